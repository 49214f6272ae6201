"""Operating a fleet: maintenance (with its drain) and quarantined components, on the wire and on disk.

Maintenance stops new work reaching a host (``slice.vm_provision`` and ``slice.plan`` are refused
``host_in_maintenance``) while what runs there goes on; the drain says when the last slice is gone.
A quarantined component (a GPU, an NVMe namespace, a fabric VF or a whole slot) is one whose
handover or health failed: no slot using it is offered until ``slice.unquarantine`` re-runs the
check that failed. Each piece is named by what it *is* (a PCI address, a disk identity), never by a
kernel name that moves on reboot.

An operator's reason is free text that ends up in logs, the heartbeat and a terminal: it is one
line of printable text, bounded, so a hostile or pasted reason cannot forge log lines or escape
sequences.
"""

from __future__ import annotations

import re
import unicodedata
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from gpuaas_agent.compat import Self
from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.types import DISK_IDENTITY_KINDS, PCI_ADDRESS_RE

MAX_REASON_CHARS = 500
MAX_EVIDENCE_CHARS = 16_000  # the evidence of one quarantine, as JSON: enough for a wipe proof, not a dump
_DISK_IDENTITY_RE = re.compile(rf"^({'|'.join(DISK_IDENTITY_KINDS)}):[\x21-\x7e]{{1,256}}$")


def _one_printable_line(value: str) -> str:
    """Printable text on one line: no control characters (C0, C1, DEL), no line or paragraph separators,
    no format characters (bidi overrides that make a log line read other than it is)."""
    if not value.strip():
        raise ValueError("reason is empty: say why (it is shown to whoever looks at this host next)")
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            raise ValueError(f"reason contains a control or format character (U+{ord(ch):04X}); one printable line")
    return value


OperatorReason = Annotated[str, Field(min_length=1, max_length=MAX_REASON_CHARS),
                           AfterValidator(_one_printable_line)]


# -- maintenance -------------------------------------------------------------------------------


class MaintenancePayload(WireModel):
    """``slice.maintenance``: put the host in maintenance (``on``) or take it out (``off``)."""

    mode: Literal["on", "off"]
    reason: OperatorReason
    # Who asked (an operator id from the control plane; the CLI puts ``local:<user>``).
    requested_by: str = Field(default="control-plane", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._:@-]+$")


class MaintenanceState(WireModel):
    """The host's maintenance state as stored (``agent_meta``) and reported (heartbeat, status, metrics).

    ``drained_at``: when maintenance was on and the host held no slot lease any more (the drain is
    done); None while slices remain, and whenever maintenance is off.
    """

    on: bool
    reason: str = Field(default="", max_length=MAX_REASON_CHARS)
    requested_by: str = Field(default="", max_length=100)
    since: datetime | None = None
    task_id: str | None = Field(default=None, max_length=200)
    drained_at: datetime | None = None


class DrainReport(WireModel):
    """The heartbeat's and status's view of a maintenance: on since when, and what still runs."""

    maintenance: bool
    reason: str = ""
    since: datetime | None = None
    leased_slots: list[int] = Field(default_factory=list)
    allocations: int = 0
    drained: bool = False
    drained_at: datetime | None = None


# -- quarantine ------------------------------------------------------------------------------------


class ComponentKind(WireEnum):
    gpu = "gpu"  # identity: the GPU's PCI address
    nvme = "nvme"  # identity: the namespace's disk identity (uuid:/nguid:/eui:/wwid:...)
    fabric_vf = "fabric_vf"  # identity: the VF's PCI address
    slot = "slot"  # identity: the slot index, in decimal (when no single component is to blame)


class QuarantineReason(WireEnum):
    """Why a component was taken out of service; each names the check ``slice.unquarantine`` re-runs."""

    wipe_unverified = "wipe_unverified"  # a released disk's wipe did not verify (docs/safety.md §6)
    gpu_reset_failed = "gpu_reset_failed"  # the GPU reset the agent chose failed (§4.12)
    gpu_memory_clear_failed = "gpu_memory_clear_failed"  # the GPU's memory clear did not verify (§4.12)
    smart_failing = "smart_failing"  # the disk's SMART log says critical warning / media errors
    gpu_aer_fatal = "gpu_aer_fatal"  # the GPU reported a fatal PCIe AER error
    gpu_xid = "gpu_xid"  # the GPU reported a fatal XID
    firmware_changed = "firmware_changed"  # the device's firmware changed during a tenancy
    fabric_vf_not_parked = "fabric_vf_not_parked"  # a released fabric VF did not read back parked (§4.15)
    bmc_failed = "bmc_failed"  # the HGX baseboard's BMC judged the GPU failed (ECC, row remap, temperature...)
    operator = "operator"  # an operator took it out (slice.quarantine); re-check: the operator's word


def check_identity(kind: ComponentKind, identity: str) -> str:
    """The identity must name a component of its kind: a PCI address, a disk identity, a slot index."""
    if kind in (ComponentKind.gpu, ComponentKind.fabric_vf):
        if not PCI_ADDRESS_RE.match(identity):
            raise ValueError(f"a {kind.value} is named by its PCI address (0000:1b:00.0), not {identity[:80]!r}")
    elif kind is ComponentKind.nvme:
        if not _DISK_IDENTITY_RE.match(identity):
            raise ValueError(f"an nvme is named by its disk identity ({'|'.join(DISK_IDENTITY_KINDS)}:...), "
                             f"not {identity[:80]!r}")
    elif not (identity.isascii() and identity.isdigit() and len(identity) <= 3 and int(identity) <= 255):
        raise ValueError(f"a slot is named by its index (0-255), not {identity[:80]!r}")
    return identity


class ComponentRef(WireModel):
    """One component by kind and identity (validated together: an nvme named by a PCI address is refused)."""

    kind: ComponentKind
    identity: str = Field(min_length=1, max_length=300)

    @model_validator(mode="after")
    def _identity_fits_kind(self) -> Self:
        check_identity(self.kind, self.identity)
        return self


class QuarantineRecord(WireModel):
    """A quarantined component as stored and reported: what, why, the evidence, when, by which task."""

    kind: ComponentKind
    identity: str = Field(min_length=1, max_length=300)
    reason: QuarantineReason
    evidence: dict[str, Any] = Field(default_factory=dict)
    quarantined_at: datetime
    task_id: str = Field(min_length=1, max_length=200)
    slot_index: int | None = Field(default=None, ge=0, le=255)  # the slot it was in, when known

    @model_validator(mode="after")
    def _identity_fits_kind(self) -> Self:
        check_identity(self.kind, self.identity)
        return self

    @property
    def ref(self) -> ComponentRef:
        return ComponentRef(kind=self.kind, identity=self.identity)


class QuarantinedComponent(WireModel):
    """A quarantined component as the heartbeat names it (the evidence stays on the host: ``status --json``)."""

    kind: ComponentKind
    identity: str = Field(min_length=1, max_length=300)
    reason: QuarantineReason
    since: datetime
    task_id: str = Field(max_length=200)
    slot_index: int | None = None

    @classmethod
    def of(cls, record: QuarantineRecord) -> QuarantinedComponent:
        return cls(kind=record.kind, identity=record.identity, reason=record.reason, since=record.quarantined_at,
                   task_id=record.task_id, slot_index=record.slot_index)


class UnquarantinePayload(WireModel):
    """``slice.unquarantine``: return a component after the check that failed passes again."""

    component: ComponentRef
    reason: OperatorReason
    requested_by: str = Field(default="control-plane", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._:@-]+$")


class QuarantinePayload(WireModel):
    """``slice.quarantine``: an operator takes a component out of service (refused while an allocation holds it)."""

    component: ComponentRef
    reason: OperatorReason
    slot_index: int | None = Field(default=None, ge=0, le=255)
    requested_by: str = Field(default="control-plane", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._:@-]+$")


class RecheckVerdict(WireModel):
    """What a re-run check found: ``passed`` returns the component; the evidence goes with the result."""

    check: str = Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)
    passed: bool
    detail: str = Field(max_length=4000)
    evidence: dict[str, Any] = Field(default_factory=dict)
