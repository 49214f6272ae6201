"""An asyncio body run in a thread that entered a network namespace: the netlink sockets it opens, the
threads it starts and their children are that namespace's, as a daemon's are its own (the network watch's
tests watch a namespace the test owns, not the machine's links that other work changes)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any


def run_in_netns(name: str, body: Callable[[], Awaitable[Any]], deadline_s: float) -> Any:
    """``asyncio.run(body())`` in a thread that entered netns ``name``, bounded by ``deadline_s``."""
    out: dict[str, Any] = {}

    def target() -> None:
        from pyroute2.netns import setns

        try:
            setns(name, flags=0)  # this thread only; flags=0: never create it
            out["value"] = asyncio.run(asyncio.wait_for(body(), deadline_s))
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=target, name="netns-watch", daemon=True)
    thread.start()
    thread.join(deadline_s + 30)
    assert not thread.is_alive(), "the body did not stop within its deadline"
    if "error" in out:
        raise out["error"]
    return out["value"]


async def until(condition: Callable[[], object], what: str, deadline_s: float) -> None:
    """Wait for ``condition()`` to hold, failing with ``what`` after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {deadline_s:.0f} s: {what}"
        await asyncio.sleep(0.05)
