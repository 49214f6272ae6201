"""``slice.vm_power``: a tenant stops, starts, reboots or resets the slice it holds.

Who may: only the allocation that holds the slot's lease on this host *and* an
``active`` slot record for it. A slot that is ``provisioning``, ``releasing``,
``cleanup_blocked`` or another allocation's is refused before anything is looked
at; the domain must carry our metadata naming this allocation and slot. The
payload only names the slot: devices, MAC and bridge come from the lease and the
domain the agent defined, never from the wire.

What each operation does (all idempotent):

* ``stop``: ACPI power button, ``graceful_timeout_s`` to comply, then destroy.
  A shut-off domain: nothing changed.
* ``start``: the guarded start every start takes (:mod:`gpuaas_agent.tasks.domain_start`:
  IOMMU isolation, disk guard, KVM/bridge/hugepages/vfio, then the OVS port's ids).
  A running domain: nothing changed.
* ``reboot``: ``stop`` then ``start``, so the start guards run again (a guest that
  ignores ACPI is destroyed at the deadline). Not ``virDomainReboot``: that leaves
  the guest to decide and re-checks nothing on the host.
* ``reset``: ``virDomainReset``, a hard reset; the domain stays running, so no start
  guard is needed. A shut-off domain is refused (``domain_not_running``): start it.

A multi-slot slice (one allocation, N slots, one domain: ``tasks/slotset.py``) is named by
its boot slot; the domain must hold every leased slot's disk (the boot disk first) and, when
the profile passes devices through, every slot's GPU and VF, and each slot must still be
``active`` for the allocation. Its start guards every slot's devices and disk under that
slot's own lease (:func:`~gpuaas_agent.tasks.domain_start.guarded_start`'s ``data_slots``,
as provision's start does). The operation holds every slot's lock, in index order.

Fairness (docs/fairness.md): operations of one slot go through the slot's power line
(:mod:`gpuaas_agent.tasks.power_line`): one runs, at most one waits, a newer request
supersedes the waiting one, and a repeat of the running operation is answered
``superseded`` at once. ``graceful_timeout_s`` is cut to the host's
``[slice] max_graceful_timeout_s``; the result says when it was.

A stopped slice keeps its lease, its disk and its ``active`` record: it is never
wiped or released here. The record's detail says ``power_state`` (``running``,
``stopped``, or libvirt's state) and the last operation, so reconcile and the
control plane tell a slice the tenant stopped from one that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from gpuaas_agent.contract.domain import DomainInfo, DomainState, StartTarget
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.slots import SlotOutcome, SlotStatus
from gpuaas_agent.contract.state import PowerState, SlotLease, SlotRecord
from gpuaas_agent.contract.storage import DiskLease
from gpuaas_agent.contract.tasks import VmPowerPayload
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.context import Handler, SlotRequest, TaskContext
from gpuaas_agent.tasks.domain_start import SlicePort, guarded_start
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.pipeline import PipelineFailed, Step, run_pipeline

log = logging.getLogger(__name__)

# States in which the domain counts as on (a start of it changes nothing).
ON = frozenset({DomainState.running, DomainState.blocked, DomainState.paused, DomainState.pmsuspended})


class PowerRefused(AgentError):
    """Refused before anything was changed on the host.

    Codes: ``not_this_allocation``, ``slot_cleanup_blocked``, ``slot_not_active``,
    ``domain_missing``, ``domain_not_ours``, ``domain_lease_mismatch``, ``domain_not_running``.
    """

    default_code = "power_refused"


def power_state(state: DomainState | None) -> str:
    """The slot record's ``power_state``: what the tenant sees (``stopped`` for shut off)."""
    return PowerState.of_domain(state).value


def admit(store: StateStore, payload: SlotRequest) -> tuple[SlotLease, SlotRecord]:
    """The lease and the active record of this allocation on the slot, or a refusal naming why not."""
    index, alloc = payload.slot_index, payload.allocation_id
    record = store.slot_state(index)
    lease = next((held for held in store.leases() if held.slot_index == index), None)
    holder = next((r.allocation_id for r in (lease, record) if r is not None and r.allocation_id != alloc), None)
    evidence = {"slot_index": index, "lease_held": lease is not None and lease.allocation_id == alloc,
                "host_status": record.status.value if record else None}
    if holder is not None:
        raise PowerRefused(f"slot {index} is held by another allocation, not {alloc}: nothing touched",
                           code="not_this_allocation", evidence={**evidence, "held_by": holder})
    if record is not None and record.status is SlotStatus.cleanup_blocked:
        raise PowerRefused(f"slot {index} is cleanup_blocked: only a release (wipe and verify) may act on it",
                           code="slot_cleanup_blocked", evidence=evidence)
    if lease is None or record is None or record.status is not SlotStatus.active:
        state = record.status.value if record else "not leased"
        raise PowerRefused(f"slot {index} is {state} on this host, not an active slice of {alloc}",
                           code="slot_not_active", evidence=evidence)
    return lease, record


def admit_slice(store: StateStore, payload: VmPowerPayload) -> tuple[SlotLease, SlotRecord, list[SlotLease]]:
    """:func:`admit`, and the allocation's other leased slots (a multi-slot slice), each still ``active`` for it."""
    lease, record = admit(store, payload)
    data = sorted((held for held in store.leases_of(payload.allocation_id) if held.slot_index != lease.slot_index),
                  key=lambda held: held.slot_index)
    for held in data:
        other = store.slot_state(held.slot_index)
        if other is None or other.allocation_id != payload.allocation_id or other.status is not SlotStatus.active:
            state = other.status.value if other else "not recorded"
            raise PowerRefused(f"slot {held.slot_index} of the slice of {payload.allocation_id} is {state}, not active: "
                               f"nothing touched", code="slot_cleanup_blocked" if other is not None and
                               other.status is SlotStatus.cleanup_blocked else "slot_not_active",
                               evidence={"slot_index": held.slot_index, "boot_slot_index": payload.slot_index,
                                         "host_status": other.status.value if other else None})
    return lease, record, data


def check_domain(info: DomainInfo | None, payload: SlotRequest) -> DomainInfo:
    name = domain_name(payload.allocation_id)
    if info is None:
        raise PowerRefused(f"slot {payload.slot_index} is active but domain {name} does not exist",
                           code="domain_missing", evidence={"domain": name, "slot_index": payload.slot_index})
    meta = info.metadata
    if meta is None or (meta.allocation_id, meta.slot_index) != (payload.allocation_id, payload.slot_index):
        raise PowerRefused(f"domain {name} is not this agent's domain of allocation {payload.allocation_id} "
                           f"slot {payload.slot_index}", code="domain_not_ours",
                           evidence={"domain": info.model_dump(mode="json"), "slot_index": payload.slot_index})
    return info


async def start_plan(drivers: SliceDrivers, info: DomainInfo, lease: SlotLease,
                     data_slots: Sequence[SlotLease] = ()) -> tuple[StartTarget, SlicePort]:
    """What the guarded start checks, from the leases and the domain's own XML; the two must agree.

    ``lease`` is the boot slot's (its disk boots, its vNIC is the domain's one interface); ``data_slots``
    the allocation's other leased slots, whose disks, GPUs and VFs the domain holds too.
    """
    devices = await drivers.libvirt.devices(info.name)
    assert info.metadata is not None  # check_domain proved it ours
    profile = get_profile(info.metadata.profile)  # unknown_profile: refused, nothing started
    vnic = vnic_name(lease.allocation_id, lease.slot_index)
    slots = [lease, *data_slots]
    leased_disks = [held.nvme_device for held in slots]
    leased_pci = {a for held in slots for a in (held.gpu_pci_address, held.fabric_vf_pci_address)}
    problems = []
    if devices.block_disks[:1] != [lease.nvme_device] or sorted(devices.block_disks) != sorted(leased_disks):
        problems.append(f"block disks {devices.block_disks} are not the leased {leased_disks} (boot disk first)")
    if set(devices.hostdevs) != (leased_pci if profile.hostdevs else set()):
        problems.append(f"PCI hostdevs {sorted(devices.hostdevs)} are not the leased "
                        f"{sorted(leased_pci) if profile.hostdevs else []}")
    ifaces = [i for i in devices.interfaces if i.target_dev == vnic and i.bridge]
    if len(devices.interfaces) != 1 or not ifaces:
        problems.append(f"interfaces {[i.model_dump() for i in devices.interfaces]} are not the one vNIC {vnic}")
    if problems:
        raise PowerRefused(f"domain {info.name} does not match the lease of slot {lease.slot_index}: {problems[0]}",
                           code="domain_lease_mismatch",
                           evidence={"problems": problems, "devices": devices.model_dump(mode="json"),
                                     "leases": [held.model_dump() for held in slots]})
    nodeset = devices.numa_nodeset
    bridge = ifaces[0].bridge
    assert bridge, "ifaces keeps only interfaces on a bridge"
    target = StartTarget(
        allocation_id=lease.allocation_id, slot_index=lease.slot_index, profile=profile,
        gpu_pci_address=lease.gpu_pci_address if profile.hostdevs else None,
        fabric_vf_pci_address=lease.fabric_vf_pci_address if profile.hostdevs else None,
        nvme_device=lease.nvme_device, ovs_bridge=bridge,
        numa_node=int(nodeset) if nodeset is not None and nodeset.isdigit() else None)
    # The port's isolation rules are built from the slot's reservation: no reservation, no start.
    reserved = [r for r in await asyncio.to_thread(drivers.reservations().reservations)
                if r.allocation_id == lease.allocation_id and r.slot_index == lease.slot_index]
    if len(reserved) != 1 or reserved[0].mac != ifaces[0].mac:
        raise PowerRefused(f"slot {lease.slot_index} of allocation {lease.allocation_id} has no reservation for "
                           f"{ifaces[0].mac}: its port could not be isolated", code="reservation_missing",
                           evidence={"reservations": [r.model_dump(mode="json") for r in reserved],
                                     "mac": ifaces[0].mac})
    port = SlicePort(bridge=bridge, vnic=vnic, mac=ifaces[0].mac, ip=str(reserved[0].ip),
                     allocation_id=lease.allocation_id, slot_index=lease.slot_index,
                     policing=profile.ingress_policing, guest_telemetry=lease.guest_telemetry)
    return target, port


async def power(drivers: SliceDrivers, payload: VmPowerPayload, ctx: TaskContext) -> dict[str, Any]:
    """One power operation, in its turn on the slot's power line (superseded when a newer one wins)."""
    async with drivers.power_line.turn(payload.slot_index, ctx.envelope.task_id, payload.operation):
        store = as_store_thread(ctx.store)
        held = {lease.slot_index for lease in await store.leases_of(payload.allocation_id)}
        async with contextlib.AsyncExitStack() as locks:
            # Every slot of the slice, in index order (as provision takes them: no cycle with another set).
            for index in sorted(held | {payload.slot_index}):
                await locks.enter_async_context(drivers.slot_lock(index))
            return await _power(drivers, payload, ctx)


def graceful_timeout(drivers: SliceDrivers, payload: VmPowerPayload) -> tuple[int, dict[str, Any] | None]:
    """The payload's graceful timeout cut to the host's cap, and what was cut (``None`` when nothing)."""
    cap = drivers.slice.max_graceful_timeout_s
    if payload.graceful_timeout_s <= cap:
        return payload.graceful_timeout_s, None
    return cap, {"requested_s": payload.graceful_timeout_s, "max_graceful_timeout_s": cap}


async def _power(drivers: SliceDrivers, payload: VmPowerPayload, ctx: TaskContext) -> dict[str, Any]:
    store = as_store_thread(ctx.store)  # every call awaited on the store thread (state/aio.py)
    op = payload.operation
    name = domain_name(payload.allocation_id)
    task_id = ctx.envelope.task_id
    grace, capped = graceful_timeout(drivers, payload)

    lease, record, data_slots = await store.run(admit_slice, payload)
    info = check_domain(await drivers.libvirt.lookup(name), payload)
    before = info.state
    if op == "reset" and before not in ON:
        raise PowerRefused(f"domain {name} is {before.value}; a reset needs a running domain (start it instead)",
                           code="domain_not_running", evidence={"domain": name, "state": before.value})
    disk_lease = DiskLease(allocation_id=lease.allocation_id, slot_index=lease.slot_index,
                           nvme_device=lease.nvme_device, disk_identity=lease.disk_identity)

    async def stop() -> dict[str, Any]:
        outcome = await drivers.libvirt.shutdown(name, deadline_s=grace)
        return outcome.model_dump(mode="json")

    async def start() -> dict[str, Any]:
        target, port = await start_plan(drivers, info, lease, data_slots)
        # Each data slot's GPU, VF and disk guarded under its own lease, as provision's start does.
        return await guarded_start(drivers, target, disk_lease=disk_lease, port=port, data_slots=data_slots)

    async def reset() -> dict[str, Any]:
        return (await drivers.libvirt.reset(name)).model_dump(mode="json")

    steps: list[Step] = []
    if op in ("stop", "reboot") and before is not DomainState.shutoff:
        steps.append(Step("shutdown", stop))
    if op == "reboot" or (op == "start" and before not in ON):
        steps.append(Step("start", start))
    if op == "reset":
        steps.append(Step("reset", reset))

    failure: PipelineFailed | None = None
    outputs: dict[str, Any] = {}
    if steps:
        try:
            outputs = await run_pipeline(ctx, steps)
        except PipelineFailed as exc:
            failure = exc
    try:
        after = await drivers.libvirt.lookup(name)
    except AgentError:  # libvirt gone after the operation: record "unknown", never mask the operation's error
        after = None
    state = after.state if after is not None else None
    last = {"operation": op, "task_id": task_id, "at": time.time(), "changed": bool(outputs or failure),
            "succeeded": failure is None, "code": failure.code if failure else None}
    detail = record.detail.updated(power_state=power_state(state), last_power_operation=last)
    # Status stays active whatever happened: a stopped slice keeps its lease and its disk.
    await store.set_slot_state(record.model_copy(update={"detail": detail, "task_id": task_id,
                                                         "updated_at": time.time()}))
    ctx.slot_outcomes.append(SlotOutcome(slot_index=payload.slot_index, status=SlotStatus.active,
                                         health_state=record.health_state,
                                         health_detail={"power_state": power_state(state),
                                                        "last_power_operation": last}))
    log_event(log, "slice_power", logging.WARNING if failure else logging.INFO, task_id=task_id,
              allocation_id=payload.allocation_id, slot_index=payload.slot_index, operation=op,
              before=before.value, after=state.value if state else None, changed=last["changed"],
              code=last["code"], slots=[payload.slot_index, *(held.slot_index for held in data_slots)],
              graceful_timeout_s=grace, graceful_timeout_capped=capped is not None)
    if failure is not None:
        if capped is not None:
            failure.evidence.setdefault("graceful_timeout_capped", capped)
        raise failure
    out = {
        "vm": name,
        "operation": op,
        "changed": bool(outputs),
        "done": list(outputs) or [f"nothing: domain was already {before.value}"],
        "state_before": before.value,
        "state": state.value if state else None,
        "power_state": power_state(state),
        "steps": outputs,
        "graceful_timeout_s": grace,
    }
    if capped is not None:
        out["graceful_timeout_capped"] = capped
    if data_slots:
        out["slots"] = [payload.slot_index, *(held.slot_index for held in data_slots)]
    return out


def power_handler(drivers: SliceDrivers) -> Handler:
    async def handle(payload: VmPowerPayload, ctx: TaskContext) -> dict[str, Any]:
        return await power(drivers, payload, ctx)

    return handle
