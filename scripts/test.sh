#!/usr/bin/env bash
# Installs everything the tests need, then runs the whole suite. CI runs exactly this.
# --durations=25: the slowest tests are printed at the end, so the suite's cost stays visible.
# With no arguments the suite runs in two passes that together select every test once (tests/test_tiers.py
# holds the partition): the tests that start at most one private server, OVS or loop device, on two
# pytest-xdist workers (they wait more than they compute; a module stays on one worker), then the lab, guests,
# deploy roots, crash harness, clusters, namespaced daemons and whole agents in one process (CPU-bound TCG
# guests, host-wide locks), with the deploy tests that need none of those beside it in a second process (the
# deploy lane: chroots, dpkg and the .deb, which wait on apt and dpkg; its output is printed after the serial
# lane's). Both passes and both lanes always run; the script fails if any does.
# GPUAAS_TEST_PASSES=serial runs the second pass only (both lanes), =parallel the first only.
# With arguments (a path, -m, -k, -x ...) it is one pytest run with them, as scripts/test-fast.sh uses it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest --durations=25 "$@"
fi
passes="${GPUAAS_TEST_PASSES:-parallel serial}"
rc=0
if [[ " $passes " == *" parallel "* ]]; then
    .venv/bin/python -m pytest --durations=25 -m "not lab and not deploy and not crash and not fleet and not libvirtd and not netns and not agent" -n "${GPUAAS_TEST_WORKERS:-2}" --dist loadfile || rc=$?
fi
if [[ " $passes " == *" serial "* ]]; then
    lane_log="$(mktemp /tmp/gpuaas-deploy-lane.XXXXXX.log)"
    # Its own process group (set -m) so that it keeps SIGINT (a background job of a script ignores it), and
    # an interrupt of the script reaches it as a Ctrl-C: pytest then tears its fixtures down (chroot mounts).
    set -m
    .venv/bin/python -m pytest --durations=25 -m "deploy and not lab and not crash and not fleet and not libvirtd and not netns and not agent" >"$lane_log" 2>&1 &
    lane=$!
    set +m
    trap 'kill -INT "$lane" 2>/dev/null || true; wait "$lane" 2>/dev/null || true' INT TERM
    .venv/bin/python -m pytest --durations=25 -m "lab or crash or fleet or libvirtd or netns or agent" || rc=$((rc == 0 ? $? : rc))
    lane_rc=0
    wait "$lane" || lane_rc=$?
    trap - INT TERM
    echo "==================== the deploy lane (ran beside the serial lane; log $lane_log) ===================="
    cat "$lane_log"
    if [ "$lane_rc" -ne 0 ] && [ "$rc" -eq 0 ]; then
        rc=$lane_rc
    fi
fi
exit "$rc"
