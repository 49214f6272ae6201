"""One terminal session's bytes between a guest PTY and its two NATS subjects, with flow control.

The frames and the windows are the contract's (``contract/terminal.py``); this module
enforces them:

* Output: the agent reads the PTY only while the gateway's credit allows
  (``sent - acked < output_window``) and never more than the credit left, so a gateway
  that stops acknowledging stops the reads, the SSH channel's window fills, and the
  guest's own ``write`` blocks. The agent holds at most one frame of output.
* Input: ``.in`` frames are taken in ``seq`` order only (a gap or a replay closes the
  session); their bytes queue for the PTY and are acknowledged (``ack_in``) once written.
  A gateway that sends beyond ``input_window`` bytes past the last ``ack_in`` the agent
  published is closed (``input_window_exceeded``), so the queue is bounded by the window.
  The subscription's own pending limits bound what NATS buffers before the callback runs
  (overflow drops frames, which the ``seq`` check turns into a close, never a silent hole).
* ``slice.terminal_data`` input (:meth:`TerminalSession.send_input`) shares that queue and is
  bounded twice: in bytes (at most ``max_pending_input_bytes`` not yet handed to the guest,
  beyond it ``terminal_input_full``) and in time (a task whose bytes the guest has not taken
  within ``input_wait_s`` fails ``terminal_input_stalled``). The PTY gets a queued entry only
  once it took the one before (drain, then write), so an entry whose task gave up (that
  bound, or its deadline's cancel) is still in the agent and is dropped: its bytes are never
  typed into the shell later.
* Idle (no PTY byte either way for ``idle_timeout_s``; acks alone are not activity) and
  absolute (``max_session_s``) timeouts, and a periodic ``recheck`` (the allocation
  still holds an active slot) close the session. A watchdog whose recheck (or byte-counter
  tick) raises closes its session (``watchdog_failed``, logged): a session is never left
  running unchecked.
* :meth:`start` runs shielded: a cancel that lands while it subscribes lets it finish, so a
  :meth:`close` then sees, and ends, every subscription and task it made.

Every close, whatever its cause, runs once: the subscription ends, the SSH connection
closes, a last frame carrying ``closed`` (reason, totals) is published, and the owner's
``on_closed`` writes the audit row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.terminal import (
    CloseReason,
    SessionTotals,
    TerminalClosed,
    TerminalInputFrame,
    TerminalOutputFrame,
    b64,
)
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)


class Pty(Protocol):
    """What the session needs of a PTY (``host/vm/sshrelay.SshPty``)."""

    async def read(self, n: int) -> bytes: ...
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def resize(self, cols: int, rows: int) -> None: ...
    @property
    def exit_status(self) -> int | None: ...
    async def close(self, timeout_s: float = 5.0) -> None: ...


class SessionClosed(AgentError):
    """The session ended before (or while) the operation ran."""

    default_code = "session_closed"


class InputRefused(AgentError):
    """Terminal input not taken: the session's input queue is full, or the guest did not read it in time.

    Codes: ``terminal_input_full``, ``terminal_input_stalled``. Either way none of its bytes reach the guest.
    """

    default_code = "terminal_input_full"


@dataclass(frozen=True)
class FlowSettings:
    output_window_bytes: int
    input_window_bytes: int
    max_frame_bytes: int
    idle_timeout_s: float
    max_session_s: float
    recheck_interval_s: float
    max_pending_input_bytes: int = 64 << 10
    input_wait_s: float = 10.0


@dataclass
class _Input:
    """Bytes queued for the PTY: an ``.in`` frame's (``waiter`` None) or a data task's."""

    data: bytes
    waiter: asyncio.Future[int] | None
    from_frame: bool
    dropped: bool = False  # its task gave up before the PTY took it: never written


@dataclass
class Counters:
    out_seq: int = 0  # frames published on .out
    out_sent: int = 0  # PTY output bytes published
    out_acked: int = 0  # ... of which the gateway acknowledged
    in_seq: int = 0  # last .in frame taken
    in_received: int = 0  # .in data bytes taken
    in_frame_written: int = 0  # ... of which written to the PTY (what ack_in says)
    in_acked_published: int = 0  # the last ack_in published
    bytes_in: int = 0  # every byte written to the PTY (frames and terminal_data tasks)


class TerminalSession:
    """Start with :meth:`start`; ends by itself or with :meth:`close`; :attr:`closed` is set when done."""

    def __init__(self, nc: Client, node_id: str, session_id: str, pty: Pty, flow: FlowSettings, *,
                 on_closed: Callable[[TerminalSession], Awaitable[None]],
                 recheck: Callable[[], Awaitable[str | None]] | None = None,
                 on_tick: Callable[[TerminalSession], Awaitable[None]] | None = None) -> None:
        self.nc = nc
        self.session_id = session_id
        self.pty = pty
        self.flow = flow
        self.subject_in = subjects.terminal_in(node_id, session_id)
        self.subject_out = subjects.terminal_out(node_id, session_id)
        self.counters = Counters()
        self.final: TerminalClosed | None = None
        self.closed = asyncio.Event()
        self._on_closed = on_closed
        self._recheck = recheck
        self._on_tick = on_tick
        self._loop = asyncio.get_running_loop()
        self.opened_at = self._loop.time()
        self._last_activity = self.opened_at
        self._credit = asyncio.Condition()
        self._queue: asyncio.Queue[_Input] = asyncio.Queue()
        self._pending_task_bytes = 0  # data tasks' bytes queued and not yet written (the byte bound)
        self._draining = False  # the input pump waits for the guest to take what it was given
        self._taken: _Input | None = None  # the entry the input pump holds (waiting for the drain)
        self._publish_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._closer: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self._sub: Subscription | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe and start the pumps and the watchdog; shielded (see the module docstring)."""
        self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        # Bounded buffering before the callback: beyond it NATS drops frames (then the seq check closes us).
        pending_bytes = 4 * self.flow.input_window_bytes + (1 << 20)
        self._sub = await self.nc.subscribe(self.subject_in, cb=self._on_in, pending_msgs_limit=4096,
                                            pending_bytes_limit=pending_bytes)
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self.nc.flush(timeout=5)
        if self._closer is not None:  # closed while subscribing: close() ends the subscription, no pumps
            return
        self._tasks = [asyncio.create_task(self._pump_out(), name=f"terminal-out-{self.session_id}"),
                       asyncio.create_task(self._pump_in(), name=f"terminal-in-{self.session_id}"),
                       asyncio.create_task(self._watch(), name=f"terminal-watch-{self.session_id}")]

    @property
    def pending_input_bytes(self) -> int:
        """Data tasks' bytes queued for the guest and not yet written (bounded by ``max_pending_input_bytes``)."""
        return self._pending_task_bytes

    @property
    def input_blocked(self) -> bool:
        """The guest has not taken the input it was given: the next queued entry waits for it."""
        return self._draining

    @property
    def totals(self) -> SessionTotals:
        return SessionTotals(bytes_in=self.counters.bytes_in, bytes_out=self.counters.out_sent)

    def request_close(self, reason: CloseReason, detail: str = "") -> asyncio.Task[None]:
        """Close from inside a pump or a callback (a task cannot cancel itself and wait for itself)."""
        if self._closer is None:
            self._closer = asyncio.ensure_future(self._close(reason, detail))
        return self._closer

    async def close(self, reason: CloseReason, detail: str = "") -> TerminalClosed:
        """Close once (later calls wait for the first); returns the closing frame's body."""
        await asyncio.shield(self.request_close(reason, detail))
        assert self.final is not None
        return self.final

    async def _close(self, reason: CloseReason, detail: str) -> None:
        if self._starting is not None:  # a start still subscribing: let it finish so its subscription is ours
            with contextlib.suppress(Exception):
                await self._starting
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current), return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._sub.unsubscribe()
        await self.pty.close()
        left = [self._taken] if self._taken is not None else []
        while not self._queue.empty():
            left.append(self._queue.get_nowait())
        for item in left:
            if item.waiter is not None and not item.waiter.done():
                item.waiter.set_exception(SessionClosed(f"terminal session {self.session_id} closed: {reason.value}",
                                                        evidence={"session_id": self.session_id,
                                                                  "reason": reason.value}))
        self.final = TerminalClosed(reason=reason, detail=detail[:500], totals=self.totals,
                                    exit_status=self.pty.exit_status)
        try:
            await self._publish(b"", closed=self.final)
        except AgentError as exc:  # the gateway is gone too; the audit row still says how it ended
            log_event(log, "terminal_final_frame_lost", logging.WARNING, session_id=self.session_id, code=exc.code)
        try:
            await self._on_closed(self)
        except Exception as exc:  # the audit row could not be written (store gone): the session still ended
            log_event(log, "terminal_close_audit_failed", logging.ERROR, session_id=self.session_id,
                      reason=reason.value, error=repr(exc)[:300])
        finally:
            self.closed.set()

    # -- the two directions ------------------------------------------------------------------

    async def _publish(self, data: bytes, *, closed: TerminalClosed | None = None) -> None:
        c = self.counters
        async with self._publish_lock:
            c.out_seq += 1
            frame = TerminalOutputFrame(session_id=self.session_id, seq=c.out_seq, offset=c.out_sent, data=b64(data),
                                        ack_in=c.in_frame_written, closed=closed)
            c.out_sent += len(data)
            c.in_acked_published = c.in_frame_written
            try:
                await self.nc.publish(self.subject_out, frame.model_dump_json().encode())
            except (nats.errors.Error, OSError) as exc:
                raise AgentError(f"terminal output of {self.session_id} could not be published: {exc!r}",
                                 code="terminal_publish_failed", evidence={"session_id": self.session_id}) from None

    async def _pump_out(self) -> None:
        c, window = self.counters, self.flow.output_window_bytes
        try:
            while True:
                async with self._credit:
                    await self._credit.wait_for(lambda: c.out_sent - c.out_acked < window)
                    room = window - (c.out_sent - c.out_acked)
                data = await self.pty.read(min(self.flow.max_frame_bytes, room))
                if not data:
                    await self._ended("the guest closed the channel")
                    return
                self._last_activity = self._loop.time()
                await self._publish(data)
        except AgentError as exc:  # NATS refused the publish
            self.request_close(CloseReason.connection_lost, exc.message)
        except Exception as exc:  # OSError, asyncssh.Error and kin: the SSH side broke under the read
            await self._ended(repr(exc)[:300], lost=True)

    async def _ended(self, detail: str, *, lost: bool = False) -> None:
        """The PTY's channel ended: the shell exited (exit status known), the guest closed it, or the link broke."""
        with contextlib.suppress(Exception):
            process = getattr(self.pty, "process", None)
            if process is not None:
                await asyncio.wait_for(process.wait_closed(), 2.0)
        status = self.pty.exit_status
        if status is not None:
            self.request_close(CloseReason.remote_closed, f"the guest's shell exited with status {status}")
        else:
            self.request_close(CloseReason.connection_lost if lost else CloseReason.remote_closed, detail)

    async def _pump_in(self) -> None:
        c = self.counters
        try:
            while True:
                self._taken = None
                item = self._taken = await self._queue.get()
                if item.dropped:
                    continue
                # The guest took what it was given before: only then does this entry go to the PTY. While it
                # waits here, its task may give up; then it is dropped, never typed later.
                self._draining = True
                try:
                    await self.pty.drain()
                finally:
                    self._draining = False
                if item.dropped:
                    continue
                self.pty.write(item.data)
                c.bytes_in += len(item.data)
                if item.from_frame:
                    c.in_frame_written += len(item.data)
                else:
                    self._pending_task_bytes -= len(item.data)
                    self._last_activity = self._loop.time()  # a byte reached the PTY
                if item.waiter is not None and not item.waiter.done():
                    item.waiter.set_result(len(item.data))
                if item.from_frame and self._queue.empty():
                    await self._publish(b"")  # an ack frame: the gateway's input credit is back
        except AgentError as exc:
            self.request_close(CloseReason.connection_lost, exc.message)
        except Exception as exc:  # the channel broke under the write (or the shell exited meanwhile)
            await self._ended(repr(exc)[:300], lost=True)

    async def _on_in(self, msg: Msg) -> None:
        if self._closer is not None:
            return
        c = self.counters
        try:
            frame = TerminalInputFrame.model_validate_json(msg.data)
        except ValidationError as exc:
            self.request_close(CloseReason.protocol_error, f"an .in frame does not match the contract: "
                                                           f"{exc.errors(include_url=False)[0]['msg']}"[:500])
            return
        if frame.session_id != self.session_id:
            self.request_close(CloseReason.protocol_error, f"an .in frame names session {frame.session_id}")
            return
        if frame.seq != c.in_seq + 1:
            self.request_close(CloseReason.input_out_of_order, f"expected .in seq {c.in_seq + 1}, got {frame.seq}")
            return
        c.in_seq = frame.seq
        if not c.out_acked <= frame.ack_out <= c.out_sent:
            self.request_close(CloseReason.protocol_error,
                               f"ack_out {frame.ack_out} outside [{c.out_acked}, {c.out_sent}] (acked, sent)")
            return
        data = frame.raw
        if len(data) > self.flow.max_frame_bytes:
            self.request_close(CloseReason.protocol_error,
                               f"an .in frame carries {len(data)} bytes, more than max_frame_bytes "
                               f"{self.flow.max_frame_bytes}")
            return
        if frame.ack_out > c.out_acked:
            async with self._credit:
                c.out_acked = frame.ack_out
                self._credit.notify_all()
        if data:
            outstanding = c.in_received + len(data) - c.in_acked_published
            if outstanding > self.flow.input_window_bytes:
                self.request_close(CloseReason.input_window_exceeded,
                                   f"{outstanding} input bytes beyond the last ack_in {c.in_acked_published}; "
                                   f"the window is {self.flow.input_window_bytes}")
                return
            c.in_received += len(data)
            self._last_activity = self._loop.time()
            self._queue.put_nowait(_Input(data, None, True))

    # -- tasks' operations -----------------------------------------------------------------------

    async def send_input(self, data: bytes) -> int:
        """Write ``data`` to the PTY in order with the frames (``slice.terminal_data``); returns once the PTY took it.

        Bounded in bytes (:class:`InputRefused` ``terminal_input_full``, nothing queued) and in time
        (``terminal_input_stalled`` after ``input_wait_s``); given up, or cancelled, its bytes are dropped.
        """
        if self._closer is not None:
            raise SessionClosed(f"terminal session {self.session_id} is closed", evidence={"session_id": self.session_id})
        limit = self.flow.max_pending_input_bytes
        if self._pending_task_bytes + len(data) > limit:
            raise InputRefused(
                f"terminal session {self.session_id} already holds {self._pending_task_bytes} bytes of input the guest "
                f"has not taken; {len(data)} more would pass max_pending_input_bytes {limit}",
                code="terminal_input_full", evidence={"session_id": self.session_id, "bytes": len(data),
                                                      "pending_bytes": self._pending_task_bytes,
                                                      "max_pending_input_bytes": limit})
        item = _Input(data, self._loop.create_future(), False)
        assert item.waiter is not None
        self._pending_task_bytes += len(data)
        self._queue.put_nowait(item)
        try:
            done, _ = await asyncio.wait({item.waiter}, timeout=self.flow.input_wait_s)
        finally:
            if not item.waiter.done():  # gave up (the bound below) or cancelled (its deadline): never written
                self._drop(item)
        if not done:
            raise InputRefused(
                f"the guest of terminal session {self.session_id} did not take {len(data)} bytes of input within "
                f"{self.flow.input_wait_s:g}s (it is not reading); they were dropped",
                code="terminal_input_stalled", evidence={"session_id": self.session_id, "bytes": len(data),
                                                         "input_wait_s": self.flow.input_wait_s})
        return item.waiter.result()

    def _drop(self, item: _Input) -> None:
        item.dropped = True
        self._pending_task_bytes -= len(item.data)
        if item.waiter is not None:
            item.waiter.cancel()

    def resize(self, cols: int, rows: int) -> None:
        if self._closer is not None:
            raise SessionClosed(f"terminal session {self.session_id} is closed", evidence={"session_id": self.session_id})
        self.pty.resize(cols, rows)

    # -- timeouts and rechecks ------------------------------------------------------------------

    async def _watch(self) -> None:
        flow = self.flow
        next_recheck = self.opened_at + flow.recheck_interval_s
        while True:
            now = self._loop.time()
            wake = min(self.opened_at + flow.max_session_s, self._last_activity + flow.idle_timeout_s, next_recheck)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.closed.wait(), max(0.0, wake - now))  # the earliest deadline
                return
            now = self._loop.time()
            if now >= self.opened_at + flow.max_session_s:
                self.request_close(CloseReason.absolute_timeout, f"open for {flow.max_session_s:g}s")
                return
            if now >= self._last_activity + flow.idle_timeout_s:
                self.request_close(CloseReason.idle_timeout, f"no byte either way for {flow.idle_timeout_s:g}s")
                return
            if now >= next_recheck:
                next_recheck = now + flow.recheck_interval_s
                try:
                    if self._on_tick is not None:
                        await self._on_tick(self)  # e.g. the byte counters to the store, awaited off the loop
                    why = await self._recheck() if self._recheck is not None else None
                except Exception as exc:  # the check itself failed: closed with the reason, never left unchecked
                    log_event(log, "terminal_watchdog_failed", logging.ERROR, session_id=self.session_id,
                              error=repr(exc)[:300])
                    self.request_close(CloseReason.watchdog_failed, f"the session's periodic check failed: {exc!r}")
                    return
                if why is not None:
                    self.request_close(CloseReason.allocation_inactive, why)
                    return
