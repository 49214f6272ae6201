#!/usr/bin/env bash
# The main job on the bundled default host: discovery of the recorded 8x H200 slice host.
# (The full lab-in-a-box — NATS, OVS, dnsmasq, libvirt guests — grows here as those rooms land.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
root=${GPUAAS_LAB_HOST:-fixtures/hosts/h200-slice-after-transition}
echo "== gpuaas-agent discover --root $root"
.venv/bin/gpuaas-agent discover --root "$root"
mkdir -p out
.venv/bin/gpuaas-agent discover --root "$root" --json > out/topology.json
echo "== full report: out/topology.json"
