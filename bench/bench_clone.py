"""Clone speed as ratios against ``dd bs=4M oflag=direct`` measured in the same run (docs/performance.md).

Target: a loop device (``--direct-io=on``) over a sparse file on this machine's
disk, behind a ``/dev/disk/by-id/gpuaas-test-*`` link, so the agent's real
path runs (guard, exclusive hold, qemu-img). Needs root.

1. dense: the same fully-written raw image onto the same target, ``clone_image``
   vs dd of the raw bytes (goal >= 0.95x dd's throughput);
2. sparse: an image with ~1/8 data onto a freshly wiped target, ``clone_image``
   with the wipe proof (``--target-is-zero``) vs dd of the whole raw image (goal >= 2x).

Source images are read once beforehand so both sides read from the page cache.
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

from gpuaas_agent.host.images.clone import clone_image
from gpuaas_agent.host.run import run
from gpuaas_agent.host.storage.blockwipe import wipe_disk
from gpuaas_agent.hostfs import HostRoot
from tests.support.realdev import MiB, RealDevices

LIVE = HostRoot.open("/")


def _write_image(path: Path, size_mib: int, *, every: int) -> None:
    """Raw file with a distinct 1 MiB random-ish block at every ``every``-th MiB; holes elsewhere."""
    block = os.urandom(MiB)
    with open(path, "wb") as fh:
        fh.truncate(size_mib * MiB)
        for i in range(0, size_mib, every):
            fh.seek(i * MiB)
            fh.write(i.to_bytes(8, "little") + block[8:])


def _warm(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(16 * MiB):
            pass


def _timed(coro_fn) -> float:
    start = time.perf_counter()
    asyncio.run(coro_fn())
    return time.perf_counter() - start


async def _dd(raw: Path, dev: str) -> None:
    await run(["dd", f"if={raw}", f"of={dev}", "bs=4M", "oflag=direct", "conv=notrunc", "status=none"], timeout=3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp", help="where the image and the loop backing file live")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_clone needs root (losetup, /dev/disk/by-id)")
    size = args.size_mib
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gpuaas-bench-") as tmp:
        tmp_path = Path(tmp)
        devices = RealDevices(tmp_path)
        try:
            disk = devices.disk(size, direct_io=True)
            lease = disk.lease()
            dense = tmp_path / "dense.raw"
            sparse = tmp_path / "sparse.raw"
            _write_image(dense, size, every=1)
            _write_image(sparse, size, every=8)
            _warm(dense)
            _warm(sparse)

            dd_dense, clone_dense = [], []
            for _ in range(args.runs):
                dd_dense.append(_timed(lambda: _dd(dense, disk.dev)))
                clone_dense.append(_timed(lambda: clone_image(LIVE, str(dense), disk.by_id, lease=lease)))

            dd_sparse, clone_sparse, wipe_s = [], [], []
            for _ in range(args.runs):
                dd_sparse.append(_timed(lambda: _dd(sparse, disk.dev)))
                start = time.perf_counter()
                proof = asyncio.run(wipe_disk(LIVE, disk.by_id, lease=lease))
                wipe_s.append(time.perf_counter() - start)
                result = None

                async def clone_zero():
                    nonlocal result
                    result = await clone_image(LIVE, str(sparse), disk.by_id, lease=lease, wipe_proof=proof)

                clone_sparse.append(_timed(clone_zero))
                assert result is not None and result.target_is_zero
        finally:
            devices.close()

    def mibs(seconds: list[float]) -> float:
        return size / statistics.median(seconds)

    print(f"target: loop device (--direct-io=on) over a sparse file in {args.dir} on this VM's disk; "
          f"image {size} MiB; medians of {args.runs} interleaved runs")
    print(f"dense  raw   dd bs=4M oflag=direct: {statistics.median(dd_dense):7.3f} s  {mibs(dd_dense):8.1f} MiB/s")
    print(f"dense  raw   clone_image:           {statistics.median(clone_dense):7.3f} s  {mibs(clone_dense):8.1f} MiB/s")
    print(f"dense  ratio clone/dd throughput:   {statistics.median(dd_dense) / statistics.median(clone_dense):.2f}x (goal >= 0.95x)")
    print(f"sparse 1/8   dd bs=4M oflag=direct: {statistics.median(dd_sparse):7.3f} s")
    print(f"sparse 1/8   clone --target-is-zero:{statistics.median(clone_sparse):7.3f} s  (after a wipe of {statistics.median(wipe_s):.3f} s, not counted)")
    print(f"sparse ratio clone/dd speed:        {statistics.median(dd_sparse) / statistics.median(clone_sparse):.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
