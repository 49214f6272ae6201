"""The slice network, re-proven while slices run: a short timer and netlink events drive its checks.

Why: readiness proved the network once. The seed 004 incident (the NAT ``MASQUERADE``
rule gone, guests without egress) stayed invisible until a user complained, and the
full health round (``operator/health.py``) runs only every ``health_interval_s``
(60 s). This watch re-runs the slice network's checks, the same functions as the
health round (``slice_gateway``, ``slice_nat``, ``slice_ip_forward``, ``dnsmasq``) plus
``port_isolation`` (the flows and nft guard of every active port):

- every ``netwatch_interval_s`` (≤ 15 s): what no event announces (a dnsmasq that
  died, OpenFlow rules of a restarted vswitchd);
- at once (debounced) on a netlink event: links, IPv4 addresses, routes and
  forwarding (``RTNLGRP_LINK``, ``_IPV4_IFADDR``, ``_IPV4_ROUTE``, ``_IPV4_NETCONF``:
  ``ip_forward`` changes are announced there) and every nftables change
  (``NFNLGRP_NFTABLES`` on a ``NETLINK_NETFILTER`` socket: iptables is iptables-nft,
  so deleting the ``MASQUERADE`` rule is an nftables event). The messages are not
  parsed: any of them only says "look again".

Each round's checks replace the same-named ones in the reporter (every check carries its
``checked_at``). When the set of failing checks changes, a :class:`DriftReport`
(``slice_network_degraded`` / ``slice_network_restored``) goes out on the drift subject and a
heartbeat is sent at once, so the control plane sees ``degraded`` with the reason within
seconds of the break, not one health period later. When ``port_isolation`` starts failing
(a vswitchd restart loses every OpenFlow rule), the daemon's repairing reconcile runs at once
(serialized with its timer): it reinstalls the rules of known active ports and publishes its
``flows_missing`` findings; the next round reports the check restored.

The sockets are opened in the agent's own network namespace; with ``health_netns`` set
(the checks read another namespace) the watch runs on its timer only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING

from nats.aio.client import Client

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.drift import (
    DriftFinding,
    DriftKind,
    DriftReport,
    DriftSeverity,
    DriftTrigger,
)
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.logs import log_event
from gpuaas_agent.operator.health import (
    CHECK_TIMEOUT_S,
    CheckThreads,
    HealthSettings,
    dnsmasq_check,
    guarded_check,
    network_checks,
)

if TYPE_CHECKING:  # the reporter is the daemon's; the watch only merges checks into it
    from gpuaas_agent.operator.reporter import Reporter

log = logging.getLogger(__name__)

SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NETLINK_NETFILTER = 12
NFNLGRP_NFTABLES = 7
RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV4_ROUTE, RTNLGRP_IPV4_NETCONF = 1, 5, 7, 24
ROUTE_GROUPS = (RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV4_ROUTE, RTNLGRP_IPV4_NETCONF)
WATCHED = ("slice_gateway", "slice_nat", "slice_ip_forward", "dnsmasq", "port_isolation")
_BAD = ("degraded", "failed")

Probe = Callable[[], Awaitable[list[HealthCheck]]]


def open_netlink_sockets() -> list[socket.socket]:
    """Non-blocking netlink sockets subscribed to the groups above (rtnetlink and nftables)."""
    made: list[socket.socket] = []
    for proto, groups in ((socket.NETLINK_ROUTE, ROUTE_GROUPS), (NETLINK_NETFILTER, (NFNLGRP_NFTABLES,))):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, proto)
        try:
            sock.bind((0, 0))
            for group in groups:
                sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        except OSError:
            sock.close()
            for other in made:
                other.close()
            raise
        made.append(sock)
    return made


def failing(checks: list[HealthCheck]) -> dict[str, HealthCheck]:
    return {c.name: c for c in checks if c.status in _BAD}


def drift_findings(before: dict[str, HealthCheck], after: dict[str, HealthCheck]) -> list[DriftFinding]:
    """One finding per check that started or stopped failing (or failed for another reason)."""
    findings = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if new is not None and (old is None or (old.status, old.detail) != (new.status, new.detail)):
            findings.append(DriftFinding(
                kind=DriftKind.slice_network_degraded, subject=name, expected="ok",
                actual=f"{new.status}: {new.detail}"[:2000],
                severity=DriftSeverity.error, detail={"checked_at": new.checked_at.isoformat()}))
        elif new is None and old is not None:
            findings.append(DriftFinding(
                kind=DriftKind.slice_network_restored, subject=name, expected=f"{old.status}: {old.detail}"[:2000],
                actual="ok", severity=DriftSeverity.info, detail={}))
    return findings


class NetWatch:
    """The watch of one daemon: runs rounds, merges their checks into the reporter, reports changes."""

    def __init__(self, settings: HealthSettings, reporter: Reporter, *, interval_s: float, node_id: str | None = None,
                 isolation: Probe | None = None, publish: Callable[[str, bytes], Awaitable[None]] | None = None,
                 subject: str | None = None, debounce_s: float = 0.5, min_gap_s: float = 2.0,
                 repair: Callable[[], Awaitable[object]] | None = None, threads: CheckThreads) -> None:
        self.settings = settings
        # The daemon's check threads, shared with the reporter's rounds: one stuck thread per check at most.
        self.threads = threads
        self.reporter = reporter
        self.interval_s = interval_s
        self.node_id = node_id
        self.isolation = isolation
        self.publish = publish
        self.subject = subject
        self.debounce_s = debounce_s
        self.min_gap_s = min_gap_s  # rounds at most this often, however busy netlink is (other tenants' taps)
        self.failing: dict[str, HealthCheck] = {}
        self.rounds = 0
        # The daemon's repairing reconcile: run at once when port_isolation starts failing (a vswitchd that
        # restarted lost every OpenFlow rule; waiting for the reconcile timer would leave slices open).
        self.repair = repair
        self.repairs = 0
        self.last_round_at: datetime | None = None
        self._wake = asyncio.Event()

    async def checks(self) -> list[HealthCheck]:
        """The watched checks once, concurrently; a broken one is ``unavailable`` with its reason."""
        jobs = [guarded_check("slice_network", lambda: network_checks(self.settings), threads=self.threads),
                guarded_check("dnsmasq", lambda: dnsmasq_check(self.settings), threads=self.threads)]
        if self.isolation is not None:
            jobs.append(self._isolation())
        return [c for group in await asyncio.gather(*jobs) for c in group]

    async def _isolation(self) -> list[HealthCheck]:
        assert self.isolation is not None  # checks() asks only with a probe
        try:
            return await asyncio.wait_for(self.isolation(), CHECK_TIMEOUT_S)
        except Exception as exc:
            return [HealthCheck(name="port_isolation", status="unavailable",
                                detail=f"check raised {type(exc).__name__}: {exc}"[:4000], checked_at=datetime.now(UTC))]

    async def round(self, trigger: DriftTrigger) -> list[DriftFinding]:
        """One round: check, merge into the reporter, and on a change publish drift and a heartbeat now."""
        checks = await self.checks()
        fresh = {c.name: c for c in checks}
        if self.reporter.checks is not None:  # before the first health round the heartbeat says "unknown"
            merged = {c.name: c for c in self.reporter.checks}
            merged.update(fresh)
            self.reporter.checks = sorted(merged.values(), key=lambda c: c.name)
        now_failing = failing(checks)
        findings = drift_findings(self.failing, now_failing)
        newly_open = "port_isolation" in now_failing and "port_isolation" not in self.failing
        self.failing = now_failing
        self.rounds += 1
        self.last_round_at = datetime.now(UTC)
        if findings:
            log_event(log, "slice_network_changed", logging.WARNING if now_failing else logging.INFO,
                      trigger=trigger.value, failing={n: c.detail for n, c in now_failing.items()},
                      changes=[f"{f.kind.value} {f.subject}" for f in findings])
            if self.publish is not None and self.subject is not None:
                report = DriftReport(node_id=self.node_id, trigger=trigger, findings=findings, at=datetime.now(UTC))
                with contextlib.suppress(Exception):  # a lost drift message must not stop the watch
                    await self.publish(self.subject, report.model_dump_json().encode())
            if self.reporter.checks is not None:
                await self.reporter.tick()  # the heartbeat now, not one interval later
        if newly_open and self.repair is not None:
            await self._repair(now_failing["port_isolation"])
        return findings

    async def _repair(self, check: HealthCheck) -> None:
        self.repairs += 1
        assert self.repair is not None  # round() repairs only with one
        try:
            outcome = await self.repair()
        except Exception as exc:
            log_event(log, "netwatch_repair_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}",
                      reason=check.detail)
        else:
            log_event(log, "netwatch_repaired", logging.WARNING, reason=check.detail, outcome=outcome)
        self._wake.set()  # look again at once: the restored rules make the next round report "restored"

    def _readable(self, sock: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while sock.recv(1 << 16):  # drain: the content does not matter, only that something changed
                pass
        self._wake.set()

    async def run(self) -> None:
        """Rounds on the timer and on netlink events until cancelled."""
        loop = asyncio.get_running_loop()
        sockets: list[socket.socket] = []
        if self.settings.netns is None:
            try:
                sockets = open_netlink_sockets()
            except OSError as exc:
                log_event(log, "netwatch_netlink_unavailable", logging.WARNING, error=str(exc))
        for sock in sockets:
            loop.add_reader(sock.fileno(), self._readable, sock)
        log_event(log, "netwatch_started", interval_s=self.interval_s, netlink=bool(sockets),
                  checks=list(WATCHED if self.isolation else WATCHED[:-1]))
        trigger = DriftTrigger.timer
        try:
            while True:
                started = loop.time()
                try:
                    await self.round(trigger)
                except Exception:
                    log_event(log, "netwatch_round_failed", logging.ERROR, exc_info=True)
                trigger = DriftTrigger.timer
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)  # the timer, or an event first
                    trigger = DriftTrigger.netlink
                    # let a burst of events (one nft transaction) settle, and bound the rate of rounds
                    await asyncio.sleep(max(self.debounce_s, self.min_gap_s - (loop.time() - started)))
                self._wake.clear()
        finally:
            for sock in sockets:
                loop.remove_reader(sock.fileno())
                sock.close()


def serialized(fn: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
    """``fn`` with one run at a time: the reconcile timer and the watch's repair share it."""
    lock = asyncio.Lock()

    async def run() -> object:
        async with lock:
            return await fn()

    return run


def start_netwatch(config: AgentConfig, reporter: Reporter, nc: Client, node_id: str, isolation: Probe | None,
                   repair: Callable[[], Awaitable[object]] | None = None, *, threads: CheckThreads) -> asyncio.Task[None]:
    """The daemon's hook: the watch as a background task publishing on the node's drift subject."""
    watch = NetWatch(HealthSettings.from_config(config), reporter, interval_s=config.netwatch_interval_s,
                     node_id=node_id, isolation=isolation, publish=nc.publish, subject=subjects.drift(node_id),
                     repair=repair, threads=threads)
    return asyncio.create_task(watch.run(), name="netwatch")
