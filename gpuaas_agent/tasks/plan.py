"""``slice.plan``: the node-scheduler boundary (seed 002, "Current Non-Infra Work Queue").

The control plane hands over approved slot ids and its records of them; the
agent checks each record against what the host has *now* (complete bindings,
a per-slot VF, a by-id disk that resolves to a raw, unmounted namespace; a
binding this host does not have is ``not_approved``; bindings that exist but
are not exactly the host's candidate slot of that index are ``slot_mismatch``),
takes the host-local leases all or nothing, and answers with the concrete
bundle. It changes nothing else on the host.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuaas_agent.contract.fabric import FabricPartitionList, PartitionLease, PartitionState
from gpuaas_agent.contract.placement import Placement
from gpuaas_agent.contract.plan import BundlePlan, PlannedSlot
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.slots import ApprovedSlot, SlotStatus
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.tasks import PlanPayload
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.discovery.quarantine import mark_quarantined
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.discovery.slots import PlanConfig
from gpuaas_agent.errors import AgentError
from gpuaas_agent.guards.slot_binding import check_slot_binding, disks_by_name
from gpuaas_agent.host.devices.fabricmanager import FabricManager
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.context import Handler, TaskContext
from gpuaas_agent.tasks.fabric_partitions import choose_partition, fabric_for
from gpuaas_agent.tasks.maintenance import check_not_in_maintenance
from gpuaas_agent.tasks.placement import assess_placement, enforce_placement
from gpuaas_agent.tasks.quarantine import check_not_quarantined
from gpuaas_agent.tasks.slotset import free_slot_indexes

# A slot the control plane has not handed to this allocation cannot be planned.
PLANNABLE = frozenset({SlotStatus.available, SlotStatus.reserved})


class PlanError(AgentError):
    default_code = "plan_refused"


def _slot_records(payload: PlanPayload) -> list[ApprovedSlot]:
    """The records of exactly the approved ids; an id without a record is ``not_approved``."""
    by_id = {slot.slot_id: slot for slot in payload.slots}
    missing = [i for i in payload.approved_slot_ids if i not in by_id]
    if missing:
        raise PlanError(f"slots {', '.join(missing)} have no approved record in this task", code="not_approved",
                        evidence={"missing_slot_ids": missing, "records": sorted(by_id)})
    return [by_id[i] for i in payload.approved_slot_ids]


def _no_shared_devices(slots: list[ApprovedSlot]) -> None:
    for field in ("slot_index", "gpu_pci_address", "nvme_device", "fabric_vf_pci_address", "mac", "private_ip"):
        values = [getattr(s, field) for s in slots]
        dupes = sorted({str(v) for v in values if values.count(v) > 1})
        if dupes:
            raise PlanError(f"{field} appears in more than one approved slot: {', '.join(dupes)}",
                            code="duplicate_binding", evidence={"field": field, "values": dupes})


def _not_on_this_node(slot: ApprovedSlot, what: str, detail: str, **evidence: Any) -> PlanError:
    """A binding this host does not have cannot belong to an approved slot of this node."""
    return PlanError(f"slot {slot.slot_id}: {detail}", code="not_approved",
                     evidence={"slot_id": slot.slot_id, "binding": what, **evidence})


def plan_bundle(payload: PlanPayload, report: TopologyReport, *, placement: Placement = Placement.any,
                free_slots: Sequence[int] = (), fabric: FabricPartitionList | None = None,
                held_partitions: Sequence[int] = ()) -> BundlePlan:
    """Pure: approved records + live discovery -> bundle plan, or a typed refusal naming the evidence.

    A set of more than one slot also gets its placement verdict (``tasks/placement.py``); one that crosses
    ``placement`` is refused (``placement_violated``). ``free_slots``: where to look for a better set.
    ``fabric``: Fabric Manager's partitions, given for a ``fabric_partitions`` profile on an NVSwitch host:
    the set (one slot included) must be exactly a supported, healthy, free partition, which the verdict
    names (``fabric_partition_*`` refusals otherwise; ``held_partitions``: this allocation's own).
    """
    slots = _slot_records(payload)
    _no_shared_devices(slots)
    gpus = {g.pci_address: g for g in report.gpus}
    vfs = {f.pci_address: f for f in report.fabric_devices if f.is_vf}
    disks = disks_by_name(report)
    identities = {c.slot_index: c.fabric_vf_identity for c in report.candidate_slots
                  if c.fabric_vf_pci_address is not None}
    planned = []
    for slot in slots:
        if slot.status not in PLANNABLE:
            raise PlanError(f"slot {slot.slot_id} is {slot.status.value}, not available for a new allocation",
                            code="slot_not_available", evidence={"slot_id": slot.slot_id, "status": slot.status.value})
        gpu = gpus.get(slot.gpu_pci_address)
        if gpu is None:
            raise _not_on_this_node(slot, "gpu_pci_address", f"no GPU at {slot.gpu_pci_address} on this host",
                         host_gpus=sorted(gpus))
        vf = vfs.get(slot.fabric_vf_pci_address)
        if vf is None:
            raise _not_on_this_node(slot, "fabric_vf_pci_address",
                         f"{slot.fabric_vf_pci_address} is not a fabric VF on this host (a PF is never shared)",
                         host_vfs=sorted(vfs))
        disk = disks.get(slot.nvme_device)
        if disk is None:
            raise _not_on_this_node(slot, "nvme_device", f"{slot.nvme_device} does not resolve to an NVMe namespace here")
        check_slot_binding(slot, report)  # slot_mismatch: exists, but is not this slot's (any field)
        if not disk.slice_eligible:
            raise PlanError(
                f"slot {slot.slot_id}: {slot.nvme_device} is not a raw, unused disk",
                code="nvme_unsafe",
                evidence={"slot_id": slot.slot_id, "kernel_name": disk.kernel_name,
                          "reasons": [r.model_dump() for r in disk.ineligible_reasons]},
            )
        # A disk with no identity never gets here: check_slot_binding holds the slot's disk by identity (slot_mismatch).
        planned.append(PlannedSlot.model_validate(dict(
            slot_id=slot.slot_id, slot_index=slot.slot_index,
            gpu_pci_address=gpu.pci_address, gpu_numa_node=gpu.numa_node, gpu_local_cpulist=gpu.local_cpulist,
            fabric_vf_pci_address=vf.pci_address, fabric_pf_pci_address=vf.physfn,
            nvme_device=slot.nvme_device, nvme_kernel_name=disk.kernel_name, disk_identity=disk.disk_identity,
            nvme_size_bytes=disk.size_bytes,
            mac=slot.mac, private_ip=slot.private_ip, ovs_bridge=slot.ovs_bridge,
            fabric_vf_identity=identities.get(slot.slot_index),
        )))
    partition = None
    if fabric is not None:
        partition = choose_partition(fabric, [p.gpu_pci_address for p in planned], held=held_partitions).partition_id
    elif len(planned) == 1:
        return BundlePlan(allocation_id=payload.allocation_id, slots=planned,
                          fabric_attachment=payload.fabric_attachment)
    verdict = enforce_placement(assess_placement(report, planned, placement, free_slots, fabric_partition=partition))
    return BundlePlan(allocation_id=payload.allocation_id, slots=planned, placement=verdict,
                      fabric_attachment=payload.fabric_attachment)


def lease_bundle(store: StateStore, plan: BundlePlan, task_id: str, *, now: float | None = None) -> list[SlotLease]:
    """Take every slot's lease in one transaction (raises ``lease_conflict``, taking none).

    A plan that names a Fabric Manager partition records it first (``partition_leased`` when another
    allocation holds it); a slot lease conflict then drops that record again, unless it was already ours.
    """
    taken_at = time.time() if now is None else now
    partition_id = plan.placement.fabric_partition_id if plan.placement is not None else None
    recorded = False
    if partition_id is not None:
        _drop_stale_partitions(store, plan.allocation_id)
    if partition_id is not None and store.partition_of(plan.allocation_id) is None:
        store.record_partition(PartitionLease(
            allocation_id=plan.allocation_id, partition_id=partition_id,
            gpu_pci_addresses=tuple(s.gpu_pci_address for s in plan.slots), state=PartitionState.leased,
            task_id=task_id, recorded_at=taken_at))
        recorded = True
    try:
        return _take_slot_leases(store, plan, task_id, taken_at)
    except AgentError:
        if recorded:
            store.release_partition(plan.allocation_id)
        raise


def _drop_stale_partitions(store: StateStore, allocation_id: str) -> None:
    """A partition recorded by a plan whose allocation no longer holds any slot (its provision failed early
    and gave the slots back) is nobody's: it must not keep the GPUs of a later plan from their partition."""
    for held in store.partition_leases():
        if held.allocation_id != allocation_id and held.state is PartitionState.leased \
                and not store.leases_of(held.allocation_id):
            store.release_partition(held.allocation_id)


def _take_slot_leases(store: StateStore, plan: BundlePlan, task_id: str, taken_at: float) -> list[SlotLease]:
    return store.take_leases([
        SlotLease(allocation_id=plan.allocation_id, slot_index=s.slot_index, gpu_pci_address=s.gpu_pci_address,
                  nvme_device=s.nvme_device, disk_identity=s.disk_identity,
                  fabric_vf_pci_address=s.fabric_vf_pci_address,
                  task_id=task_id, taken_at=taken_at)
        for s in plan.slots
    ])


def plan_handler(host_root: Path, plan_config: PlanConfig | None = None, fabric: FabricManager | None = None) -> Handler:
    """The worker's handler for ``slice.plan`` (discovery runs off the event loop).

    ``plan_config``: the host's slice subnet, gateway and bridge (``SliceConfig``), so the
    candidate slots' suggested MAC/IP are the ones the records were approved from.
    ``fabric``: the host's Fabric Manager (``[slice.fabric_manager]``), asked for a ``fabric_partitions``
    profile on an NVSwitch host; FM not answering refuses the plan before anything is leased.
    """

    async def handle(payload: PlanPayload, ctx: TaskContext) -> dict[str, Any]:
        await ctx.progress("validate", "started")
        state = as_store_thread(ctx.store)  # SQLite on the store thread, never on the loop (state/aio.py)
        await state.run(check_not_in_maintenance)  # host_in_maintenance: before anything else
        quarantined = await state.quarantined()  # their slots are not free for a better placement either
        report = await asyncio.to_thread(
            lambda: mark_quarantined(discover(HostRoot.open(host_root), plan_config), quarantined))
        profile = get_profile(payload.runtime_profile) if payload.runtime_profile else None
        placement = profile.placement if profile is not None else Placement.any
        partitions = await fabric_for(profile, report, fabric) if profile is not None else None
        free = await state.run(lambda store: free_slot_indexes(report, store, payload.allocation_id))
        held = await state.run(lambda store: [p.partition_id for p in [store.partition_of(payload.allocation_id)] if p])
        plan = plan_bundle(payload, report, placement=placement, free_slots=free, fabric=partitions,
                           held_partitions=held)
        await state.run(check_not_quarantined, plan)  # component_quarantined: a slot with a quarantined part
        await ctx.progress("validate", "succeeded")
        await state.run(lease_bundle, plan, ctx.envelope.task_id, write=True)
        await ctx.progress("lease", "succeeded", detail={"slots": [s.slot_index for s in plan.slots]})
        return plan.model_dump(mode="json")

    return handle
