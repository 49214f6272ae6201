"""The memory probe: inert without its variable; with it, SIGUSR2 writes the heap's types and a snapshot."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tracemalloc

from gpuaas_agent.operator import memprobe


def test_without_the_variable_nothing_is_installed():
    asyncio.run(_without())


async def _without():
    loop = asyncio.get_running_loop()
    assert memprobe.install(loop, {}) is None
    assert loop.remove_signal_handler(signal.SIGUSR2) is False  # SIGUSR2 keeps its default action


def test_sigusr2_writes_types_and_a_snapshot_that_compares(tmp_path):
    asyncio.run(_probed(tmp_path))


async def _probed(tmp_path):
    loop = asyncio.get_running_loop()
    directory = tmp_path / "probe"
    tracemalloc.start(5)
    try:
        assert memprobe.install(loop, {memprobe.ENV: str(directory)}) == directory
        try:
            for n in range(2):
                os.kill(os.getpid(), signal.SIGUSR2)
                deadline = loop.time() + 30
                while not (directory / f"{n}.json").exists():
                    assert loop.time() < deadline, "no probe written"
                    await asyncio.sleep(0.01)
                if n == 0:
                    kept = [object() for _ in range(1000)]  # what the second probe must see grow
        finally:
            loop.remove_signal_handler(signal.SIGUSR2)
    finally:
        tracemalloc.stop()
    first, second = (json.loads((directory / f"{n}.json").read_text()) for n in range(2))
    assert second["types"]["builtins.list"] >= 1 and first["rss_bytes"] > 0 and first["asyncio_tasks"] >= 1
    assert first["threads"] >= 1 and "rss_after_trim_bytes" not in first  # trimming only when marked
    heap = memprobe.malloc_heap()
    assert heap is None or heap["in_use"] > 0  # glibc: what tracemalloc cannot see
    before, after = (tracemalloc.Snapshot.load(str(directory / f"{n}.tracemalloc")) for n in range(2))
    grown = after.compare_to(before, "filename")
    assert any(stat.traceback[0].filename == __file__ and stat.size_diff > 0 for stat in grown)
    assert len(kept) == 1000
