"""Quarantine: a component whose handover or health failed stays out of service until a re-check passes.

:func:`quarantine_component` is what the release and handover call on a wipe that does not verify or
a GPU reset or memory clear that fails (and health on a failing SMART log or a fatal AER/XID): one
row per component, so one bad disk takes one slot away, not the host's other seven. Discovery
(``slice.topology_discover``) marks every candidate slot using a quarantined component with a
``component_quarantined`` blocker, and ``slice.plan`` / ``slice.vm_provision`` refuse such a slot
before anything is leased (:func:`check_not_quarantined`).

Only an explicit task returns a component: ``slice.unquarantine`` with the operator's reason, after
the check that failed passes again (``tasks/recheck.py``), and never while an allocation's lease
holds it (its release is still under way: ``component_in_use``). ``slice.quarantine`` lets an
operator take out a component that no allocation holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic_core import to_json

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.fleet import (
    MAX_EVIDENCE_CHARS,
    ComponentKind,
    ComponentRef,
    QuarantinePayload,
    QuarantineReason,
    QuarantineRecord,
    UnquarantinePayload,
)
from gpuaas_agent.contract.plan import BundlePlan
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.discovery.quarantine import mark_quarantined, slot_components
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.discovery.slots import PlanConfig
from gpuaas_agent.errors import AgentError
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.context import Handler, TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.provision_admission import slice_plan_config
from gpuaas_agent.tasks.recheck import RECHECKS, Recheck, RecheckContext

log = logging.getLogger(__name__)

RECHECK_TIMEOUT_S = 300.0


class QuarantineRefused(AgentError):
    default_code = "quarantine_refused"


def _bounded(evidence: dict[str, Any]) -> dict[str, Any]:
    """Evidence as JSON-safe data, at most MAX_EVIDENCE_CHARS of it (a huge proof is cut, and says so)."""
    text = to_json(evidence, fallback=str).decode()
    if len(text) <= MAX_EVIDENCE_CHARS:
        bounded: dict[str, Any] = json.loads(text)
        return bounded
    return {"truncated": True, "chars": len(text), "head": text[:MAX_EVIDENCE_CHARS - 200]}


async def quarantine_component(store: StateStore | StoreThread, kind: ComponentKind | str, identity: str,
                               reason: QuarantineReason | str, evidence: dict[str, Any], task_id: str, *,
                               slot_index: int | None = None) -> QuarantineRecord:
    """Take one component out of service with its reason and evidence; returns the record that holds.

    ``kind``: ``gpu`` / ``fabric_vf`` (identity: PCI address), ``nvme`` (identity: the lease's
    ``disk_identity``), ``slot`` (identity: the slot index in decimal). ``reason``: a
    :class:`QuarantineReason` (``wipe_unverified``, ``gpu_reset_failed``, ``gpu_memory_clear_failed``...).
    A component quarantined already keeps its first record. Raises ``ValueError`` (pydantic) on a kind,
    identity or reason that is not one, and ``StateError`` when the store cannot write: never silent.
    """
    record = QuarantineRecord(kind=ComponentKind(kind), identity=identity, reason=QuarantineReason(reason),
                              evidence=_bounded(evidence), quarantined_at=datetime.now(UTC), task_id=task_id,
                              slot_index=slot_index)
    held: QuarantineRecord
    new: bool
    held, new = await as_store_thread(store).quarantine(record)
    log_event(log, "component_quarantined" if new else "component_already_quarantined", logging.ERROR if new else
              logging.WARNING, kind=held.kind.value, identity=held.identity, reason=record.reason.value,
              first_reason=held.reason.value, task_id=task_id, slot_index=slot_index,
              message=f"{held.kind.value} {held.identity} quarantined ({record.reason.value}, task {task_id})"
                      + ("" if new else f"; already quarantined since {held.quarantined_at.isoformat()}"))
    return held


def holder_of(store: StateStore, ref: ComponentRef) -> SlotLease | None:
    """The lease that holds the component now, or None."""
    for lease in store.leases():
        if (ref.kind is ComponentKind.slot and ref.identity == str(lease.slot_index)) or \
                (ref.kind is ComponentKind.gpu and ref.identity == lease.gpu_pci_address) or \
                (ref.kind is ComponentKind.fabric_vf and ref.identity == lease.fabric_vf_pci_address) or \
                (ref.kind is ComponentKind.nvme and ref.identity == lease.disk_identity):
            return lease
    return None


def check_not_quarantined(store: StateStore, plan: BundlePlan) -> None:
    """``component_quarantined`` when any slot of the plan uses a quarantined component (before the lease)."""
    quarantined = {(r.kind, r.identity): r for r in store.quarantined()}
    if not quarantined:
        return
    for slot in plan.slots:
        wanted = [(ComponentKind.slot, str(slot.slot_index)), (ComponentKind.gpu, slot.gpu_pci_address),
                  (ComponentKind.fabric_vf, slot.fabric_vf_pci_address), (ComponentKind.nvme, slot.disk_identity),
                  (ComponentKind.nvme, f"path:{slot.nvme_device}")]  # named by a lease from before identities
        found = [quarantined[w] for w in wanted if w in quarantined]
        if found:
            first = found[0]
            raise QuarantineRefused(
                f"slot {slot.slot_index}: {first.kind.value} {first.identity} is quarantined ({first.reason.value}); "
                "slice.unquarantine re-runs the failed check before it is offered again",
                code="component_quarantined",
                evidence={"slot_index": slot.slot_index, "slot_id": slot.slot_id,
                          "quarantined": [r.model_dump(mode="json", exclude={"evidence"}) for r in found]})


def discover_with_quarantine(host_root: Path, plan_config: PlanConfig | None, store: StateStore) -> TopologyReport:
    """Discovery of the host with quarantined components marked (blocking: run it off the loop)."""
    return mark_quarantined(discover(HostRoot.open(host_root), plan_config), store.quarantined())


def _on_this_host(report: TopologyReport, ref: ComponentRef) -> bool:
    components = {c for slot in report.candidate_slots for c in slot_components(slot, report)}
    components |= {(ComponentKind.gpu, g.pci_address) for g in report.gpus}
    components |= {(ComponentKind.fabric_vf, f.pci_address) for f in report.fabric_devices if f.is_vf}
    components |= {(ComponentKind.nvme, d.disk_identity) for d in report.nvme_devices if d.disk_identity}
    return (ref.kind, ref.identity) in components


def _refuse_if_held(store: StateStore, ref: ComponentRef, what: str) -> None:
    holder = holder_of(store, ref)
    if holder is not None:
        raise QuarantineRefused(
            f"{ref.kind.value} {ref.identity} is held by allocation {holder.allocation_id} (slot {holder.slot_index}); "
            f"{what} only once its release is done",
            code="component_in_use",
            evidence={"component": ref.model_dump(mode="json"), "held_by": holder.allocation_id,
                      "slot_index": holder.slot_index})


def quarantine_handler(config: AgentConfig) -> Handler:
    """``slice.quarantine``: an operator takes out a component of this host that no allocation holds."""

    async def handle(payload: QuarantinePayload, ctx: TaskContext) -> dict[str, Any]:
        state = as_store_thread(ctx.store)
        ref = payload.component
        report = await asyncio.to_thread(lambda: discover(HostRoot.open(config.host_root),
                                                          slice_plan_config(config.slice)))
        if not _on_this_host(report, ref):
            raise QuarantineRefused(f"{ref.kind.value} {ref.identity} is not a component of this host",
                                    code="unknown_component", evidence={"component": ref.model_dump(mode="json")})
        await state.run(_refuse_if_held, ref, "quarantine it")
        record = await quarantine_component(
            state, ref.kind, ref.identity, QuarantineReason.operator,
            {"operator_reason": payload.reason, "requested_by": payload.requested_by}, ctx.envelope.task_id,
            slot_index=payload.slot_index)
        return {"quarantined": record.model_dump(mode="json")}

    return handle


def unquarantine_handler(config: AgentConfig, drivers: SliceDrivers | None = None,
                         rechecks: Mapping[QuarantineReason, Recheck] | None = None) -> Handler:
    """``slice.unquarantine``: re-run the failed check; return the component only when it passes."""
    table = RECHECKS if rechecks is None else rechecks

    async def handle(payload: UnquarantinePayload, ctx: TaskContext) -> dict[str, Any]:
        state = as_store_thread(ctx.store)
        ref = payload.component
        record = await state.quarantine_of(ref)
        if record is None:
            raise QuarantineRefused(f"{ref.kind.value} {ref.identity} is not quarantined on this host",
                                    code="not_quarantined",
                                    evidence={"component": ref.model_dump(mode="json"),
                                              "quarantined": [f"{r.kind.value}:{r.identity}"
                                                              for r in await state.quarantined()][:50]})
        await state.run(_refuse_if_held, ref, "return it")
        recheck = table.get(record.reason)
        if recheck is None:
            raise QuarantineRefused(
                f"no re-check for {record.reason.value} on this agent: {ref.kind.value} {ref.identity} stays "
                "quarantined (replace or repair it, then ask again once the check exists)",
                code="recheck_unavailable", evidence={"reason": record.reason.value,
                                                      "rechecks": sorted(r.value for r in table)})
        await ctx.progress("recheck", "started", detail={"reason": record.reason.value})
        try:
            verdict = await asyncio.wait_for(recheck(RecheckContext(host_root=config.host_root, drivers=drivers,
                                                                    store=ctx.store, extra={"bmc": config.bmc}),
                                                     record), RECHECK_TIMEOUT_S)
        except TimeoutError:
            raise QuarantineRefused(f"the {record.reason.value} re-check took over {RECHECK_TIMEOUT_S:.0f}s",
                                    code="recheck_failed", evidence={"reason": record.reason.value}) from None
        if not verdict.passed:
            log_event(log, "unquarantine_refused", logging.WARNING, kind=ref.kind.value, identity=ref.identity,
                      check=verdict.check, detail=verdict.detail)
            raise QuarantineRefused(
                f"{ref.kind.value} {ref.identity} stays quarantined: {verdict.check} still fails: {verdict.detail}",
                code="recheck_failed", evidence={"verdict": verdict.model_dump(mode="json"),
                                                 "quarantine": record.model_dump(mode="json", exclude={"evidence"})})
        await ctx.progress("recheck", "succeeded", detail={"check": verdict.check})
        released = await state.release_quarantine(ref, released_by=payload.requested_by, reason=payload.reason,
                                                  recheck=verdict, task_id=ctx.envelope.task_id)
        if released is None:  # another task returned it meanwhile
            raise QuarantineRefused(f"{ref.kind.value} {ref.identity} is not quarantined any more",
                                    code="not_quarantined", evidence={"component": ref.model_dump(mode="json")})
        log_event(log, "component_unquarantined", logging.WARNING, kind=ref.kind.value, identity=ref.identity,
                  reason=payload.reason, requested_by=payload.requested_by, check=verdict.check,
                  message=f"{ref.kind.value} {ref.identity} returned to service by {payload.requested_by} "
                          f"({payload.reason}); {verdict.check} passed: {verdict.detail}")
        return {"unquarantined": released.model_dump(mode="json"), "recheck": verdict.model_dump(mode="json")}

    return handle
