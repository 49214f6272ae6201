"""The state store seen from the event loop: every SQLite call runs on ONE store thread (issue 17 item 6).

Why: a commit takes SQLite's write lock and fsyncs (``synchronous=FULL``); when
another process holds the lock (a CLI ``gpuaas-agent release``, a backup, an
operator's ``sqlite3``) a commit waits up to the busy timeout. Run on the loop,
that wait stops heartbeats, keepalives (JetStream then redelivers a running
task) and the systemd watchdog. So the daemon never touches its connection from
the loop: :class:`StoreThread` owns the :class:`StateStore` and a single-thread
executor, and each call is a coroutine that waits for that thread.

One thread, not a pool: the store's transactions (``BEGIN IMMEDIATE`` ...
``COMMIT``) share one connection, and two threads interleaving statements on
it would run one's statements inside the other's transaction. The same thread
also serves reads (WAL readers never wait for the writer lock, so reads are
cheap there).

* ``await state.journal(...)`` / ``await state.leases()``: any public
  :class:`StateStore` method, as a coroutine run on the store thread.
* ``await state.run(fn, *args)``: ``fn(store, *args)`` on the store thread (a read
  made of several calls, e.g. the reporter's in-flight view).
* ``state.sync``: the same methods, synchronous, still executed on the store
  thread (the caller blocks until it is done). For code that has not been made
  async yet (the task handlers' ``ctx.store``): serialised with the daemon's
  other store work, but the waiting caller is blocked — on the loop that is the
  old behaviour, so convert such callers to ``await``.

The CLI keeps using :class:`StateStore` directly (no loop to protect).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gpuaas_agent.state.store import StateStore

T = TypeVar("T")

THREAD_NAME = "gpuaas-state"


class StoreThread:
    """A :class:`StateStore` whose every call runs on its own single thread; see the module docstring."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.path = store.path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._thread_id: int | None = None
        self.sync = BlockingStore(self)

    def _in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._thread_id = threading.get_ident()
        return fn(*args, **kwargs)

    def on_store_thread(self) -> bool:
        return threading.get_ident() == self._thread_id

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(store, *args)`` on the store thread; the loop goes on meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(self._in_thread, fn, self.store, *args))

    def call_blocking(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``store.name(*args)`` on the store thread; blocks the caller (not the store thread) until done."""
        method = getattr(self.store, name)
        if self.on_store_thread():  # re-entered from a function already running there
            return method(*args, **kwargs)
        return self._executor.submit(self._in_thread, method, *args, **kwargs).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not callable(getattr(StateStore, name, None)):
            raise AttributeError(name)
        method = getattr(self.store, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._executor, functools.partial(self._in_thread, method, *args, **kwargs))

        call.__name__ = name
        return call

    async def aclose(self) -> None:
        """Close the connection on its thread, then end the thread."""
        await self.run(lambda store: store.close())
        self._executor.shutdown(wait=True)

    def close(self) -> None:
        """Synchronous close (outside a loop): the same, waiting here."""
        self._executor.submit(self.store.close).result()
        self._executor.shutdown(wait=True)


class BlockingStore:
    """``StateStore``'s synchronous API, executed on the :class:`StoreThread`'s thread (see the module docstring)."""

    def __init__(self, owner: StoreThread) -> None:
        self._owner = owner
        self.path = owner.store.path

    @property
    def schema_version(self) -> int:
        return self._owner.call_blocking("__getattribute__", "schema_version")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not callable(getattr(StateStore, name, None)):
            raise AttributeError(name)
        return functools.partial(self._owner.call_blocking, name)


_WRAPPED: "weakref.WeakKeyDictionary[StateStore, StoreThread]" = weakref.WeakKeyDictionary()
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
        return thread
