"""A diagnostic probe: on SIGUSR2 the daemon writes what its heap holds, so a lab run can name what grows.

A leak shows as a count that grows with every run of the same load while the registered counts of the
status stay at zero. The probe writes, per signal, ``<n>.json`` (the live objects counted by type after a
full collection, the asyncio tasks and threads, the RSS, glibc's heap in use and free) and, when ``tracemalloc`` is tracing (``PYTHONTRACEMALLOC=N``
in the daemon's environment), ``<n>.tracemalloc`` (a snapshot that ``tracemalloc.Snapshot.load`` reads back
for ``compare_to``). bench/bench_fairness_lab.py ``--memprobe`` uses it.

Inert in production: it is installed only when ``GPUAAS_AGENT_MEMPROBE_DIR`` is set in the daemon's
environment at start (the unit never sets it); without it SIGUSR2 keeps its default action.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import os
import signal
import threading
import tracemalloc
from collections import Counter
from pathlib import Path

from gpuaas_agent.operator.daemonstatus import own_rss_bytes

ENV = "GPUAAS_AGENT_MEMPROBE_DIR"
TRIM_MARK = "trim"  # a file of that name in the directory: this probe also malloc_trim(0)s and records the RSS after


def type_histogram() -> dict[str, int]:
    """Live gc-tracked objects by qualified type name, after a full collection (garbage is not a leak)."""
    gc.collect()
    counts = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    return dict(counts.most_common())


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def malloc_heap() -> dict[str, int] | None:
    """glibc's heap (all arenas): bytes in use, free but kept, and mmapped; None off glibc (no ``mallinfo2``).

    tracemalloc sees only Python's allocations: a heap whose free part grows while the traced part stays
    flat is fragmentation and the allocator's high-water mark, not a leak.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd, "arena": info.arena}


def rss_after_trim() -> int | None:
    """The RSS once glibc handed its free pages back (``malloc_trim(0)``): what the heap really needs."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return None
    libc.malloc_trim(0)
    return own_rss_bytes()


def dump(directory: Path) -> Path:
    """Write the next probe into ``directory``; returns the JSON file (written last, atomically: a reader
    that sees it also sees the snapshot)."""
    directory.mkdir(parents=True, exist_ok=True)
    n = len(list(directory.glob("*.json")))
    if tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(str(directory / f"{n}.tracemalloc"))
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # no running loop (a direct call)
        tasks = 0
    record: dict[str, object] = {
        "rss_bytes": own_rss_bytes(), "asyncio_tasks": tasks, "threads": threading.active_count(),
        "traced_bytes": tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None,
        "malloc": malloc_heap(), "types": type_histogram()}
    if (directory / TRIM_MARK).exists():
        record["rss_after_trim_bytes"] = rss_after_trim()
    path = directory / f"{n}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def install(loop: asyncio.AbstractEventLoop, environ: dict[str, str] | None = None) -> Path | None:
    """SIGUSR2 -> :func:`dump` into the directory ``GPUAAS_AGENT_MEMPROBE_DIR`` names; nothing without it."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV)
    if not raw:
        return None
    directory = Path(raw)
    loop.add_signal_handler(signal.SIGUSR2, dump, directory)
    return directory
