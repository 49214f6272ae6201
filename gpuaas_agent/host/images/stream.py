"""One pass over a downloading image: every chunk is hashed, written to the cache file and to the slot disk.

Why: the first boot of an image a host has never seen used to cost three passes over its
bytes (download into the cache, fsync, clone onto the disk). A raw image needs no random
access, so the download itself is written to both places while it is hashed, and the
first provision costs about one pass: ``max(download, disk write)``, not their sum.

The pump is mechanism only; host/images/cache.py decides when a download may stream and what
its digest must be. Threads, because every piece blocks and releases the GIL (socket
reads, ``hashlib`` over 4 MiB, ``pwrite``): the calling thread reads the source into a
small pool of page-aligned buffers (``O_DIRECT`` needs the alignment); each sink (the
digest with the cache file, the disk) runs in its own thread and takes the chunks in
order, so the download, the hash and the disk write overlap. A buffer goes back to the
pool when every sink is done with it, which bounds memory to ``buffers * chunk_bytes``.

A sink's error or ``cancel`` stops the pump: the reader stops reading, every sink stops
before its next write, and the pump returns only after every sink thread has ended, so
whoever owns the descriptors may close them without a write landing afterwards.
"""

from __future__ import annotations

import mmap
import queue
import threading
from collections.abc import Callable

Sink = Callable[[memoryview, int], None]  # (chunk, offset in the image); called in order, from one thread

STREAM_CHUNK_BYTES = 4 << 20  # 4 MiB: hashlib and O_DIRECT writes at full speed, few wake-ups
STREAM_BUFFERS = 8  # 32 MiB in flight at most: the reader runs ahead of the slowest sink by up to 7 chunks
_POLL_S = 0.2  # how often a blocked queue wait looks at ``cancel``


class PumpCancelled(Exception):
    """``cancel`` was set: the caller gave up (its deadline, a stall, the task's cancellation)."""


class TooLarge(Exception):
    """The source sent more than ``max_bytes``; ``received`` is a lower bound of what it would send."""

    def __init__(self, received: int) -> None:
        super().__init__(received)
        self.received = received


def fill(read_into: Callable[[memoryview], int], buf: memoryview, on_read: Callable[[], None] | None = None) -> int:
    """Read until ``buf`` is full or the source ends; the byte count. Sources return short reads."""
    got = 0
    while got < len(buf):
        n = read_into(buf[got:])
        if not n:
            break
        got += n
        if on_read is not None:
            on_read()
    return got


class _SinkThread:
    def __init__(self, name: str, sink: Sink, pump: _Pump) -> None:
        self.sink = sink
        self.pump = pump
        self.inbox: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            index, length, offset = item
            try:
                if not self.pump.cancel.is_set():
                    self.sink(self.pump.views[index][:length], offset)
            except BaseException as exc:  # handed to the reader, which raises it
                self.pump.fail(exc)
            finally:
                self.pump.done_with(index)


class _Pump:
    def __init__(self, sinks: list[Sink], cancel: threading.Event, chunk_bytes: int, buffers: int) -> None:
        self.cancel = cancel
        self.maps = [mmap.mmap(-1, chunk_bytes) for _ in range(buffers)]  # page-aligned, zero-filled
        self.views = [memoryview(m) for m in self.maps]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(buffers):
            self.free.put(index)
        self.holders = [0] * buffers
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.sinks = [_SinkThread(f"image-sink-{i}", sink, self) for i, sink in enumerate(sinks)]

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        self.cancel.set()

    def done_with(self, index: int) -> None:
        with self.lock:
            self.holders[index] -= 1
            free = self.holders[index] == 0
        if free:
            self.free.put(index)

    def take(self) -> int:
        while True:
            self.check()
            try:
                return self.free.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.cancel.is_set():
            raise PumpCancelled()

    def close(self) -> None:
        for s in self.sinks:
            s.inbox.put(None)
        for s in self.sinks:
            if s.thread.is_alive():
                s.thread.join()
        # The buffers are not closed here: a slice of one may live on in an error's traceback (the
        # chunk a sink failed on), and mmap refuses to close under it. They go with their last reference.
        self.views.clear()
        self.maps.clear()


def pump(read_into: Callable[[memoryview], int], sinks: list[Sink], *, head: bytes = b"",
         max_bytes: int | None = None, cancel: threading.Event | None = None,
         on_read: Callable[[], None] | None = None, on_chunk: Callable[[int], None] | None = None,
         chunk_bytes: int = STREAM_CHUNK_BYTES, buffers: int = STREAM_BUFFERS) -> int:
    """Read the source to its end (``head`` first: bytes already read from it), hand each chunk to every sink.

    Returns the byte count. Raises :class:`TooLarge` past ``max_bytes`` (before any sink sees the
    chunk that crossed it), :class:`PumpCancelled`, or the first error a sink or ``read_into`` raised.
    ``on_chunk(total)`` runs after each chunk is handed out (progress). Every chunk but the last is
    exactly ``chunk_bytes`` long, so its offset is a multiple of it (``O_DIRECT`` alignment).
    """
    if len(head) > chunk_bytes:
        raise ValueError("head is longer than one chunk")
    state = _Pump(sinks, cancel or threading.Event(), chunk_bytes, buffers)
    for s in state.sinks:
        s.thread.start()
    total = 0
    try:
        while True:
            index = state.take()
            view = state.views[index]
            got = 0
            if head:
                view[:len(head)] = head
                got, head = len(head), b""
            got += fill(read_into, view[got:], on_read)
            state.check()  # a sink failed or the caller gave up while this read blocked
            if max_bytes is not None and total + got > max_bytes:
                raise TooLarge(total + got)
            if not got:
                state.free.put(index)
                break
            with state.lock:
                state.holders[index] = len(state.sinks)
            for s in state.sinks:
                s.inbox.put((index, got, total))
            total += got
            if on_chunk is not None:
                on_chunk(total)
            if got < chunk_bytes:
                break
    except BaseException as exc:
        state.fail(exc)
        raise
    finally:
        state.close()
    if state.error is not None:
        raise state.error
    return total
