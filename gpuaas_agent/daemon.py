"""The agent's asyncio main: builds the object graph once, runs the task worker and heartbeats until SIGTERM.

``python -m gpuaas_agent.daemon run --config F`` / ``enroll --config F [--token-file T]``
(``gpuaas-agent run|enroll`` call :func:`run_main` / :func:`enroll_main`).

systemd (``Type=notify``): ``READY=1`` once the task consumer is bound,
``STATUS=`` on state changes, ``WATCHDOG=1`` at half of ``WATCHDOG_USEC`` from a
loop task (a wedged event loop stops petting it), ``STOPPING=1`` on SIGTERM.
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
import socket
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

import nats
import nats.errors
from nats.aio.client import Client

from gpuaas_agent import __version__
from gpuaas_agent.config import AgentConfig, load_config
from gpuaas_agent.contract.tasks import Heartbeat, TaskType
from gpuaas_agent.control.connection import Backoff, NatsConnectError, connect_nats, safe_url
from gpuaas_agent.control.enroll import (
    EnrollIdentity,
    EnrollmentRecord,
    enroll,
    load_enrollment,
)
from gpuaas_agent.control.worker import Handler, TaskWorker, WorkerSettings
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import configure_logging, log_event
from gpuaas_agent.state.store import StateStore

log = logging.getLogger("gpuaas_agent.daemon")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3
# Refusals that say "the host's surroundings are wrong" (NATS down, refused, silent), not "the request was bad".
ENVIRONMENT_CODES = frozenset({"nats_unreachable", "nats_auth_refused", "enroll_unreachable"})


_event = functools.partial(log_event, log)


# -- systemd notify ----------------------------------------------------------------


class SdNotifier:
    """sd_notify(3) without libsystemd: one datagram to ``$NOTIFY_SOCKET``; a no-op when it is unset."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        if address:
            # '@' is an abstract-namespace socket (systemd's own notation).
            self._target = "\0" + address[1:] if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls) -> "SdNotifier":
        return cls(os.environ.get("NOTIFY_SOCKET"))

    def notify(self, **fields: str | int) -> bool:
        """``notify(READY=1, STATUS="...")``; returns False (and logs) when the datagram could not be sent."""
        if self._sock is None:
            return False
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(payload, self._target)
            return True
        except OSError as exc:
            _event("sd_notify_failed", logging.WARNING, error=repr(exc), fields=sorted(fields))
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s(environ: dict[str, str] | None = None) -> float | None:
    """Half of ``WATCHDOG_USEC`` when the watchdog is meant for this process, else None."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1_000_000 / 2


# -- task handlers ------------------------------------------------------------------


def default_handlers(config: AgentConfig, slice_host=None) -> dict[TaskType, Handler]:
    """Every type not here gets ``failed``/``not_implemented`` from the worker.

    ``slice_host``: the drivers the slice pipelines share (one per daemon); without
    it only the read-only tasks are served.
    """
    from gpuaas_agent.tasks.admission import slice_plan_config
    from gpuaas_agent.tasks.plan import plan_handler
    from gpuaas_agent.tasks.preflight import preflight_handler
    from gpuaas_agent.tasks.topology import topology_discover_handler

    handlers: dict[TaskType, Handler] = {
        TaskType.topology_discover: topology_discover_handler(config.host_root, config.slice.gateway),
        TaskType.plan: plan_handler(config.host_root, slice_plan_config(config.slice)),
        TaskType.preflight: preflight_handler(config.host_root, sockets=_sockets(config), slice_config=config.slice),
    }
    if slice_host is not None:
        from gpuaas_agent.tasks.power import power_handler
        from gpuaas_agent.tasks.provision import provision_handler
        from gpuaas_agent.tasks.reconcile import reconcile_handler
        from gpuaas_agent.tasks.release import release_handler

        handlers[TaskType.vm_provision] = provision_handler(slice_host)
        handlers[TaskType.vm_release] = release_handler(slice_host)
        handlers[TaskType.reconcile] = reconcile_handler(slice_host)
        handlers[TaskType.vm_power] = power_handler(slice_host)
    return handlers


def _sockets(config: AgentConfig):
    """Preflight probes the daemons the slice pipelines use: the configured ovsdb, not the default one."""
    from gpuaas_agent.discovery.prereqs import SocketPaths

    remote = config.slice.ovsdb_remote
    return SocketPaths(ovsdb=remote.removeprefix("unix:")) if remote.startswith("unix:") else SocketPaths()


def timer_reconcile(slice_host, store: StateStore, nc: Client, node_id: str) -> Callable[[], Awaitable[dict]]:
    """The periodic reconcile: repairs what is safe, publishes its findings on the drift subject."""
    from gpuaas_agent.contract.drift import DriftTrigger
    from gpuaas_agent.control.uevent_watch import drift_subject
    from gpuaas_agent.tasks.reconcile import reconcile

    async def run() -> dict:
        report = await reconcile(slice_host, store, repair=True, trigger=DriftTrigger.timer, node_id=node_id)
        if report.findings:
            with contextlib.suppress(nats.errors.Error):
                await nc.publish(drift_subject(node_id), report.model_dump_json().encode())
        return {"findings": len(report.findings), "repaired": sum(f.repaired for f in report.findings)}

    return run


def identity_from_host(host_root: Path) -> EnrollIdentity:
    """Enrollment identity read from the host root (live ``/`` or a fixture)."""
    from gpuaas_agent.discovery.identity import read_identity
    from gpuaas_agent.discovery.sysread import SysReader
    from gpuaas_agent.hostfs import HostRoot

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


async def connect(config: AgentConfig, record: EnrollmentRecord, stop: asyncio.Event,
                  *, rng: random.Random | None = None) -> Client | None:
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
        connecting = asyncio.ensure_future(connect_nats(
            record.credentials.servers, timeout_s=config.connect_timeout_s, name=label,
            user=record.credentials.user, password=record.credentials.password, reconnect=backoff, rng=rng))
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


async def heartbeat_loop(nc: Client, node_id: str, worker: TaskWorker, store: StateStore,
                         interval_s: float, timeout_s: float) -> None:
    subject = f"gpuaas.node.{node_id}.heartbeat"
    while True:
        beat = Heartbeat(
            node_id=node_id,
            agent_version=__version__,
            # unknown until the consumer is bound; degraded while NATS is reconnecting
            health_state=("healthy" if nc.is_connected else "degraded") if worker.ready.is_set() else "unknown",
            running_tasks=worker.running_task_ids,
            leased_slots=[lease.slot_index for lease in store.leases()],
            at=datetime.now(timezone.utc),
        )
        try:
            await nc.publish(subject, beat.model_dump_json().encode())
            await nc.flush(timeout=timeout_s)
        except (nats.errors.Error, TimeoutError) as exc:
            _event("heartbeat_failed", logging.WARNING, error=repr(exc))
        await asyncio.sleep(interval_s)  # the period of the heartbeat itself


def uevent_watch_task(config: AgentConfig, nc: Client, node_id: str) -> asyncio.Task:
    """The drift watcher wired to discovery of ``host_root`` and the host's device events."""
    from gpuaas_agent.control.uevent_watch import DriftWatcher
    from gpuaas_agent.discovery.drift import topology_drift
    from gpuaas_agent.discovery.report import discover
    from gpuaas_agent.host.uevents import DEFAULT_MAX_BURST_S, UeventMonitor
    from gpuaas_agent.hostfs import HostRoot

    watcher = DriftWatcher(nc, node_id, lambda: discover(HostRoot.open(config.host_root)), topology_drift,
                           publish_timeout_s=config.request_timeout_s)
    return asyncio.create_task(watcher.watch(UeventMonitor(), debounce_s=config.uevent_debounce_s,
                                             max_burst_s=DEFAULT_MAX_BURST_S), name="uevent_watch")


async def watchdog_loop(notifier: SdNotifier, interval_s: float) -> None:
    while True:
        notifier.notify(WATCHDOG=1)
        await asyncio.sleep(interval_s)  # the watchdog period


async def reconcile_loop(reconcile: Callable[[], Awaitable[dict]], interval_s: float, timeout_s: float) -> None:
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


# -- main --------------------------------------------------------------------------


async def run_agent(
    config: AgentConfig,
    stop: asyncio.Event,
    *,
    handlers: dict[TaskType, Handler] | None = None,
    notifier: SdNotifier | None = None,
    reconcile: Callable[[], Awaitable[dict]] | None = None,
) -> int:
    """Run until ``stop`` is set; returns the exit code.

    ``reconcile``: the periodic host reconcile (every ``reconcile_interval_s``); None until the
    ``slice.reconcile`` room lands, and then the timer is off (logged once at start).
    """
    notifier = notifier or SdNotifier.from_env()
    record = load_enrollment(config.state_dir)
    if record is None:
        raise AgentError(f"not enrolled: no enrollment record in {config.state_dir}; run `gpuaas-agent enroll` first",
                         code="not_enrolled", evidence={"state_dir": str(config.state_dir)})
    store = StateStore.open(config.state_db)
    background: list[asyncio.Task] = []
    nc: Client | None = None
    slice_host = None
    try:
        _event("agent_starting", node_id=record.node_id, version=__version__,
               servers=[safe_url(s) for s in record.credentials.servers])
        notifier.notify(STATUS="connecting to NATS")
        nc = await connect(config, record, stop)
        if nc is None:
            return EXIT_OK  # stopped before the first connect
        settings = WorkerSettings(concurrency=config.concurrency, keepalive_interval_s=config.keepalive_interval_s,
                                  ack_wait_s=config.ack_wait_s, request_timeout_s=config.request_timeout_s,
                                  max_task_deadline_s=config.max_task_deadline_s,
                                  max_task_starts=config.max_task_starts, retry_backoff_s=config.task_retry_backoff_s)
        if handlers is None:
            from gpuaas_agent.tasks.slicehost import SliceHost

            slice_host = SliceHost.from_config(config)
            removed = slice_host.images.remove_stale_partials()  # downloads a crashed agent left behind
            if removed:
                _event("image_partials_removed", files=removed)
            handlers = default_handlers(config, slice_host)
            if reconcile is None:
                reconcile = timer_reconcile(slice_host, store, nc, record.node_id)
        worker = TaskWorker(nc, store, record.node_id, handlers, settings)
        worker_task = asyncio.create_task(worker.run(), name="worker")
        background.append(asyncio.create_task(
            heartbeat_loop(nc, record.node_id, worker, store, config.heartbeat_interval_s, config.request_timeout_s),
            name="heartbeat"))
        if config.uevent_watch:
            background.append(uevent_watch_task(config, nc, record.node_id))
        else:
            _event("uevent_watch_disabled", reason="config")
        if reconcile is not None:
            background.append(asyncio.create_task(
                reconcile_loop(reconcile, config.reconcile_interval_s, config.reconcile_interval_s), name="reconcile"))
        else:
            _event("reconcile_timer_disabled", reason="no_reconcile_handler")
        if (wd := watchdog_interval_s()) is not None:
            background.append(asyncio.create_task(watchdog_loop(notifier, wd), name="watchdog"))

        ready = asyncio.create_task(worker.ready.wait())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopping, worker_task}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            notifier.notify(READY=1, STATUS=f"node {record.node_id}: pulling tasks")
            _event("agent_ready", node_id=record.node_id, version=__version__)
        await asyncio.wait({stopping, worker_task}, return_when=asyncio.FIRST_COMPLETED)
        for waiter in (ready, stopping):
            waiter.cancel()

        if worker_task.done() and not stop.is_set():
            exc = worker_task.exception()
            _event("worker_died", logging.ERROR, error=repr(exc))
            return EXIT_FAILED
        notifier.notify(STOPPING=1, STATUS="stopping: finishing running tasks")
        _event("agent_stopping", running_tasks=worker.running_task_ids, grace_s=config.shutdown_grace_s)
        worker.stop()
        await asyncio.wait({worker_task}, timeout=config.request_timeout_s * 2)
        await worker.drain(config.shutdown_grace_s)
        return EXIT_OK
    finally:
        for task in background:
            task.cancel()
        if background:
            await asyncio.wait(background, timeout=config.request_timeout_s)
        if nc is not None:
            # OSError: the socket broke under the close (server killed); closing is all that was left to do.
            with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
                await asyncio.wait_for(nc.close(), config.request_timeout_s)
        if slice_host is not None:
            with contextlib.suppress(Exception):  # closing the libvirt connection must not mask the exit
                await slice_host.close()
        store.close()
        _event("agent_stopped")


async def _run_with_signals(config: AgentConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await run_agent(config, stop)


def run_main(config_path: str | Path) -> int:
    """``gpuaas-agent run --config F``: the daemon; exit 0 on SIGTERM, 1 on failure."""
    configure_logging()
    try:
        config = load_config(config_path)
        return asyncio.run(_run_with_signals(config))
    except AgentError as exc:
        _event("agent_failed", logging.ERROR, code=exc.code, message=exc.message, evidence=exc.evidence)
        return EXIT_FAILED


def enroll_main(config_path: str | Path, token_file: str | Path | None = None) -> int:
    """``gpuaas-agent enroll --config F [--token-file T]``: exit 0 enrolled (or already), 3 NATS unreachable,
    1 refused or impossible otherwise; every failure is one line on stderr, within connect + request timeouts.
    """
    handler = configure_logging()
    try:
        config = load_config(config_path)
        identity = identity_from_host(config.host_root)
        record = asyncio.run(enroll(config.nats_url, token_file or config.token_file, config.state_dir, identity,
                                    timeout=config.request_timeout_s, connect_timeout=config.connect_timeout_s))
    except AgentError as exc:
        if not isinstance(handler, logging.StreamHandler):
            # journald keeps the structured event; on stderr the line below is the record (one line, not two).
            _event("enroll_failed", logging.ERROR, code=exc.code, message=exc.message, evidence=exc.evidence)
        print(f"gpuaas-agent: enroll failed: {exc}", file=sys.stderr)
        # Under systemd (ExecStartPre, NotifyAccess=exec) `systemctl status` shows why it does not start.
        notifier = SdNotifier.from_env()
        notifier.notify(STATUS=f"enroll failed: {exc.code}: {exc.message}")
        notifier.close()
        return EXIT_ENVIRONMENT if exc.code in ENVIRONMENT_CODES else EXIT_FAILED
    print(f"enrolled node_id={record.node_id}")
    return EXIT_OK
