"""Host-local records the agent keeps on disk: slot leases, pipeline step journal, task results."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.domain import DomainState
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
    # The provision asked for guest telemetry (VmProvisionPayload.guest_telemetry); dropped with the lease.
    guest_telemetry: bool = False


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


class PowerState(WireEnum):
    """A slice's VM as its tenant sees it (a slot record's ``power_state``): ``stopped`` is libvirt's shutoff,
    ``unknown`` what a lookup that failed leaves; libvirt's other states by their own name."""

    running = "running"
    stopped = "stopped"
    unknown = "unknown"
    nostate = "nostate"
    blocked = "blocked"
    paused = "paused"
    shutdown = "shutdown"
    crashed = "crashed"
    pmsuspended = "pmsuspended"

    @classmethod
    def of_domain(cls, state: DomainState | None) -> PowerState:
        if state is None:
            return cls.unknown
        if state is DomainState.shutoff:
            return cls.stopped
        return cls(state.value)


class LastPowerOperation(WireModel):
    """The last ``slice.vm_power`` on the slot (tasks/power.py)."""

    operation: str
    task_id: str
    at: float
    changed: bool
    succeeded: bool
    code: str | None = None


class BootRecoveryNote(WireModel):
    """What the boot recovery pass of ``boot_id`` did to the slot (tasks/boot_recovery.py)."""

    boot_id: str | None  # None: the boot id could not be read
    outcome: str
    at: float
    findings: list[str] = Field(default_factory=list)


class SlotFailure(WireModel):
    """Why a slot is ``cleanup_blocked``: the step that failed (None: an interrupted run closed after it) and its code."""

    step: str | None
    code: str


class SlotDetail(WireModel):
    """What the tasks note on a slot record besides its status, by the task that writes it.

    Stored flat, one JSON object per row (as every release wrote it), so a rollback reads a new row too.
    A new write is validated: a key not here is refused. A stored row is read leniently
    (:meth:`from_stored`): an older or newer release's key this one does not know, or a value it cannot
    type, is kept in ``unknown`` (never read by name, written back unchanged) rather than failing the slot.
    """

    # slice.vm_power (and boot recovery, which restarts a slice: running)
    power_state: PowerState | None = Field(default=None, strict=False)  # the enum from its value, as stored
    last_power_operation: LastPowerOperation | None = None
    # slice.vm_provision, success
    domain: str | None = None
    readiness: dict[str, Any] | None = None
    # A data slot of a multi-slot allocation names its boot slot (reconcile expects no vNIC on it).
    boot_slot_index: int | None = Field(default=None, ge=0)
    # a failure (provision, release, their recovery): see :attr:`failure`
    failed_step: str | None = None
    code: str | None = None
    message: str | None = None
    evidence: dict[str, Any] | None = None
    cancelled: bool | None = None
    nvme_device: str | None = None
    disk_role: Literal["boot", "data"] | None = None
    steps_reached: list[str] | None = None
    disk_touched: bool | None = None
    compensations: list[dict[str, Any]] | None = None
    unfinished_steps: list[str] | None = None
    # boot recovery
    boot_recovery: BootRecoveryNote | None = None
    # What a stored row held that this release does not type (see the class docstring).
    unknown: dict[str, Any] = Field(default_factory=dict)

    @property
    def failure(self) -> SlotFailure | None:
        """The failure that left the slot as it is, when one did."""
        return SlotFailure(step=self.failed_step, code=self.code) if self.code is not None else None

    @classmethod
    def from_stored(cls, raw: Any) -> SlotDetail:
        """A row's detail as any release wrote it; never raises (see the class docstring)."""
        if not isinstance(raw, dict):
            return cls(unknown={"stored": raw})
        try:
            return cls.from_wire(raw)
        except ValidationError:
            pass
        known: dict[str, Any] = {}
        unknown: dict[str, Any] = {}
        for key, value in raw.items():
            if key in cls.model_fields and key != "unknown" and _validates(key, value):
                known[key] = value
            else:
                unknown[key] = value
        return cls.from_wire(known).model_copy(update={"unknown": unknown})

    def to_stored(self) -> dict[str, Any]:
        """The flat JSON object a row holds (None fields left out; what could not be typed, as it was read)."""
        return {**self.unknown, **self._set_fields()}

    def _set_fields(self) -> dict[str, Any]:
        """The typed fields that hold a value, as JSON (a None inside one, e.g. a power operation's code, stays)."""
        dumped = self.model_dump(mode="json", exclude={"unknown"})
        return {key: value for key, value in dumped.items() if value is not None}

    def updated(self, **changes: Any) -> SlotDetail:
        """A copy with ``changes`` validated (``model_copy`` would not validate them); ``unknown`` is kept."""
        data = {**self._set_fields(), **changes}
        return SlotDetail.model_validate(data).model_copy(update={"unknown": self.unknown})


def _validates(key: str, value: Any) -> bool:
    try:
        SlotDetail.from_wire({key: value})
    except ValidationError:
        return False
    return True


class SlotRecord(WireModel):
    """The host's own record of a slot a task touched: survives restarts, outlives the lease.

    ``cleanup_blocked`` here makes the agent refuse a new provision of the slot
    until a release has wiped and verified its disk.
    """

    slot_index: int = Field(ge=0)
    allocation_id: str
    status: SlotStatus
    health_state: HealthState
    detail: SlotDetail = Field(default_factory=SlotDetail)
    task_id: str
    updated_at: float
