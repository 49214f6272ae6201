"""A recorded 8xH200 host whose slot NVMe disks are real loop devices (the lab-in-a-box's host root).

The agent reads the host through ``HostRoot``: a copy of the fixture is that root.
For each slot disk the copy is made to describe a real loop device instead of
the recorded NVMe namespace, so the agent's disk guard, clone, wipe and verify
run unchanged against a real block device:

* the namespace's sysfs ``dev`` and ``size`` carry the loop's major:minor and size;
* ``<root>/dev/<kernel name>`` becomes a block node with that major:minor (the
  guard checks the node's ``st_rdev`` against sysfs and opens it ``O_EXCL``);
* the real ``/dev/disk/by-id/<same name>`` links to ``/dev/loopN``, because
  libvirt and QEMU open the by-id path on the real host.

Everything made is undone by :meth:`LoopHost.close`, by name (never "all loop devices").
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REAL_BY_ID = Path("/dev/disk/by-id")
SECTOR = 512


def _sh(*argv: str, timeout: float = 60) -> str:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=timeout).stdout


@dataclass
class SlotDisk:
    slot_index: int
    by_id: str  # /dev/disk/by-id/nvme-eui.<...>, the same name in the fixture and on the real host
    kernel_name: str  # the fixture's name (nvme3n1): advisory, as on a real host
    loop: str  # /dev/loopN
    image: Path


@dataclass
class LoopHost:
    root: Path
    disks: list[SlotDisk] = field(default_factory=list)
    _links: list[Path] = field(default_factory=list)

    def close(self) -> list[str]:
        """Detach the loops and remove the real by-id links; returns what could not be undone."""
        problems = []
        for link in self._links:
            try:
                if link.is_symlink():
                    link.unlink()
            except OSError as exc:
                problems.append(f"{link}: {exc}")
        for disk in self.disks:
            try:
                subprocess.run(["losetup", "-d", disk.loop], check=True, capture_output=True, timeout=30)
            except (subprocess.SubprocessError, OSError) as exc:
                problems.append(f"{disk.loop}: {exc}")
            disk.image.unlink(missing_ok=True)
        self._links.clear()
        self.disks.clear()
        return problems

    def manifest(self) -> dict:
        return {"root": str(self.root), "disks": [
            {"slot_index": d.slot_index, "by_id": d.by_id, "kernel_name": d.kernel_name, "loop": d.loop}
            for d in self.disks]}


def _dev_of(path: str) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def _forget_recorded_mounts(root: Path, devs: set[str]) -> None:
    """Drop recorded mounts on the major:minor numbers the loops now have.

    The recorded host had its own loop devices (snap squashfs images on 7:N);
    those mounts describe *its* devices, not ours, and would make the guard
    refuse our disk as mounted. Only lines naming one of our numbers go.
    """
    mountinfo = root / "proc/self/mountinfo"
    lines = mountinfo.read_text().splitlines(keepends=True)
    kept = [line for line in lines if len(line.split()) < 3 or line.split()[2] not in devs]
    mountinfo.write_text("".join(kept))


def materialize(fixture: Path, workdir: Path, *, disk_bytes: int, slots: int | None = None,
                real_links: bool = True) -> LoopHost:
    """Copy ``fixture`` under ``workdir/root`` and back its candidate-slot disks with loop devices.

    ``real_links=False``: no ``/dev/disk/by-id`` link on the real host (nothing outside the agent,
    such as QEMU, will open the disk), so two such hosts can exist side by side.
    """
    from gpuaas_agent.discovery.report import discover
    from gpuaas_agent.hostfs import HostRoot

    if os.geteuid() != 0:
        raise SystemExit("the lab host needs root: losetup, mknod, /dev/disk/by-id")
    root = workdir / "root"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(fixture, root, symlinks=True)
    report = discover(HostRoot.open(root))
    names = {}
    for disk in report.nvme_devices:
        for link in filter(None, [disk.by_id, *disk.by_id_links]):
            names[link] = disk.kernel_name
    host = LoopHost(root=root)
    try:
        for slot in report.candidate_slots[:slots]:
            if slot.nvme_device is None or slot.blockers:
                continue
            kernel = names[slot.nvme_device]
            image = workdir / f"slot{slot.slot_index}.img"
            with open(image, "wb") as fh:
                fh.truncate(disk_bytes)
            loop = _sh("losetup", "--find", "--show", str(image)).strip()
            host.disks.append(SlotDisk(slot.slot_index, slot.nvme_device, kernel, loop, image))
            st = os.stat(loop)
            major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
            sysdir = Path(os.path.realpath(root / "sys/class/block" / kernel))
            if not sysdir.is_relative_to(root):
                raise RuntimeError(f"{kernel}: sysfs entry resolves outside the lab root ({sysdir})")
            (sysdir / "dev").write_text(f"{major}:{minor}\n")
            (sysdir / "size").write_text(f"{disk_bytes // SECTOR}\n")
            node = root / "dev" / kernel
            node.unlink(missing_ok=True)
            os.mknod(node, stat.S_IFBLK | 0o600, os.makedev(major, minor))
            if not real_links:
                continue
            real_link = REAL_BY_ID / Path(slot.nvme_device).name
            REAL_BY_ID.mkdir(parents=True, exist_ok=True)
            if real_link.is_symlink() or real_link.exists():
                raise RuntimeError(f"{real_link} exists already on this machine: refusing to re-point it")
            real_link.symlink_to(loop)
            host._links.append(real_link)
    except BaseException:
        host.close()
        raise
    _forget_recorded_mounts(root, {_dev_of(d.loop) for d in host.disks})
    (workdir / "loophost.json").write_text(json.dumps(host.manifest(), indent=2) + "\n")
    return host
