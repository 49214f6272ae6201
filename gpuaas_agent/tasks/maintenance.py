"""Maintenance and drain: a host in maintenance takes no new slice; what runs there goes on until released.

``slice.maintenance`` (from the control plane) and ``gpuaas-agent maintenance on|off`` (the person at
the host) write one ``agent_meta`` row, so the state survives agent restarts and host reboots. While
it is on, ``slice.plan`` and ``slice.vm_provision`` are refused ``host_in_maintenance`` at the very
start of their validation, before anything is leased; power operations, terminals, releases and
reconcile are not asked. The drain is done when the host holds no slot lease any more: the first
report that sees it (:func:`observe_drain`, every heartbeat tick) records ``drained_at`` once and
says so in the log, the heartbeat and the metrics.

A provision that passed its check before maintenance went on finishes (the tenant got what was
admitted); it is then one more slice the drain waits for, since the drain counts leases, not tasks.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.fleet import DrainReport, MaintenancePayload, MaintenanceState
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateError, StateStore
from gpuaas_agent.tasks.context import Handler, TaskContext

log = logging.getLogger(__name__)

MAINTENANCE_KEY = "maintenance"


class HostInMaintenance(AgentError):
    """New work refused: the host is in maintenance (nothing was leased or written)."""

    default_code = "host_in_maintenance"


def maintenance_state(store: StateStore) -> MaintenanceState:
    """The stored state; off when never set. A row that does not validate is ``maintenance_state_unreadable``
    (refusing new work is the safe reading of a state nobody can read)."""
    raw = store.meta(MAINTENANCE_KEY)
    if raw is None:
        return MaintenanceState(on=False)
    try:
        return MaintenanceState.model_validate_json(raw)
    except ValidationError as exc:
        raise StateError(f"the stored maintenance state cannot be read: {exc.error_count()} problem(s); "
                         "set it again with `gpuaas-agent maintenance on|off --reason ...`",
                         code="maintenance_state_unreadable", evidence={"key": MAINTENANCE_KEY, "raw": raw[:500]}
                         ) from None


def set_maintenance(store: StateStore, payload: MaintenancePayload, task_id: str,
                    now: datetime | None = None) -> tuple[MaintenanceState, bool]:
    """Turn maintenance on or off; (the state now, whether it changed). Blocking: the store thread or the CLI.

    Turning it on again keeps its first ``since`` (how long the host has been out is what an alert
    reads) and takes the new reason; off forgets the drain.
    """
    now = now or datetime.now(UTC)
    before = maintenance_state_or_off(store)
    if payload.mode == "on":
        state = MaintenanceState(on=True, reason=payload.reason, requested_by=payload.requested_by,
                                 since=before.since if before.on else now, task_id=task_id,
                                 drained_at=before.drained_at if before.on else None)
    else:
        state = MaintenanceState(on=False, reason=payload.reason, requested_by=payload.requested_by, since=now,
                                 task_id=task_id)
    store.set_meta(MAINTENANCE_KEY, state.model_dump_json())
    return state, before.on != state.on


def maintenance_state_or_off(store: StateStore) -> MaintenanceState:
    """The stored state, or off when the row is unreadable (only for overwriting it with a new one)."""
    try:
        return maintenance_state(store)
    except StateError:
        return MaintenanceState(on=False)


def check_not_in_maintenance(store: StateStore) -> None:
    """``host_in_maintenance`` while maintenance is on: called first by plan and provision validation."""
    state = maintenance_state(store)
    if state.on:
        raise HostInMaintenance(
            f"host is in maintenance since {state.since.isoformat() if state.since else '?'} "
            f"({state.reason}); no new slice is placed here until it is turned off",
            evidence={"maintenance": state.model_dump(mode="json")})


def drain_report(store: StateStore, state: MaintenanceState | None = None) -> DrainReport:
    """Maintenance and what still holds the host: leased slots and their allocations."""
    state = maintenance_state(store) if state is None else state
    leases = store.leases()
    return DrainReport(maintenance=state.on, reason=state.reason if state.on else "", since=state.since if state.on else None,
                       leased_slots=sorted(lease.slot_index for lease in leases),
                       allocations=len({lease.allocation_id for lease in leases}),
                       drained=state.on and not leases, drained_at=state.drained_at if state.on else None)


def drain_changed(report: DrainReport) -> bool:
    """Whether :func:`observe_drain` has a record to write: the drain just done, or undone by a new lease."""
    return report.maintenance and (report.drained != (report.drained_at is not None))


def observe_drain(store: StateStore, now: datetime | None = None) -> tuple[DrainReport, bool]:
    """The drain report; the first time maintenance is on with no lease left, ``drained_at`` is stored and
    (report, True) returned (the caller logs ``host_drained`` once). A lease taken again (a provision that
    passed its check before maintenance) clears it: the drain is then not done."""
    state = maintenance_state(store)
    report = drain_report(store, state)
    if not state.on:
        return report, False
    if report.leased_slots and state.drained_at is not None:
        store.set_meta(MAINTENANCE_KEY, state.model_copy(update={"drained_at": None}).model_dump_json())
        return report.model_copy(update={"drained_at": None}), False
    if not report.leased_slots and state.drained_at is None:
        at = now or datetime.now(UTC)
        store.set_meta(MAINTENANCE_KEY, state.model_copy(update={"drained_at": at}).model_dump_json())
        return report.model_copy(update={"drained_at": at}), True
    return report, False


def log_drained(report: DrainReport) -> None:
    log_event(log, "host_drained", logging.WARNING, reason=report.reason,
              since=report.since.isoformat() if report.since else None,
              message=f"maintenance drain done: no slice left on this host (maintenance: {report.reason})")


def maintenance_handler() -> Handler:
    """``slice.maintenance``: on or off, with the operator's reason; the result is the state and the drain."""

    async def handle(payload: MaintenancePayload, ctx: TaskContext) -> dict[str, Any]:
        state = as_store_thread(ctx.store)
        now, changed = await state.run(set_maintenance, payload, ctx.envelope.task_id, write=True)
        log_event(log, "maintenance_on" if now.on else "maintenance_off", logging.WARNING,
                  task_id=ctx.envelope.task_id, requested_by=payload.requested_by, changed=changed,
                  reason=payload.reason,
                  message=f"maintenance {payload.mode} by {payload.requested_by}: {payload.reason}")
        report, drained = await state.run(observe_drain, write=True)
        if drained:
            log_drained(report)
        return {"maintenance": now.model_dump(mode="json"), "changed": changed, "drain": report.model_dump(mode="json")}

    return handle
