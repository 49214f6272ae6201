"""A real DHCP lab for tests: network namespaces, veth pairs, dnsmasq in the foreground, busybox udhcpc, dropbear.

Import the fixture into a test module (``from tests.support.dnsmasq_fixture import dhcp_lab``).
Namespace A (the "host") holds ``10.100.0.1/24`` and dnsmasq serving
``10.100.0.0/24`` to reserved MACs only (``--dhcp-range=...,static``); namespace
B (the "guest") holds the peer veth, whose MAC a test sets to the reserved one.
Every process is started with Popen in the foreground and stopped by its PID;
namespaces (and the veths in them) are deleted at teardown, also when a test
fails. Needs root, ``ip``, ``dnsmasq``, ``busybox`` and ``dropbear``: it FAILS
(never skips) without them.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import fcntl
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.daemons import stop_pid
from tests.support.tiers import starts

SUBNET = IPv4Network("10.100.0.0/24")
GATEWAY = IPv4Address("10.100.0.1")
CLONE_NEWNET = 0x40000000
CMD_TIMEOUT_S = 30
_T = TypeVar("_T")


def sh(*argv: str, timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run a setup command: argv list, deadline, output captured, failure shown with stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("DHCP lab tests need root (ip netns, dnsmasq); run them as root", pytrace=False)


def wait_until(predicate: Callable[[], _T], what: str, timeout_s: float = 10.0, interval_s: float = 0.02) -> _T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def call_in_netns(netns: str, fn: Callable[[], _T], timeout_s: float = 60.0) -> _T:
    """Run ``fn()`` in a thread that has entered ``netns`` (setns is per thread); return or raise what it did.

    The test process itself stays in the root namespace; sockets ``fn`` opens live in ``netns``.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(f"call in netns {netns} did not finish within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def run_in_netns(netns: str, coro_factory: Callable[[], Coroutine[Any, Any, _T]], timeout_s: float = 60.0) -> _T:
    """``asyncio.run(coro_factory())`` on a fresh event loop in a thread inside ``netns``."""
    return call_in_netns(netns, lambda: asyncio.run(coro_factory()), timeout_s)


SIOCETHTOOL = 0x8946
ETHTOOL_GTXCSUM, ETHTOOL_STXCSUM = 0x16, 0x17


def _ethtool_value(sock: socket.socket, iface: str, cmd: int, data: int = 0) -> int:
    buf = array.array("B", struct.pack("II", cmd, data))  # struct ethtool_value
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, struct.pack("16sP", iface.encode(), buf.buffer_info()[0]))
    return struct.unpack("II", buf.tobytes())[1]


def disable_tx_checksum(netns: str, iface: str) -> None:
    """``ethtool -K IF tx off`` (no ethtool binary here): the kernel fills in checksums before a frame leaves.

    Needed for a sender whose frames cross the OVS userspace datapath: vswitchd re-sends them with a raw
    socket, which drops the "checksum still to be done" mark of veth offload, so they arrive with the
    partial checksum and the receiver (udhcpc checks UDP checksums) discards them.
    """

    def off() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            _ethtool_value(sock, iface, ETHTOOL_STXCSUM, 0)
            return _ethtool_value(sock, iface, ETHTOOL_GTXCSUM)

    assert call_in_netns(netns, off) == 0, f"tx checksum offload still on for {iface} in {netns}"


@dataclass
@starts("netns")
class Dnsmasq:
    """A dnsmasq serving ``subnet`` on ``iface`` inside ``netns``, its files in ``workdir``."""

    netns: str
    iface: str
    workdir: Path
    subnet: IPv4Network = SUBNET
    gateway: IPv4Address = GATEWAY
    proc: subprocess.Popen | None = None

    @property
    def hosts_file(self) -> Path:
        return self.workdir / "dhcp-hosts"

    @property
    def lease_file(self) -> Path:
        return self.workdir / "dnsmasq.leases"

    @property
    def pid_file(self) -> Path:
        return self.workdir / "dnsmasq.pid"

    @property
    def log_file(self) -> Path:
        return self.workdir / "dnsmasq.log"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts_file.touch()
        argv = [
            "ip", "netns", "exec", self.netns,  # ip execs dnsmasq: the Popen pid is dnsmasq's pid
            "dnsmasq", "--keep-in-foreground", "--user=root", "--conf-file=/dev/null", "--port=0",
            f"--interface={self.iface}", "--bind-interfaces", "--log-dhcp", "--log-facility=-",
            f"--dhcp-range={self.subnet.network_address},static,{self.subnet.netmask},1h",
            f"--dhcp-hostsfile={self.hosts_file}", f"--dhcp-leasefile={self.lease_file}",
            f"--pid-file={self.pid_file}",
        ]
        log = open(self.log_file, "wb")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"dnsmasq exited {self.proc.returncode}: {self.log()}")
            return self.pid_file.exists() and self.pid_file.read_text().strip() == str(self.proc.pid)

        wait_until(ready, "dnsmasq to write its pid file")
        comm = Path(f"/proc/{self.proc.pid}/comm").read_text().strip()
        assert comm == "dnsmasq", f"pid {self.proc.pid} is {comm!r}"
        # dnsmasq ignores SIGHUP until its start-up is over, and the pid file is written before that: it is
        # ready for reloads once a SIGHUP has made it re-read the hosts file.
        deadline = time.monotonic() + 10
        while True:
            before = self.reads()
            os.kill(self.proc.pid, signal.SIGHUP)
            try:
                self.wait_reread(before, timeout_s=0.5)
                return
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise AssertionError(f"dnsmasq never re-read its hosts file on SIGHUP: {self.log()}") from None

    def reads(self) -> int:
        """How many times dnsmasq has logged reading the hosts file."""
        return self.log().count(f"read {self.hosts_file}\n")

    def wait_reread(self, before: int, timeout_s: float = 10.0) -> None:
        """Block until dnsmasq has read the hosts file more than ``before`` times (take ``reads()`` before SIGHUP)."""
        wait_until(lambda: self.reads() > before, f"dnsmasq to re-read {self.hosts_file}", timeout_s)

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)


@dataclass
@starts("netns")
class NetLab:
    """Namespaces and veths made for one test, deleted in reverse order at teardown (by name)."""

    tmp: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    namespaces: list[str] = field(default_factory=list)
    root_links: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def netns(self, role: str) -> str:
        name = f"gpt-{role}-{self.tag}"
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def veth(self, name: str, netns: str | None, peer: str, peer_netns: str | None) -> None:
        """A veth pair created directly in its namespaces (``None``: the root namespace)."""
        argv = ["ip", "link", "add", name]
        if netns:
            argv += ["netns", netns]
        argv += ["type", "veth", "peer", "name", peer]
        if peer_netns:
            argv += ["netns", peer_netns]
        sh(*argv)
        for n, ns in ((name, netns), (peer, peer_netns)):
            if ns is None:
                self.root_links.append(n)

    def up(self, netns: str | None, iface: str, *, address: str | None = None, mac: str | None = None) -> None:
        ip = ["ip", "-n", netns] if netns else ["ip"]
        if mac:
            sh(*ip, "link", "set", iface, "down")
            sh(*ip, "link", "set", iface, "address", mac)
        if address:
            sh(*ip, "addr", "add", address, "dev", iface)
        sh(*ip, "link", "set", iface, "up")

    def popen(self, netns: str, argv: list[str], log: Path) -> subprocess.Popen:
        """A foreground daemon inside ``netns``, remembered so teardown stops it by PID."""
        with open(log, "wb") as fh:
            proc = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT)
        self.processes.append(proc)
        return proc

    def cleanup(self) -> list[str]:
        problems = []
        for proc in reversed(self.processes):
            stop_pid(proc)
        for link in reversed(self.root_links):
            if sh("ip", "link", "show", link, check=False).returncode == 0:
                r = sh("ip", "link", "del", link, check=False)
                if r.returncode != 0:
                    problems.append(f"ip link del {link}: {r.stderr.strip()}")
        for ns in reversed(self.namespaces):
            r = sh("ip", "netns", "del", ns, check=False)
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        return problems


def udhcpc(netns: str, iface: str, *, tries: int = 3, timeout_s: float = 30) -> str | None:
    """One busybox DHCP exchange from ``iface`` in ``netns``: the leased IP, or None when no server answered."""
    proc = sh("ip", "netns", "exec", netns, "busybox", "udhcpc", "-i", iface, "-n", "-q", "-f", "-t", str(tries),
              "-T", "1", "-s", "/bin/true", timeout=timeout_s, check=False)
    out = proc.stdout + proc.stderr
    m = re.search(r"lease of (\d+\.\d+\.\d+\.\d+) obtained", out)
    if proc.returncode == 0:
        assert m, f"udhcpc succeeded without a lease line: {out}"
        return m.group(1)
    assert "no lease" in out, f"udhcpc failed for another reason ({proc.returncode}): {out}"
    return None


@dataclass
class DhcpLab:
    """Namespace ``server`` with dnsmasq on ``server_if`` (10.100.0.1/24); namespace ``client`` with ``client_if``."""

    net: NetLab
    server: str
    client: str
    server_if: str
    client_if: str
    dnsmasq: Dnsmasq

    def set_client_mac(self, mac: str) -> None:
        self.net.up(self.client, self.client_if, mac=mac)

    def lease(self, tries: int = 3) -> str | None:
        return udhcpc(self.client, self.client_if, tries=tries)

    def masquerade(self) -> list[str]:
        """The slice subnet's NAT in the server namespace, forwarding on, as a host baseline leaves it: the
        ``iptables -t nat`` rule (without ``-A``/``-D``), for a test that deletes and restores it."""
        rule = ["POSTROUTING", "-s", "10.100.0.0/24", "-j", "MASQUERADE"]
        sh("ip", "netns", "exec", self.server, "iptables", "-t", "nat", "-A", *rule)
        sh("ip", "netns", "exec", self.server, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        return rule

    def agent_slice(self) -> dict[str, str]:
        """The agent config's ``slice`` section for this lab: its bridge port and dnsmasq, libvirt's test driver."""
        return {"libvirt_uri": "test:///default", "ovs_bridge": self.server_if,
                "dnsmasq_hosts_file": str(self.dnsmasq.hosts_file), "dnsmasq_pid_file": str(self.dnsmasq.pid_file)}

    def dropbear(self, ip: str, port: int = 22) -> subprocess.Popen:
        """A real SSH server in the client namespace listening on ``ip:port`` (the guest's sshd)."""
        key = self.net.tmp / "dropbear_ed25519"
        if not key.exists():
            sh("dropbearkey", "-t", "ed25519", "-f", str(key))
        return self.net.popen(self.client, ["dropbear", "-F", "-E", "-p", f"{ip}:{port}", "-r", str(key)],
                              self.net.tmp / "dropbear.log")


def build_direct_lab(net: NetLab) -> DhcpLab:
    server, client = net.netns("a"), net.netns("b")
    net.veth("hostside", server, "guestside", client)
    net.up(server, "hostside", address=f"{GATEWAY}/{SUBNET.prefixlen}")
    net.up(client, "guestside")
    dnsmasq = Dnsmasq(netns=server, iface="hostside", workdir=net.tmp / "dnsmasq")
    net_dnsmasq_start(net, dnsmasq)
    return DhcpLab(net=net, server=server, client=client, server_if="hostside", client_if="guestside",
                   dnsmasq=dnsmasq)


def net_dnsmasq_start(net: NetLab, dnsmasq: Dnsmasq) -> None:
    """Start dnsmasq and hand its Popen to the lab so teardown stops it by PID even if a test fails."""
    dnsmasq.start()
    assert dnsmasq.proc is not None
    net.processes.append(dnsmasq.proc)


@pytest.fixture
@starts("netns")
def net_lab(tmp_path: Path) -> Iterator[NetLab]:
    require_root()
    for tool in ("ip", "dnsmasq", "busybox", "dropbear", "dropbearkey"):
        if sh("which", tool, check=False).returncode != 0:
            pytest.fail(f"{tool} is not installed; the DHCP lab needs it", pytrace=False)
    net = NetLab(tmp=tmp_path)
    try:
        yield net
    finally:
        problems = net.cleanup()
        assert not problems, problems


@pytest.fixture
@starts("netns")
def dhcp_lab(net_lab: NetLab) -> DhcpLab:
    return build_direct_lab(net_lab)
