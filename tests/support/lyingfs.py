"""A disk that acknowledges a discard but keeps the data in chosen ranges: a real FUSE file system.

NVMe Deallocate (``blkdiscard``) is a hint a controller may honour in part. This
file system serves one file, ``disk.img``, over a real backing file; a loop
device over it is a real block device whose discards reach :meth:`fallocate`
as ``FALLOC_FL_PUNCH_HOLE``. Hole punching answers success everywhere but
leaves the ``--keep OFFSET:LENGTH`` ranges untouched, as such a controller
would. Write Zeroes (``blkdiscard --zeroout``: the loop driver sends
``FALLOC_FL_ZERO_RANGE``, the kernel's NOUNMAP) is honoured: its post-condition
is one a device must keep.

Run as its own process (``python -m tests.support.lyingfs MOUNTPOINT BACKING
--keep 0x100000:65536 ...``); :class:`LyingDisk` mounts it, puts a loop device
over it and undoes both by PID and name. The kernel has FUSE but no
device-mapper, nbd or ublk on these machines: this is the real-device way to
make a block device lie.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from tests.support.daemons import stop_pid
from tests.support.tiers import starts

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
NAME = "disk.img"


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) (Python's os module has posix_fallocate only, which cannot punch or zero a range)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _subtract(start: int, end: int, keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) minus every kept range, as (offset, length) pieces."""
    pieces = [(start, end)]
    for k_off, k_len in keep:
        k_end = k_off + k_len
        out = []
        for a, b in pieces:
            if k_end <= a or k_off >= b:
                out.append((a, b))
                continue
            if a < k_off:
                out.append((a, k_off))
            if k_end < b:
                out.append((k_end, b))
        pieces = out
    return [(a, b - a) for a, b in pieces if b > a]


def serve(mountpoint: str, backing: str, keep: list[tuple[int, int]], *, lie_zeroout: bool = False) -> None:
    import mfusepy as fuse

    class LyingFS(fuse.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.fd = os.open(backing, os.O_RDWR | os.O_CLOEXEC)
            self.punched: list[tuple[int, int]] = []

        def getattr(self, path, fh=None):
            if path == "/":
                return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
            if path != "/" + NAME:
                raise fuse.FuseOSError(errno.ENOENT)
            st = os.fstat(self.fd)
            return {"st_mode": stat.S_IFREG | 0o600, "st_nlink": 1, "st_size": st.st_size,
                    "st_blocks": st.st_blocks, "st_mtime_ns": st.st_mtime_ns}

        def readdir(self, path, fh):
            return [".", "..", NAME]

        def open(self, path, flags):
            if path != "/" + NAME:
                raise fuse.FuseOSError(errno.ENOENT)
            return 0

        def read(self, path, size, offset, fh):
            return os.pread(self.fd, size, offset)

        def write(self, path, data, offset, fh):
            return os.pwrite(self.fd, data, offset)

        def truncate(self, path, length, fh=None):
            os.ftruncate(self.fd, length)

        def flush(self, path, fh):
            return 0

        def fsync(self, path, datasync, fh):
            os.fsync(self.fd)
            return 0

        def fallocate(self, path, mode, offset, size, fh):
            if mode & FALLOC_FL_PUNCH_HOLE:
                # Acknowledged whole; carried out only outside the kept ranges.
                for off, length in _subtract(offset, offset + size, keep):
                    _fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length)
                return 0
            if mode & FALLOC_FL_ZERO_RANGE:
                # ``--lie-zeroout``: a device that breaks even Write Zeroes' contract in the kept ranges.
                pieces = _subtract(offset, offset + size, keep) if lie_zeroout else [(offset, size)]
                for off, length in pieces:
                    _fallocate(self.fd, FALLOC_FL_ZERO_RANGE | (mode & FALLOC_FL_KEEP_SIZE), off, length)
                return 0
            os.posix_fallocate(self.fd, offset, size)
            return 0

        def statfs(self, path):
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 20, "f_bfree": 1 << 19,
                    "f_bavail": 1 << 19, "f_namemax": 255}

    fuse.FUSE(LyingFS(), mountpoint, foreground=True, nothreads=True, allow_other=False, default_permissions=False)


def _range(text: str) -> tuple[int, int]:
    off, length = text.split(":", 1)
    return int(off, 0), int(length, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mountpoint")
    parser.add_argument("backing")
    parser.add_argument("--keep", type=_range, action="append", default=[])
    parser.add_argument("--lie-zeroout", action="store_true")
    args = parser.parse_args(argv)
    serve(args.mountpoint, args.backing, args.keep, lie_zeroout=args.lie_zeroout)
    return 0


@starts()
class LyingDisk:
    """The file system mounted, a loop device over its file; :meth:`close` undoes both (by PID and name)."""

    def __init__(self, tmp: Path, size: int, keep: list[tuple[int, int]], *, lie_zeroout: bool = False) -> None:
        from tests.support.realdev import sh

        self._sh = sh
        self.mountpoint = tmp / "lyingfs"
        self.mountpoint.mkdir()
        self.backing = tmp / "lyingfs-backing.img"
        with open(self.backing, "wb") as fh:
            fh.truncate(size)
        argv = [sys.executable, "-m", "tests.support.lyingfs", str(self.mountpoint), str(self.backing)]
        for off, length in keep:
            argv += ["--keep", f"{off}:{length}"]
        if lie_zeroout:
            argv.append("--lie-zeroout")
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(argv, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.file = self.mountpoint / NAME
        deadline = time.monotonic() + 15
        while not os.path.ismount(self.mountpoint) or not self.file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"lyingfs exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("lyingfs did not mount within 15 s")
            time.sleep(0.02)
        self.dev = ""
        self.dev = sh("losetup", "--find", "--show", str(self.file)).strip()

    def close(self) -> None:
        if self.dev:
            self._sh("losetup", "-d", self.dev, check=False)
            self.dev = ""
        if os.path.ismount(self.mountpoint):
            self._sh("umount", "-l", str(self.mountpoint), check=False)
        stop_pid(self.proc, 10)


if __name__ == "__main__":
    sys.exit(main())
