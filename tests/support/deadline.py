"""Deadlines for test bodies and waits: a test never sleeps to synchronise, it waits on a condition that has one."""

from __future__ import annotations

import asyncio

TEST_DEADLINE_S = 120  # a whole test body; every wait inside it has its own, shorter deadline


def run_bounded(coro, deadline_s: float = TEST_DEADLINE_S):
    """Run a test's async body on a fresh loop (the suite has no asyncio plugin), failing it after ``deadline_s``."""
    return asyncio.run(asyncio.wait_for(coro, deadline_s))


async def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll a cheap condition until it holds or the deadline passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.05)
