"""Device events (block, pci, net) as an asyncio source of debounced bursts, from pyudev's netlink monitor.

Why events at all: a disk, PCI function or link that appears, vanishes or
changes driver should reach the control plane within seconds, not at the next
reconcile tick. Why bursts: one ``losetup -P`` or one VM start emits a handful
of events; discovery runs once per burst, not once per event.

Source: with udevd running (its control socket answers) the monitor listens to
udev's post-processing events, so ``/dev/disk/by-id`` links already exist when
the agent rediscovers; without udevd (CI machines, minimal hosts) nobody sends
those, and the monitor must listen to the kernel's own netlink group instead.

The monitor's file descriptor is registered with the event loop
(``loop.add_reader``): no thread, no blocking receive. Events are read from
the uevent's own properties, never from sysfs (a removed device has none).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, get_args

import pyudev

from gpuaas_agent.contract.drift import Uevent
from gpuaas_agent.errors import HostError
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

UDEV_CONTROL_SOCKET = "/run/udev/control"
WATCHED_SUBSYSTEMS: tuple[str, ...] = ("block", "net", "pci")
WATCHED_ACTIONS = frozenset(get_args(Uevent.model_fields["action"].annotation))  # the contract's list
DEFAULT_DEBOUNCE_S = 1.0  # quiet time that closes a burst
DEFAULT_MAX_BURST_S = 5.0  # an event storm still yields a trigger this often
MAX_EVENTS_PER_BURST = 256  # events listed in one burst; the rest are counted
QUEUE_SIZE = 4096
READ_BATCH = 512  # messages read per wake-up before other callbacks get the loop
# udevadm monitor asks for 128 MiB; 8 MiB holds thousands of events and is forced with CAP_NET_ADMIN.
RECEIVE_BUFFER_BYTES = 8 << 20


class UeventSource(str, Enum):
    udev = "udev"  # after udevd processed the event (links and properties exist)
    kernel = "kernel"  # straight from the kernel: the only source when no udevd runs


class UeventMonitorError(HostError):
    """The event monitor cannot be created or stopped working."""

    default_code = "uevent_monitor_unavailable"


def udevd_running(control_socket: str = UDEV_CONTROL_SOCKET) -> bool:
    """True when udevd answers on its control socket.

    A leftover socket file from a udevd that died does not count: a monitor on
    the udev source would then wait forever for events nobody sends.
    """
    try:
        if not stat.S_ISSOCK(os.stat(control_socket).st_mode):
            return False
    except OSError:
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(1.0)
        sock.connect(control_socket)  # udevd accepts and drops a connection that sends nothing
        return True
    except OSError:
        return False
    finally:
        sock.close()


def choose_source(control_socket: str = UDEV_CONTROL_SOCKET) -> UeventSource:
    return UeventSource.udev if udevd_running(control_socket) else UeventSource.kernel


def parse_uevent(props: Mapping[str, str]) -> Uevent | None:
    """The event of a uevent's properties, or None when it is not one we act on."""
    action, devpath = props.get("ACTION"), props.get("DEVPATH")
    if action not in WATCHED_ACTIONS or not devpath:
        return None
    seqnum = props.get("SEQNUM")
    return Uevent(
        action=action,  # type: ignore[arg-type]  # one of WATCHED_ACTIONS (checked above); the model checks it too
        subsystem=props.get("SUBSYSTEM", ""),
        name=devpath.rstrip("/").rsplit("/", 1)[-1],
        devpath=devpath,
        devname=props.get("DEVNAME"),
        devtype=props.get("DEVTYPE"),
        driver=props.get("DRIVER"),
        old_devpath=props.get("DEVPATH_OLD"),
        seqnum=int(seqnum) if seqnum and seqnum.isdigit() else None,
        synthetic="SYNTH_UUID" in props,
    )


@dataclass(frozen=True)
class UeventBurst:
    """Events that arrived close together: one trigger for one rediscovery."""

    events: tuple[Uevent, ...]
    dropped: int = 0  # over MAX_EVENTS_PER_BURST, refused by a full queue, or lost to a socket overflow
    overflowed: bool = False  # the kernel dropped events (ENOBUFS): rediscovery is the only way to know what changed
    source: UeventSource = UeventSource.kernel

    @property
    def devices(self) -> list[str]:
        """``subsystem:name`` of every device seen, once each, sorted."""
        return sorted({f"{e.subsystem}:{e.name}" for e in self.events})


_OVERFLOW = object()  # queued when the socket overflowed, so a burst starts even if no event follows


@dataclass
class UeventMonitor:
    """A started netlink monitor feeding an asyncio queue; use as ``async with UeventMonitor() as m``."""

    subsystems: tuple[str, ...] = WATCHED_SUBSYSTEMS
    actions: frozenset[str] = WATCHED_ACTIONS
    source: UeventSource | None = None  # None: udev when udevd answers, kernel otherwise
    control_socket: str = UDEV_CONTROL_SOCKET
    receive_buffer_bytes: int = RECEIVE_BUFFER_BYTES
    _queue: asyncio.Queue[Any] = field(init=False, repr=False)  # Uevents and the _OVERFLOW marker
    _monitor: Any = field(default=None, init=False, repr=False)  # pyudev's Monitor (untyped)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _fd: int | None = field(default=None, init=False, repr=False)
    _errsock: socket.socket | None = field(default=None, init=False, repr=False)
    _dropped: int = field(default=0, init=False)
    _overflowed: bool = field(default=False, init=False)
    _failure: UeventMonitorError | None = field(default=None, init=False, repr=False)

    def start(self) -> UeventMonitor:
        """Open the netlink socket, install the subsystem filter, register the fd with the running loop."""
        if self._monitor is not None:
            return self
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(QUEUE_SIZE)
        if self.source is None:
            self.source = choose_source(self.control_socket)
        try:
            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.source.value)
            for subsystem in self.subsystems:
                monitor.filter_by(subsystem)  # a socket filter: other subsystems never wake the loop
            try:
                monitor.set_receive_buffer_size(self.receive_buffer_bytes)
            except OSError as exc:  # needs CAP_NET_ADMIN; the default buffer still works
                log_event(log, "uevent_receive_buffer_default", logging.WARNING, error=repr(exc))
            monitor.start()
            fd = monitor.fileno()
        except (ImportError, OSError) as exc:
            raise UeventMonitorError(f"cannot open a {self.source.value} uevent monitor: {exc}",
                                     evidence={"source": self.source.value, "error": repr(exc)}) from exc
        self._monitor, self._fd = monitor, fd
        self._errsock = socket.fromfd(fd, socket.AF_NETLINK, socket.SOCK_RAW)  # a dup, to read SO_ERROR
        self._loop.add_reader(fd, self._on_readable)
        log_event(log, "uevent_monitor_started", source=self.source.value, subsystems=list(self.subsystems),
                  udev_control_socket=self.control_socket)
        return self

    def close(self) -> None:
        """Unregister the fd and drop the monitor (libudev closes the socket when it is released)."""
        if self._monitor is None:
            return
        if self._loop is not None and self._fd is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        if self._errsock is not None:
            self._errsock.close()
        self._monitor, self._fd, self._errsock = None, None, None

    async def __aenter__(self) -> UeventMonitor:
        return self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    # -- reading (event loop callback) ------------------------------------------------

    def _on_readable(self) -> None:
        """Drain queued messages (the socket is non-blocking); a storm yields to the loop every batch."""
        monitor = self._monitor
        if monitor is None:
            return
        for _ in range(READ_BATCH):  # the reader is level-triggered: what is left calls us again
            try:
                device = monitor.poll(timeout=0)
            except OSError as exc:
                # pyudev's poll raises on POLLERR without reading the error ("Error while polling fd"),
                # and POLLERR stays until someone does: SO_ERROR reads (and clears) it.
                pending = self._pending_error()
                if errno.ENOBUFS in (exc.errno, pending):  # the kernel dropped events: say so, keep reading
                    self._overflowed = True
                    self._put(_OVERFLOW)
                    continue
                self._fail(exc, pending)
                return
            if device is None:
                return
            event = parse_uevent(dict(device.properties))
            if event is not None and event.subsystem in self.subsystems and event.action in self.actions:
                self._put(event)

    def _pending_error(self) -> int | None:
        try:
            return self._errsock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if self._errsock else None
        except OSError:
            return None

    def _put(self, item: object) -> None:
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._dropped += 1

    def _fail(self, exc: OSError, socket_error: int | None) -> None:
        evidence: dict[str, Any] = {"source": self.source.value if self.source else None, "error": repr(exc),
                    "socket_error": errno.errorcode.get(socket_error or 0, socket_error)}
        self._failure = UeventMonitorError(f"uevent monitor failed: {exc}", code="uevent_monitor_failed",
                                           evidence=evidence)
        log_event(log, "uevent_monitor_failed", logging.ERROR, **evidence)
        self.close()
        self._put(_OVERFLOW)  # wake a waiting consumer so it sees the failure

    # -- consuming --------------------------------------------------------------------

    async def _get(self, timeout: float | None) -> Any:  # a Uevent or the _OVERFLOW marker
        if self._loop is None:
            raise UeventMonitorError("the monitor is not started", code="uevent_monitor_not_started")
        if self._failure is not None:
            raise self._failure
        item = await asyncio.wait_for(self._queue.get(), timeout) if timeout is not None else await self._queue.get()
        if self._failure is not None:
            raise self._failure
        return item

    async def next_event(self, timeout: float | None = None) -> Uevent | None:
        """The next single event (None for an overflow marker); ``TimeoutError`` after ``timeout``."""
        item = await self._get(timeout)
        return None if item is _OVERFLOW else item

    async def bursts(self, debounce_s: float = DEFAULT_DEBOUNCE_S,
                     max_burst_s: float = DEFAULT_MAX_BURST_S) -> AsyncIterator[UeventBurst]:
        """One :class:`UeventBurst` per group of events with less than ``debounce_s`` between them.

        A burst closes after ``debounce_s`` of quiet, or ``max_burst_s`` after its
        first event, whichever comes first. Raises :class:`UeventMonitorError`
        when the monitor fails.
        """
        while True:
            items = [await self._get(None)]
            assert self._loop is not None  # _get refuses an unstarted monitor
            closes_at = self._loop.time() + max_burst_s
            while (left := closes_at - self._loop.time()) > 0:
                try:
                    items.append(await self._get(min(debounce_s, left)))
                except TimeoutError:
                    break
            yield self._burst(items)

    def _burst(self, items: Iterable[Any]) -> UeventBurst:
        events = [i for i in items if i is not _OVERFLOW]
        dropped = self._dropped + max(0, len(events) - MAX_EVENTS_PER_BURST)
        overflowed = self._overflowed
        self._dropped, self._overflowed = 0, False
        return UeventBurst(events=tuple(events[:MAX_EVENTS_PER_BURST]), dropped=dropped, overflowed=overflowed,
                           source=self.source or UeventSource.kernel)
