"""Guest vs. bare metal on a real HGX host: NCCL (NVLink/PCIe, and IB to a peer) and vLLM, as ratios of one run.

docs/performance.md (targets) asks that a slice run within 5 % of bare metal on NCCL/IB and inference (seed 004's
comparison). CI has no GPU host, so this script is what an operator runs on one (docs/hgx.md
"Measuring a slice"). Both sides are measured in the same invocation, on the same host and the same
GPU model, so the ratio compares like with like:

* **bare metal**: the workloads on GPUs the host still drives (``--host-gpus``: e.g. the four GPUs of
  a partition no slice holds; ``CUDA_VISIBLE_DEVICES``), run here;
* **guest**: the same workloads inside a provisioned slice (``--guest user@10.100.0.12``), run over SSH.

Workloads (each skipped with a note when its tool is not installed on a side):

* ``nccl``: nccl-tests ``all_reduce_perf -b 8M -e 8G -f 2 -g N``; the figure is its
  ``# Avg bus bandwidth`` (GB/s). Inside one partition this is NVLink through the NVSwitches; a guest
  without an activated partition falls back to PCIe and shows it here.
* ``ib``: perftest ``ib_write_bw --report_gbits`` against ``--ib-peer`` (a host running
  ``ib_write_bw -d DEV`` as server, started here over SSH); the figure is the average Gb/s. The guest
  side uses its SR-IOV VF, the host side the PF of the same ConnectX-7.
* ``vllm``: ``vllm bench throughput`` with ``--model`` (a local path: nothing is downloaded), the
  figure its output tokens/s.

Read-only for the host: it starts no service, changes no GPU, FM or NIC setting, binds no driver.
Prints one line per workload: bare metal, guest, ratio (guest / bare metal) and whether it meets 0.95.

    python bench/bench_guest_perf.py --guest ubuntu@10.100.0.12 --host-gpus 4,5,6,7 --gpus 4 \\
        --model /models/Llama-3.1-8B-Instruct [--ib-peer root@10.0.0.2 --ib-dev mlx5_0 --guest-ib-dev mlx5_0]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

TARGET_RATIO = 0.95
TIMEOUT_S = 1800

_NCCL_BUSBW = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.]+)")
_IB_ROW = re.compile(r"^\s*\d+\s+\d+\s+[0-9.]+\s+([0-9.]+)\s+[0-9.]+\s*$", re.M)
_VLLM = re.compile(r"Throughput:.*?([0-9.]+)\s+output tokens/s")


def nccl_busbw(text: str) -> float | None:
    """nccl-tests' summary line ``# Avg bus bandwidth    : 187.52``."""
    m = _NCCL_BUSBW.search(text)
    return float(m.group(1)) if m else None


def ib_average_gbits(text: str) -> float | None:
    """perftest's result row ``#bytes #iterations BW peak BW average MsgRate`` (the last row, largest size)."""
    rows = _IB_ROW.findall(text)
    return float(rows[-1]) if rows else None


def vllm_output_tokens(text: str) -> float | None:
    """``Throughput: 12.3 requests/s, 9876.5 total tokens/s, 4321.0 output tokens/s``."""
    m = _VLLM.search(text)
    return float(m.group(1)) if m else None


@dataclass(frozen=True)
class Side:
    name: str
    ssh: str | None  # None: here
    env: dict[str, str]

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        if self.ssh is None:
            return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  env={**os.environ, **self.env})
        remote = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), *map(shlex.quote, argv)])
        return subprocess.run(["ssh", "-o", "BatchMode=yes", self.ssh, remote], capture_output=True, text=True,
                              timeout=TIMEOUT_S)

    def has(self, tool: str) -> bool:
        return self.run(["sh", "-c", f"command -v {shlex.quote(tool)}"]).returncode == 0


def measure(side: Side, workload: str, args: argparse.Namespace) -> tuple[float | None, str]:
    if workload == "nccl":
        if not side.has("all_reduce_perf"):
            return None, "all_reduce_perf (nccl-tests) not installed"
        done = side.run(["all_reduce_perf", "-b", "8M", "-e", "8G", "-f", "2", "-g", str(args.gpus)])
        return nccl_busbw(done.stdout), done.stderr[-300:]
    if workload == "ib":
        if args.ib_peer is None or not side.has("ib_write_bw"):
            return None, "no --ib-peer, or ib_write_bw (perftest) not installed"
        peer = Side("peer", args.ib_peer, {})
        server = subprocess.Popen(["ssh", "-o", "BatchMode=yes", args.ib_peer,
                                   f"timeout 120 ib_write_bw -d {shlex.quote(args.ib_peer_dev)} --report_gbits"])
        try:
            dev = args.guest_ib_dev if side.ssh else args.ib_dev
            done = side.run(["ib_write_bw", "-d", dev, "--report_gbits", args.ib_peer_addr or peer.ssh.split("@")[-1]])
        finally:
            server.terminate()
            server.wait(timeout=30)
        return ib_average_gbits(done.stdout), done.stderr[-300:]
    if workload == "vllm":
        if args.model is None or not side.has("vllm"):
            return None, "no --model, or vllm not installed"
        done = side.run(["vllm", "bench", "throughput", "--model", args.model, "--tensor-parallel-size",
                         str(args.gpus), "--input-len", "1024", "--output-len", "256", "--num-prompts", "500"])
        return vllm_output_tokens(done.stdout), done.stderr[-300:]
    raise ValueError(workload)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guest", required=True, help="user@address of the slice guest (SSH, key auth)")
    parser.add_argument("--host-gpus", required=True, help="CUDA_VISIBLE_DEVICES of the bare-metal side")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per side (the slice's size)")
    parser.add_argument("--model", help="a local model path for vLLM (nothing is downloaded)")
    parser.add_argument("--ib-peer", help="user@address of an IB peer host that runs the ib_write_bw server")
    parser.add_argument("--ib-peer-addr", help="the peer's address on the IB fabric (default: --ib-peer's host)")
    parser.add_argument("--ib-peer-dev", default="mlx5_0")
    parser.add_argument("--ib-dev", default="mlx5_0", help="the bare-metal side's RDMA device")
    parser.add_argument("--guest-ib-dev", default="mlx5_0", help="the guest's RDMA device (its VF)")
    parser.add_argument("--workloads", default="nccl,ib,vllm")
    args = parser.parse_args()
    host = Side("bare metal", None, {"CUDA_VISIBLE_DEVICES": args.host_gpus})
    guest = Side("guest", args.guest, {})
    print(f"{'workload':10} {'bare metal':>12} {'guest':>12} {'ratio':>7}  meets {TARGET_RATIO}")
    for workload in args.workloads.split(","):
        base, base_note = measure(host, workload, args)
        got, got_note = measure(guest, workload, args)
        if base is None or got is None:
            print(f"{workload:10} skipped: {base_note if base is None else got_note}".rstrip())
            continue
        ratio = got / base
        print(f"{workload:10} {base:12.2f} {got:12.2f} {ratio:7.3f}  {'yes' if ratio >= TARGET_RATIO else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
