"""Handover cost on a real NVMe controller (QEMU's, in a TCG lab guest): Format NVM (user-data erase) and
Write Zeroes (nvme-cli), each with the proof the agent gives it, against reading the whole namespace once with ``dd``
inside the same guest, in one run.

The agent's ``nvme_erase`` runs here and sends its nvme-cli argv into the guest (lab/nvme_guest.py);
the proof's reads run in the guest too, so all three figures share one emulated device and one CPU.
QEMU 7.2 implements Format NVM but no Sanitize, so Sanitize is not measured (its refusal is tested in
tests/host/storage/test_nvme_guest.py). TCG makes every figure slow in absolute terms: read the ratios.
Prints medians and what a 3.84 TB namespace would take at the measured rate; never asserts a time.
Run as root: ``.venv/bin/python bench/bench_wipe_nvme.py [--size-mib 256] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuaas_agent.contract.nvmewipe import FormatErase, WipeMethod, WipePolicy
from gpuaas_agent.host.storage.nvmewipe import nvme_erase
from lab import nvme_guest

DEV = "/dev/nvme0n1"
PATTERN = b"tenant data \xa5" * 4096


def _fill(backing: Path) -> None:
    size = backing.stat().st_size
    with open(backing, "r+b") as fh:
        for _ in range(size // len(PATTERN)):
            fh.write(PATTERN)


async def _timed(coro) -> float:
    started = time.perf_counter()
    await coro
    return time.perf_counter() - started


async def _zeroout(run) -> None:
    """Write Zeroes over the whole namespace with nvme-cli (the guest's busybox blkdiscard has no --zeroout):
    one command per 65,536 blocks, the most one Write Zeroes carries (NLB is 16 bits)."""
    doc = json.loads((await run(["nvme", "id-ns", DEV, "--output-format=json"], timeout=60)).stdout)
    blocks = int(doc["nsze"])
    for start in range(0, blocks, 65536):
        count = min(65536, blocks - start)
        await run(["nvme", "write-zeroes", DEV, f"--start-block={start}", f"--block-count={count - 1}"],
                  timeout=600)


async def main_async(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="gpuaas-bench-nvme-"))
    guest = nvme_guest.boot_nvme_guest(work, backing_mib=args.size_mib)
    reads, formats, zeroouts = [], [], []
    try:
        conn = await nvme_guest.connect(guest)
        run = nvme_guest.guest_runner(conn)
        wwid = (await run(["cat", "/sys/block/nvme0n1/wwid"], timeout=60)).stdout.decode().strip()
        policy = WipePolicy(method=WipeMethod.nvme_format, format_erase=FormatErase.user_data)
        read = ["dd", f"if={DEV}", "of=/dev/null", "bs=8M", "iflag=direct"]
        for _ in range(args.runs):
            _fill(guest.backing)
            reads.append(await _timed(run(read, timeout=3600)))
            _fill(guest.backing)
            # Format's user-data erase: the namespace reads zero after it (DLFEAT=1), so its proof samples.
            formats.append(await _timed(nvme_erase(DEV, nsid=1, lease_identity=f"wwid:{wwid}", policy=policy,
                                                   by_id="/dev/disk/by-id/nvme-lab", runner=run)))
            _fill(guest.backing)
            zeroouts.append(await _timed(_zeroout(run)))
        conn.close()
    finally:
        guest.stop()
        shutil.rmtree(work, ignore_errors=True)
    size = args.size_mib << 20
    read = statistics.median(reads)
    print(f"QEMU {nvme_guest.qemu_version()} emulated NVMe, TCG guest, {args.size_mib} MiB namespace, "
          f"{args.runs} runs (medians)")
    print(f"whole-namespace read (dd iflag=direct, in the guest): {read:7.3f} s  {size / read / 1e6:8.1f} MB/s")
    for name, values in (("nvme format --ses=1", formats), ("nvme write-zeroes", zeroouts)):
        t = statistics.median(values)
        print(f"{name:22s}: {t:7.3f} s  ratio to one read {t / read:5.2f}x  "
              f"3.84 TB at this rate: {3.84e12 / (size / t) / 60:8.1f} min")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
