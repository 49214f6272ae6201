"""One lab-in-a-box for the end-to-end tests of this directory (it takes ~1 min to start).

The lab's asyncio objects (the control plane's NATS connection) live on one event
loop in a background thread for the whole module; tests submit coroutines to it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.harness import Lab, LabSettings
from tests.support.tiers import starts


class LoopThread:
    """An event loop in a thread; :meth:`run` waits for a coroutine's result with a deadline."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lab-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 900):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="package")
@starts("lab")
def lab() -> Iterator[tuple[Lab, LoopThread]]:
    if os.geteuid() != 0:
        pytest.fail("the end-to-end lab needs root (loop devices, OVS, dnsmasq, libvirtd)", pytrace=False)
    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-e2e-", dir="/var/tmp"))
    lines: list[str] = []
    lab = Lab(LabSettings(workdir=workdir, slots=8, readiness_timeout_s=300, say=lines.append))
    runner = LoopThread()
    try:
        runner.run(lab.start(), timeout=900)
        yield lab, runner
    finally:
        problems = runner.run(lab.stop(), timeout=300)
        runner.close()
        if problems:
            pytest.fail(f"lab teardown left things behind: {problems}; logs in {workdir}", pytrace=False)
        shutil.rmtree(workdir, ignore_errors=True)
