"""What the daemon says about itself every tick: heartbeat, status file, metrics textfile, systemd STATUS=.

One :class:`Reporter` per daemon, started as soon as the state store is open, so
``gpuaas-agent status`` and ``systemctl status`` tell the truth while NATS is
still down. It learns the NATS client and the worker when they exist
(:meth:`attach`) and publishes heartbeats only then. Health checks run on their
own timer (:meth:`health_loop`); every heartbeat carries their latest verdict.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import nats.errors
from nats.aio.client import Client

from gpuaas_agent import __version__
from gpuaas_agent.compat import UTC
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.bmc import BmcReading
from gpuaas_agent.contract.fleet import DrainReport, QuarantinedComponent
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import HealthCheck, Heartbeat, HostHealth
from gpuaas_agent.control.taskpolicy import STOPPED_STEP, TASK_STEP
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event
from gpuaas_agent.operator import bmc
from gpuaas_agent.operator.daemonstatus import (
    AdmissionView,
    DaemonStatus,
    InFlightTask,
    RegisteredView,
    own_rss_bytes,
    write_status,
)
from gpuaas_agent.operator.fleetview import fleet_view
from gpuaas_agent.operator.health import (
    CHECK_TIMEOUT_S,
    CheckThreads,
    HealthSettings,
    RoundReadings,
    run_checks,
    summarise,
)
from gpuaas_agent.operator.health_quarantine import quarantine_failing_devices
from gpuaas_agent.operator.metrics import AgentMetrics
from gpuaas_agent.state.aio import BlockingStore, StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.maintenance import drain_changed, log_drained, observe_drain

log = logging.getLogger(__name__)


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def in_flight(store: StateStore | BlockingStore, task_ids: list[str]) -> list[InFlightTask]:
    """Each running task's type, start, and the step it is in now, from the journal."""
    out = []
    for task_id in task_ids:
        entries = store.journal_of(task_id)
        starts = [e for e in entries if e.step == TASK_STEP and e.status == StepStatus.started]
        steps = [e for e in entries if e.step not in (TASK_STEP, STOPPED_STEP)]
        last = steps[-1] if steps else None
        out.append(InFlightTask(
            task_id=task_id,
            type=starts[-1].detail.get("type") if starts else None,
            started_at=_utc(starts[-1].at) if starts else None,
            step=None if last is None else (last.step if last.status == StepStatus.started
                                            else f"{last.step} ({last.status.value})"),
            step_started_at=_utc(last.at) if last is not None else None,
        ))
    return out


@dataclass
class ReporterSettings:
    node_id: str
    state_dir: Path
    heartbeat_interval_s: float
    health_interval_s: float
    request_timeout_s: float
    metrics_textfile: Path | None = None


class Reporter:
    def __init__(self, settings: ReporterSettings, store: StateStore | StoreThread, health: HealthSettings,
                 metrics: AgentMetrics | None, notify: Callable[..., bool], *, threads: CheckThreads) -> None:
        self.settings = settings
        # The daemon's check threads (operator/health.py): the blocking checks of every round run in them.
        self.threads = threads
        # Reads go through the daemon's store thread (state/aio.py): the heartbeat never waits on SQLite.
        self.state = as_store_thread(store)
        self.store = self.state.sync
        self.health_settings = health
        self.metrics = metrics
        self._notify = notify
        self.started_at = datetime.now(UTC)
        self.nc: Client | None = None
        self.worker: TaskWorker | None = None
        self.connect_attempts = 0
        self.stopping = False
        self.checks: list[HealthCheck] | None = None
        # The last BMC reading a health round finished (gpu_bmc's), for each slice's telemetry: its GPU's sensors.
        self.bmc_reading: BmcReading | None = None
        self.last_heartbeat_at: datetime | None = None
        self._last_status_line: str | None = None
        self.checked = asyncio.Event()  # set after the first round of health checks
        # Maintenance/drain and quarantined components as of the last tick (operator/fleetview.py).
        self.drain: DrainReport | None = None
        self.quarantined: list[QuarantinedComponent] = []
        self._drain_write: asyncio.Task[None] | None = None
        # The slice drivers' registered counts (terminal sessions, power turns): the daemon sets it when it
        # serves slices (tasks/drivers.py SliceDrivers.registered).
        self.slice_counts: Callable[[], dict[str, int]] | None = None
        # Checks that need the slice drivers (the daemon adds them when it serves slices).
        self.extra_checks: list[Callable[[], Awaitable[list[HealthCheck]]]] = []

    # -- what the daemon tells us ---------------------------------------------------------

    def attach(self, nc: Client, worker: TaskWorker) -> None:
        self.nc, self.worker = nc, worker

    def connect_attempt(self, attempt: int) -> None:
        """Called before each NATS connect attempt: systemd shows which one we are waiting on."""
        self.connect_attempts = attempt
        self.status_line(f"node {self.settings.node_id}: waiting for NATS (attempt {attempt})")

    def status_line(self, line: str) -> None:
        """``STATUS=`` for ``systemctl status``, sent only when it changes."""
        if line != self._last_status_line:
            self._last_status_line = line
            self._notify(STATUS=line)

    # -- state ------------------------------------------------------------------------------

    @property
    def nats_state(self) -> str:
        if self.stopping:
            return "stopping"
        if self.nc is None:
            return "waiting"
        return "connected" if self.nc.is_connected else "reconnecting"

    @property
    def reconnects(self) -> int:
        return int(self.nc.stats.get("reconnects", 0)) if self.nc is not None else 0

    def health(self) -> tuple[HostHealth, str | None]:
        """The host's health_state and why: the worst check, NATS trouble, or unknown before the first round."""
        state: HostHealth
        reason: str | None
        if self.checks is None:
            state, reason = "unknown", "health checks have not run yet"
        else:
            state, reason = summarise(self.checks)
        if self.nats_state == "reconnecting":
            reason = "nats: connection lost, reconnecting" + (f"; {reason}" if reason and state != "healthy" else "")
            state = "failed" if state == "failed" else "degraded"
        elif state == "healthy" and self.worker is not None and not self.worker.ready.is_set():
            state, reason = "unknown", "task consumer not bound yet"
        return state, reason

    def daemon_status(self, flights: list[InFlightTask] | None = None) -> DaemonStatus:
        """``flights``: the in-flight view read off the loop (:meth:`tick`); else read here, blocking."""
        state, reason = self.health()
        running = self.worker.running_task_ids if self.worker is not None else []
        if flights is None:
            flights = in_flight(self.store, running)
        return DaemonStatus(
            node_id=self.settings.node_id, agent_version=__version__, pid=os.getpid(), started_at=self.started_at,
            written_at=datetime.now(UTC), heartbeat_interval_s=self.settings.heartbeat_interval_s,
            nats_state=self.nats_state, nats_connect_attempts=self.connect_attempts, nats_reconnects=self.reconnects,
            last_heartbeat_at=self.last_heartbeat_at, health_state=state, health_reason=reason,
            health=self.checks or [], in_flight=flights, maintenance=self.drain, quarantined=self.quarantined,
            admission=AdmissionView.model_validate(self.worker.admission.snapshot()) if self.worker is not None
            else None, registered=self.registered(running))

    def registered(self, running: list[str]) -> RegisteredView:
        """What the daemon holds now (tasks, sessions, power turns, subscriptions) and its RSS."""
        counts = self.slice_counts() if self.slice_counts is not None else {}
        # nats-py keeps no public count: its sid -> subscription map is the connection's registry.
        subs = len(self.nc._subs) if self.nc is not None else 0
        return RegisteredView(tasks=len(running), terminal_sessions=counts.get("terminal_sessions", 0),
                              terminal_opening=counts.get("terminal_opening", 0),
                              power_tasks=counts.get("power_tasks", 0), subscriptions=subs, rss_bytes=own_rss_bytes())

    # -- loops --------------------------------------------------------------------------------

    async def check_health(self) -> None:
        leases, records = await self.state.leases(), await self.state.slot_states()
        readings = RoundReadings()
        checks = await run_checks(self.health_settings, leases, records, readings, threads=self.threads)
        if readings.bmc is not None:
            self.bmc_reading = readings.bmc
        for extra in self.extra_checks:
            try:
                checks += await asyncio.wait_for(extra(), CHECK_TIMEOUT_S)
            except Exception as exc:
                checks.append(HealthCheck(name=getattr(extra, "__name__", "extra"), status="unavailable",
                                          detail=f"check raised {type(exc).__name__}: {exc}"[:4000],
                                          checked_at=datetime.now(UTC)))
        self.checks = sorted(checks, key=lambda c: c.name)
        if self.metrics is not None:  # before any await: a heartbeat that carries these checks finds them scraped
            self.metrics.health(self.health()[0], self.checks)
        self.checked.set()
        try:  # a failing part is taken out of service by itself (one bad disk does not take the host's other slots)
            status = {c.name: c.status for c in self.checks}
            # The round's own readings, judged again per component: nothing is read a second time.
            await quarantine_failing_devices(
                self.health_settings.host_root, self.state, aer=readings.aer,
                bmc_reading=readings.bmc if status.get(bmc.CHECK_NAME) == "failed" else None,
                nvml_reading=readings.nvml if status.get("gpu_nvml") == "failed" else None,
                read_smart=status.get("nvme_smart") in ("failed", "degraded"))
        except Exception:
            log_event(log, "health_quarantine_failed", logging.ERROR, exc_info=True)
        state, reason = summarise(self.checks)
        log_event(log, "health_checked", logging.INFO if state == "healthy" else logging.WARNING,
                  status=state, message=reason or "every check ok or unavailable",
                  checks={c.name: c.status for c in self.checks})

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:
                log_event(log, "health_check_failed", logging.ERROR, exc_info=True)
            await asyncio.sleep(self.settings.health_interval_s)  # the period of the checks

    async def tick(self) -> None:
        """One heartbeat (when connected), the status file, the textfile, STATUS= on a change."""
        state, reason = self.health()
        await self.observe_fleet()
        if self.metrics is not None and self.checks is not None:  # the scrape is never behind the heartbeat
            self.metrics.health(state, self.checks)
        if self.nc is not None and self.nc.is_connected:
            await self._publish(state, reason)
        if self.nc is not None and self.worker is not None:
            if self.nc.is_connected and self.worker.ready.is_set():
                self.status_line(f"node {self.settings.node_id}: pulling tasks; health {state}{self._fleet_note()}")
            elif not self.nc.is_connected:
                self.status_line(f"node {self.settings.node_id}: NATS connection lost, reconnecting")
        try:
            running = self.worker.running_task_ids if self.worker is not None else []
            flights = await self.state.run(in_flight, running)
            write_status(self.settings.state_dir, self.daemon_status(flights))
        except OSError as exc:
            log_event(log, "status_file_failed", logging.WARNING, error=exc.strerror or str(exc))
        if self.metrics is not None and self.settings.metrics_textfile is not None:
            try:
                # off the loop: rendering reads the slot records (SQLite, through the store thread)
                await asyncio.to_thread(self.metrics.write_textfile, self.settings.metrics_textfile)
            except OSError as exc:
                log_event(log, "metrics_textfile_failed", logging.WARNING, path=str(self.settings.metrics_textfile),
                          error=exc.strerror or str(exc))

    async def observe_fleet(self) -> None:
        """Maintenance, drain and quarantine, read off the reader (a held write lock never delays the heartbeat).

        When the drain's record must change (done: ``drained_at`` once, logged once; undone by a new lease),
        the write runs beside the tick on the writer thread, one at a time.
        """
        try:
            self.drain, self.quarantined = await self.state.run(fleet_view)
        except Exception as exc:  # the heartbeat and status file go out with the last view, and the log says why
            log_event(log, "fleet_view_failed", logging.WARNING, error=repr(exc))
            return
        if self.drain is None or not drain_changed(self.drain):
            return
        if self._drain_write is None or self._drain_write.done():
            self._drain_write = asyncio.create_task(self._record_drain())

    async def _record_drain(self) -> None:
        try:
            drain, newly_drained = await self.state.run(observe_drain, write=True)
        except AgentError as exc:
            log_event(log, "drain_record_failed", logging.WARNING, code=exc.code, message=exc.message)
            return
        self.drain = drain
        if newly_drained:
            log_drained(drain)

    def _fleet_note(self) -> str:
        note = ""
        if self.drain is not None and self.drain.maintenance:
            note += ("; maintenance, drained" if self.drain.drained
                     else f"; maintenance, draining {len(self.drain.leased_slots)} slot(s)")
        if self.quarantined:
            note += f"; {len(self.quarantined)} quarantined"
        return note

    async def _publish(self, state: HostHealth, reason: str | None) -> None:
        assert self.nc is not None  # tick publishes only while connected
        leased = [lease.slot_index for lease in await self.state.leases()]
        beat = Heartbeat(
            node_id=self.settings.node_id, agent_version=__version__, health_state=state, health_reason=reason,
            health=self.checks or [],
            running_tasks=self.worker.running_task_ids if self.worker is not None else [],
            leased_slots=leased, maintenance=self.drain, quarantined=self.quarantined,
            at=datetime.now(UTC))
        try:
            await self.nc.publish(subjects.heartbeat(self.settings.node_id), beat.model_dump_json().encode())
            await self.nc.flush(timeout=self.settings.request_timeout_s)  # type: ignore[arg-type]  # nats.py says int; seconds
        except (nats.errors.Error, TimeoutError) as exc:
            log_event(log, "heartbeat_failed", logging.WARNING, error=repr(exc))
            return
        self.last_heartbeat_at = beat.at
        if self.metrics is not None:
            self.metrics.heartbeats.inc()

    async def loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log_event(log, "report_tick_failed", logging.ERROR, exc_info=True)
            await asyncio.sleep(self.settings.heartbeat_interval_s)  # the period of the heartbeat itself
