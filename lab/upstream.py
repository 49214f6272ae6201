"""The lab's "internet": a network namespace beyond the slice NAT, with a TCP listener that logs who connected.

Why: the slice network must be proven end to end (issue 16): a guest's egress leaves
through the host's ``MASQUERADE`` rule, and only then reaches anything. The upstream
namespace has a route to its veth peer only, never to the slice subnet, so a packet
that left *without* NAT gets no answer (as on a real uplink).

Set up in the root namespace, undone by :meth:`Upstream.close` (also on failure):

- ``ip_forward=1`` (the previous value is restored);
- ``iptables -t nat -A POSTROUTING -s <subnet> -j MASQUERADE`` (seed 004's rule, exactly
  the one the agent's checks look for);
- a veth pair to the namespace: ``<host>/30`` on the host end, ``<peer>/30`` inside;
- the listener (``lab/upstream.py --serve``) inside the namespace on ``<peer>:<port>``:
  it answers ``GPUAAS-UPSTREAM peer=<address it saw>`` and appends that address to its log.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from pathlib import Path

PORT = 7777
BANNER = "GPUAAS-UPSTREAM"


def _sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check)


def masquerade_rule(subnet: IPv4Network) -> list[str]:
    return ["POSTROUTING", "-s", str(subnet), "-j", "MASQUERADE"]


def set_masquerade(subnet: IPv4Network, present: bool) -> None:
    """Add or delete the NAT rule (idempotent): what the tests break and repair."""
    rule = masquerade_rule(subnet)
    have = _sh("iptables", "-w", "10", "-t", "nat", "-C", *rule, check=False).returncode == 0
    if present and not have:
        _sh("iptables", "-w", "10", "-t", "nat", "-A", *rule)
    elif not present and have:
        _sh("iptables", "-w", "10", "-t", "nat", "-D", *rule)


@dataclass
class Upstream:
    subnet: IPv4Network
    workdir: Path
    port: int = PORT
    netns: str = ""
    host_if: str = ""
    host_ip: str = ""
    peer_ip: str = ""
    log: Path | None = None
    proc: subprocess.Popen | None = None
    _forward_before: str | None = None
    _undo: list = field(default_factory=list)

    def start(self) -> Upstream:
        tag = os.getpid() % 100000
        self.netns, self.host_if, peer_if = f"gpuaas-up-{tag}", f"gup{tag}h", f"gup{tag}n"
        base = 4 * (tag % 63)  # one /30 of 192.0.2.0/24 (TEST-NET-1) per lab process
        self.host_ip, self.peer_ip = f"192.0.2.{base + 1}", f"192.0.2.{base + 2}"
        try:
            _sh("ip", "netns", "add", self.netns)
            self._undo.append(lambda: _sh("ip", "netns", "del", self.netns, check=False))
            _sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", peer_if)
            self._undo.append(lambda: _sh("ip", "link", "del", self.host_if, check=False))
            _sh("ip", "link", "set", peer_if, "netns", self.netns)
            _sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _sh("ip", "link", "set", self.host_if, "up")
            for argv in (("ip", "addr", "add", f"{self.peer_ip}/30", "dev", peer_if), ("ip", "link", "set", peer_if, "up"),
                         ("ip", "link", "set", "lo", "up")):
                _sh("ip", "netns", "exec", self.netns, *argv)
            self._forward_before = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
            set_masquerade(self.subnet, True)
            self._undo.append(lambda: set_masquerade(self.subnet, False))
            self.log = self.workdir / "upstream-connections.log"
            self.log.touch()
            out = open(self.workdir / "upstream.log", "ab")
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, str(Path(__file__).resolve()), "--serve",
                 "--bind", self.peer_ip, "--port", str(self.port), "--log", str(self.log)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            out.close()
            deadline = time.monotonic() + 30
            while "listening" not in (self.workdir / "upstream.log").read_text():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"upstream listener did not start: {(self.workdir / 'upstream.log').read_text()}")
                time.sleep(0.05)  # poll step of a deadline wait
        except BaseException:
            self.close()
            raise
        return self

    def peers(self) -> list[str]:
        """Every source address the listener saw, in order."""
        return self.log.read_text().split() if self.log and self.log.exists() else []

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:
                pass
        if self._forward_before is not None:
            Path("/proc/sys/net/ipv4/ip_forward").write_text(self._forward_before + "\n")
            self._forward_before = None


async def _serve(bind: str, port: int, log: Path) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        with open(log, "a") as fh:
            fh.write(peer + "\n")
        writer.write(f"{BANNER} peer={peer}\n".encode())
        try:
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, bind, port)
    print(f"listening on {bind}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--bind", required=True)
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    asyncio.run(_serve(args.bind, args.port, args.log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
