"""NVMe namespaces as whole disks: stable identity, place in the PCI tree, and every way they are in use.

The seed incidents this module exists for:

* ``wipefs`` erased a disk whose *child partition* was mounted, because only
  the parent was checked — so mounts are matched by major:minor over the disk,
  every partition, and every holder stacked on them (LVM, md, dm-crypt);
* kernel names (``nvme4n1``) moved on reboot — so a disk is named by its
  ``/dev/disk/by-id`` link and the kernel name is advisory;
* with native multipath the namespace lives under
  ``/sys/devices/virtual/nvme-subsystem`` and hidden per-path nodes
  (``nvme4c4n1``) show up next to it — they are paths, not disks.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from gpuaas_agent.contract.topology import (
    Finding,
    MountedChild,
    NvmeDevice,
    Partition,
    StorageIdentityKind,
)
from gpuaas_agent.contract.types import BY_ID_NAME_RE, MAJOR_MINOR_RE
from gpuaas_agent.discovery.pci import BDF_RE, PciIndex
from gpuaas_agent.discovery.procfs import (
    MountEntry,
    parse_mountinfo,
    parse_swaps,
    parse_udev_data,
)
from gpuaas_agent.discovery.sysread import SysReader

CLASS_BLOCK = "/sys/class/block"
SYS_BLOCK = "/sys/block"
BY_ID = "/dev/disk/by-id"
NVME_NAMESPACE_RE = re.compile(r"^nvme\d+n\d+\Z")
NVME_PATH_NODE_RE = re.compile(r"^nvme\d+c\d+n\d+\Z")
NVME_CONTROLLER_RE = re.compile(r"^nvme\d+\Z")
DEV_RE = MAJOR_MINOR_RE
SECTOR_BYTES = 512  # sysfs "size" is always in 512-byte sectors
OS_MOUNTPOINTS = ("/", "/boot", "/boot/efi", "/efi")
UDEV_SIGNATURES = {"ID_PART_TABLE_TYPE": "partition_table", "ID_FS_TYPE": "filesystem"}


@dataclass
class BlockNode:
    """One entry of /sys/class/block."""

    name: str
    sysfs: str
    dev: str | None
    is_partition: bool
    hidden: bool
    holders: list[str] = field(default_factory=list)


class BlockTable:
    """All block nodes of a host plus the holder graph between them."""

    def __init__(self, reader: SysReader) -> None:
        self.reader = reader
        self.nodes: dict[str, BlockNode] = {}
        base = CLASS_BLOCK if reader.host.is_dir(CLASS_BLOCK) else SYS_BLOCK
        for name in reader.listdir(base, required=True):
            self._add(name, f"{base}/{name}")
        if base == SYS_BLOCK:  # /sys/block lists disks only: partitions are their subdirs
            for disk in [n for n in self.nodes.values() if not n.is_partition]:
                for child in reader.listdir(disk.sysfs):
                    if child.startswith(disk.name) and reader.host.exists(f"{disk.sysfs}/{child}/partition"):
                        self._add(child, f"{disk.sysfs}/{child}")

    def _add(self, name: str, entry: str) -> None:
        sysfs = self.reader.resolve(entry)
        if sysfs is None:
            return
        if not self.reader.host.is_dir(sysfs):
            self.reader.findings.warn("block_entry_dangling", "block device entry does not lead to a directory", entry)
            return
        self.nodes[name] = BlockNode(
            name=name,
            sysfs=sysfs,
            dev=self._dev(f"{sysfs}/dev"),
            is_partition=self.reader.host.exists(f"{sysfs}/partition"),
            hidden=self.reader.attr(f"{sysfs}/hidden") == "1",
            holders=self.reader.listdir(f"{sysfs}/holders"),
        )

    def _dev(self, path: str) -> str | None:
        """``major:minor``; anything else is junk that must not become a path or a match key."""
        value = self.reader.attr(path)
        if value is not None and not DEV_RE.match(value):
            self.reader.findings.warn("sysfs_unexpected_value", f"expected major:minor, found {value[:40]!r}", path)
            return None
        return value

    def partitions_of(self, disk: BlockNode) -> list[BlockNode]:
        return [
            n
            for n in self.nodes.values()
            if n.is_partition and posixpath.dirname(n.sysfs) == disk.sysfs
        ]

    def holder_closure(self, name: str) -> list[str]:
        """Every node stacked on ``name`` (dm on a partition, LVs on a PV, ...), nearest first."""
        out: list[str] = []
        todo = list(self.nodes[name].holders) if name in self.nodes else []
        while todo:
            holder = todo.pop(0)
            if holder in out:
                continue
            out.append(holder)
            node = self.nodes.get(holder)
            if node is not None:
                todo.extend(node.holders)
        return out


class MountTable:
    """Mounts and swap areas, matched to block nodes by major:minor (and source for btrfs)."""

    def __init__(self, reader: SysReader, blocks: BlockTable) -> None:
        self.by_name: dict[str, list[MountEntry]] = {}
        text = reader.text("/proc/self/mountinfo", required=True)
        entries, bad = parse_mountinfo(text or "")
        for number in bad:
            reader.findings.warn("mountinfo_line_unparsed", f"line {number} does not match proc(5)", "/proc/self/mountinfo")
        by_dev = {n.dev: n.name for n in blocks.nodes.values() if n.dev}
        for entry in entries:
            name = by_dev.get(entry.dev)
            if name is None and entry.dev.startswith("0:") and entry.source.startswith("/dev/"):
                # btrfs and other anonymous-device filesystems: only the source names the disk.
                name = self._source_name(reader, entry.source, blocks)
            if name is not None:
                self.by_name.setdefault(name, []).append(entry)
        swaps_text = reader.text("/proc/swaps")
        self.swap_names = {
            n for p in parse_swaps(swaps_text or "") if p.startswith("/dev/") and (n := self._source_name(reader, p, blocks))
        }

    @staticmethod
    def _source_name(reader: SysReader, source: str, blocks: BlockTable) -> str | None:
        resolved = reader.resolve(source)
        name = posixpath.basename(resolved) if resolved else None
        return name if name in blocks.nodes else None

    def mounts_of(self, name: str) -> list[MountEntry]:
        seen: dict[str, MountEntry] = {}
        for entry in self.by_name.get(name, []):
            seen.setdefault(entry.mountpoint, entry)
        return [seen[mp] for mp in sorted(seen)]


@dataclass(frozen=True)
class DiskUse:
    """Everything mounted from or stacked on one whole disk.

    The one walk both discovery and the disk guard use, so what discovery
    reports and what the guard refuses can never disagree.
    """

    mountpoints: list[str]  # the disk itself
    mounted_children: list[MountedChild]  # a partition, or a holder on one, mounted somewhere
    holder_closure: list[str]  # every node stacked on the disk or a partition, nearest first
    swap: list[str]  # the disk, partitions or holders that are active swap areas

    @property
    def os_mountpoints(self) -> list[str]:
        every = set(self.mountpoints) | {c.mountpoint for c in self.mounted_children}
        return sorted(mp for mp in every if mp in OS_MOUNTPOINTS)


def disk_use(blocks: BlockTable, mounts: MountTable, disk: BlockNode) -> DiskUse:
    """Mounts by major:minor over the disk, every partition and their holder closures (seed 004)."""
    children: list[MountedChild] = []
    closure = list(blocks.holder_closure(disk.name))
    partitions = blocks.partitions_of(disk)
    for part in partitions:
        children += [MountedChild(partition=part.name, mountpoint=m.mountpoint, fstype=m.fstype)
                     for m in mounts.mounts_of(part.name)]
        for holder in blocks.holder_closure(part.name):
            if holder not in closure:
                closure.append(holder)
            children += [MountedChild(partition=part.name, mountpoint=m.mountpoint, fstype=m.fstype, via_holder=holder)
                         for m in mounts.mounts_of(holder)]
    for holder in blocks.holder_closure(disk.name):  # a PV or md member on the whole disk
        children += [MountedChild(partition=disk.name, mountpoint=m.mountpoint, fstype=m.fstype, via_holder=holder)
                     for m in mounts.mounts_of(holder)]
    in_use = {disk.name, *(p.name for p in partitions), *closure}
    return DiskUse(
        mountpoints=[m.mountpoint for m in mounts.mounts_of(disk.name)],
        mounted_children=children,
        holder_closure=closure,
        swap=sorted(mounts.swap_names & in_use),
    )


def identity_kind(link: str) -> StorageIdentityKind | None:
    """Which stable name a by-id link is; ``None`` for links that are not NVMe namespace names."""
    if link.startswith("nvme-eui."):
        return StorageIdentityKind.nvme_eui_by_id
    if link.startswith(("nvme-uuid.", "nvme-nvme.", "nvme-naa.", "wwn-")):
        return StorageIdentityKind.nvme_wwn_by_id
    if link.startswith("nvme-"):
        return StorageIdentityKind.nvme_serial_by_id
    return None


_KIND_RANK: dict[StorageIdentityKind | None, int] = {
    StorageIdentityKind.nvme_eui_by_id: 0,
    StorageIdentityKind.nvme_wwn_by_id: 1,
    StorageIdentityKind.nvme_serial_by_id: 2,
}


def read_by_id_links(reader: SysReader, blocks: BlockTable) -> dict[str, list[str]]:
    """Kernel name -> its by-id link names, best identity first."""
    targets: dict[str, list[str]] = {}
    for link in reader.listdir(BY_ID):
        path = f"{BY_ID}/{link}"
        if not BY_ID_NAME_RE.match(link):
            reader.findings.warn("by_id_name_unusable", "link name has characters a slot path may not carry", path)
            continue
        resolved = reader.resolve(path)
        if resolved is None:
            continue
        target = posixpath.basename(resolved)
        if not resolved.startswith("/dev/") or target not in blocks.nodes:
            reader.findings.warn("by_id_dangling", f"link points at {resolved}, which is not a block device here", path)
            continue
        targets.setdefault(target, []).append(link)
    for links in targets.values():
        links.sort(key=lambda n: (_KIND_RANK.get(identity_kind(n), 9), len(n), n))
    return targets


_IDENTITY_ATTRS = (("uuid", "uuid"), ("nguid", "nguid"), ("eui", "eui"), ("wwid", "wwid"))
_ZERO_ID_RE = re.compile(r"[0:\-]+\Z")


def disk_identity(reader: SysReader, node: BlockNode) -> str | None:
    """What a whole disk *is*: ``<kind>:<value>`` from its namespace's sysfs identity, strongest first.

    Every ``/dev/disk/by-id`` alias of one namespace (EUI, WWN, model_serial)
    resolves to the same node and so to the same identity: leases, the disk
    guard and the slot binding compare this, never a link name. NVMe reports an
    unset id as zeroes; those are skipped. A block device with no id at all
    (a loop device) falls back to ``dev:<major:minor>``, which is unique while
    the host runs but moves on reboot; ``None`` when not even that is readable.
    """
    for kind, attr in _IDENTITY_ATTRS:
        value = reader.attr(f"{node.sysfs}/{attr}")
        if not value:
            continue
        value = "_".join(value.lower().split())
        if _ZERO_ID_RE.match(value) or not value.isascii() or not value.isprintable() or len(value) > 256:
            continue
        if kind in ("nguid", "eui"):
            value = value.replace("-", "").replace(":", "")
        return f"{kind}:{value}"
    return f"dev:{node.dev}" if node.dev else None


def _controller_addresses(reader: SysReader, ns: BlockNode) -> list[str]:
    """PCI functions of the controllers serving a namespace.

    Classic layout: the namespace directory sits under its controller's PCI
    function. Multipath: it sits under ``nvme-subsysN``, whose ``nvmeN`` links
    lead to each controller.
    """
    own = [c for c in ns.sysfs.split("/") if BDF_RE.match(c)]
    if own:
        return [own[-1]]
    parent = posixpath.dirname(ns.sysfs)
    found = set()
    for name in reader.listdir(parent):
        if not NVME_CONTROLLER_RE.match(name):
            continue
        resolved = reader.resolve(f"{parent}/{name}") or ""
        bdfs = [c for c in resolved.split("/") if BDF_RE.match(c)]
        address = bdfs[-1] if bdfs else reader.attr(f"{parent}/{name}/address")
        if address and BDF_RE.match(address):
            found.add(address)
    return sorted(found)


def _identity_attr(reader: SysReader, ns: BlockNode, attr: str) -> str | None:
    """serial/model live on the controller (classic) or the subsystem (multipath)."""
    for base in (posixpath.dirname(ns.sysfs), f"{ns.sysfs}/device"):
        value = reader.attr(f"{base}/{attr}")
        if value:
            return value
    return None


def _udev(reader: SysReader, node: BlockNode) -> dict[str, str]:
    if not node.dev:
        return {}
    text = reader.text(f"/run/udev/data/b{node.dev}")
    return parse_udev_data(text)[0] if text else {}


def read_nvme_devices(index: PciIndex) -> list[NvmeDevice]:
    """Every NVMe namespace (whole disk) in kernel-name order."""
    reader = index.reader
    blocks = BlockTable(reader)
    mounts = MountTable(reader, blocks)
    by_id = read_by_id_links(reader, blocks)
    devices = []
    for name, node in blocks.nodes.items():
        if node.is_partition or node.hidden or NVME_PATH_NODE_RE.match(name) or not NVME_NAMESPACE_RE.match(name):
            continue
        devices.append(_read_namespace(reader, index, blocks, mounts, by_id, node))
    return sorted(devices, key=lambda d: (len(d.kernel_name), d.kernel_name))


def _read_namespace(
    reader: SysReader,
    index: PciIndex,
    blocks: BlockTable,
    mounts: MountTable,
    by_id: dict[str, list[str]],
    node: BlockNode,
) -> NvmeDevice:
    links = [l for l in by_id.get(node.name, []) if identity_kind(l) is not None]
    kind = identity_kind(links[0]) if links else StorageIdentityKind.kernel_name_only
    controllers = _controller_addresses(reader, node)
    pci = index.detailed(controllers[0]) if controllers else None
    udev = _udev(reader, node)
    sectors = reader.int_attr(f"{node.sysfs}/size", required=True)

    use = disk_use(blocks, mounts, node)
    partitions: list[Partition] = []
    holders = list(node.holders)  # reported: direct holders of the disk and its partitions
    for part in blocks.partitions_of(node):
        part_udev = _udev(reader, part)
        partitions.append(
            Partition(
                name=part.name,
                number=reader.int_attr(f"{part.sysfs}/partition"),
                size_bytes=_bytes(reader.int_attr(f"{part.sysfs}/size")),
                fstype=part_udev.get("ID_FS_TYPE") or None,
                part_type=part_udev.get("ID_PART_ENTRY_TYPE") or None,
                holders=part.holders,
                mountpoints=[m.mountpoint for m in mounts.mounts_of(part.name)],
            )
        )
        holders += [h for h in part.holders if h not in holders]
    signatures = [f"{label}={udev[key]}" for key, label in UDEV_SIGNATURES.items() if udev.get(key)]
    signatures += [f"{p.name}:{p.fstype}" for p in partitions if p.fstype]

    device: dict[str, Any] = dict(
        by_id=f"{BY_ID}/{links[0]}" if links else None,
        by_id_links=[f"{BY_ID}/{l}" for l in links[1:]],
        storage_identity_kind=kind,
        kernel_name=node.name,
        dev=node.dev,
        wwid=reader.attr(f"{node.sysfs}/wwid"),
        disk_identity=disk_identity(reader, node),
        pci_address=pci.address if pci else None,
        controller_pci_addresses=controllers,
        pci_path=list(pci.pci_path) if pci else [],
        numa_node=pci.numa_node if pci else None,
        size_bytes=_bytes(sectors),
        serial=_identity_attr(reader, node, "serial"),
        model=_identity_attr(reader, node, "model"),
        mounted=bool(use.mountpoints or use.mounted_children),
        mountpoints=use.mountpoints,
        mounted_children=use.mounted_children,
        holders=holders,
        partitions=partitions,
        signatures=signatures,
        swap=bool(use.swap),
        os_disk=bool(use.os_mountpoints),
    )
    reasons = ineligible_reasons(device, read_only=reader.attr(f"{node.sysfs}/ro") == "1", os_mountpoints=use.os_mountpoints)
    return NvmeDevice(**device, slice_eligible=not reasons, ineligible_reasons=reasons)


def _bytes(sectors: int | None) -> int | None:
    return None if sectors is None else sectors * SECTOR_BYTES


def ineligible_reasons(d: dict[str, Any], *, read_only: bool, os_mountpoints: list[str]) -> list[Finding]:
    """Why a disk may not be a slice disk; empty means it is raw, unused and stably named."""
    name = d["kernel_name"]
    reasons = []

    def add(code: str, detail: str) -> None:
        reasons.append(Finding(code=code, detail=detail, path=d["by_id"] or f"/dev/{name}"))

    if os_mountpoints:
        add("os_disk", f"{name} holds the host OS ({', '.join(os_mountpoints)})")
    if d["by_id"] is None:
        add("no_stable_by_id", f"{name} has no /dev/disk/by-id link; kernel names move on reboot")
    if d["mountpoints"]:
        add("mounted", f"{name} is mounted at {', '.join(d['mountpoints'])}")
    if d["mounted_children"]:
        add("mounted_child", "; ".join(
            f"{c.partition}{' via ' + c.via_holder if c.via_holder else ''} mounted at {c.mountpoint}"
            for c in d["mounted_children"]
        ))
    if d["holders"]:
        add("holders", f"{name} is held by {', '.join(d['holders'])}")
    if d["swap"]:
        add("swap", f"{name} (or a partition or holder of it) is an active swap area")
    if d["partitions"] or d["signatures"]:
        found = ", ".join(d["signatures"]) or ", ".join(p.name for p in d["partitions"])
        add("not_raw", f"{name} is not a raw disk: {found}")
    if read_only:
        add("read_only", f"{name} is read-only")
    if not d["size_bytes"]:
        add("empty", f"{name} reports size 0")
    if d["pci_address"] is None:
        add("not_local_pcie", f"{name} is not served by a local PCIe NVMe controller")
    return reasons
