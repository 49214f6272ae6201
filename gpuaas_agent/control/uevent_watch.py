"""The daemon's drift watcher: on each trigger, rediscover, compare with the last report, publish the drift.

Triggers are bursts of device events (a disk, PCI function or link appearing,
vanishing or changing driver), so the control plane hears about a pulled disk
within seconds instead of at the next reconcile tick; ``check()`` is also the
entry point for the timer and for tasks. Discovery blocks (sysfs walks), so it
runs in a thread with a deadline. The first discovery is the baseline: drift
that happened while the agent was down is the reconcile's business (it compares
the host with the leases), not this watcher's.

This room only talks NATS: discovery, the drift comparison and the event source
are handed in by ``daemon.py`` (docs/architecture.md: control imports contract and state).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import Protocol

import nats.errors
from nats.aio.client import Client

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.drift import DriftFinding, DriftReport, DriftTrigger, Uevent
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)
_event = functools.partial(log_event, log)

DEFAULT_DISCOVER_TIMEOUT_S = 60.0
DEFAULT_PUBLISH_TIMEOUT_S = 5.0

Discover = Callable[[], TopologyReport]  # blocking; run in a thread
Drift = Callable[[TopologyReport, TopologyReport], list[DriftFinding]]


def drift_subject(node_id: str) -> str:
    return subjects.drift(node_id)


class Burst(Protocol):
    """What a trigger from the event source carries (``host.devices.uevents.UeventBurst``, a frozen dataclass: read-only)."""

    @property
    def events(self) -> Sequence[Uevent]: ...

    @property
    def dropped(self) -> int: ...

    @property
    def overflowed(self) -> bool: ...


class BurstSource(Protocol):
    """A started-on-demand source of bursts (``host.devices.uevents.UeventMonitor``)."""

    source: object

    def start(self) -> object: ...

    def close(self) -> None: ...

    def bursts(self, debounce_s: float, max_burst_s: float) -> AsyncIterator[Burst]: ...


class DriftWatcher:
    """Keeps the last discovery; each check rediscovers, diffs, logs and (when there is drift) publishes."""

    def __init__(
        self,
        nc: Client,
        node_id: str,
        discover: Discover,
        drift: Drift,
        *,
        discover_timeout_s: float = DEFAULT_DISCOVER_TIMEOUT_S,
        publish_timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S,
        publish_empty: bool = False,
    ) -> None:
        self.nc = nc
        self.node_id = node_id
        self.subject = drift_subject(node_id)
        self._discover = discover
        self._drift = drift
        self.discover_timeout_s = discover_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.publish_empty = publish_empty  # False: a check that found nothing is logged, not sent
        self.last_report: TopologyReport | None = None
        self.last_drift: DriftReport | None = None
        self.checks = 0  # completed rediscoveries (the baseline included)
        self._lock = asyncio.Lock()  # one rediscovery at a time: "last report" must mean one thing

    async def _rediscover(self) -> TopologyReport | None:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._discover), self.discover_timeout_s)
        except AgentError as exc:
            _event("drift_discovery_failed", logging.WARNING, code=exc.code, message=exc.message, evidence=exc.evidence)
        except TimeoutError:  # the thread runs on; its result is dropped
            _event("drift_discovery_failed", logging.WARNING, code="discovery_timeout", timeout_s=self.discover_timeout_s)
        return None

    async def baseline(self) -> TopologyReport | None:
        """Discover once and keep it as the reference; no report."""
        async with self._lock:
            report = await self._rediscover()
            if report is not None:
                self.last_report = report
                self.checks += 1
                _event("drift_baseline", summary=report.summary.as_line())
            return report

    async def check(self, trigger: DriftTrigger, burst: Burst | None = None) -> DriftReport | None:
        """Rediscover and compare with the last report; the report (sent or not), or None when no comparison ran."""
        async with self._lock:
            after = await self._rediscover()
            if after is None:
                return None
            before, self.last_report = self.last_report, after
            self.checks += 1
            if before is None:
                _event("drift_baseline", trigger=trigger.value, summary=after.summary.as_line())
                return None
            findings = self._drift(before, after)
            events = list(burst.events) if burst is not None else []
            report = DriftReport(node_id=self.node_id, trigger=trigger, findings=findings,
                                 at=datetime.now(UTC), events=events,
                                 events_dropped=burst.dropped if burst is not None else 0)
            self.last_drift = report
            _event("drift_checked", logging.WARNING if findings else logging.INFO, trigger=trigger.value,
                   findings=[f"{f.kind.value}:{f.subject}" for f in findings],
                   devices=sorted({f"{e.subsystem}:{e.name}" for e in events}),
                   events_dropped=report.events_dropped, overflowed=bool(burst and burst.overflowed))
            if findings or self.publish_empty:
                await self.publish(report)
            return report

    async def publish(self, report: DriftReport) -> bool:
        """Core NATS publish + flush; a failure is logged (the report is in the log either way)."""
        try:
            await self.nc.publish(self.subject, report.model_dump_json().encode())
            await self.nc.flush(timeout=self.publish_timeout_s)  # type: ignore[arg-type]  # nats.py says int; seconds
            _event("drift_published", subject=self.subject, findings=len(report.findings))
            return True
        except (nats.errors.Error, TimeoutError) as exc:
            _event("drift_publish_failed", logging.WARNING, subject=self.subject, error=repr(exc))
            return False

    async def watch(self, source: BurstSource, *, debounce_s: float, max_burst_s: float) -> None:
        """Start the event source, take the baseline, then check once per burst until cancelled.

        The watcher is an extra: when the source cannot start or fails, that is
        logged and this returns, and the daemon goes on with its timer.
        """
        try:
            source.start()
        except AgentError as exc:
            _event("uevent_watch_unavailable", logging.ERROR, code=exc.code, message=exc.message, evidence=exc.evidence)
            return
        try:
            _event("uevent_watch_started", source=str(getattr(source.source, "value", source.source)),
                   subject=self.subject, debounce_s=debounce_s)
            if self.last_report is None:
                await self.baseline()
            async for burst in source.bursts(debounce_s, max_burst_s):
                await self.check(DriftTrigger.uevent, burst)
        except AgentError as exc:
            _event("uevent_watch_failed", logging.ERROR, code=exc.code, message=exc.message, evidence=exc.evidence)
        except Exception:
            _event("uevent_watch_failed", logging.ERROR, code="internal_error", exc_info=True)
        finally:
            source.close()
