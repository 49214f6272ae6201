#!/usr/bin/env bash
# README command 1: the lab-in-a-box on the bundled 8x H200 host (run as root on Debian 12 / Ubuntu 24.04).
# Real nats-server + test control plane, real OVS (netdev datapath), dnsmasq, a libvirt daemon, and the
# agent on the recorded host whose slot disks are loop devices; two slices are provisioned as real TCG
# guests, one released, then reconcile. Everything it starts is stopped again, also on failure.
# GPUAAS_LAB_HOST=<host root dir> picks another host (default: the 8x H200 fixture host, materialised by
# lab/fixture_hosts.py); extra arguments go to lab/run_lab.py (--keep).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
root=${GPUAAS_LAB_HOST:-$(.venv/bin/python -m lab.fixture_hosts h200-slice-after-transition)}
echo "== gpuaas-agent discover --root $root"
.venv/bin/gpuaas-agent discover --root "$root"
mkdir -p out
.venv/bin/gpuaas-agent discover --root "$root" --json > out/topology.json
echo "== full report: out/topology.json"
exec .venv/bin/python lab/run_lab.py --fixture "$root" "$@"
