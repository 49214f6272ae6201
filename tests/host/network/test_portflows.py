"""Port isolation through a real OVS netdev bridge: two guests that try to spoof, poison and reach, and fail.

Topology: the switch namespace is the host. Its bridge's LOCAL port owns the gateway
10.100.0.1/24 with dnsmasq and TCP/UDP listeners on it, and NATs the slice subnet to an
"upstream" namespace over a veth. Guests A and B are namespaces whose ``eth0`` is the
peer of a veth whose host end, named like the slot's vNIC, is the guest's OVS port
(and, like a libvirt tap under the userspace datapath, also a host kernel device).
The agent's own code installs and reads the rules: :func:`isolate_port`, reconcile.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.drift import DriftKind
from gpuaas_agent.contract.isolation import (
    FlowRule,
    FlowState,
    cookie_of_port_name,
    port_cookie,
    port_name_of_cookie,
)
from gpuaas_agent.contract.naming import vnic_name
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations, make_reservation
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.host.network.portflows import IsolationRefused, PortFlows, expected_flows, parse_dump, port_isolation
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.isolation import isolate_port, nft_guard
from gpuaas_agent.tasks.reconcile import reconcile
from tests.support.dnsmasq_fixture import (
    Dnsmasq,
    NetLab,
    call_in_netns,
    disable_tx_checksum,
    net_dnsmasq_start,
    run_in_netns,
    sh,
    udhcpc,
)
from tests.support.ovsdb_fixture import OvsSwitch

SUBNET = IPv4Network("10.100.0.0/24")
GATEWAY = "10.100.0.1"
UPSTREAM = "203.0.113.2"
A1 = "1111aaaa-2222-4333-8444-555555555555"
A2 = "2222bbbb-3333-4444-8555-666666666666"
FOREIGN_FLOW = "cookie=0x1234,priority=5,dl_type=0x88b5,actions=drop"
PROBE_TIMEOUT_S = 2.0  # how long a connect may take before a dropped SYN counts as "unreachable"
EXPORTER_PORT = 9100  # the agent's guest_exporter_port in this lab


@dataclass
class Guest:
    ns: str
    allocation_id: str
    slot_index: int
    mac: str
    ip: str

    @property
    def port(self) -> str:
        return vnic_name(self.allocation_id, self.slot_index)


@dataclass
class IsoLab:
    net: NetLab
    sw: OvsSwitch
    a: Guest
    b: Guest
    upstream: str
    sh: SliceDrivers
    dnsmasq: Dnsmasq
    listeners: dict

    @property
    def host(self) -> str:
        assert self.sw.netns is not None
        return self.sw.netns

    def agent(self, coro_factory):
        """Run agent code as the daemon would on the host: inside the host (switch) namespace."""
        return run_in_netns(self.host, coro_factory)

    def ports(self) -> dict:
        with OvsDriver(self.sw.remote) as ovs:
            return {p.name: p for p in ovs.list_agent_ports(self.sw.bridge)}

    def isolate(self, guest: Guest, *, guest_telemetry: bool = False) -> dict:
        port = self.ports()[guest.port]
        return self.agent(lambda: isolate_port(self.sh, port, mac=guest.mac, ip=guest.ip,
                                               guest_telemetry=guest_telemetry))

    def ofctl(self, *args: str) -> str:
        return sh("ovs-ofctl", *args).stdout

    def all_flows(self) -> list[FlowRule]:
        return parse_dump(self.ofctl("--no-stats", "--no-names", "dump-flows", _mgmt(self.sw)))

    def nft(self, *args: str) -> str:
        return sh("ip", "netns", "exec", self.host, "nft", *args).stdout


def _mgmt(sw: OvsSwitch) -> str:
    return f"unix:{sw.rundir}/{sw.bridge}.mgmt"


def _tcp_listener(ns: str, ip: str, port: int) -> socket.socket:
    def make():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        s.listen(16)
        s.settimeout(0.2)
        return s
    return call_in_netns(ns, make)


def _udp_socket(ns: str, ip: str, port: int = 0) -> socket.socket:
    def make():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        return s
    return call_in_netns(ns, make)


def _accepting(listener: socket.socket) -> None:
    """Accept and close connections forever (a daemon thread per listener)."""
    import threading

    def loop():
        while listener.fileno() != -1:
            try:
                conn, _ = listener.accept()
                conn.close()
            except (TimeoutError, OSError):
                continue

    threading.Thread(target=loop, daemon=True).start()


def tcp_reaches(ns: str, ip: str, port: int, *, source: str | None = None) -> bool:
    def attempt() -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(PROBE_TIMEOUT_S)
            if source:
                s.bind((source, 0))
            try:
                s.connect((ip, port))
                return True
            except OSError:
                return False
    return call_in_netns(ns, attempt)


def udp_received(sock: socket.socket, marker: bytes, deadline_s: float = 5.0) -> set:
    """Read datagrams until ``marker`` arrives; returns every (payload, source ip) seen before it."""
    seen = set()
    sock.settimeout(0.2)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            data, (src, _) = sock.recvfrom(2048)
        except TimeoutError:
            continue
        if data == marker:
            return seen
        seen.add((data, src))
    raise AssertionError(f"the sentinel {marker!r} never arrived; saw {seen}")


def udp_within(sock: socket.socket, seconds: float, wanted: bytes) -> set:
    """Datagrams (payload, source) read for at most ``seconds``, stopping early once ``wanted`` came."""
    seen: set = set()
    sock.settimeout(0.1)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not any(data == wanted for data, _ in seen):
        try:
            data, (src, _) = sock.recvfrom(2048)
            seen.add((data, src))
        except TimeoutError:
            continue
    return seen


def becomes(predicate, seconds: float) -> bool:
    """True as soon as ``predicate()`` holds, False if it never did within ``seconds`` (a probe of a negative)."""
    end = time.monotonic() + seconds
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)  # poll step of a bounded wait, not synchronisation


def udp_send(ns: str, dst: str, port: int, payload: bytes, *, source: str | None = None) -> None:
    def send():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            if source:
                s.bind((source, 0))
            s.sendto(payload, (dst, port))
    call_in_netns(ns, send)


def _mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


def gratuitous_arp(ns: str, iface: str, *, src_mac: str, claim_ip: str) -> None:
    """A raw broadcast ARP reply "claim_ip is-at src_mac" (what arping -U sends), through AF_PACKET."""
    mac = _mac_bytes(src_mac)
    ip = socket.inet_aton(claim_ip)
    frame = b"\xff" * 6 + mac + b"\x08\x06" + struct.pack("!HHBBH", 1, 0x0800, 6, 4, 2) + mac + ip + b"\xff" * 6 + ip

    def send():
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
            s.bind((iface, 0))
            s.send(frame)
    call_in_netns(ns, send)


def neigh(ns: str, ip: str) -> str | None:
    out = sh("ip", "-n", ns, "-j", "neigh", "show", ip).stdout
    entries = json.loads(out or "[]")
    return entries[0].get("lladdr") if entries else None


def set_mac(ns: str, mac: str) -> None:
    sh("ip", "-n", ns, "link", "set", "eth0", "address", mac)


def bridge_mac(lab: IsoLab) -> str:
    return json.loads(sh("ip", "-n", lab.host, "-j", "link", "show", lab.sw.bridge).stdout)[0]["address"]


def build_lab(net: NetLab, sw: OvsSwitch, tmp: Path) -> IsoLab:
    host = sw.netns
    assert host is not None
    sw.ip("addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", sw.bridge)
    sw.ip("link", "set", sw.bridge, "up")
    disable_tx_checksum(host, sw.bridge)
    # The gateway's view of a guest may be updated by a gratuitous ARP at once (no 1 s lock): the probe's baseline.
    sh("ip", "netns", "exec", host, "sysctl", "-qw", f"net.ipv4.neigh.{sw.bridge}.locktime=0",
       "net.ipv4.ip_forward=1")
    a = Guest(net.netns("ga"), A1, 0, "52:54:00:0a:00:0a", "10.100.0.10")
    b = Guest(net.netns("gb"), A2, 1, "52:54:00:0b:00:0b", "10.100.0.11")
    with OvsDriver(sw.remote) as ovs:
        for g in (a, b):
            net.veth(g.port, host, "eth0", g.ns)
            sw.ip("link", "set", g.port, "up")
            net.up(g.ns, "eth0", address=f"{g.ip}/{SUBNET.prefixlen}", mac=g.mac)
            sh("ip", "-n", g.ns, "route", "add", "default", "via", GATEWAY)
            sh("ip", "netns", "exec", g.ns, "sysctl", "-qw", "net.ipv4.neigh.eth0.locktime=0")
            disable_tx_checksum(g.ns, "eth0")
            ovs.add_vm_port(sw.bridge, g.port, mac=g.mac, vm_uuid=g.allocation_id, allocation_id=g.allocation_id,
                            slot_index=g.slot_index)
    upstream = net.netns("up")
    net.veth("upl0", host, "upl1", upstream)
    net.up(host, "upl0", address="203.0.113.1/24")
    net.up(upstream, "upl1", address=f"{UPSTREAM}/24")
    disable_tx_checksum(upstream, "upl1")
    # NAT of the slice subnet, a foreign table the agent must leave alone.
    sh("ip", "netns", "exec", host, "nft", "add table ip labnat { chain post { type nat hook postrouting priority "
       "srcnat; ip saddr 10.100.0.0/24 oifname \"upl0\" masquerade; }; }")
    sh("ovs-ofctl", "add-flow", _mgmt(sw), FOREIGN_FLOW)

    dnsmasq = Dnsmasq(netns=host, iface=sw.bridge, workdir=tmp / "dnsmasq")
    net_dnsmasq_start(net, dnsmasq)
    reservations = DnsmasqReservations(dnsmasq.hosts_file, SUBNET, IPv4Address(GATEWAY), dnsmasq.pid_file)
    for g in (a, b):
        reservations.add(make_reservation(g.allocation_id, g.slot_index, g.mac, g.ip, f"slice{g.slot_index}"))
    before = dnsmasq.reads()
    reservations.reload()
    dnsmasq.wait_reread(before)

    listeners = {
        "gw_http": _tcp_listener(host, GATEWAY, 8080),
        "gw_dns_tcp": _tcp_listener(host, GATEWAY, 53),
        "gw_dns_udp": _udp_socket(host, GATEWAY, 53),
        "up_tcp": _tcp_listener(upstream, UPSTREAM, 9000),
        "b_tcp": _tcp_listener(b.ns, b.ip, 7000),
        "b_udp": _udp_socket(b.ns, b.ip, 7001),
    }
    for name in ("gw_http", "gw_dns_tcp", "up_tcp", "b_tcp"):
        _accepting(listeners[name])
    slice_cfg = SliceConfig(subnet=SUBNET, gateway=IPv4Address(GATEWAY), ovs_bridge=sw.bridge, ovsdb_remote=sw.remote,
                            dnsmasq_hosts_file=dnsmasq.hosts_file, dnsmasq_lease_file=dnsmasq.lease_file,
                            dnsmasq_pid_file=dnsmasq.pid_file, seed_dir=tmp / "seeds")
    slicehost = SliceDrivers(host_root=Path("/"), slice=slice_cfg, images=ImageCache(tmp / "images"),
                          libvirt=LibvirtLifecycle("test:///default"), guest_exporter_port=EXPORTER_PORT)
    return IsoLab(net=net, sw=sw, a=a, b=b, upstream=upstream, sh=slicehost, dnsmasq=dnsmasq, listeners=listeners)


@pytest.fixture
def lab(net_lab: NetLab, ovs_switch: OvsSwitch, tmp_path: Path):
    built = build_lab(net_lab, ovs_switch, tmp_path)
    try:
        yield built
    finally:
        for s in built.listeners.values():
            s.close()


def spoof_probes(lab: IsoLab) -> dict:
    """What A manages against B and the host; True means the attack (or reach) succeeded."""
    a, b = lab.a, lab.b
    gw_udp = lab.listeners["gw_dns_udp"]
    out = {}
    # Clean neighbour tables (an earlier open window may have let A poison them), then the gateway's and
    # B's entries exist first (a gratuitous ARP updates an entry, it does not create one).
    sh("ip", "-n", lab.host, "neigh", "flush", "dev", lab.sw.bridge)
    sh("ip", "-n", b.ns, "neigh", "flush", "dev", "eth0")
    assert tcp_reaches(a.ns, GATEWAY, 53)
    # The host resolves B with a SYN to its SSH port (no listener: refused, but B answered ARP); not a ping: the
    # guard drops the host's ICMP echo to a guest, and a guest's to the host.
    tcp_reaches(lab.host, b.ip, 22)
    assert tcp_reaches(b.ns, GATEWAY, 53)
    gw_mac = bridge_mac(lab)
    assert neigh(b.ns, GATEWAY) == gw_mac and neigh(lab.host, b.ip) == b.mac

    # 1. direct reach of B (B's MAC is known to the attacker: a static neighbour entry)
    sh("ip", "-n", a.ns, "neigh", "replace", b.ip, "lladdr", b.mac, "dev", "eth0")
    out["tcp_to_b"] = tcp_reaches(a.ns, b.ip, 7000)
    udp_send(a.ns, b.ip, 7001, b"from-a")
    # No sentinel can follow A's datagram to B through A's own port once isolated: wait a bounded while.
    out["udp_to_b"] = (b"from-a", a.ip) in udp_within(lab.listeners["b_udp"], PROBE_TIMEOUT_S, b"from-a")
    # 2. the host's other services on the gateway address
    out["gw_http"] = tcp_reaches(a.ns, GATEWAY, 8080)
    # 3. B's IP as source (A's MAC), then B's MAC
    out["ip_spoof"] = ip_spoof_reaches_gateway(lab)
    set_mac(a.ns, b.mac)
    udp_send(a.ns, GATEWAY, 53, b"spoof-mac")
    set_mac(a.ns, a.mac)
    udp_send(a.ns, GATEWAY, 53, b"sentinel-2")
    out["mac_spoof"] = any(data == b"spoof-mac" for data, _ in udp_received(gw_udp, b"sentinel-2"))
    # (an open bridge has now learnt B's MAC on A's port: B speaks once so the host's frames find B again)
    assert tcp_reaches(b.ns, GATEWAY, 53)
    # 4. gratuitous ARP: "B's IP is at A's MAC" to the gateway, "the gateway is at A's MAC" to B
    # The gateway's view: a sentinel after the lie, through A's own port, arrives after the lie was processed.
    gratuitous_arp(a.ns, "eth0", src_mac=a.mac, claim_ip=b.ip)
    udp_send(a.ns, GATEWAY, 53, b"sentinel-4")
    udp_received(gw_udp, b"sentinel-4")
    out["arp_for_b"] = neigh(lab.host, b.ip) == a.mac
    # B's view: nothing of A's can be ordered before a sentinel to B, so a bounded wait.
    gratuitous_arp(a.ns, "eth0", src_mac=a.mac, claim_ip=GATEWAY)
    out["arp_for_gateway"] = becomes(lambda: neigh(b.ns, GATEWAY) == a.mac, PROBE_TIMEOUT_S)
    return out


def ip_spoof_reaches_gateway(lab: IsoLab) -> bool:
    """A takes B's IP as a second address and sends from it to the gateway's UDP 53: did it arrive?"""
    a, b = lab.a, lab.b
    sh("ip", "-n", a.ns, "addr", "add", f"{b.ip}/32", "dev", "eth0")
    try:
        udp_send(a.ns, GATEWAY, 53, b"spoof-ip", source=b.ip)
    finally:
        sh("ip", "-n", a.ns, "addr", "del", f"{b.ip}/32", "dev", "eth0")
    udp_send(a.ns, GATEWAY, 53, b"sentinel-1")
    return any(data == b"spoof-ip" for data, _ in udp_received(lab.listeners["gw_dns_udp"], b"sentinel-1"))


ATTACKS = ("tcp_to_b", "udp_to_b", "gw_http", "ip_spoof", "mac_spoof", "arp_for_b", "arp_for_gateway")


def test_without_isolation_a_guest_spoofs_and_reaches_everything_so_the_probes_can_fail(lab: IsoLab):
    got = spoof_probes(lab)
    assert got == {k: True for k in ATTACKS}, got


def test_isolated_guests_cannot_spoof_or_reach_each_other_or_host_services_but_keep_dhcp_dns_and_nat(lab: IsoLab):
    before_nft = lab.nft("-j", "list", "table", "ip", "labnat")
    for g in (lab.a, lab.b):
        evidence = lab.isolate(g)
        assert evidence["nft_guarded"] and evidence["flows"] == len(expected_flows(_iso(lab, g)))

    got = spoof_probes(lab)
    assert got == {k: False for k in ATTACKS}, got
    # what a guest may do: DNS on the gateway, the NAT uplink, its own DHCP from 0.0.0.0
    assert tcp_reaches(lab.a.ns, GATEWAY, 53)
    assert tcp_reaches(lab.a.ns, UPSTREAM, 9000)
    assert tcp_reaches(lab.b.ns, UPSTREAM, 9000)
    assert udhcpc(lab.a.ns, "eth0") == lab.a.ip
    # foreign rules untouched
    assert lab.nft("-j", "list", "table", "ip", "labnat") == before_nft
    assert any(r.cookie == 0x1234 and r.actions == "drop" for r in lab.all_flows())


def test_a_guest_that_finds_the_host_tap_gets_no_arp_answer_and_no_service(lab: IsoLab):
    """Under the userspace datapath the host kernel sees the guest's frames on the tap beside OVS: the nft guard."""
    lab.isolate(lab.a)
    host_end = json.loads(sh("ip", "-n", lab.host, "-j", "link", "show", lab.a.port).stdout)[0]["address"]
    # ARP for the gateway: only the bridge answers, never the host on the tap
    sh("ip", "-n", lab.a.ns, "neigh", "flush", "dev", "eth0")
    assert tcp_reaches(lab.a.ns, GATEWAY, 53)
    assert neigh(lab.a.ns, GATEWAY) == bridge_mac(lab)
    # the tap's MAC guessed: the host stack still serves only DNS/DHCP, and routes nothing
    sh("ip", "-n", lab.a.ns, "neigh", "replace", GATEWAY, "lladdr", host_end, "dev", "eth0")
    assert not tcp_reaches(lab.a.ns, GATEWAY, 8080)
    assert not tcp_reaches(lab.a.ns, UPSTREAM, 9000)


EXPOSITION = b"# TYPE node_load1 gauge\nnode_load1 0.5\n"


class _Served:
    """An HTTP server in a thread, closed like the lab's listeners (``close``): stopped, then its socket closed."""

    def __init__(self, server) -> None:
        self.server = server

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _exporter(ns: str, ip: str) -> _Served:
    """A guest's exporter: a real HTTP server on its IP inside its namespace (a daemon thread serves it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Exposition(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(EXPOSITION)))
            self.end_headers()
            self.wfile.write(EXPOSITION)

        def log_message(self, *args):
            pass

    server = call_in_netns(ns, lambda: HTTPServer((ip, EXPORTER_PORT), Exposition))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return _Served(server)


def host_pings(lab: IsoLab, ip: str) -> str:
    """One ICMP echo from the host (busybox ping, 1 s): ``answered``, ``refused`` (the host's own output hook
    dropped it: the send fails at once with EPERM) or ``silent``."""
    done = sh("ip", "netns", "exec", lab.host, "busybox", "ping", "-c1", "-W1", ip, check=False)
    if done.returncode == 0:
        return "answered"
    return "refused" if "Operation not permitted" in done.stdout + done.stderr else "silent"


def test_the_hosts_only_ways_into_a_guest_are_ssh_and_an_opted_in_exporter_and_no_guest_can_open_anything(
        lab: IsoLab, tmp_path: Path):
    """The narrow path of guest telemetry (docs/security.md "Guest telemetry"): A's allocation opted in, B's not.
    The agent, from the gateway, pulls A's exporter through the real bridge and guard; the host's other ports
    into A (9101) and B's exporter are dropped, and so is an ICMP echo from the host to either guest (nothing the
    agent does needs one), SSH (readiness, terminal) still reaches both; nothing a guest
    starts reaches the host (its exporter-pull address on any port) or the other guest's exporter. Without
    isolation every one of these probes succeeds: they can fail. Re-isolating A without the opt-in closes its
    exporter; an opening nobody granted is found and closed by reconcile."""
    from gpuaas_agent.contract.telemetry import GuestPullBounds
    from gpuaas_agent.operator.guest_telemetry import GuestPuller, GuestTarget

    a, b = lab.a, lab.b
    lab.listeners["a_exporter"] = _exporter(a.ns, a.ip)
    lab.listeners["b_exporter"] = _exporter(b.ns, b.ip)
    for name, (ns, ip, port) in {"a_other": (a.ns, a.ip, 9101), "a_ssh": (a.ns, a.ip, 22), "b_ssh": (b.ns, b.ip, 22),
                                 "gw_exporter": (lab.host, GATEWAY, EXPORTER_PORT),
                                 "gw_ssh": (lab.host, GATEWAY, 22)}.items():
        lab.listeners[name] = _tcp_listener(ns, ip, port)
        _accepting(lab.listeners[name])
    host_opens = {"a_exporter": (a.ip, EXPORTER_PORT), "a_other": (a.ip, 9101), "a_ssh": (a.ip, 22),
                  "b_exporter": (b.ip, EXPORTER_PORT), "b_ssh": (b.ip, 22)}
    guest_opens = {"a_to_gw_exporter": (a.ns, GATEWAY, EXPORTER_PORT), "a_to_gw_ssh": (a.ns, GATEWAY, 22),
                   "a_to_gw_http": (a.ns, GATEWAY, 8080), "b_to_a_exporter": (b.ns, a.ip, EXPORTER_PORT),
                   "b_to_gw_exporter": (b.ns, GATEWAY, EXPORTER_PORT)}

    def reach() -> dict:
        out = {k: tcp_reaches(lab.host, ip, port, source=GATEWAY) for k, (ip, port) in host_opens.items()}
        out.update(a_ping=host_pings(lab, a.ip), b_ping=host_pings(lab, b.ip))
        return {**out, **{k: tcp_reaches(ns, ip, port) for k, (ns, ip, port) in guest_opens.items()}}

    # unisolated: every probe succeeds (the guests answer an echo)
    assert reach() == {**{k: True for k in (*host_opens, *guest_opens)}, "a_ping": "answered", "b_ping": "answered"}
    assert lab.isolate(a, guest_telemetry=True)["exporter_open"]
    assert not lab.isolate(b)["exporter_open"]
    assert reach() == {"a_exporter": True, "a_other": False, "a_ssh": True, "b_exporter": False, "b_ssh": True,
                       "a_ping": "refused", "b_ping": "refused", **{k: False for k in guest_opens}}

    bounds = GuestPullBounds(max_bytes=64 * 1024, max_series=100, timeout_s=10.0, min_interval_s=0)
    puller = GuestPuller(bounds, source=IPv4Address(GATEWAY))

    def target(g: Guest) -> GuestTarget:
        return GuestTarget(allocation_id=g.allocation_id, slot_index=g.slot_index, ip=IPv4Address(g.ip),
                           port=EXPORTER_PORT, path="/metrics")

    pulled = lab.agent(lambda: puller.pull(target(a)))
    assert pulled.outcome == "ok", pulled
    assert [(s.name, s.value) for s in pulled.series] == [("node_load1", 0.5)]
    closed = GuestPuller(bounds.model_copy(update={"timeout_s": PROBE_TIMEOUT_S}), source=IPv4Address(GATEWAY))
    assert lab.agent(lambda: closed.pull(target(b))).outcome == "timeout"  # opt-out: the SYN never leaves the host

    # the lease's opt-in gone (re-isolated without it): A's exporter closes, SSH stays
    lab.isolate(a)
    assert not tcp_reaches(lab.host, a.ip, EXPORTER_PORT) and tcp_reaches(lab.host, a.ip, 22)
    # an opening nobody granted (B's IP added by hand) is reconcile's finding, closed by its repair
    store = _store_with_active(lab, tmp_path, opted=(a,))
    sh("ip", "netns", "exec", lab.host, "nft", "add", "element", "inet", "gpuaas_slice_guard", "exporter_guests",
       f"{{ {b.ip} }}")
    assert tcp_reaches(lab.host, b.ip, EXPORTER_PORT)  # the element is what opens the path
    report = lab.agent(lambda: reconcile(lab.sh, store, repair=True))
    found = {(f.kind, f.detail.get("exporter")): f for f in report.findings if f.detail.get("exporter")}
    assert set(found) == {(DriftKind.nft_guard_orphan, b.ip), (DriftKind.nft_guard_missing, a.ip)}, found
    assert all(f.repaired for f in found.values())
    assert not tcp_reaches(lab.host, b.ip, EXPORTER_PORT) and tcp_reaches(lab.host, a.ip, EXPORTER_PORT)
    assert not _kinds(lab.agent(lambda: reconcile(lab.sh, store, repair=False)))


def _iso(lab: IsoLab, g: Guest):
    port = lab.ports()[g.port]
    return port_isolation(bridge=port.bridge, port=port.name, allocation_id=g.allocation_id, slot_index=g.slot_index,
                          ofport=port.ofport, mac=g.mac, ip=g.ip)


def test_install_is_idempotent_and_unplug_removes_exactly_that_ports_flows_and_guard_entry(lab: IsoLab):
    lab.isolate(lab.a)
    lab.isolate(lab.b)
    first = lab.all_flows()
    lab.isolate(lab.a)  # again (after start): same rules, one bundle
    assert lab.all_flows() == first
    out = run_in_netns(lab.host, lambda: lab.sh.unplug(lab.sw.bridge, lab.a.port, lab.a.allocation_id))
    assert out["removed"] and out["flows_removed"] == len(expected_flows(_iso(lab, lab.b))) and out["nft_removed"]
    left = lab.all_flows()
    assert not [r for r in left if r.cookie == lab_cookie(lab.a)]
    assert [r for r in left if r.cookie == lab_cookie(lab.b)] == [r for r in first if r.cookie == lab_cookie(lab.b)]
    assert [r for r in left if r.cookie == 0x1234]
    guard = lab.agent(lambda: nft_guard(lab.sh).read())
    assert guard.guest_ports == [lab.b.port] and guard.rules_match
    # and again: nothing left to remove, nothing else touched
    again = run_in_netns(lab.host, lambda: lab.sh.unplug(lab.sw.bridge, lab.a.port, lab.a.allocation_id))
    assert again == {"port": lab.a.port, "removed": False, "flows_removed": 0, "nft_removed": False}
    assert lab.all_flows() == left


def lab_cookie(g: Guest) -> int:
    return port_cookie(g.allocation_id, g.slot_index)


@pytest.mark.parametrize("field", ["mac", "ip"])
def test_a_port_claiming_another_ports_mac_or_ip_is_refused_before_any_flow_is_written(lab: IsoLab, field: str):
    lab.isolate(lab.a)
    before = lab.all_flows()
    guard_before = lab.nft("-j", "list", "ruleset")
    b = lab.b
    mac, ip = (lab.a.mac, b.ip) if field == "mac" else (b.mac, lab.a.ip)
    port = lab.ports()[b.port]
    with pytest.raises(IsolationRefused) as refused:
        lab.agent(lambda: isolate_port(lab.sh, port, mac=mac, ip=ip))
    assert refused.value.code == "port_isolation_conflict"
    assert refused.value.evidence["field"] == field and refused.value.evidence["other_port"] == lab.a.port
    assert lab.all_flows() == before
    assert lab.nft("-j", "list", "ruleset") == guard_before


def test_a_port_claiming_another_ports_ofport_is_refused_before_any_flow_is_written(lab: IsoLab):
    lab.isolate(lab.a)
    before = lab.all_flows()
    port = lab.ports()[lab.b.port].model_copy(update={"ofport": lab.ports()[lab.a.port].ofport})
    with pytest.raises(IsolationRefused) as refused:
        lab.agent(lambda: isolate_port(lab.sh, port, mac=lab.b.mac, ip=lab.b.ip))
    assert refused.value.code == "port_isolation_conflict"
    assert refused.value.evidence["field"] == "ofport" and refused.value.evidence["other_port"] == lab.a.port
    assert lab.all_flows() == before


def test_foreign_rules_naming_a_guests_mac_are_no_conflict_and_survive_install_remove_and_repair(lab: IsoLab,
                                                                                             tmp_path: Path):
    """An operator's own flows (no agent tag in the cookie) are never read as a claim, changed or deleted."""
    mgmt = _mgmt(lab.sw)
    foreign = [f"cookie=0x77,priority=200,dl_src={lab.a.mac},actions=drop",
               f"cookie=0x0,priority=5,ip,nw_dst={lab.b.ip},actions=NORMAL"]
    for flow in foreign:
        sh("ovs-ofctl", "add-flow", mgmt, flow)
    try:
        def theirs():
            return sorted((r for r in lab.all_flows() if r.cookie >> 48 != 0x6773), key=repr)

        before = theirs()
        assert len(before) >= 3  # the two above and the lab's FOREIGN_FLOW
        store = _store_with_active(lab, tmp_path)
        lab.isolate(lab.a)  # the foreign dl_src rule is not another port's claim on A's MAC
        lab.isolate(lab.b)
        lab.sw.restart_vswitchd()
        for flow in (*foreign, FOREIGN_FLOW):  # an operator's own flows come back by the operator's hand
            sh("ovs-ofctl", "add-flow", mgmt, flow)
        report = lab.agent(lambda: reconcile(lab.sh, store, repair=True))
        assert {f.kind for f in report.findings if f.kind.value.startswith("flows")} == {DriftKind.flows_missing}
        run_in_netns(lab.host, lambda: lab.sh.unplug(lab.sw.bridge, lab.a.port, lab.a.allocation_id))
        assert theirs() == before
    finally:
        sh("ovs-ofctl", "del-flows", mgmt, "cookie=0x77/-1")
        sh("ovs-ofctl", "--strict", "del-flows", mgmt, f"priority=5,ip,nw_dst={lab.b.ip}")


def _store_with_active(lab: IsoLab, tmp: Path, *, opted: tuple[Guest, ...] = ()) -> StateStore:
    """Both guests' slots leased and active; ``opted``: the guests whose allocation asked for guest telemetry."""
    store = StateStore.open(tmp / "state.db")
    for i, g in enumerate((lab.a, lab.b)):
        store.take_lease(SlotLease(allocation_id=g.allocation_id, slot_index=g.slot_index,
                                   gpu_pci_address=f"0000:1{i}:00.0", nvme_device=f"/dev/disk/by-id/nvme-test{i}",
                                   disk_identity=f"path:/dev/disk/by-id/nvme-test{i}",
                                   fabric_vf_pci_address=f"0000:2{i}:00.1", task_id=f"t{i}", taken_at=time.time(),
                                   guest_telemetry=g in opted))
        store.set_slot_state(SlotRecord(slot_index=g.slot_index, allocation_id=g.allocation_id,
                                        status=SlotStatus.active, health_state=HealthState.healthy, task_id=f"t{i}",
                                        updated_at=time.time()))
    return store


def _kinds(report) -> dict:
    return {(f.kind, f.subject): f for f in report.findings if f.kind.value.startswith(("flows", "nft_guard"))}


def test_vswitchd_restart_loses_the_flows_and_reconcile_reports_and_restores_them(lab: IsoLab, tmp_path: Path):
    store = _store_with_active(lab, tmp_path)
    lab.isolate(lab.a)
    lab.isolate(lab.b)
    clean = lab.agent(lambda: reconcile(lab.sh, store, repair=False))
    assert _kinds(clean) == {}
    ours = [r for r in lab.all_flows() if r.cookie >> 48 == 0x6773]

    lab.sw.restart_vswitchd()
    assert not [r for r in lab.all_flows() if r.cookie != 0]  # OpenFlow rules do not survive vswitchd
    assert ip_spoof_reaches_gateway(lab)  # and A is open again

    report = lab.agent(lambda: reconcile(lab.sh, store, repair=True))
    found = _kinds(report)
    assert set(found) == {(DriftKind.flows_missing, lab.a.allocation_id),
                          (DriftKind.flows_missing, lab.b.allocation_id)}
    assert all(f.repaired for f in found.values())
    assert sorted((r for r in lab.all_flows() if r.cookie >> 48 == 0x6773), key=repr) == sorted(ours, key=repr)
    assert spoof_probes(lab) == {k: False for k in ATTACKS}
    assert _kinds(lab.agent(lambda: reconcile(lab.sh, store, repair=False))) == {}


def test_reconcile_reports_altered_flows_and_guard_and_removes_orphans(lab: IsoLab, tmp_path: Path):
    store = _store_with_active(lab, tmp_path)
    lab.isolate(lab.a)
    lab.isolate(lab.b)
    mgmt = _mgmt(lab.sw)
    # an operator loosens A's drop-all; an old slot's flows and guard entry linger; B's guard entry is lost
    sh("ovs-ofctl", "--strict", "mod-flows", mgmt,
       f"cookie={lab_cookie(lab.a):#x}/-1,priority=100,in_port={lab.ports()[lab.a.port].ofport},actions=NORMAL")
    stale = "gs7-99999999aa"
    stale_cookie = cookie_of_port_name(stale)
    sh("ovs-ofctl", "add-flow", mgmt, f"cookie={stale_cookie:#x},priority=100,in_port=99,actions=drop")
    sh("ip", "netns", "exec", lab.host, "nft", "add", "element", "inet", "gpuaas_slice_guard", "guest_ports",
       f"{{ {stale} }}")
    sh("ip", "netns", "exec", lab.host, "nft", "delete", "element", "arp", "gpuaas_slice_guard", "guest_ports",
       f"{{ {lab.b.port} }}")

    report = lab.agent(lambda: reconcile(lab.sh, store, repair=False))
    found = _kinds(report)
    assert set(found) == {(DriftKind.flows_altered, lab.a.allocation_id), (DriftKind.flows_orphan, stale),
                          (DriftKind.nft_guard_altered, "gpuaas_slice_guard"),
                          (DriftKind.nft_guard_missing, lab.b.allocation_id), (DriftKind.nft_guard_orphan, stale)}
    assert not any(f.repaired for f in found.values())

    repaired = _kinds(lab.agent(lambda: reconcile(lab.sh, store, repair=True)))
    assert set(repaired) == set(found) and all(f.repaired for f in repaired.values()), repaired
    assert _kinds(lab.agent(lambda: reconcile(lab.sh, store, repair=False))) == {}
    assert [r for r in lab.all_flows() if r.cookie == 0x1234]
    assert not spoof_probes(lab)["ip_spoof"]


# -- pure: cookies, the rules, the dump parser --------------------------------------------------------------


def test_cookie_names_its_port_both_ways_and_carries_the_agent_tag():
    cookie = port_cookie(A1, 0x2A)
    assert cookie >> 48 == 0x6773 and port_name_of_cookie(cookie) == vnic_name(A1, 0x2A)
    assert cookie_of_port_name(vnic_name(A1, 0x2A)) == cookie
    assert cookie_of_port_name("vnet3") is None and port_name_of_cookie(0x1234) is None


def test_a_port_whose_ofport_is_unknown_is_closed_by_mac_alone():
    iso = port_isolation(bridge="ovsbr0", port=vnic_name(A1, 0), allocation_id=A1, slot_index=0, ofport=None,
                         mac="52:54:00:0a:00:0a", ip="10.100.0.10")
    assert {(r.priority, r.match, r.actions) for r in expected_flows(iso)} == {
        (80, ("dl_dst=52:54:00:0a:00:0a",), "drop"), (70, ("dl_src=52:54:00:0a:00:0a",), "drop")}


def test_dump_parser_reads_ovs_ofctl_lines_and_fails_loudly_on_garbage():
    text = ("NXST_FLOW reply (xid=0x4):\n"
            " cookie=0x6773001111aaaa22, priority=110,ip,in_port=1,dl_src=52:54:00:12:34:56,nw_src=10.100.0.10 "
            "actions=LOCAL\n"
            " cookie=0x1, table=3, priority=5 actions=output:1,output:2\n"
            " priority=0 actions=NORMAL\n")
    rules = parse_dump(text)
    assert FlowRule(cookie=0x6773001111aaaa22, priority=110, actions="LOCAL",
                    match=("dl_src=52:54:00:12:34:56", "in_port=1", "ip", "nw_src=10.100.0.10")) in rules
    assert FlowRule(cookie=1, table=3, priority=5, match=(), actions="output:1,output:2") in rules
    assert FlowRule(cookie=0, priority=0, match=(), actions="NORMAL") in rules
    from gpuaas_agent.errors import HostError
    with pytest.raises(HostError):
        parse_dump("what is this\n")


@pytest.mark.parametrize("bad", [{"mac": "53:54:00:00:00:01"}, {"ip": "0.0.0.0"}, {"ofport": 0xFFFE},
                                 {"port": "gs0-2222bbbb33"}])
def test_port_isolation_refuses_what_cannot_be_a_guest_port(bad):
    from gpuaas_agent.host.network.portflows import IsolationInputError
    fields = dict(bridge="ovsbr0", port=vnic_name(A1, 0), allocation_id=A1, slot_index=0, ofport=3,
                  mac="52:54:00:0a:00:0a", ip="10.100.0.10")
    with pytest.raises(IsolationInputError):
        port_isolation(**{**fields, **bad})


def test_flow_state_of_a_port_with_nothing_installed_is_missing():
    from gpuaas_agent.host.network.portflows import compare_flows
    iso = port_isolation(bridge="ovsbr0", port=vnic_name(A1, 0), allocation_id=A1, slot_index=0, ofport=3,
                         mac="52:54:00:0a:00:0a", ip="10.100.0.10")
    assert compare_flows(iso, []).state is FlowState.missing
    assert compare_flows(iso, expected_flows(iso)).state is FlowState.ok
    assert compare_flows(iso, expected_flows(iso)[1:]).state is FlowState.altered


def test_port_flows_rejects_a_cookie_without_the_agent_tag():
    from gpuaas_agent.host.network.portflows import IsolationInputError
    with pytest.raises(IsolationInputError):
        asyncio.run(PortFlows(Path("/nonexistent")).remove("ovsbr0", 0x1234))



def test_after_a_vswitchd_restart_the_network_watch_degrades_port_isolation_repairs_at_once_and_reports_it(
        lab: IsoLab, tmp_path: Path):
    """The daemon's watch (operator/netwatch.py) with its real probe and repair: no wait for the reconcile timer."""
    from gpuaas_agent.contract.drift import DriftReport, DriftTrigger
    from gpuaas_agent.operator.health import CheckThreads, HealthSettings, isolation_check
    from gpuaas_agent.operator.netwatch import NetWatch

    store = _store_with_active(lab, tmp_path)
    lab.isolate(lab.a)
    lab.isolate(lab.b)
    ours = sorted((r for r in lab.all_flows() if r.cookie >> 48 == 0x6773), key=repr)
    lab.sw.restart_vswitchd()
    assert ip_spoof_reaches_gateway(lab)

    class Heartbeats:  # the reporter's side the watch uses: its checks, and a heartbeat sent now
        checks: list = []
        sent = 0

        async def tick(self) -> None:
            self.sent += 1

    published: list[DriftReport] = []
    repairs: list[int] = []

    async def publish(subject: str, data: bytes) -> None:
        published.append(DriftReport.model_validate_json(data))

    async def probe():
        return [isolation_check((await reconcile(lab.sh, store, repair=False)).findings)]

    async def repair():
        report = await reconcile(lab.sh, store, repair=True)
        repairs.append(sum(f.repaired for f in report.findings))
        return repairs[-1]

    beats = Heartbeats()
    watch = NetWatch(HealthSettings(host_root=Path("/"), subnet=str(SUBNET), ovs_bridge=lab.sw.bridge, netns=lab.host),
                     beats, interval_s=1, isolation=probe, publish=publish, subject="gpuaas.node.test.drift",
                     repair=repair, threads=CheckThreads())

    async def two_rounds():
        return await watch.round(DriftTrigger.timer), await watch.round(DriftTrigger.netlink)

    first, second = lab.agent(two_rounds)
    opened = [f for f in first if f.subject == "port_isolation"]
    assert [f.kind for f in opened] == [DriftKind.slice_network_degraded] and "flows_missing" in opened[0].actual
    assert repairs == [2]  # both ports' rules reinstalled by the repairing reconcile, at once
    assert sorted((r for r in lab.all_flows() if r.cookie >> 48 == 0x6773), key=repr) == ours
    assert not ip_spoof_reaches_gateway(lab)
    assert [f.kind for f in second if f.subject == "port_isolation"] == [DriftKind.slice_network_restored]
    kinds = [(f.kind, f.subject) for r in published for f in r.findings if f.subject == "port_isolation"]
    assert kinds == [(DriftKind.slice_network_degraded, "port_isolation"),
                     (DriftKind.slice_network_restored, "port_isolation")]
    assert beats.sent == 2 and watch.repairs == 1
    assert next(c for c in beats.checks if c.name == "port_isolation").status == "ok"
