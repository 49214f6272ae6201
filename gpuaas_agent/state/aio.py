"""The state store seen from the event loop: every SQLite call runs on ONE store thread.

Why: a commit takes SQLite's write lock and fsyncs (``synchronous=FULL``); when
another process holds the lock (a CLI ``gpuaas-agent release``, a backup, an
operator's ``sqlite3``) a commit waits up to the busy timeout. Run on the loop,
that wait stops heartbeats, keepalives (JetStream then redelivers a running
task) and the systemd watchdog. So the daemon never touches its connection from
the loop: :class:`StoreThread` owns the :class:`StateStore` and a single-thread
executor, and each call is a coroutine that waits for that thread.

One writer thread, not a pool: the store's transactions (``BEGIN IMMEDIATE`` ...
``COMMIT``) share one connection, and two threads interleaving statements on
it would run one's statements inside the other's transaction. Reads
(:data:`READS`) go to a second connection on a second thread when the daemon
gives one (``reader``): WAL readers never wait for the write lock, so a heartbeat
that lists the leases is never queued behind a commit that waits for it.
Without a reader (tests, a plain store) reads share the writer thread.

* ``await state.journal(...)`` / ``await state.leases()``: any public
  :class:`StateStore` method, as a coroutine run on the store thread.
* ``await state.run(fn, *args)``: ``fn(store, *args)`` on the store thread (a read
  made of several calls, e.g. the reporter's in-flight view).
* ``state.sync``: the same methods, synchronous, still executed on the store
  thread (the caller blocks until it is done). Only for code that already runs
  off the loop (inside ``asyncio.to_thread``, e.g. a metrics scrape rendered on
  a worker thread): called from a thread that runs an event loop it raises
  :class:`StoreCallOnLoop`, so a handler that blocks the loop on SQLite again
  fails its tests instead of stalling heartbeats in production.

Task handlers get the :class:`StoreThread` itself as ``ctx.store`` and ``await``
every call (``await ctx.store.journal(...)``); a read made of several calls is
one ``await ctx.store.run(fn, ...)``. Writes are shielded from cancellation: a
task cancelled while its journal write waits for the store thread still gets
that write, in order (the thread runs them first in, first out).

The CLI keeps using :class:`StateStore` directly (no loop to protect).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gpuaas_agent.state.store import StateStore

T = TypeVar("T")

THREAD_NAME = "gpuaas-state"
# StateStore methods that only read: served by the reader connection when there is one.
READS = frozenset({"meta", "leases", "leases_of", "journal_of", "unfinished_steps", "result_of", "latest_wipe_proof",
                   "latest_wipe_proof_at",
                   "slot_state", "slot_states", "quarantine_of", "quarantined", "quarantine_history"})


class StoreCallOnLoop(RuntimeError):
    """A synchronous store call from a thread that runs an event loop: it would stall that loop (a bug)."""


def _on_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _submit(executor: ThreadPoolExecutor, fn: Callable[..., T], *, shield: bool) -> T:
    """``fn()`` on ``executor``'s thread; with ``shield``, a cancelled caller does not cancel the call."""
    future = asyncio.wrap_future(executor.submit(fn))
    return await (asyncio.shield(future) if shield else future)


class StoreThread:
    """A :class:`StateStore` whose every call runs on its own single thread; see the module docstring."""

    def __init__(self, store: StateStore, reader: StateStore | None = None) -> None:
        self.store = store
        self.reader = reader
        self.path = store.path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._read_executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{THREAD_NAME}-read")
                               if reader is not None else self._executor)
        self._thread_ids: set[int] = set()
        self.sync = BlockingStore(self)

    @classmethod
    def open(cls, path: str | Path) -> StoreThread:
        """The daemon's store: the writer connection (runs the migrations) and a reader connection."""
        store = StateStore.open(path)
        try:
            reader = StateStore.open(path)
        except BaseException:
            store.close()
            raise
        return cls(store, reader)

    def _in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._thread_ids.add(threading.get_ident())
        return fn(*args, **kwargs)

    def on_store_thread(self) -> bool:
        return threading.get_ident() in self._thread_ids

    def _route(self, name: str) -> tuple[Callable[..., Any], ThreadPoolExecutor]:
        if name in READS and self.reader is not None:
            return getattr(self.reader, name), self._read_executor
        return getattr(self.store, name), self._executor

    async def run(self, fn: Callable[..., T], *args: Any, write: bool = False) -> T:
        """``fn(store, *args)`` on the reader's thread (``write=True``: the writer's); the loop goes on."""
        store, executor = (self.store, self._executor) if write or self.reader is None else (
            self.reader, self._read_executor)
        return await _submit(executor, functools.partial(self._in_thread, fn, store, *args), shield=write)

    def call_blocking(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``store.name(*args)`` on the store thread; blocks the caller (not the store thread) until done."""
        method, executor = self._route(name)
        if self.on_store_thread():  # re-entered from a function already running there
            return method(*args, **kwargs)
        if _on_loop_thread():
            raise StoreCallOnLoop(f"StateStore.{name} called synchronously on the event loop's thread: it would "
                                  f"stall the loop while SQLite waits; await it (state/aio.py)")
        return executor.submit(self._in_thread, method, *args, **kwargs).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not callable(getattr(StateStore, name, None)):
            raise AttributeError(name)
        method, executor = self._route(name)
        write = name not in READS

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await _submit(executor, functools.partial(self._in_thread, method, *args, **kwargs), shield=write)

        call.__name__ = name
        return call

    def drain(self) -> None:
        """Wait until every call queued so far has run (a no-op on the store thread itself or once shut down)."""
        if self.on_store_thread():
            return
        for executor in {self._executor, self._read_executor}:
            try:
                executor.submit(lambda: None).result()
            except RuntimeError:  # shut down: nothing more runs there
                pass

    async def aclose(self) -> None:
        """Close the connections on their threads, then end the threads."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Synchronous close (outside a loop): the same, waiting here."""
        self._executor.submit(self.store.close).result()
        self._executor.shutdown(wait=True)
        if self.reader is not None:
            self._read_executor.submit(self.reader.close).result()
            self._read_executor.shutdown(wait=True)


class BlockingStore:
    """``StateStore``'s synchronous API, executed on the :class:`StoreThread`'s thread (see the module docstring)."""

    def __init__(self, owner: StoreThread) -> None:
        self._owner = owner
        self.path = owner.store.path

    @property
    def schema_version(self) -> int:
        return self._owner.store.schema_version

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not callable(getattr(StateStore, name, None)):
            raise AttributeError(name)
        return functools.partial(self._owner.call_blocking, name)


_WRAPPED: weakref.WeakKeyDictionary[StateStore, StoreThread] = weakref.WeakKeyDictionary()
_WRAPPED_LOCK = threading.Lock()


def as_store_thread(store: StateStore | StoreThread | BlockingStore) -> StoreThread:
    """The :class:`StoreThread` serving ``store``: itself, its owner, or one made (once) for a plain store.

    Lets code that is handed either kind (the daemon's store thread, a test's plain
    :class:`StateStore`) await its calls the one way.
    """
    if isinstance(store, StoreThread):
        return store
    if isinstance(store, BlockingStore):
        return store._owner
    with _WRAPPED_LOCK:
        thread = _WRAPPED.get(store)
        if thread is None:
            thread = _WRAPPED[store] = StoreThread(store)
            # The plain store's owner closes it directly: let the calls queued on its thread finish first.
            store.before_close(thread.drain)
        return thread
