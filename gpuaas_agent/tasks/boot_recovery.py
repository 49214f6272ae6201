"""The first start of the agent after the host rebooted: re-validate every active slice, restore what is safe.

A reboot moves kernel names (docs/safety.md §2), loads ``nvidia``/``mlx5_core`` back
onto the GPUs and VFs (vfio-pci binds by ``driver_override``, which does not
survive a boot), may take the 1 GiB hugepages, and leaves every domain shut off
(the agent defines them without autostart: a domain must not start before its
devices are proven). Nothing restarts a slice unless the agent does, so:

1. **Detect the boot**: the kernel's ``/proc/sys/kernel/random/boot_id`` (read
   through the host root) differs from the one the state store remembers.
2. For every slot that is ``active`` with its lease (``provisioning``/``releasing``
   slots are their journaled task's business, resumed by the worker):

   * the slot's devices against the live host (``tasks/slot_topology.py``): GPU and
     VF present, the by-id path still the leased disk identity, the domain's
     hostdevs and NUMA node the leased ones. Any mismatch: typed findings, the
     domain is **never** started, the record's health is ``failed``;
   * a domain that is running: validated, nothing to do;
   * shut off because the tenant stopped it (record ``power_state: stopped``) or by
     the profile's ``on_host_boot: leave_stopped``: ``boot_restart_held``;
   * otherwise (``on_host_boot: restart``, the default): the GPU and VF are put back
     on vfio-pci through ``host/devices/vfio.py``'s guarded path (IOMMU group isolation
     first), the fabric VF's recorded attachment set again and read back (a reboot reset
     the PF's VF settings; ``tasks/fabricvf.py``), then the one guarded start every start takes
     (``tasks/domain_start.py``: disk guard with the lease's identity, /dev/kvm, the
     OVS bridge, hugepages on the node, vfio-pci, port isolation). A refusal is a
     ``slot_rebind_failed`` or ``boot_restart_refused`` finding with the guard's
     code and evidence; a start is ``boot_restarted`` (info).

3. Remember the new boot_id only after the pass ran: an agent killed mid-recovery
   runs it again at its next start (every step is idempotent).

The report is a :class:`DriftReport` with ``trigger: boot``, logged and published on
the drift subject. Nothing here wipes a disk, releases a lease or destroys a domain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.domain import DomainInfo
from gpuaas_agent.contract.drift import (
    DriftFinding,
    DriftKind,
    DriftReport,
    DriftSeverity,
    DriftTrigger,
)
from gpuaas_agent.contract.naming import allocation_from_domain_name
from gpuaas_agent.contract.runtime import (
    OnHostBoot,
    RuntimeProfile,
    UnknownProfileError,
    get_profile,
)
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import BootRecoveryNote, PowerState, SlotLease, SlotRecord
from gpuaas_agent.contract.storage import DiskLease
from gpuaas_agent.contract.types import UUID_RE
from gpuaas_agent.contract.vfio import VFIO_DRIVER
from gpuaas_agent.errors import AgentError
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.tasks.context import AnyStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.slot_topology import slot_topology_findings

if TYPE_CHECKING:
    from gpuaas_agent.host.devices.vfio import AfterWrite

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
BOOT_ID_KEY = "boot_id"
_BOOT_ID_RE = UUID_RE  # the kernel prints boot_id as a lower-case UUID


def read_boot_id(host: HostRoot) -> str | None:
    """The kernel's boot id (a UUID, new at every boot), or None when it cannot be read or is not one."""
    try:
        value = host.read_text(BOOT_ID_PATH).strip()
    except (OSError, ValueError):
        return None
    return value if _BOOT_ID_RE.match(value) else None


def boot_action(profile: RuntimeProfile, record: SlotRecord) -> str:
    """``restart`` or why not: ``tenant_stopped`` (the tenant's stop outlives a reboot) or ``policy``."""
    if record.detail.power_state is PowerState.stopped:
        return "tenant_stopped"
    if profile.on_host_boot is OnHostBoot.leave_stopped:
        return "policy"
    return "restart"


@dataclass
class SlotRecovery:
    """What recovery found and did for one active slot."""

    lease: SlotLease
    findings: list[DriftFinding] = field(default_factory=list)
    outcome: str = "validated"  # validated | restarted | held | refused

    def add(self, kind: DriftKind, severity: DriftSeverity, *, expected: str | None = None,
            actual: str | None = None, subject: str | None = None, **detail: Any) -> None:
        self.findings.append(DriftFinding(
            kind=kind, subject=subject or self.lease.allocation_id, severity=severity, expected=expected,
            actual=actual, detail={"allocation_id": self.lease.allocation_id, "slot_index": self.lease.slot_index,
                                   **detail}))


def _refused(rec: SlotRecovery, kind: DriftKind, exc: AgentError, **detail: Any) -> None:
    rec.outcome = "refused"
    rec.add(kind, DriftSeverity.error, expected="restored", actual=f"{exc.code}: {exc.message}",
            code=exc.code, evidence=exc.evidence, **detail)


async def rebind(drivers: SliceDrivers, lease: SlotLease, rec: SlotRecovery, after_write: AfterWrite | None) -> bool:
    """Put the slot's GPU and VF back on vfio-pci (guarded, idempotent); False after a refusal (finding made)."""
    # The rebind, the guarded start and the power plan: only a host with an active slot recovers one, so an idle
    # host's start does not import them (docs/performance.md, idle footprint).
    from gpuaas_agent.host.devices.vfio import bind_to_vfio

    approved = [lease.gpu_pci_address, lease.fabric_vf_pci_address]
    for address in approved:
        try:
            result = await bind_to_vfio(drivers.discovered_root(), address, approved, after_write=after_write)
        except AgentError as exc:
            _refused(rec, DriftKind.slot_rebind_failed, exc, address=address)
            rec.findings[-1] = rec.findings[-1].model_copy(update={"subject": address, "expected": VFIO_DRIVER})
            return False
        if result.changed:
            log_event(log, "boot_rebound", address=address, previous_driver=result.previous_driver,
                      allocation_id=lease.allocation_id)
    return True


async def recover_slot(drivers: SliceDrivers, lease: SlotLease, record: SlotRecord, domain: DomainInfo | None,
                       *, after_write: AfterWrite | None = None, data_slots: tuple[SlotLease, ...] = (),
                       store: StoreThread | None = None) -> SlotRecovery:
    """One active slice after a boot: ``lease`` is its boot slot; ``data_slots`` the other slots of a
    multi-GPU allocation (one domain), re-bound and guarded with it, never started on their own."""
    from gpuaas_agent.tasks.domain_start import guarded_start  # an active slot's: see rebind
    from gpuaas_agent.tasks.fabricvf import restore_applied
    from gpuaas_agent.tasks.power import ON, start_plan

    rec = SlotRecovery(lease)
    if domain is None or domain.metadata is None:
        rec.outcome = "refused"
        rec.add(DriftKind.domain_missing, DriftSeverity.error, expected="the slot's domain defined",
                actual="no agent domain")
        return rec
    try:
        profile = get_profile(domain.metadata.profile)
    except UnknownProfileError as exc:
        _refused(rec, DriftKind.boot_restart_refused, exc, domain=domain.name)
        return rec
    try:
        devices = await drivers.libvirt.devices(domain.name)
    except AgentError as exc:
        _refused(rec, DriftKind.boot_restart_refused, exc, domain=domain.name)
        return rec
    # Devices first, whatever the domain's state: a disk that is not the leased one is never started.
    topology = await asyncio.to_thread(slot_topology_findings, drivers.discovered_root(), lease, devices, hostdevs=profile.hostdevs)
    if topology:
        rec.findings += topology
        rec.outcome = "refused"
        rec.add(DriftKind.boot_restart_refused, DriftSeverity.error, expected="the leased devices",
                actual=", ".join(sorted({f.kind.value for f in topology})), code="slot_devices_changed",
                domain=domain.name, note="the domain is not started: a release (wipe and verify) or an operator decides")
        return rec
    if domain.state in ON:
        return rec  # running (an agent restart without a reboot of libvirt's guests): validated, nothing to do
    action = boot_action(profile, record)
    if action != "restart":
        rec.outcome = "held"
        rec.add(DriftKind.boot_restart_held, DriftSeverity.info if action == "tenant_stopped" else DriftSeverity.warn,
                expected="stopped" if action == "tenant_stopped" else f"on_host_boot={profile.on_host_boot.value}",
                actual=domain.state.value, reason=action, domain=domain.name)
        return rec
    if profile.hostdevs:
        for held in (lease, *data_slots):
            if not await rebind(drivers, held, rec, after_write):
                return rec
        if store is not None:  # a reboot reset the PFs' VF settings: the attachment again, read back, first
            try:
                await restore_applied(drivers.fabric_vf, store, [h.fabric_vf_pci_address for h in (lease, *data_slots)],
                                      lease.allocation_id)
            except AgentError as exc:
                _refused(rec, DriftKind.boot_restart_refused, exc, domain=domain.name)
                return rec
    disk_lease = DiskLease(allocation_id=lease.allocation_id, slot_index=lease.slot_index,
                           nvme_device=lease.nvme_device, disk_identity=lease.disk_identity)
    try:
        target, port = await start_plan(drivers, domain, lease, data_slots)
        started = await guarded_start(drivers, target, disk_lease=disk_lease, port=port, data_slots=data_slots)
    except AgentError as exc:
        _refused(rec, DriftKind.boot_restart_refused, exc, domain=domain.name)
        return rec
    rec.outcome = "restarted"
    rec.add(DriftKind.boot_restarted, DriftSeverity.info, expected="running", actual=started["state"],
            domain=domain.name, checks_passed=started["preconditions"]["checks_passed"])
    return rec


async def recover_after_boot(drivers: SliceDrivers, store: AnyStore, *, boot_id: str | None = None, previous_boot_id: str | None = None,
                             node_id: str | None = None, after_write: AfterWrite | None = None) -> DriftReport:
    """One pass over the active slots (see the module docstring); the slot records get the outcome."""
    state = as_store_thread(store)
    leases = await state.leases()
    records = {r.slot_index: r for r in await state.slot_states()}
    active = [lease for lease in leases if (r := records.get(lease.slot_index)) is not None
              and r.status is SlotStatus.active and r.allocation_id == lease.allocation_id]
    by_alloc: dict[str, DomainInfo] = {}
    for d in await drivers.libvirt.list_agent_domains() if active else []:
        alloc = d.metadata.allocation_id if d.metadata else allocation_from_domain_name(d.name)
        if alloc:
            by_alloc[alloc] = d
    findings: list[DriftFinding] = []
    outcomes: dict[str, int] = {}
    # A data slot of a multi-GPU allocation (its record names its boot slot) is recovered with its boot slot.
    data_of: dict[str, list[SlotLease]] = {}
    for lease in active:
        if records[lease.slot_index].detail.boot_slot_index is not None:
            data_of.setdefault(lease.allocation_id, []).append(lease)
    for lease in active:
        record = records[lease.slot_index]
        if record.detail.boot_slot_index is not None:
            continue
        async with drivers.slot_lock(lease.slot_index):
            rec = await recover_slot(drivers, lease, record, by_alloc.get(lease.allocation_id), after_write=after_write,
                                     data_slots=tuple(data_of.get(lease.allocation_id, ())), store=state)
            findings += rec.findings
            outcomes[rec.outcome] = outcomes.get(rec.outcome, 0) + 1
            note = BootRecoveryNote(boot_id=boot_id, outcome=rec.outcome, at=time.time(),
                                    findings=sorted({f.kind.value for f in rec.findings}))
            restarted = {"power_state": PowerState.running} if rec.outcome == "restarted" else {}
            update: dict[str, Any] = {"detail": record.detail.updated(boot_recovery=note, **restarted), "updated_at": time.time()}
            if rec.outcome == "restarted":
                update["health_state"] = HealthState.healthy
            elif rec.outcome == "refused":
                update["health_state"] = HealthState.failed
            await state.set_slot_state(record.model_copy(update=update))
    log_event(log, "boot_recovered", logging.WARNING if outcomes.get("refused") else logging.INFO,
              boot_id=boot_id, previous_boot_id=previous_boot_id, outcomes=outcomes, findings=len(findings))
    return DriftReport(node_id=node_id, trigger=DriftTrigger.boot, findings=findings, at=datetime.now(UTC))


async def check_boot(drivers: SliceDrivers, store: AnyStore, *, node_id: str | None = None,
                     after_write: AfterWrite | None = None) -> DriftReport | None:
    """Run :func:`recover_after_boot` when the host booted since the boot_id was stored; None when it did not.

    The very first start (no boot_id stored: a fresh install or an agent from before this) runs the
    pass too: it restarts nothing that is running and re-validates what is held.
    """
    state = as_store_thread(store)
    current = await asyncio.to_thread(read_boot_id, drivers.discovered_root())
    if current is None:
        log_event(log, "boot_id_unreadable", logging.WARNING, path=BOOT_ID_PATH,
                  message="cannot tell whether the host rebooted: boot recovery skipped; reconcile still reports")
        return None
    previous = await state.meta(BOOT_ID_KEY)
    if previous == current:
        return None
    report = await recover_after_boot(drivers, state, boot_id=current, previous_boot_id=previous, node_id=node_id,
                                      after_write=after_write)
    await state.set_meta(BOOT_ID_KEY, current)
    return report


async def boot_recovery_at_start(drivers: SliceDrivers, store: AnyStore) -> DriftReport | None:
    """The daemon's call before it pulls tasks: :func:`check_boot`, a failure logged (the reconcile timer and the
    next start try again: the boot_id is stored only after a pass ran), never fatal."""
    try:
        return await check_boot(drivers, store)
    except AgentError as exc:
        log_event(log, "boot_recovery_failed", logging.WARNING, code=exc.code, message=exc.message,
                  evidence=exc.evidence)
        return None


async def publish_boot_report(nc: Client, node_id: str, report: DriftReport | None, timeout_s: float) -> None:
    """The boot report on ``gpuaas.node.<node>.drift`` when it has findings (best effort, like the timer's)."""
    if report is None or not report.findings:
        return
    data = report.model_copy(update={"node_id": node_id}).model_dump_json().encode()
    try:
        await nc.publish(subjects.drift(node_id), data)
        await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # nats.py says int; seconds
    except (nats.errors.Error, TimeoutError) as exc:
        log_event(log, "boot_report_publish_failed", logging.WARNING, error=repr(exc))
