"""Slice network evidence: bridge, gateway address, NAT, ip_forward, dnsmasq, IPoIB (seed 004, 2026-04-24).

The incident this exists for: ``ovsbr0`` had ``10.100.0.1/24`` and dnsmasq
answered, but the ``POSTROUTING -s 10.100.0.0/24 -j MASQUERADE`` rule was gone,
so guests' traffic left with private source addresses and the host still
looked schedulable. In private-NAT mode a missing NAT rule and a disabled
``ip_forward`` are therefore hard blockers, and anything that could not be
read is a warning, never a pass.

Two sources, one result:

* a recorded fixture: the ``ip -j addr/route/link``, ``iptables-save -t nat``
  and ``nft -j list ruleset`` outputs the recorder keeps under
  ``.gpuaas-fixture/commands/`` plus ``/proc/sys/net/ipv4/ip_forward``;
* the live host (optionally one named network namespace): netlink through
  pyroute2 for links, addresses and routes; ``iptables -t nat -C`` for NAT
  (iptables is iptables-nft: nft's JSON shows its rules as opaque ``xt``
  entries, so the iptables front end is asked); ``ip_forward`` read inside the
  namespace, because it is per network namespace.
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpuaas_agent.contract.fixture import FIXTURE_META_DIR, MANIFEST_NAME
from gpuaas_agent.contract.parity import (
    DnsmasqEvidence,
    DnsmasqProcess,
    NatEvidence,
    NetAddress,
    NetRoute,
    SliceNetworkEvidence,
)
from gpuaas_agent.contract.topology import Finding
from gpuaas_agent.errors import AgentError, HostError
from gpuaas_agent.host.run import run_sync
from gpuaas_agent.hostfs import HostRoot

COMMAND_TIMEOUT_S = 10
IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"
DNSMASQ_CONF = "/etc/dnsmasq.conf"
DNSMASQ_DIR = "/etc/dnsmasq.d"
IPOIB_NETPLAN = "/etc/netplan/60-ipoib.yaml"
TMFIFO = "tmfifo_net0"
MAIN_TABLE = 254


class NetEvidenceError(AgentError):
    """The evidence cannot even be asked for (a namespace that does not exist, netns on a fixture)."""

    default_code = "net_evidence_error"


@dataclass(frozen=True)
class NetTarget:
    """What the slice network should be: subnet, bridge, and where to look (a netns for tests)."""

    subnet: ipaddress.IPv4Network = ipaddress.IPv4Network("10.100.0.0/24")
    ovs_bridge: str = "ovsbr0"
    netns: str | None = None

    @property
    def gateway(self) -> ipaddress.IPv4Interface:
        """The bridge's address: the subnet's first host (10.100.0.1/24)."""
        return ipaddress.IPv4Interface(f"{self.subnet.network_address + 1}/{self.subnet.prefixlen}")

    @property
    def masquerade_rule(self) -> str:
        return f"-A POSTROUTING -s {self.subnet} -j MASQUERADE"


@dataclass
class NetSnapshot:
    """Links, addresses and routes as read, before any judgement; ``None``: could not read."""

    links: list[str] | None = None
    addresses: list[NetAddress] | None = None
    routes: list[NetRoute] | None = None
    ip_forward: bool | None = None
    nat: NatEvidence | None = None
    unreadable: list[Finding] = field(default_factory=list)

    def cannot(self, code: str, detail: str, path: str | None = None) -> None:
        self.unreadable.append(Finding(code=code, detail=detail, path=path))


# -- pure parsers over recorded command outputs ---------------------------------------------


def parse_ip_addr(text: str) -> tuple[list[str], list[NetAddress]]:
    """``ip -j addr`` -> (link names, addresses)."""
    links, addresses = [], []
    for link in json.loads(text or "[]"):
        name = link.get("ifname")
        if not name:
            continue
        links.append(name)
        for info in link.get("addr_info", []):
            family, local, prefix = info.get("family"), info.get("local"), info.get("prefixlen")
            if family in ("inet", "inet6") and local and prefix is not None:
                addresses.append(NetAddress(ifname=name, family=family, cidr=f"{local}/{prefix}"))
    return links, addresses


def parse_ip_link(text: str) -> list[str]:
    """``ip -j link`` -> link names."""
    return [link["ifname"] for link in json.loads(text or "[]") if link.get("ifname")]


def parse_ip_route(text: str) -> list[NetRoute]:
    """``ip -j route`` (IPv4 main table) -> routes; a bare host route ``10.1.2.3`` becomes ``/32``."""
    routes = []
    for route in json.loads(text or "[]"):
        dst = route.get("dst")
        if not dst:
            continue
        if dst != "default" and "/" not in dst:
            dst = f"{dst}/32"
        routes.append(NetRoute(dst=dst, dev=route.get("dev"), gateway=route.get("gateway")))
    return routes


def masquerade_in_iptables_save(text: str, subnet: ipaddress.IPv4Network) -> str | None:
    """The ``-A POSTROUTING -s SUBNET ... -j MASQUERADE`` line of ``iptables-save -t nat``, if any.

    Extra matches (``-o eno8303``) are accepted; a negated source (``! -s``) is not this rule.
    """
    table = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("*"):
            table = line[1:]
            continue
        words = line.split()
        if table not in (None, "nat") or words[:2] != ["-A", "POSTROUTING"]:
            continue
        if "-j" not in words or words[words.index("-j") + 1 :][:1] != ["MASQUERADE"]:
            continue
        for i, word in enumerate(words[:-1]):
            if word in ("-s", "--source") and (i == 0 or words[i - 1] != "!") and _same_net(words[i + 1], subnet):
                return line
    return None


def masquerade_in_nft(text: str, subnet: ipaddress.IPv4Network) -> str | None:
    """A native nft postrouting rule matching ``ip saddr SUBNET`` with ``masquerade``; its description or None.

    An iptables-nft rule shows up as an ``xt`` expression; newer nft prints it
    without a name, so only a named ``MASQUERADE`` target counts here (the live
    reader asks ``iptables -C`` instead).
    """
    items = json.loads(text or "{}").get("nftables", [])
    hooks = {}
    for item in items:
        chain = item.get("chain")
        if chain:
            hooks[(chain.get("family"), chain.get("table"), chain.get("name"))] = (chain.get("hook"), chain.get("type"))
    for item in items:
        rule = item.get("rule")
        if not rule:
            continue
        key = (rule.get("family"), rule.get("table"), rule.get("chain"))
        hook, kind = hooks.get(key, (None, None))
        if hook != "postrouting" and (rule.get("chain") or "").lower() != "postrouting":
            continue
        if kind not in (None, "nat"):
            continue
        exprs = rule.get("expr", [])
        source = any(_nft_saddr_in(e, subnet) for e in exprs)
        masq = any("masquerade" in e or ((e.get("xt") or {}).get("name") == "MASQUERADE") for e in exprs)
        if source and masq:
            return f"nft {key[0]} {key[1]} {key[2]} handle {rule.get('handle')}"
    return None


def _nft_saddr_in(expr: dict[str, Any], subnet: ipaddress.IPv4Network) -> bool:
    match = expr.get("match")
    if not match or match.get("op") not in ("==", "in"):
        return False
    left = (match.get("left") or {}).get("payload") or {}
    if left.get("protocol") != "ip" or left.get("field") != "saddr":
        return False
    right = match.get("right")
    if isinstance(right, dict) and "prefix" in right:
        return _same_net(f"{right['prefix'].get('addr')}/{right['prefix'].get('len')}", subnet)
    return isinstance(right, str) and _same_net(right, subnet)


def _same_net(text: str, subnet: ipaddress.IPv4Network) -> bool:
    try:
        return ipaddress.IPv4Network(text, strict=False) == subnet
    except ValueError:
        return False


def dnsmasq_ranges_in(text: str, subnet: ipaddress.IPv4Network) -> bool:
    """Whether a dnsmasq config serves ``subnet``: a ``dhcp-range`` whose first address lies in it."""
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if not sep or key.strip() != "dhcp-range":
            continue
        for part in value.split(","):
            try:
                start = ipaddress.IPv4Address(part.strip())
            except ValueError:
                continue  # tag:, set:, an interface name
            if start in subnet:
                return True
            break
    return False


# -- the fixture reader -------------------------------------------------------------------


def _recorded_command(host: HostRoot, name: str, snap: NetSnapshot) -> str | None:
    """Stdout of a command the recorder ran, or None (noted) when it was not recorded or failed."""
    meta = host.root / FIXTURE_META_DIR
    failed = _failed_commands(meta)
    if name in failed:
        snap.cannot("command_failed", f"recorded {name} did not succeed: {failed[name]}",
                    f"{FIXTURE_META_DIR}/commands/{name}.out")
        return None
    path = meta / "commands" / f"{name}.out"
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        snap.cannot("command_not_recorded", f"no recorded output: {exc.strerror or exc}",
                    f"{FIXTURE_META_DIR}/commands/{name}.out")
        return None


def _failed_commands(meta: Path) -> dict[str, str]:
    try:
        manifest = json.loads((meta / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {c["name"]: c.get("error") or f"exit code {c.get('exit_code')}" for c in manifest.get("commands", [])
            if c.get("exit_code") != 0}


def read_recorded(host: HostRoot, target: NetTarget) -> NetSnapshot:
    """Links, addresses, routes, NAT and ip_forward from a recording (pure reads under the root)."""
    snap = NetSnapshot()
    for name, parse in (("ip-addr", "addr"), ("ip-link", "link"), ("ip-route", "route")):
        text = _recorded_command(host, name, snap)
        if text is None:
            continue
        try:
            if parse == "addr":
                links, snap.addresses = parse_ip_addr(text)
                snap.links = snap.links or links
            elif parse == "link":
                snap.links = parse_ip_link(text)
            else:
                snap.routes = parse_ip_route(text)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            snap.cannot("command_output_invalid", f"{name} output is not ip -j JSON: {exc}",
                        f"{FIXTURE_META_DIR}/commands/{name}.out")
    snap.ip_forward = _ip_forward_file(host, snap)
    snap.nat = _nat_from_dumps(
        _recorded_command(host, "iptables-save-nat", snap), _recorded_command(host, "nft-ruleset", snap), target, snap,
        method_prefix="recorded ")
    return snap


def _ip_forward_file(host: HostRoot, snap: NetSnapshot) -> bool | None:
    try:
        value = host.read_attr(IP_FORWARD)
    except OSError as exc:
        snap.cannot("ip_forward_unreadable", f"cannot read: {exc.strerror or exc}", IP_FORWARD)
        return None
    return _forward_value(value, snap)


def _forward_value(value: str, snap: NetSnapshot) -> bool | None:
    if value in ("0", "1"):
        return value == "1"
    snap.cannot("ip_forward_unreadable", f"unexpected value {value[:20]!r}", IP_FORWARD)
    return None


def _nat_from_dumps(iptables_save: str | None, nft_json: str | None, target: NetTarget, snap: NetSnapshot,
                    *, method_prefix: str = "") -> NatEvidence:
    """NAT from rule dumps: found in either -> present; both read and neither has it -> absent; else unknown."""
    rule = target.masquerade_rule
    if iptables_save is not None:
        line = masquerade_in_iptables_save(iptables_save, target.subnet)
        if line:
            return NatEvidence(present=True, method=f"{method_prefix}iptables-save", rule=rule, detail=line)
    if nft_json is not None:
        try:
            found = masquerade_in_nft(nft_json, target.subnet)
        except (ValueError, AttributeError, TypeError) as exc:
            snap.cannot("command_output_invalid", f"nft ruleset is not JSON: {exc}")
            nft_json, found = None, None
        if found:
            return NatEvidence(present=True, method=f"{method_prefix}nft", rule=rule, detail=found)
    if iptables_save is None and nft_json is None:
        return NatEvidence(present=None, method="none", rule=rule, detail="no NAT ruleset could be read")
    seen = " and ".join(n for n, t in (("iptables-save -t nat", iptables_save), ("nft ruleset", nft_json)) if t is not None)
    return NatEvidence(present=False, method=f"{method_prefix}{'iptables-save' if iptables_save is not None else 'nft'}",
                       rule=rule, detail=f"no MASQUERADE rule for {target.subnet} in {seen}")


# -- the live reader ------------------------------------------------------------------------


def _ns_argv(target: NetTarget, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", target.netns, *argv] if target.netns else argv


def _run(argv: list[str]) -> subprocess.CompletedProcess[str] | str:
    """A read-only command through ``host/run.py``; the completed process, or a sentence why it did not run."""
    try:
        done = run_sync(argv, timeout=COMMAND_TIMEOUT_S, check=False)
    except HostError as exc:  # command_not_found / command_timeout: the sentence says which
        return exc.message
    except OSError as exc:
        return f"cannot run {argv[0]}: {exc.strerror or exc}"
    return subprocess.CompletedProcess(list(done.argv), done.returncode, done.stdout.decode("utf-8", "replace"),
                                       done.stderr.decode("utf-8", "replace"))


_FAMILIES: dict[int, Literal["inet", "inet6"]] = {socket.AF_INET: "inet", socket.AF_INET6: "inet6"}


def _netlink(target: NetTarget) -> Any:  # pyroute2's IPRoute: the library is untyped
    """An IPRoute for the host's own namespace (a socket in this process: no child, no fork)."""
    from pyroute2 import IPRoute

    return IPRoute()


def _read_netns_ip_json(target: NetTarget, snap: NetSnapshot) -> None:
    """Links, addresses and routes of *another* namespace through ``ip -n NS -j``.

    Not pyroute2's NetNS: it forks this process, and the child shares asyncio's signal
    wake-up socket, so the SIGTERM that NetNS.close() sends its child woke the daemon's
    loop as if the daemon had been told to stop (seen as a daemon stopping 0.1 s after start).
    """
    assert target.netns is not None  # the host's own namespace is read through netlink
    if not Path("/run/netns", target.netns).exists():
        raise NetEvidenceError(f"network namespace {target.netns!r} does not exist", code="netns_missing",
                               evidence={"netns": target.netns, "path": f"/run/netns/{target.netns}"})
    for what, argv in (("addr", ["addr", "show"]), ("route", ["route", "show", "table", "main"])):
        done = _run(["ip", "-n", target.netns, "-j", *argv])
        if isinstance(done, str) or done.returncode != 0:
            why = done if isinstance(done, str) else done.stderr.strip()[:200]
            snap.cannot("netlink_unreadable", f"ip -n {target.netns} -j {' '.join(argv)}: {why}",
                        f"netns:{target.netns}")
            continue
        try:
            if what == "addr":
                snap.links, snap.addresses = parse_ip_addr(done.stdout)
            else:
                snap.routes = parse_ip_route(done.stdout)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            snap.cannot("command_output_invalid", f"ip -j {what} output is not JSON: {exc}", f"netns:{target.netns}")


def _read_netlink(target: NetTarget, snap: NetSnapshot) -> None:
    from pyroute2.netlink.exceptions import NetlinkError

    if target.netns is not None:
        _read_netns_ip_json(target, snap)
        return
    try:
        with _netlink(target) as nl:
            names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in nl.get_links()}
            snap.links = [names[i] for i in sorted(names)]
            addresses = []
            for msg in nl.get_addr():
                family = _FAMILIES.get(msg["family"])
                local = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
                if family and local:
                    addresses.append(NetAddress(ifname=names.get(msg["index"], str(msg["index"])), family=family,
                                                cidr=f"{local}/{msg['prefixlen']}"))
            snap.addresses = addresses
            routes = []
            for msg in nl.get_routes(family=socket.AF_INET, table=MAIN_TABLE):
                if msg["type"] != 1:  # unicast only: no local/broadcast entries
                    continue
                dst = msg.get_attr("RTA_DST")
                oif = msg.get_attr("RTA_OIF")
                routes.append(NetRoute(dst=f"{dst}/{msg['dst_len']}" if dst else "default",
                                       dev=names.get(oif) if oif is not None else None,
                                       gateway=msg.get_attr("RTA_GATEWAY")))
            snap.routes = routes
    except (NetlinkError, OSError) as exc:
        snap.cannot("netlink_unreadable", f"netlink dump failed: {exc}", f"netns:{target.netns}" if target.netns else None)


def _live_ip_forward(host: HostRoot, target: NetTarget, snap: NetSnapshot) -> bool | None:
    if target.netns is None:
        return _ip_forward_file(host, snap)
    done = _run(_ns_argv(target, ["cat", IP_FORWARD]))
    if isinstance(done, str) or done.returncode != 0:
        why = done if isinstance(done, str) else done.stderr.strip()[:200]
        snap.cannot("ip_forward_unreadable", f"cannot read in netns {target.netns}: {why}", IP_FORWARD)
        return None
    return _forward_value(done.stdout.strip(), snap)


def _live_nat(target: NetTarget, snap: NetSnapshot) -> NatEvidence:
    """``iptables -t nat -C`` first (exact rule); then the dumps (variants with ``-o``, native nft rules)."""
    argv = _ns_argv(target, ["iptables", "-t", "nat", "-C", "POSTROUTING", "-s", str(target.subnet), "-j", "MASQUERADE"])
    done = _run(argv)
    if not isinstance(done, str) and done.returncode == 0:
        return NatEvidence(present=True, method="iptables -C", rule=target.masquerade_rule,
                           detail=f"iptables -t nat -C POSTROUTING -s {target.subnet} -j MASQUERADE exited 0")
    if isinstance(done, str):
        snap.cannot("nat_unreadable", done)
    elif done.returncode != 1:  # 1 is "no such rule"; anything else is iptables failing to answer
        snap.cannot("nat_unreadable", f"iptables -C exited {done.returncode}: {done.stderr.strip()[:200]}")
    dumps: list[str | None] = []
    for name, cmd in (("iptables-save", ["iptables-save", "-t", "nat"]), ("nft", ["nft", "-j", "list", "ruleset"])):
        out = _run(_ns_argv(target, cmd))
        if isinstance(out, str) or out.returncode != 0:
            snap.cannot("nat_unreadable", f"{name}: {out if isinstance(out, str) else out.stderr.strip()[:200]}")
            dumps.append(None)
        else:
            dumps.append(out.stdout)
    return _nat_from_dumps(dumps[0], dumps[1], target, snap)


def read_live(host: HostRoot, target: NetTarget) -> NetSnapshot:
    snap = NetSnapshot()
    _read_netlink(target, snap)
    snap.ip_forward = _live_ip_forward(host, target, snap)
    snap.nat = _live_nat(target, snap)
    return snap


# -- files under /etc (either source) and the judgement ---------------------------------------


def _dnsmasq_files(host: HostRoot) -> list[str]:
    """dnsmasq.conf and the conf-dir files dnsmasq itself would read (it skips ``~``/``.dpkg-*``/dotfiles)."""
    files = [DNSMASQ_CONF] if host.exists(DNSMASQ_CONF) else []
    try:
        names = host.listdir(DNSMASQ_DIR)
    except OSError:
        names = []
    for name in names:
        if name.startswith(".") or name.endswith("~") or ".dpkg-" in name:
            continue
        path = posixpath.join(DNSMASQ_DIR, name)
        if not host.is_dir(path):
            files.append(path)
    return files


def read_network_evidence(host: HostRoot, target: NetTarget | None = None) -> SliceNetworkEvidence:
    """The slice network of ``host``: live (netlink, iptables, optionally in ``target.netns``) or recorded."""
    target = target or NetTarget()
    if not host.is_live and target.netns:
        raise NetEvidenceError("a network namespace can only be read on the live host", code="netns_on_fixture",
                               evidence={"root": str(host.root), "netns": target.netns})
    snap = read_live(host, target) if host.is_live else read_recorded(host, target)
    return evaluate(host, target, snap)


def evaluate(host: HostRoot, target: NetTarget, snap: NetSnapshot) -> SliceNetworkEvidence:
    """Snapshot + /etc files -> evidence with blockers (missing) and warnings (unproven)."""
    dns_files = _dnsmasq_files(host)
    dns_subnet = []
    for path in dns_files:
        try:
            if dnsmasq_ranges_in(host.read_text(path), target.subnet):
                dns_subnet.append(path)
        except OSError as exc:
            snap.cannot("dnsmasq_config_unreadable", f"cannot read: {exc.strerror or exc}", path)
    nat = snap.nat or NatEvidence(present=None, method="none", rule=target.masquerade_rule, detail="not read")
    evidence = SliceNetworkEvidence(
        source="live" if host.is_live else "fixture",
        netns=target.netns,
        subnet=str(target.subnet),
        gateway=str(target.gateway),
        ovs_bridge=target.ovs_bridge,
        links=snap.links or [],
        addresses=snap.addresses or [],
        routes=snap.routes or [],
        ip_forward=snap.ip_forward,
        nat=nat,
        dnsmasq_files=dns_files,
        dnsmasq_subnet_files=dns_subnet,
        ipoib_netplan=IPOIB_NETPLAN if host.exists(IPOIB_NETPLAN) else None,
        unreadable=snap.unreadable,
    )
    blockers, warnings = judge(evidence, links_read=snap.links is not None, addresses_read=snap.addresses is not None)
    return evidence.model_copy(update={"blockers": blockers, "warnings": warnings})


def judge(ev: SliceNetworkEvidence, *, links_read: bool = True, addresses_read: bool = True) -> tuple[list[Finding], list[Finding]]:
    """Private-NAT mode: missing bridge/gateway/NAT/ip_forward/dnsmasq block; what was not read only warns."""
    blockers: list[Finding] = []
    warnings: list[Finding] = []
    bridge = ev.ovs_bridge
    if not links_read:
        warnings.append(Finding(code="ovs_bridge_unproven", detail="links could not be read"))
    elif bridge not in ev.links:
        blockers.append(Finding(code="ovs_bridge_missing", detail=f"no link named {bridge}"))
    elif not addresses_read:
        warnings.append(Finding(code="gateway_address_unproven", detail="addresses could not be read"))
    elif ev.gateway not in ev.addresses_of(bridge):
        blockers.append(Finding(code="gateway_address_missing",
                                detail=f"{bridge} does not own {ev.gateway}: has {', '.join(ev.addresses_of(bridge)) or 'no IPv4'}"))
    if ev.nat.present is False:
        blockers.append(Finding(code="nat_missing", detail=f"{ev.nat.rule} not in force: {ev.nat.detail}"))
    elif ev.nat.present is None:
        warnings.append(Finding(code="nat_unproven", detail=ev.nat.detail))
    if ev.ip_forward is False:
        blockers.append(Finding(code="ip_forward_disabled", detail="net.ipv4.ip_forward=0", path=IP_FORWARD))
    elif ev.ip_forward is None:
        warnings.append(Finding(code="ip_forward_unproven", detail="net.ipv4.ip_forward could not be read", path=IP_FORWARD))
    if not ev.dnsmasq_subnet_files:
        blockers.append(Finding(code="dnsmasq_subnet_missing",
                                detail=f"no dhcp-range in {ev.subnet} in {', '.join(ev.dnsmasq_files) or 'any dnsmasq config'}",
                                path=DNSMASQ_DIR))
    if TMFIFO in ev.links and not any(ipaddress.IPv4Interface(c).network.prefixlen == 30 for c in ev.addresses_of(TMFIFO)):
        warnings.append(Finding(code="tmfifo_without_ipv4", detail=f"{TMFIFO} exists without a /30 IPv4 address"))
    return blockers, warnings



# -- dnsmasq: the running process, its config, and the agent's hosts file ------------------------
#
# A dhcp-range in /etc/dnsmasq.d proves only that *a* config serves the subnet. What a provision
# needs is that the dnsmasq actually running reads the file the agent writes reservations to:
# otherwise the reservation step succeeds, SIGHUP is sent, and the guest never gets its address
# (seed 004: the recorded hosts read /var/lib/gpuaas/dnsmasq-hosts while reservations went
# elsewhere). So the evidence starts from the process table and follows what each dnsmasq was
# told on its command line and in every config file it loads.

DNSMASQ_COMM = "dnsmasq"
DEFAULT_DNSMASQ_CONF = "/etc/dnsmasq.conf"  # compiled-in CONFFILE, read when no -C/--conf-file is given
# How Debian/Ubuntu's dnsmasq service starts it (/etc/init.d/dnsmasq CONFIG_DIR): the default config file
# plus /etc/dnsmasq.d without dpkg leftovers. On a recording, the config read this way says which hosts
# file dnsmasq would read; only a live process table proves what the running one reads.
RECORDED_DNSMASQ_ARGV = ["dnsmasq", "--conf-dir=/etc/dnsmasq.d,.dpkg-dist,.dpkg-old,.dpkg-new"]
_COMMENTED_HOSTS = re.compile(r"^\s*#+\s*(dhcp-hostsfile|dhcp-hostsdir)\s*=\s*(\S+)")
MAX_CONF_DEPTH = 8


def _opt_value(argv: list[str], i: int, long: str, short: str | None, *, optional: bool = False) -> tuple[str | None, int]:
    """(value, words consumed) of option ``argv[i]`` if it is ``--long=V``, ``--long V``, ``-sV`` or ``-s V``.

    ``optional`` options (dnsmasq's ``--conf-file``) take a value only after ``=``. Returns (None, 0)
    when ``argv[i]`` is not this option; ("", 1) for a bare optional one.
    """
    word = argv[i]
    if word.startswith(f"--{long}="):
        return word[len(long) + 3:], 1
    if word == f"--{long}":
        if optional:
            return "", 1
        return (argv[i + 1], 2) if i + 1 < len(argv) else ("", 1)
    if short and word.startswith(f"-{short}") and not word.startswith("--"):
        if len(word) > 2:
            return word[2:], 1
        return (argv[i + 1], 2) if i + 1 < len(argv) else ("", 1)
    return None, 0


def _conf_lines(text: str) -> list[tuple[str, str]]:
    """``key=value`` pairs of a dnsmasq config file; ``#`` outside quotes starts a comment."""
    out = []
    for raw in text.splitlines():
        line, quoted = [], False
        for c in raw:
            if c == '"':
                quoted = not quoted
                continue
            if c == "#" and not quoted:
                break
            line.append(c)
        key, _, value = "".join(line).strip().partition("=")
        if key.strip():
            out.append((key.strip(), value.strip()))
    return out


def _conf_dir_files(host: HostRoot, spec: str) -> tuple[list[str], str | None]:
    """Files ``conf-dir=DIR[,*.inc|,.exc...]`` loads, sorted; plus a reason when DIR cannot be listed.

    A suffix starting with ``*`` keeps only files ending with it; any other suffix drops files
    ending with it; dnsmasq always skips ``.``-files, ``~`` backups and ``#...#`` autosaves.
    """
    directory, *suffixes = [p.strip() for p in spec.split(",")]
    include = [s[1:] for s in suffixes if s.startswith("*")]
    exclude = [s for s in suffixes if s and not s.startswith("*")]
    try:
        names = host.listdir(directory)
    except OSError as exc:
        return [], f"conf-dir {directory}: {exc.strerror or exc}"
    files = []
    for name in names:
        if name.startswith(".") or name.endswith("~") or (name.startswith("#") and name.endswith("#")):
            continue
        if include and not any(name.endswith(s) for s in include):
            continue
        if any(name.endswith(s) for s in exclude):
            continue
        path = posixpath.join(directory, name)
        if not host.is_dir(path):
            files.append(path)
    return files, None


def dnsmasq_process(host: HostRoot, pid: int, argv: list[str]) -> DnsmasqProcess:
    """What one dnsmasq reads: ``argv`` first, then each config file it loads (nested, in order)."""
    proc = DnsmasqProcess(pid=pid, argv=argv)
    conf_queue: list[tuple[str, str, int]] = []  # (path, named where, depth)
    explicit_conf = False

    def hosts(kind: str, value: str, where: str) -> None:
        if not value:
            return
        (proc.hosts_files if kind == "file" else proc.hosts_dirs).append(value)
        proc.sources.setdefault(value, f"dhcp-hosts{kind}={value} ({where})")

    def conf_dir(spec: str, where: str, depth: int) -> None:
        files, problem = _conf_dir_files(host, spec)
        if problem:
            proc.unreadable.append(Finding(code="dnsmasq_conf_dir_unreadable", detail=problem, path=where))
        conf_queue.extend((f, f"conf-dir={spec} in {where}", depth) for f in files)

    i = 1
    while i < len(argv):
        for long, short, optional, kind in (("conf-file", "C", True, "conf"), ("conf-dir", "7", False, "dir"),  # noqa: B007 - kind is read after the break
                                            ("dhcp-hostsfile", None, False, "file"),
                                            ("dhcp-hostsdir", None, False, "hostsdir")):
            value, used = _opt_value(argv, i, long, short, optional=optional)
            if used:
                break
        else:
            i += 1
            continue
        i += used
        assert value is not None  # an option that used a word has a value ("" when bare)
        if kind == "conf":
            explicit_conf = True
            if value:
                conf_queue.append((value, "command line", 0))
        elif kind == "dir":
            conf_dir(value, "command line", 0)
        else:
            hosts("file" if kind == "file" else "dir", value, "command line")
    if not explicit_conf:
        conf_queue.insert(0, (DEFAULT_DNSMASQ_CONF, "default config file", 0))

    seen: set[str] = set()
    while conf_queue:
        path, where, depth = conf_queue.pop(0)
        if path in seen or depth > MAX_CONF_DEPTH:
            continue
        seen.add(path)
        if path == "/dev/null":
            proc.conf_files.append(path)
            continue
        try:
            text = host.read_text(path)
        except OSError as exc:
            if where != "default config file" or host.exists(path):
                proc.unreadable.append(Finding(code="dnsmasq_conf_unreadable",
                                               detail=f"{path} ({where}): {exc.strerror or exc}", path=path))
            continue
        proc.conf_files.append(path)
        nested = []
        for key, value in _conf_lines(text):
            if key == "conf-file" and value:
                nested.append((value, f"conf-file in {path}", depth + 1))
            elif key == "conf-dir" and value:
                files, problem = _conf_dir_files(host, value)
                if problem:
                    proc.unreadable.append(Finding(code="dnsmasq_conf_dir_unreadable", detail=problem, path=path))
                nested.extend((f, f"conf-dir={value} in {path}", depth + 1) for f in files)
            elif key == "dhcp-hostsfile":
                hosts("file", value, path)
            elif key == "dhcp-hostsdir":
                hosts("dir", value, path)
        conf_queue[0:0] = nested  # dnsmasq reads an included file where it is named
    return proc


def _same(host: HostRoot, a: str, b: str) -> bool:
    """Two host paths name the same entry (links followed inside the root, trailing slashes ignored)."""
    def norm(p: str) -> str:
        try:
            return host.resolve(posixpath.normpath(p))
        except OSError:
            return posixpath.normpath(p)
    return norm(a) == norm(b)


def reads_hosts_file(host: HostRoot, proc: DnsmasqProcess, hosts_file: str) -> str | None:
    """How ``proc`` reads ``hosts_file`` (``dhcp-hostsfile=... (where)``), or None when it does not.

    ``dhcp-hostsfile`` may name the file itself or a directory holding it; ``dhcp-hostsdir`` the
    directory. dnsmasq skips dotfiles and ``~`` backups in a directory.
    """
    parent, name = posixpath.split(posixpath.normpath(hosts_file))
    in_dir_ok = not name.startswith(".") and not name.endswith("~")
    for value in proc.hosts_files:
        if _same(host, value, hosts_file) or (in_dir_ok and host.is_dir(value) and _same(host, value, parent)):
            return proc.sources.get(value, value)
    for value in proc.hosts_dirs:
        if in_dir_ok and _same(host, value, parent):
            return proc.sources.get(value, value)
    return None


def _proc_pids(host: HostRoot) -> list[int] | None:
    """The pids of a process table under the root; None when the root has none (a recording)."""
    try:
        names = host.listdir("/proc")
    except OSError:
        return None
    pids = sorted(int(n) for n in names if n.isdigit())
    return pids or None


def _argv(host: HostRoot, pid: int) -> list[str] | None:
    try:
        with open(host.real(f"/proc/{pid}/cmdline"), "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a] or None


def running_processes(host: HostRoot, comms: tuple[str, ...]) -> dict[int, tuple[str, list[str]]] | None:
    """pid -> (comm, argv) of the processes whose ``comm`` is one of ``comms``; None without a process table.

    ``comm`` is the kernel's 15-character name: pass it truncated (``nvidia-persiste``).
    """
    pids = _proc_pids(host)
    if pids is None:
        return None
    found = {}
    for pid in pids:
        try:
            comm = host.read_attr(f"/proc/{pid}/comm")
        except OSError:
            continue  # exited while we looked
        if comm in comms:
            argv = _argv(host, pid)
            if argv is not None:
                found[pid] = (comm, argv)
    return found


def read_dnsmasq_evidence(host: HostRoot, hosts_file: str | Path, pid_file: str | Path | None = None) -> DnsmasqEvidence:
    """Every running dnsmasq (``/proc/*/comm``), what it reads, and which of them read ``hosts_file``.

    Paths are host paths under ``host`` (the running dnsmasq's own mount namespace is assumed to
    be the agent's). Blocking: call it through ``asyncio.to_thread`` from the event loop.
    """
    hosts_file, pid_file = str(hosts_file), None if pid_file is None else str(pid_file)
    pid_file_pid = None
    if pid_file is not None:
        try:
            text = host.read_attr(pid_file)
            pid_file_pid = int(text) if text.isdigit() and int(text) > 0 else None
        except OSError:
            pid_file_pid = None
    table = running_processes(host, (DNSMASQ_COMM,))
    processes = [dnsmasq_process(host, pid, argv) for pid, (_, argv) in sorted((table or {}).items())]
    readers, via = [], None
    for proc in processes:
        how = reads_hosts_file(host, proc, hosts_file)
        if how:
            readers.append(proc.pid)
            via = via or f"pid {proc.pid}: {how}"
    recorded, recorded_via, commented = None, None, []
    if table is None:
        recorded = dnsmasq_process(host, 0, RECORDED_DNSMASQ_ARGV)
        recorded_via = reads_hosts_file(host, recorded, hosts_file)
        commented = _commented_hosts_lines(host, recorded.conf_files)
    return DnsmasqEvidence(source="live" if host.is_live else "fixture", hosts_file=hosts_file, pid_file=pid_file,
                           pid_file_pid=pid_file_pid, process_table=table is not None, processes=processes,
                           readers=readers, via=via, recorded_config=recorded, recorded_via=recorded_via,
                           commented=commented)


def _commented_hosts_lines(host: HostRoot, files: list[str]) -> list[str]:
    """``path:N: text`` of each commented-out hosts option: an operator who sees one knows why nothing is read."""
    found = []
    for path in files:
        try:
            lines = host.read_text(path).splitlines()
        except OSError:
            continue  # already recorded as unreadable by dnsmasq_process
        found += [f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if _COMMENTED_HOSTS.match(line)]
    return found


def judge_recorded_dnsmasq(ev: DnsmasqEvidence) -> Finding | None:
    """On a recording (no process table): what the recorded config says about the agent's hosts file.

    ``dnsmasq_unproven`` when it reads ``hosts_file`` (the running process still is not provable),
    ``dnsmasq_config_reads_other_hosts`` naming what it reads instead, ``dnsmasq_config_reads_no_hosts``
    when it names none (a commented-out line is named). None when ``ev`` has a process table.
    """
    cfg = ev.recorded_config
    if ev.process_table or cfg is None:
        return None
    files = ",".join(cfg.conf_files) or "no config file"
    if ev.recorded_via:
        return Finding(code="dnsmasq_unproven", path=ev.hosts_file,
                       detail=f"the recorded config reads {ev.hosts_file} ({ev.recorded_via}); "
                              "whether a running dnsmasq does is not provable on a recording")
    named = cfg.hosts_files + cfg.hosts_dirs
    if named:
        return Finding(code="dnsmasq_config_reads_other_hosts", path=named[0],
                       detail=f"the recorded config reads {'; '.join(cfg.sources.get(n, n) for n in named)}, "
                              f"not the agent's {ev.hosts_file}")
    hint = f"; commented out: {' | '.join(ev.commented)}" if ev.commented else ""
    return Finding(code="dnsmasq_config_reads_no_hosts", path=ev.hosts_file,
                   detail=f"the recorded config ({files}) names no dhcp-hostsfile or dhcp-hostsdir, so dnsmasq "
                          f"started from it reads no reservations{hint}")


def judge_dnsmasq(ev: DnsmasqEvidence) -> Finding | None:
    """The one thing wrong with the dnsmasq that should serve the agent's reservations, or None.

    Codes: ``dnsmasq_unproven`` (no process table to read), ``dnsmasq_not_running``,
    ``dnsmasq_not_reading_hosts``, ``dnsmasq_pid_file_mismatch`` (the reader is not the pid the
    reservation step will SIGHUP, so new reservations would not be re-read).
    """
    if not ev.process_table:
        return Finding(code="dnsmasq_unproven", detail="no process table under the root: a running dnsmasq cannot be proven",
                       path="/proc")
    if not ev.processes:
        return Finding(code="dnsmasq_not_running", detail="no process with comm dnsmasq is running", path="/proc")
    if not ev.readers:
        told = "; ".join(
            f"pid {p.pid} reads {','.join(p.hosts_files + p.hosts_dirs) or 'no dhcp-hostsfile/dhcp-hostsdir'}"
            f" (config {','.join(p.conf_files) or 'none'})" for p in ev.processes)
        return Finding(code="dnsmasq_not_reading_hosts", detail=f"no running dnsmasq reads {ev.hosts_file}: {told}",
                       path=ev.hosts_file)
    if ev.pid_file is not None and ev.pid_file_pid not in ev.readers:
        return Finding(code="dnsmasq_pid_file_mismatch",
                       detail=f"{ev.pid_file} names {ev.pid_file_pid or 'no pid'}, but the dnsmasq reading "
                              f"{ev.hosts_file} is pid {','.join(map(str, ev.readers))}: a reload would not reach it",
                       path=ev.pid_file)
    return None


def read_bridge_addresses(host: HostRoot, target: NetTarget) -> tuple[list[str] | None, list[NetAddress] | None, list[Finding]]:
    """Links and addresses only (netlink, or the recorded ``ip -j addr``): enough to prove the gateway."""
    snap = NetSnapshot()
    if host.is_live:
        _read_netlink(target, snap)
    else:
        text = _recorded_command(host, "ip-addr", snap)
        if text is not None:
            try:
                snap.links, snap.addresses = parse_ip_addr(text)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                snap.cannot("command_output_invalid", f"ip-addr output is not ip -j JSON: {exc}")
    return snap.links, snap.addresses, snap.unreadable
