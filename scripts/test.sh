#!/usr/bin/env bash
# Installs everything the tests need, then runs the whole suite. CI runs exactly this.
# --durations=25: the slowest tests are printed at the end, so the suite's cost stays visible.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest --durations=25 "$@"
