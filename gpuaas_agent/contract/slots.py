"""Approved slots and their states, as the control plane records them (seed 002 Phase 2/5)."""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.topology import FabricClaimMode, StorageIdentityKind
from gpuaas_agent.contract.types import BRIDGE_NAME_PATTERN, ByIdPath, MacAddress, PciAddress


class SlotStatus(str, Enum):
    disabled = "disabled"
    available = "available"
    reserved = "reserved"
    provisioning = "provisioning"
    active = "active"
    releasing = "releasing"
    cleanup = "cleanup"
    cleanup_blocked = "cleanup_blocked"


class HealthState(str, Enum):
    unknown = "unknown"
    healthy = "healthy"
    degraded = "degraded"
    failed = "failed"


class ApprovedSlot(WireModel):
    """A slot an operator approved into node_resource_slots: complete bindings only."""

    slot_id: str = Field(min_length=1, max_length=100)
    slot_index: int = Field(ge=0)
    gpu_pci_address: PciAddress
    nvme_device: ByIdPath
    storage_identity_kind: StorageIdentityKind
    fabric_vf_pci_address: PciAddress
    fabric_claim_mode: FabricClaimMode
    mac: MacAddress
    private_ip: str
    ovs_bridge: str = Field(pattern=BRIDGE_NAME_PATTERN)
    numa_node: int | None = None
    status: SlotStatus
    health_state: HealthState = HealthState.unknown


class SlotOutcome(WireModel):
    """What a task did to a slot: on failed provisioning never ``available``, but ``cleanup_blocked``."""

    slot_index: int
    status: SlotStatus
    health_state: HealthState
    health_detail: dict = Field(default_factory=dict)
