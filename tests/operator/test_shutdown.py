"""SIGTERM does not wait for a health check that blocks: the check's thread is left behind, the daemon exits.

The blocking condition is real: the dnsmasq pid file the ``dnsmasq`` check reads is a FIFO
with a writer that never writes, so the check's ``read()`` blocks in the kernel for as long
as the test keeps the write end open (longer than the daemon's whole life).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import time

from gpuaas_agent.operator.health import CHECK_TIMEOUT_S, CheckThreads, guarded_check
from tests.support.agent_process import NotifyListener, enrolled_setup, pulling_agent
from tests.support.deadline import run_bounded

PID_FILE = "/run/gpuaas-test/dnsmasq.pid"
# A failure bound, waited on the process's exit: well under the 20 s a check may take.
EXIT_DEADLINE_S = 8.0
assert EXIT_DEADLINE_S < CHECK_TIMEOUT_S / 2


def _open_writer_when_read(fifo, deadline_s: float = 60.0) -> int:
    """The FIFO's write end, opened once a reader is blocked on it (ENXIO until then): the check is in its read."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
        time.sleep(0.02)  # poll interval of a wait on a condition with a deadline


def test_sigterm_during_a_blocked_health_check_exits_0_at_once_with_stopping(nats_server, host_copy, tmp_path,
                                                                             short_dir, agents):
    root = host_copy("h200-slice-after-transition")
    fifo = root / PID_FILE.lstrip("/")
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)

    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path, host_root=str(root),
                                                       health_interval_s=60, slice={
                                                           "libvirt_uri": "test:///default",
                                                           "dnsmasq_pid_file": PID_FILE})
        listener = NotifyListener(short_dir / "notify")
        writer = None
        try:
            agent = await pulling_agent(config, listener, tmp_path / "agent.log", agents, node_id)
            writer = await asyncio.to_thread(_open_writer_when_read, fifo)  # the dnsmasq check now blocks in read()
            agent.signal(signal.SIGTERM)
            started = time.monotonic()
            code = await agent.wait(timeout=EXIT_DEADLINE_S)
            assert code == 0, agent.log_path.read_text()[-3000:]
            assert time.monotonic() - started < EXIT_DEADLINE_S
            await listener.wait_for("STOPPING", "1", timeout=5)
            assert "agent_stopped" in [e.get("event") for e in agent.log_events()]
        finally:
            if writer is not None:
                os.close(writer)
            listener.close()
            await plane.close()

    run_bounded(body())


def test_a_check_still_blocked_is_not_started_again_until_its_thread_ends(tmp_path):
    fifo = tmp_path / "blocks"
    os.mkfifo(fifo)
    threads = CheckThreads()
    started = []

    def check():
        started.append(1)
        with open(fifo) as fh:  # blocks until a writer comes, then until it closes
            return [fh.read()]

    async def body():
        first = await guarded_check("fifo", check, timeout_s=0.2, threads=threads)
        assert first[0].status == "unavailable" and "did not answer within 0.2s" in first[0].detail
        second = await guarded_check("fifo", check, timeout_s=0.2, threads=threads)
        assert second[0].status == "unavailable" and "still blocked" in second[0].detail
        assert len(started) == 1
        writer = await asyncio.to_thread(_open_writer_when_read, fifo)
        os.close(writer)  # EOF: the stuck thread returns and leaves the registry

        async def released():
            while threads.stuck_since("fifo") is not None:
                await asyncio.sleep(0.01)  # poll interval of a wait on a condition with a deadline

        await asyncio.wait_for(released(), 10)
        third = await guarded_check("fifo", lambda: [], timeout_s=5, threads=threads)
        assert third == []

    asyncio.run(body())
