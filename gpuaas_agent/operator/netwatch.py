"""The slice network, re-proven while slices run: a short timer and netlink events drive its checks.

Why: readiness proved the network once. The seed 004 incident (the NAT ``MASQUERADE``
rule gone, guests without egress) stayed invisible until a user complained, and the
full health round (``operator/health.py``) runs only every ``health_interval_s``
(60 s). This watch re-runs the slice network's checks, the same functions as the
health round (``slice_gateway``, ``slice_nat``, ``slice_ip_forward``, ``dnsmasq``) plus
``port_isolation`` (the flows and nft guard of every active port):

- every ``netwatch_interval_s`` (≤ 15 s): what no event announces (a dnsmasq that
  died, OpenFlow rules of a restarted vswitchd);
- at once (debounced) on a netlink event about something a check reads: links (``RTNLGRP_LINK``),
  and where the slice network is read live in this namespace its IPv4 addresses and forwarding
  (``_IPV4_IFADDR``, ``_IPV4_NETCONF``: ``ip_forward`` changes are announced there), and nftables
  changes (``NFNLGRP_NFTABLES`` on a ``NETLINK_NETFILTER`` socket: iptables is iptables-nft, so
  deleting the ``MASQUERADE`` rule is an nftables event). No check reads routes: no route group.

Which events wake a round (:class:`Interest`, :class:`EventFilter`) is derived each round from what
the checks read: the OVS bridge and ``tmfifo_net0`` with their addresses, ``ip_forward`` and the
table of the NAT rule when the network is read live; the bridge, the vNIC of every slot the store
leases or records, the PFs of the fabric VFs the store records (a VF setting is announced as its PF's
``RTM_NEWLINK``) and the agent's nft guard table with the ``port_isolation`` probe. A link
is matched by name or by the ifindex it had; a message that names nothing (a link without
``IFLA_IFNAME``, an nftables object without its table, a type not known here, a lost or truncated
message) wakes a round, as does everything when the interest could not be derived. On a shared host,
other work's links, routes and tables (seen: 7-22 extra rounds in 73 s on the dev VM) then cost a parse
each, not a round (docs/performance.md).

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
import errno
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
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
from gpuaas_agent.contract.isolation import GUARD_TABLE
from gpuaas_agent.contract.naming import vnic_name
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.discovery.netevidence import TMFIFO
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.logs import log_event
from gpuaas_agent.operator.health import (
    CHECK_TIMEOUT_S,
    CheckThreads,
    HealthSettings,
    dnsmasq_check,
    guarded_check,
    network_checks,
)
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.fabricvf import recorded_pf_netdevs

if TYPE_CHECKING:  # the reporter is the daemon's; the watch only merges checks into it
    from gpuaas_agent.operator.reporter import Reporter

log = logging.getLogger(__name__)

SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NETLINK_NETFILTER = 12
NFNLGRP_NFTABLES = 7
RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV4_NETCONF = 1, 5, 24
ROUTE_GROUPS = (RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV4_NETCONF)
# The messages the filter reads (linux/rtnetlink.h, if_link.h, if_addr.h, netconf.h, nf_tables.h).
NLMSG_HDRLEN = 16
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR, RTM_DELADDR, RTM_NEWNETCONF, RTM_DELNETCONF = 16, 17, 20, 21, 80, 81
IFLA_IFNAME, IFA_LABEL, NETCONFA_IFINDEX = 3, 3, 1
NETCONFA_IFINDEX_ALL = -1  # "all": what net.ipv4.ip_forward sets and announces
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWGEN = 15  # a transaction's trailer (its generation): each object it changed came as its own message
NFTA_TABLE = 1  # attribute 1 of every nf_tables object message is its table's name (table, chain, rule, set...)
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
MAX_REASONS = 8  # a round keeps at most this many of the events that woke it
IPTABLES_C = "(iptables -C)"  # how slice_nat's ok detail ends when iptables-nft's ``nat`` table proved the rule
WATCHED = ("slice_gateway", "slice_nat", "slice_ip_forward", "dnsmasq", "port_isolation")
_BAD = ("degraded", "failed")

Probe = Callable[[], Awaitable[list[HealthCheck]]]


def open_netlink_sockets(route_groups: tuple[int, ...] = ROUTE_GROUPS) -> list[socket.socket]:
    """Non-blocking netlink sockets subscribed to ``route_groups`` (rtnetlink) and to nftables, in that order."""
    made: list[socket.socket] = []
    for proto, groups in ((socket.NETLINK_ROUTE, route_groups), (NETLINK_NETFILTER, (NFNLGRP_NFTABLES,))):
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


@dataclass(frozen=True)
class Interest:
    """What the watched checks read that netlink announces: an event about anything else wakes no round.

    ``None`` for ``links`` or ``nft_tables``: every link, every table (what could not be narrowed)."""

    links: frozenset[str] | None = frozenset()  # by name, and by the ifindex each had when last seen
    addresses_of: frozenset[str] | None = frozenset()  # links whose IPv4 addresses a check reads
    ip_forward: bool = False  # net.ipv4.ip_forward ("all" forwarding)
    nft_tables: frozenset[str] | None = frozenset()


EVERYTHING = Interest(links=None, addresses_of=None, ip_forward=True, nft_tables=None)


def _messages(data: bytes) -> Iterator[tuple[int | None, bytes]]:
    """(type, payload) of each netlink message in one datagram; (None, b"") for a truncated one."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < NLMSG_HDRLEN:
            yield None, b""
            return
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < NLMSG_HDRLEN or offset + length > len(data):
            yield None, b""
            return
        yield kind, data[offset + NLMSG_HDRLEN:offset + length]
        offset += (length + 3) & ~3


def _attrs(payload: bytes, start: int) -> dict[int, bytes]:
    """The top-level attributes after a message's fixed header (the first of each type)."""
    out: dict[int, bytes] = {}
    offset = start
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if length < 4 or offset + length > len(payload):
            break
        out.setdefault(kind & NLA_TYPE_MASK, payload[offset + 4:offset + length])
        offset += (length + 3) & ~3
    return out


def _name(value: bytes | None) -> str | None:
    return None if value is None else value.split(b"\0", 1)[0].decode("utf-8", "replace")


class EventFilter:
    """Which netlink messages wake a round, for the current :class:`Interest` (see the module docstring).

    Each method returns why a datagram wakes the watch (for the round's log) or None; ``ignored`` counts
    the messages that woke nothing."""

    def __init__(self, interest: Interest = EVERYTHING) -> None:
        self.interest = interest
        self.indexes: set[int] = set()  # ifindexes of watched links (a rename or a deletion keeps its index)
        self.address_indexes: set[int] = set()
        self.ignored = 0

    def refresh(self, interest: Interest) -> None:
        """A new interest; the ifindexes of its named links as they are now in this namespace."""
        self.interest = interest
        self.indexes = {i for i in map(_ifindex, interest.links or ()) if i is not None}
        self.address_indexes = {i for i in map(_ifindex, interest.addresses_of or ()) if i is not None}

    def route(self, data: bytes) -> str | None:
        reasons = [self._route_message(kind, payload) for kind, payload in _messages(data)]
        return self._verdict(reasons)

    def netfilter(self, data: bytes) -> str | None:
        reasons = [self._nft_message(kind, payload) for kind, payload in _messages(data)]
        return self._verdict(reasons)

    def _verdict(self, reasons: list[str | None]) -> str | None:
        self.ignored += reasons.count(None)
        return next((r for r in reasons if r is not None), None)

    def _route_message(self, kind: int | None, payload: bytes) -> str | None:
        interest = self.interest
        if kind in (RTM_NEWLINK, RTM_DELLINK) and len(payload) >= 16:
            index = struct.unpack_from("=i", payload, 4)[0]
            name = _name(_attrs(payload, 16).get(IFLA_IFNAME))
            if name is None:
                return f"link #{index} without a name"
            if interest.links is None or name in interest.links:
                self.indexes.add(index)
                return f"link {name}"
            if index in self.indexes:
                return f"link {name} (#{index}, watched as another name)"
            return None
        if kind in (RTM_NEWADDR, RTM_DELADDR) and len(payload) >= 8:
            index = struct.unpack_from("=I", payload, 4)[0]
            label = _name(_attrs(payload, 8).get(IFA_LABEL))
            watched = interest.addresses_of
            if watched is None or index in self.address_indexes or (label or "").partition(":")[0] in watched:
                return f"address on {label or f'#{index}'}"
            return None
        if kind in (RTM_NEWNETCONF, RTM_DELNETCONF) and len(payload) >= 1:
            raw = _attrs(payload, 4).get(NETCONFA_IFINDEX)
            if not interest.ip_forward:
                return None
            if raw is None or len(raw) < 4:
                return "netconf without an ifindex"
            return "ip_forward" if struct.unpack_from("=i", raw)[0] == NETCONFA_IFINDEX_ALL else None
        return f"rtnetlink message type {kind}"  # a type not read here, or truncated: cannot tell, look again

    def _nft_message(self, kind: int | None, payload: bytes) -> str | None:
        if kind is None or kind >> 8 != NFNL_SUBSYS_NFTABLES or len(payload) < 4:
            return f"netfilter message type {kind}"
        if kind & 0xFF == NFT_MSG_NEWGEN:
            return None
        table = _name(_attrs(payload, 4).get(NFTA_TABLE))
        if table is None:
            return f"nftables message {kind & 0xFF} without a table"
        tables = self.interest.nft_tables
        return f"nft table {table}" if tables is None or table in tables else None


def isolation_links(store: StateStore) -> frozenset[str]:
    """On the store thread: the links the isolation probe reads of the store's slots, i.e. the vNIC (tap and OVS
    port) of every lease and slot record, as the reconcile knows them, and the PF of every recorded fabric VF."""
    slots = {(lease.allocation_id, lease.slot_index) for lease in store.leases()} | {
        (record.allocation_id, record.slot_index) for record in store.slot_states()}
    return frozenset(vnic_name(allocation, slot) for allocation, slot in slots) | recorded_pf_netdevs(store)


def _ifindex(name: str) -> int | None:
    try:
        return socket.if_nametoindex(name)
    except OSError:  # not there now: its creation names it
        return None


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
                 repair: Callable[[], Awaitable[object]] | None = None, threads: CheckThreads,
                 store: StoreThread | None = None) -> None:
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
        # Where the recorded fabric VFs are (their PFs' links wake a round); None: every link does.
        self.store = store
        # The network checks read this namespace's links, addresses, ip_forward and NAT (not a recording).
        self.network_live = settings.netns is None and HostRoot(Path(settings.network_root or settings.host_root).resolve()).is_live
        self.filter = EventFilter()  # everything wakes until the first round has said what the checks read
        self.nat: HealthCheck | None = None  # the last round's slice_nat: which table proved the rule
        self.woken_by: list[str] = []  # why the last round ran early (the events' objects), for its log and tests
        self._reasons: list[str] = []
        self._wake = asyncio.Event()

    @property
    def route_groups(self) -> tuple[int, ...]:
        """The rtnetlink groups worth a subscription: links, and addresses and forwarding where the network checks
        read them (not over a recording: there only the isolation probe reads live links)."""
        return ROUTE_GROUPS if self.network_live else (RTNLGRP_LINK,)

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
        self.nat = fresh.get("slice_nat")
        await self._refresh_interest()  # before the round counts: an event after it is judged by this round's reading
        self.rounds += 1
        self.last_round_at = datetime.now(UTC)
        if findings:
            log_event(log, "slice_network_changed", logging.WARNING if now_failing else logging.INFO,
                      trigger=trigger.value, woken_by=self.woken_by, failing={n: c.detail for n, c in now_failing.items()},
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

    async def interest(self) -> Interest:
        """What this round's checks read that netlink announces (see the module docstring)."""
        bridge = self.settings.ovs_bridge
        links: set[str] = set()
        addresses: set[str] = set()
        tables: set[str] | None = set()
        if self.network_live:
            links |= {bridge, TMFIFO}
            addresses |= {bridge, TMFIFO}
            nat = self.nat
            if nat is not None and nat.status == "ok" and nat.detail.endswith(IPTABLES_C):
                # iptables-nft's table. Any other proof (a native nft rule in some table, none yet, a detail worded
                # otherwise): every table, the safe side.
                tables = {"nat"}
            else:
                tables = None
        if self.isolation is not None:
            links.add(bridge)
            if tables is not None:
                tables.add(GUARD_TABLE)
            if self.store is None:  # the slots' vNICs and the fabric VFs' PFs cannot be named: every link
                return Interest(links=None, addresses_of=frozenset(addresses), ip_forward=self.network_live,
                                nft_tables=None if tables is None else frozenset(tables))
            links |= await self.store.run(isolation_links)  # one hop to the store thread a round
        return Interest(links=frozenset(links), addresses_of=frozenset(addresses), ip_forward=self.network_live,
                        nft_tables=None if tables is None else frozenset(tables))

    async def _refresh_interest(self) -> None:
        try:
            interest = await asyncio.wait_for(self.interest(), CHECK_TIMEOUT_S)
        except Exception as exc:  # cannot tell what the checks read: every event wakes a round
            log_event(log, "netwatch_interest_unknown", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
            interest = EVERYTHING
        self.filter.refresh(interest)  # a few if_nametoindex ioctls, in the loop's namespace (the sockets' one)

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

    def _readable(self, sock: socket.socket, judge: Callable[[bytes], str | None]) -> None:
        """Drain the socket; wake a round if any message concerns what the checks read (``judge``)."""
        reasons = []
        try:
            while data := sock.recv(1 << 16):
                reason = judge(data)
                if reason is not None:
                    reasons.append(reason)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:  # ENOBUFS: the kernel dropped messages we never saw; look again
            reasons.append(f"netlink messages lost ({errno.errorcode.get(exc.errno or 0, exc.errno)})")
        if reasons:
            self._reasons.extend(reasons[:MAX_REASONS - len(self._reasons)])
            self._wake.set()

    async def run(self) -> None:
        """Rounds on the timer and on netlink events until cancelled."""
        loop = asyncio.get_running_loop()
        sockets: list[socket.socket] = []
        if self.settings.netns is None and (self.network_live or self.isolation is not None):
            try:
                sockets = open_netlink_sockets(self.route_groups)
            except OSError as exc:
                log_event(log, "netwatch_netlink_unavailable", logging.WARNING, error=str(exc))
        for sock, judge in zip(sockets, (self.filter.route, self.filter.netfilter), strict=False):
            loop.add_reader(sock.fileno(), self._readable, sock, judge)
        log_event(log, "netwatch_started", interval_s=self.interval_s, netlink=bool(sockets),
                  checks=list(WATCHED if self.isolation else WATCHED[:-1]))
        trigger = DriftTrigger.timer
        try:
            while True:
                started = loop.time()
                self.woken_by, self._reasons = self._reasons, []
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
                   repair: Callable[[], Awaitable[object]] | None = None, *, threads: CheckThreads,
                   store: StoreThread | None = None) -> asyncio.Task[None]:
    """The daemon's hook: the watch as a background task publishing on the node's drift subject."""
    watch = NetWatch(HealthSettings.from_config(config), reporter, interval_s=config.netwatch_interval_s,
                     node_id=node_id, isolation=isolation, publish=nc.publish, subject=subjects.drift(node_id),
                     repair=repair, threads=threads, store=store)
    return asyncio.create_task(watch.run(), name="netwatch")
