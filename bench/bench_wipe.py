"""Wipe cost: ``wipe_slot_disk`` with a policy (``--policy``; guard, blkdiscard, wipefs, rereadpt, signature probes, sampled read-back)
vs a bare ``blkdiscard`` of the same target, measured in the same run.

Target: a loop device (``--direct-io=on``) over a sparse file on this machine's
disk behind a ``/dev/disk/by-id/gpuaas-test-*`` link; the disk is filled with
data before every run so each wipe has something to discard. Needs root.
Prints medians of interleaved runs; never asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuaas_agent.contract.nvmewipe import WipePolicy, WipePolicyMethod
from gpuaas_agent.host.run import run
from gpuaas_agent.host.wipepolicy import wipe_slot_disk
from gpuaas_agent.hostfs import HostRoot
from tests.realdev import RealDevices

LIVE = HostRoot.open("/")


def _fill(dev: str, size_mib: int) -> None:
    asyncio.run(run(["dd", "if=/dev/zero", f"of={dev}", "bs=4M", f"count={size_mib // 4}", "oflag=direct", "status=none"], timeout=3600))
    # a GPT and an ext4 so wipefs and the probes have work to do
    asyncio.run(run(["sfdisk", "-q", "--no-reread", dev], stdin=b"label: gpt\n,\n", timeout=60))
    asyncio.run(run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", dev], timeout=600))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--policy", choices=["discard", "zeroout"], default="discard",
                        help="wipe policy of the measured wipe (NVMe methods need an NVMe drive)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_wipe needs root (losetup, /dev/disk/by-id)")
    bare, full, methods = [], [], set()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpuaas-bench-") as tmp:
        devices = RealDevices(Path(tmp))
        try:
            disk = devices.disk(args.size_mib, direct_io=True)
            for _ in range(args.runs):
                _fill(disk.dev, args.size_mib)
                start = time.perf_counter()
                asyncio.run(run(["blkdiscard", disk.dev], timeout=3600))
                bare.append(time.perf_counter() - start)
                _fill(disk.dev, args.size_mib)
                start = time.perf_counter()
                proof = asyncio.run(wipe_slot_disk(WipePolicy(method=WipePolicyMethod(args.policy)), LIVE, disk.by_id,
                                                   lease=disk.lease(), samples=args.samples))
                full.append(time.perf_counter() - start)
                assert proof.verified
                methods.add(proof.method.value)
        finally:
            devices.close()
    b, f = statistics.median(bare), statistics.median(full)
    print(f"target: loop device (--direct-io=on) over a sparse file in {args.dir} on this VM's disk; "
          f"{args.size_mib} MiB; medians of {args.runs} interleaved runs")
    print(f"bare blkdiscard:                 {b:7.3f} s")
    print(f"wipe_slot_disk({args.policy}) + verify ({args.samples}+2 samples): {f:7.3f} s  method={','.join(sorted(methods))}")
    print(f"ratio wipe+verify / blkdiscard:  {f / b:.2f}x  (overhead {f - b:+.3f} s)")


if __name__ == "__main__":
    main()
