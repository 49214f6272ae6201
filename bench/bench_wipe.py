"""Handover cost per wipe method: ``wipe_slot_disk`` (guard, erase, signature probes, the proof the method's
guarantee needs) against reading the whole device once with ``dd iflag=direct``, in the same run.

Methods: ``zeroout`` (Write Zeroes, sampled proof: the device's guarantee covers every byte) and
``discard`` (advisory, so the proof reads every byte back). Target: a loop device (``--direct-io=on``)
over a sparse file on this machine's disk behind a ``/dev/disk/by-id/gpuaas-test-*`` link, filled with
data before every run. NVMe Format/Sanitize need an NVMe drive (on a host: the same ratio applies to
the whole-device read their proof adds when the namespace does not promise zeroes).

Prints medians of interleaved runs, the ratio to one whole-device read, and what a 3.84 TB NVMe would
take per method at the measured throughput (an operator's estimate: size / measured bytes-per-second);
never asserts a time. Needs root.
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

from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.host.run import run
from gpuaas_agent.host.storage.wipepolicy import wipe_slot_disk
from gpuaas_agent.hostfs import HostRoot
from tests.support.realdev import RealDevices

LIVE = HostRoot.open("/")


def _fill(dev: str, size_mib: int) -> None:
    asyncio.run(run(["dd", "if=/dev/zero", f"of={dev}", "bs=4M", f"count={size_mib // 4}", "oflag=direct", "status=none"], timeout=3600))
    # a GPT and an ext4 so wipefs and the probes have work to do
    asyncio.run(run(["sfdisk", "-q", "--no-reread", dev], stdin=b"label: gpt\n,\n", timeout=60))
    asyncio.run(run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", dev], timeout=600))


def _read_once(dev: str, size_mib: int) -> float:
    start = time.perf_counter()
    asyncio.run(run(["dd", f"if={dev}", "of=/dev/null", "bs=8M", f"count={size_mib // 8}", "iflag=direct",
                     "status=none"], timeout=3600))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--policy", action="append", choices=["discard", "zeroout"],
                        help="methods to measure (default: both)")
    args = parser.parse_args()
    policies = args.policy or ["zeroout", "discard"]
    if os.geteuid() != 0:
        sys.exit("bench_wipe needs root (losetup, /dev/disk/by-id)")
    reads: list[float] = []
    wipes: dict[str, list[float]] = {p: [] for p in policies}
    guarantees: dict[str, set[str]] = {p: set() for p in policies}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpuaas-bench-") as tmp:
        devices = RealDevices(Path(tmp))
        try:
            disk = devices.disk(args.size_mib, direct_io=True)
            for _ in range(args.runs):
                _fill(disk.dev, args.size_mib)
                reads.append(_read_once(disk.dev, args.size_mib))
                for policy in policies:
                    _fill(disk.dev, args.size_mib)
                    start = time.perf_counter()
                    proof = asyncio.run(wipe_slot_disk(WipePolicy(method=WipeMethod(policy)), LIVE, disk.by_id,
                                                       lease=disk.lease(), samples=args.samples))
                    wipes[policy].append(time.perf_counter() - start)
                    assert proof.verified and proof.covers_every_byte
                    guarantees[policy].add(f"{proof.method.value}/{proof.guarantee.value}")
        finally:
            devices.close()
    size = args.size_mib * (1 << 20)
    read = statistics.median(reads)
    print(f"device: loop --direct-io=on over {args.dir}, {args.size_mib} MiB, {args.runs} runs (medians)")
    print(f"whole-device read (dd iflag=direct): {read:7.3f} s  {size / read / 1e6:8.1f} MB/s")
    for policy in policies:
        t = statistics.median(wipes[policy])
        per_tb = 3.84e12 / (size / t)
        print(f"wipe+proof {policy:8s}: {t:7.3f} s  ratio to one read {t / read:5.2f}x  "
              f"({','.join(sorted(guarantees[policy]))})  3.84 TB at this rate: {per_tb / 60:7.1f} min")


if __name__ == "__main__":
    main()
