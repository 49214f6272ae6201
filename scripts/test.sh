#!/usr/bin/env bash
# Installs everything the tests need, then runs the whole suite. CI runs exactly this.
# --durations=25: the slowest tests are printed at the end, so the suite's cost stays visible.
# With no arguments the suite runs in two passes that together select every test once (tests/test_tiers.py
# holds the partition): the tests that start at most one private server, OVS or loop device, on two
# pytest-xdist workers (they wait more than they compute; a module stays on one worker), then the lab, guests,
# deploy roots, crash harness, clusters, namespaced daemons and whole agents in one process (CPU-bound TCG
# guests, host-wide locks). Both passes always run; the script fails if either does.
# With arguments (a path, -m, -k, -x ...) it is one pytest run with them, as scripts/test-fast.sh uses it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest --durations=25 "$@"
fi
rc=0
.venv/bin/python -m pytest --durations=25 -m "not lab and not deploy and not crash and not fleet and not libvirtd and not netns and not agent" -n "${GPUAAS_TEST_WORKERS:-2}" --dist loadfile || rc=$?
.venv/bin/python -m pytest --durations=25 -m "lab or deploy or crash or fleet or libvirtd or netns or agent" || rc=$((rc == 0 ? $? : rc))
exit "$rc"
