"""The host-side half of slice isolation: one nftables table the agent owns, filtering what guests may send the host.

Why a second layer beside the port flows: a guest's tap is also a network device of
the host kernel. With the userspace (netdev) datapath the kernel receives every frame
the guest sends on its tap beside OVS (and answers its ARP for the gateway address
there, arp_ignore=0), so a guest can reach the host's listening services without ever
crossing the bridge's rules. And traffic that does cross them reaches the gateway
address, where every service of the host listens too. So the host kernel filters
input from the slices itself.

The tables (``inet gpuaas_slice_guard`` and ``arp gpuaas_slice_guard``, each with its own
``guest_ports`` set holding the same names; the agent touches no other table)::

    set guest_ports { type ifname }           # the vNIC names of the guest ports
    chain input   { type filter hook input priority filter - 5; policy accept;
        iifname @guest_ports jump guest_input                  # straight off a guest tap
        iifname != "lo" ip saddr <subnet> jump guest_input     # from the slices, via the bridge
    }
    chain forward { type filter hook forward priority filter - 5; policy accept;
        iifname @guest_ports drop                              # routing must come via the bridge's port
        ip saddr <subnet> ip daddr <subnet> drop               # guest -> guest hairpinned by the host
    }
    chain guest_input {
        ct state established,related accept                    # answers to the host's own connections (SSH)
        meta nfproto ipv4 udp dport 67 accept                  # DHCP
        ip daddr <gateway> udp dport 53 accept                 # DNS on the gateway
        ip daddr <gateway> tcp dport 53 accept
        drop                                                   # every other service of the host, any address
    }
    set exporter_guests { type ipv4_addr }     # guests whose allocation asked for guest telemetry
    chain output  { type filter hook output priority filter - 5; policy accept;
        oifname != "lo" ip daddr <subnet> jump host_output     # the host's own packets towards the slices
    }
    chain host_output {
        ct state established,related accept                    # answers to what a guest may open (DHCP, DNS), and
                                                               # ICMP errors about a guest's own flows (related)
        udp sport 67 udp dport 68 accept                       # DHCP offers and acks
        tcp dport <agent port> accept                          # SSH: readiness's banner, the terminal relay
        ip daddr @exporter_guests tcp dport <exporter> accept  # guest telemetry, opted-in guests only
        drop                                                   # any other port of any guest
    }
    # table arp gpuaas_slice_guard
    chain input   { type filter hook input priority filter; policy accept;
        iifname @guest_ports drop     # the host never answers ARP on a guest tap (only through the bridge)
    }

Without the ARP chain a guest asking for the gateway gets two answers, the bridge's and
one from the host kernel on its tap (arp_ignore=0 answers for any local address on any
interface); a guest that picked the tap's MAC would send its traffic past the port
flows, straight into the host stack.

The NAT uplink is the forward path and stays open; input to *any* host address from
the slices is filtered (the gateway's and the host's others alike). The other way, the
host's own connections into a guest are narrowed to exactly what the agent uses: SSH
on the agent ports, and the exporter port towards the guests whose allocation opted in
to guest telemetry (their IP in ``exporter_guests``, added with the port and removed
with it; the element's comment names the port). The SYN of any other connection is
dropped before it leaves the host (the agent never tries one: it pulls opted-in guests
only, within the pull's time bound). ICMP echo from the host is dropped too: nothing the
agent does needs it (readiness is the DHCP lease and the SSH banner, the terminal is SSH,
guest telemetry is TCP; dnsmasq pings only an address it would hand out dynamically, never
a ``dhcp-host`` reservation, which is all a slice gets), and every packet the host may send
a guest is one more thing a guest sees of it. ICMP errors the host sends about a guest's own
flows (fragmentation needed, unreachable on its NAT'd traffic) are ``related`` and pass. IPv6 needs no output
rule: the port flows drop every IPv6 frame a guest sends, so no IPv6 exchange with a
guest can complete. Base chains of
other tables see the same packets: an ``accept`` elsewhere cannot undo our ``drop``.

Writes go through ``nft -j -f -`` (JSON, one transaction each): adding a port is
add-if-missing of table, set and chains, a flush and re-add of the chains' rules, and
the port's set element, atomically, so concurrent plugs of two slots both land and
the rules are always the spec's. :meth:`NftGuard.replace` swaps the whole table
(``add; delete; define``) for repair. Reads use ``nft -j list``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from ipaddress import IPv4Address
from typing import Any, cast

from gpuaas_agent.contract.isolation import EXPORTER_SET, GUARD_SET, GuardSpec, GuardState
from gpuaas_agent.contract.ovs import IFNAME_PATTERN
from gpuaas_agent.errors import ContractError, HostError
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

FAMILY = "inet"
ARP_FAMILY = "arp"
FAMILIES = (FAMILY, ARP_FAMILY)
PRIORITY = -5  # "filter - 5": before the usual filter chains, not that order matters for a drop
GUEST_CHAIN = "guest_input"
HOST_CHAIN = "host_output"
DHCP_PORT, DHCP_CLIENT_PORT, DNS_PORT = 67, 68, 53
Runner = Callable[..., Awaitable[Completed]]
_IFNAME = re.compile(IFNAME_PATTERN)


class NftGuardInputError(ContractError):
    default_code = "nft_guard_invalid_input"


def _check_ifname(name: Any) -> str:
    if not isinstance(name, str) or not _IFNAME.fullmatch(name):
        raise NftGuardInputError(f"ifname={name!r}: not an interface name", evidence={"ifname": name})
    return name


# -- pure core: the table as nft JSON -----------------------------------------------------------------


def _eq(left: dict[str, Any], right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def _payload(protocol: str, field: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


def expected_chains(spec: GuardSpec) -> dict[str, dict[str, Any]]:
    """Chain name -> its properties (hook, prio, policy; none for a regular chain) and rules (expr lists, in order).

    Written in the exact form ``nft -j list`` prints back, so a readback compares equal.
    """
    subnet = {"prefix": {"addr": str(spec.subnet.network_address), "len": spec.subnet.prefixlen}}
    gateway = str(spec.gateway)
    ipv4 = _eq(_meta("nfproto"), "ipv4")
    base = {"type": "filter", "prio": PRIORITY, "policy": "accept"}
    return {
        "input": {"props": {**base, "hook": "input"}, "rules": [
            [_eq(_meta("iifname"), f"@{GUARD_SET}"), {"jump": {"target": GUEST_CHAIN}}],
            [_eq(_meta("iifname"), "lo", "!="), _eq(_payload("ip", "saddr"), subnet),
             {"jump": {"target": GUEST_CHAIN}}],
        ]},
        "forward": {"props": {**base, "hook": "forward"}, "rules": [
            [_eq(_meta("iifname"), f"@{GUARD_SET}"), {"drop": None}],
            [_eq(_payload("ip", "saddr"), subnet), _eq(_payload("ip", "daddr"), subnet), {"drop": None}],
        ]},
        GUEST_CHAIN: {"props": {}, "rules": [
            [_eq({"ct": {"key": "state"}}, ["established", "related"], "in"), {"accept": None}],
            [ipv4, _eq(_payload("udp", "dport"), DHCP_PORT), {"accept": None}],
            # "ip daddr" implies IPv4: nft drops a "meta nfproto ipv4" written before it.
            [_eq(_payload("ip", "daddr"), gateway), _eq(_payload("udp", "dport"), DNS_PORT), {"accept": None}],
            [_eq(_payload("ip", "daddr"), gateway), _eq(_payload("tcp", "dport"), DNS_PORT), {"accept": None}],
            [{"drop": None}],
        ]},
        "output": {"props": {**base, "hook": "output"}, "rules": [
            [_eq(_meta("oifname"), "lo", "!="), _eq(_payload("ip", "daddr"), subnet),
             {"jump": {"target": HOST_CHAIN}}],
        ]},
        HOST_CHAIN: {"props": {}, "rules": host_output_rules(spec)},
    }


def host_output_rules(spec: GuardSpec) -> list[list[Any]]:
    """What the host itself may open into a guest: SSH, and the exporter of an opted-in guest; nothing else."""
    rules: list[list[Any]] = [
        [_eq({"ct": {"key": "state"}}, ["established", "related"], "in"), {"accept": None}],
        [_eq(_payload("udp", "sport"), DHCP_PORT), _eq(_payload("udp", "dport"), DHCP_CLIENT_PORT), {"accept": None}],
    ]
    rules += [[_eq(_payload("tcp", "dport"), port), {"accept": None}] for port in spec.agent_ports]
    if spec.exporter_port is not None:
        rules.append([_eq(_payload("ip", "daddr"), f"@{EXPORTER_SET}"),
                      _eq(_payload("tcp", "dport"), spec.exporter_port), {"accept": None}])
    rules.append([{"drop": None}])
    return rules


def expected_arp_chains() -> dict[str, dict[str, Any]]:
    return {"input": {"props": {"type": "filter", "hook": "input", "prio": 0, "policy": "accept"}, "rules": [
        [_eq(_meta("iifname"), f"@{GUARD_SET}"), {"drop": None}],
    ]}}


def expected_tables(spec: GuardSpec) -> dict[str, dict[str, dict[str, Any]]]:
    """Family -> chain name -> props and rules."""
    return {FAMILY: expected_chains(spec), ARP_FAMILY: expected_arp_chains()}


Exporters = Mapping[str, IPv4Address]  # port name -> the guest IP whose exporter the host may open


def _check_exporters(exporters: Exporters) -> list[dict[str, Any]]:
    """The exporter set's elements: the guest's IP, commented with its port's name (validated both)."""
    elems = []
    for name, ip in sorted(exporters.items()):
        if not isinstance(ip, IPv4Address):
            raise NftGuardInputError(f"exporter {ip!r} of {name}: not an IPv4 address", evidence={"ip": str(ip)})
        elems.append({"elem": {"val": str(ip), "comment": _check_ifname(name)}})
    return elems


def _ensure_commands(spec: GuardSpec, ifnames: Iterable[str], exporters: Exporters) -> list[dict[str, Any]]:
    """Add-if-missing tables, sets and chains; flush and re-add every rule; add the elements (both families)."""
    names = sorted({_check_ifname(n) for n in ifnames})
    opened = _check_exporters(exporters)
    cmds: list[dict[str, Any]] = []
    for family, chains in expected_tables(spec).items():
        t = {"family": family, "table": spec.table}
        cmds += [{"add": {"table": {"family": family, "name": spec.table}}},
                 {"add": {"set": {**t, "name": GUARD_SET, "type": "ifname"}}}]
        if family == FAMILY:  # before the chains: a rule names it
            cmds.append({"add": {"set": {**t, "name": EXPORTER_SET, "type": "ipv4_addr"}}})
        cmds += [{"add": {"chain": {**t, "name": name, **chain["props"]}}} for name, chain in chains.items()]
        for name, chain in chains.items():
            cmds.append({"flush": {"chain": {**t, "name": name}}})
            cmds += [{"add": {"rule": {**t, "chain": name, "expr": expr}}} for expr in chain["rules"]]
        if names:
            cmds.append({"add": {"element": {**t, "name": GUARD_SET, "elem": names}}})
        if family == FAMILY and opened:
            cmds.append({"add": {"element": {**t, "name": EXPORTER_SET, "elem": opened}}})
    return cmds


def ensure_document(spec: GuardSpec, ifnames: Iterable[str], exporters: Exporters | None = None) -> dict[str, Any]:
    return {"nftables": _ensure_commands(spec, ifnames, exporters or {})}


def replace_document(spec: GuardSpec, ifnames: Iterable[str], exporters: Exporters | None = None) -> dict[str, Any]:
    """Both tables swapped in one transaction (``add`` first so ``delete`` cannot fail on a missing one)."""
    cmds: list[dict[str, Any]] = []
    for family in FAMILIES:
        table = {"table": {"family": family, "name": spec.table}}
        cmds += [{"add": table}, {"delete": table}]
    return {"nftables": [*cmds, *_ensure_commands(spec, ifnames, exporters or {})]}


def remove_document(spec: GuardSpec, ifname: str, families: Iterable[str]) -> dict[str, Any]:
    return {"nftables": [{"delete": {"element": {"family": f, "table": spec.table, "name": GUARD_SET,
                                                 "elem": [ifname]}}} for f in families]}


def close_exporters_document(spec: GuardSpec, ips: Iterable[str]) -> dict[str, Any]:
    """Delete exporter elements by IP (the caller read which are there)."""
    return {"nftables": [{"delete": {"element": {"family": FAMILY, "table": spec.table, "name": EXPORTER_SET,
                                                 "elem": sorted(ips)}}}]}


def _parse_family(family: str, expected: dict[str, dict[str, Any]],
                  listing: dict[str, Any]) -> tuple[list[str], list[str], dict[str, str]]:
    """(differences, set elements, exporter IP -> port) of one family's table listing."""
    chains: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[Any]] = {}
    sets: dict[str, dict[str, Any]] = {}
    for item in listing.get("nftables", []):
        if "chain" in item:
            c = item["chain"]
            chains[c["name"]] = {k: c[k] for k in ("type", "hook", "prio", "policy") if k in c}
        elif "rule" in item:
            r = item["rule"]
            rules.setdefault(r["chain"], []).append(r["expr"])
        elif "set" in item:
            sets[item["set"]["name"]] = item["set"]
    differences = []
    for name in sorted(set(expected) | set(chains)):
        where = f"{family} chain {name}"
        if name not in expected:
            differences.append(f"{where} is not ours")
        elif name not in chains:
            differences.append(f"{where} missing")
        elif chains[name] != expected[name]["props"]:
            differences.append(f"{where} is {chains[name]}, not {expected[name]['props']}")
        elif rules.get(name, []) != expected[name]["rules"]:
            differences.append(f"{where} rules differ")
    guest_set = sets.get(GUARD_SET)
    elements: list[str] = []
    if guest_set is None:
        differences.append(f"{family} set {GUARD_SET} missing")
    else:
        if guest_set.get("type") != "ifname" or guest_set.get("flags"):
            differences.append(f"{family} set {GUARD_SET} is {guest_set.get('type')} {guest_set.get('flags')}")
        elements = sorted(e for e in guest_set.get("elem", []) if isinstance(e, str))
    exporters: dict[str, str] = {}
    ours = {GUARD_SET}
    if family == FAMILY:
        ours.add(EXPORTER_SET)
        exporter_set = sets.get(EXPORTER_SET)
        if exporter_set is None:
            differences.append(f"{family} set {EXPORTER_SET} missing")
        elif exporter_set.get("type") != "ipv4_addr" or exporter_set.get("flags"):
            differences.append(f"{family} set {EXPORTER_SET} is {exporter_set.get('type')} "
                               f"{exporter_set.get('flags')}")
        else:
            exporters = _exporter_elements(exporter_set.get("elem", []))
    differences += [f"{family} set {name} is not ours" for name in sorted(set(sets) - ours)]
    return differences, elements, exporters


def _exporter_elements(elems: list[Any]) -> dict[str, str]:
    """IP -> the port its comment names ("" for an element without one: nobody's, an orphan)."""
    out: dict[str, str] = {}
    for e in elems:
        if isinstance(e, str):
            out[e] = ""
        elif isinstance(e, dict) and isinstance(e.get("elem"), dict) and isinstance(e["elem"].get("val"), str):
            out[e["elem"]["val"]] = str(e["elem"].get("comment", ""))
    return out


def parse_tables(spec: GuardSpec, listings: dict[str, dict[str, Any] | None]) -> GuardState:
    """A :class:`GuardState` from ``nft -j list table`` of each family (None: that table does not exist)."""
    differences: list[str] = []
    elements: dict[str, list[str]] = {}
    exporters: dict[str, str] = {}
    for family, chains in expected_tables(spec).items():
        listing = listings.get(family)
        if listing is None:
            differences.append(f"table {family} {spec.table} absent")
            continue
        found, elements[family], opened = _parse_family(family, chains, listing)
        differences += found
        exporters.update(opened)
    if not elements:
        return GuardState(table=spec.table, present=False, rules_match=False, differences=differences)
    inet, arp = set(elements.get(FAMILY, [])), set(elements.get(ARP_FAMILY, []))
    if FAMILY in elements and ARP_FAMILY in elements and inet != arp:
        differences.append(f"the sets differ: only inet {sorted(inet - arp)}, only arp {sorted(arp - inet)}")
    # A port counts as guarded only when both families hold it.
    both = inet & arp if len(elements) == 2 else set()
    return GuardState(table=spec.table, present=True, rules_match=not differences, differences=differences,
                      guest_ports=sorted(both), elements=elements, exporters=exporters)


# -- the thin shell -------------------------------------------------------------------------------------


class NftGuard:
    """The guard table of one host (one slice subnet)."""

    def __init__(self, spec: GuardSpec, *, timeout_s: float = 10.0, runner: Runner = run) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._run = runner

    async def _apply(self, document: dict[str, Any], what: str) -> None:
        await self._run(["nft", "-j", "-f", "-"], timeout=self.timeout_s, stdin=json.dumps(document).encode())
        log_event(log, "nft_guard_applied", table=self.spec.table, what=what)

    async def read(self) -> GuardState:
        tables = await self._run(["nft", "-j", "list", "tables"], timeout=self.timeout_s)
        present = {i["table"]["family"] for i in _json(tables).get("nftables", [])
                   if "table" in i and i["table"].get("name") == self.spec.table}
        listings: dict[str, dict[str, Any] | None] = {}
        for family in FAMILIES:
            listings[family] = None
            if family in present:
                done = await self._run(["nft", "-j", "list", "table", family, self.spec.table], timeout=self.timeout_s)
                listings[family] = _json(done)
        return parse_tables(self.spec, listings)

    async def add_port(self, ifname: str, *, exporter: IPv4Address | None = None) -> GuardState:
        """Put the guest port in the guard (creating or correcting the table's rules); idempotent.

        ``exporter``: the guest's IP when its allocation opted in to guest telemetry (the host may then
        open its exporter port); None closes any opening this port had. An opening the port had for
        another IP is closed.

        A table whose set or chains cannot be corrected in place (a set of another type, a
        chain on another hook) is swapped whole, keeping the elements it had.
        """
        _check_ifname(ifname)
        opened = {ifname: exporter} if exporter is not None else {}
        try:
            await self._apply(ensure_document(self.spec, [ifname], opened), f"add {ifname}")
        except HostError as exc:
            if exc.code != "command_failed":
                raise
            state = await self.read()
            log_event(log, "nft_guard_replaced", logging.WARNING, table=self.spec.table, ifname=ifname,
                      differences=state.differences, error=exc.evidence.get("stderr"))
            keep = sorted({n for names in state.elements.values() for n in names} | {ifname})
            kept = {port: IPv4Address(ip) for ip, port in state.exporters.items() if port and port != ifname}
            await self._apply(replace_document(self.spec, keep, {**kept, **opened}), f"replace for {ifname}")
        state = await self.read()
        stale = [ip for ip, port in state.exporters.items()
                 if port == ifname and (exporter is None or ip != str(exporter))]
        if stale:
            await self._apply(close_exporters_document(self.spec, stale), f"close {ifname}'s exporter")
            state = await self.read()
        return state

    async def remove_port(self, ifname: str) -> bool:
        """Take the guest port out of both sets and close its exporter opening; False when nothing held it."""
        _check_ifname(ifname)
        state = await self.read()
        holding = [f for f, names in state.elements.items() if ifname in names]
        opened = [ip for ip, port in state.exporters.items() if port == ifname]
        if not holding and not opened:
            return False
        try:
            if opened:
                await self._apply(close_exporters_document(self.spec, opened), f"close {ifname}'s exporter")
            if holding:
                await self._apply(remove_document(self.spec, ifname, holding), f"remove {ifname}")
        except HostError:
            after = await self.read()
            if any(ifname in names for names in after.elements.values()) or ifname in after.exporters.values():
                raise  # not a lost race with another remove: a real failure
            return False
        return True

    async def replace(self, ifnames: Iterable[str], exporters: Exporters | None = None) -> GuardState:
        """Swap in the whole table with exactly ``ifnames`` in its set and ``exporters`` opened (repair)."""
        names = sorted({_check_ifname(n) for n in ifnames})
        await self._apply(replace_document(self.spec, names, exporters), f"replace with {len(names)} ports")
        return await self.read()

    async def close_exporters(self, ips: Iterable[str]) -> GuardState:
        """Close the exporter openings of these guest IPs (reconcile's repair of an opening nobody granted)."""
        wanted = sorted(set(ips))
        present = [ip for ip in wanted if ip in (await self.read()).exporters]
        if present:
            await self._apply(close_exporters_document(self.spec, present), f"close {len(present)} exporters")
        return await self.read()


def _json(done: Completed) -> dict[str, Any]:
    try:
        return cast("dict[str, Any]", json.loads(done.stdout or b"{}"))
    except json.JSONDecodeError as exc:
        raise HostError("nft -j printed something that is not JSON", code="nft_output_unparsable",
                        evidence={"argv": list(done.argv), "stdout": done.stdout[:2000].decode("utf-8", "replace")}) \
            from exc
