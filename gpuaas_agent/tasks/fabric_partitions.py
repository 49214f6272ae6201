"""Fabric Manager partitions in placement and reconcile: which partition a slot set is, and what drifted.

Pure: FM's partition list (``host/devices/fabricmanager.py``), the agent's partition leases and the
running domains in; a choice, a typed refusal or drift findings out.

- A slot set of a ``fabric_partitions`` profile on an NVSwitch host is offered only when its
  GPUs are *exactly* one supported partition (FM activates whole partitions, never a subset),
  that partition is healthy (every GPU of a multi-GPU partition has all its NVLinks) and
  neither it nor a partition sharing one of its GPUs is active (FM refuses that: FM_ST_IN_USE).
  A 1-GPU slice takes the 1-GPU partition of its GPU: in the Shared NVSwitch model every GPU
  a guest uses is in an activated partition.
- Reconcile compares FM's active partitions with the leases and domains; after an FM restart
  the leases say which partitions to set active again (:func:`partitions_to_restore`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
from gpuaas_agent.contract.fabric import (
    FabricPartition,
    FabricPartitionList,
    PartitionDrift,
    PartitionDriftKind,
    PartitionLease,
    PartitionState,
)
from gpuaas_agent.contract.plan import BundlePlan
from gpuaas_agent.contract.runtime import RuntimeProfile
from gpuaas_agent.contract.slots import SlotStatus
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.devices.fabricmanager import FabricManager, FabricManagerError

log = logging.getLogger(__name__)


class PartitionRefused(AgentError):
    """The slot set is not a partition Fabric Manager can give it now; nothing was leased."""

    default_code = "fabric_partition_unsupported"


def _sets(listed: FabricPartitionList) -> list[dict[str, Any]]:
    return [{"partition_id": p.partition_id, "gpus": sorted(p.gpu_addresses), "active": p.active}
            for p in listed.partitions]


def choose_partition(listed: FabricPartitionList, gpu_addresses: Sequence[str], *,
                     held: Iterable[int] = ()) -> FabricPartition:
    """The supported, healthy, free partition whose GPUs are exactly ``gpu_addresses``.

    ``held``: partitions this very allocation already holds (a redelivered plan): active is fine there.
    """
    wanted = frozenset(gpu_addresses)
    held = set(held)
    match = next((p for p in listed.partitions if p.gpu_addresses == wanted), None)
    if match is None:
        # What this host can offer instead: free, healthy partitions of the same size.
        offer = [p.partition_id for p in listed.partitions if len(p.gpus) == len(wanted) and not p.degraded_gpus
                 and not any(q.active and q.gpu_addresses & p.gpu_addresses for q in listed.partitions)]
        raise PartitionRefused(
            f"GPUs {sorted(wanted)} are not one supported Fabric Manager partition; a set must be exactly one "
            f"(free partitions of {len(wanted)} GPUs: {offer or 'none'}; evidence lists every supported set)",
            evidence={"field": "slots", "gpus": sorted(wanted), "offer": offer, "supported": _sets(listed)})
    if match.degraded_gpus:
        raise PartitionRefused(
            f"Fabric Manager partition {match.partition_id} is not healthy: {', '.join(match.degraded_gpus)}",
            code="fabric_partition_unhealthy",
            evidence={"partition_id": match.partition_id, "degraded_gpus": match.degraded_gpus})
    busy = [p.partition_id for p in listed.partitions
            if p.active and p.partition_id not in held and p.gpu_addresses & wanted]
    if busy:
        raise PartitionRefused(
            f"Fabric Manager partition {match.partition_id} shares GPUs with active partition(s) {busy}",
            code="fabric_partition_in_use",
            evidence={"partition_id": match.partition_id, "active_overlapping": busy})
    return match


def partition_drift(listed: FabricPartitionList, leases: Sequence[PartitionLease],
                    running_allocations: Iterable[str]) -> list[PartitionDrift]:
    """Active partitions nobody holds or no domain uses, and running domains whose partition FM lost."""
    running = set(running_allocations)
    by_partition = {lease.partition_id: lease for lease in leases}
    found = []
    for p in listed.partitions:
        if not p.active:
            continue
        lease = by_partition.get(p.partition_id)
        if lease is None:
            found.append(PartitionDrift(kind=PartitionDriftKind.active_without_lease, partition_id=p.partition_id,
                                        detail=f"partition {p.partition_id} ({sorted(p.gpu_addresses)}) is active "
                                               "and no lease of this agent holds it"))
        elif lease.allocation_id not in running:
            found.append(PartitionDrift(kind=PartitionDriftKind.active_without_domain, partition_id=p.partition_id,
                                        allocation_id=lease.allocation_id,
                                        detail=f"partition {p.partition_id} is active and allocation "
                                               f"{lease.allocation_id} has no running domain"))
    for lease in leases:
        partition = listed.by_id(lease.partition_id)
        if lease.allocation_id in running and (partition is None or not partition.active):
            found.append(PartitionDrift(kind=PartitionDriftKind.domain_without_partition,
                                        partition_id=lease.partition_id, allocation_id=lease.allocation_id,
                                        detail=f"allocation {lease.allocation_id} runs and Fabric Manager lists "
                                               f"its partition {lease.partition_id} "
                                               f"{'absent' if partition is None else 'inactive'} (an FM restart?)"))
    return sorted(found, key=lambda d: (d.kind.value, d.partition_id))


def partitions_to_restore(listed: FabricPartitionList, leases: Sequence[PartitionLease]) -> list[int]:
    """After an FM restart: every partition the leases hold that FM no longer lists active (none: nothing to do)."""
    lost = []
    for lease in leases:
        partition = listed.by_id(lease.partition_id)
        if partition is not None and not partition.active:
            lost.append(lease.partition_id)
    return sorted(set(lost))


async def fabric_for(profile: RuntimeProfile, report: TopologyReport,
                     fabric: FabricManager | None) -> FabricPartitionList | None:
    """FM's partitions when this profile on this host needs one (None: it does not); FM not answering is
    ``fabric_manager_missing`` (guards/preconditions.py), raised before anything is leased."""
    if not profile.fabric_partitions or not report.nvswitches:
        return None
    problem = "no [slice.fabric_manager] in the agent's configuration"
    if fabric is not None:
        try:
            return await fabric.partitions()
        except FabricManagerError as exc:
            problem = f"{exc.code}: {exc.message}"
    # The provision guards (and the GPU reset checks they import): a plan's refusal, never the reconcile's path
    # through this module that every idle round takes (docs/performance.md, idle footprint).
    from gpuaas_agent.guards.preconditions import check_fabric_manager

    check_fabric_manager(profile, [s.pci_address for s in report.nvswitches], problem)
    return None  # unreachable: check_fabric_manager raised


# -- provision, release and reconcile actions (a store on its thread, the host's Fabric Manager) -----------


async def record_planned(store: Any, plan: BundlePlan, task_id: str, held: PartitionLease | None) -> bool:
    """Record the partition a plan names for its allocation unless it already holds it; True when recorded."""
    partition_id = plan.placement.fabric_partition_id if plan.placement is not None else None
    if partition_id is None or held is not None:
        return False
    await store.record_partition(PartitionLease(
        allocation_id=plan.allocation_id, partition_id=partition_id,
        gpu_pci_addresses=tuple(s.gpu_pci_address for s in plan.slots), state=PartitionState.leased,
        task_id=task_id, recorded_at=time.time()))
    return True


def _need(fabric: FabricManager | None, what: str) -> FabricManager:
    if fabric is None:
        raise FabricManagerError(f"allocation holds a fabric partition and no [slice.fabric_manager] is configured "
                                 f"to {what} it", code="fm_unavailable", evidence={"configured": False})
    return fabric


async def activate_leased(fabric: FabricManager | None, store: Any, allocation_id: str) -> dict[str, Any]:
    """Provision, before ``start``: activate the partition ``slice.plan`` leased to this allocation.

    Nothing leased (no NVSwitch, or a profile without ``fabric_partitions``): nothing to do. The partition
    must still be the GPUs that were planned (an FM configuration change in between is refused), and FM
    must list it active afterwards (``FabricManager.activate`` reads it back).
    """
    lease = await store.partition_of(allocation_id)
    if lease is None:
        return {"partition_id": None}
    fm = _need(fabric, "activate")
    listed = await fm.partitions()
    partition = listed.by_id(lease.partition_id)
    if partition is None or partition.gpu_addresses != frozenset(lease.gpu_pci_addresses):
        raise PartitionRefused(
            f"Fabric Manager partition {lease.partition_id} is no longer the GPUs planned for this allocation",
            code="fabric_partition_changed",
            evidence={"partition_id": lease.partition_id, "planned": list(lease.gpu_pci_addresses),
                      "listed": sorted(partition.gpu_addresses) if partition else None})
    was_active = partition.active
    if not was_active:
        await fm.activate(lease.partition_id)
    await store.record_partition(PartitionLease(**{**lease.model_dump(), "state": PartitionState.active}))
    return {"partition_id": lease.partition_id, "gpus": list(lease.gpu_pci_addresses), "was_active": was_active}


async def deactivate_leased(fabric: FabricManager | None, store: Any, allocation_id: str, *,
                            release: bool) -> dict[str, Any]:
    """Deactivate this allocation's partition when FM lists it active; ``release``: drop the record too.

    Provision's compensation keeps the record (``leased``: the slot leases still name the set); release
    runs it after the domain is gone and drops it. Idempotent: a partition already inactive is left as is.
    """
    lease = await store.partition_of(allocation_id)
    if lease is None:
        return {"partition_id": None}
    fm = _need(fabric, "deactivate")
    partition = (await fm.partitions()).by_id(lease.partition_id)
    deactivated = partition is not None and partition.active
    if deactivated:
        await fm.deactivate(lease.partition_id)
    if release:
        await store.release_partition(allocation_id)
    else:
        await store.record_partition(PartitionLease(**{**lease.model_dump(), "state": PartitionState.leased}))
    return {"partition_id": lease.partition_id, "deactivated": deactivated, "released": release}


async def confirm_active(fabric: FabricManager | None, store: Any, allocation_id: str) -> dict[str, Any]:
    """Provision, right after ``start``: the partition is still active. Fabric Manager restarting between
    activation and start leaves the guest without NVLink; then every partition the leases hold is set
    active again (:func:`restore_after_restart`), and a restore FM does not confirm fails the provision."""
    lease = await store.partition_of(allocation_id)
    if lease is None:
        return {"partition_id": None}
    fm = _need(fabric, "check")
    listed = await fm.partitions()
    partition = listed.by_id(lease.partition_id)
    if partition is not None and partition.active:
        return {"partition_id": lease.partition_id, "active": True}
    restored = await restore_after_restart(fm, store, listed)
    return {"partition_id": lease.partition_id, "active": True, "restored": restored}


async def restore_after_restart(fabric: FabricManager, store: Any,
                                listed: FabricPartitionList | None = None, *,
                                settled: set[str] | None = None) -> list[int]:
    """After an FM restart: set active again every partition an ``active`` lease holds that FM lost.

    Only partitions provision activated (state ``active``) are restored, never a merely planned one.
    Returns the partitions restored (empty: nothing was lost). ``fm_restore_unverified`` when FM does
    not list them active afterwards.

    ``settled``: the allocations no task is changing (every slot ``active``), for a caller that holds no
    slot lock (the health loop). Only their lost partitions count, and the list set again is theirs plus
    what FM lists active now: a partition a release has just deactivated (its lease not yet dropped) is
    never switched back on, and one a provision has just activated stays on.
    """
    leases = [p for p in await store.partition_leases() if p.state is PartitionState.active]
    listed = listed or await fabric.partitions()
    if settled is None:
        lost = partitions_to_restore(listed, leases)
        keep = sorted({p.partition_id for p in leases})
    else:
        lost = partitions_to_restore(listed, [p for p in leases if p.allocation_id in settled])
        keep = sorted({p.partition_id for p in leases
                       if p.allocation_id in settled or ((q := listed.by_id(p.partition_id)) and q.active)})
    if not lost:
        return []
    await fabric.set_activated(keep)
    return lost


def settled_allocations(records: Iterable[Any]) -> set[str]:
    """Allocations whose every slot record is ``active`` (slot records: ``store.slot_states()``)."""
    by_allocation: dict[str, bool] = {}
    for record in records:
        by_allocation[record.allocation_id] = (by_allocation.get(record.allocation_id, True)
                                               and record.status is SlotStatus.active)
    return {allocation for allocation, settled in by_allocation.items() if settled}


_DRIFT_KINDS = {
    PartitionDriftKind.active_without_domain: (DriftKind.fabric_partition_without_domain, DriftSeverity.warn),
    PartitionDriftKind.active_without_lease: (DriftKind.fabric_partition_without_lease, DriftSeverity.warn),
    PartitionDriftKind.domain_without_partition: (DriftKind.fabric_partition_lost, DriftSeverity.error),
}


async def reconcile_findings(fabric: FabricManager | None, store: Any, running: set[str], *,
                             repair: bool) -> list[DriftFinding]:
    """Reconcile's partition findings. The one repair: a running slice whose partition FM lost (an FM
    restart) gets the leased list set active again; an active partition without domain or lease is only
    reported (deactivating it is a release's decision, never reconcile's)."""
    leases = await store.partition_leases()
    if fabric is None:
        if not leases:
            return []
        return [DriftFinding(kind=DriftKind.fabric_manager_unavailable, subject="fabric_manager",
                             severity=DriftSeverity.error, expected="[slice.fabric_manager] configured",
                             actual="not configured", detail={"leased_partitions": [p.partition_id for p in leases]})]
    try:
        listed = await fabric.partitions()
    except FabricManagerError as exc:
        return [DriftFinding(kind=DriftKind.fabric_manager_unavailable, subject="fabric_manager",
                             severity=DriftSeverity.error if leases else DriftSeverity.warn,
                             expected="fmpm -l answers", actual=exc.code,
                             detail={"message": exc.message, "leased_partitions": [p.partition_id for p in leases]})]
    drift = partition_drift(listed, leases, running)
    restored: list[int] = []
    if repair and any(d.kind is PartitionDriftKind.domain_without_partition for d in drift):
        try:
            restored = await restore_after_restart(fabric, store, listed)
        except FabricManagerError as exc:
            log.warning("fabric partition restore failed: %s", exc.message)
    findings = []
    for d in drift:
        kind, severity = _DRIFT_KINDS[d.kind]
        findings.append(DriftFinding(
            kind=kind, subject=f"partition {d.partition_id}", severity=severity,
            expected="active and held by a running slice", actual=d.detail,
            repaired=d.partition_id in restored,
            detail={"partition_id": d.partition_id, "allocation_id": d.allocation_id}))
    return findings
