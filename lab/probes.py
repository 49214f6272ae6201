"""Network isolation probes with real guests (issue 16 item 3): what tenant A may and may not do on the bridge.

Tenant A is an attacker with root in its own VM (the tenant key logs in as root on
the lab guest, as ``sudo`` would on a real image). Every probe runs commands in A
over SSH from the host side (the way readiness reaches a guest), using the lab
guest's busybox applets (``ip``, ``ping``, ``nc``, ``arping``), and judges the outcome
from evidence outside A where one exists (the host's and B's neighbour tables, the
upstream listener's log, a listener on the gateway address):

=====================  =======  ============================================================
probe                  expect   how
=====================  =======  ============================================================
ssh_to_a               allowed  a command runs in A
dhcp_lease_a           allowed  dnsmasq's lease of A's MAC holds A's IP, and A's NIC has it
egress_nat             allowed  A reaches the upstream listener; it saw the NAT'd address
reach_b_icmp           blocked  A pings B (the host reads B's SSH banner: control)
host_icmp_b            blocked  the host pings B: the guard's host_output drops ICMP echo (the host
                                reads B's SSH banner: control)
reach_b_tcp            blocked  A connects to B's SSH (the host gets its banner: control)
host_service_gateway   blocked  A connects to a TCP listener on the gateway address
take_b_ip              blocked  A adds B's IP and pings the gateway from it; the host's
                                neighbour entry of B stays B's MAC
arp_spoof_b            blocked  A announces B's IP (arping -U); the host's entry stays B's
arp_spoof_gateway      blocked  A announces the gateway's IP; B's entry stays the bridge's
take_b_mac             blocked  A takes B's MAC and pings the gateway; B stays reachable
=====================  =======  ============================================================

The MAC and gateway probes cut A's own SSH path while they run, so they run detached
in A and their result is read back over a new connection once A restored itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from gpuaas_agent.host.network.dnsmasq import lease_status
from gpuaas_agent.host.network.readiness import wait_for_ssh

SSH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Guest:
    ip: str
    mac: str


@dataclass
class Probe:
    name: str
    expect: str  # "blocked" or "allowed"
    ok: bool
    detail: str

    def line(self) -> str:
        return (f"GPUAAS_LAB probe name={self.name} expect={self.expect} result={'ok' if self.ok else 'FAIL'} "
                f"detail={json.dumps(self.detail)}")


def _host(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


def host_neighbour(bridge: str, ip: str) -> str | None:
    """The host's neighbour entry for ``ip`` on the bridge: its MAC, or None."""
    for entry in json.loads(_host("ip", "-j", "neigh", "show", ip, "dev", bridge).stdout or "[]"):
        return entry.get("lladdr")
    return None


class GuestShell:
    """Commands in a guest over SSH as root with the tenant key; reconnects when a probe cut the session."""

    def __init__(self, guest: Guest, key_file: Path) -> None:
        self.guest, self.key_file = guest, key_file
        self.conn: asyncssh.SSHClientConnection | None = None

    async def connect(self, within_s: float = SSH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + within_s
        while True:
            try:
                self.conn = await asyncio.wait_for(asyncssh.connect(
                    self.guest.ip, username="root", client_keys=[str(self.key_file)], known_hosts=None), 20)
                return
            except (OSError, asyncssh.Error, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)  # poll step of a deadline wait

    async def run(self, command: str, timeout: float = 60) -> tuple[int, str]:
        if self.conn is None:
            await self.connect()
        done = await self.conn.run(command, check=False, timeout=timeout)
        return done.exit_status if done.exit_status is not None else -1, f"{done.stdout}{done.stderr}"

    async def detached(self, script: str, out: str, within_s: float = 90) -> str:
        """Run ``script`` detached (it may cut the network), then read ``out`` once it says ``done``."""
        await self.run(f"rm -f {out}; (sh -c {shlex.quote(script)} >{out} 2>&1; echo done >>{out}) "
                       "</dev/null >/dev/null 2>&1 &", timeout=30)
        self.close()
        deadline = time.monotonic() + within_s
        while True:
            try:
                await self.connect(within_s=max(5, deadline - time.monotonic()))
                _, text = await self.run(f"cat {out} 2>/dev/null", timeout=20)
                if text.rstrip().endswith("done"):
                    return text
            except (OSError, asyncssh.Error, TimeoutError):
                self.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"detached probe in {self.guest.ip} did not finish within {within_s}s")
            await asyncio.sleep(1)  # poll step of a deadline wait

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _rc(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("rc="):
            return int(line[3:])
    return None


async def run_probes(lab, a: Guest, b: Guest) -> list[Probe]:
    """Every probe of the table above, in order; never raises for a probe's failure (it becomes FAIL)."""
    gw, bridge, key = lab.gateway, lab.bridge, lab.tenant_key_file
    bridge_mac = Path(f"/sys/class/net/{bridge}/address").read_text().strip()
    shell_a, shell_b = GuestShell(a, key), GuestShell(b, key)
    probes: list[Probe] = []

    async def probe(name: str, expect: str, body) -> None:
        try:
            ok, detail = await body()
        except Exception as exc:
            ok, detail = False, f"probe raised {type(exc).__name__}: {exc}"
        probes.append(Probe(name, expect, ok, detail))
        lab.say(probes[-1].line())

    try:
        await shell_a.connect()
        _, ifname = await shell_a.run("ls /sys/class/net | grep -v '^lo$' | head -n1")
        ifname = ifname.strip()

        async def ssh_to_a():
            rc, out = await shell_a.run("echo gpuaas-probe-$((40 + 2))")
            return rc == 0 and "gpuaas-probe-42" in out, out.strip()

        async def dhcp_lease_a():
            status = lease_status(lab.work / "dnsmasq/leases", a.mac, a.ip)
            _, out = await shell_a.run(f"ip -4 -o addr show dev {ifname}")
            return status.lease_state.value == "bound" and f" {a.ip}/" in out, \
                f"lease={status.lease_state.value} guest: {out.strip()}"

        async def egress_nat():
            up = lab.upstream
            before = len(up.peers())
            _, out = await shell_a.run(f"nc -w 5 {up.peer_ip} {up.port} </dev/null")
            seen = up.peers()[before:]
            ok = f"peer={up.host_ip}" in out and seen and all(p == up.host_ip for p in seen) and a.ip not in seen
            return bool(ok), f"guest read {out.strip()!r}; listener saw {seen}"

        async def b_banner() -> str:
            """B's SSH banner read by the host: B is up and reachable, and the host holds B's neighbour entry
            (not a ping: the guard drops the host's ICMP echo to a guest, host_icmp_b)."""
            return await wait_for_ssh(b.ip, deadline=asyncio.get_running_loop().time() + 30)

        async def reach_b_icmp():
            banner = await b_banner()
            rc, _ = await shell_a.run(f"ping -c 2 -W 2 {b.ip}")
            return rc != 0, f"host read B's banner {banner!r}; A->B ping rc={rc}"

        async def host_icmp_b():
            banner = await b_banner()
            done = _host("busybox", "ping", "-c", "1", "-W", "3", b.ip)
            said = (done.stdout + done.stderr).strip()
            # refused by the host's own output hook (EPERM at once), not merely unanswered
            return done.returncode != 0 and "Operation not permitted" in said, \
                f"host read B's banner {banner!r}; host->B ping rc={done.returncode} {said[-80:]!r}"

        async def reach_b_tcp():
            banner = await wait_for_ssh(b.ip, deadline=asyncio.get_running_loop().time() + 30)
            _, out = await shell_a.run(f"nc -w 3 {b.ip} 22 </dev/null")
            return "SSH-2.0" not in out, f"host read B's banner {banner!r}; A read {out.strip()[:80]!r}"

        async def host_service_gateway():
            seen: list[str] = []

            async def handle(reader, writer):
                seen.append(writer.get_extra_info("peername")[0])
                writer.write(b"GPUAAS-HOST-SERVICE\n")
                with contextlib.suppress(Exception):
                    await writer.drain()
                writer.close()

            server = await asyncio.start_server(handle, gw, 0)
            port = server.sockets[0].getsockname()[1]
            try:
                _, out = await shell_a.run(f"nc -w 3 {gw} {port} </dev/null")
            finally:
                server.close()
                await server.wait_closed()
            return "GPUAAS-HOST-SERVICE" not in out and not seen, \
                f"listener {gw}:{port} accepted {seen}; A read {out.strip()[:80]!r}"

        async def take_b_ip():
            await b_banner()  # the host's entry of B exists and is B's
            _, out = await shell_a.run(
                f"ip addr add {b.ip}/32 dev {ifname}; ping -c 3 -W 2 -I {b.ip} {gw}; echo rc=$?; "
                f"ip addr del {b.ip}/32 dev {ifname}")
            mac = host_neighbour(bridge, b.ip)
            return _rc(out) not in (0, None) and mac in (b.mac, None), \
                f"A ping from B's IP rc={_rc(out)}; host neigh {b.ip} -> {mac} (B is {b.mac})"

        async def arp_spoof_b():
            await b_banner()
            _, out = await shell_a.run(
                f"ip addr add {b.ip}/32 dev {ifname}; arping -U -c 3 -w 4 -I {ifname} {b.ip}; echo rc=$?; "
                f"ip addr del {b.ip}/32 dev {ifname}")
            mac = host_neighbour(bridge, b.ip)
            sent = "Sent 3" in out or "sent 3" in out.lower()
            return sent and mac in (b.mac, None), f"arping sent={sent}; host neigh {b.ip} -> {mac} (B is {b.mac})"

        async def arp_spoof_gateway():
            await shell_b.run(f"ping -c 1 -W 3 {gw}")  # B's entry of the gateway exists and is the bridge's
            out = await shell_a.detached(
                f"ip addr add {gw}/32 dev {ifname}; arping -U -c 3 -w 4 -I {ifname} {gw}; echo rc=$?; "
                f"ip addr del {gw}/32 dev {ifname}; ip route replace default via {gw} dev {ifname}", "/tmp/arp-gw.out")
            _, neigh = await shell_b.run(f"ip neigh show {gw}")
            sent = "Sent 3" in out
            return sent and bridge_mac in neigh and a.mac not in neigh, \
                f"arping sent={sent}; B's neigh: {neigh.strip()} (bridge {bridge_mac}, A {a.mac})"

        async def take_b_mac():
            out = await shell_a.detached(
                f"ip link set {ifname} down; ip link set {ifname} address {b.mac}; ip link set {ifname} up; "
                f"ip route replace default via {gw} dev {ifname}; ping -c 3 -W 2 {gw}; echo rc=$?; "
                f"ip link set {ifname} down; ip link set {ifname} address {a.mac}; ip link set {ifname} up; "
                f"ip route replace default via {gw} dev {ifname}", "/tmp/take-mac.out")
            banner = await wait_for_ssh(b.ip, deadline=asyncio.get_running_loop().time() + 30)
            mac = host_neighbour(bridge, b.ip)
            return _rc(out) not in (0, None) and mac in (b.mac, None), \
                f"A ping with B's MAC rc={_rc(out)}; B still answers {banner!r}; host neigh {b.ip} -> {mac}"

        for name, expect, body in (
            ("ssh_to_a", "allowed", ssh_to_a), ("dhcp_lease_a", "allowed", dhcp_lease_a),
            ("egress_nat", "allowed", egress_nat), ("reach_b_icmp", "blocked", reach_b_icmp),
            ("host_icmp_b", "blocked", host_icmp_b),
            ("reach_b_tcp", "blocked", reach_b_tcp), ("host_service_gateway", "blocked", host_service_gateway),
            ("take_b_ip", "blocked", take_b_ip), ("arp_spoof_b", "blocked", arp_spoof_b),
            ("arp_spoof_gateway", "blocked", arp_spoof_gateway), ("take_b_mac", "blocked", take_b_mac),
        ):
            await probe(name, expect, body)
    finally:
        shell_a.close()
        shell_b.close()
    return probes
