#!/usr/bin/env bash
# Installs everything the tests need, then runs the whole suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
