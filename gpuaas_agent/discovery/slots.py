"""Candidate slot planner: one candidate per GPU, paired best-fit with a raw NVMe and a fabric VF.

Rules (seed 002 Phase 2, docs/safety.md):

* no disk and no VF is in two candidates;
* the OS disk and disks without a by-id name are never proposed; disks in use
  (mounted children, holders, swap, old filesystems) are proposed only when no
  clean disk is left, and then carry blockers — the operator sees which infra
  drain is needed instead of an empty slot;
* a GPU gets a VF or a ``no_free_fabric_vf`` blocker, never a shared PF;
* pairing maximises complete slots first, then prefers the same PCIe switch,
  then the same NUMA node;
* MAC and IP suggestions, and the fabric VF's MAC and IB GUIDs, are deterministic from host
  identity + slot index.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass

from gpuaas_agent.contract.fabricvf import derive_vf_identity
from gpuaas_agent.contract.topology import (
    CandidateSlot,
    FabricDevice,
    Finding,
    GpuDevice,
    Locality,
    NvmeDevice,
    SharingMechanism,
)
from gpuaas_agent.discovery.assignment import max_weight_assignment
from gpuaas_agent.discovery.pci import LOCALITY_SCORE, PciIndex, locality

NEVER_PROPOSED = frozenset({"os_disk", "no_stable_by_id", "not_local_pcie"})

# Weight tiers: a tier always beats any locality difference, which beats index tie-breaks.
_TIER = 10**9
_LOCALITY = 10**6


@dataclass(frozen=True)
class PlanConfig:
    subnet: ipaddress.IPv4Network = ipaddress.IPv4Network("10.100.0.0/24")
    gateway: ipaddress.IPv4Address | None = None  # default: first address of the subnet
    first_host_offset: int = 10  # slot 0 -> 10.100.0.10, as on the seed's lab hosts
    ovs_bridge: str = "ovsbr0"

    @property
    def gateway_address(self) -> ipaddress.IPv4Address:
        return self.gateway or self.subnet.network_address + 1


def suggest_mac(host_key: str, slot_index: int, taken: set[str]) -> str:
    """Locally administered unicast MAC (``02:...``) from host identity + slot index."""
    counter = 0
    while True:
        digest = hashlib.sha256(f"gpuaas-slot-mac/{host_key}/{slot_index}/{counter}".encode()).digest()
        mac = "02:" + ":".join(f"{b:02x}" for b in digest[:5])
        if mac not in taken:
            return mac
        counter += 1


def suggest_ips(config: PlanConfig, count: int) -> list[str | None]:
    """Private IPs for slots 0..count-1 inside the subnet, never network, gateway or broadcast."""
    gateway = config.gateway_address
    usable = [ip for ip in config.subnet.hosts() if ip != gateway]
    first = config.subnet.network_address + config.first_host_offset
    start = next((i for i, ip in enumerate(usable) if ip >= first), 0)
    return [str(usable[start + i]) if start + i < len(usable) else None for i in range(count)]


def _locality_weight(loc: Locality) -> int:
    return LOCALITY_SCORE[loc] * _LOCALITY


def _assign_vfs(gpus: list[GpuDevice], vfs: list[FabricDevice], index: PciIndex) -> dict[int, int]:
    weights = [
        [
            _TIER + _locality_weight(locality(index.get(g.pci_address), index.get(v.pci_address))) - j
            for j, v in enumerate(vfs)
        ]
        for g in gpus
    ]
    return max_weight_assignment(weights)


def _assign_disks(
    gpus: list[GpuDevice], disks: list[NvmeDevice], has_vf: set[int], index: PciIndex
) -> dict[int, int]:
    weights = []
    for i, g in enumerate(gpus):
        row = []
        for j, d in enumerate(disks):
            if d.slice_eligible:
                tier = 3 if i in has_vf else 2
            else:
                tier = 1
            loc = locality(index.get(g.pci_address), index.get(d.pci_address))
            row.append(tier * _TIER + _locality_weight(loc) - j)
        weights.append(row)
    return max_weight_assignment(weights)


def _gpu_blockers(gpu: GpuDevice, index: PciIndex) -> list[Finding]:
    """A GPU can be passed through only with an IOMMU group it does not share with strangers."""
    path = f"/sys/bus/pci/devices/{gpu.pci_address}"
    if gpu.iommu_group is None:
        return [Finding(code="gpu_no_iommu_group", detail=f"{gpu.pci_address} has no IOMMU group (IOMMU off?)", path=path)]
    me = index.get(gpu.pci_address)
    assert me is not None  # the GPU was read from this index
    strangers = []
    for member in gpu.iommu_group_members:
        fn = index.get(member)
        if member == gpu.pci_address or (fn is not None and (fn.is_bridge or fn.slot == me.slot)):
            continue
        strangers.append(member)
    if strangers:
        return [Finding(
            code="gpu_iommu_group_shared",
            detail=f"IOMMU group {gpu.iommu_group} also holds {', '.join(strangers)}; all would have to go to vfio-pci",
            path=f"/sys/kernel/iommu_groups/{gpu.iommu_group}",
        )]
    return []


def _no_vf_detail(gpu: GpuDevice, pfs: list[FabricDevice], index: PciIndex) -> str:
    local = [p for p in pfs if locality(index.get(gpu.pci_address), index.get(p.pci_address)) == Locality.same_switch]
    if local:
        nic = local[0]
        return (f"no free SR-IOV VF for GPU {gpu.pci_address}: local fabric NIC {nic.pci_address} has "
                f"sriov_numvfs={nic.sriov_numvfs} of {nic.sriov_totalvfs}; a shared PF is never handed out")
    return f"no free SR-IOV VF for GPU {gpu.pci_address} on any fabric NIC; a shared PF is never handed out"


def plan_slots(
    gpus: list[GpuDevice],
    disks: list[NvmeDevice],
    fabric: list[FabricDevice],
    index: PciIndex,
    host_key: str,
    config: PlanConfig,
) -> list[CandidateSlot]:
    """One candidate per GPU, in GPU address order."""
    vfs = [f for f in fabric if f.is_vf]
    pfs = [f for f in fabric if not f.is_vf]
    proposable = [d for d in disks if not {r.code for r in d.ineligible_reasons} & NEVER_PROPOSED]
    vf_of = _assign_vfs(gpus, vfs, index)
    disk_of = _assign_disks(gpus, proposable, set(vf_of), index)
    ips = suggest_ips(config, len(gpus))
    macs: set[str] = set()
    slots = []
    for i, gpu in enumerate(gpus):
        blockers = _gpu_blockers(gpu, index)
        warnings: list[Finding] = []
        gpu_fn = index.get(gpu.pci_address)
        disk = proposable[disk_of[i]] if i in disk_of else None
        vf = vfs[vf_of[i]] if i in vf_of else None
        nvme_loc = fabric_loc = None
        if disk is None:
            blockers.append(Finding(code="no_nvme_device", detail=f"no raw, unmounted, by-id NVMe disk left for GPU {gpu.pci_address}"))
        else:
            blockers += [Finding(code=f"nvme_{r.code}", detail=r.detail, path=r.path) for r in disk.ineligible_reasons]
            nvme_loc = locality(gpu_fn, index.get(disk.pci_address))
        if vf is None:
            blockers.append(Finding(code="no_free_fabric_vf", detail=_no_vf_detail(gpu, pfs, index)))
        else:
            fabric_loc = locality(gpu_fn, index.get(vf.pci_address))
            if vf.iommu_group is None:
                blockers.append(Finding(code="fabric_vf_no_iommu_group", detail=f"VF {vf.pci_address} has no IOMMU group"))
        for what, loc in (("nvme", nvme_loc), ("fabric", fabric_loc)):
            if loc == Locality.remote:
                warnings.append(Finding(code=f"{what}_remote_numa", detail=f"{what} device is on another NUMA node than GPU {gpu.pci_address}"))
        if gpu.numa_node is None:
            warnings.append(Finding(code="gpu_numa_unknown", detail=f"GPU {gpu.pci_address} reports no NUMA node; vCPU pinning cannot be planned"))
        if ips[i] is None:
            blockers.append(Finding(code="no_private_ip", detail=f"subnet {config.subnet} has no free address for slot {i}"))
        mac = suggest_mac(host_key, i, macs)
        macs.add(mac)
        slots.append(
            CandidateSlot(
                slot_index=i,
                gpu_pci_address=gpu.pci_address,
                nvme_device=disk.by_id if disk else None,
                storage_identity_kind=disk.storage_identity_kind if disk else None,
                nvme_kernel_name=disk.kernel_name if disk else None,
                fabric_vf_pci_address=vf.pci_address if vf else None,
                fabric_pf_pci_address=vf.physfn if vf else None,
                mac=mac,
                private_ip=ips[i],
                ovs_bridge=config.ovs_bridge,
                numa_node=gpu.numa_node,
                nvme_locality=nvme_loc,
                fabric_locality=fabric_loc,
                fabric_vf_identity=derive_vf_identity(host_key, i) if vf else None,
                blockers=blockers,
                warnings=warnings,
                sharing_mechanism=SharingMechanism.exclusive_device,  # whole-GPU slots only (no MIG/vGPU yet)
            )
        )
    return slots
