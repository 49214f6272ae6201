"""``slice.reconcile`` (and the periodic timer): compare what the agent holds with what the host has.

Sources: the state store (leases, slot records), libvirt (agent-owned domains,
read back from their metadata), OVS (ports carrying ``gpuaas-allocation``),
dnsmasq (the agent's reservations and the lease file), sysfs (drivers of the
leased PCI functions), the bridge's flows and the nft guard (``tasks/isolation.py``).
Every difference is a typed :class:`DriftFinding`. Each lease's devices are also compared
with the live host (``tasks/slot_topology.py``: ``slot_device_missing``/``slot_device_moved``),
and an active slot's shut-off domain is always reported (``domain_shutoff``; ``info`` when the
tenant stopped it). Store reads go through the store thread (``state/aio.py``), off the loop.

Repairs are limited to what cannot hurt a tenant: an OVS port or a dnsmasq
reservation of an allocation this host no longer knows at all (no lease, no
slot record, no domain) is removed, and so are isolation flows or guard entries of
ports that no longer exist; an active port's missing or altered flows are reinstalled
(that only ever closes the port again). Nothing here ever destroys a domain,
releases a lease or wipes a disk: those are findings for the control plane,
which answers with a release.

One pass is three phases, so the judgement can be read and tested on its own:
:func:`gather` reads every source once into a :class:`HostSnapshot`; :func:`judge` turns
the snapshot into findings and the repairs they allow (pure: no I/O, no clock); :func:`apply_repairs`
applies those repairs when asked. The port isolation's reading, judgement and repairs
(``tasks/isolation.py``) are parts of the same three phases. The Fabric Manager partitions
(``tasks/fabric_partitions.py``) come last: read, judged and repaired in that module, from
the snapshot's running domains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.dhcp import Lease, LeaseState, Reservation
from gpuaas_agent.contract.domain import DomainInfo, DomainState
from gpuaas_agent.contract.drift import (
    DriftFinding,
    DriftKind,
    DriftReport,
    DriftSeverity,
    DriftTrigger,
)
from gpuaas_agent.contract.naming import allocation_from_domain_name
from gpuaas_agent.contract.ovs import OvsPort
from gpuaas_agent.contract.runtime import UnknownProfileError, get_profile
from gpuaas_agent.contract.slots import SlotStatus
from gpuaas_agent.contract.state import PowerState, SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import ReconcilePayload
from gpuaas_agent.contract.vfio import VFIO_DRIVER
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.dnsmasq import parse_leases, status_of
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.tasks import fabric_partitions, fabricvf
from gpuaas_agent.tasks.context import AnyStore, Handler, TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.isolation import (
    ActivePort,
    IsolationJudgement,
    IsolationSnapshot,
    judge_isolation,
    read_isolation,
    repair_isolation,
)
from gpuaas_agent.tasks.slot_topology import slot_topology_findings

log = logging.getLogger(__name__)


def _finding(kind: DriftKind, subject: str, severity: DriftSeverity, *, expected: str | None = None,
             actual: str | None = None, repaired: bool = False, **detail: Any) -> DriftFinding:
    return DriftFinding(kind=kind, subject=subject, severity=severity, expected=expected, actual=actual,
                        repaired=repaired, detail=detail)


# -- gather: every source read once ---------------------------------------------------------------------


def by_allocation(domains: Iterable[DomainInfo]) -> dict[str, DomainInfo]:
    """The domains by the allocation their metadata (else their name) names; unnamed ones left out."""
    found = {}
    for d in domains:
        alloc = d.metadata.allocation_id if d.metadata else allocation_from_domain_name(d.name)
        if alloc:
            found[alloc] = d
    return found


@dataclass(frozen=True)
class HostSnapshot:
    """What one reconcile reads of the store and the host, read once before anything is judged or repaired
    (Fabric Manager's partitions excepted: ``tasks/fabric_partitions.py`` reads and judges those)."""

    leases: tuple[SlotLease, ...] = ()
    records: Mapping[int, SlotRecord] = field(default_factory=dict)  # the store's slot records by slot index
    domains: tuple[DomainInfo, ...] = ()  # the agent's domains as libvirt lists them
    reservations: tuple[Reservation, ...] = ()  # the agent's dnsmasq hosts file
    ports: tuple[OvsPort, ...] = ()  # every agent port in ovsdb
    dhcp: tuple[Lease, ...] = ()  # dnsmasq's lease file
    read_at: float = 0.0  # Unix time of the lease file's read: a lease's expiry is judged against it
    # The driver each leased PCI function is bound to now (sysfs; None: none).
    pci_drivers: Mapping[str, str | None] = field(default_factory=dict)
    # Per leased slot: its devices against live sysfs and its domain's XML, as tasks/slot_topology.py reads and
    # compares them (the same check boot recovery makes; reconcile adds its findings to the lease's).
    device_findings: Mapping[int, tuple[DriftFinding, ...]] = field(default_factory=dict)
    # The bridges' isolation flows and the nft guard (tasks/isolation.py); None: not read.
    isolation: IsolationSnapshot | None = None

    @property
    def domains_by_allocation(self) -> dict[str, DomainInfo]:
        return by_allocation(self.domains)

    @property
    def known(self) -> frozenset[str]:
        """Allocations this host still knows: a lease, a slot record or a domain."""
        return frozenset({lease.allocation_id for lease in self.leases}
                         | {r.allocation_id for r in self.records.values()} | set(self.domains_by_allocation))

    @property
    def running(self) -> frozenset[str]:
        """Allocations whose domain runs."""
        return frozenset(a for a, d in self.domains_by_allocation.items() if d.state is DomainState.running)


def isolation_needs_domains(leases: Iterable[SlotLease], records: Iterable[SlotRecord], ports: Iterable[OvsPort]) -> bool:
    """Whether the port isolation probe reads libvirt's domains (pure). The isolation judgement asks of them only
    whether an agent port's allocation is still known (``known``: a lease, a slot record or a domain), so without a
    lease, and with every agent port's allocation named by a slot record, its findings are the same without them.
    A host with a lease reads them as the full pass does (that host uses libvirt; the snapshot stays whole)."""
    leased = {lease.allocation_id for lease in leases}
    known = leased | {r.allocation_id for r in records}
    return bool(leased) or any(p.allocation_id not in known for p in ports)


async def gather(drivers: SliceDrivers, state: StoreThread, *, isolation_only: bool = False) -> HostSnapshot:
    """Read the store, libvirt, dnsmasq, ovsdb and sysfs once (store reads on the store thread).

    ``isolation_only``: the read of the health round's ``port_isolation`` probe (its isolation findings only):
    libvirt is asked only where its answer can change those (:func:`isolation_needs_domains`), so an idle host's
    probe (every network watch round) neither loads libvirt nor runs a child for it; the snapshot then holds no
    domain, and only its isolation findings are meant."""
    leases = tuple(await state.leases())
    records = {r.slot_index: r for r in await state.slot_states()}
    domains: tuple[DomainInfo, ...] = ()
    if not isolation_only:
        domains = tuple(await drivers.libvirt.list_agent_domains())
    reservations = tuple(await asyncio.to_thread(drivers.reservations().reservations))
    async with drivers.ovs() as ovs:
        ports = tuple(await asyncio.to_thread(ovs.list_agent_ports))
    if isolation_only and isolation_needs_domains(leases, records.values(), ports):
        domains = tuple(await drivers.libvirt.list_agent_domains())
    dhcp = tuple(await asyncio.to_thread(parse_leases, drivers.slice.dnsmasq_lease_file))
    read_at = time.time()
    host = drivers.discovered_root().fresh()
    pci_drivers = {address: host.link_name(f"/sys/bus/pci/devices/{address}/driver")
                   for lease in leases for address in (lease.gpu_pci_address, lease.fabric_vf_pci_address)}
    by_alloc = by_allocation(domains)
    device_findings = {lease.slot_index: tuple(await _device_findings(drivers, lease, by_alloc.get(lease.allocation_id)))
                       for lease in leases}
    isolation = await read_isolation(drivers, ports)
    return HostSnapshot(leases=leases, records=records, domains=domains, reservations=reservations, ports=ports,
                        dhcp=dhcp, read_at=read_at, pci_drivers=pci_drivers, device_findings=device_findings,
                        isolation=isolation)


def _hostdevs(domain: DomainInfo) -> bool:
    """Whether the domain's profile passes the GPU and VF through (an unknown profile: assume it does)."""
    if domain.metadata is None:
        return True
    try:
        return get_profile(domain.metadata.profile).hostdevs
    except UnknownProfileError:
        return True


async def _device_findings(drivers: SliceDrivers, lease: SlotLease, domain: DomainInfo | None) -> list[DriftFinding]:
    """The lease's devices against live sysfs and the domain's XML (``tasks/slot_topology.py``)."""
    devices, hostdevs = None, True
    if domain is not None and domain.metadata is not None:
        try:
            devices = await drivers.libvirt.devices(domain.name)
        except AgentError:  # gone between list and read: the domain findings say so
            devices = None
        hostdevs = _hostdevs(domain)
    host = drivers.discovered_root()
    return await asyncio.to_thread(slot_topology_findings, host, lease, devices, hostdevs=hostdevs)


# -- judge: the snapshot in, findings and the repairs they allow out (pure) ------------------------------


@dataclass(frozen=True)
class RemoveReservation:
    """Drop the dnsmasq reservation of an allocation this host does not know; ``finding``: its index."""

    finding: int
    reservation: Reservation


@dataclass(frozen=True)
class RemovePort:
    """Drop the OVS port of an allocation this host does not know; ``finding``: its index."""

    finding: int
    port: OvsPort


Repair = RemoveReservation | RemovePort


@dataclass(frozen=True)
class Judgement:
    """What the snapshot shows: findings in report order (none repaired yet) and the repairs they allow;
    the isolation's (flows and guard) come after them in the report."""

    findings: list[DriftFinding]
    repairs: list[Repair]
    active: list[ActivePort]  # the active slots' ports, with the reservation their rules follow
    isolation: IsolationJudgement | None = None  # None: the snapshot holds no isolation reading


def lease_findings(snap: HostSnapshot, lease: SlotLease) -> list[DriftFinding]:
    """One lease against its slot record, domain, reservation, DHCP lease and the drivers of its devices."""
    findings: list[DriftFinding] = []
    record = snap.records.get(lease.slot_index)
    domain = snap.domains_by_allocation.get(lease.allocation_id)
    status = record.status if record else None
    if domain is None and status is SlotStatus.active:
        findings.append(_finding(DriftKind.domain_missing, lease.allocation_id, DriftSeverity.error,
                                 expected="domain defined and running", actual="no domain",
                                 slot_index=lease.slot_index))
    elif domain is None and status not in (SlotStatus.provisioning, SlotStatus.releasing,
                                           SlotStatus.cleanup_blocked):
        findings.append(_finding(DriftKind.lease_without_domain, lease.allocation_id, DriftSeverity.warn,
                                 expected="a domain for the leased slot", actual="no domain",
                                 slot_index=lease.slot_index, slot_status=status.value if status else None))
    if domain is not None and status is SlotStatus.active and domain.state.value == "shutoff":
        findings.append(shutoff_finding(lease, record, domain))
    findings += snap.device_findings.get(lease.slot_index, ())
    mine = [r for r in snap.reservations if r.allocation_id == lease.allocation_id and r.slot_index == lease.slot_index]
    # A data slot of a multi-slot allocation (docs/multi-gpu.md) has no vNIC and no reservation of its own.
    data_slot = record is not None and record.detail.boot_slot_index not in (None, lease.slot_index)
    if status is SlotStatus.active and not mine and not data_slot:
        findings.append(_finding(DriftKind.reservation_missing, lease.allocation_id, DriftSeverity.error,
                                 expected="a dnsmasq reservation", actual="none",
                                 slot_index=lease.slot_index))
    if status is SlotStatus.active and mine and domain is not None and domain.state.value == "running":
        seen = status_of(list(snap.dhcp), mine[0].mac, mine[0].ip, snap.read_at)
        if seen.lease_state is not LeaseState.bound:
            findings.append(_finding(DriftKind.dhcp_lease_missing, lease.allocation_id, DriftSeverity.warn,
                                     expected=f"{mine[0].mac} holds {mine[0].ip}",
                                     actual=f"{seen.lease_state.value} {seen.actual_ip or ''}".strip(),
                                     slot_index=lease.slot_index))
    if domain is not None and domain.metadata is not None and domain.state.value == "running" and _hostdevs(domain):
        for address in (lease.gpu_pci_address, lease.fabric_vf_pci_address):
            driver = snap.pci_drivers.get(address)
            if driver != VFIO_DRIVER:
                findings.append(_finding(DriftKind.driver_not_vfio, address, DriftSeverity.error,
                                         expected=VFIO_DRIVER, actual=driver or "none",
                                         allocation_id=lease.allocation_id))
    return findings


def blocked_disk_findings(snap: HostSnapshot) -> list[DriftFinding]:
    """Every ``cleanup_blocked`` slot: a disk that is not wiped and verified."""
    return [_finding(DriftKind.disk_not_wiped, store_disk(snap.leases, record) or str(record.slot_index),
                     DriftSeverity.error, expected="wiped and verified", actual="cleanup_blocked",
                     slot_index=record.slot_index, allocation_id=record.allocation_id,
                     failed_step=record.detail.failed_step)
            for record in snap.records.values() if record.status is SlotStatus.cleanup_blocked]


def orphan_domain_findings(snap: HostSnapshot) -> list[DriftFinding]:
    """Domains of allocations without a lease (reported only: a release decides)."""
    leased = {lease.allocation_id for lease in snap.leases}
    return [_finding(DriftKind.domain_orphan, alloc, DriftSeverity.warn,
                     expected="no domain (no lease)", actual=f"{domain.name} {domain.state.value}",
                     note="never destroyed by reconcile: a release decides")
            for alloc, domain in sorted(snap.domains_by_allocation.items()) if alloc not in leased]


def orphan_reservations(snap: HostSnapshot) -> list[tuple[DriftFinding, Reservation]]:
    """Reservations of allocations this host does not know at all, each with its finding."""
    known = snap.known
    return [(_finding(DriftKind.reservation_orphan, res.allocation_id, DriftSeverity.warn,
                      expected="no reservation (allocation unknown here)", actual=f"{res.mac} {res.ip}",
                      slot_index=res.slot_index), res)
            for res in snap.reservations if res.allocation_id not in known]


def orphan_ports(snap: HostSnapshot) -> list[tuple[DriftFinding, OvsPort]]:
    """OVS ports of allocations this host does not know at all, each with its finding."""
    known = snap.known
    return [(_finding(DriftKind.port_orphan, port.allocation_id or port.name, DriftSeverity.warn,
                      expected="no port (allocation unknown here)", actual=f"{port.bridge}/{port.name}",
                      port=port.name), port)
            for port in snap.ports if port.allocation_id not in known]


def active_ports(snap: HostSnapshot, *, in_flight: bool = False) -> list[ActivePort]:
    """Port isolation (docs/safety.md §9): each active slot's port with the reservation its rules follow.

    ``in_flight``: every leased slot's port and reservation instead, whatever its record says (a provision
    still running has plugged its port and opened what its payload asked for)."""
    return [ActivePort(port=port, mac=res.mac, ip=str(res.ip), guest_telemetry=lease.guest_telemetry)
            for lease in snap.leases
            if in_flight or ((rec := snap.records.get(lease.slot_index)) is not None
                             and rec.status is SlotStatus.active and rec.allocation_id == lease.allocation_id)
            for port in snap.ports if (port.allocation_id, port.slot_index) == (lease.allocation_id, lease.slot_index)
            for res in snap.reservations if (res.allocation_id, res.slot_index) == (lease.allocation_id,
                                                                                      lease.slot_index)]


def judge(snap: HostSnapshot, slice_config: SliceConfig, *, exporter_port: int | None = None) -> Judgement:
    """The snapshot's findings in report order and the repairs reconcile may make (none applied).

    ``slice_config``: the slice's subnet and gateway, which an active port's isolation rules follow;
    ``exporter_port``: the guest exporter's port the host may open into opted-in slots (None: into none).
    """
    findings: list[DriftFinding] = []
    for lease in snap.leases:
        findings += lease_findings(snap, lease)
    findings += blocked_disk_findings(snap)
    findings += orphan_domain_findings(snap)
    repairs: list[Repair] = []
    for finding, res in orphan_reservations(snap):
        repairs.append(RemoveReservation(len(findings), res))
        findings.append(finding)
    for finding, port in orphan_ports(snap):
        repairs.append(RemovePort(len(findings), port))
        findings.append(finding)
    active = active_ports(snap)
    isolation = None if snap.isolation is None else judge_isolation(
        slice_config, snap.isolation, ports=snap.ports, active=active, known=snap.known,
        exporter_port=exporter_port, leased=active_ports(snap, in_flight=True))
    return Judgement(findings=findings, repairs=repairs, active=active, isolation=isolation)


def tenant_stopped(record: SlotRecord | None) -> bool:
    """The slot record says the tenant's own ``slice.vm_power stop`` (or a reboot whose start failed) left it off."""
    return record is not None and record.detail.power_state is PowerState.stopped


def shutoff_finding(lease: SlotLease, record: SlotRecord | None, domain: DomainInfo) -> DriftFinding:
    """An active slot's shut-off domain is always reported; ``info`` when the tenant stopped it, else ``error``."""
    stopped = tenant_stopped(record)
    return _finding(DriftKind.domain_shutoff, lease.allocation_id, DriftSeverity.info if stopped else DriftSeverity.error,
                    expected="running" if not stopped else "stopped by the tenant", actual=domain.state.value,
                    slot_index=lease.slot_index, domain=domain.name,
                    power_state=record.detail.power_state.value if record and record.detail.power_state else None,
                    last_power_operation=record.detail.last_power_operation.model_dump(mode="json")
                    if record and record.detail.last_power_operation else None)


def store_disk(leases: tuple[SlotLease, ...] | list[SlotLease], record: SlotRecord) -> str | None:
    return next((lease.nvme_device for lease in leases if lease.slot_index == record.slot_index), None)


# -- repair: only what cannot hurt a tenant --------------------------------------------------------------


async def apply_repairs(drivers: SliceDrivers, judgement: Judgement) -> list[DriftFinding]:
    """Apply the judgement's repairs; returns its findings with ``repaired`` set where one took effect.

    Reservations first (dnsmasq is signalled once, after them), then ports: each idempotent. The
    isolation's repairs (``tasks/isolation.py``) are applied after these, by the caller.
    """
    findings = list(judgement.findings)
    reservations = [r for r in judgement.repairs if isinstance(r, RemoveReservation)]
    if reservations:
        hosts_file = drivers.reservations()
        for fix in reservations:
            removed = await asyncio.to_thread(hosts_file.remove, fix.reservation.allocation_id,
                                              fix.reservation.slot_index)
            findings[fix.finding] = findings[fix.finding].model_copy(update={"repaired": bool(removed)})
        await asyncio.to_thread(hosts_file.reload)
    for unplug in (r for r in judgement.repairs if isinstance(r, RemovePort)):
        async with drivers.ovs() as ovs:
            done = await asyncio.to_thread(ovs.remove_vm_port, unplug.port.bridge, unplug.port.name,
                                           allocation_id=unplug.port.allocation_id)
        findings[unplug.finding] = findings[unplug.finding].model_copy(update={"repaired": done})
    return findings


async def reconcile(drivers: SliceDrivers, store: AnyStore, *, repair: bool,
                    trigger: DriftTrigger = DriftTrigger.task, node_id: str | None = None,
                    isolation_only: bool = False) -> DriftReport:
    """One pass (see the module docstring). ``isolation_only`` (read-only): the port isolation probe's pass, whose
    isolation findings alone are meant; libvirt is read only where they depend on it (:func:`gather`)."""
    if isolation_only and repair:
        raise ValueError("an isolation-only pass is read-only: its other findings may lack the domains")
    started = time.monotonic()
    state = as_store_thread(store)  # SQLite off the loop (state/aio.py)
    snap = await gather(drivers, state, isolation_only=isolation_only)
    judgement = judge(snap, drivers.slice, exporter_port=drivers.guest_exporter_port)
    findings = await apply_repairs(drivers, judgement) if repair else list(judgement.findings)
    if judgement.isolation is not None:
        findings += (await repair_isolation(drivers, judgement.isolation) if repair
                     else judgement.isolation.findings)
    # NVSwitch hosts: Fabric Manager's active partitions vs. the partition leases and the running domains.
    findings += await fabric_partitions.reconcile_findings(drivers.fabric, state, set(snap.running), repair=repair)
    # Every fabric VF the agent set vs. its PF: an active lease's attachment restored, a parked VF parked again.
    findings += await fabricvf.reconcile_findings(drivers.fabric_vf, state, {(lease.allocation_id, lease.fabric_vf_pci_address)
                                                                            for lease in snap.leases}, repair=repair)

    report = DriftReport(node_id=node_id, trigger=trigger, findings=findings, at=datetime.now(UTC))
    log_event(log, "reconciled", trigger=trigger.value, findings=len(findings),
              repaired=sum(f.repaired for f in findings), duration_s=round(time.monotonic() - started, 3),
              leases=len(snap.leases), domains=len(snap.domains), ports=len(snap.ports),
              reservations=len(snap.reservations), dhcp_leases=len(snap.dhcp))
    return report


def reconcile_handler(drivers: SliceDrivers) -> Handler:
    async def handle(payload: ReconcilePayload, ctx: TaskContext) -> dict[str, Any]:
        await ctx.progress("reconcile", "started")
        report = await reconcile(drivers, ctx.store, repair=payload.repair, node_id=ctx.node_id)
        await ctx.progress("reconcile", "succeeded", detail={"findings": len(report.findings)})
        return report.model_dump(mode="json")

    return handle
