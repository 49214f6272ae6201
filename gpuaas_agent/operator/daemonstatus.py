"""``<state_dir>/daemon-status.json``: the running daemon's own account of itself, for ``gpuaas-agent status``.

The status command must answer without NATS and without asking the daemon anything
(a wedged daemon is exactly when it is needed), so the daemon writes this small file
atomically on every heartbeat tick, connected or not: NATS state, the last heartbeat
the server accepted, the tasks in flight with their current step, the health checks.
Its age is itself evidence: a file older than a few heartbeat intervals means the
daemon is not running or its loop is stuck.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from pydantic import Field, ValidationError

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.contract.base import SCHEMA_VERSION, WireModel
from gpuaas_agent.contract.fleet import DrainReport, QuarantinedComponent
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.errors import AgentError

STATUS_FILE = "daemon-status.json"


class InFlightTask(WireModel):
    task_id: str
    type: str | None = None
    step: str | None = None  # the last journaled step; None before the first
    started_at: datetime | None = None
    step_started_at: datetime | None = None


class AdmissionView(WireModel):
    """The worker's places (control/admission.py): in flight and capacity per class, tenants holding
    interactive places, and how many pulled tasks were turned away, by the bound they met."""

    in_flight: dict[str, int]
    capacity: dict[str, int]
    tenants: int
    handed_back: dict[str, int] = Field(default_factory=dict)


class RegisteredView(WireModel):
    """What the daemon holds registered now, counted from its own objects. After any load an idle node is
    back to its baseline: no task, terminal session or power turn left, and the NATS subscriptions it had
    before (the task pull, the rotation inbox; one more per live terminal session). A count that stays
    above it is a leak (docs/fairness.md)."""

    tasks: int  # handler tasks in flight in the worker
    terminal_sessions: int  # registered terminal sessions
    terminal_opening: int  # terminal sessions still connecting (not yet registered)
    power_tasks: int  # power tasks in the slots' power lines, running and waiting
    subscriptions: int  # live subscriptions of the daemon's NATS connection
    rss_bytes: int | None = None  # the daemon's resident memory (/proc/self/statm)


class DaemonStatus(WireModel):
    schema_version: str = SCHEMA_VERSION
    node_id: str
    agent_version: str
    pid: int
    started_at: datetime
    written_at: datetime
    heartbeat_interval_s: float
    nats_state: str = Field(description="waiting | connected | reconnecting | stopping")
    nats_connect_attempts: int = 0
    nats_reconnects: int = 0
    last_heartbeat_at: datetime | None = None  # the last heartbeat the server took (flush answered)
    health_state: str
    health_reason: str | None = None
    health: list[HealthCheck] = Field(default_factory=list)
    in_flight: list[InFlightTask] = Field(default_factory=list)
    admission: AdmissionView | None = None
    registered: RegisteredView | None = None
    maintenance: DrainReport | None = None
    quarantined: list[QuarantinedComponent] = Field(default_factory=list)


def own_rss_bytes() -> int | None:
    """This process's resident set size, or None where /proc cannot say."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def status_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STATUS_FILE


def write_status(state_dir: str | Path, status: DaemonStatus) -> None:
    """Atomically replace the status file (0600: it names allocations).

    Not fsynced: it is rewritten every heartbeat and only says what the daemon is doing now; a
    power loss that empties it reads as ``daemon_status_invalid`` until the next heartbeat.
    """
    write_atomic(status_path(state_dir), status.model_dump_json(indent=1).encode(), mode=0o600, durable=False)


def read_status(state_dir: str | Path) -> DaemonStatus | None:
    """The last status the daemon wrote; None when there is none; ``daemon_status_invalid`` when unreadable junk."""
    path = status_path(state_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AgentError(f"cannot read {path}: {exc.strerror}", code="daemon_status_unreadable",
                         evidence={"path": str(path)}) from None
    try:
        return DaemonStatus.model_validate_json(raw)
    except ValidationError as exc:
        raise AgentError(f"{path} is not a daemon status file", code="daemon_status_invalid",
                         evidence={"path": str(path), "errors": exc.errors(include_url=False, include_input=False)}
                         ) from None
