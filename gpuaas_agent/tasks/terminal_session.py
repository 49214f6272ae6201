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
* Idle (no PTY byte either way for ``idle_timeout_s``; acks alone are not activity) and
  absolute (``max_session_s``) timeouts, and a periodic ``recheck`` (the allocation
  still holds an active slot) close the session.

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
    """What the session needs of a PTY (``host/sshrelay.SshPty``)."""

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


@dataclass(frozen=True)
class FlowSettings:
    output_window_bytes: int
    input_window_bytes: int
    max_frame_bytes: int
    idle_timeout_s: float
    max_session_s: float
    recheck_interval_s: float


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
        self._queue: asyncio.Queue[tuple[bytes, asyncio.Future | None, bool]] = asyncio.Queue()
        self._publish_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._closer: asyncio.Task | None = None
        self._sub = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        # Bounded buffering before the callback: beyond it NATS drops frames (then the seq check closes us).
        pending_bytes = 4 * self.flow.input_window_bytes + (1 << 20)
        self._sub = await self.nc.subscribe(self.subject_in, cb=self._on_in, pending_msgs_limit=4096,
                                            pending_bytes_limit=pending_bytes)
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self.nc.flush(timeout=5)
        self._tasks = [asyncio.create_task(self._pump_out(), name=f"terminal-out-{self.session_id}"),
                       asyncio.create_task(self._pump_in(), name=f"terminal-in-{self.session_id}"),
                       asyncio.create_task(self._watch(), name=f"terminal-watch-{self.session_id}")]

    @property
    def totals(self) -> SessionTotals:
        return SessionTotals(bytes_in=self.counters.bytes_in, bytes_out=self.counters.out_sent)

    def request_close(self, reason: CloseReason, detail: str = "") -> asyncio.Task:
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
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current), return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._sub.unsubscribe()
        await self.pty.close()
        while not self._queue.empty():
            _, waiter, _ = self._queue.get_nowait()
            if waiter is not None and not waiter.done():
                waiter.set_exception(SessionClosed(f"terminal session {self.session_id} closed: {reason.value}",
                                                   evidence={"session_id": self.session_id, "reason": reason.value}))
        self.final = TerminalClosed(reason=reason, detail=detail[:500], totals=self.totals,
                                    exit_status=self.pty.exit_status)
        try:
            await self._publish(b"", closed=self.final)
        except AgentError as exc:  # the gateway is gone too; the audit row still says how it ended
            log_event(log, "terminal_final_frame_lost", logging.WARNING, session_id=self.session_id, code=exc.code)
        try:
            await self._on_closed(self)
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
                data, waiter, from_frame = await self._queue.get()
                self.pty.write(data)
                await self.pty.drain()
                c.bytes_in += len(data)
                if from_frame:
                    c.in_frame_written += len(data)
                if waiter is not None and not waiter.done():
                    waiter.set_result(len(data))
                if from_frame and self._queue.empty():
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
            self._queue.put_nowait((data, None, True))

    # -- tasks' operations -----------------------------------------------------------------------

    async def send_input(self, data: bytes) -> int:
        """Write ``data`` to the PTY in order with the frames (``slice.terminal_data``); returns when written."""
        if self._closer is not None:
            raise SessionClosed(f"terminal session {self.session_id} is closed", evidence={"session_id": self.session_id})
        waiter: asyncio.Future = self._loop.create_future()
        self._last_activity = self._loop.time()
        self._queue.put_nowait((data, waiter, False))
        return await waiter

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
                if self._on_tick is not None:
                    await self._on_tick(self)  # e.g. the byte counters to the store, awaited off the loop
                if self._recheck is not None:
                    why = await self._recheck()
                    if why is not None:
                        self.request_close(CloseReason.allocation_inactive, why)
                        return
