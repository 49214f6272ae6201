"""The agent's asyncio main: builds the object graph once, runs the task worker and heartbeats until SIGTERM.

``python -m gpuaas_agent.daemon run --config F`` / ``enroll --config F [--token-file T]``
(``gpuaas-agent run|enroll`` call :func:`run_main` / :func:`enroll_main`).

systemd (``Type=notify``, through libsystemd's ``sd_notify``): ``READY=1`` as soon as
config, enrollment and state are loaded, with ``STATUS=waiting for NATS (attempt N)``:
a NATS outage at boot must not look like a start that hangs (systemd would kill and
restart the agent every start timeout, for ever). ``WATCHDOG=1`` at half of
``WATCHDOG_USEC`` from a loop task started before the first connect attempt (a wedged
event loop stops petting it; a NATS outage does not); ``STATUS=`` changes when the
consumer is bound, when NATS is lost and back; ``STOPPING=1`` on SIGTERM.

Around the worker: the :class:`~gpuaas_agent.operator.reporter.Reporter` (heartbeats,
the status file ``gpuaas-agent status`` reads, health checks on their timer), the
Prometheus metrics (``metrics_listen``, ``metrics_textfile``), and the retention prune
of stored results (at start and daily).
Shutdown: stop pulling, let running handlers finish for ``shutdown_grace_s``
(the rest stay unacked and are redelivered), close NATS, close the store, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, cast

import nats
import nats.errors
from nats.aio.client import Client

from gpuaas_agent import __version__
from gpuaas_agent.compat import UTC
from gpuaas_agent.config import AgentConfig, SliceConfig, load_config
from gpuaas_agent.contract.dhcp import Reservation
from gpuaas_agent.contract.drift import DriftReport, DriftTrigger
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.contract.telemetry import GuestPullBounds
from gpuaas_agent.control.connection import (
    Backoff,
    NatsConnectError,
    connect_nats,
    safe_url,
)
from gpuaas_agent.control.enroll import (
    EnrollIdentity,
    EnrollmentRecord,
    creds_path,
    enroll,
    js_api_prefix_in_use,
    load_enrollment,
    login_options,
)
from gpuaas_agent.control.rotation import CredsRotator, revert_unconfirmed_rotation
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.uevent_watch import Burst, DriftWatcher, drift_subject
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.discovery.drift import topology_drift
from gpuaas_agent.discovery.identity import read_identity
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.errors import AgentError
from gpuaas_agent.exitcodes import (  # noqa: F401
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    exit_code_for,
)
from gpuaas_agent.host.devices.fabricmanager import FabricManager
from gpuaas_agent.host.devices.uevents import DEFAULT_MAX_BURST_S, UeventMonitor
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations
from gpuaas_agent.host.vm.consolelog import sweep
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.logs import configure_logging, log_event
from gpuaas_agent.operator import memprobe
from gpuaas_agent.operator.fleetview import fleet_view
from gpuaas_agent.operator.guest_telemetry import GuestPuller, GuestTelemetrySource
from gpuaas_agent.operator.health import CheckThreads, HealthSettings, isolation_check
from gpuaas_agent.operator.health_fabric import fabric_probe
from gpuaas_agent.operator.health_quarantine import all_rechecks
from gpuaas_agent.operator.metrics import AgentMetrics, LiveState, MetricsServer
from gpuaas_agent.operator.netwatch import Probe, serialized, start_netwatch
from gpuaas_agent.operator.reporter import Reporter, ReporterSettings
from gpuaas_agent.operator.telemetry import (
    DomainStatsSource,
    GpuSensors,
    PfVfCounters,
    SliceMetricsCollector,
    SliceTelemetryLoop,
)
from gpuaas_agent.state.aio import BlockingStore, StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.boot_recovery import boot_recovery_at_start, publish_boot_report
from gpuaas_agent.tasks.crashpoint import armed as crash_point_armed
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.reconcile import reconcile as reconcile_host
from gpuaas_agent.tasks.registry import BuiltTasks, TaskDeps, build_tasks, concurrency_for
from systemd import daemon  # type: ignore[attr-defined]  # python-systemd ships no stubs for its submodules

log = logging.getLogger("gpuaas_agent.daemon")



_event = functools.partial(log_event, log)


# -- systemd notify ----------------------------------------------------------------


class SdNotifier:
    """sd_notify(3) through libsystemd (``systemd.daemon.notify``); a no-op when ``$NOTIFY_SOCKET`` is unset."""

    @classmethod
    def from_env(cls) -> SdNotifier:
        return cls()

    @property
    def enabled(self) -> bool:
        return bool(os.environ.get("NOTIFY_SOCKET"))

    def notify(self, **fields: str | int) -> bool:
        """``notify(READY=1, STATUS="...")``; returns False (and logs) when the message could not be sent."""
        if not self.enabled:
            return False

        payload = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            return bool(daemon.notify(payload))
        except OSError as exc:
            _event("sd_notify_failed", logging.WARNING, error=repr(exc), fields=sorted(fields))
            return False

    def close(self) -> None:
        """Nothing to close: libsystemd opens and closes its socket per message."""


def watchdog_interval_s(environ: dict[str, str] | None = None) -> float | None:
    """Half of ``WATCHDOG_USEC`` when the watchdog is meant for this process, else None."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1_000_000 / 2


# -- task handlers ------------------------------------------------------------------


def task_deps(config: AgentConfig, slice_host: SliceDrivers | None = None) -> TaskDeps:
    """What the registry's rows are built with: the config, the slice drivers (built once per daemon; None:
    only the rows without ``needs_slice_host``) and the quarantine re-checks of every room (the operator
    room's BMC and NVML ones merged into the tasks room's)."""
    return TaskDeps(config=config, drivers=slice_host, rechecks=all_rechecks())


def default_tasks(config: AgentConfig, slice_host: SliceDrivers | None = None) -> BuiltTasks:
    """The handlers and recoveries of :data:`~gpuaas_agent.tasks.registry.TASKS`, as its rows declare them;
    every type not there gets ``failed``/``not_implemented`` from the worker."""
    return build_tasks(task_deps(config, slice_host))


Reconcile = Callable[[], Awaitable[object]]


def port_isolation_probe(slice_host: SliceDrivers, store: StateStore | StoreThread) -> Probe:
    """The health round's ``port_isolation`` check: a read-only reconcile, its isolation findings only (read
    without libvirt where they do not depend on it: an idle host's probe loads no libvirt)."""

    async def port_isolation() -> list[HealthCheck]:
        report = await reconcile_host(slice_host, store, repair=False, trigger=DriftTrigger.timer, isolation_only=True)
        return [isolation_check(report.findings)]

    return port_isolation


def timer_reconcile(slice_host: SliceDrivers, store: StateStore | StoreThread, nc: Client,
                    node_id: str) -> Callable[[], Awaitable[dict[str, int]]]:
    """The periodic reconcile: repairs what is safe, publishes its findings on the drift subject."""
    async def run() -> dict[str, int]:
        report = await reconcile_host(slice_host, store, repair=True, trigger=DriftTrigger.timer, node_id=node_id)
        if report.findings:
            with contextlib.suppress(nats.errors.Error):
                await nc.publish(drift_subject(node_id), report.model_dump_json().encode())
        return {"findings": len(report.findings), "repaired": sum(f.repaired for f in report.findings)}

    return run


def fabric_manager_of(drivers: SliceDrivers) -> FabricManager:
    """The Fabric Manager of a probe row that ``needs_fabric_manager`` (built only where the drivers have one)."""
    if drivers.fabric is None:
        raise AgentError("a needs_fabric_manager probe is built only on a host with Fabric Manager",
                         code="fabric_manager_missing")
    return drivers.fabric


@dataclass(frozen=True)
class HealthProbeSpec:
    """One check of the slice host that the health round runs beside the reporter's own: its name, how it is
    built from the drivers and the store thread, and what it needs (a row that ``needs_fabric_manager`` is
    built only on a host whose config has ``[slice.fabric_manager]``)."""

    name: str
    make: Callable[[SliceDrivers, StoreThread], Probe]
    needs_fabric_manager: bool = False


# Every health-round check the slice drivers add, in one table (the reporter's own are operator/health.py's).
SLICE_HEALTH_PROBES: tuple[HealthProbeSpec, ...] = (
    # A read-only reconcile's isolation findings (docs/safety.md §9).
    HealthProbeSpec("port_isolation", lambda drivers, store: port_isolation_probe(drivers, store)),
    # Fabric Manager restarts found on the health interval (operator/health_fabric.py).
    HealthProbeSpec("fabric_partitions", lambda drivers, store: fabric_probe(fabric_manager_of(drivers), store),
                    needs_fabric_manager=True),
)


def slice_health_probes(drivers: SliceDrivers, store: StoreThread,
                        probes: tuple[HealthProbeSpec, ...] = SLICE_HEALTH_PROBES) -> list[Probe]:
    """The rows of ``probes`` this host has what they need for, built."""
    return [spec.make(drivers, store) for spec in probes if drivers.fabric is not None or not spec.needs_fabric_manager]


class NodeHost(Protocol):
    """What the daemon does with the host's slice drivers. Production runs :class:`SliceHost`; a test injects
    its own (tests/support/daemon_hosts.py) instead of the daemon branching on "no drivers"."""

    def tasks(self, config: AgentConfig) -> BuiltTasks: ...

    def start(self) -> None: ...

    def isolation_probe(self, store: StoreThread) -> Probe | None: ...

    def health_probes(self, store: StoreThread) -> list[Probe]: ...

    def sample(self, live: LiveState) -> None: ...

    def registered(self) -> dict[str, int]: ...

    def loops(self, config: AgentConfig, store: StoreThread) -> list[tuple[str, Coroutine[Any, Any, None]]]: ...

    async def boot_recovery(self, store: StoreThread) -> DriftReport | None: ...

    def reconcile(self, store: StoreThread, nc: Client, node_id: str) -> Reconcile | None: ...

    def domain_stats(self) -> DomainStatsSource | None: ...

    async def close_terminals(self) -> None: ...

    async def aclose(self) -> None: ...


class SliceHost:
    """The slice drivers as the daemon runs them (built once per daemon from the config)."""

    def __init__(self, drivers: SliceDrivers) -> None:
        self.drivers = drivers

    @classmethod
    def from_config(cls, config: AgentConfig) -> SliceHost:
        return cls(SliceDrivers.from_config(config))

    def tasks(self, config: AgentConfig) -> BuiltTasks:
        return default_tasks(config, self.drivers)

    def start(self) -> None:
        """Leftovers of a crashed agent: partial image downloads, a cache over its bounds."""
        removed = self.drivers.images.remove_stale_partials()
        if removed:
            _event("image_partials_removed", files=removed)
        evicted = self.drivers.images.enforce_bounds()
        if evicted:
            _event("image_cache_evicted", files=evicted, reason="bounds at start")

    def isolation_probe(self, store: StoreThread) -> Probe | None:
        return port_isolation_probe(self.drivers, store)

    def health_probes(self, store: StoreThread) -> list[Probe]:
        """The health round's checks of the slice host, beside the reporter's own (:data:`SLICE_HEALTH_PROBES`)."""
        return slice_health_probes(self.drivers, store)

    def sample(self, live: LiveState) -> None:
        stats = self.drivers.images.stats()
        live.image_cache_bytes, live.image_cache_entries = stats.size_bytes, stats.entries
        live.image_cache_hits, live.image_cache_misses = stats.hits, stats.misses
        live.image_cache_evictions = stats.evictions

    def registered(self) -> dict[str, int]:
        """What the drivers hold now (terminal sessions, power tasks), for the status's ``registered``."""
        return self.drivers.registered()

    def loops(self, config: AgentConfig, store: StoreThread) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [("console-logs", console_log_loop(store, config.slice))]

    async def boot_recovery(self, store: StoreThread) -> DriftReport | None:
        return await boot_recovery_at_start(self.drivers, store)

    def reconcile(self, store: StoreThread, nc: Client, node_id: str) -> Reconcile | None:
        return timer_reconcile(self.drivers, store, nc, node_id)

    def domain_stats(self) -> DomainStatsSource | None:
        """Slice telemetry's one bulk stats call per interval, on the drivers' libvirt connection."""
        return self.drivers.libvirt.all_domain_stats

    async def close_terminals(self) -> None:
        await self.drivers.close_terminals()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):  # closing the libvirt connection must not mask the exit
            await self.drivers.close()



def identity_from_host(host_root: Path) -> EnrollIdentity:
    """Enrollment identity read from the host root (live ``/`` or a fixture)."""
    host = read_identity(SysReader(HostRoot.open(host_root)))
    if not host.machine_id or not host.hostname:
        raise AgentError("enrollment needs /etc/machine-id and a hostname", code="host_identity_missing",
                         evidence={"host_root": str(host_root)})
    maas = None
    maas_file = Path(host_root) / "etc/maas/system_id"  # not always present; the control plane copes without
    with contextlib.suppress(OSError):
        maas = maas_file.read_text().strip() or None
    return EnrollIdentity(machine_id=host.machine_id, hostname=host.hostname, dmi_serial=host.dmi_serial,
                          maas_system_id=maas, agent_version=__version__)


# -- NATS --------------------------------------------------------------------------


# Connect refusals no retry can fix; creds_expired is retried: a rotation may replace the file meanwhile.
FATAL_CONNECT_CODES = frozenset({"plaintext_refused", "creds_insecure", "creds_invalid", "creds_unreadable",
                                 "tls_config_invalid"})



def worker_settings(config: AgentConfig, record: EnrollmentRecord | None = None) -> WorkerSettings:
    """The task worker's settings from the config; also what the control plane creates the node's consumer with
    (``WorkerSettings.consumer_config``: ack_wait, how many tasks the agent may hold). The JetStream API prefix
    is the config's when set there, else the one enrollment received (``js_api_prefix_in_use``)."""
    js_api_prefix, source = js_api_prefix_in_use(config, record)
    if record is not None:
        _event("js_api_prefix_chosen", js_api_prefix=js_api_prefix, source=source)
    return WorkerSettings(concurrency=concurrency_for(config), keepalive_interval_s=config.keepalive_interval_s,
                          ack_wait_s=config.ack_wait_s, request_timeout_s=config.request_timeout_s,
                          max_task_deadline_s=config.max_task_deadline_s,
                          max_task_starts=config.max_task_starts, retry_backoff_s=config.task_retry_backoff_s,
                          fetch_timeout_s=config.pull_expiry_s, consumer_replicas=config.task_consumer_replicas,
                          consumer_memory=config.task_consumer_memory,
                          fetch_heartbeat_s=config.pull_heartbeat_s, js_api_prefix=js_api_prefix)

async def connect(config: AgentConfig, record: EnrollmentRecord, stop: asyncio.Event,
                  *, rng: random.Random | None = None,
                  on_attempt: Callable[[int], None] | None = None) -> Client | None:
    """Connect with the enrolled credentials; retry with backoff until connected or ``stop`` (then None).

    Each attempt is bounded by ``connect_timeout_s`` and raced against ``stop``, so SIGTERM
    ends the wait at once even while NATS is down. Between attempts: exponential backoff
    with full jitter (``reconnect_backoff_initial_s`` .. ``reconnect_backoff_max_s``), one
    log line per attempt. After the first connect nats.py reconnects by itself, forever,
    with the same backoff (``control/connection.py``); subscriptions and the pull
    consumer's inbox are restored by it.
    """
    rng = rng or random.Random()
    backoff = Backoff(config.reconnect_backoff_initial_s, config.reconnect_backoff_max_s)
    label = f"gpuaas-agent-{record.node_id}"
    attempt = 0
    while not stop.is_set():
        if on_attempt is not None:
            on_attempt(attempt + 1)
        try:
            login = login_options(config, record)  # TLS + creds + per-node inbox (control/transport.py)
        except AgentError as exc:
            raise NatsConnectError(exc.message, code=exc.code, evidence=exc.evidence) from None
        connecting = asyncio.ensure_future(connect_nats(
            record.credentials.servers, timeout_s=config.connect_timeout_s, name=label,
            reconnect=backoff, rng=rng, **login))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not connecting.done():
            connecting.cancel()  # connect_nats closes its client when cancelled
            with contextlib.suppress(asyncio.CancelledError, NatsConnectError):
                await connecting
            return None
        try:
            nc = connecting.result()
        except NatsConnectError as exc:
            if exc.code in FATAL_CONNECT_CODES:
                raise  # retrying cannot help: the config or the files must change (the message says which)
            if exc.code == "nats_auth_refused":
                revert_unconfirmed_rotation(creds_path(config.state_dir))  # a crash left unconfirmed creds in place
            delay = backoff.delay(attempt, rng)
            attempt += 1
            _event("nats_connect_failed", logging.WARNING, attempt=attempt, code=exc.code, retry_in_s=round(delay, 3),
                   message=f"NATS connect attempt {attempt} failed: {exc.code}: {exc.message}; "
                           f"next in {delay:.1f}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            continue
        if stop.is_set():  # connected in the same instant SIGTERM came
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await asyncio.wait_for(nc.close(), config.request_timeout_s)
            return None
        _event("nats_connected", servers=[safe_url(s) for s in record.credentials.servers], attempts=attempt + 1)
        return nc
    return None


class CountingBursts:
    """The uevent source, counting the device events it hands on (``gpuaas_agent_uevents_total``)."""

    def __init__(self, monitor: UeventMonitor) -> None:
        self.monitor = monitor
        self.source: object = monitor.source  # udev or kernel: the monitor chooses at start
        self.events = 0

    def start(self) -> object:
        started = self.monitor.start()
        self.source = self.monitor.source
        return started

    def close(self) -> None:
        self.monitor.close()

    async def bursts(self, debounce_s: float, max_burst_s: float) -> AsyncIterator[Burst]:
        async for burst in self.monitor.bursts(debounce_s, max_burst_s):
            self.events += len(burst.events)
            yield burst


def uevent_watch_loop(config: AgentConfig, nc: Client, node_id: str,
                      counter: list[CountingBursts]) -> Coroutine[Any, Any, None]:
    """The drift watcher wired to discovery of ``host_root`` and the host's device events."""
    watcher = DriftWatcher(nc, node_id, lambda: discover(HostRoot.open(config.host_root)), topology_drift,
                           publish_timeout_s=config.request_timeout_s)
    source = CountingBursts(UeventMonitor())
    counter.append(source)
    return watcher.watch(source, debounce_s=config.uevent_debounce_s, max_burst_s=DEFAULT_MAX_BURST_S)


async def watchdog_loop(notifier: SdNotifier, interval_s: float) -> None:
    while True:
        notifier.notify(WATCHDOG=1)
        await asyncio.sleep(interval_s)  # the watchdog period


async def prune_loop(store: StateStore | StoreThread, retention_s: float, interval_s: float = 86400.0) -> None:
    """Forget stored results (and their journal rows) older than the retention: at start, then daily."""
    state = as_store_thread(store)
    while True:
        try:
            results, rows = await state.prune_finished(time.time() - retention_s)
            if results or rows:
                _event("state_pruned", results=results, journal_rows=rows, retention_days=round(retention_s / 86400, 2))
        except AgentError as exc:
            _event("state_prune_failed", logging.WARNING, code=exc.code, message=exc.message)
        await asyncio.sleep(interval_s)  # the retention period's tick


async def console_log_loop(store: StateStore | StoreThread, settings: SliceConfig) -> None:
    """Cap the slices' console logs (host/vm/consolelog.py): at start, then every console_log_sweep_interval_s."""
    state = as_store_thread(store)
    while True:
        try:
            leased = {lease.allocation_id.lower() for lease in await state.leases()}
            report = await asyncio.to_thread(sweep, settings.console_log_dir, max_bytes=settings.console_log_max_bytes,
                                             max_age_s=settings.console_log_max_age_s, leased=leased)
            if report.deleted or report.trimmed:
                _event("console_logs_swept", deleted=len(report.deleted), trimmed=len(report.trimmed),
                       directory=str(settings.console_log_dir))
        except (AgentError, OSError) as exc:
            _event("console_log_sweep_failed", logging.WARNING, message=str(exc), directory=str(settings.console_log_dir))
        await asyncio.sleep(settings.console_log_sweep_interval_s)  # the sweep's tick


def live_state(store: StateStore | BlockingStore, reporter: Reporter, host: NodeHost,
               uevents: list[CountingBursts]) -> Callable[[], LiveState]:
    """What a scrape reads at that moment: cache, slot records, NATS, uevents."""
    def sample() -> LiveState:
        live = LiveState(nats_connected=reporter.nats_state == "connected", nats_reconnects=reporter.reconnects,
                         uevents_seen=sum(u.events for u in uevents))
        counts: dict[str, int] = {}
        for record in store.slot_states():
            counts[record.status.value] = counts.get(record.status.value, 0) + 1
        live.slot_states = counts
        live.maintenance, live.quarantined = fleet_view(cast(StateStore, store))  # a BlockingStore is its view
        host.sample(live)
        return live

    return sample


async def reconcile_loop(reconcile: Reconcile, interval_s: float, timeout_s: float) -> None:
    """Run the host reconcile every ``interval_s``; one run at most ``timeout_s``; a failure is logged, not fatal."""
    while True:
        await asyncio.sleep(interval_s)  # the reconcile period
        try:
            findings = await asyncio.wait_for(reconcile(), timeout_s)
            _event("reconcile_done", findings=findings)
        except AgentError as exc:
            _event("reconcile_failed", logging.WARNING, code=exc.code, message=exc.message)
        except TimeoutError:
            _event("reconcile_failed", logging.WARNING, code="reconcile_timeout", timeout_s=timeout_s)


# -- assembly ------------------------------------------------------------------------


class Background:
    """Starts the daemon's loops, each owned by the exit stack: cancelled (and awaited, bounded) when the stack
    unwinds, in the reverse order of their start, whether the daemon stops or a later part fails to start."""

    def __init__(self, stack: contextlib.AsyncExitStack, settle_s: float) -> None:
        self.stack, self.settle_s = stack, settle_s

    def start(self, name: str, loop: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self.own(asyncio.create_task(loop, name=name))

    def own(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """A task started elsewhere (the network watch, the worker), cancelled like the loops."""
        self.stack.push_async_callback(self._cancel, task)
        return task

    async def _cancel(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        await asyncio.wait({task}, timeout=self.settle_s)


class Connection:
    """The NATS connection, closed by the exit stack at the place it was registered: after every loop that
    uses it is cancelled, before the store; registered before the loops start (the connect comes later)."""

    def __init__(self, timeout_s: float) -> None:
        self.nc: Client | None = None
        self.timeout_s = timeout_s

    async def aclose(self) -> None:
        if self.nc is not None:
            # OSError: the socket broke under the close (server killed); closing is all that was left to do.
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await asyncio.wait_for(self.nc.close(), self.timeout_s)


async def run_agent(
    config: AgentConfig,
    stop: asyncio.Event,
    *,
    host: NodeHost | None = None,
    tasks: BuiltTasks | None = None,
    notifier: SdNotifier | None = None,
    reconcile: Reconcile | None = None,
) -> int:
    """Run until ``stop`` is set; returns the exit code.

    ``host``: the slice drivers as the daemon runs them (default :meth:`SliceHost.from_config`); tests inject
    theirs. ``tasks``: every task type's handler and recovery (default the host's). ``reconcile``: the periodic host
    reconcile (every ``reconcile_interval_s``; default the host's, None: the timer is off, logged once).

    Everything it opens or starts is owned by one exit stack, so it is closed or cancelled in reverse
    order however the run ends (a stop, a worker that died, a part that failed to start).
    """
    notifier = notifier or SdNotifier.from_env()
    record = load_enrollment(config.state_dir)
    if record is None:
        raise AgentError(f"not enrolled: no enrollment record in {config.state_dir}; run `gpuaas-agent enroll` first",
                         code="not_enrolled", evidence={"state_dir": str(config.state_dir)})
    # Every SQLite call of the daemon runs on this one thread, off the event loop (state/aio.py). A store that
    # cannot be opened ends the run before anything started (no agent_stopped: it never started).
    state = StoreThread.open(config.state_db)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(_event, "agent_stopped")  # the last line, after everything below is closed
        stack.push_async_callback(state.aclose)
        _event("agent_starting", node_id=record.node_id, version=__version__,
               servers=[safe_url(s) for s in record.credentials.servers])
        if crash_point_armed():  # tests only (tasks/crashpoint.py): say so loudly if it is ever set in production
            _event("crash_point_armed", level=logging.WARNING, spec=crash_point_armed())
        if host is None:
            host = SliceHost.from_config(config)
        stack.push_async_callback(host.aclose)
        host.start()
        if tasks is None:
            tasks = host.tasks(config)
        connection = Connection(config.request_timeout_s)
        stack.push_async_callback(connection.aclose)
        background = Background(stack, config.request_timeout_s)
        return await _serve(config, stop, record, state, host, tasks, notifier, reconcile, connection, background,
                            stack)
    raise AssertionError("unreachable: the exit stack suppresses nothing")  # pragma: no cover


async def _serve(config: AgentConfig, stop: asyncio.Event, record: EnrollmentRecord, state: StoreThread,
                 host: NodeHost, tasks: BuiltTasks, notifier: SdNotifier, reconcile: Reconcile | None,
                 connection: Connection, background: Background, stack: contextlib.AsyncExitStack) -> int:
    """The agent's run, its parts started in order (each owned by ``stack``); see :func:`run_agent`."""
    uevents: list[CountingBursts] = []
    # The threads every blocking health check runs in, owned here: the reporter's rounds and the network
    # watch run checks of the same names, and one registry keeps one stuck thread per check at most.
    check_threads = CheckThreads()
    reporter = Reporter(
        ReporterSettings(node_id=record.node_id, state_dir=config.state_dir,
                         heartbeat_interval_s=config.heartbeat_interval_s,
                         health_interval_s=config.health_interval_s, request_timeout_s=config.request_timeout_s,
                         metrics_textfile=config.metrics_textfile),
        state, HealthSettings.from_config(config), None, notifier.notify, threads=check_threads)
    reporter.extra_checks.extend(host.health_probes(state))
    reporter.slice_counts = host.registered
    # state.sync: a scrape renders on a worker thread (operator/metrics.py), never on the loop
    metrics = AgentMetrics(live_state(state.sync, reporter, host, uevents))
    reporter.metrics = metrics
    # Config and state are loaded: tell systemd we are up, whatever NATS does (see the module docstring).
    notifier.notify(READY=1, STATUS=f"node {record.node_id}: waiting for NATS (attempt 1)")
    if (wd := watchdog_interval_s()) is not None:
        background.start("watchdog", watchdog_loop(notifier, wd))
    if config.metrics_listen:
        metrics_server = MetricsServer(metrics)
        if await metrics_server.start(config.metrics_listen):
            stack.push_async_callback(metrics_server.close)
    background.start("report", reporter.loop())
    background.start("health", reporter.health_loop())
    background.start("prune", prune_loop(state, config.task_retention_days * 86400))
    for name, loop in host.loops(config, state):
        background.start(name, loop)

    # After a host reboot: re-validate and restore the active slices before any task runs
    # (after READY and with the watchdog going: a restart of several slices takes a while).
    boot_report = await host.boot_recovery(state)
    nc = connection.nc = await connect(config, record, stop, on_attempt=reporter.connect_attempt)
    if nc is None:
        reporter.stopping = True
        notifier.notify(STOPPING=1, STATUS="stopping: NATS never answered")
        return EXIT_OK  # stopped before the first connect
    if reconcile is None:
        reconcile = host.reconcile(state, nc, record.node_id)
    if reconcile is not None:
        reconcile = serialized(reconcile)  # the timer and the network watch's repair, one at a time
    await publish_boot_report(nc, record.node_id, boot_report, config.request_timeout_s)
    start_slice_telemetry(config, host, state, nc, record.node_id, metrics, background, reporter)
    worker = TaskWorker(nc, state, record.node_id, tasks.handlers, worker_settings(config, record),
                        recoveries=tasks.recoveries, observer=metrics)
    if config.nats_creds_file is None and record.credentials.user_jwt is not None:
        # Enrolled with a key of its own: the control plane may order a rotation (control/rotation.py).
        await CredsRotator(nc, record.node_id, creds_path(config.state_dir),
                           timeout_s=config.request_timeout_s).start()
    reporter.attach(nc, worker)
    reporter.status_line(f"node {record.node_id}: connected to NATS, binding the task consumer")
    worker_task = asyncio.create_task(worker.run(), name="worker")
    if config.netwatch_interval_s > 0:  # the slice network re-proven on a timer and netlink events
        netwatch = start_netwatch(config, reporter, nc, record.node_id, host.isolation_probe(state), repair=reconcile,
                                  threads=check_threads, store=state)
        background.own(netwatch)
    if config.uevent_watch:
        background.start("uevent_watch", uevent_watch_loop(config, nc, record.node_id, uevents))
    else:
        _event("uevent_watch_disabled", reason="config")
    if reconcile is not None:
        background.start("reconcile", reconcile_loop(reconcile, config.reconcile_interval_s,
                                                      config.reconcile_interval_s))
    else:
        _event("reconcile_timer_disabled", reason="no_reconcile_handler")
    # The worker is stopped and drained below, not cancelled; an exception before that still cancels it.
    background.own(worker_task)
    return await _until_stopped(config, stop, record, reporter, notifier, worker, worker_task, host)


def start_slice_telemetry(config: AgentConfig, host: NodeHost, state: StoreThread, nc: Client, node_id: str,
                          metrics: AgentMetrics, background: Background,
                          reporter: Reporter | None = None) -> SliceTelemetryLoop | None:
    """Slice telemetry (operator/telemetry.py) on ``slice_telemetry_interval_s``, its slot series on /metrics;
    each slot's GPU sensors from the health rounds' last BMC reading (``reporter``), while it is recent."""
    source = host.domain_stats()
    if source is None or config.slice_telemetry_interval_s <= 0:
        _event("slice_telemetry_disabled", reason="config" if source is not None else "no_slice_drivers")
        return None

    async def leases() -> list[SlotLease]:
        held: list[SlotLease] = await state.leases()
        return held

    def leased() -> set[str]:  # at scrape time, on the scrape's worker thread (operator/metrics.py)
        return {lease.allocation_id for lease in state.sync.leases()}

    max_age_s = 3 * config.health_interval_s

    def gpus() -> GpuSensors | None:  # a reading older than three health rounds is not passed off as current
        reading = reporter.bmc_reading if reporter is not None else None
        if reading is None or (datetime.now(UTC) - reading.read_at).total_seconds() > max_age_s:
            return None
        return GpuSensors(read_at=reading.read_at, by_pci_address=reading.sensors_by_pci_address())

    telemetry = SliceTelemetryLoop(node_id, source, leases, nc.publish, interval_s=config.slice_telemetry_interval_s,
                                   stats_timeout_s=config.request_timeout_s * 2, guest=guest_telemetry_source(config),
                                   fabric=PfVfCounters(config.host_root), gpus=gpus)
    metrics.registry.register(SliceMetricsCollector(telemetry, leased))
    background.start("slice-telemetry", telemetry.run())
    return telemetry


def guest_telemetry_source(config: AgentConfig) -> GuestTelemetrySource:
    """Guest pulls for the allocations that opt in: the target from this config and the slot's reservation only."""
    hosts = DnsmasqReservations(config.slice.dnsmasq_hosts_file, config.slice.subnet, config.slice.gateway,
                                config.slice.dnsmasq_pid_file)

    async def reservations() -> list[Reservation]:
        return await asyncio.to_thread(hosts.reservations)

    # The loop pulls once per interval; the floor sits just under it so a timer that fires a little early (the
    # event loop's clock resolution) never throttles a due pull, while a second pull within one interval is refused.
    bounds = GuestPullBounds(max_bytes=config.guest_pull_max_bytes, max_series=config.guest_pull_max_series,
                             timeout_s=config.guest_pull_timeout_s, min_interval_s=config.slice_telemetry_interval_s * 0.9)
    return GuestTelemetrySource(GuestPuller(bounds, source=config.slice.gateway), reservations,
                                port=config.guest_exporter_port, path=config.guest_exporter_path)


async def _until_stopped(config: AgentConfig, stop: asyncio.Event, record: EnrollmentRecord, reporter: Reporter,
                         notifier: SdNotifier, worker: TaskWorker, worker_task: asyncio.Task[None],
                         host: NodeHost) -> int:
    """Serve until ``stop`` (drain: stop pulling, let running tasks finish for the grace) or the worker dies."""
    ready = asyncio.create_task(worker.ready.wait())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({ready, stopping, worker_task}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            reporter.status_line(f"node {record.node_id}: pulling tasks")
            _event("agent_ready", node_id=record.node_id, version=__version__)
            await reporter.tick()  # the first heartbeat and status file now, not one interval later
        await asyncio.wait({stopping, worker_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in (ready, stopping):
            waiter.cancel()

    if worker_task.done() and not stop.is_set():
        exc = worker_task.exception()
        _event("worker_died", logging.ERROR, error=repr(exc))
        return EXIT_FAILED
    reporter.stopping = True
    notifier.notify(STOPPING=1, STATUS="stopping: finishing running tasks")
    _event("agent_stopping", running_tasks=worker.running_task_ids, grace_s=config.shutdown_grace_s)
    worker.stop()
    await asyncio.wait({worker_task}, timeout=config.request_timeout_s * 2)
    await worker.drain(config.shutdown_grace_s)
    await host.close_terminals()  # while NATS is still up: each gateway gets its session's closing frame
    return EXIT_OK


async def _run_with_signals(config: AgentConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():  # the log says why the agent stopped (systemctl stop, ^C, a stray kill)
            _event("signal_received", signal=sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    memprobe.install(loop)  # diagnostic, only with GPUAAS_AGENT_MEMPROBE_DIR set (docs/fairness.md)
    return await run_agent(config, stop)


def run_main(config_path: str | Path) -> int:
    """``gpuaas-agent run --config F``: the daemon; exit 0 on SIGTERM; otherwise one ``agent_failed`` line and
    2 (bad config), 3 (environment: not enrolled, state unreadable) or 1 (the worker died)."""
    configure_logging()
    try:
        config = load_config(config_path)
        return asyncio.run(_run_with_signals(config))
    except AgentError as exc:
        _event("agent_failed", logging.ERROR, code=exc.code, message=exc.message, evidence=exc.evidence)
        return exit_code_for(exc.code)
    except (OSError, sqlite3.Error) as exc:  # the state dir or DB cannot be used: the host's problem, not a bug
        _event("agent_failed", logging.ERROR, code="state_unreadable" if isinstance(exc, sqlite3.Error) else "os_error",
               message=f"{type(exc).__name__}: {exc}")
        return EXIT_ENVIRONMENT


def enroll_main(config_path: str | Path, token_file: str | Path | None = None) -> int:
    """``gpuaas-agent enroll --config F [--token-file T]``: exit 0 enrolled (or already), 3 NATS unreachable,
    1 refused or impossible otherwise; every failure is one line on stderr, within connect + request timeouts.
    """
    handler = configure_logging()
    try:
        config = load_config(config_path)
        identity = identity_from_host(config.host_root)
        record = asyncio.run(enroll(config.nats_url, token_file or config.token_file, config.state_dir, identity,
                                    timeout=config.request_timeout_s, connect_timeout=config.connect_timeout_s,
                                    security=TransportSecurity.from_config(config, enroll=True)))
    except AgentError as exc:
        if not isinstance(handler, logging.StreamHandler):
            # journald keeps the structured event; on stderr the line below is the record (one line, not two).
            _event("enroll_failed", logging.ERROR, code=exc.code, message=exc.message, evidence=exc.evidence)
        print(f"gpuaas-agent: enroll failed: {exc}", file=sys.stderr)
        # Under systemd (ExecStartPre, NotifyAccess=exec) `systemctl status` shows why it does not start.
        notifier = SdNotifier.from_env()
        notifier.notify(STATUS=f"enroll failed: {exc.code}: {exc.message}")
        notifier.close()
        return exit_code_for(exc.code)
    print(f"enrolled node_id={record.node_id}")
    return EXIT_OK
