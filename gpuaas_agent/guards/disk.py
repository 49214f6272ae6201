"""The one check every disk write (clone, wipe) passes first (docs/safety.md §1, §2).

Seed 004: ``wipefs --all --force /dev/nvme0n1`` erased a disk whose child
partition was mounted at ``/share2``, because only the parent was checked
(``findmnt --source <disk>``). Here mounts are matched by major:minor over the
disk, every partition and every holder stacked on them, using the same
:class:`BlockTable`/:class:`MountTable` discovery uses. ``qemu-img convert -n``
does not even get EBUSY on such a disk — this guard is the only protection.

The by-id link is resolved afresh on every call: kernel names move on reboot
and a link can be re-pointed by udev at any time.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Collection
from typing import Any

from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.storage import DiskEvidence, DiskLease
from gpuaas_agent.contract.types import BY_ID_PATH_RE
from gpuaas_agent.discovery.nvme import SECTOR_BYTES, BlockTable, MountTable, disk_identity, disk_use
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.errors import GuardError
from gpuaas_agent.hostfs import HostRoot, SymlinkLoopError


class DiskGuardError(GuardError):
    """A disk write was refused; ``code`` says why, ``evidence`` shows what was seen. Nothing was written."""

    default_code = "disk_guard_refused"


def _refuse(code: str, message: str, **evidence: Any) -> DiskGuardError:
    return DiskGuardError(message, code=code, evidence=evidence)


def check_disk_writable(
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease | SlotLease,
    domain_disks: Collection[str] = (),
) -> DiskEvidence:
    """Prove ``by_id`` may be overwritten now, or raise :class:`DiskGuardError`.

    ``lease``: the slot this task holds (the state store's :class:`SlotLease`
    or a bare :class:`DiskLease`); only the disk its ``disk_identity`` names may
    be written, through any by-id alias of it.

    ``domain_disks``: disks (by-id or ``/dev`` paths, or kernel names) that
    defined libvirt domains, running or shut off, *other than the slot's own*
    reference; the caller knows which domain is the slot's. They are compared
    by resolved major:minor over the disk, its partitions and holders.

    Blocking (sysfs walk, ``open``): call it through ``asyncio.to_thread`` and
    immediately before the write.
    """
    passed: list[str] = []
    if not isinstance(by_id, str) or not BY_ID_PATH_RE.match(by_id) or posixpath.normpath(by_id) != by_id:
        raise _refuse(
            "not_by_id", f"{by_id!r} is not a /dev/disk/by-id/ path; kernel names move on reboot", by_id=by_id
        )
    passed.append("by_id")
    legacy = lease.disk_identity.startswith("path:")
    if legacy and by_id != lease.nvme_device:  # a lease from before identities: its own link only
        raise _not_in_lease(by_id, lease, None)

    fresh = host.fresh()
    reader = SysReader(fresh)
    blocks = BlockTable(reader)
    name = _resolve_by_id(fresh, blocks, by_id)
    node = blocks.nodes[name]
    base: dict[str, Any] = {"by_id": by_id, "kernel_name": name, "dev": node.dev}
    if node.is_partition:
        raise _refuse("not_whole_disk", f"{by_id} resolves to partition {name}, not a whole disk", **base)
    if node.dev is None:
        raise _refuse("missing", f"{name} has no readable major:minor in sysfs", **base)
    passed.append("whole_disk")
    identity = disk_identity(reader, node)
    if not legacy and identity != lease.disk_identity:
        # Any alias of the leased namespace is that disk; a link to another namespace never is.
        raise _not_in_lease(by_id, lease, identity, kernel_name=name, dev=node.dev)
    passed.append("in_lease")
    base["disk_identity"] = identity

    mounts = MountTable(reader, blocks)
    part_names = [p.name for p in blocks.partitions_of(node)]
    base["partitions"] = part_names
    _require_complete_reads(reader, base)
    use = disk_use(blocks, mounts, node)
    if use.os_mountpoints:
        raise _refuse("os_disk", f"{name} holds the host OS ({', '.join(use.os_mountpoints)})", **base,
                      os_mountpoints=use.os_mountpoints)
    passed.append("not_os_disk")
    if use.mountpoints:
        raise _refuse("mounted", f"{name} is mounted at {', '.join(use.mountpoints)}", **base,
                      mountpoints=use.mountpoints)
    passed.append("not_mounted")
    if use.mounted_children:
        children = [
            {"node": c.partition, **({"via_holder": c.via_holder} if c.via_holder else {}), "mountpoint": c.mountpoint}
            for c in use.mounted_children
        ]
        detail = "; ".join(
            f"{c.partition}{' via ' + c.via_holder if c.via_holder else ''} at {c.mountpoint}"
            for c in use.mounted_children
        )
        raise _refuse("mounted_child", f"{name} has mounted children: {detail}", **base, mounted_children=children)
    passed.append("no_mounted_children")
    holders = use.holder_closure
    if holders:
        raise _refuse("holders", f"{name} is held by {', '.join(holders)} (dm/md/LVM)", **base, holders=holders)
    passed.append("no_holders")
    if use.swap:
        raise _refuse("swap", f"{', '.join(use.swap)} on {name} is an active swap area", **base, swap=use.swap)
    passed.append("not_swap")

    ours = {blocks.nodes[n].dev for n in (name, *part_names, *holders) if n in blocks.nodes and blocks.nodes[n].dev}
    for entry in domain_disks:
        # Compared by the device the path resolves to (major:minor), never by the path string:
        # a domain may name the disk by another by-id alias, /dev/nvmeXnY or a partition.
        used = _domain_disk_dev(fresh, blocks, entry)
        if used in ours or entry == by_id:
            raise _refuse(
                "in_use_by_domain",
                f"{name} is used by another defined domain (as {entry})",
                **base,
                domain_disk=entry,
                domain_disk_dev=used,
            )
    passed.append("not_in_use_by_domain")

    _check_dev_node(fresh, name, node.dev, base)
    passed.append("dev_node_matches")
    check_exclusive(fresh, name, base)
    passed.append("exclusive_open")
    sectors = reader.int_attr(f"{node.sysfs}/size", required=True) or 0
    return DiskEvidence(
        by_id=by_id,
        kernel_name=name,
        dev=node.dev,
        disk_identity=identity,
        size_bytes=sectors * SECTOR_BYTES,
        partitions=part_names,
        checks_passed=passed,
    )


def read_disk_identity(host: HostRoot, by_id: str) -> str:
    """The identity of the whole disk ``by_id`` resolves to now (``missing`` when it resolves to none)."""
    fresh = host.fresh()
    reader = SysReader(fresh)
    blocks = BlockTable(reader)
    node = blocks.nodes[_resolve_by_id(fresh, blocks, by_id)]
    identity = None if node.is_partition else disk_identity(reader, node)
    if identity is None:
        raise _refuse("missing", f"{by_id} resolves to {node.name}, which has no disk identity", by_id=by_id,
                      kernel_name=node.name)
    return identity


# Reads the guard cannot do without: a mount table it could not read proves nothing (§4.7).
ESSENTIAL_PATHS = ("/proc/self/mountinfo", "/proc/swaps", "/sys/class/block", "/sys/block")


def _require_complete_reads(reader: SysReader, base: dict[str, Any]) -> None:
    blind = [
        f.model_dump(mode="json")
        for f in reader.findings.items
        if f.path in ESSENTIAL_PATHS or f.code == "mountinfo_line_unparsed"
    ]
    if blind:
        raise _refuse("unproven", "the mount/swap/block tables could not be read completely", **base, findings=blind)


def _resolve_by_id(host: HostRoot, blocks: BlockTable, by_id: str) -> str:
    """Kernel name the link points at now; ``missing`` for absent, dangling or looping links."""
    if not host.is_link(by_id):
        raise _refuse("missing", f"{by_id} does not exist (or is not a link)", by_id=by_id)
    try:
        resolved = host.resolve(by_id)
    except SymlinkLoopError:
        raise _refuse("missing", f"{by_id} is a symlink loop", by_id=by_id, reason="symlink_loop") from None
    name = posixpath.basename(resolved)
    if posixpath.dirname(resolved) != "/dev" or name not in blocks.nodes:
        raise _refuse(
            "missing", f"{by_id} points at {resolved}, which is not a block device here", by_id=by_id, resolved=resolved
        )
    return name


def _check_dev_node(host: HostRoot, name: str, dev: str, base: dict[str, Any]) -> None:
    """``/dev/<name>`` must be the block device sysfs describes (a stale node could be another disk)."""
    path = host.real(f"/dev/{name}")
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _refuse("missing", f"/dev/{name} cannot be examined: {exc.strerror}", **base) from None
    if not stat.S_ISBLK(st.st_mode):
        if host.is_live:
            raise _refuse("missing", f"/dev/{name} is not a block device", **base)
        return  # a recorded host root has plain files where device nodes were
    seen = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    if seen != dev:
        raise _refuse("missing", f"/dev/{name} is {seen} but sysfs says {dev}", **base, dev_node=seen)


def _domain_disk_dev(host: HostRoot, blocks: BlockTable, entry: str) -> str | None:
    """major:minor of the block device a domain's disk source (a path, or a bare kernel name) is, if any."""
    if not entry.startswith("/"):
        node = blocks.nodes.get(entry)
        return node.dev if node else None
    try:
        resolved = host.resolve(entry)
    except (OSError, SymlinkLoopError):
        resolved = None
    if resolved and posixpath.dirname(resolved) == "/dev" and posixpath.basename(resolved) in blocks.nodes:
        return blocks.nodes[posixpath.basename(resolved)].dev
    try:  # a device node outside the host root's /dev/disk tree: its own device number
        st = os.stat(host.real(entry))
    except (OSError, ValueError):
        return None
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISBLK(st.st_mode) else None


def _not_in_lease(by_id: str, lease: DiskLease | SlotLease, identity: str | None, **seen: Any) -> DiskGuardError:
    return _refuse(
        "not_in_lease",
        f"{by_id} is not the disk of slot {lease.slot_index} ({lease.nvme_device}, {lease.disk_identity})",
        by_id=by_id,
        disk_identity=identity,
        **seen,
        lease={
            "allocation_id": lease.allocation_id,
            "slot_index": lease.slot_index,
            "nvme_device": lease.nvme_device,
            "disk_identity": lease.disk_identity,
        },
    )


def open_exclusive(path: str, evidence: dict[str, Any]) -> int:
    """An O_EXCL open of a whole disk: EBUSY (``busy``) when anything holds it or a partition.

    Mounted partitions, dm/md members and swap all claim the whole disk, so
    this also catches a mount that appeared after the sysfs/mountinfo walk.
    The clone keeps the descriptor for its whole write.
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
    except OSError as exc:
        code = "busy" if exc.errno == errno.EBUSY else "missing"
        raise _refuse(code, f"exclusive open of {path} failed: {exc.strerror}", **evidence) from None


def check_exclusive(host: HostRoot, name: str, evidence: dict[str, Any] | None = None) -> None:
    """Last check before writing: the disk can be opened exclusively right now."""
    os.close(open_exclusive(str(host.real(f"/dev/{name}")), evidence or {"kernel_name": name}))
