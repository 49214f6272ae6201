"""The guest's PCIe/NUMA layout of a passthrough domain: which host node each slot's devices sit on, as the guest sees it.

Without it, a multi-GPU guest sees every GPU, VF and NVMe hanging off one
root complex with no NUMA node: ``nvidia-smi topo -m`` shows SYS between every
pair, NCCL and GPUDirect RDMA choose slow paths, and a 24-vCPU-per-GPU guest
loses the locality the host slot was built around (seed 002's tuned-profile
measurements). The layout mirrors the host:

* one guest NUMA cell per host NUMA node used, its vCPUs pinned to that node's
  CPUs and its memory (1 GiB pages) taken strictly from that node;
* one ``pcie-expander-bus`` (QEMU ``pxb-pcie``) per cell, carrying the cell's
  ``<node>``, and behind it one ``pcie-root-port`` per device, so each GPU, its
  paired VF and its NVMe are on their own node's host bridge in the guest;
* a 64-bit MMIO window for OVMF (``X-PciMmio64Mb``) large enough for every
  device's 64-bit BARs, as read from sysfs by discovery (an H200's 256 GiB
  framebuffer BAR does not fit OVMF's default window);
* a memlock/hard limit that covers VFIO pinning all guest RAM.

Pure: a :class:`DomainSpec` in, a :class:`GuestLayout` out; ``domain_xml`` turns it into XML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuaas_agent.contract.domain import DomainSpec, DomainSpecError, GuestSlot, cpulist_cpus
from gpuaas_agent.contract.runtime import HUGEPAGE_1G_MIB
from gpuaas_agent.discovery.bars import mmio64_bytes

# Guest bus numbers: expander i gets EXPANDER_BUS_BASE + i * EXPANDER_BUS_STRIDE and its root ports the
# numbers after it. pcie-root keeps 0x00-0x7f for what libvirt places itself (vNIC, cdrom, rng ports).
EXPANDER_BUS_BASE = 0x80
EXPANDER_BUS_STRIDE = 0x20
MAX_CELLS = (0x100 - EXPANDER_BUS_BASE) // EXPANDER_BUS_STRIDE  # 4 host NUMA nodes per guest
MAX_PORTS_PER_CELL = EXPANDER_BUS_STRIDE - 1  # each root port takes one bus number after the expander's
# libvirt's own rule for a VFIO guest's memlock limit (qemuDomainGetMemLockLimitBytes): guest RAM + 1 GiB.
# We add 1 GiB per GPU: the hard limit is also the memory cgroup limit, and QEMU's VFIO/MSI-X bookkeeping grows
# with the device count; hugepages are charged to hugetlb, not to this limit, so the margin is QEMU's own.
MEMLOCK_BASE_MIB = 1024
MEMLOCK_PER_GPU_MIB = 1024
# OVMF's 64-bit window must also hold the small 64-bit BARs of the VFs and of hotplug reservations; a window
# exactly the size of the GPU apertures leaves none, so the total is rounded to the next power of two above it.
MMIO_MIN_MIB = 32 * 1024  # never below OVMF's default
# Preallocation threads: VFIO pins every page at start; touching them first from several threads shortens it
# (bench/bench_guest_start.py). Capped: more threads than this only contend on the node's memory controller.
MAX_PREALLOC_THREADS = 16


@dataclass(frozen=True)
class RootPort:
    """One guest root port behind an expander, and the host device plugged into it."""

    index: int  # controller index (also the guest bus number its device appears on: libvirt's bus='index')
    chassis: int
    port: int
    expander_index: int
    kind: str  # gpu | fabric_vf | nvme
    slot_index: int
    host_address: str | None  # PCI address for gpu/fabric_vf
    nvme_device: str | None
    boot: bool = False


@dataclass(frozen=True)
class GuestCell:
    """A guest NUMA cell, the host node it is pinned to, and its expander."""

    cell_id: int
    host_node: int
    host_cpulist: str
    vcpu_first: int
    vcpus: int
    memory_mib: int
    expander_index: int
    expander_bus: int


@dataclass(frozen=True)
class GuestLayout:
    cells: tuple[GuestCell, ...]
    root_ports: tuple[RootPort, ...]
    vcpus: int
    memory_mib: int
    mmio64_mib: int
    memlock_kib: int
    prealloc_threads: int

    @property
    def vcpu_cpuset(self) -> str:
        """The union of the cells' host cpulists, as libvirt's cpuset takes it (node order)."""
        return ",".join(c.host_cpulist for c in self.cells)


def _next_pow2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def mmio64_window_mib(slots: list[GuestSlot]) -> int:
    """The OVMF 64-bit window in MiB: each device's 64-bit BARs at their alignment, summed, next power of two above."""
    needed = 0
    for slot in slots:
        needed += mmio64_bytes(slot.gpu_bars) + mmio64_bytes(slot.fabric_vf_bars)
    needed_mib = -(-needed // (1 << 20))
    # "above": a window exactly filled by the GPUs has no room for the root ports' own reservations.
    return max(MMIO_MIN_MIB, _next_pow2(needed_mib + 1))


def plan_layout(spec: DomainSpec) -> GuestLayout:
    """Refuse a spec whose slots cannot form one guest (duplicate devices, unknown BARs, NUMA limits); else lay it out."""
    profile = spec.profile
    slots = spec.guest_slots()
    evidence = {"allocation_id": spec.allocation_id, "slot_indexes": [s.slot_index for s in slots],
                "profile": profile.name}
    _check_unique(slots, evidence)
    for slot in slots:
        if not slot.gpu_bars:
            raise DomainSpecError(
                f"the BAR sizes of GPU {slot.gpu_pci_address} (slot {slot.slot_index}) are unknown: the guest's "
                "64-bit MMIO window cannot be sized",
                code="gpu_bars_unknown",
                evidence={**evidence, "slot_index": slot.slot_index, "gpu": slot.gpu_pci_address},
            )
    by_node: dict[int, list[GuestSlot]] = {}
    cpulists: dict[int, str] = {}
    for slot in slots:
        assert slot.numa_node is not None and slot.numa_cpulist is not None  # check_slot ran first
        by_node.setdefault(slot.numa_node, []).append(slot)
        cpulists[slot.numa_node] = slot.numa_cpulist
    if len(by_node) > MAX_CELLS:
        raise DomainSpecError(
            f"slots span {len(by_node)} NUMA nodes; one guest takes at most {MAX_CELLS}",
            code="too_many_numa_nodes",
            evidence={**evidence, "numa_nodes": sorted(by_node), "max": MAX_CELLS},
        )
    cells: list[GuestCell] = []
    ports: list[RootPort] = []
    next_vcpu = 0
    expander_count = len(by_node)
    next_controller = 1 + expander_count  # 0 is pcie-root, 1..E the expanders, root ports after them
    for cell_id, node in enumerate(sorted(by_node)):
        node_slots = by_node[node]
        vcpus = profile.vcpus * len(node_slots)
        node_cpus = len(cpulist_cpus(cpulists[node]))
        if vcpus > node_cpus:
            raise DomainSpecError(
                f"{len(node_slots)} slots of profile {profile.name} need {vcpus} vCPUs on NUMA node {node}; "
                f"it has {node_cpus}",
                code="vcpus_exceed_numa_node",
                evidence={**evidence, "numa_node": node, "vcpus": vcpus, "node_cpus": node_cpus},
            )
        devices_on_node = 3 * len(node_slots)
        if devices_on_node > MAX_PORTS_PER_CELL:
            raise DomainSpecError(
                f"{devices_on_node} devices on NUMA node {node}; one expander carries at most {MAX_PORTS_PER_CELL}",
                code="too_many_devices_on_node",
                evidence={**evidence, "numa_node": node, "devices": devices_on_node, "max": MAX_PORTS_PER_CELL},
            )
        expander_index = 1 + cell_id
        cells.append(GuestCell(cell_id=cell_id, host_node=node, host_cpulist=cpulists[node], vcpu_first=next_vcpu,
                               vcpus=vcpus, memory_mib=profile.memory_mib * len(node_slots),
                               expander_index=expander_index,
                               expander_bus=EXPANDER_BUS_BASE + cell_id * EXPANDER_BUS_STRIDE))
        next_vcpu += vcpus
        port_number = 0
        for slot in node_slots:
            for kind, address, disk in (("gpu", slot.gpu_pci_address, None),
                                        ("fabric_vf", slot.fabric_vf_pci_address, None),
                                        ("nvme", None, slot.nvme_device)):
                ports.append(RootPort(index=next_controller, chassis=next_controller, port=port_number,
                                      expander_index=expander_index, kind=kind, slot_index=slot.slot_index,
                                      host_address=address, nvme_device=disk,
                                      boot=kind == "nvme" and slot is slots[0]))
                next_controller += 1
                port_number += 1
    memory_mib = profile.memory_mib * len(slots)
    if profile.hugepages_1g and memory_mib % HUGEPAGE_1G_MIB:
        raise DomainSpecError(  # per-slot size already checked; kept for a future profile catalogue
            f"memory {memory_mib} MiB is not a multiple of the 1 GiB hugepage size",
            code="memory_not_hugepage_multiple", evidence={**evidence, "memory_mib": memory_mib})
    gpus = len(slots)
    return GuestLayout(
        cells=tuple(cells),
        root_ports=tuple(ports),
        vcpus=next_vcpu,
        memory_mib=memory_mib,
        mmio64_mib=mmio64_window_mib(slots),
        memlock_kib=(memory_mib + MEMLOCK_BASE_MIB + MEMLOCK_PER_GPU_MIB * gpus) * 1024,
        prealloc_threads=min(next_vcpu, MAX_PREALLOC_THREADS),
    )


def _check_unique(slots: list[GuestSlot], evidence: dict[str, Any]) -> None:
    """Two slots naming one GPU, VF, disk or slot index would hand one device to the guest twice."""
    seen: dict[str, int] = {}
    for slot in slots:
        # gpu and vf share the "pci:" key space: a VF address given as another slot's GPU is a duplicate too.
        for key in (f"slot:{slot.slot_index}", f"pci:{slot.gpu_pci_address}", f"pci:{slot.fabric_vf_pci_address}",
                    f"disk:{slot.nvme_device}"):
            if key.endswith(":None"):
                continue
            if key in seen:
                raise DomainSpecError(
                    f"{key.split(':', 1)[1]} is named by slot {seen[key]} and slot {slot.slot_index}",
                    code="duplicate_slot_device",
                    evidence={**evidence, "device": key.split(":", 1)[1], "slots": [seen[key], slot.slot_index]},
                )
            seen[key] = slot.slot_index
