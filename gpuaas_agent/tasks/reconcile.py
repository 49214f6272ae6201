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
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.dhcp import LeaseState
from gpuaas_agent.contract.drift import (
    DriftFinding,
    DriftKind,
    DriftReport,
    DriftSeverity,
    DriftTrigger,
)
from gpuaas_agent.contract.naming import allocation_from_domain_name
from gpuaas_agent.contract.runtime import UnknownProfileError, get_profile
from gpuaas_agent.contract.slots import SlotStatus
from gpuaas_agent.contract.state import PowerState
from gpuaas_agent.contract.tasks import ReconcilePayload
from gpuaas_agent.contract.vfio import VFIO_DRIVER
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.dnsmasq import parse_leases, status_of
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.tasks import fabric_partitions
from gpuaas_agent.tasks.context import TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.isolation import ActivePort, isolation_drift
from gpuaas_agent.tasks.slot_topology import slot_topology_findings

log = logging.getLogger(__name__)


def _finding(kind: DriftKind, subject: str, severity: DriftSeverity, *, expected=None, actual=None,
             repaired=False, **detail) -> DriftFinding:
    return DriftFinding(kind=kind, subject=subject, severity=severity, expected=expected, actual=actual,
                        repaired=repaired, detail=detail)


async def reconcile(sh: SliceDrivers, store, *, repair: bool, trigger: DriftTrigger = DriftTrigger.task,
                    node_id: str | None = None) -> DriftReport:
    started = time.monotonic()
    state = as_store_thread(store)  # SQLite off the loop (state/aio.py)
    leases = await state.leases()
    records = {r.slot_index: r for r in await state.slot_states()}
    domains = await sh.libvirt.list_agent_domains()
    reservations_file = sh.reservations()
    reservations = await asyncio.to_thread(reservations_file.reservations)
    async with sh.ovs() as ovs:
        ports = await asyncio.to_thread(ovs.list_agent_ports)
    dhcp = await asyncio.to_thread(parse_leases, sh.slice.dnsmasq_lease_file)
    host = sh.discovered_root().fresh()

    leased = {lease.allocation_id for lease in leases}
    recorded = {r.allocation_id for r in records.values()}
    by_alloc = {}
    for d in domains:
        alloc = d.metadata.allocation_id if d.metadata else allocation_from_domain_name(d.name)
        if alloc:
            by_alloc[alloc] = d
    known = leased | recorded | set(by_alloc)
    findings: list[DriftFinding] = []

    for lease in leases:
        record = records.get(lease.slot_index)
        domain = by_alloc.get(lease.allocation_id)
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
        findings += await topology_findings(sh, lease, domain)
        mine = [r for r in reservations if r.allocation_id == lease.allocation_id and r.slot_index == lease.slot_index]
        # A data slot of a multi-slot allocation (docs/multi-gpu.md) has no vNIC and no reservation of its own.
        data_slot = record is not None and record.detail.boot_slot_index not in (None, lease.slot_index)
        if status is SlotStatus.active and not mine and not data_slot:
            findings.append(_finding(DriftKind.reservation_missing, lease.allocation_id, DriftSeverity.error,
                                     expected="a dnsmasq reservation", actual="none",
                                     slot_index=lease.slot_index))
        if status is SlotStatus.active and mine and domain is not None and domain.state.value == "running":
            seen = status_of(dhcp, mine[0].mac, mine[0].ip, time.time())
            if seen.lease_state is not LeaseState.bound:
                findings.append(_finding(DriftKind.dhcp_lease_missing, lease.allocation_id, DriftSeverity.warn,
                                         expected=f"{mine[0].mac} holds {mine[0].ip}",
                                         actual=f"{seen.lease_state.value} {seen.actual_ip or ''}".strip(),
                                         slot_index=lease.slot_index))
        if domain is not None and domain.metadata is not None and domain.state.value == "running":
            try:
                hostdevs = get_profile(domain.metadata.profile).hostdevs
            except UnknownProfileError:
                hostdevs = True
            if hostdevs:
                for address in (lease.gpu_pci_address, lease.fabric_vf_pci_address):
                    driver = host.link_name(f"/sys/bus/pci/devices/{address}/driver")
                    if driver != VFIO_DRIVER:
                        findings.append(_finding(DriftKind.driver_not_vfio, address, DriftSeverity.error,
                                                 expected=VFIO_DRIVER, actual=driver or "none",
                                                 allocation_id=lease.allocation_id))

    for record in records.values():
        if record.status is SlotStatus.cleanup_blocked:
            findings.append(_finding(DriftKind.disk_not_wiped, store_disk(leases, record) or str(record.slot_index),
                                     DriftSeverity.error, expected="wiped and verified", actual="cleanup_blocked",
                                     slot_index=record.slot_index, allocation_id=record.allocation_id,
                                     failed_step=record.detail.failed_step))

    for alloc, domain in sorted(by_alloc.items()):
        if alloc not in leased:
            findings.append(_finding(DriftKind.domain_orphan, alloc, DriftSeverity.warn,
                                     expected="no domain (no lease)", actual=f"{domain.name} {domain.state.value}",
                                     note="never destroyed by reconcile: a release decides"))

    removed_reservations = set()
    for res in reservations:
        if res.allocation_id in known:
            continue
        done = False
        if repair:
            done = bool(await asyncio.to_thread(reservations_file.remove, res.allocation_id, res.slot_index))
            removed_reservations.add(res.allocation_id)
        findings.append(_finding(DriftKind.reservation_orphan, res.allocation_id, DriftSeverity.warn,
                                 expected="no reservation (allocation unknown here)", actual=f"{res.mac} {res.ip}",
                                 repaired=done, slot_index=res.slot_index))
    if removed_reservations:
        await asyncio.to_thread(reservations_file.reload)

    for port in ports:
        if port.allocation_id in known:
            continue
        done = False
        if repair:
            async with sh.ovs() as ovs:
                done = await asyncio.to_thread(ovs.remove_vm_port, port.bridge, port.name,
                                               allocation_id=port.allocation_id)
        findings.append(_finding(DriftKind.port_orphan, port.allocation_id or port.name, DriftSeverity.warn,
                                 expected="no port (allocation unknown here)", actual=f"{port.bridge}/{port.name}",
                                 repaired=done, port=port.name))

    # Port isolation (docs/safety.md §9): an active slot's port carries the flows and guard its reservation implies.
    active = [ActivePort(port=port, mac=res.mac, ip=str(res.ip))
              for lease in leases
              if (rec := records.get(lease.slot_index)) is not None and rec.status is SlotStatus.active
              and rec.allocation_id == lease.allocation_id
              for port in ports if (port.allocation_id, port.slot_index) == (lease.allocation_id, lease.slot_index)
              for res in reservations if (res.allocation_id, res.slot_index) == (lease.allocation_id,
                                                                                   lease.slot_index)]
    findings += await isolation_drift(sh, ports=ports, active=active, known=known, repair=repair)
    # NVSwitch hosts: Fabric Manager's active partitions vs. the partition leases and the running domains.
    findings += await fabric_partitions.reconcile_findings(
        sh.fabric, state, {a for a, d in by_alloc.items() if d.state.value == "running"}, repair=repair)

    report = DriftReport(node_id=node_id, trigger=trigger, findings=findings, at=datetime.now(UTC))
    log_event(log, "reconciled", trigger=trigger.value, findings=len(findings),
              repaired=sum(f.repaired for f in findings), duration_s=round(time.monotonic() - started, 3),
              leases=len(leases), domains=len(domains), ports=len(ports), reservations=len(reservations),
              dhcp_leases=len(dhcp))
    return report


def tenant_stopped(record) -> bool:
    """The slot record says the tenant's own ``slice.vm_power stop`` (or a reboot whose start failed) left it off."""
    return record is not None and record.detail.power_state is PowerState.stopped


def shutoff_finding(lease, record, domain) -> DriftFinding:
    """An active slot's shut-off domain is always reported; ``info`` when the tenant stopped it, else ``error``."""
    stopped = tenant_stopped(record)
    return _finding(DriftKind.domain_shutoff, lease.allocation_id, DriftSeverity.info if stopped else DriftSeverity.error,
                    expected="running" if not stopped else "stopped by the tenant", actual=domain.state.value,
                    slot_index=lease.slot_index, domain=domain.name,
                    power_state=record.detail.power_state.value if record and record.detail.power_state else None,
                    last_power_operation=record.detail.last_power_operation.model_dump(mode="json")
                    if record and record.detail.last_power_operation else None)


async def topology_findings(sh: SliceDrivers, lease, domain) -> list[DriftFinding]:
    """The lease's devices against live sysfs and the domain's XML (``tasks/slot_topology.py``)."""
    devices, hostdevs = None, True
    if domain is not None and domain.metadata is not None:
        try:
            devices = await sh.libvirt.devices(domain.name)
        except AgentError:  # gone between list and read: the domain findings above say so
            devices = None
        try:
            hostdevs = get_profile(domain.metadata.profile).hostdevs
        except UnknownProfileError:
            hostdevs = True
    host = sh.discovered_root()
    return await asyncio.to_thread(slot_topology_findings, host, lease, devices, hostdevs=hostdevs)


def store_disk(leases, record) -> str | None:
    return next((lease.nvme_device for lease in leases if lease.slot_index == record.slot_index), None)


def reconcile_handler(sh: SliceDrivers):
    async def handle(payload: ReconcilePayload, ctx: TaskContext) -> dict:
        await ctx.progress("reconcile", "started")
        report = await reconcile(sh, ctx.store, repair=payload.repair, node_id=ctx.node_id)
        await ctx.progress("reconcile", "succeeded", detail={"findings": len(report.findings)})
        return report.model_dump(mode="json")

    return handle
