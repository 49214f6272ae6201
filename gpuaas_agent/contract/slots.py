"""Approved slots and their states, as the control plane records them (seed 002 Phase 2/5)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.topology import (
    FabricClaimMode,
    SharingMechanism,
    StorageIdentityKind,
    check_parent_slot_id,
    check_sharing_mechanism,
)
from gpuaas_agent.contract.types import BRIDGE_NAME_PATTERN, ByIdPath, IPv4String, MacAddress, PciAddress


class SlotStatus(WireEnum):
    disabled = "disabled"
    available = "available"
    reserved = "reserved"
    provisioning = "provisioning"
    active = "active"
    releasing = "releasing"
    cleanup = "cleanup"
    cleanup_blocked = "cleanup_blocked"


class HealthState(WireEnum):
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
    private_ip: IPv4String
    ovs_bridge: str = Field(pattern=BRIDGE_NAME_PATTERN)
    numa_node: int | None = None
    status: SlotStatus
    health_state: HealthState = HealthState.unknown
    # Room for fractional GPUs (MIG, vGPU): defaults keep today's payloads valid; anything but a whole
    # device with no parent is refused (invalid_payload naming the field) until a mechanism is implemented.
    sharing_mechanism: SharingMechanism = SharingMechanism.exclusive_device
    parent_slot_id: str | None = Field(default=None, max_length=100)

    _sharing = field_validator("sharing_mechanism")(check_sharing_mechanism)
    _parent = field_validator("parent_slot_id")(check_parent_slot_id)


class SlotOutcome(WireModel):
    """What a task did to a slot: on failed provisioning never ``available``, but ``cleanup_blocked``."""

    slot_index: int
    status: SlotStatus
    health_state: HealthState
    health_detail: dict[str, Any] = Field(default_factory=dict)
