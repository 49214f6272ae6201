"""Guest readiness: wait until the expected MAC holds the expected IP, then until SSH answers on it.

A VM is ``active`` only after both (docs/safety.md §5). Each wait polls with a
deadline, reports progress when what it sees changes, honours cancellation at
every await, and ends in a typed timeout whose evidence names what was missing
and the last thing observed.

Deadlines are absolute times on the running event loop's clock,
``asyncio.get_running_loop().time()`` (monotonic: ``time.monotonic()`` for the
default loop), so a wall-clock jump cannot cut a wait short or stretch it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from gpuaas_agent import compat
from gpuaas_agent.contract.dhcp import GuestReadiness, LeaseState, LeaseStatus
from gpuaas_agent.errors import HostError
from gpuaas_agent.host.network.dnsmasq import lease_status

# progress(event, fields): e.g. ("lease_wait", {"status": {...}}); may be a coroutine function
Progress = Callable[[str, dict[str, Any]], Awaitable[None] | None]

BANNER_PREFIX = b"SSH-2.0-"
MAX_PRE_BANNER_LINES = 16  # RFC 4253 §4.2: a server may send other lines before its version line
MAX_LINE_BYTES = 255  # the RFC's limit for the version line, CR LF included


class ReadinessTimeout(HostError):
    """The guest did not become ready before the deadline; ``evidence`` names what was missing."""

    default_code = "readiness_timeout"


async def _emit(progress: Progress | None, event: str, fields: dict[str, Any]) -> None:
    if progress is not None:
        result = progress(event, fields)
        if asyncio.iscoroutine(result):
            await result


def is_fresh(status: LeaseStatus, stale_expires: int | None) -> bool:
    """A bound lease the guest took after ``stale_expires`` was read (the slot's lease before its domain started).

    A slot keeps its MAC and IP from tenant to tenant, and dnsmasq keeps a released guest's lease until it
    expires: that lease says nothing of the new guest. A new DHCP exchange writes a later expiry (now + lease
    time), so only a lease expiring after the old one counts. An infinite lease (0) cannot be told apart.
    """
    if status.lease_state != LeaseState.bound:
        return False
    if stale_expires is None or stale_expires == 0 or status.expires == 0:
        return True
    return status.expires is not None and status.expires > stale_expires


def stale_lease_expires(lease_file: Path, mac: str, expected_ip: IPv4Address | str) -> int | None:
    """Before a domain starts: the expiry of the bound lease the slot's MAC already holds (None: none)."""
    status = lease_status(lease_file, mac, expected_ip)
    return status.expires if status.lease_state == LeaseState.bound else None


async def wait_for_lease(lease_file: Path, mac: str, expected_ip: IPv4Address | str, *, deadline: float,
                         progress: Progress | None = None, poll_s: float = 0.5,
                         stale_expires: int | None = None) -> LeaseStatus:
    """Poll dnsmasq's lease file until ``mac`` holds ``expected_ip`` (``lease_state=bound``); return that status.

    ``deadline`` is loop time (see the module docstring). Progress ``lease_wait`` is emitted for the first
    observation and on every change of state. ``stale_expires``: the expiry of the lease the MAC held before
    the domain started (:func:`stale_lease_expires`); that lease, from the slot's last guest, is never taken
    for this one (:func:`is_fresh`). Raises :class:`ReadinessTimeout` code ``lease_timeout``.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    last: LeaseStatus | None = None
    while True:
        status = lease_status(lease_file, mac, expected_ip)  # a few hundred bytes: not worth a thread
        if status != last:
            last = status
            await _emit(progress, "lease_wait", {"status": status.model_dump(mode="json"),
                                                 **({"stale_expires": stale_expires} if stale_expires else {})})
        if is_fresh(status, stale_expires):
            return status
        remaining = deadline - loop.time()
        if remaining <= 0:
            stale = status.lease_state == LeaseState.bound
            raise ReadinessTimeout(
                f"{mac} did not hold {expected_ip} before the deadline (last seen: "
                f"{'the lease from before the domain started' if stale else status.lease_state.value})",
                code="lease_timeout",
                evidence={"missing": f"bound lease of {expected_ip} for {status.mac}", "lease_file": str(lease_file),
                          "last_status": status.model_dump(mode="json"), "waited_s": round(loop.time() - started, 3),
                          "stale_expires": stale_expires},
            )
        await asyncio.sleep(min(poll_s, remaining))


async def _read_banner(reader: asyncio.StreamReader) -> str:
    """The server's version line; raises ValueError naming what came instead."""
    for _ in range(MAX_PRE_BANNER_LINES):
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            raise ValueError(f"connection closed before a banner (got {exc.partial[:64]!r})") from None
        except asyncio.LimitOverrunError:
            raise ValueError("line longer than the stream limit before a banner") from None
        if len(line) > MAX_LINE_BYTES:
            raise ValueError(f"line of {len(line)} bytes before a banner")
        if line.startswith(BANNER_PREFIX):
            return line.rstrip(b"\r\n").decode("ascii", "replace")
        if line.startswith(b"SSH-"):
            raise ValueError(f"server speaks {line.rstrip()[:64]!r}, not SSH-2.0")
    raise ValueError(f"no SSH- line within {MAX_PRE_BANNER_LINES} lines")


async def wait_for_ssh(ip: IPv4Address | str, port: int = 22, *, deadline: float, progress: Progress | None = None,
                       poll_s: float = 0.5, attempt_timeout_s: float = 5.0) -> str:
    """Connect to ``ip:port`` until it sends an ``SSH-2.0-`` banner before the deadline; return the banner line.

    Each attempt (connect + banner) is bounded by ``attempt_timeout_s`` and the deadline; a refused or silent
    port is retried every ``poll_s``. Progress ``ssh_wait`` is emitted when the observed error changes.
    Raises :class:`ReadinessTimeout` code ``ssh_timeout`` whose evidence has the last error and attempt count.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    host = str(IPv4Address(str(ip)))
    attempts = 0
    last_error: str | None = None
    while True:
        attempts += 1
        budget = max(0.0, min(attempt_timeout_s, deadline - loop.time()))
        writer = None
        try:
            async with compat.timeout(budget):
                reader, writer = await asyncio.open_connection(host, port, limit=4096)
                return await _read_banner(reader)
        except TimeoutError:
            error = "connected, no banner before the attempt timed out" if writer is not None else "connect timed out"
            if budget < attempt_timeout_s and last_error is not None:
                error = last_error  # cut short by the overall deadline: the previous full attempt says more
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if writer is not None:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass
        if error != last_error:
            last_error = error
            await _emit(progress, "ssh_wait", {"ip": host, "port": port, "attempt": attempts, "error": error})
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise ReadinessTimeout(
                f"no SSH-2.0 banner from {host}:{port} before the deadline (last: {error})",
                code="ssh_timeout",
                evidence={"missing": f"SSH-2.0- banner on {host}:{port}", "last_error": error, "attempts": attempts,
                          "waited_s": round(loop.time() - started, 3)},
            )
        await asyncio.sleep(min(poll_s, remaining))


async def wait_for_guest(lease_file: Path, mac: str, expected_ip: IPv4Address | str, *, deadline: float,
                         ssh_port: int = 22, progress: Progress | None = None, poll_s: float = 0.5,
                         stale_expires: int | None = None) -> GuestReadiness:
    """Both waits in order under one deadline: the lease first (a fresh one), then SSH on the leased address."""
    lease = await wait_for_lease(lease_file, mac, expected_ip, deadline=deadline, progress=progress, poll_s=poll_s,
                                 stale_expires=stale_expires)
    banner = await wait_for_ssh(expected_ip, ssh_port, deadline=deadline, progress=progress, poll_s=poll_s)
    return GuestReadiness(lease=lease, ssh_port=ssh_port, ssh_banner=banner)
