#!/usr/bin/env python3
"""Write recorded-host fixture trees for a Dell PowerEdge XE9680 with 8x NVIDIA H200.

No H200 host was available to ``gpuaas-agent record-fixture``, so this script
writes, file by file, what the Linux 6.8 kernel (sysfs, procfs), udev
(``/run/udev/data``, ``/dev/disk/*``) and Ubuntu 24.04 show on such a host:
eight GPU "islands" (one Broadcom PEX89000 switch each, holding a GPU, a
ConnectX-7 and a Micron 7450), NVSwitches, a BlueField-3, a BMC VGA, a Dell
BOSS-N1 OS disk with an LVM root, native NVMe multipath.

Why synthesise instead of hand-writing: the trees hold thousands of entries
whose cross-references (links, major:minor numbers, by-id names, IOMMU groups)
must agree with each other; one generator keeps them consistent and lets tests
produce trap variants (classic NVMe layout, absolute links) on demand.

Rules the output follows because discovery code depends on them:

* links are written the way kernfs writes them (relative, climbing to the
  common ancestor of the link's directory and the target's *parent*), or as
  absolute host paths with ``absolute_links=True``;
* attribute files end with a newline, NVMe ``model``/``serial`` are
  space-padded like the kernel prints them;
* kernel names and major:minor numbers do *not* follow PCI order, and change
  across the simulated reboot; by-id names never change;
* empty directories (``holders/`` of an unused disk) are not written by
  default: git cannot store them, so a committed recording loses them too and
  readers must treat a missing ``holders/`` as empty (``empty_dirs=True``
  writes them for tests that want the live-host shape).

Stdlib only; deterministic (identifiers come from hashes of fixed labels, the
only shuffle uses a seeded ``random.Random``).

Tests, the lab and the benchmarks never run this by hand: ``fixtures/hosts/<name>.synth.json``
describes each host (variant, options, pinned tree digest) and
``lab.fixture_hosts.fixture_host(name)`` generates it once into a cache keyed
by this file's content. By hand::

    python lab/synth_host.py OUT_DIR --variant after-reboot [--no-multipath] [--absolute-links]
    python lab/synth_host.py --all OUT_DIR      # every variant, under its fixture name
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import posixpath
import random
import shutil
import sys
import uuid
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------
# Host facts
# --------------------------------------------------------------------------------------

FIXTURE_PREFIX = "h200-slice-"
VARIANTS = ("after-transition", "before-transition", "after-reboot", "no-vfs", "nat-missing")
REGENERATE_ALL = "python lab/synth_host.py --all OUT_DIR"

HOSTNAME = "j22u05"
KERNEL_RELEASE = "6.8.0-57-generic"
# default_hugepagesz=1G is what makes /proc/meminfo report Hugepagesize 1048576 kB.
CMDLINE = (
    f"BOOT_IMAGE=/vmlinuz-{KERNEL_RELEASE} root=/dev/mapper/ubuntu--vg-ubuntu--lv ro "
    "intel_iommu=on iommu=pt default_hugepagesz=1G hugepagesz=1G hugepages=512"
)
NUMA_CPULIST = {0: "0-55,112-167", 1: "56-111,168-223"}
CPU_COUNT = 224


def cpumask(cpulist: str, ncpus: int = CPU_COUNT) -> str:
    """The kernel's ``%*pb`` bitmap form of a cpulist: comma-separated 32-bit words, high first."""
    mask = 0
    for part in cpulist.split(","):
        lo, _, hi = part.partition("-")
        for cpu in range(int(lo), int(hi or lo) + 1):
            mask |= 1 << cpu
    words = (ncpus + 31) // 32
    return ",".join(f"{(mask >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


NUMA_CPUMASK = {node: cpumask(cpus) for node, cpus in NUMA_CPULIST.items()}

# Root bus of each GPU island, in GPU order; the first four sit on socket 0.
ISLAND_ROOT_BUSES = (0x15, 0x37, 0x48, 0x59, 0x97, 0xA7, 0xB7, 0xD7)
SLOT_EUIS = (
    "000000000000000100a075244a103331",
    "000000000000000100a075244a10dcab",
    "000000000000000100a075244a103489",
    "000000000000000100a075244a10dc41",
    "000000000000000100a075244a10dc98",
    "000000000000000100a075244a10e101",
    "000000000000000100a075244a10e115",
    "000000000000000100a075244a103483",
)
OS_EUI = "000000000000000100a0752c1b4b2241"

# nvme instance numbers per boot, island 0..7; no island gets its own index and
# every island is renamed by the reboot. "a" = fixtures 1, 2 and 4, "b" = after-reboot.
BOOT_SLOT_NVME = {"a": (3, 6, 0, 8, 1, 7, 2, 5), "b": (5, 0, 8, 1, 6, 2, 4, 3)}
BOOT_OS_NVME = {"a": 4, "b": 7}
# The order the kernel's async namespace scans finished in, per boot (seeds for the shuffle).
BOOT_SCAN_SEED = {"a": 0xA, "b": 0xB}
# before-transition: boot-"a" nvme number of the slot disk -> where its p1 is mounted.
SHARE_MOUNTS = {0: "/share2", 2: "/share3", 3: "/share4", 5: "/share5", 6: "/share6", 7: "/share7", 8: "/share8"}

SLOT_MODEL = "Micron_7450_MTFDKCC3T8TFS"
SLOT_FIRMWARE = "E2MU200"
SLOT_SECTORS = 7501476528  # 3.84 TB
OS_MODEL = "Dell BOSS-N1"
OS_SERIAL = "a3c7e1f2b4d60918"
OS_FIRMWARE = "2.1.13.1"
OS_SECTORS = 1875374768  # 960 GB
LV_SECTORS = 209715200  # ubuntu-lv: curtin's 100 GiB default
NVME_CHAR_MAJOR = 240
EXT_MAJOR = 259
DM_MAJOR = 252

ESP_TYPE = "c12a7328-f81f-11d2-ba4b-00a0c93ec93b"
LINUX_FS_TYPE = "0fc63daf-8483-4772-8e79-3d69d8477de4"
LVM_TYPE = "e6d6d379-f507-44c2-a23c-238f2a3df928"
IPOIB_PREFIX = "00:00:10:49:fe:80:00:00:00:00:00:00"

# Slice network baseline (seed 004, j22u05 "low-risk lab baseline"): private NAT on ovsbr0,
# RShim management on tmfifo_net0, one IPoIB rail subnet per ConnectX-7 PF.
SLICE_SUBNET = "10.100.0.0/24"
SLICE_GATEWAY = ("10.100.0.1", 24)
UPLINK = ("eno8303", "10.177.36.197", 24, "10.177.36.1")
TMFIFO_ADDR = ("192.168.100.1", 30)
IPOIB_RAIL = "172.16.{rail}.5"
RECORDED_AT = "Thu Apr 17 15:25:32 2026"  # fixed: outputs must be byte-identical on every run

# Kernel module owning each PCI driver (None: built in).
DRIVER_MODULES = {
    "pcieport": None,
    "nvidia": "nvidia",
    "nvidia-nvswitch": "nvidia",
    "mlx5_core": "mlx5_core",
    "nvme": "nvme",
    "mgag200": "mgag200",
    "tg3": "tg3",
    "vfio-pci": "vfio_pci",
    "xhci_hcd": "xhci_pci",
    "i801_smbus": "i2c_i801",
}


# --------------------------------------------------------------------------------------
# Deterministic identifiers
# --------------------------------------------------------------------------------------


def _digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def det_hex(label: str, chars: int) -> str:
    """``chars`` lowercase hex digits that depend only on ``label``."""
    return _digest(label).hex()[:chars]


def det_uuid(label: str) -> str:
    """A version-4 looking UUID that depends only on ``label``."""
    return str(uuid.UUID(bytes=_digest(label)[:16], version=4))


def det_lvm_id(label: str, length: int = 32) -> str:
    """An LVM-style identifier (letters and digits, as lvm2 generates them)."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    raw = _digest(label) + _digest(label + "/2")
    return "".join(alphabet[b % 62] for b in raw[:length])


def lvm_dashed(ident: str) -> str:
    """lvm2's printed form of a 32-char id: 6-4-4-4-4-4-6."""
    cuts = (6, 4, 4, 4, 4, 4, 6)
    out, pos = [], 0
    for n in cuts:
        out.append(ident[pos : pos + n])
        pos += n
    return "-".join(out)


def bdf(bus: int, dev: int = 0, fn: int = 0, domain: int = 0) -> str:
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"


def bdf_key(address: str) -> tuple[int, int, int, int]:
    domain, bus, devfn = address.split(":")
    dev, fn = devfn.split(".")
    return int(domain, 16), int(bus, 16), int(dev, 16), int(fn)


def guid_bytes(label: str) -> bytes:
    """A Mellanox-OUI GUID (a0:88:c2:03:00:xx:xx:xx)."""
    return bytes([0xA0, 0x88, 0xC2, 0x03, 0x00]) + _digest(label)[:3]


def guid_text(raw: bytes) -> str:
    """The ``node_guid`` form: four groups of four hex digits."""
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


def colon_bytes(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def nguid_text(eui: str) -> str:
    """``nguid`` sysfs form (``%pU``) of a 32-hex NGUID."""
    return f"{eui[0:8]}-{eui[8:12]}-{eui[12:16]}-{eui[16:20]}-{eui[20:32]}"


# --------------------------------------------------------------------------------------
# Options and host states
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """Knobs for trap variants; the described fixture hosts use the defaults."""

    multipath: bool = True  # False: classic /sys/block/nvme0n1 under the controller, no heads/paths
    absolute_links: bool = False  # True: every link is an absolute host path (/sys/devices/...)
    empty_dirs: bool = False  # True: also write empty holders/ slaves/ dirs (git drops them)
    hidden_in_sys_block: bool = True  # the kernel links hidden path disks into /sys/block too
    iommu_group_type: str = "identity"  # what iommu=pt shows; "DMA-FQ" for a translated default domain
    vfio_driver_override: bool = False  # vfio-pci bound via driver_override instead of by ids
    numvfs: int | None = None  # VFs per ConnectX-7 PF; None: the variant's own (1, or 0 in no-vfs)


@dataclass(frozen=True)
class HostState:
    """What differs between the four recorded moments of the one host."""

    variant: str
    summary: str
    boot: str  # "a": the boot of fixtures 1, 2, 4; "b": after the reboot
    gpu_driver: str
    vf_driver: str
    nvswitch_driver: str | None
    numvfs: int
    slot_partitions: bool  # each slot disk still carries GPT + p1 (ext4)
    nvidia_loaded: bool
    nat: bool = True  # False: the 2026-04-24 drift, the MASQUERADE rule for the slice subnet is gone


_AFTER_TRANSITION = HostState(
    variant="after-transition",
    summary="final state after the storage transition: 8 GPUs on nvidia, one IB VF per ConnectX-7, "
    "8 raw slot disks plus the BOSS-N1 OS disk (nvme4n1); only the OS disk is mounted",
    boot="a",
    gpu_driver="nvidia",
    vf_driver="mlx5_core",
    nvswitch_driver="nvidia-nvswitch",
    numvfs=1,
    slot_partitions=False,
    nvidia_loaded=True,
)

# The other three moments are the same host with a few things changed.
STATES = {
    "after-transition": _AFTER_TRANSITION,
    "before-transition": replace(
        _AFTER_TRANSITION,
        variant="before-transition",
        summary="before the storage transition: every slot disk has GPT + p1 (ext4); seven of them are "
        "mounted at /share2../share8, nvme1n1p1 is not mounted; OS disk nvme4n1",
        slot_partitions=True,
    ),
    "after-reboot": replace(
        _AFTER_TRANSITION,
        variant="after-reboot",
        summary="after-transition host after a reboot: NVMe kernel names, controller/subsystem numbers "
        "and 259:* minors all moved (OS disk now nvme7n1), by-id names unchanged; GPUs and fabric VFs "
        "bound to vfio-pci, nvidia module not loaded",
        boot="b",
        gpu_driver="vfio-pci",
        vf_driver="vfio-pci",
        nvswitch_driver=None,
        nvidia_loaded=False,
    ),
    "no-vfs": replace(
        _AFTER_TRANSITION,
        variant="no-vfs",
        summary="after-transition host with SR-IOV off: every ConnectX-7 PF has sriov_numvfs 0 and no VF exists",
        numvfs=0,
    ),
    "nat-missing": replace(
        _AFTER_TRANSITION,
        variant="nat-missing",
        summary="after-transition host with the seed's 2026-04-24 network drift: ovsbr0 owns 10.100.0.1/24 and "
        "dnsmasq serves the subnet, but the POSTROUTING MASQUERADE rule for 10.100.0.0/24 is missing",
        nat=False,
    ),
}


def variant_name(name: str) -> str:
    """Accept ``after-reboot`` and ``h200-slice-after-reboot`` alike."""
    short = name[len(FIXTURE_PREFIX) :] if name.startswith(FIXTURE_PREFIX) else name
    if short not in STATES:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    return short


# --------------------------------------------------------------------------------------
# Tree: files and links under a fixture root, addressed by host path
# --------------------------------------------------------------------------------------


def kernfs_link_target(target: str, link_dir: str) -> str:
    """The relative target kernfs writes for a link in ``link_dir`` to ``target``.

    kernfs climbs from the link's directory to the common ancestor with the
    target's *parent*, then descends: a namespace head's ``device`` link to
    its own parent reads ``../../nvme-subsys0``, not ``..``.
    """
    parent, name = posixpath.split(target)
    up = posixpath.relpath(parent, link_dir)
    return name if up == "." else f"{up}/{name}"


class Tree:
    """Writes one fixture; refuses to write any path twice so topology bugs surface."""

    def __init__(self, root: Path, options: Options) -> None:
        self.root = root
        self.options = options
        self._taken: set[str] = set()

    def real(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def _claim(self, host_path: str) -> Path:
        norm = posixpath.normpath(host_path)
        if norm in self._taken:
            raise RuntimeError(f"synth_host: {norm} written twice")
        self._taken.add(norm)
        real = self.real(norm)
        real.parent.mkdir(parents=True, exist_ok=True)
        return real

    def attr(self, host_path: str, value: object) -> None:
        """A sysfs-style attribute: the value plus a newline."""
        self.text(host_path, f"{value}\n")

    def text(self, host_path: str, content: str) -> None:
        """A file with exactly ``content`` (empty for bind/unbind style files)."""
        self._claim(host_path).write_bytes(content.encode())

    def link(self, host_path: str, target: str) -> None:
        """A symlink, kernfs-relative unless the tree is written with absolute links."""
        real = self._claim(host_path)
        if self.options.absolute_links:
            os.symlink(target, real)
        else:
            os.symlink(kernfs_link_target(target, posixpath.dirname(host_path)), real)

    def empty_dir(self, host_path: str) -> None:
        """A directory that is empty on the host (only written with ``empty_dirs``)."""
        if self.options.empty_dirs:
            self.real(host_path).mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------------------
# PCI
# --------------------------------------------------------------------------------------


@dataclass
class PciFunc:
    """One PCI function and the attributes its sysfs directory shows."""

    address: str
    parent: str  # host path of the directory that holds this function's directory
    vendor: int
    device: int
    pci_class: int
    subsystem_vendor: int
    subsystem_device: int
    numa: int
    revision: int = 0
    driver: str | None = None
    bus_range: tuple[int, int] | None = None  # bridges: secondary, subordinate
    link: tuple[str, int] | None = None  # PCIe speed, width
    sriov: dict[str, object] | None = None
    physfn: str | None = None  # VFs: the PF's address
    virtfns: list[str] = field(default_factory=list)
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"{self.parent}/{self.address}"

    @property
    def is_vf(self) -> bool:
        return self.physfn is not None


# sysfs ``resource`` flags (include/linux/ioport.h): what a BAR is, as the kernel prints it.
IORESOURCE_MEM = 0x00000200
IORESOURCE_PREFETCH = 0x00002000
IORESOURCE_MEM_64 = 0x00100000
IORESOURCE_SIZEALIGN = 0x00040000
BAR_MEM32 = IORESOURCE_MEM | IORESOURCE_SIZEALIGN
BAR_MEM64_PREFETCH = IORESOURCE_MEM | IORESOURCE_PREFETCH | IORESOURCE_MEM_64 | IORESOURCE_SIZEALIGN | 0xC
H200_BAR1_BYTES = 256 << 30  # the framebuffer BAR of an H200 SXM (resizable BAR at its maximum)


def resource_text(bars: dict[int, tuple[int, int, int]]) -> str:
    """A function's ``resource`` file: 13 lines (6 BARs, ROM, 6 SR-IOV BARs), ``start end flags`` each.

    ``bars`` maps a line index to (start, size, flags); every other line is the kernel's all-zero line.
    """
    lines = []
    for index in range(13):
        start, size, flags = bars.get(index, (0, 0, 0))
        end = start + size - 1 if size else 0
        lines.append(f"0x{start:016x} 0x{end:016x} 0x{flags:016x}")
    return "\n".join(lines)


def h200_resource(island_index: int) -> str:
    """An H200's BARs: BAR0 16 MiB registers (32-bit), BAR1 256 GiB framebuffer, BAR3 32 MiB (64-bit prefetchable)."""
    mmio32 = 0x9A000000 + island_index * 0x02000000
    mmio64 = 0x200000000000 + island_index * 0x8000000000  # 512 GiB apart, naturally aligned
    return resource_text({0: (mmio32, 16 << 20, BAR_MEM32), 1: (mmio64, H200_BAR1_BYTES, BAR_MEM64_PREFETCH),
                          3: (mmio64 + H200_BAR1_BYTES, 32 << 20, BAR_MEM64_PREFETCH)})


def cx7_vf_resource(island_index: int, vf: int) -> str:
    """A ConnectX-7 VF: BAR0 2 MiB, 64-bit prefetchable (carved from the PF's SR-IOV BAR)."""
    start = 0x300000000000 + island_index * 0x100000000 + vf * (2 << 20)
    return resource_text({0: (start, 2 << 20, BAR_MEM64_PREFETCH)})


class PciTree:
    """All PCI functions of the host; writes their directories and the bus/driver/IOMMU links."""

    def __init__(self) -> None:
        self.funcs: dict[str, PciFunc] = {}
        self.root_buses: set[int] = set()

    @staticmethod
    def root_complex(bus: int) -> str:
        return f"/sys/devices/pci0000:{bus:02x}"

    def add(self, func: PciFunc) -> PciFunc:
        if func.address in self.funcs:
            raise RuntimeError(f"synth_host: PCI address {func.address} used twice")
        self.funcs[func.address] = func
        return func

    def bridge(self, parent: str, address: str, vendor: int, device: int, numa: int, bus_range: tuple[int, int], **kw: Any) -> PciFunc:
        """A PCIe root port or switch port, bound to pcieport like every bridge on Linux."""
        return self.add(
            PciFunc(
                address=address,
                parent=parent,
                vendor=vendor,
                device=device,
                pci_class=0x060400,
                subsystem_vendor=kw.pop("subsystem_vendor", vendor),
                subsystem_device=kw.pop("subsystem_device", 0x0000),
                numa=numa,
                driver="pcieport",
                bus_range=bus_range,
                **kw,
            )
        )

    def iommu_groups(self) -> dict[str, int]:
        """Group numbers: one per function (ACS on); boot-time functions by address, then VFs."""
        base = sorted((a for a, f in self.funcs.items() if not f.is_vf), key=bdf_key)
        vfs = sorted((a for a, f in self.funcs.items() if f.is_vf), key=bdf_key)
        return {address: n for n, address in enumerate(base + vfs)}

    def write(self, tree: Tree, drivers: list[str], options: Options) -> dict[str, int]:
        groups = self.iommu_groups()
        for bus in sorted(self.root_buses):
            tree.text(f"{self.root_complex(bus)}/uevent", "")
        for address in sorted(self.funcs, key=bdf_key):
            func = self.funcs[address]
            self._write_func(tree, func, groups[address], options)
            tree.link(f"/sys/bus/pci/devices/{address}", func.path)
            group_dir = f"/sys/kernel/iommu_groups/{groups[address]}"
            tree.link(f"{group_dir}/devices/{address}", func.path)
            tree.attr(f"{group_dir}/type", options.iommu_group_type)
            tree.text(f"{group_dir}/reserved_regions", "0x00000000fee00000 0x00000000feefffff msi\n")
        tree.text("/sys/bus/pci/drivers_probe", "")
        tree.text("/sys/bus/pci/rescan", "")
        tree.attr("/sys/bus/pci/drivers_autoprobe", "1")
        bound = {f.driver for f in self.funcs.values() if f.driver}
        missing = bound - set(drivers)
        if missing:
            raise RuntimeError(f"synth_host: bound drivers not loaded: {sorted(missing)}")
        for name in sorted(drivers):
            ddir = f"/sys/bus/pci/drivers/{name}"
            for ctl in ("bind", "unbind", "new_id", "remove_id", "uevent"):
                tree.text(f"{ddir}/{ctl}", "")
            module = DRIVER_MODULES.get(name)
            if module:
                tree.link(f"{ddir}/module", f"/sys/module/{module}")
            for address in sorted(self.funcs, key=bdf_key):
                if self.funcs[address].driver == name:
                    tree.link(f"{ddir}/{address}", self.funcs[address].path)
        return groups

    @staticmethod
    def _write_func(tree: Tree, f: PciFunc, group: int, options: Options) -> None:
        p = f.path
        tree.attr(f"{p}/vendor", f"0x{f.vendor:04x}")
        tree.attr(f"{p}/device", f"0x{f.device:04x}")
        tree.attr(f"{p}/class", f"0x{f.pci_class:06x}")
        tree.attr(f"{p}/subsystem_vendor", f"0x{f.subsystem_vendor:04x}")
        tree.attr(f"{p}/subsystem_device", f"0x{f.subsystem_device:04x}")
        tree.attr(f"{p}/revision", f"0x{f.revision:02x}")
        tree.attr(f"{p}/numa_node", f.numa)
        tree.attr(f"{p}/local_cpulist", NUMA_CPULIST[f.numa])
        tree.attr(f"{p}/local_cpus", NUMA_CPUMASK[f.numa])
        tree.attr(f"{p}/enable", "1")
        override = "vfio-pci" if options.vfio_driver_override and f.driver == "vfio-pci" else "(null)"
        tree.attr(f"{p}/driver_override", override)
        tree.attr(f"{p}/irq", "0" if f.is_vf else "16")
        tree.text(f"{p}/reset", "")
        tree.text(f"{p}/remove", "")
        tree.text(f"{p}/rescan", "")
        uevent = [] if f.driver is None else [f"DRIVER={f.driver}"]
        cls_hi = f"{f.pci_class:X}"
        uevent += [
            f"PCI_CLASS={cls_hi}",
            f"PCI_ID={f.vendor:04X}:{f.device:04X}",
            f"PCI_SUBSYS_ID={f.subsystem_vendor:04X}:{f.subsystem_device:04X}",
            f"PCI_SLOT_NAME={f.address}",
            "MODALIAS=pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X"
            % (
                f.vendor,
                f.device,
                f.subsystem_vendor,
                f.subsystem_device,
                f.pci_class >> 16,
                (f.pci_class >> 8) & 0xFF,
                f.pci_class & 0xFF,
            ),
        ]
        tree.text(f"{p}/uevent", "\n".join(uevent) + "\n")
        if f.bus_range is not None:
            tree.attr(f"{p}/secondary_bus_number", f.bus_range[0])
            tree.attr(f"{p}/subordinate_bus_number", f.bus_range[1])
        if f.link is not None:
            speed, width = f.link
            tree.attr(f"{p}/current_link_speed", speed)
            tree.attr(f"{p}/current_link_width", width)
            tree.attr(f"{p}/max_link_speed", speed)
            tree.attr(f"{p}/max_link_width", width)
        if f.sriov is not None:
            for key in ("totalvfs", "numvfs", "offset", "stride", "vf_device", "drivers_autoprobe"):
                tree.attr(f"{p}/sriov_{key}", f.sriov[key])
        for n, vf in enumerate(f.virtfns):
            tree.link(f"{p}/virtfn{n}", f"{f.parent}/{vf}")
        if f.physfn is not None:
            tree.link(f"{p}/physfn", f"{f.parent}/{f.physfn}")
        for name, value in sorted(f.extra.items()):
            tree.attr(f"{p}/{name}", value)
        tree.link(f"{p}/subsystem", "/sys/bus/pci")
        tree.link(f"{p}/iommu_group", f"/sys/kernel/iommu_groups/{group}")
        if f.driver is not None:
            tree.link(f"{p}/driver", f"/sys/bus/pci/drivers/{f.driver}")


# --------------------------------------------------------------------------------------
# Network functions (ConnectX-7 in InfiniBand mode, BlueField-3, LOM)
# --------------------------------------------------------------------------------------


@dataclass
class Netdev:
    """A network interface living under a PCI function (or virtual, for lo)."""

    name: str
    device_path: str | None  # the PCI function dir; None for virtual interfaces
    address: str
    if_type: int
    ifindex: int
    mtu: int
    operstate: str
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> str:
        if self.device_path is None:
            return f"/sys/devices/virtual/net/{self.name}"
        return f"{self.device_path}/net/{self.name}"


def write_netdev(tree: Tree, nd: Netdev) -> None:
    p = nd.path
    addr_len = len(nd.address.split(":"))
    tree.attr(f"{p}/address", nd.address)
    tree.attr(f"{p}/addr_len", addr_len)
    tree.attr(f"{p}/type", nd.if_type)
    tree.attr(f"{p}/ifindex", nd.ifindex)
    tree.attr(f"{p}/iflink", nd.ifindex)
    tree.attr(f"{p}/mtu", nd.mtu)
    tree.attr(f"{p}/operstate", nd.operstate)
    tree.attr(f"{p}/carrier", "1" if nd.operstate == "up" else "0")
    for name, value in sorted(nd.extra.items()):
        tree.attr(f"{p}/{name}", value)
    tree.text(f"{p}/uevent", f"INTERFACE={nd.name}\nIFINDEX={nd.ifindex}\n")
    tree.link(f"{p}/subsystem", "/sys/class/net")
    if nd.device_path is not None:
        tree.link(f"{p}/device", nd.device_path)
    tree.link(f"/sys/class/net/{nd.name}", p)


@dataclass
class IbDevice:
    """An RDMA device (``/sys/class/infiniband/<name>``) under a mlx5 function."""

    name: str
    device_path: str
    node_guid: bytes
    link_layer: str  # "InfiniBand" or "Ethernet"
    hca_type: str
    lid: int = 0
    rate: str = "400 Gb/sec (4X NDR)"

    @property
    def path(self) -> str:
        return f"{self.device_path}/infiniband/{self.name}"


def write_ib_device(tree: Tree, ib: IbDevice) -> None:
    p = ib.path
    tree.attr(f"{p}/node_guid", guid_text(ib.node_guid))
    tree.attr(f"{p}/sys_image_guid", guid_text(ib.node_guid))
    tree.attr(f"{p}/node_type", "1: CA")
    tree.attr(f"{p}/node_desc", f"{HOSTNAME} {ib.name}")
    tree.attr(f"{p}/hca_type", ib.hca_type)
    tree.attr(f"{p}/fw_ver", "28.43.1014")
    tree.attr(f"{p}/board_id", "DEL0000000047")
    port = f"{p}/ports/1"
    tree.attr(f"{port}/state", "4: ACTIVE")
    tree.attr(f"{port}/phys_state", "5: LinkUp")
    tree.attr(f"{port}/link_layer", ib.link_layer)
    tree.attr(f"{port}/rate", ib.rate)
    tree.attr(f"{port}/lid", f"0x{ib.lid:x}")
    tree.attr(f"{port}/sm_lid", "0x1" if ib.link_layer == "InfiniBand" else "0x0")
    tree.attr(f"{port}/lid_mask_count", "0")
    tree.link(f"{p}/device", ib.device_path)
    tree.link(f"{p}/subsystem", "/sys/class/infiniband")
    tree.link(f"/sys/class/infiniband/{ib.name}", p)


# --------------------------------------------------------------------------------------
# NVMe and block devices
# --------------------------------------------------------------------------------------


@dataclass
class PartitionSpec:
    number: int
    start: int
    sectors: int
    part_type: str
    fs_type: str
    fs_uuid: str
    part_uuid: str
    minor: int = -1


@dataclass
class NvmeDisk:
    """One NVMe drive: its PCI function, controller, subsystem, namespace and partitions."""

    label: str  # stable identity used for derived ids ("slot3", "os")
    island: int | None
    address: str
    pci_path: str
    instance: int  # controller number == subsystem number, as Ubuntu shows it
    model: str
    serial: str
    firmware: str
    eui: str
    sectors: int
    numa: int
    subsysnqn: str
    cntlid: int
    partitions: list[PartitionSpec] = field(default_factory=list)
    table_uuid: str | None = None
    path_minor: int | None = None
    head_minor: int = -1

    @property
    def name(self) -> str:
        return f"nvme{self.instance}n1"

    @property
    def ctrl_dir(self) -> str:
        return f"{self.pci_path}/nvme/nvme{self.instance}"

    @property
    def subsys_dir(self) -> str:
        return f"/sys/devices/virtual/nvme-subsystem/nvme-subsys{self.instance}"

    @property
    def path_disk_name(self) -> str:
        return f"nvme{self.instance}c{self.instance}n1"

    def head_dir(self, multipath: bool) -> str:
        if multipath:
            return f"{self.subsys_dir}/{self.name}"
        return f"{self.ctrl_dir}/{self.name}"

    def part_name(self, part: PartitionSpec) -> str:
        return f"{self.name}p{part.number}"

    def part_dir(self, part: PartitionSpec, multipath: bool) -> str:
        return f"{self.head_dir(multipath)}/{self.part_name(part)}"

    def by_id_names(self) -> list[str]:
        """udev's 60-persistent-storage names (spaces become ``_``)."""
        model = self.model.replace(" ", "_")
        return [f"nvme-eui.{self.eui}", f"nvme-{model}_{self.serial}", f"nvme-{model}_{self.serial}_1"]

    @property
    def by_path_name(self) -> str:
        return f"pci-{self.address}-nvme-1"


@dataclass
class BlockEntry:
    """A block device as /proc/partitions and /sys/dev/block see it."""

    name: str
    sysfs: str
    major: int
    minor: int
    sectors: int
    is_partition: bool = False


def allocate_minors(disks: list[NvmeDisk], boot: str, multipath: bool) -> None:
    """Give 259:* minors in the order the kernel's namespace scans finished.

    ``device_add_disk`` takes an extended minor for every gendisk, the hidden
    per-path disk included (it just never gets a ``dev``), then the head, then
    the partitions found on it. Scans run asynchronously, so the order is not
    PCI order nor instance order: a seeded shuffle per boot stands in for it.
    """
    order = sorted(disks, key=lambda d: d.instance)
    random.Random(BOOT_SCAN_SEED[boot]).shuffle(order)
    nxt = 0
    for disk in order:
        if multipath:
            disk.path_minor = nxt
            nxt += 1
        disk.head_minor = nxt
        nxt += 1
        for part in disk.partitions:
            part.minor = nxt
            nxt += 1


def pad(value: str, width: int) -> str:
    """NVMe identify strings are space padded and the kernel prints them whole."""
    return value.ljust(width)


def write_nvme_disk(tree: Tree, disk: NvmeDisk, options: Options, holders: dict[str, list[str]]) -> list[BlockEntry]:
    """Controller, subsystem, namespace head (or classic namespace), path disk and partitions.

    ``holders`` maps a block name to the sysfs dirs of what is stacked on it
    (dm-0 on the OS disk's p3), for the ``holders/`` links.
    """
    mp = options.multipath
    ctrl = disk.ctrl_dir
    tree.attr(f"{ctrl}/serial", pad(disk.serial, 20))
    tree.attr(f"{ctrl}/model", pad(disk.model, 40))
    tree.attr(f"{ctrl}/firmware_rev", pad(disk.firmware, 8))
    tree.attr(f"{ctrl}/address", disk.address)
    tree.attr(f"{ctrl}/transport", "pcie")
    tree.attr(f"{ctrl}/cntlid", disk.cntlid)
    tree.attr(f"{ctrl}/state", "live")
    tree.attr(f"{ctrl}/subsysnqn", disk.subsysnqn)
    tree.attr(f"{ctrl}/numa_node", disk.numa)
    tree.attr(f"{ctrl}/queue_count", "129")
    tree.attr(f"{ctrl}/dev", f"{NVME_CHAR_MAJOR}:{disk.instance}")
    tree.text(f"{ctrl}/uevent", f"MAJOR={NVME_CHAR_MAJOR}\nMINOR={disk.instance}\nDEVNAME=nvme{disk.instance}\nNVME_TRTYPE=pcie\n")
    tree.link(f"{ctrl}/device", disk.pci_path)
    tree.link(f"{ctrl}/subsystem", "/sys/class/nvme")
    tree.link(f"/sys/class/nvme/nvme{disk.instance}", ctrl)
    tree.link(f"/sys/dev/char/{NVME_CHAR_MAJOR}:{disk.instance}", ctrl)

    # The subsystem exists with or without multipath; only multipath hangs a head disk under it.
    sub = disk.subsys_dir
    tree.attr(f"{sub}/model", pad(disk.model, 40))
    tree.attr(f"{sub}/serial", pad(disk.serial, 20))
    tree.attr(f"{sub}/firmware_rev", pad(disk.firmware, 8))
    tree.attr(f"{sub}/subsysnqn", disk.subsysnqn)
    tree.attr(f"{sub}/subsystype", "nvm")
    tree.attr(f"{sub}/iopolicy", "numa")
    tree.text(f"{sub}/uevent", "NVME_TRTYPE=pcie\n")
    tree.link(f"{sub}/nvme{disk.instance}", ctrl)
    tree.link(f"{sub}/subsystem", "/sys/class/nvme-subsystem")
    tree.link(f"/sys/class/nvme-subsystem/nvme-subsys{disk.instance}", sub)

    entries: list[BlockEntry] = []
    head = disk.head_dir(mp)
    _write_disk_attrs(tree, head, disk, hidden=False)
    tree.attr(f"{head}/dev", f"{EXT_MAJOR}:{disk.head_minor}")
    tree.text(
        f"{head}/uevent",
        f"MAJOR={EXT_MAJOR}\nMINOR={disk.head_minor}\nDEVNAME={disk.name}\nDEVTYPE=disk\nDISKSEQ={disk.head_minor + 1}\n",
    )
    tree.link(f"{head}/device", sub if mp else ctrl)
    _write_holders(tree, head, disk.name, holders)
    tree.empty_dir(f"{head}/slaves")
    entries.append(BlockEntry(disk.name, head, EXT_MAJOR, disk.head_minor, disk.sectors))

    if mp:
        # The per-path disk: hidden, no dev (so no /dev node and no udev data), a trap for readers.
        path = f"{ctrl}/{disk.path_disk_name}"
        _write_disk_attrs(tree, path, disk, hidden=True)
        tree.text(f"{path}/uevent", f"DEVNAME={disk.path_disk_name}\nDEVTYPE=disk\n")
        tree.link(f"{path}/device", ctrl)
        tree.empty_dir(f"{path}/holders")
        tree.empty_dir(f"{path}/slaves")
        tree.link(f"/sys/class/block/{disk.path_disk_name}", path)
        if options.hidden_in_sys_block:
            tree.link(f"/sys/block/{disk.path_disk_name}", path)

    for part in disk.partitions:
        pname = disk.part_name(part)
        pdir = disk.part_dir(part, mp)
        tree.attr(f"{pdir}/dev", f"{EXT_MAJOR}:{part.minor}")
        tree.attr(f"{pdir}/partition", part.number)
        tree.attr(f"{pdir}/start", part.start)
        tree.attr(f"{pdir}/size", part.sectors)
        tree.attr(f"{pdir}/ro", "0")
        tree.attr(f"{pdir}/alignment_offset", "0")
        tree.attr(f"{pdir}/discard_alignment", "0")
        tree.text(
            f"{pdir}/uevent",
            f"MAJOR={EXT_MAJOR}\nMINOR={part.minor}\nDEVNAME={pname}\nDEVTYPE=partition\n"
            f"DISKSEQ={disk.head_minor + 1}\nPARTN={part.number}\n",
        )
        tree.link(f"{pdir}/subsystem", "/sys/class/block")
        _write_holders(tree, pdir, pname, holders)
        entries.append(BlockEntry(pname, pdir, EXT_MAJOR, part.minor, part.sectors, is_partition=True))
    return entries


def _write_disk_attrs(tree: Tree, d: str, disk: NvmeDisk, *, hidden: bool) -> None:
    tree.attr(f"{d}/size", disk.sectors)
    tree.attr(f"{d}/hidden", "1" if hidden else "0")
    tree.attr(f"{d}/nsid", "1")
    tree.attr(f"{d}/wwid", f"eui.{disk.eui}")
    tree.attr(f"{d}/nguid", nguid_text(disk.eui))
    tree.attr(f"{d}/removable", "0")
    tree.attr(f"{d}/ro", "0")
    tree.attr(f"{d}/ext_range", "256")
    tree.attr(f"{d}/queue/logical_block_size", "512")
    tree.attr(f"{d}/queue/physical_block_size", "4096" if disk.island is not None else "512")
    tree.attr(f"{d}/queue/rotational", "0")
    tree.link(f"{d}/subsystem", "/sys/class/block")


def _write_holders(tree: Tree, d: str, name: str, holders: dict[str, list[str]]) -> None:
    held_by = holders.get(name, [])
    if not held_by:
        tree.empty_dir(f"{d}/holders")
    for holder_dir in held_by:
        tree.link(f"{d}/holders/{posixpath.basename(holder_dir)}", holder_dir)


def write_dm_root(tree: Tree, pv_dir: str, pv_name: str, lvm: dict[str, str]) -> BlockEntry:
    """dm-0: the LVM root volume stacked on the OS disk's p3."""
    d = "/sys/devices/virtual/block/dm-0"
    tree.attr(f"{d}/dev", f"{DM_MAJOR}:0")
    tree.attr(f"{d}/size", LV_SECTORS)
    tree.attr(f"{d}/ro", "0")
    tree.attr(f"{d}/removable", "0")
    tree.attr(f"{d}/hidden", "0")
    tree.attr(f"{d}/ext_range", "1")
    tree.attr(f"{d}/dm/name", lvm["dm_name"])
    tree.attr(f"{d}/dm/uuid", lvm["dm_uuid"])
    tree.attr(f"{d}/dm/suspended", "0")
    tree.attr(f"{d}/dm/use_blk_mq", "1")
    tree.attr(f"{d}/queue/logical_block_size", "512")
    tree.attr(f"{d}/queue/rotational", "0")
    tree.text(f"{d}/uevent", f"MAJOR={DM_MAJOR}\nMINOR=0\nDEVNAME=dm-0\nDEVTYPE=disk\nDISKSEQ=20\n")
    tree.link(f"{d}/subsystem", "/sys/class/block")
    tree.link(f"{d}/slaves/{pv_name}", pv_dir)
    tree.empty_dir(f"{d}/holders")
    return BlockEntry("dm-0", d, DM_MAJOR, 0, LV_SECTORS)


# --------------------------------------------------------------------------------------
# udev: /run/udev/data and /dev/disk/*
# --------------------------------------------------------------------------------------


class Udev:
    """Collects /dev links and udev database records, then writes them."""

    def __init__(self) -> None:
        self.dev_links: dict[str, str] = {}  # /dev/... link -> /dev/<kernel name>
        self.records: dict[str, list[str]] = {}

    def add(self, majmin: str, kernel_name: str, links: list[str], env: list[tuple[str, str]]) -> None:
        for link in links:
            self.dev_links[f"/dev/{link}"] = f"/dev/{kernel_name}"
        lines = [f"S:{link}" for link in links]
        lines += [f"E:{k}={v}" for k, v in env]
        lines += ["G:systemd", "Q:systemd", "V:1"]
        self.records[f"b{majmin}"] = lines

    def write(self, tree: Tree) -> None:
        for link in sorted(self.dev_links):
            tree.link(link, self.dev_links[link])
        for key in sorted(self.records):
            tree.text(f"/run/udev/data/{key}", "\n".join(self.records[key]) + "\n")


def disk_udev(udev: Udev, disk: NvmeDisk) -> None:
    links = [f"disk/by-id/{n}" for n in disk.by_id_names()] + [f"disk/by-path/{disk.by_path_name}"]
    env = _nvme_env(disk)
    if disk.table_uuid:
        env += [("ID_PART_TABLE_UUID", disk.table_uuid), ("ID_PART_TABLE_TYPE", "gpt")]
    udev.add(f"{EXT_MAJOR}:{disk.head_minor}", disk.name, links, env)
    for part in disk.partitions:
        pname = disk.part_name(part)
        links = [f"disk/by-id/{n}-part{part.number}" for n in disk.by_id_names()]
        links.append(f"disk/by-path/{disk.by_path_name}-part{part.number}")
        links.append(f"disk/by-partuuid/{part.part_uuid}")
        fs_env = [("ID_FS_UUID", part.fs_uuid), ("ID_FS_UUID_ENC", part.fs_uuid)]
        if part.fs_type == "LVM2_member":
            links.append(f"disk/by-id/lvm-pv-uuid-{part.fs_uuid}")
            fs_env += [("ID_FS_VERSION", "LVM2 001"), ("ID_FS_TYPE", "LVM2_member"), ("ID_FS_USAGE", "raid")]
        else:
            links.append(f"disk/by-uuid/{part.fs_uuid}")
            version = "FAT32" if part.fs_type == "vfat" else "1.0"
            fs_env += [("ID_FS_VERSION", version), ("ID_FS_TYPE", part.fs_type), ("ID_FS_USAGE", "filesystem")]
        env = _nvme_env(disk) + [("ID_PART_TABLE_UUID", disk.table_uuid or ""), ("ID_PART_TABLE_TYPE", "gpt")]
        env += fs_env
        env += [
            ("ID_PART_ENTRY_SCHEME", "gpt"),
            ("ID_PART_ENTRY_UUID", part.part_uuid),
            ("ID_PART_ENTRY_TYPE", part.part_type),
            ("ID_PART_ENTRY_NUMBER", str(part.number)),
            ("ID_PART_ENTRY_OFFSET", str(part.start)),
            ("ID_PART_ENTRY_SIZE", str(part.sectors)),
            ("ID_PART_ENTRY_DISK", f"{EXT_MAJOR}:{disk.head_minor}"),
        ]
        udev.add(f"{EXT_MAJOR}:{part.minor}", pname, links, env)


def _nvme_env(disk: NvmeDisk) -> list[tuple[str, str]]:
    path_tag = disk.by_path_name.replace(":", "_").replace(".", "_")
    return [
        ("ID_SERIAL_SHORT", disk.serial),
        ("ID_WWN", f"eui.{disk.eui}"),
        ("ID_MODEL", disk.model),
        ("ID_REVISION", disk.firmware),
        ("ID_NSID", "1"),
        # systemd 255 sets ID_SERIAL twice; the nsid-suffixed assignment wins.
        ("ID_SERIAL", f"{disk.model}_{disk.serial}_1"),
        ("ID_PATH", disk.by_path_name),
        ("ID_PATH_TAG", path_tag),
    ]


def dm_udev(udev: Udev, lvm: dict[str, str]) -> None:
    links = [
        f"disk/by-id/dm-name-{lvm['dm_name']}",
        f"disk/by-id/dm-uuid-{lvm['dm_uuid']}",
        f"disk/by-uuid/{lvm['fs_uuid']}",
        f"mapper/{lvm['dm_name']}",
        "ubuntu-vg/ubuntu-lv",
    ]
    env = [
        ("DM_UDEV_DISABLE_LIBRARY_FALLBACK_FLAG", "1"),
        ("DM_UDEV_PRIMARY_SOURCE_FLAG", "1"),
        ("DM_UDEV_RULES_VSN", "2"),
        ("DM_NAME", lvm["dm_name"]),
        ("DM_UUID", lvm["dm_uuid"]),
        ("DM_SUSPENDED", "0"),
        ("DM_VG_NAME", "ubuntu-vg"),
        ("DM_LV_NAME", "ubuntu-lv"),
        ("ID_FS_UUID", lvm["fs_uuid"]),
        ("ID_FS_UUID_ENC", lvm["fs_uuid"]),
        ("ID_FS_VERSION", "1.0"),
        ("ID_FS_TYPE", "ext4"),
        ("ID_FS_USAGE", "filesystem"),
    ]
    udev.add(f"{DM_MAJOR}:0", "dm-0", links, env)


# --------------------------------------------------------------------------------------
# procfs
# --------------------------------------------------------------------------------------


@dataclass
class Mount:
    """One /proc/self/mountinfo line."""

    mount_id: int
    parent_id: int
    majmin: str
    mountpoint: str
    options: str
    optional: str
    fstype: str
    source: str
    super_options: str
    root: str = "/"


def mangle(path: str) -> str:
    """mountinfo's octal escapes for space, tab, newline and backslash."""
    return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")


def mountinfo_text(mounts: list[Mount]) -> str:
    lines = []
    for m in mounts:
        optional = f" {m.optional}" if m.optional else ""
        lines.append(
            f"{m.mount_id} {m.parent_id} {m.majmin} {mangle(m.root)} {mangle(m.mountpoint)} {m.options}{optional}"
            f" - {m.fstype} {mangle(m.source)} {m.super_options}"
        )
    return "\n".join(lines) + "\n"


def host_mounts(os_disk: NvmeDisk, share_parts: list[tuple[str, NvmeDisk, PartitionSpec]]) -> list[Mount]:
    """The mount table of a systemd host, pseudo filesystems and snaps included as noise."""
    esp, boot = os_disk.partitions[0], os_disk.partitions[1]
    nosuid = "rw,nosuid,nodev,noexec,relatime"
    mounts = [
        Mount(24, 29, "0:22", "/sys", nosuid, "shared:7", "sysfs", "sysfs", "rw"),
        Mount(25, 29, "0:23", "/proc", nosuid, "shared:12", "proc", "proc", "rw"),
        Mount(26, 29, "0:5", "/dev", "rw,nosuid,relatime", "shared:2", "devtmpfs", "udev",
              "rw,size=1056640540k,nr_inodes=264160135,mode=755,inode64"),
        Mount(27, 26, "0:24", "/dev/pts", "rw,nosuid,noexec,relatime", "shared:3", "devpts", "devpts",
              "rw,gid=5,mode=620,ptmxmode=000"),
        Mount(28, 29, "0:25", "/run", "rw,nosuid,nodev,noexec,relatime", "shared:5", "tmpfs", "tmpfs",
              "rw,size=211334684k,mode=755,inode64"),
        Mount(29, 1, f"{DM_MAJOR}:0", "/", "rw,relatime", "shared:1", "ext4", "/dev/mapper/ubuntu--vg-ubuntu--lv", "rw"),
        Mount(30, 24, "0:6", "/sys/kernel/security", nosuid, "shared:8", "securityfs", "securityfs", "rw"),
        Mount(31, 26, "0:26", "/dev/shm", "rw,nosuid,nodev,inode64", "shared:4", "tmpfs", "tmpfs", "rw,inode64"),
        Mount(32, 28, "0:27", "/run/lock", nosuid, "shared:6", "tmpfs", "tmpfs", "rw,size=5120k,inode64"),
        Mount(33, 24, "0:28", "/sys/fs/cgroup", nosuid, "shared:9", "cgroup2", "cgroup2",
              "rw,nsdelegate,memory_recursiveprot"),
        Mount(34, 24, "0:29", "/sys/fs/pstore", nosuid, "shared:10", "pstore", "pstore", "rw"),
        Mount(35, 24, "0:30", "/sys/firmware/efi/efivars", nosuid, "shared:11", "efivarfs", "efivarfs", "rw"),
        Mount(36, 24, "0:31", "/sys/fs/bpf", nosuid, "shared:13", "bpf", "bpf", "rw,mode=700"),
        Mount(37, 25, "0:32", "/proc/sys/fs/binfmt_misc", "rw,relatime", "shared:14", "autofs", "systemd-1",
              "rw,fd=32,pgrp=1,timeout=0,minproto=5,maxproto=5,direct,pipe_ino=4471"),
        Mount(38, 26, "0:33", "/dev/hugepages", "rw,nosuid,nodev,relatime", "shared:15", "hugetlbfs", "hugetlbfs",
              "rw,pagesize=1024M"),
        Mount(39, 26, "0:19", "/dev/mqueue", nosuid, "shared:16", "mqueue", "mqueue", "rw"),
        Mount(40, 24, "0:7", "/sys/kernel/debug", nosuid, "shared:17", "debugfs", "debugfs", "rw"),
        Mount(41, 24, "0:12", "/sys/kernel/tracing", nosuid, "shared:18", "tracefs", "tracefs", "rw"),
        Mount(42, 24, "0:34", "/sys/fs/fuse/connections", nosuid, "shared:19", "fusectl", "fusectl", "rw"),
        Mount(43, 24, "0:21", "/sys/kernel/config", nosuid, "shared:20", "configfs", "configfs", "rw"),
        Mount(63, 29, "7:0", "/snap/core22/1908", "ro,nodev,relatime", "shared:31", "squashfs", "/dev/loop0",
              "ro,errors=continue,threads=single"),
        Mount(66, 29, "7:1", "/snap/snapd/24505", "ro,nodev,relatime", "shared:33", "squashfs", "/dev/loop1",
              "ro,errors=continue,threads=single"),
        Mount(69, 29, f"{EXT_MAJOR}:{boot.minor}", "/boot", "rw,relatime", "shared:35", "ext4",
              f"/dev/{os_disk.part_name(boot)}", "rw"),
        Mount(72, 69, f"{EXT_MAJOR}:{esp.minor}", "/boot/efi", "rw,relatime", "shared:37", "vfat",
              f"/dev/{os_disk.part_name(esp)}",
              "rw,fmask=0077,dmask=0077,codepage=437,iocharset=iso8859-1,shortname=mixed,errors=remount-ro"),
    ]
    next_id, shared = 75, 39
    for mountpoint, disk, part in share_parts:
        mounts.append(
            Mount(next_id, 29, f"{EXT_MAJOR}:{part.minor}", mountpoint, "rw,relatime", f"shared:{shared}", "ext4",
                  f"/dev/{disk.part_name(part)}", "rw")
        )
        next_id += 3
        shared += 2
    mounts += [
        Mount(next_id + 20, 37, "0:40", "/proc/sys/fs/binfmt_misc", nosuid, "shared:91", "binfmt_misc",
              "binfmt_misc", "rw"),
        Mount(next_id + 44, 28, "0:47", "/run/user/1000", "rw,nosuid,nodev,relatime", "shared:424", "tmpfs",
              "tmpfs", "rw,size=211334680k,nr_inodes=52833671,mode=700,uid=1000,gid=1000,inode64"),
    ]
    return mounts


def swaps_text() -> str:
    """/proc/swaps as ``swap_show`` formats it (Ubuntu's default swap file)."""
    name = "/swap.img"
    return "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n" + f"{name:<40}file\t\t8388604\t\t0\t\t-2\n"


def meminfo_text() -> str:
    """/proc/meminfo of a 2 TiB host with 512 x 1 GiB huge pages reserved at boot."""
    kb = [
        ("MemTotal", 2113347412), ("MemFree", 1538765532), ("MemAvailable", 1561234876), ("Buffers", 412356),
        ("Cached", 18234560), ("SwapCached", 0), ("Active", 9876544), ("Inactive", 10234560),
        ("Active(anon)", 1234568), ("Inactive(anon)", 0), ("Active(file)", 8641976),
        ("Inactive(file)", 10234560), ("Unevictable", 31744), ("Mlocked", 27648), ("SwapTotal", 8388604),
        ("SwapFree", 8388604), ("Zswap", 0), ("Zswapped", 0), ("Dirty", 128), ("Writeback", 0),
        ("AnonPages", 1498765), ("Mapped", 612344), ("Shmem", 45678), ("KReclaimable", 2345678),
        ("Slab", 6543210), ("SReclaimable", 2345678), ("SUnreclaim", 4197532), ("KernelStack", 98304),
        ("PageTables", 34567), ("SecPageTables", 0), ("NFS_Unstable", 0), ("Bounce", 0), ("WritebackTmp", 0),
        ("CommitLimit", 796626854), ("Committed_AS", 6543210), ("VmallocTotal", 13743895347199),
        ("VmallocUsed", 1234567), ("VmallocChunk", 0), ("Percpu", 456192), ("HardwareCorrupted", 0),
        ("AnonHugePages", 204800), ("ShmemHugePages", 0), ("ShmemPmdMapped", 0), ("FileHugePages", 0),
        ("FilePmdMapped", 0), ("Unaccepted", 0),
    ]
    lines = [f"{name + ':':<16}{value:>8} kB" for name, value in kb]
    lines += [
        "HugePages_Total:     512",
        "HugePages_Free:      512",
        "HugePages_Rsvd:        0",
        "HugePages_Surp:        0",
        "Hugepagesize:    1048576 kB",
        "Hugetlb:        536870912 kB",
        "DirectMap4k:     1234568 kB",
        "DirectMap2M:    34568192 kB",
        "DirectMap1G:    2113929216 kB",
    ]
    return "\n".join(lines) + "\n"


def node_meminfo_text(node: int) -> str:
    total, free = 1056673706, 769382766  # half of /proc/meminfo each
    rows = [
        ("MemTotal", total), ("MemFree", free), ("MemUsed", total - free), ("SwapCached", 0),
        ("Active", 4938272), ("Inactive", 5117280), ("Active(anon)", 617284), ("Inactive(anon)", 0),
        ("Active(file)", 4320988), ("Inactive(file)", 5117280), ("Unevictable", 15872), ("Mlocked", 13824),
        ("Dirty", 64), ("Writeback", 0), ("FilePages", 9323458), ("Mapped", 306172), ("AnonPages", 749382),
        ("Shmem", 22839), ("KernelStack", 49152), ("PageTables", 17283), ("SecPageTables", 0),
        ("NFS_Unstable", 0), ("Bounce", 0), ("WritebackTmp", 0), ("KReclaimable", 1172839),
        ("Slab", 3271605), ("SReclaimable", 1172839), ("SUnreclaim", 2098766), ("AnonHugePages", 102400),
        ("ShmemHugePages", 0), ("ShmemPmdMapped", 0), ("FileHugePages", 0), ("FilePmdMapped", 0),
        ("Unaccepted", 0),
    ]
    lines = [f"Node {node} {name + ':':<16}{value:>8} kB" for name, value in rows]
    lines += [
        f"Node {node} HugePages_Total:   256",
        f"Node {node} HugePages_Free:    256",
        f"Node {node} HugePages_Surp:      0",
    ]
    return "\n".join(lines) + "\n"


def partitions_text(entries: list[BlockEntry]) -> str:
    """/proc/partitions: registration order, hidden path disks suppressed."""
    lines = ["major minor  #blocks  name", ""]
    for e in entries:
        lines.append(f"{e.major:4d}  {e.minor:7d} {e.sectors // 2:10d} {e.name}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# The host
# --------------------------------------------------------------------------------------


@dataclass
class Island:
    """One GPU island: root port -> PEX89000 upstream -> 3 downstream ports -> GPU, NIC, NVMe."""

    index: int
    root_bus: int

    @property
    def numa(self) -> int:
        return 0 if self.index < 4 else 1

    @property
    def gpu(self) -> str:
        return bdf(self.root_bus + 3)

    @property
    def nic(self) -> str:
        return bdf(self.root_bus + 4)

    @property
    def nvme(self) -> str:
        return bdf(self.root_bus + 5)

    @property
    def eui(self) -> str:
        return SLOT_EUIS[self.index]

    @property
    def nic_ifname(self) -> str:
        return f"ibp{self.root_bus + 4}s0"


def vf_address(pf: str, index: int, offset: int = 1, stride: int = 1) -> str:
    domain, bus, dev, fn = bdf_key(pf)
    devfn = (dev << 3 | fn) + offset + index * stride
    return bdf(bus, devfn >> 3, devfn & 7, domain)


class HostBuilder:
    """Lays out one host state and writes it; each ``_``-method owns one part of the tree."""

    def __init__(self, state: HostState, options: Options) -> None:
        self.state = state
        self.options = options
        self.numvfs = state.numvfs if options.numvfs is None else options.numvfs
        if not 0 <= self.numvfs <= 16:
            raise ValueError("numvfs must be 0..16 (sriov_totalvfs is 16)")
        self.islands = [Island(i, bus) for i, bus in enumerate(ISLAND_ROOT_BUSES)]
        self.pci = PciTree()
        self.netdevs: list[Netdev] = []
        self.ib_devices: list[IbDevice] = []
        self.disks: list[NvmeDisk] = []
        self.manifest: dict[str, Any] = {"variant": state.variant, "islands": []}

    # -- PCI topology ------------------------------------------------------------------

    def build_pci(self) -> None:
        self._chipset()
        for island in self.islands:
            self._island(island)
        self._nvswitches()
        self._bluefield()

    def _chipset(self) -> None:
        pci, rc = self.pci, PciTree.root_complex(0x00)
        pci.root_buses.add(0x00)
        intel = dict(subsystem_vendor=0x1028, subsystem_device=0x0C4F, numa=0)
        pci.add(PciFunc("0000:00:00.0", rc, 0x8086, 0x09A2, 0x060000, revision=0x20, **intel))
        pci.add(PciFunc("0000:00:14.0", rc, 0x8086, 0x1BCD, 0x0C0330, revision=0x11, driver="xhci_hcd", **intel))
        pci.add(PciFunc("0000:00:1f.0", rc, 0x8086, 0x1B81, 0x060100, revision=0x11, **intel))
        pci.add(PciFunc("0000:00:1f.4", rc, 0x8086, 0x1BC9, 0x0C0500, revision=0x11, driver="i801_smbus", **intel))
        # BOSS-N1 behind 00:1c.0, the LOM (eno8303/eno8403) behind 00:1c.4, the BMC VGA behind 00:1c.5.
        boss_rp = pci.bridge(rc, "0000:00:1c.0", 0x8086, 0x1BB8, 0, (0x01, 0x01), revision=0x11)
        lom_rp = pci.bridge(rc, "0000:00:1c.4", 0x8086, 0x1BBC, 0, (0x02, 0x02), revision=0x11)
        vga_rp = pci.bridge(rc, "0000:00:1c.5", 0x8086, 0x1BBD, 0, (0x03, 0x03), revision=0x11)
        pci.add(PciFunc("0000:01:00.0", boss_rp.path, 0x1B4B, 0x2241, 0x010802, 0x1028, 0x2151, 0,
                        revision=0x20, driver="nvme", link=("16.0 GT/s PCIe", 4)))
        for fn, ifname in ((0, "eno8303"), (1, "eno8403")):
            f = pci.add(PciFunc(bdf(0x02, 0, fn), lom_rp.path, 0x14E4, 0x165F, 0x020000, 0x1028, 0x08FF, 0,
                                driver="tg3", link=("5.0 GT/s PCIe", 1)))
            self.netdevs.append(Netdev(ifname, f.path, f"c4:cb:e1:a7:3e:{0x10 + fn:02x}", 1, 2 + fn, 1500,
                                       "up" if fn == 0 else "down", {"dev_port": "0"}))
        pci.add(PciFunc("0000:03:00.0", vga_rp.path, 0x102B, 0x0536, 0x030000, 0x1028, 0x0C4F, 0,
                        revision=0x04, driver="mgag200", extra={"boot_vga": "1"}))

    def _island(self, island: Island) -> None:
        pci, xx, numa = self.pci, island.root_bus, island.numa
        pci.root_buses.add(xx)
        rp = pci.bridge(PciTree.root_complex(xx), bdf(xx, 1), 0x8086, 0x352A, numa, (xx + 1, xx + 5),
                        revision=0x04, link=("32.0 GT/s PCIe", 16))
        up = pci.bridge(rp.path, bdf(xx + 1), 0x1000, 0xC030, numa, (xx + 2, xx + 5), subsystem_vendor=0x1000,
                        subsystem_device=0xA064, revision=0xB0, link=("32.0 GT/s PCIe", 16))
        downs = [
            pci.bridge(up.path, bdf(xx + 2, dev), 0x1000, 0xC030, numa, (xx + 3 + dev, xx + 3 + dev),
                       subsystem_vendor=0x1000, subsystem_device=0xA064, revision=0xB0,
                       link=("32.0 GT/s PCIe", 16))
            for dev in range(3)
        ]
        pci.add(PciFunc(island.gpu, downs[0].path, 0x10DE, 0x2335, 0x030200, 0x10DE, 0x18BE, numa,
                        revision=0xA1, driver=self.state.gpu_driver, link=("32.0 GT/s PCIe", 16),
                        extra={"resource": h200_resource(island.index)}))
        vfs = [vf_address(island.nic, k) for k in range(self.numvfs)]
        pf = pci.add(PciFunc(island.nic, downs[1].path, 0x15B3, 0x1021, 0x020700, 0x15B3, 0x0041, numa,
                             driver="mlx5_core", link=("32.0 GT/s PCIe", 16), virtfns=vfs,
                             sriov={"totalvfs": 16, "numvfs": self.numvfs, "offset": 1, "stride": 1,
                                    "vf_device": "101e", "drivers_autoprobe": 1}))
        pf_guid = guid_bytes(f"cx7-pf-{island.index}")
        self.netdevs.append(Netdev(island.nic_ifname, pf.path, f"{IPOIB_PREFIX}:{colon_bytes(pf_guid)}", 32,
                                   4 + island.index, 4092, "up", {"dev_port": "0", "dev_id": "0x0"}))
        self.ib_devices.append(IbDevice(f"mlx5_{island.index}", pf.path, pf_guid, "InfiniBand", "MT4129",
                                        lid=0x101 + island.index))
        for k, vf in enumerate(vfs):
            vfunc = pci.add(PciFunc(vf, downs[1].path, 0x15B3, 0x101E, 0x020700, 0x15B3, 0x0041, numa,
                                    driver=self.state.vf_driver, physfn=island.nic,
                                    extra={"resource": cx7_vf_resource(island.index, k)}))
            if self.state.vf_driver == "mlx5_core":
                vf_guid = guid_bytes(f"cx7-vf-{island.index}-{k}")
                serial = island.index * self.numvfs + k
                self.netdevs.append(Netdev(f"{island.nic_ifname}v{k}", vfunc.path,
                                           f"{IPOIB_PREFIX}:{colon_bytes(vf_guid)}", 32, 14 + serial, 4092, "up",
                                           {"dev_port": "0", "dev_id": "0x0"}))
                self.ib_devices.append(IbDevice(f"mlx5_{8 + serial}", vfunc.path, vf_guid, "InfiniBand",
                                                "MT4130", lid=0x201 + serial))
        nvme = pci.add(PciFunc(island.nvme, downs[2].path, 0x1344, 0x51C3, 0x010802, 0x1344, 0x3000, numa,
                               revision=0x01, driver="nvme", link=("16.0 GT/s PCIe", 4)))
        self.manifest["islands"].append(
            {"island": island.index, "gpu": island.gpu, "nic_pf": island.nic, "nic_vfs": vfs,
             "nic_ifname": island.nic_ifname, "nvme": nvme.address, "eui": island.eui}
        )

    def _nvswitches(self) -> None:
        pci, numa = self.pci, 1
        pci.root_buses.add(0xC7)
        rp = pci.bridge(PciTree.root_complex(0xC7), bdf(0xC7, 1), 0x8086, 0x352A, numa, (0xC8, 0xCD),
                        revision=0x04, link=("32.0 GT/s PCIe", 16))
        up = pci.bridge(rp.path, bdf(0xC8), 0x1000, 0xC030, numa, (0xC9, 0xCD), subsystem_vendor=0x1000,
                        subsystem_device=0xA064, revision=0xB0)
        for k in range(4):
            down = pci.bridge(up.path, bdf(0xC9, k), 0x1000, 0xC030, numa, (0xCA + k, 0xCA + k),
                              subsystem_vendor=0x1000, subsystem_device=0xA064, revision=0xB0)
            pci.add(PciFunc(bdf(0xCA + k), down.path, 0x10DE, 0x22A3, 0x068000, 0x10DE, 0x1796, numa,
                            revision=0xA1, driver=self.state.nvswitch_driver, link=("16.0 GT/s PCIe", 2)))

    def _bluefield(self) -> None:
        # Placed on its own root bus (e7): the islands use XX..XX+5, so pci0000:bb/0000:bc would collide
        # with the b7 island's NIC and NVMe.
        pci, numa = self.pci, 1
        pci.root_buses.add(0xE7)
        rp = pci.bridge(PciTree.root_complex(0xE7), bdf(0xE7, 1), 0x8086, 0x352A, numa, (0xE8, 0xE8),
                        revision=0x04, link=("32.0 GT/s PCIe", 16))
        for fn in (0, 1):
            f = pci.add(PciFunc(bdf(0xE8, 0, fn), rp.path, 0x15B3, 0xA2DC, 0x020000, 0x15B3, 0x0051, numa,
                                revision=0x01, driver="mlx5_core", link=("32.0 GT/s PCIe", 16),
                                sriov={"totalvfs": 16, "numvfs": 0, "offset": 2, "stride": 1,
                                       "vf_device": "101e", "drivers_autoprobe": 1}))
            ifname = f"enp{0xE8}s0f{fn}np{fn}"
            self.netdevs.append(Netdev(ifname, f.path, f"b8:3f:d2:8c:41:{0x5A + fn:02x}", 1, 12 + fn, 1500, "up",
                                       {"dev_port": "0", "phys_port_name": f"p{fn}"}))
            self.ib_devices.append(IbDevice(f"mlx5_bf{fn}", f.path, guid_bytes(f"bf3-{fn}"), "Ethernet",
                                            "MT41692", rate="200 Gb/sec (2X NDR)"))
        pci.add(PciFunc(bdf(0xE8, 0, 2), rp.path, 0x15B3, 0xC2D5, 0x080100, 0x15B3, 0x0051, numa, revision=0x01))
        self.manifest["bluefield"] = [bdf(0xE8, 0, fn) for fn in (0, 1, 2)]

    # -- NVMe ----------------------------------------------------------------------------

    def build_disks(self) -> None:
        boot = self.state.boot
        for island, number in zip(self.islands, BOOT_SLOT_NVME[boot]):
            serial = f"2317{island.eui[-8:].upper()}"
            disk = NvmeDisk(
                label=f"slot{island.index}", island=island.index, address=island.nvme,
                pci_path=self.pci.funcs[island.nvme].path, instance=number, model=SLOT_MODEL, serial=serial,
                firmware=SLOT_FIRMWARE, eui=island.eui, sectors=SLOT_SECTORS, numa=island.numa,
                subsysnqn=f"nqn.2016-08.com.micron:nvme:nvm-subsystem-sn-{serial}", cntlid=1,
            )
            # Boot "a" happened while the slot disks were still partitioned: their p1 minors were
            # taken at boot and stay taken in after-transition (the partitions are deleted, not renumbered).
            if boot == "a":
                disk.table_uuid = det_uuid(f"gpt-{disk.label}")
                last = (SLOT_SECTORS - 34 - 2048) // 2048 * 2048
                disk.partitions.append(PartitionSpec(1, 2048, last, LINUX_FS_TYPE, "ext4",
                                                     det_uuid(f"ext4-{disk.label}"), det_uuid(f"part-{disk.label}")))
            self.disks.append(disk)
        os_addr = "0000:01:00.0"
        os_disk = NvmeDisk(
            label="os", island=None, address=os_addr, pci_path=self.pci.funcs[os_addr].path,
            instance=BOOT_OS_NVME[boot], model=OS_MODEL, serial=OS_SERIAL, firmware=OS_FIRMWARE, eui=OS_EUI,
            sectors=OS_SECTORS, numa=0,
            subsysnqn="nqn.2014.08.org.nvmexpress:1b4b1028" + pad(OS_SERIAL, 20) + pad(OS_MODEL, 40), cntlid=0,
            table_uuid=det_uuid("gpt-os"),
        )
        p3_start = 2048 + 2097152 + 4194304
        p3_len = (OS_SECTORS - 34 - p3_start) // 2048 * 2048
        esp_uuid = det_hex("vfat-os", 8).upper()
        os_disk.partitions = [
            PartitionSpec(1, 2048, 2097152, ESP_TYPE, "vfat", f"{esp_uuid[:4]}-{esp_uuid[4:]}", det_uuid("part-os-1")),
            PartitionSpec(2, 2099200, 4194304, LINUX_FS_TYPE, "ext4", det_uuid("ext4-os-boot"), det_uuid("part-os-2")),
            PartitionSpec(3, p3_start, p3_len, LVM_TYPE, "LVM2_member", lvm_dashed(det_lvm_id("pv-os")),
                          det_uuid("part-os-3")),
        ]
        self.disks.append(os_disk)
        allocate_minors(self.disks, boot, self.options.multipath)
        if not self.state.slot_partitions:
            for disk in self.disks:
                if disk.island is not None:
                    disk.partitions = []
                    disk.table_uuid = None

    @property
    def os_disk(self) -> NvmeDisk:
        return next(d for d in self.disks if d.island is None)

    # -- writing -------------------------------------------------------------------------

    def write(self, tree: Tree) -> dict[str, Any]:
        self.build_pci()
        self.build_disks()
        drivers = ["pcieport", "mlx5_core", "nvme", "mgag200", "tg3", "vfio-pci", "xhci_hcd", "i801_smbus"]
        if self.state.nvidia_loaded:
            drivers += ["nvidia", "nvidia-nvswitch"]
        groups = self.pci.write(tree, drivers, self.options)
        netdevs = [Netdev("lo", None, "00:00:00:00:00:00", 772, 1, 65536, "unknown")] + self.netdevs + VIRTUAL_NETDEVS
        for nd in netdevs:
            write_netdev(tree, nd)
        write_slice_network(tree, self.state, netdevs, [i.nic_ifname for i in self.islands])
        for ib in self.ib_devices:
            write_ib_device(tree, ib)
        self._write_storage(tree)
        self._write_system(tree, groups)
        self._finish_manifest(groups)
        return self.manifest

    def _write_storage(self, tree: Tree) -> None:
        mp = self.options.multipath
        os_disk = self.os_disk
        pv = os_disk.partitions[2]
        pv_name, pv_dir = os_disk.part_name(pv), os_disk.part_dir(pv, mp)
        vg_id, lv_id = det_lvm_id("vg-ubuntu"), det_lvm_id("lv-ubuntu")
        lvm = {"dm_name": "ubuntu--vg-ubuntu--lv", "dm_uuid": f"LVM-{vg_id}{lv_id}", "fs_uuid": det_uuid("ext4-root")}
        holders = {pv_name: ["/sys/devices/virtual/block/dm-0"]}
        registered: list[tuple[int, list[BlockEntry]]] = []
        udev = Udev()
        for disk in sorted(self.disks, key=lambda d: d.instance):
            entries = write_nvme_disk(tree, disk, self.options, holders)
            registered.append((disk.head_minor, entries))
            disk_udev(udev, disk)
        dm = write_dm_root(tree, pv_dir, pv_name, lvm)
        dm_udev(udev, lvm)
        blocks = [e for _, entries in sorted(registered, key=lambda r: r[0]) for e in entries] + [dm]
        for e in blocks:
            tree.link(f"/sys/class/block/{e.name}", e.sysfs)
            tree.link(f"/sys/dev/block/{e.major}:{e.minor}", e.sysfs)
            if not e.is_partition:  # /sys/block lists whole disks; partitions are their subdirs
                tree.link(f"/sys/block/{e.name}", e.sysfs)
        udev.write(tree)
        tree.text("/proc/partitions", partitions_text(blocks))

        share_parts = []
        if self.state.slot_partitions:
            for disk in sorted(self.disks, key=lambda d: d.instance):
                if disk.instance in SHARE_MOUNTS and disk.island is not None:
                    share_parts.append((SHARE_MOUNTS[disk.instance], disk, disk.partitions[0]))
        tree.text("/proc/self/mountinfo", mountinfo_text(host_mounts(os_disk, share_parts)))
        tree.text("/proc/swaps", swaps_text())
        tree.text("/etc/fstab", self._fstab(lvm, os_disk, share_parts))
        self.manifest["os_disk"] = {"name": os_disk.name, "address": os_disk.address, "eui": os_disk.eui}
        self.manifest["mounts"] = {mp_: disk.part_name(part) for mp_, disk, part in share_parts}
        by_label = {d.label: d for d in self.disks}
        for row in self.manifest["islands"]:
            disk = by_label[f"slot{row['island']}"]
            row["kernel_name"] = disk.name
            row["majmin"] = f"{EXT_MAJOR}:{disk.head_minor}"

    @staticmethod
    def _fstab(lvm: dict[str, str], os_disk: NvmeDisk, share_parts: list[tuple[str, NvmeDisk, PartitionSpec]]) -> str:
        # Comments keep the install-time kernel names (boot "a": nvme4), as curtin wrote them.
        esp, boot = os_disk.partitions[0], os_disk.partitions[1]
        lines = [
            "# /etc/fstab: static file system information.",
            "#",
            "# Use 'blkid' to print the universally unique identifier for a",
            "# device; this may be used with UUID= as a more robust way to name devices",
            "# that works even if disks are added and removed. See fstab(5).",
            "#",
            "# <file system> <mount point>   <type>  <options>       <dump>  <pass>",
            "# / was on /dev/ubuntu-vg/ubuntu-lv during curtin installation",
            f"/dev/disk/by-id/dm-uuid-{lvm['dm_uuid']} / ext4 defaults 0 1",
            "# /boot was on /dev/nvme4n1p2 during curtin installation",
            f"/dev/disk/by-uuid/{boot.fs_uuid} /boot ext4 defaults 0 1",
            "# /boot/efi was on /dev/nvme4n1p1 during curtin installation",
            f"/dev/disk/by-uuid/{esp.fs_uuid} /boot/efi vfat defaults 0 1",
            "/swap.img\tnone\tswap\tsw\t0\t0",
        ]
        for mountpoint, _disk, part in share_parts:
            lines.append(f"UUID={part.fs_uuid} {mountpoint} ext4 defaults,nofail 0 2")
        return "\n".join(lines) + "\n"

    def _write_system(self, tree: Tree, groups: dict[str, int]) -> None:
        # NUMA, memory, huge pages.
        node = "/sys/devices/system/node"
        for name in ("online", "possible", "has_cpu", "has_memory", "has_normal_memory"):
            tree.attr(f"{node}/{name}", "0-1")
        for n in (0, 1):
            nd = f"{node}/node{n}"
            tree.attr(f"{nd}/cpulist", NUMA_CPULIST[n])
            tree.attr(f"{nd}/cpumap", NUMA_CPUMASK[n])
            tree.attr(f"{nd}/distance", "10 21" if n == 0 else "21 10")
            tree.text(f"{nd}/meminfo", node_meminfo_text(n))
            for size, count in (("1048576kB", 256), ("2048kB", 0)):
                hp = f"{nd}/hugepages/hugepages-{size}"
                tree.attr(f"{hp}/nr_hugepages", count)
                tree.attr(f"{hp}/free_hugepages", count)
                tree.attr(f"{hp}/surplus_hugepages", 0)
        for size, count in (("1048576kB", 512), ("2048kB", 0)):
            hp = f"/sys/kernel/mm/hugepages/hugepages-{size}"
            for name, value in (("nr_hugepages", count), ("free_hugepages", count), ("resv_hugepages", 0),
                                ("surplus_hugepages", 0), ("nr_overcommit_hugepages", 0)):
                tree.attr(f"{hp}/{name}", value)
        cpu = "/sys/devices/system/cpu"
        for name in ("online", "possible", "present"):
            tree.attr(f"{cpu}/{name}", "0-223")

        # Firmware identity (/sys/class/dmi/id is itself a link, as on the host).
        dmi = "/sys/devices/virtual/dmi/id"
        for name, value in (
            ("sys_vendor", "Dell Inc."), ("product_name", "PowerEdge XE9680"), ("product_serial", "8KQ2X34"),
            ("product_uuid", "4c4c4544-004b-5110-8032-b8c04f583334"), ("product_family", "PowerEdge"),
            ("board_vendor", "Dell Inc."), ("board_name", "0X2JHM"), ("board_serial", ".8KQ2X34.CNFCP0041U00AB."),
            ("bios_vendor", "Dell Inc."), ("bios_version", "2.7.5"), ("bios_date", "02/18/2025"),
            ("chassis_vendor", "Dell Inc."), ("chassis_type", "23"), ("chassis_serial", "8KQ2X34"),
        ):
            tree.attr(f"{dmi}/{name}", value)
        tree.link("/sys/class/dmi/id", dmi)

        # Modules: present as directories, as /sys/module shows loaded ones.
        # Ubuntu builds nvme/nvme_core in: their dirs exist (they have parameters) without initstate.
        builtin = {
            "nvme": {"parameters/io_queue_depth": "1024"},
            "nvme_core": {"parameters/multipath": "Y" if self.options.multipath else "N"},
        }
        loadable: dict[str, dict[str, str]] = {
            "vfio_pci": {}, "vfio_iommu_type1": {}, "vfio": {}, "kvm": {}, "kvm_intel": {"parameters/nested": "Y"},
            "mlx5_core": {}, "mlx5_ib": {}, "mgag200": {}, "tg3": {}, "xhci_pci": {}, "i2c_i801": {},
        }
        if self.state.nvidia_loaded:
            loadable["nvidia"] = {"version": "570.124.06"}
        for name, attrs in sorted(loadable.items()):
            tree.attr(f"/sys/module/{name}/initstate", "live")
            tree.attr(f"/sys/module/{name}/refcnt", "0")
            for key, value in attrs.items():
                tree.attr(f"/sys/module/{name}/{key}", value)
        for name, attrs in sorted(builtin.items()):
            for key, value in attrs.items():
                tree.attr(f"/sys/module/{name}/{key}", value)

        # /dev markers: device nodes cannot be recorded, so regular empty files stand in.
        tree.text("/dev/kvm", "")
        tree.text("/dev/vfio/vfio", "")
        for address in sorted(self.pci.funcs, key=bdf_key):
            if self.pci.funcs[address].driver == "vfio-pci":
                tree.text(f"/dev/vfio/{groups[address]}", "")

        # procfs and /etc.
        tree.attr("/proc/cmdline", CMDLINE)
        tree.text("/proc/meminfo", meminfo_text())
        tree.attr("/proc/sys/kernel/osrelease", KERNEL_RELEASE)
        tree.attr("/proc/sys/kernel/hostname", HOSTNAME)
        tree.attr("/etc/hostname", HOSTNAME)
        tree.attr("/etc/machine-id", det_hex(f"machine-id-{HOSTNAME}", 32))
        tree.text(
            "/etc/os-release",
            'PRETTY_NAME="Ubuntu 24.04.2 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\n'
            'VERSION="24.04.2 LTS (Noble Numbat)"\nVERSION_CODENAME=noble\nID=ubuntu\nID_LIKE=debian\n'
            'HOME_URL="https://www.ubuntu.com/"\nSUPPORT_URL="https://help.ubuntu.com/"\n'
            'BUG_REPORT_URL="https://bugs.launchpad.net/ubuntu/"\n'
            'PRIVACY_POLICY_URL="https://www.ubuntu.com/legal/terms-and-policies/privacy-policy"\n'
            "UBUNTU_CODENAME=noble\nLOGO=ubuntu-logo\n",
        )

    def _finish_manifest(self, groups: dict[str, int]) -> None:
        for row in self.manifest["islands"]:
            row["gpu_iommu_group"] = groups[row["gpu"]]
        self.manifest["nvswitches"] = [bdf(0xCA + k) for k in range(4)]


# --------------------------------------------------------------------------------------
# Slice network: the recorder's command outputs and the files the parity checks read
# --------------------------------------------------------------------------------------

# ifindex far above any PF/VF netdev (VFs take 14.. up to 16 per PF).
VIRTUAL_NETDEVS = [
    Netdev("ovs-system", None, "9a:1e:52:6c:0d:71", 1, 200, 1500, "down"),
    Netdev("ovsbr0", None, "5e:3b:a4:27:90:4c", 1, 201, 1500, "unknown"),
    Netdev("tmfifo_net0", None, "00:1a:ca:ff:ff:02", 1, 202, 1500, "up"),
]
LINK_TYPES = {1: "ether", 32: "infiniband", 772: "loopback"}


def _addresses(state: HostState, ib_pfs: list[str]) -> dict[str, list[tuple[str, int]]]:
    out = {"lo": [("127.0.0.1", 8)], UPLINK[0]: [(UPLINK[1], UPLINK[2])], "ovsbr0": [SLICE_GATEWAY],
           "tmfifo_net0": [TMFIFO_ADDR]}
    for rail, ifname in enumerate(ib_pfs):
        out[ifname] = [(IPOIB_RAIL.format(rail=rail), 24)]
    return out


def _ip_link_rows(netdevs: list[Netdev]) -> list[dict[str, Any]]:
    rows = []
    for nd in sorted(netdevs, key=lambda n: n.ifindex):
        up = nd.operstate in ("up", "unknown")
        flags = (["LOOPBACK"] if nd.name == "lo" else ["BROADCAST", "MULTICAST"]) + (["UP", "LOWER_UP"] if up else [])
        rows.append({"ifindex": nd.ifindex, "ifname": nd.name, "flags": flags, "mtu": nd.mtu,
                     "operstate": nd.operstate.upper(), "link_type": LINK_TYPES[nd.if_type], "address": nd.address})
    return rows


def _ip_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, separators=(",", ":")) + "\n"


def write_slice_network(tree: Tree, state: HostState, netdevs: list[Netdev], ib_pfs: list[str]) -> None:
    """ip -j addr/link/route, the NAT rulesets, ip_forward, dnsmasq, IPoIB netplan, baseline unit, OVMF."""
    meta = "/.gpuaas-fixture/commands"
    addrs = _addresses(state, ib_pfs)
    links = _ip_link_rows(netdevs)
    tree.text(f"{meta}/ip-link.out", _ip_json(links))
    with_addrs = []
    for row in links:
        info = [{"family": "inet", "local": ip, "prefixlen": plen, "scope": "host" if row["ifname"] == "lo" else "global",
                 "label": row["ifname"]} for ip, plen in addrs.get(row["ifname"], [])]
        with_addrs.append({**row, "addr_info": info})
    tree.text(f"{meta}/ip-addr.out", _ip_json(with_addrs))
    routes = [{"dst": "default", "gateway": UPLINK[3], "dev": UPLINK[0], "protocol": "static", "flags": []}]
    for ifname, entries in sorted(addrs.items()):
        for ip, plen in entries:
            if ifname == "lo":
                continue
            net = f"{'.'.join(ip.split('.')[:3])}.{int(ip.split('.')[3]) & (0xFF << (32 - plen)) & 0xFF}/{plen}"
            routes.append({"dst": net, "dev": ifname, "protocol": "kernel", "scope": "link", "prefsrc": ip, "flags": []})
    tree.text(f"{meta}/ip-route.out", _ip_json(routes))
    masq = [f"-A POSTROUTING -s {SLICE_SUBNET} -j MASQUERADE"] if state.nat else []
    tree.text(f"{meta}/iptables-save-nat.out", "\n".join([
        f"# Generated by iptables-save v1.8.10 (nf_tables) on {RECORDED_AT}", "*nat",
        ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]", ":POSTROUTING ACCEPT [0:0]",
        *masq, "COMMIT", f"# Completed on {RECORDED_AT}"]) + "\n")
    # iptables-nft rules appear in nft's JSON as opaque xt entries (docs/testing.md): the proof is iptables'.
    nft: list[dict[str, Any]] = [
        {"metainfo": {"version": "1.0.9", "release_name": "Old Doc Yak #3", "json_schema_version": 1}},
        {"table": {"family": "ip", "name": "nat", "handle": 1}},
        {"chain": {"family": "ip", "table": "nat", "name": "POSTROUTING", "handle": 1, "type": "nat",
                   "hook": "postrouting", "prio": 100, "policy": "accept"}},
    ]
    if state.nat:
        nft.append({"rule": {"family": "ip", "table": "nat", "chain": "POSTROUTING", "handle": 2, "expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                       "right": {"prefix": {"addr": "10.100.0.0", "len": 24}}}},
            {"counter": {"packets": 0, "bytes": 0}}, {"xt": None}]}})
    tree.text(f"{meta}/nft-ruleset.out", json.dumps({"nftables": nft}, separators=(",", ":")) + "\n")

    tree.attr("/proc/sys/net/ipv4/ip_forward", 1)
    tree.text("/etc/dnsmasq.d/gpuaas-slice.conf", "\n".join([
        "# gpuaas slice private network (gpuaas-slice-host-net-baseline)",
        "interface=ovsbr0", "bind-interfaces", "except-interface=lo",
        "dhcp-range=10.100.0.10,10.100.0.250,255.255.255.0,12h",
        "dhcp-option=option:router,10.100.0.1", "dhcp-option=option:dns-server,1.1.1.1,8.8.8.8",
        "dhcp-hostsdir=/var/lib/gpuaas/dnsmasq-hosts"]) + "\n")
    rails = "".join(f"    {ifname}:\n      dhcp4: false\n      mtu: 4092\n      addresses: [{IPOIB_RAIL.format(rail=rail)}/24]\n"
                    for rail, ifname in enumerate(ib_pfs))
    tree.text("/etc/netplan/60-ipoib.yaml", "# IPoIB fabric rails (site/profile bootstrap)\nnetwork:\n  version: 2\n"
              "  ethernets:\n" + rails)
    tree.text("/etc/systemd/system/gpuaas-slice-host-net-baseline.service", "\n".join([
        "[Unit]", "Description=GPUaaS slice host network baseline (ovsbr0, NAT, tmfifo)",
        "After=network-online.target openvswitch-switch.service", "", "[Service]", "Type=oneshot",
        "ExecStart=/usr/local/sbin/gpuaas-slice-host-net-baseline", "RemainAfterExit=yes", "",
        "[Install]", "WantedBy=multi-user.target"]) + "\n")
    for name in ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"):  # firmware images: presence is the evidence
        tree.text(f"/usr/share/OVMF/{name}", "")


# --------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------


def fixture_md(state: HostState, options: Options, manifest: dict[str, Any]) -> str:
    non_default = [f"{f.name}={getattr(options, f.name)!r}" for f in fields(Options)
                   if getattr(options, f.name) != f.default]
    lines = [
        f"# {FIXTURE_PREFIX}{state.variant}",
        "",
        f"Host state: {state.summary}.",
        "",
        "Dell PowerEdge XE9680, 8x NVIDIA H200, Ubuntu 24.04, kernel " + KERNEL_RELEASE
        + ", native NVMe multipath" + ("" if options.multipath else " (OFF in this variant)") + ", LVM root.",
        "Synthesised, not recorded: no H200 host was available to `gpuaas-agent record-fixture`, so",
        "`lab/synth_host.py` wrote this tree in the kernel's sysfs/procfs/udev layout.",
        "Empty directories (e.g. an unused disk's `holders/`) are "
        + ("written here." if options.empty_dirs else "absent, as in any recording kept in git."),
        "",
        "| island | GPU | NIC PF | NIC VFs | NVMe | kernel name | EUI |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in manifest["islands"]:
        lines.append(
            f"| {row['island']} | {row['gpu']} | {row['nic_pf']} | {', '.join(row['nic_vfs']) or '-'} | "
            f"{row['nvme']} | {row['kernel_name']} | {row['eui']} |"
        )
    os_row = manifest["os_disk"]
    lines += ["", f"OS disk: {os_row['name']} ({OS_MODEL}, {os_row['address']}, eui {os_row['eui']})."]
    if manifest["mounts"]:
        lines.append("Mounted slot partitions: " + ", ".join(f"{k} <- {v}" for k, v in manifest["mounts"].items()) + ".")
    if non_default:
        lines.append("Generator options: " + ", ".join(non_default) + ".")
    lines += [
        "",
        f"Generated at first use from `fixtures/hosts/{FIXTURE_PREFIX}{state.variant}.synth.json` by",
        f"`lab.fixture_hosts.fixture_host(name)` (this tree alone: `python lab/synth_host.py OUT_DIR --variant {state.variant}`).",
    ]
    return "\n".join(lines) + "\n"


def build(out_dir: str | os.PathLike[str], variant: str, *, overwrite: bool = False, **options: Any) -> dict[str, Any]:
    """Write one host state into ``out_dir``; returns a manifest of what went where.

    ``options`` are the fields of :class:`Options` (``multipath``,
    ``absolute_links``, ``empty_dirs``, ...). An existing non-empty
    ``out_dir`` is replaced only with ``overwrite=True`` and only when it is a
    tree this script wrote (it has ``FIXTURE.md``).
    """
    state = STATES[variant_name(variant)]
    opts = Options(**options)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force)")
        if not (out / "FIXTURE.md").is_file():
            raise FileExistsError(f"{out} has no FIXTURE.md: refusing to replace a tree this script did not write")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    tree = Tree(out, opts)
    manifest = HostBuilder(state, opts).write(tree)
    tree.text("/FIXTURE.md", fixture_md(state, opts, manifest))
    return manifest


def build_all(hosts_dir: str | os.PathLike[str]) -> list[Path]:
    """Write every variant under ``hosts_dir``, each under its fixture name."""
    written = []
    for variant in VARIANTS:
        path = Path(hosts_dir) / f"{FIXTURE_PREFIX}{variant}"
        build(path, variant, overwrite=True)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", help="directory to write one host state into")
    parser.add_argument("--variant", choices=VARIANTS + tuple(FIXTURE_PREFIX + v for v in VARIANTS))
    parser.add_argument("--all", metavar="HOSTS_DIR", help="write every variant under HOSTS_DIR")
    parser.add_argument("--no-multipath", action="store_true", help="classic NVMe layout (nvme_core.multipath=N)")
    parser.add_argument("--absolute-links", action="store_true", help="write every link as an absolute host path")
    parser.add_argument("--empty-dirs", action="store_true", help="also write empty holders/ and slaves/ dirs")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if this script wrote it before")
    args = parser.parse_args(argv)
    if args.all:
        if args.out_dir or args.variant or args.no_multipath or args.absolute_links or args.empty_dirs:
            parser.error("--all takes only HOSTS_DIR")
        for path in build_all(args.all):
            print(path)
        return 0
    if not args.out_dir or not args.variant:
        parser.error("give OUT_DIR and --variant, or --all HOSTS_DIR")
    try:
        build(args.out_dir, args.variant, overwrite=args.force, multipath=not args.no_multipath,
              absolute_links=args.absolute_links, empty_dirs=args.empty_dirs)
    except FileExistsError as exc:
        print(f"synth_host: {exc}", file=sys.stderr)
        return 2
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
