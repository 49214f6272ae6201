"""Real block devices for tests: loop disks over sparse files, GPT partitions, mounts, swap, dm, by-id links.

Import the fixtures into a test module (``from tests.support.realdev import loop_disks``).
Everything made is undone in reverse order at teardown, by name (never
"all loop devices"). There is no udev on CI: the by-id link is created by hand in
the real ``/dev/disk/by-id`` as ``gpuaas-test-<uuid> -> ../../loopN``.
Tests that use these fixtures need root and FAIL (not skip) without it.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuaas_agent.contract.storage import DiskLease
from gpuaas_agent.host.run import run
from tests.support.tiers import starts

BY_ID_DIR = Path("/dev/disk/by-id")
MiB = 1 << 20


def sh(*argv: str, timeout: float = 120, check: bool = True) -> str:
    """Run a setup command through the agent's runner (argv, deadline, no shell)."""
    return asyncio.run(run(list(argv), timeout=timeout, check=check)).stdout.decode()


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("real-device tests need root (losetup, mount, /dev/disk/by-id); run them as root", pytrace=False)



@dataclass
class LoopDisk:
    image: Path
    dev: str  # /dev/loopN
    by_id: str  # /dev/disk/by-id/gpuaas-test-<uuid>
    partitions: list[str] = field(default_factory=list)  # /dev/loopNpM

    @property
    def name(self) -> str:
        return os.path.basename(self.dev)

    def lease(self, slot_index: int = 0) -> DiskLease:
        return DiskLease(allocation_id=str(uuid.uuid4()), slot_index=slot_index, nvme_device=self.by_id,
                         disk_identity=self.identity)

    @property
    def identity(self) -> str:
        """What the guard compares: a loop device has no namespace id, so its major:minor."""
        from gpuaas_agent.guards.disk import read_disk_identity
        from gpuaas_agent.hostfs import HostRoot

        return read_disk_identity(HostRoot.open("/"), self.by_id)


class RealDevices:
    """Makes loop disks and the things that use them; undoes it all in reverse order."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def _push(self, what: str, undo: Callable[[], None]) -> None:
        self._undo.append((what, undo))

    def disk(
        self, size_mib: int = 64, *, partitions_mib: list[int] | None = None, link: bool = True, direct_io: bool = False
    ) -> LoopDisk:
        """A loop disk over a sparse file; ``direct_io`` makes the loop bypass the page cache (benchmarks)."""
        image = self.tmp / f"disk-{uuid.uuid4().hex[:8]}.img"
        with open(image, "wb") as fh:
            fh.truncate(size_mib * MiB)
        extra = ["--direct-io=on"] if direct_io else []
        dev = sh("losetup", "--find", "--show", "-P", *extra, str(image)).strip()
        self._push(f"losetup -d {dev}", lambda: sh("losetup", "-d", dev))
        disk = LoopDisk(image=image, dev=dev, by_id="")
        if partitions_mib:
            script = "label: gpt\n" + "".join(f",{n}M\n" for n in partitions_mib)
            asyncio.run(run(["sfdisk", "-q", "--no-reread", dev], stdin=script.encode(), timeout=60))
            sh("partx", "-u", dev, check=False)
            disk.partitions = [f"{dev}p{i + 1}" for i in range(len(partitions_mib))]
            for part in disk.partitions:
                if not os.path.exists(part):
                    sh("partx", "-a", dev, check=False)
                    break
            _wait_for(lambda: all(os.path.exists(p) for p in disk.partitions), f"partition nodes of {dev}")
        if link:
            disk.by_id = self.by_id_link(f"../../{disk.name}")
        return disk

    def by_id_link(self, target: str) -> str:
        """A link ``/dev/disk/by-id/gpuaas-test-<uuid>`` with any (even broken) target."""
        if not BY_ID_DIR.is_dir():
            BY_ID_DIR.mkdir(parents=True)
            self._push(f"rmdir {BY_ID_DIR}", lambda: _rmdir_if_empty(BY_ID_DIR))
        path = BY_ID_DIR / f"gpuaas-test-{uuid.uuid4()}"
        os.symlink(target, path)
        self._push(f"rm {path}", lambda: path.unlink(missing_ok=True))
        return str(path)

    def mkfs_ext4(self, part: str) -> None:
        sh("mkfs.ext4", "-q", "-F", part)

    def mount(self, part: str) -> Path:
        mountpoint = self.tmp / f"mnt-{os.path.basename(part)}"
        mountpoint.mkdir()
        sh("mount", part, str(mountpoint))
        self._push(f"umount {mountpoint}", lambda: sh("umount", str(mountpoint)))
        return mountpoint

    def swapon(self, part: str) -> None:
        sh("mkswap", "-f", part)
        sh("swapon", part)
        self._push(f"swapoff {part}", lambda: sh("swapoff", part))

    def close(self) -> None:
        errors = []
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # keep undoing the rest; report at the end
                errors.append(f"{what}: {exc}")
        if errors:
            raise RuntimeError("teardown left things behind: " + "; ".join(errors))


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # another test (or engineer) still has links there


@pytest.fixture
@starts("loopdev")
def realdev(tmp_path) -> Iterator[RealDevices]:
    """Factory of real loop disks; fails without root."""
    require_root()
    devices = RealDevices(tmp_path)
    try:
        yield devices
    finally:
        devices.close()


def read_bytes(dev: str, offset: int, length: int) -> bytes:
    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def write_bytes(dev: str, offset: int, data: bytes) -> None:
    fd = os.open(dev, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
