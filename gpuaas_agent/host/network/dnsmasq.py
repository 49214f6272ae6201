"""dnsmasq driver: the agent's DHCP reservations in a hosts file it owns, reloaded with SIGHUP; lease file reader.

Each reservation is one ``--dhcp-hostsfile`` line that names its owner in a
trailing comment, ``<mac>,<ip>,<hostname> # gpuaas allocation=<id> slot=<n>``,
so reconcile lists them after a restart with no other state (seed 004: stale
``gpuaas-slice-*`` reservations from failed attempts had to be found by hand).
dnsmasq ends a line at a ``#`` that follows whitespace. The owner is NOT
recorded as a ``set:<tag>``: dnsmasq 2.90 (Debian 12) crashes with
``free(): invalid pointer`` / SIGSEGV on the SIGHUP after it has leased an
address to a hosts-file line carrying ``set:`` (seen in tests here).
Lines the agent did not write (comments, hand-made hosts, junk) are kept
verbatim on every rewrite; junk is reported, never dropped. Writes are atomic
(temp + fsync + rename) under an ``flock`` on a sidecar lock file, so two
concurrent adds cannot lose each other's line. dnsmasq is only ever sent
SIGHUP (it re-reads ``--dhcp-hostsfile``); the agent never starts, restarts or
enables it (seed 004: a unit that ran ``systemctl enable --now dnsmasq`` from
inside itself looped).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.contract.dhcp import DNS_LABEL_PATTERN, HostsFileJunk, Lease, LeaseState, LeaseStatus, Reservation
from gpuaas_agent.contract.types import MAC, UUID_RE, whole
from gpuaas_agent.errors import GuardError, HostError

OWNER_MARK = "# gpuaas "
_OWNED_LINE = re.compile(
    r"^(?P<mac>[^,\s]*),(?P<ip>[^,\s]*),(?P<hostname>[^,\s]*) # gpuaas allocation=(?P<allocation_id>\S*) "
    r"slot=(?P<slot_index>\S*)$"
)
_OWNED_MARK = re.compile(r"\s#\s*gpuaas\s+allocation=")
_COMMENT = re.compile(r"(^|\s)#.*$")  # where dnsmasq ends a line
_MAC_ANY_CASE = whole(MAC, re.IGNORECASE | re.ASCII)  # hand-written lines may use upper case
_IPV4 = re.compile(r"^\d{1,3}(\.\d{1,3}){3}\Z")
LOCK_TIMEOUT_S = 10.0
HOSTS_FILE_MODE = 0o644  # dnsmasq may read it after dropping to its own user


class ReservationRefused(GuardError):
    """A reservation was refused (bad input or a conflict); the hosts file was not changed."""

    default_code = "reservation_refused"


class DnsmasqError(HostError):
    """The hosts file or the dnsmasq process could not be used (lock, pid file, signal)."""

    default_code = "dnsmasq_error"


def owner_comment(allocation_id: str, slot_index: int) -> str:
    """The trailing comment that records which allocation and slot own a line."""
    return f"{OWNER_MARK}allocation={allocation_id} slot={slot_index}"


def render_line(res: Reservation) -> str:
    return f"{res.mac},{res.ip},{res.hostname} {owner_comment(res.allocation_id, res.slot_index)}"


def _refuse(code: str, message: str, **evidence: Any) -> ReservationRefused:
    return ReservationRefused(message, code=code, evidence=evidence)


def make_reservation(allocation_id: str, slot_index: int, mac: str, ip: str, hostname: str) -> Reservation:
    """Validate raw values into a :class:`Reservation`, refusing with a precise code instead of a pydantic dump.

    MACs are accepted in either case and stored lower-case; a multicast or all-zero MAC is refused.
    """
    if not isinstance(allocation_id, str) or not UUID_RE.fullmatch(allocation_id):
        raise _refuse("bad_allocation_id", f"allocation id {allocation_id!r} is not a lower-case UUID",
                      allocation_id=allocation_id)
    if isinstance(slot_index, bool) or not isinstance(slot_index, int) or not 0 <= slot_index <= 255:
        raise _refuse("bad_slot_index", f"slot index {slot_index!r} is not an integer 0..255", slot_index=slot_index)
    if not isinstance(mac, str) or not _MAC_ANY_CASE.fullmatch(mac):
        raise _refuse("bad_mac", f"MAC {mac!r} is not six colon-separated hex octets", mac=mac)
    mac = mac.lower()
    first = int(mac[:2], 16)
    if first & 1 or mac == "00:00:00:00:00:00":
        raise _refuse("bad_mac", f"MAC {mac} is multicast or all-zero; a guest NIC needs a unicast MAC", mac=mac)
    if not isinstance(ip, (str, IPv4Address)) or not _IPV4.fullmatch(str(ip)):
        raise _refuse("bad_ip", f"{ip!r} is not a dotted-quad IPv4 address", ip=str(ip))
    try:
        address = IPv4Address(str(ip))
    except ValueError:
        raise _refuse("bad_ip", f"{ip!r} is not an IPv4 address", ip=str(ip)) from None
    if not isinstance(hostname, str) or not re.fullmatch(DNS_LABEL_PATTERN, hostname):
        raise _refuse("bad_hostname", f"hostname {hostname!r} is not a DNS label (1-63 of A-Z a-z 0-9 -, "
                      "no hyphen at either end)", hostname=hostname)
    return Reservation(allocation_id=allocation_id, slot_index=slot_index, mac=mac, ip=address, hostname=hostname)


@dataclass
class _Line:
    text: str  # verbatim, without the newline
    reservation: Reservation | None = None  # a well-formed line the agent owns
    macs: set[str] = field(default_factory=set)  # what a line it does not own claims (conflict checks)
    ips: set[IPv4Address] = field(default_factory=set)
    hostnames: set[str] = field(default_factory=set)
    junk_reason: str | None = None


@dataclass(frozen=True)
class HostsFileReport:
    """Everything in the hosts file: the agent's reservations, lines others wrote, and junk (line numbers 1-based)."""

    reservations: list[Reservation]
    foreign_lines: list[str]
    junk: list[HostsFileJunk]


def _parse_owned(text: str) -> tuple[Reservation | None, str | None]:
    m = _OWNED_LINE.match(text)
    if m is None:
        return None, "owner comment but not '<mac>,<ip>,<hostname> # gpuaas allocation=<id> slot=<n>'"
    try:
        slot = int(m["slot_index"]) if m["slot_index"].isdigit() else m["slot_index"]
        # a non-numeric slot is passed on as text for make_reservation to refuse by name
        res = make_reservation(m["allocation_id"], slot, m["mac"], m["ip"], m["hostname"])  # type: ignore[arg-type]
    except ReservationRefused as exc:
        return None, f"{exc.code}: {exc.message}"
    if m["mac"] != res.mac:
        return None, "bad_mac: the agent writes MACs lower-case"
    return res, None


def _parse_foreign(text: str) -> _Line:
    """A line the agent did not write: note what it claims, so a new reservation cannot collide with it."""
    line = _Line(text=text)
    body = _COMMENT.sub("", text).strip()
    if not body:
        return line
    for part in body.split(","):
        part = part.strip()
        if _MAC_ANY_CASE.fullmatch(part):
            line.macs.add(part.lower())
        elif _IPV4.fullmatch(part):
            try:
                line.ips.add(IPv4Address(part))
            except ValueError:
                pass
        elif re.fullmatch(DNS_LABEL_PATTERN, part):
            line.hostnames.add(part.lower())
    if not line.macs and not line.ips:
        line.junk_reason = "neither a MAC nor an IPv4 address: not a dhcp-host line"
    return line


def _parse(text: str) -> list[_Line]:
    lines = []
    raws = text.split("\n")  # not splitlines(): a CR or form feed inside a junk line must survive a rewrite
    if raws[-1] == "":
        raws.pop()
    for raw in raws:
        if _OWNED_MARK.search(raw) and not raw.lstrip().startswith("#"):  # the agent's mark, well-formed or not
            res, reason = _parse_owned(raw)
            line = _Line(text=raw, reservation=res, junk_reason=reason)
            if res is None:  # a damaged line of ours still blocks what it names
                foreign = _parse_foreign(raw)
                line.macs, line.ips, line.hostnames = foreign.macs, foreign.ips, foreign.hostnames
            lines.append(line)
        else:
            lines.append(_parse_foreign(raw))
    return lines


def _printable(text: str) -> str:
    """A line as valid UTF-8 for a report (bytes that are not UTF-8 become U+FFFD; the file keeps them)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _claims(line: _Line) -> tuple[set[str], set[IPv4Address], set[str]]:
    if line.reservation is not None:
        r = line.reservation
        return {r.mac}, {r.ip}, {r.hostname.lower()}
    return line.macs, line.ips, line.hostnames


class DnsmasqReservations:
    """The agent's dnsmasq hosts file (``--dhcp-hostsfile``) for one subnet, and the dnsmasq that reads it.

    Blocking file I/O and ``flock``: call it through ``asyncio.to_thread`` from async code.
    """

    def __init__(self, hosts_file: Path, subnet: IPv4Network, gateway: IPv4Address, pid_file: Path | None = None,
                 *, proc_root: Path = Path("/proc"), lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        subnet, gateway = IPv4Network(subnet), IPv4Address(gateway)
        if gateway not in subnet:
            raise ValueError(f"gateway {gateway} is not in {subnet}")
        self.hosts_file = Path(hosts_file)
        self.subnet = subnet
        self.gateway = gateway
        self.pid_file = Path(pid_file) if pid_file is not None else None
        self.proc_root = proc_root
        self.lock_timeout_s = lock_timeout_s
        self.lock_file = self.hosts_file.parent / f".{self.hosts_file.name}.lock"

    # -- reading -------------------------------------------------------------------------------------------

    def _read(self) -> list[_Line]:
        try:
            data = self.hosts_file.read_bytes()
        except FileNotFoundError:
            return []
        # surrogateescape: bytes that are not UTF-8 survive a rewrite unchanged
        return _parse(data.decode("utf-8", "surrogateescape"))

    def report(self) -> HostsFileReport:
        lines = self._read()
        return HostsFileReport(
            reservations=[ln.reservation for ln in lines if ln.reservation is not None],
            foreign_lines=[ln.text for ln in lines if ln.reservation is None and ln.junk_reason is None
                           and ln.text.strip() and not ln.text.lstrip().startswith("#")],
            junk=[HostsFileJunk(line_number=i, text=_printable(ln.text), reason=ln.junk_reason)
                  for i, ln in enumerate(lines, 1) if ln.junk_reason is not None],
        )

    def reservations(self) -> list[Reservation]:
        """The agent's reservations, read from the file alone (what reconcile lists after a restart)."""
        return self.report().reservations

    def junk_lines(self) -> list[HostsFileJunk]:
        return self.report().junk

    # -- writing -------------------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive ``flock`` on a sidecar file (the hosts file is replaced by rename, so it cannot hold one)."""
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise DnsmasqError(
                            f"hosts file lock {self.lock_file} held for over {self.lock_timeout_s:g}s",
                            code="hosts_file_locked", evidence={"lock_file": str(self.lock_file)}) from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def _write(self, lines: list[_Line]) -> None:
        text = "".join(f"{ln.text}\n" for ln in lines)
        write_atomic(self.hosts_file, text.encode("utf-8", "surrogateescape"), mode=HOSTS_FILE_MODE)

    def _check_address(self, res: Reservation) -> None:
        if res.ip not in self.subnet:
            raise _refuse("ip_outside_subnet", f"{res.ip} is outside {self.subnet}", ip=str(res.ip),
                          subnet=str(self.subnet))
        special = {self.subnet.network_address: "network", self.subnet.broadcast_address: "broadcast",
                   self.gateway: "gateway"}
        if res.ip in special:
            raise _refuse("ip_reserved", f"{res.ip} is the {special[res.ip]} address of {self.subnet}",
                          ip=str(res.ip), role=special[res.ip])
        if int(res.mac[:2], 16) & 1 or res.mac == "00:00:00:00:00:00":
            raise _refuse("bad_mac", f"MAC {res.mac} is multicast or all-zero", mac=res.mac)

    def add(self, res: Reservation) -> bool:
        """Reserve ``res``; True when the file changed, False when the same reservation is already there.

        Refused (nothing written) with ``ip_outside_subnet``, ``ip_reserved``, ``bad_mac``, ``slot_reserved``
        (this allocation+slot already has a different reservation), ``mac_in_use``, ``ip_in_use`` or
        ``hostname_in_use`` (claimed by another allocation or by a line the agent did not write).
        """
        self._check_address(res)
        with self._locked():
            lines = self._read()
            if self._conflicts(lines, res):
                return False
            self._write([*lines, _Line(text=render_line(res), reservation=res)])
        return True

    def check(self, res: Reservation) -> bool:
        """Every refusal :meth:`add` would raise for ``res`` now, without writing anything.

        A provision asks this in its validate step, before any lease is taken or disk
        written, so a reserved MAC, IP or hostname refuses the task with the slot clean.
        True when this very reservation is already there.
        """
        self._check_address(res)
        return self._conflicts(self._read(), res)

    @staticmethod
    def _conflicts(lines: list[_Line], res: Reservation) -> bool:
        """Raise when another line claims what ``res`` needs; True when ``res`` itself is there already."""
        for ln in lines:
            other = ln.reservation
            if other is not None and (other.allocation_id, other.slot_index) == (res.allocation_id, res.slot_index):
                if other == res:
                    return True
                raise _refuse("slot_reserved", f"allocation {res.allocation_id} slot {res.slot_index} already "
                              f"reserves {other.mac} -> {other.ip} ({other.hostname}); release it first",
                              existing=other.model_dump(mode="json"), requested=res.model_dump(mode="json"))
        for ln in lines:
            macs, ips, hostnames = _claims(ln)
            owner = ln.text
            if res.mac in macs:
                raise _refuse("mac_in_use", f"MAC {res.mac} is already reserved by another line", mac=res.mac,
                              line=owner)
            if res.ip in ips:
                raise _refuse("ip_in_use", f"{res.ip} is already reserved by another line", ip=str(res.ip),
                              line=owner)
            if res.hostname.lower() in hostnames:
                raise _refuse("hostname_in_use", f"hostname {res.hostname} is already reserved by another line",
                              hostname=res.hostname, line=owner)
        return False

    def remove(self, allocation_id: str, slot_index: int | None = None) -> list[Reservation]:
        """Drop the allocation's reservations (one slot, or all of them); returns what was removed.

        Damaged lines carrying the allocation's tag are kept (and stay reported as junk): the agent removes
        only what it can prove it wrote.
        """
        with self._locked():
            lines = self._read()
            keep, removed = [], []
            for ln in lines:
                r = ln.reservation
                if r is not None and r.allocation_id == allocation_id and slot_index in (None, r.slot_index):
                    removed.append(r)
                else:
                    keep.append(ln)
            if removed:
                self._write(keep)
        return removed

    # -- dnsmasq -------------------------------------------------------------------------------------------

    def dnsmasq_pid(self) -> int:
        """The pid in the pid file, proven to be a running dnsmasq by ``/proc/<pid>/comm``."""
        if self.pid_file is None:
            raise DnsmasqError("no dnsmasq pid file is configured", code="dnsmasq_pid_unknown")
        try:
            text = self.pid_file.read_text().strip()
        except FileNotFoundError:
            raise DnsmasqError(f"dnsmasq pid file {self.pid_file} does not exist", code="dnsmasq_not_running",
                               evidence={"pid_file": str(self.pid_file)}) from None
        if not text.isdigit() or int(text) <= 0:
            raise DnsmasqError(f"dnsmasq pid file {self.pid_file} holds {text[:40]!r}, not a pid",
                               code="dnsmasq_pid_unknown",
                               evidence={"pid_file": str(self.pid_file), "content": text[:40]})
        pid = int(text)
        try:
            comm = (self.proc_root / str(pid) / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            raise DnsmasqError(f"dnsmasq pid {pid} from {self.pid_file} is not running", code="dnsmasq_not_running",
                               evidence={"pid_file": str(self.pid_file), "pid": pid}) from None
        if comm != "dnsmasq":
            # a stale pid file whose number was reused: signalling it would hit an unrelated process
            raise DnsmasqError(f"pid {pid} from {self.pid_file} is {comm!r}, not dnsmasq", code="pid_not_dnsmasq",
                               evidence={"pid_file": str(self.pid_file), "pid": pid, "comm": comm})
        return pid

    def reload(self) -> int:
        """SIGHUP dnsmasq so it re-reads the hosts file; returns the pid signalled. Never starts or restarts it."""
        pid = self.dnsmasq_pid()
        try:
            os.kill(pid, signal.SIGHUP)
        except ProcessLookupError:
            raise DnsmasqError(f"dnsmasq pid {pid} exited before it could be signalled", code="dnsmasq_not_running",
                               evidence={"pid": pid}) from None
        return pid


def stale_reservations(reservations: Iterable[Reservation], live_allocation_ids: Iterable[str]) -> list[Reservation]:
    """Reservations whose allocation is not live any more (reconcile removes them)."""
    live = set(live_allocation_ids)
    return [r for r in reservations if r.allocation_id not in live]


# -- leases ----------------------------------------------------------------------------------------------------


def parse_leases(lease_file: Path) -> list[Lease]:
    """The IPv4 Ethernet leases in a dnsmasq lease file (``<expires> <mac> <ip> <hostname|*> <client-id|*>``).

    A missing file is no leases. DHCPv6 lines (after the ``duid`` line), non-Ethernet hardware addresses
    and short lines are skipped: dnsmasq rewrites the file in place, so a reader can see a torn last line.
    """
    try:
        text = Path(lease_file).read_text("utf-8", "replace")
    except FileNotFoundError:
        return []
    leases = []
    for raw in text.splitlines():
        fields = raw.split()
        if len(fields) < 5 or fields[0] == "duid":
            continue
        expires, mac, ip, hostname, client_id = fields[:5]
        if not expires.isdigit() or not _MAC_ANY_CASE.fullmatch(mac) or not _IPV4.fullmatch(ip):
            continue
        try:
            leases.append(Lease(expires=int(expires), mac=mac.lower(), ip=IPv4Address(ip),
                                hostname=None if hostname == "*" else hostname,
                                client_id=None if client_id == "*" else client_id))
        except (ValueError, ValidationError):
            continue
    return leases


def _live(lease: Lease, now: float) -> bool:
    return lease.expires == 0 or lease.expires > now


def status_of(leases: list[Lease], mac: str, expected_ip: IPv4Address | str, now: float) -> LeaseStatus:
    """Pure: decide bound / wrong_ip / expired / missing for one MAC from parsed leases."""
    mac, expected_ip = mac.lower(), IPv4Address(str(expected_ip))
    conflicting = next((ls.mac for ls in leases if ls.ip == expected_ip and ls.mac != mac and _live(ls, now)), None)
    mine = [ls for ls in leases if ls.mac == mac]
    base: dict[str, Any] = {"mac": mac, "expected_ip": expected_ip, "conflicting_mac": conflicting}
    for ls in mine:
        if ls.ip == expected_ip and _live(ls, now):
            return LeaseStatus(**base, actual_ip=ls.ip, lease_state=LeaseState.bound, expires=ls.expires)
    for ls in mine:
        if _live(ls, now):
            return LeaseStatus(**base, actual_ip=ls.ip, lease_state=LeaseState.wrong_ip, expires=ls.expires)
    if mine:
        last = max(mine, key=lambda ls: ls.expires)
        return LeaseStatus(**base, actual_ip=last.ip, lease_state=LeaseState.expired, expires=last.expires)
    return LeaseStatus(**base, lease_state=LeaseState.missing)


def lease_status(lease_file: Path, mac: str, expected_ip: IPv4Address | str, now: float | None = None) -> LeaseStatus:
    """What dnsmasq's lease file says about ``mac`` holding ``expected_ip`` (``now``: Unix time, default the clock)."""
    return status_of(parse_leases(lease_file), mac, expected_ip, time.time() if now is None else now)
