"""Prometheus metrics of one daemon: a registry of its own, served on 127.0.0.1 and/or written for node-exporter.

One :class:`AgentMetrics` per daemon (STYLE rule 12: no global default registry,
so two agents in one test process never share counters). Events are pushed in
by the hooks (worker result path, the pipeline's step observer); live state
(image cache size and hits, slot states, NATS, uevents) is read at scrape time
from a callback the daemon provides, so a scrape never shows a stale copy.

Exposition: ``metrics_listen = "127.0.0.1:9464"`` serves ``GET /metrics`` from the
event loop (no thread); ``metrics_textfile`` is rewritten atomically on every
heartbeat tick for node-exporter's textfile collector. A port in use is one log
line, and the daemon runs on without the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from gpuaas_agent import compat
from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.config import parse_listen
from gpuaas_agent.contract.fleet import DrainReport, QuarantinedComponent
from gpuaas_agent.contract.tasks import HealthCheck, TaskType
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

HEALTH_STATUSES = ("ok", "degraded", "failed", "unavailable")
HEALTH_STATES = ("unknown", "healthy", "degraded", "failed")
TASK_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
REQUEST_TIMEOUT_S = 5.0
KNOWN_TYPES = frozenset(t.value for t in TaskType)


@dataclass
class LiveState:
    """What the daemon reads for a scrape (all optional: a daemon without slice drivers has no cache)."""

    image_cache_bytes: int | None = None
    image_cache_entries: int | None = None
    image_cache_hits: int = 0
    image_cache_misses: int = 0
    image_cache_evictions: int = 0
    slot_states: dict[str, int] = field(default_factory=dict)
    nats_connected: bool = False
    nats_reconnects: int = 0
    uevents_seen: int = 0
    # Maintenance and drain (None: the stored state could not be read: no series, and the scrape says why in the log).
    maintenance: DrainReport | None = None
    quarantined: list[QuarantinedComponent] = field(default_factory=list)


class _LiveCollector:
    def __init__(self, sample: Callable[[], LiveState]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        try:
            live = self._sample()
        except Exception as exc:
            log_event(log, "metrics_sample_failed", logging.WARNING, error=repr(exc))
            return
        yield GaugeMetricFamily("gpuaas_agent_nats_connected", "1 while the NATS connection is up",
                                value=int(live.nats_connected))
        yield CounterMetricFamily("gpuaas_agent_nats_reconnects", "NATS reconnects since the daemon started",
                                  value=live.nats_reconnects)
        yield CounterMetricFamily("gpuaas_agent_uevents", "kernel/udev device events seen by the drift watcher",
                                  value=live.uevents_seen)
        if live.image_cache_bytes is not None:
            yield GaugeMetricFamily("gpuaas_agent_image_cache_size_bytes", "bytes of verified images in the cache",
                                    value=live.image_cache_bytes)
            yield GaugeMetricFamily("gpuaas_agent_image_cache_entries", "verified images in the cache",
                                    value=live.image_cache_entries or 0)
            yield CounterMetricFamily("gpuaas_agent_image_cache_hits", "image fetches served from the cache",
                                      value=live.image_cache_hits)
            yield CounterMetricFamily("gpuaas_agent_image_cache_misses", "image fetches that downloaded",
                                      value=live.image_cache_misses)
            yield CounterMetricFamily("gpuaas_agent_image_cache_evictions", "images evicted to stay in bounds",
                                      value=live.image_cache_evictions)
        slots = GaugeMetricFamily("gpuaas_agent_slot_states", "slots the host has a record of, by status",
                                  labels=["status"])
        for status, count in sorted(live.slot_states.items()):
            slots.add_metric([status], count)
        yield slots
        yield from _fleet_families(live)


def _fleet_families(live: LiveState) -> Iterator[Metric]:
    """Maintenance, drain and quarantine: what docs/alerts.md's rules and the dashboard read."""
    if live.maintenance is not None:
        m = live.maintenance
        yield GaugeMetricFamily("gpuaas_agent_maintenance", "1 while the host is in maintenance (no new slices)",
                                value=int(m.maintenance))
        if m.maintenance and m.since is not None:
            yield GaugeMetricFamily("gpuaas_agent_maintenance_since_timestamp_seconds",
                                    "when the host went into maintenance (unix time)", value=m.since.timestamp())
        yield GaugeMetricFamily("gpuaas_agent_drained", "1 when the host is in maintenance and no slice is left",
                                value=int(m.drained))
        yield GaugeMetricFamily("gpuaas_agent_leased_slots", "slots an allocation holds a lease on",
                                value=len(m.leased_slots))
    yield GaugeMetricFamily("gpuaas_agent_quarantined_components", "components out of service until unquarantined",
                            value=len(live.quarantined))
    named = GaugeMetricFamily("gpuaas_agent_quarantined", "1 for each quarantined component, by name and reason",
                              labels=["kind", "identity", "reason", "slot"])
    for q in live.quarantined:
        named.add_metric([q.kind.value, q.identity, q.reason.value, "" if q.slot_index is None else str(q.slot_index)],
                         1)
    yield named


class AgentMetrics:
    """The daemon's metrics; every method is cheap and safe to call from the event loop."""

    def __init__(self, sample: Callable[[], LiveState] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.tasks = Counter("gpuaas_agent_tasks", "finished tasks by type and outcome", ["type", "status"], registry=r)
        self.task_duration = Histogram("gpuaas_agent_task_duration_seconds", "task run time, claim to result",
                                       ["type"], buckets=TASK_BUCKETS, registry=r)
        self.step_duration = Histogram("gpuaas_agent_step_duration_seconds", "pipeline step run time",
                                       ["type", "step"], buckets=STEP_BUCKETS, registry=r)
        self.steps = Counter("gpuaas_agent_steps", "pipeline steps by outcome", ["type", "step", "status"], registry=r)
        self.clone_bytes = Counter("gpuaas_agent_clone_bytes", "bytes cloned onto slot disks", registry=r)
        self.wipe_bytes = Counter("gpuaas_agent_wipe_bytes", "bytes wiped on slot disks", registry=r)
        self.clone_throughput = Gauge("gpuaas_agent_clone_throughput_bytes_per_second",
                                      "throughput of the last clone", registry=r)
        self.wipe_throughput = Gauge("gpuaas_agent_wipe_throughput_bytes_per_second",
                                     "throughput of the last wipe", registry=r)
        self.health_check = Gauge("gpuaas_agent_health_check", "1 for each check's current status (a state set)",
                                  ["check", "status"], registry=r)
        self.health_state = Gauge("gpuaas_agent_health_state", "1 for the host's current health state",
                                  ["state"], registry=r)
        self.heartbeats = Counter("gpuaas_agent_heartbeats", "heartbeats the server took", registry=r)
        # Every type and outcome from the start at 0, and the release's wipe step: ``increase()`` in an alert
        # (docs/alerts.md) sees the first failure after a restart, not only the second.
        for task_type in sorted(KNOWN_TYPES):
            for status in ("succeeded", "failed", "cancelled"):
                self.tasks.labels(task_type, status)
        for status in ("succeeded", "failed"):
            self.steps.labels("slice.vm_release", "wipe", status)
        if sample is not None:
            r.register(_LiveCollector(sample))

    # -- hooks ---------------------------------------------------------------------------

    def task_finished(self, task_type: str, status: str, duration_s: float | None) -> None:
        # The type comes off the wire: an unknown one is one label value, not one series per forged name.
        task_type = task_type if task_type in KNOWN_TYPES else "unknown"
        self.tasks.labels(task_type, status).inc()
        if duration_s is not None:
            self.task_duration.labels(task_type).observe(duration_s)

    def step_finished(self, task_type: str, step: str, status: str, duration_s: float, output: dict[str, Any]) -> None:
        """The pipeline's observer: durations of every step, bytes of the clone and wipe steps."""
        self.steps.labels(task_type, step, status).inc()
        self.step_duration.labels(task_type, step).observe(duration_s)
        if status != "succeeded":
            return
        for name, counter, gauge, key in (("clone", self.clone_bytes, self.clone_throughput, "virtual_size_bytes"),
                                          ("wipe", self.wipe_bytes, self.wipe_throughput, "bytes")):
            size = output.get(key) if step == name else None
            if isinstance(size, int) and size >= 0:
                counter.inc(size)
                if duration_s > 0:
                    gauge.set(size / duration_s)

    def health(self, state: str, checks: list[HealthCheck]) -> None:
        for check in checks:
            for status in HEALTH_STATUSES:
                self.health_check.labels(check.name, status).set(int(check.status == status))
        for name in HEALTH_STATES:
            self.health_state.labels(name).set(int(state == name))

    # -- exposition ----------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def write_textfile(self, path: Path) -> None:
        """node-exporter's textfile collector reads ``*.prom`` files whole: write it atomically (not durably:
        it is rewritten every heartbeat)."""
        write_atomic(Path(path), self.render(), mode=0o644, durable=False)


class MetricsServer:
    """``GET /metrics`` over HTTP/1.0 from the event loop; one request per connection."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics
        self._server: asyncio.base_events.Server | None = None

    async def start(self, listen: str) -> bool:
        """Bind ``listen``; False (and one log line) when the address is taken or cannot be bound."""
        host, port = parse_listen(listen)
        try:
            self._server = await asyncio.start_server(self._serve, host, port)
        except OSError as exc:
            log_event(log, "metrics_listen_failed", logging.WARNING, listen=listen, error=exc.strerror or str(exc),
                      message=f"cannot serve /metrics on {listen}: {exc.strerror or exc}; running without it")
            return False
        log_event(log, "metrics_listening", listen=listen)
        return True

    @property
    def port(self) -> int | None:
        if self._server is None or not self._server.sockets:
            return None
        port: int = self._server.sockets[0].getsockname()[1]  # getsockname is Any in the stubs
        return port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with compat.timeout(REQUEST_TIMEOUT_S):
                request = await reader.readline()
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    if len(line) > 8192:
                        break
                method, _, rest = request.decode("latin-1").partition(" ")
                path = rest.split(" ", 1)[0].split("?", 1)[0]
                if method == "GET" and path in ("/metrics", "/"):
                    # Rendered on a worker thread: the live state reads the slot records (SQLite), never on the loop.
                    body, status, ctype = await asyncio.to_thread(self.metrics.render), "200 OK", CONTENT_TYPE_LATEST
                else:
                    body, status, ctype = b"not found: GET /metrics\n", "404 Not Found", "text/plain"
                writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                             f"Connection: close\r\n\r\n".encode() + body)
                await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass  # a client that stalls or hangs up gets nothing more
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), REQUEST_TIMEOUT_S)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), REQUEST_TIMEOUT_S)
            self._server = None
