#!/usr/bin/env bash
# The fast tier: every test that needs no lab, guest, deploy root, crash harness, cluster, namespaced daemons
# or whole agent, and is not on the measured slow list (markers set in tests/conftest.py from each test's
# fixtures; docs/testing.md). Sets itself up like scripts/test.sh; extra arguments go to pytest (-x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/test.sh -m "not lab and not deploy and not crash and not fleet and not libvirtd and not netns and not agent and not slow" "$@"
