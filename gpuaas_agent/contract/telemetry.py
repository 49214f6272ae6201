"""Per-slice telemetry: what each allocation's slice is doing, as the host sees it (docs/contract.md).

One :class:`SliceTelemetry` per allocation per interval, published on the allocation's own subject
(``gpuaas.node.<node>.telemetry.<allocation>``, contract/subjects.py), so a control plane can hand each
tenant its own slices and nobody else's. The counters come from libvirt's bulk domain stats, read once per
interval for every domain of the host (``virConnectGetAllDomainStats``), matched to the host's leases: the
domain by its name (contract/naming.py), each slot's disk by its by-id path, the management vNIC by its
tap name.

Guest telemetry (opt-in per allocation: ``VmProvisionPayload.guest_telemetry``) rides in the same message:
the agent pulls the exporter in the guest (its port and path from the agent's configuration, its address the
slot's reservation, never the payload), bounded as :class:`GuestPullBounds` says, and carries what it read as
:class:`GuestTelemetry` per slot: the series relabelled to the slot, or the outcome that says why there are none.

Counters are cumulative since the domain started, exactly as the hypervisor gives them (rates are the
reader's: two messages and their ``collected_at``). A counter the hypervisor did not report is ``None`` and
named in ``not_reported``: unknown is never written as 0 (DESIGN.md §4 rule 7).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from gpuaas_agent.contract.base import SCHEMA_VERSION, SchemaVersion, WireModel
from gpuaas_agent.contract.bmc import GpuTelemetry
from gpuaas_agent.contract.domain import DomainState
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN
from gpuaas_agent.contract.types import UUID_PATTERN

# Bounds of one message: a host has at most 256 slots (contract/naming.py's vNIC names), an allocation at most
# that many; the names carried are the hypervisor's device names (vda, gs0-0123456789), short by construction.
MAX_SLOTS = 256
MAX_NOT_REPORTED = 64
Counter = int | None  # a cumulative counter, or None when the hypervisor did not report it


class TelemetryBounds(WireModel):
    """What one round may cost the node, carried in every message so a reader knows what it may expect."""

    max_allocations: int = Field(ge=1, le=MAX_SLOTS)  # one message per allocation per round, at most this many
    max_slots_per_allocation: int = Field(ge=1, le=MAX_SLOTS)
    stats_timeout_s: float = Field(gt=0, le=600)  # the one bulk stats call's deadline; a late round is skipped


class DiskCounters(WireModel):
    """The slot's raw NVMe as the guest uses it (libvirt ``block.<n>.*``), matched by its by-id path."""

    device: str = Field(min_length=1, max_length=64)  # the guest-side target (vda, vdb ...)
    read_bytes: Counter = Field(default=None, ge=0)
    read_ops: Counter = Field(default=None, ge=0)
    write_bytes: Counter = Field(default=None, ge=0)
    write_ops: Counter = Field(default=None, ge=0)


class LinkCounters(WireModel):
    """A link's traffic both ways: bytes, packets and drops received (rx) and sent (tx); None where not counted."""

    rx_bytes: Counter = Field(default=None, ge=0)
    rx_packets: Counter = Field(default=None, ge=0)
    rx_drops: Counter = Field(default=None, ge=0)
    tx_bytes: Counter = Field(default=None, ge=0)
    tx_packets: Counter = Field(default=None, ge=0)
    tx_drops: Counter = Field(default=None, ge=0)


class NicCounters(LinkCounters):
    """The slot's management vNIC (libvirt ``net.<n>.*`` of its tap, the guest's view: rx is what it received)."""

    interface: str = Field(min_length=1, max_length=15)


class FabricVfCounters(LinkCounters):
    """The slot's fabric VF as its PF counts it (IFLA_VF_STATS of the PF's IFLA_VFINFO_LIST, from the host).

    Read only from a PF whose driver implements the VF counters (mlx5_core); the kernel reports zeroes for
    a driver that does not (igb), and those are never taken for counts. rx: what the VF received (towards
    the guest); tx: what it sent. A drop counter the kernel does not carry (before Linux 5.8) is ``None``.
    """

    vf_pci_address: str = Field(min_length=1, max_length=16)
    pf_netdev: str = Field(min_length=1, max_length=15)
    vf_index: int = Field(ge=0)


class SlotTelemetry(WireModel):
    """One slot of the allocation: its disk, its management vNIC when the slot carries it, its fabric VF."""

    slot_index: int = Field(ge=0, lt=MAX_SLOTS)
    disk: DiskCounters | None = None  # None: the domain does not use the slot's disk (not defined as leased)
    management_nic: NicCounters | None = None  # only the slot whose vNIC the domain has
    # None: the slot has no fabric VF, or its PF gives no counters (then named in not_reported: unknown, never 0)
    fabric_vf: FabricVfCounters | None = None
    # The slot's GPU as the baseboard's BMC last read it in the health pass (contract/bmc.py: temperatures with
    # their thresholds' source, power, throttle reasons, ECC, NVLink), matched by the lease's GPU PCI address,
    # and when that pass read it. None where no BMC is configured or its last pass did not read this GPU (then
    # named in not_reported). Never another slot's GPU: the lease names the address.
    gpu: GpuTelemetry | None = None
    gpu_read_at: datetime | None = None


# Guest series: the most one pull may carry, whatever the agent's configuration says.
MAX_GUEST_SERIES = 10_000
MAX_GUEST_LABELS = 32
MAX_GUEST_NAME = 200
MAX_GUEST_LABEL_VALUE = 1024
# One slot's guest part on the wire at most (its JSON): the message must fit a NATS server's max_payload (1 MiB by
# default) beside the host-side counters, whatever long labels the guest packed into its max_bytes.
MAX_GUEST_WIRE_BYTES = 512 * 1024
GUEST_RESERVED_LABELS = frozenset({"slot", "slot_index", "allocation", "allocation_id", "node", "node_id"})
GuestPullOutcome = Literal["ok", "series_capped", "too_large", "too_large_for_wire", "timeout", "unreachable", "http_error", "malformed",
                           "throttled"]


class GuestPullBounds(WireModel):
    """What one pull of a guest exporter may cost the node (operator/guest_telemetry.py enforces each)."""

    max_bytes: int = Field(ge=1024, le=64 * 1024 * 1024)  # the response (head and body); reading stops past it
    max_series: int = Field(ge=1, le=MAX_GUEST_SERIES)  # samples kept; the rest are counted, not parsed
    timeout_s: float = Field(gt=0, le=60)  # connect, request and the whole response together
    min_interval_s: float = Field(ge=0)  # a slot is never pulled more often than this


class GuestSample(WireModel):
    """One sample of the guest's exposition, its labels as the guest gave them less the reserved ones."""

    name: str = Field(min_length=1, max_length=MAX_GUEST_NAME)
    labels: dict[str, str] = Field(default_factory=dict, max_length=MAX_GUEST_LABELS)
    value: float  # finite: NaN and infinities are dropped (reason ``non_finite``), JSON has no spelling for them


class GuestTelemetry(WireModel):
    """One slot's pull: its outcome, the series it kept, and what was dropped by reason."""

    slot_index: int = Field(ge=0, lt=MAX_SLOTS)
    target: str = Field(max_length=128)  # ip:port/path, from the agent's configuration and the slot's reservation
    outcome: GuestPullOutcome
    pulled_at: float = Field(ge=0)
    duration_s: float = Field(ge=0)
    bytes_read: int = Field(ge=0)
    series: list[GuestSample] = Field(default_factory=list, max_length=MAX_GUEST_SERIES)
    dropped: dict[str, int] = Field(default_factory=dict, max_length=16)  # reason -> samples (or 1 for a body)
    message: str | None = Field(default=None, max_length=300)  # why, for an outcome other than ok


class SliceTelemetry(WireModel):
    """``gpuaas.node.<node>.telemetry.<allocation>``: one allocation's slice, one interval."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    allocation_id: str = Field(pattern=UUID_PATTERN)
    domain: str = Field(min_length=1, max_length=64)
    source: Literal["libvirt_bulk_stats"] = "libvirt_bulk_stats"
    collected_at: float = Field(ge=0)  # unix time of the bulk stats call
    interval_s: float = Field(gt=0)  # the next message is due this much later
    bounds: TelemetryBounds
    # running: the counters below are live; shutoff (or absent from the stats): no counters, the slice is down.
    state: DomainState
    cpu_time_ns: Counter = Field(default=None, ge=0)  # the whole domain (QEMU's threads included)
    vcpu_time_ns: Counter = Field(default=None, ge=0)  # the sum over the guest's vCPUs
    vcpus: int | None = Field(default=None, ge=0)
    memory_bytes: int | None = Field(default=None, ge=0)  # the guest's memory now (balloon current)
    memory_max_bytes: int | None = Field(default=None, ge=0)
    memory_rss_bytes: int | None = Field(default=None, ge=0)  # what the host gives it (QEMU's RSS)
    slots: list[SlotTelemetry] = Field(max_length=MAX_SLOTS)
    not_reported: list[str] = Field(default_factory=list, max_length=MAX_NOT_REPORTED)
    # Only when the allocation asked for it (VmProvisionPayload.guest_telemetry): one entry per slot with a vNIC.
    guest_bounds: GuestPullBounds | None = None
    guest: list[GuestTelemetry] = Field(default_factory=list, max_length=MAX_SLOTS)

