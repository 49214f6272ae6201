"""Host-local records the agent keeps on disk: slot leases, pipeline step journal, task results."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.handover import LeaseHandover
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.types import UUID_PATTERN, ByIdPath, DiskIdentity, PciAddress


class SlotLease(WireModel):
    """One allocation holds one slot: the host-side half of the control plane's claim.

    ``disk_identity`` is what the disk *is* (every by-id alias of it has the same
    one): two leases can never hold one namespace through two of its names.
    """

    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int = Field(ge=0)
    gpu_pci_address: PciAddress
    nvme_device: ByIdPath
    disk_identity: DiskIdentity
    fabric_vf_pci_address: PciAddress
    task_id: str = Field(min_length=1, max_length=200)
    taken_at: float
    # Fixed by the provision's validate; None only on a lease taken before it (slice.plan's, or an old row):
    # release then uses the strictest method the device supports (tasks/release.py).
    handover: LeaseHandover | None = None


class StepStatus(WireEnum):
    """A pipeline step is journaled before it runs and after it ends (STYLE.md rule 6)."""

    started = "started"
    succeeded = "succeeded"
    failed = "failed"
    compensated = "compensated"


class JournalEntry(WireModel):
    task_id: str
    seq: int
    step: str
    status: StepStatus
    detail: dict[str, Any] = Field(default_factory=dict)
    at: float


class SlotRecord(WireModel):
    """The host's own record of a slot a task touched: survives restarts, outlives the lease.

    ``cleanup_blocked`` here makes the agent refuse a new provision of the slot
    until a release has wiped and verified its disk.
    """

    slot_index: int = Field(ge=0)
    allocation_id: str
    status: SlotStatus
    health_state: HealthState
    detail: dict[str, Any] = Field(default_factory=dict)
    task_id: str
    updated_at: float
