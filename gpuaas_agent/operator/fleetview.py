"""The host's maintenance, drain and quarantined components, as the heartbeat, status file and metrics show them.

Read from the store, read-only, on each heartbeat tick (the reporter records the drain beside it, once,
on the writer thread: ``tasks/maintenance.observe_drain``) and at scrape time.
"""

from __future__ import annotations

import logging

from gpuaas_agent.contract.fleet import DrainReport, QuarantinedComponent
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.maintenance import drain_report

log = logging.getLogger(__name__)


def fleet_view(store: StateStore) -> tuple[DrainReport | None, list[QuarantinedComponent]]:
    """(drain report or None when the maintenance state cannot be read, quarantined components). Blocking."""
    try:
        drain: DrainReport | None = drain_report(store)
    except AgentError as exc:
        log_event(log, "maintenance_state_unreadable", logging.WARNING, code=exc.code, message=exc.message)
        drain = None
    return drain, [QuarantinedComponent.of(r) for r in store.quarantined()]
