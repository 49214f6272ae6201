"""The OpenFlow rules that pin a guest port to its reserved MAC/IP and to the gateway, installed and read back per port.

Why: with OVS's default ``NORMAL`` switching a tenant can take another slice's IP or
MAC, answer ARP for the gateway and talk to the other tenant's VM directly (docs/safety.md
§9). Like Neutron's port-security flows, every guest port gets its own rules,
keyed by its ``in_port`` and its reserved MAC/IP, and marked with the port's cookie
(``contract/isolation.py``: derived from allocation and slot like the vNIC name).

Table layout (table 0 only; OVS's own ``priority=0 actions=NORMAL`` stays the default,
so the bridge's LOCAL port, where the gateway and dnsmasq live, and any uplink or
foreign port keep normal switching). Per guest port P (ofport p, MAC M, IP I),
all with cookie C(P):

====  ===========================================================  ==============
prio  match                                                        actions
====  ===========================================================  ==============
120   in_port=p, udp, tp_src=67   (a guest acting as DHCP server)  drop
120   in_port=p, ipv6             (RA, ND, any IPv6: not offered)  drop
110   in_port=p, arp, dl_src=M, arp_spa=I, arp_sha=M               LOCAL
110   in_port=p, ip, dl_src=M, nw_src=I                            LOCAL
110   in_port=p, udp, dl_src=M, nw_src=0.0.0.0, tp_src=68,         LOCAL
      tp_dst=67                   (DHCP discover/request)
100   in_port=p                   (any other MAC, IP, ethertype)   drop
 90   in_port=LOCAL, dl_dst=M                                      output:p
 90   in_port=LOCAL, arp, dl_dst=ff:ff:ff:ff:ff:ff, arp_tpa=I       output:p
 80   dl_dst=M                    (to the guest from anywhere else) drop
 70   dl_src=M                    (its MAC on any other port)       drop
====  ===========================================================  ==============

So a guest's frames go to LOCAL only, never ``NORMAL`` (no flooding to, no learning
towards, other guests: guest→guest is dropped on the bridge and the host kernel drops
frames not addressed to it); unicast towards a guest comes only from LOCAL and goes
straight to its port (no unknown-unicast flooding of one tenant's traffic to the
other). Broadcasts from LOCAL still flood by ``NORMAL`` (a DHCP offer with the
broadcast flag, ARP requests for other guests): they carry nothing a tenant sends.

Before vswitchd has opened the port (``ofport`` unknown: libvirt makes the tap at
domain start), only the 80 and 70 rules are installed: the MAC is closed from plug
time until the in_port rules arrive.

Install is one OpenFlow bundle (``ovs-ofctl --bundle``: delete the cookie's flows and
add the new set atomically), so a re-install after libvirt re-created the port with
another ofport never leaves the port open or half-filtered. Remove deletes by
``cookie=C/-1``: nobody else's flows are touched. A MAC, IP or ofport already claimed
by another port's flows is refused before anything is written.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuaas_agent.contract.isolation import (
    COOKIE_ALL_MASK,
    COOKIE_TAG,
    COOKIE_TAG_MASK,
    COOKIE_TAG_SHIFT,
    FlowComparison,
    FlowRule,
    FlowState,
    PortIsolation,
    port_name_of_cookie,
)
from gpuaas_agent.contract.ovs import IFNAME_PATTERN
from gpuaas_agent.errors import ContractError, GuardError, HostError
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

GATEWAY_PORT = "LOCAL"  # the bridge's own interface: the gateway address, dnsmasq and the NAT uplink
BROADCAST = "ff:ff:ff:ff:ff:ff"
DHCP_SERVER_PORT, DHCP_CLIENT_PORT = 67, 68
Runner = Callable[..., Awaitable[Completed]]
_IFNAME = re.compile(IFNAME_PATTERN)
# " cookie=0x6773..., duration=.., table=0, n_packets=.., priority=110,arp,in_port=1,... actions=LOCAL"
_DUMP_LINE = re.compile(r"^\s*(?P<head>(?:[a-z_]+=[^,\s]+,\s+)*)(?P<rest>\S.*?)\s+actions=(?P<actions>\S+)\s*$")


class IsolationRefused(GuardError):
    """The port's rules would clash with another port's; nothing was written.

    Codes: ``port_isolation_conflict`` (evidence: the other port, the field and value both claim).
    """

    default_code = "port_isolation_conflict"


class IsolationInputError(ContractError):
    """An argument that cannot describe a guest port (name, ofport, MAC, IP); checked before OVS is asked."""

    default_code = "port_isolation_invalid_input"


def port_isolation(**fields: Any) -> PortIsolation:
    """A :class:`PortIsolation` from untrusted values, or :class:`IsolationInputError` naming what is wrong."""
    try:
        return PortIsolation.from_wire(fields)  # strict models: JSON rules for untrusted str values
    except ValidationError as exc:
        raise IsolationInputError(
            f"cannot isolate port {fields.get('port')!r}: {exc.errors(include_url=False)[0]['msg']}",
            evidence={"input": {k: str(v) for k, v in fields.items()},
                      "errors": exc.errors(include_url=False, include_input=False)},
        ) from None


# -- pure core: the rules a port's reservation implies, and their text forms -------------------------


def _rule(iso: PortIsolation, priority: int, match: Iterable[str], actions: str) -> FlowRule:
    return FlowRule(cookie=iso.cookie, priority=priority, match=tuple(sorted(match)), actions=actions)


def expected_flows(iso: PortIsolation) -> list[FlowRule]:
    """Every rule of the port (see the table in the module docstring), sorted by priority then match."""
    mac, ip = iso.mac, str(iso.ip)
    rules = [
        _rule(iso, 80, [f"dl_dst={mac}"], "drop"),
        _rule(iso, 70, [f"dl_src={mac}"], "drop"),
    ]
    if iso.ofport is not None:
        p = f"in_port={iso.ofport}"
        out = f"output:{iso.ofport}"
        rules += [
            _rule(iso, 120, [p, "udp", f"tp_src={DHCP_SERVER_PORT}"], "drop"),
            _rule(iso, 120, [p, "ipv6"], "drop"),
            _rule(iso, 110, [p, "arp", f"dl_src={mac}", f"arp_spa={ip}", f"arp_sha={mac}"], GATEWAY_PORT),
            _rule(iso, 110, [p, "ip", f"dl_src={mac}", f"nw_src={ip}"], GATEWAY_PORT),
            _rule(iso, 110, [p, "udp", f"dl_src={mac}", "nw_src=0.0.0.0", f"tp_src={DHCP_CLIENT_PORT}",
                             f"tp_dst={DHCP_SERVER_PORT}"], GATEWAY_PORT),
            _rule(iso, 100, [p], "drop"),
            _rule(iso, 90, [f"in_port={GATEWAY_PORT}", f"dl_dst={mac}"], out),
            _rule(iso, 90, [f"in_port={GATEWAY_PORT}", "arp", f"dl_dst={BROADCAST}", f"arp_tpa={ip}"], out),
        ]
    return sorted(rules, key=_sort_key)


def _sort_key(rule: FlowRule) -> tuple[Any, ...]:
    return (rule.cookie, -rule.priority, rule.match, rule.actions)


def flow_mod_line(rule: FlowRule) -> str:
    """One ``add`` line of an ``ovs-ofctl add-flows`` file."""
    return (f"add cookie={rule.cookie:#x},table={rule.table},priority={rule.priority},"
            f"{','.join(_protocol_first(rule.match))},actions={rule.actions}")


def _protocol_first(match: tuple[str, ...]) -> list[str]:
    # ovs-ofctl wants the protocol shorthand (ip, arp, udp...) before fields that need it.
    return sorted(match, key=lambda t: "=" in t)


def parse_dump(text: str) -> list[FlowRule]:
    """Rules from ``ovs-ofctl --no-stats --no-names dump-flows`` output (the reply header line is skipped)."""
    rules = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("NXST_FLOW", "OFPST_FLOW")):
            continue
        m = _DUMP_LINE.match(line)
        if m is None:
            raise HostError(f"cannot parse a flow dumped by ovs-ofctl: {line.strip()!r}", code="flow_dump_unparsable",
                            evidence={"line": line})
        head = dict(part.split("=", 1) for part in re.split(r",\s+", m.group("head").strip().rstrip(",")) if part)
        tokens = m.group("rest").split(",")
        priority = 32768  # OpenFlow's default, which dump-flows leaves out
        match = []
        for token in tokens:
            if token.startswith("priority="):
                priority = int(token.split("=", 1)[1])
            elif token:
                match.append(token)
        rules.append(FlowRule(cookie=int(head.get("cookie", "0"), 16), table=int(head.get("table", "0")),
                              priority=priority, match=tuple(sorted(match)), actions=m.group("actions")))
    return sorted(rules, key=_sort_key)


def compare_flows(iso: PortIsolation, installed: Iterable[FlowRule]) -> FlowComparison:
    """Installed rules under the port's cookie vs. :func:`expected_flows`."""
    expected = expected_flows(iso)
    have = [r for r in installed if r.cookie == iso.cookie]
    missing = [r for r in expected if r not in have]
    extra = [r for r in have if r not in expected]
    if not missing and not extra:
        state = FlowState.ok
    elif len(missing) == len(expected) and not have:
        state = FlowState.missing
    else:
        state = FlowState.altered
    return FlowComparison(port=iso.port, cookie=iso.cookie, state=state, missing=missing, extra=extra)


def claims(rules: Iterable[FlowRule]) -> dict[str, set[str]]:
    """What a port's rules claim: its MACs, IPs and ofports (the values another port may not reuse)."""
    out: dict[str, set[str]] = {"mac": set(), "ip": set(), "ofport": set()}
    for rule in rules:
        for token in rule.match:
            key, _, value = token.partition("=")
            if key in ("dl_src", "dl_dst", "arp_sha") and value != BROADCAST:
                out["mac"].add(value)
            elif key in ("nw_src", "arp_spa", "arp_tpa") and value != "0.0.0.0":
                out["ip"].add(value)
            elif key == "in_port" and value != GATEWAY_PORT:
                out["ofport"].add(value)
    return out


def find_conflict(iso: PortIsolation, others: dict[int, list[FlowRule]]) -> dict[str, Any] | None:
    """The first other cookie whose rules claim this port's MAC, IP or ofport, as evidence; None if free."""
    mine = {"mac": {iso.mac}, "ip": {str(iso.ip)}, "ofport": {str(iso.ofport)} if iso.ofport else set()}
    for cookie, rules in sorted(others.items()):
        if cookie == iso.cookie:
            continue
        theirs = claims(rules)
        for field in ("mac", "ip", "ofport"):
            shared = mine[field] & theirs[field]
            if shared:
                return {"port": iso.port, "other_port": port_name_of_cookie(cookie), "other_cookie": f"{cookie:#x}",
                        "field": field, "value": sorted(shared)[0]}
    return None


def ovs_rundir(ovsdb_remote: str) -> Path:
    """Where vswitchd keeps its ``<bridge>.mgmt`` sockets: beside the ovsdb socket (``OVS_RUNDIR``)."""
    if not ovsdb_remote.startswith("unix:"):
        raise IsolationInputError(
            f"ovsdb remote {ovsdb_remote} is not a unix socket: cannot find vswitchd's OpenFlow socket beside it",
            code="ovs_rundir_unknown", evidence={"ovsdb_remote": ovsdb_remote})
    return Path(ovsdb_remote[len("unix:"):]).parent


# -- the thin shell: ovs-ofctl through host/run.py ---------------------------------------------------


class PortFlows:
    """Per-port rules on bridges of one vswitchd, reached by its ``<rundir>/<bridge>.mgmt`` socket."""

    def __init__(self, rundir: Path, *, timeout_s: float = 10.0, runner: Runner = run) -> None:
        self.rundir = Path(rundir)
        self.timeout_s = timeout_s
        self._run = runner

    def _target(self, bridge: str) -> str:
        if not isinstance(bridge, str) or not _IFNAME.fullmatch(bridge):
            raise IsolationInputError(f"bridge={bridge!r}: not an interface name", evidence={"bridge": bridge})
        return f"unix:{self.rundir}/{bridge}.mgmt"

    async def _ofctl(self, *args: str, stdin: bytes | None = None) -> Completed:
        return await self._run(["ovs-ofctl", f"--timeout={max(1, int(self.timeout_s))}", *args],
                               timeout=self.timeout_s + 5, stdin=stdin)

    async def dump(self, bridge: str, cookie: int | None = None) -> list[FlowRule]:
        """The bridge's rules under ``cookie`` (all of the port's), or under our tag when ``cookie`` is None."""
        spec = f"cookie={cookie:#x}/{COOKIE_ALL_MASK:#x}" if cookie is not None else \
            f"cookie={COOKIE_TAG << COOKIE_TAG_SHIFT:#x}/{COOKIE_TAG_MASK:#x}"
        done = await self._ofctl("--no-stats", "--no-names", "dump-flows", self._target(bridge), spec)
        return parse_dump(done.stdout.decode("utf-8", "replace"))

    async def ours(self, bridge: str) -> dict[int, list[FlowRule]]:
        """Every rule carrying our tag on the bridge, grouped by port cookie."""
        grouped: dict[int, list[FlowRule]] = {}
        for rule in await self.dump(bridge):
            grouped.setdefault(rule.cookie, []).append(rule)
        return grouped

    async def install(self, iso: PortIsolation) -> list[FlowRule]:
        """Make the port's rules exactly :func:`expected_flows` in one bundle; idempotent.

        Raises :class:`IsolationRefused` (nothing written) when another port's rules claim
        this MAC, IP or ofport.
        """
        conflict = find_conflict(iso, await self.ours(iso.bridge))
        if conflict is not None:
            raise IsolationRefused(
                f"port {iso.port} would take {conflict['field']} {conflict['value']} of port {conflict['other_port']}",
                evidence=conflict)
        rules = expected_flows(iso)
        lines = [f"delete cookie={iso.cookie:#x}/{COOKIE_ALL_MASK:#x}", *map(flow_mod_line, rules)]
        await self._ofctl("--bundle", "add-flows", self._target(iso.bridge), "-",
                          stdin=("\n".join(lines) + "\n").encode())
        log_event(log, "port_flows_installed", bridge=iso.bridge, port=iso.port, cookie=f"{iso.cookie:#x}",
                  ofport=iso.ofport, mac=iso.mac, ip=str(iso.ip), rules=len(rules))
        return rules

    async def remove(self, bridge: str, cookie: int) -> list[FlowRule]:
        """Delete exactly the rules under ``cookie`` (one bundle); returns what was there. Idempotent."""
        if not 0 <= cookie <= COOKIE_ALL_MASK or cookie >> COOKIE_TAG_SHIFT != COOKIE_TAG:
            raise IsolationInputError(f"cookie {cookie:#x} does not carry the agent's tag; refusing to delete by it",
                                      evidence={"cookie": cookie})
        present = await self.dump(bridge, cookie)
        if present:
            await self._ofctl("--bundle", "del-flows", self._target(bridge), f"cookie={cookie:#x}/{COOKIE_ALL_MASK:#x}")
            log_event(log, "port_flows_removed", bridge=bridge, port=port_name_of_cookie(cookie),
                      cookie=f"{cookie:#x}", rules=len(present))
        return present

    async def compare(self, iso: PortIsolation) -> FlowComparison:
        return compare_flows(iso, await self.dump(iso.bridge, iso.cookie))

