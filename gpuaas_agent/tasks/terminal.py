"""``slice.terminal_open`` / ``_data`` / ``_resize`` / ``_close``: the browser terminal of a slice (seed 004).

The gateway asks for a PTY in the guest of an allocation's slice; the agent opens it over
SSH (``host/vm/sshrelay.py``) with the node's relay key, whose public half provision put in
the allocation user's ``authorized_keys``, and relays it on the session's subjects
(``control/terminal_session.py``). Every field of the task is the attacker's:

* the allocation must hold the slot's lease on this host with an ``active`` record
  (``not_this_allocation``, ``slot_cleanup_blocked``, ``slot_not_active``: the power task's
  admission), and its domain must be ours and running (``domain_missing``,
  ``domain_not_ours``, ``slice_not_running``);
* the address is the slot's own DHCP reservation in the agent's hosts file; the task can
  only repeat it (``target_host``, else ``target_not_slice_ip``) and the port is the
  configured one (``target_port_refused``); no field can point the relay elsewhere;
* the user is a portable Linux name (the provision's validator: no ``-o...``, no shell
  syntax, no ``root``), passed to SSH as a user name, never through a shell;
* at most ``max_sessions_per_slice`` live sessions per slice (``too_many_sessions``) and
  ``max_sessions`` per node (``terminal_capacity``), a session id used once
  (``session_exists``);
* the guest's host key is pinned on the first session of the allocation (in the store);
  a later session meeting another key is refused (``host_key_changed``, both fingerprints).

Refusals happen before any connection is made. ``open`` and a release are ordered by the
slot lock: admission and the session's place are taken under it, the SSH connection is made
outside it, and the session is registered under it again after a second admission; a
release (which closes the slot's sessions under that lock) closes sessions still
connecting too, so no session opens into a slot being released. Each wait for the lock is
bounded by ``connect_timeout_s`` (``terminal_slot_busy``). A cancel at any point (the task's
deadline) releases everything the open registered: its place, its audit row, its
subscription.

Input of ``slice.terminal_data`` is bounded per session in bytes and in time
(``terminal_input_full``, ``terminal_input_stalled``: ``tasks/terminal_session.py``).

Each session is audited in the store
(``terminal_session``: who, allocation, user, address, host key, open task, start, end,
bytes in/out, close reason) and in the log (``terminal_opened``/``terminal_closed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from ipaddress import IPv4Address
from typing import TYPE_CHECKING, Any, Literal

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.domain import DomainState
from gpuaas_agent.contract.naming import domain_name
from gpuaas_agent.contract.terminal import (
    CloseReason,
    HostKeyPin,
    TerminalAudit,
    TerminalClosePayload,
    TerminalDataPayload,
    TerminalDataResult,
    TerminalOpenPayload,
    TerminalOpenResult,
    TerminalResizePayload,
    TerminalResizeResult,
)
from gpuaas_agent.deploy import relaykey
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.state.store import StateError
from gpuaas_agent.tasks.context import Handler, SlotRequest, TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.power import PowerRefused, admit, check_domain
from gpuaas_agent.tasks.terminal_session import FlowSettings, SessionClosed, TerminalSession

if TYPE_CHECKING:
    import asyncssh

log = logging.getLogger(__name__)


class TerminalRefused(AgentError):
    """Refused before any connection was made (codes: see the module docstring)."""

    default_code = "terminal_refused"


@dataclass
class _Live:
    session: TerminalSession
    audit: TerminalAudit


def _refused(exc: PowerRefused) -> TerminalRefused:
    return TerminalRefused(exc.message.replace("nothing touched", "no terminal opened"), code=exc.code,
                           evidence=exc.evidence)


class TerminalRelay:
    """The node's terminal sessions; one per daemon (:func:`relay_of`)."""

    def __init__(self, drivers: SliceDrivers) -> None:
        self.drivers = drivers
        self.config = drivers.slice.terminal
        self.sessions: dict[str, _Live] = {}
        self._opening: dict[str, tuple[str, int]] = {}  # session id -> (allocation, slot) while connecting
        self._revoked: set[str] = set()  # sessions still connecting that a release closed: they never open

    def counts(self) -> tuple[int, int]:
        """Sessions registered, and sessions still connecting (the daemon's status)."""
        return len(self.sessions), len(self._opening)

    @property
    def flow(self) -> FlowSettings:
        c = self.config
        return FlowSettings(output_window_bytes=c.output_window_bytes, input_window_bytes=c.input_window_bytes,
                            max_frame_bytes=c.max_frame_bytes, idle_timeout_s=c.idle_timeout_s,
                            max_session_s=c.max_session_s, recheck_interval_s=c.recheck_interval_s,
                            max_pending_input_bytes=c.max_pending_input_bytes, input_wait_s=c.input_wait_s)

    # -- admission ---------------------------------------------------------------------------

    async def _admit_slot(self, state: StoreThread, payload: SlotRequest) -> None:
        try:
            await state.run(admit, payload)
        except PowerRefused as exc:
            raise _refused(exc) from None

    def _claim(self, known: TerminalAudit | None, payload: TerminalOpenPayload) -> None:
        """Session id unused (``known``: the store's row of it, read before), the slice's and node's limits
        not reached: the session's place is taken (no await in here: the check and the claim are one step)."""
        sid = payload.session_id
        if sid in self.sessions or sid in self._opening or known is not None:
            raise TerminalRefused(f"terminal session {sid} was already used on this host", code="session_exists",
                                  evidence={"session_id": sid})
        mine = (payload.allocation_id, payload.slot_index)
        live = [s for s, (a, i) in self._places() if (a, i) == mine]
        if len(live) >= self.config.max_sessions_per_slice:
            raise TerminalRefused(
                f"slot {payload.slot_index} of allocation {payload.allocation_id} already has {len(live)} terminal "
                f"sessions (at most {self.config.max_sessions_per_slice})", code="too_many_sessions",
                evidence={"sessions": sorted(live), "max_sessions_per_slice": self.config.max_sessions_per_slice})
        total = len(self.sessions) + len(self._opening)
        if total >= self.config.max_sessions:
            raise TerminalRefused(f"this node already relays {total} terminal sessions (at most "
                                  f"{self.config.max_sessions})", code="terminal_capacity",
                                  evidence={"sessions": total, "max_sessions": self.config.max_sessions})
        self._opening[sid] = mine

    def _places(self) -> list[tuple[str, tuple[str, int]]]:
        return [*((sid, (lv.audit.allocation_id, lv.audit.slot_index)) for sid, lv in self.sessions.items()),
                *self._opening.items()]

    async def _target(self, payload: TerminalOpenPayload) -> tuple[str, int]:
        """The slot's reserved address (from the agent's own hosts file) and the configured SSH port."""
        slice_cfg = self.drivers.slice
        reserved = [r for r in await asyncio.to_thread(self.drivers.reservations().reservations)
                    if r.allocation_id == payload.allocation_id and r.slot_index == payload.slot_index]
        if len(reserved) != 1:
            raise TerminalRefused(f"slot {payload.slot_index} of allocation {payload.allocation_id} has "
                                  f"{len(reserved)} DHCP reservations on this host, not one: no address to reach",
                                  code="reservation_missing",
                                  evidence={"reservations": [r.model_dump(mode="json") for r in reserved]})
        ip = IPv4Address(str(reserved[0].ip))
        if ip not in slice_cfg.subnet or ip in (slice_cfg.gateway, slice_cfg.subnet.network_address,
                                                slice_cfg.subnet.broadcast_address):
            raise TerminalRefused(f"the reservation of slot {payload.slot_index} holds {ip}, not a guest address of "
                                  f"{slice_cfg.subnet}", code="reservation_invalid",
                                  evidence={"ip": str(ip), "subnet": str(slice_cfg.subnet)})
        if payload.target_host is not None and payload.target_host != str(ip):
            raise TerminalRefused(f"target_host {payload.target_host} is not the reservation of slot "
                                  f"{payload.slot_index} ({ip}): the relay connects only to the slice's own address",
                                  code="target_not_slice_ip",
                                  evidence={"target_host": payload.target_host, "reserved_ip": str(ip),
                                            "slot_index": payload.slot_index})
        port = self.config.ssh_port
        if payload.target_port is not None and payload.target_port != port:
            raise TerminalRefused(f"target_port {payload.target_port} is not the guests' SSH port {port}",
                                  code="target_port_refused",
                                  evidence={"target_port": payload.target_port, "ssh_port": port})
        return str(ip), port

    async def _running_domain(self, payload: TerminalOpenPayload) -> None:
        try:
            info = check_domain(await self.drivers.libvirt.lookup(domain_name(payload.allocation_id)), payload)
        except PowerRefused as exc:
            raise _refused(exc) from None
        if info.state is not DomainState.running:
            raise TerminalRefused(f"domain {info.name} is {info.state.value}: start the slice first",
                                  code="slice_not_running", evidence={"domain": info.name, "state": info.state.value})

    def _client_key(self) -> asyncssh.SSHKey:
        from gpuaas_agent.host.vm import sshrelay  # asyncssh: only a terminal pays it (tests/test_import_graph.py)

        public = self.drivers.slice.terminal_relay_key_file
        found = relaykey.inspect(public)  # a key with loose permissions or the wrong type: refused, typed
        if found.key is None:
            raise TerminalRefused(f"terminal relay key {public} is missing: run gpuaas-agent prepare-host",
                                  code="relay_key_missing", evidence={"path": str(public)})
        return sshrelay.load_client_key(found.key.private)

    @contextlib.asynccontextmanager
    async def _slot_locked(self, payload: TerminalOpenPayload) -> AsyncIterator[None]:
        """The slot lock (release and power hold it), waited for at most ``connect_timeout_s``."""
        lock = self.drivers.slot_lock(payload.slot_index)
        wait_s = self.config.connect_timeout_s
        acquiring = asyncio.ensure_future(lock.acquire())
        try:
            done, _ = await asyncio.wait({acquiring}, timeout=wait_s)
        except BaseException:  # cancelled while waiting: never keep a lock nobody will release
            if acquiring.done() and not acquiring.cancelled():
                lock.release()
            else:
                acquiring.cancel()
            raise
        if not done:
            acquiring.cancel()  # Lock.acquire hands a wake-up it got meanwhile on to the next waiter
            raise TerminalRefused(f"slot {payload.slot_index} is busy with a release, provision or power operation "
                                  f"for more than {wait_s:g}s: no terminal opened, retry after it",
                                  code="terminal_slot_busy",
                                  evidence={"slot_index": payload.slot_index, "waited_s": wait_s})
        try:
            yield
        finally:
            lock.release()

    # -- open ----------------------------------------------------------------------------------

    async def open(self, payload: TerminalOpenPayload, ctx: TaskContext) -> dict[str, Any]:
        from gpuaas_agent.host.vm import sshrelay  # asyncssh: only a terminal pays it (tests/test_import_graph.py)

        store = as_store_thread(ctx.store)  # every call awaited on the store thread (state/aio.py)
        stale = await store.close_stale_terminal_sessions(set(self.sessions) | set(self._opening),
                                                          reason=CloseReason.agent_restarted.value)
        if stale:
            log_event(log, "terminal_sessions_closed_stale", logging.WARNING, session_ids=stale,
                      reason=CloseReason.agent_restarted.value)
        async with self._slot_locked(payload):  # ordered with a release of the slot
            await self._admit_slot(store, payload)
            self._claim(await store.terminal_session(payload.session_id), payload)
        pty = None
        try:
            await self._running_domain(payload)
            host, port = await self._target(payload)
            client_key = await asyncio.to_thread(self._client_key)
            pin = await store.host_key_pin(payload.allocation_id)
            cfg = self.config
            pty = await sshrelay.open_pty(
                host, port, payload.user, client_key, pinned=pin.public_key if pin else None, term=payload.term,
                cols=payload.cols, rows=payload.rows, connect_timeout_s=cfg.connect_timeout_s,
                keepalive_interval_s=cfg.keepalive_interval_s, window_bytes=cfg.ssh_window_bytes)
            offered = sshrelay.public_line(pty.host_key)
            pinned: Literal["first_use", "matched"] = "matched"
            if pin is None:
                pinned = "first_use"
                held = await store.pin_host_key(HostKeyPin(
                    allocation_id=payload.allocation_id, slot_index=payload.slot_index, target_host=host,
                    public_key=offered, fingerprint=pty.host_key_fingerprint, pinned_at=time.time()))
                if held.public_key != offered:  # another session pinned another key meanwhile
                    raise sshrelay.HostKeyChanged(
                        f"guest {host} presented {pty.host_key_fingerprint}, pinned meanwhile: {held.fingerprint}",
                        evidence={"pinned_fingerprint": held.fingerprint,
                                  "offered_fingerprint": pty.host_key_fingerprint, "host": host})
            async with self._slot_locked(payload):
                # Registered under the slot lock, after a second admission: a release that ran while this
                # connected (or closed it while connecting) wins, and no session opens into its slot.
                if payload.session_id in self._revoked:
                    raise SessionClosed(f"terminal session {payload.session_id} was closed while connecting (a release "
                                        f"of slot {payload.slot_index}, or the agent's shutdown): no terminal opened",
                                        evidence={"session_id": payload.session_id, "slot_index": payload.slot_index})
                await self._admit_slot(store, payload)
                now = time.time()
                audit = TerminalAudit(
                    session_id=payload.session_id, allocation_id=payload.allocation_id, slot_index=payload.slot_index,
                    requested_by=payload.requested_by, user=payload.user, target_host=host, target_port=port,
                    host_key_fingerprint=pty.host_key_fingerprint, open_task_id=ctx.envelope.task_id, opened_at=now)
                try:
                    await store.record_terminal_open(audit)
                except StateError as exc:
                    raise TerminalRefused(exc.message, code=exc.code, evidence=exc.evidence) from None
                session = TerminalSession(
                    ctx.nc, ctx.node_id, payload.session_id, pty, self.flow,
                    on_closed=self._closed_callback(store), recheck=self._recheck_callback(store, payload),
                    on_tick=self._tick_callback(store))
                self.sessions[payload.session_id] = _Live(session=session, audit=audit)
                pty = None  # the session owns it now: a failure from here closes the session (and audits it)
                try:
                    await session.start()
                except BaseException as exc:
                    # A cancel (the task's deadline) too: the session is closed, its audit row written and its
                    # place freed, never left registered without its pumps and watchdog.
                    cancelled = isinstance(exc, asyncio.CancelledError)
                    await session.close(CloseReason.connection_lost,
                                        "the open was cancelled while its subjects were set up" if cancelled else
                                        f"the session's subjects could not be set up: {exc!r}")
                    if cancelled or not isinstance(exc, Exception):
                        raise
                    raise TerminalRefused(f"terminal session {payload.session_id} could not subscribe to "
                                          f"{session.subject_in}: {exc!r}", code="terminal_subscribe_failed",
                                          evidence={"session_id": payload.session_id}) from None
        except BaseException:
            if pty is not None:
                await pty.close()
            raise
        finally:
            self._opening.pop(payload.session_id, None)
            self._revoked.discard(payload.session_id)
        log_event(log, "terminal_opened", session_id=payload.session_id, allocation_id=payload.allocation_id,
                  slot_index=payload.slot_index, requested_by=payload.requested_by, user=payload.user,
                  target=f"{host}:{port}", host_key=audit.host_key_fingerprint, host_key_pinned=pinned,
                  task_id=ctx.envelope.task_id)
        return TerminalOpenResult(
            session_id=payload.session_id, allocation_id=payload.allocation_id, slot_index=payload.slot_index,
            user=payload.user, target_host=host, target_port=port, subject_in=session.subject_in,
            subject_out=session.subject_out, host_key_fingerprint=audit.host_key_fingerprint, host_key_pinned=pinned,
            output_window_bytes=cfg.output_window_bytes, input_window_bytes=cfg.input_window_bytes,
            max_frame_bytes=cfg.max_frame_bytes, idle_timeout_s=cfg.idle_timeout_s, max_session_s=cfg.max_session_s,
            opened_at=datetime.fromtimestamp(now, UTC)).model_dump(mode="json")

    @staticmethod
    def _tick_callback(store: StoreThread) -> Callable[[TerminalSession], Awaitable[None]]:
        async def tick(session: TerminalSession) -> None:
            await store.record_terminal_bytes(session.session_id, session.counters.bytes_in, session.counters.out_sent)

        return tick

    def _closed_callback(self, store: StoreThread) -> Callable[[TerminalSession], Awaitable[None]]:
        async def closed(session: TerminalSession) -> None:
            live = self.sessions.pop(session.session_id, None)
            final = session.final
            assert final is not None
            row = await store.record_terminal_close(session.session_id, reason=final.reason.value, detail=final.detail,
                                              bytes_in=final.totals.bytes_in, bytes_out=final.totals.bytes_out)
            audit = row or (live.audit if live else None)
            log_event(log, "terminal_closed",
                      logging.INFO if final.reason in _ORDINARY else logging.WARNING,
                      session_id=session.session_id, allocation_id=audit.allocation_id if audit else None,
                      requested_by=audit.requested_by if audit else None, reason=final.reason.value,
                      detail=final.detail, bytes_in=final.totals.bytes_in, bytes_out=final.totals.bytes_out,
                      exit_status=final.exit_status,
                      duration_s=round(row.closed_at - row.opened_at, 3) if row and row.closed_at else None)

        return closed

    def _recheck_callback(self, store: StoreThread,
                          payload: TerminalOpenPayload) -> Callable[[], Awaitable[str | None]]:
        async def recheck() -> str | None:
            try:
                await store.run(admit, payload)
            except PowerRefused as exc:
                return f"{exc.code}: {exc.message}"
            return None

        return recheck

    # -- the session's other tasks ---------------------------------------------------------------

    async def _live(self, store: StoreThread, session_id: str, allocation_id: str) -> _Live:
        live = self.sessions.get(session_id)
        if live is not None and live.audit.allocation_id == allocation_id:
            return live
        row = await store.terminal_session(session_id)
        if row is not None and row.allocation_id == allocation_id and row.closed_at is not None:
            raise SessionClosed(f"terminal session {session_id} is closed ({row.close_reason.value})",
                                evidence={"session_id": session_id, "reason": row.close_reason.value})
        # Another allocation's session reads as no session at all: ids are not a way to probe a tenant.
        raise TerminalRefused(f"no live terminal session {session_id} of allocation {allocation_id} on this host",
                              code="session_not_found", evidence={"session_id": session_id,
                                                                  "allocation_id": allocation_id})

    async def data(self, payload: TerminalDataPayload, ctx: TaskContext) -> dict[str, Any]:
        live = await self._live(as_store_thread(ctx.store), payload.session_id, payload.allocation_id)
        raw = payload.raw
        if len(raw) > self.config.max_frame_bytes:
            raise TerminalRefused(f"{len(raw)} bytes of input, more than max_frame_bytes {self.config.max_frame_bytes}",
                                  code="terminal_data_too_large",
                                  evidence={"bytes": len(raw), "max_frame_bytes": self.config.max_frame_bytes})
        written = await live.session.send_input(raw)  # bounded: terminal_input_full / terminal_input_stalled
        return TerminalDataResult(session_id=payload.session_id, bytes_written=written,
                                  totals=live.session.totals).model_dump(mode="json")

    async def resize(self, payload: TerminalResizePayload, ctx: TaskContext) -> dict[str, Any]:
        live = await self._live(as_store_thread(ctx.store), payload.session_id, payload.allocation_id)
        live.session.resize(payload.cols, payload.rows)
        log_event(log, "terminal_resized", session_id=payload.session_id, cols=payload.cols, rows=payload.rows)
        return TerminalResizeResult(session_id=payload.session_id, cols=payload.cols,
                                    rows=payload.rows).model_dump(mode="json")

    async def close(self, payload: TerminalClosePayload, ctx: TaskContext) -> dict[str, Any]:
        store = as_store_thread(ctx.store)
        try:
            live = await self._live(store, payload.session_id, payload.allocation_id)
        except SessionClosed:
            row: TerminalAudit | None = await store.terminal_session(payload.session_id)
            assert row is not None
            return row.model_dump(mode="json")  # closed before: its audit record, nothing else to do
        await live.session.close(CloseReason.client_closed, f"slice.terminal_close task {ctx.envelope.task_id}")
        closed: TerminalAudit | None = await store.terminal_session(payload.session_id)
        assert closed is not None
        return closed.model_dump(mode="json")

    async def close_slot(self, allocation_id: str, slot_index: int, reason: CloseReason) -> int:
        """Close the sessions into one slot of one allocation (its release, under the slot lock); returns how many.

        Sessions still connecting count too: they are marked so that their open refuses to register them.
        """
        connecting = [sid for sid, place in self._opening.items() if place == (allocation_id, slot_index)]
        self._revoked.update(connecting)
        lives = [lv for lv in self.sessions.values()
                 if (lv.audit.allocation_id, lv.audit.slot_index) == (allocation_id, slot_index)]
        await asyncio.gather(*(lv.session.close(reason) for lv in lives), return_exceptions=True)
        if connecting:
            log_event(log, "terminal_opening_revoked", session_ids=connecting, allocation_id=allocation_id,
                      slot_index=slot_index, reason=reason.value)
        return len(lives) + len(connecting)

    async def close_all(self, reason: CloseReason) -> int:
        """Close every live session (agent shutdown); returns how many. Sessions still connecting never open."""
        self._revoked.update(self._opening)
        lives = list(self.sessions.values())
        await asyncio.gather(*(lv.session.close(reason) for lv in lives), return_exceptions=True)
        return len(lives)


_ORDINARY = frozenset({CloseReason.client_closed, CloseReason.remote_closed, CloseReason.idle_timeout,
                       CloseReason.absolute_timeout, CloseReason.agent_shutdown})


def relay_of(drivers: SliceDrivers) -> TerminalRelay:
    """The node's one relay, kept by the drivers (which end its sessions on shutdown and on release)."""
    return drivers.terminals(TerminalRelay)


def terminal_handler(drivers: SliceDrivers, operation: Literal["open", "data", "resize", "close"]) -> Handler:
    """The handler of one of the four task types, all served by the node's one :class:`TerminalRelay`."""
    async def handle(payload: Any, ctx: TaskContext) -> dict[str, Any]:
        relay = relay_of(drivers)
        method: Handler = getattr(relay, operation)
        return await method(payload, ctx)

    return handle
