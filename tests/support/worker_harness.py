"""A control plane and one agent worker on its own connection (as in production), and a countable handler.

Used by the worker tests of tests/control (pull, recovery, bad journal, the plan task).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.enrollment import NatsCredentials
from gpuaas_agent.contract.tasks import TaskType
from gpuaas_agent.control.enroll import EnrollmentRecord
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.daemon import connect
from gpuaas_agent.state.store import StateStore
from tests.support.controlplane import ControlPlane

NODE = "node-test01"


DISCOVER = TaskType.topology_discover.value


class Harness:
    """Control plane + one agent worker on its own connection, as in production."""

    def __init__(self, server, tmp_path, handlers, *, recoveries=None, **settings) -> None:
        self.server, self.tmp_path, self.handlers, self.recoveries = server, tmp_path, handlers, recoveries
        self.settings = WorkerSettings(**{"keepalive_interval_s": 0.5, "ack_wait_s": 5.0, "fetch_timeout_s": 0.25, **settings})

    async def __aenter__(self):
        self.plane = await ControlPlane.connect(self.server.url)
        await self.plane.create_streams()
        await self.plane.create_node_consumer(NODE, self.settings)  # the control plane's job: the node cannot
        # The daemon's own connect (its reconnect options are what the restart test exercises).
        record = EnrollmentRecord(node_id=NODE, enrolled_at=datetime.now(UTC),
                                  credentials=NatsCredentials(user=NODE, password="unused-by-test-server",
                                                              servers=[self.server.url]))
        self._record = record
        self.nc = await connect(AgentConfig(state_dir=self.tmp_path / "state", insecure=True), record, asyncio.Event())
        self.store = StateStore.open(self.tmp_path / "state" / "state.db")
        self.worker = TaskWorker(self.nc, self.store, NODE, self.handlers, self.settings, recoveries=self.recoveries)
        self.run_task = asyncio.create_task(self.worker.run())
        await asyncio.wait_for(self.worker.ready.wait(), 10)
        return self

    async def restart_agent(self) -> None:
        """After a drain: the agent process ends (its connection closes, the server forgets its pull
        requests) and a new one starts on the same state, as a package upgrade or a restart does."""
        await asyncio.wait_for(self.run_task, 10)
        await asyncio.wait_for(self.nc.close(), 5)
        self.nc = await connect(AgentConfig(state_dir=self.tmp_path / "state", insecure=True), self._record, asyncio.Event())
        self.worker = TaskWorker(self.nc, self.store, NODE, self.handlers, self.settings, recoveries=self.recoveries)
        self.run_task = asyncio.create_task(self.worker.run())
        await asyncio.wait_for(self.worker.ready.wait(), 10)

    async def __aexit__(self, *exc):
        await self.worker.drain(5)
        await asyncio.wait_for(self.run_task, 10)
        await asyncio.wait_for(self.nc.close(), 5)
        await self.plane.close()
        self.store.close()

    async def run_task_to_result(self, envelope, **kw):
        await self.plane.enqueue(envelope, **kw)
        return await self.plane.wait_result(envelope.task_id)


class Counting:
    """A handler that counts its calls and can be held until released."""

    def __init__(self, *, hold: bool = False, output: dict | None = None, raises: Exception | None = None) -> None:
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.output = output or {"ok": True}
        self.raises = raises

    async def __call__(self, payload, ctx):
        self.calls += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.started.set()
        try:
            await self.release.wait()
            if self.raises is not None:
                raise self.raises
            return self.output
        finally:
            self.active -= 1
