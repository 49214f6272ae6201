"""``slice.plan`` output: the concrete bundle each approved slot resolves to on this host right now."""

from __future__ import annotations

from pydantic import Field

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.fabricvf import FabricAttachment, FabricVfIdentity
from gpuaas_agent.contract.placement import PlacementReport
from gpuaas_agent.contract.types import ByIdPath, DiskIdentity, KernelName, MacAddress, PciAddress


class PlannedSlot(WireModel):
    slot_id: str
    slot_index: int
    gpu_pci_address: PciAddress
    gpu_numa_node: int | None
    gpu_local_cpulist: str | None
    fabric_vf_pci_address: PciAddress
    fabric_pf_pci_address: PciAddress | None
    nvme_device: ByIdPath
    nvme_kernel_name: KernelName = Field(description="advisory: resolved now, moves on reboot")
    disk_identity: DiskIdentity = Field(description="what the disk is; the lease holds it by this, whatever its name")
    nvme_size_bytes: int | None
    mac: MacAddress
    private_ip: str
    ovs_bridge: str
    # The VF's MAC and IB GUIDs the agent derives for this slot (contract/fabricvf.py): bind the GUIDs into the
    # allocation's partition before the provision. None: the slot's VF is not on this host (never planned).
    fabric_vf_identity: FabricVfIdentity | None = None


class BundlePlan(WireModel):
    allocation_id: str
    slots: list[PlannedSlot]
    # v1.1, multi-slot sets only: the locality the set gets, the constraint that decided, a better free set.
    placement: PlacementReport | None = None
    fabric_attachment: FabricAttachment | None = None  # the payload's, echoed
