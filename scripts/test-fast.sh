#!/usr/bin/env bash
# The fast tier: every test that needs no lab, guest, deploy root, crash harness, cluster, namespaced daemons
# or whole agent, and is not on the measured slow list (markers set in tests/conftest.py from each test's
# fixtures; docs/testing.md). Sets itself up like scripts/test.sh; extra arguments go to pytest (-x, -k NAME).
# Two pytest-xdist workers: its tests start their own servers, ports and temporary directories, and one
# process keeps a 2-core machine only ~0.8 busy (GPUAAS_TEST_WORKERS=0 runs them in one process, for -x or pdb).
# --dist loadfile: a module's tests stay on one worker, so a module-scoped server starts once, not per worker.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/test.sh -m "not lab and not deploy and not crash and not fleet and not libvirtd and not netns and not agent and not slow" -n "${GPUAAS_TEST_WORKERS:-2}" --dist loadfile "$@"
