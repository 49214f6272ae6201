"""A pull cancelled (reconnect kick, stop) just as its task is handed over must not drop the task.

Found with bench_fleet (server restart, 5,000 agents): nats.py's ``next_msg`` takes the message off the
subscription's queue in an inner task; a cancel landing before the caller resumed dropped it, and
JetStream redelivered it only ``ack_wait_s`` later (60 s). The worker now reads with ``_take``.
These tests put a real delivery through that exact moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime

import pytest

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.enrollment import NatsCredentials
from gpuaas_agent.control.enroll import EnrollmentRecord
from gpuaas_agent.control.worker import TaskWorker, WorkerSettings
from gpuaas_agent.daemon import connect
from gpuaas_agent.state.store import StateStore
from tests.controlplane import ControlPlane
from tests.support.deadline import run_bounded, wait_until
from tests.support.worker_harness import DISCOVER, NODE

ACK_WAIT_S = 30.0  # far above what any assertion below waits: a redelivery by ack_wait would fail them


async def _agent_connection(nats_server, tmp_path):
    """The daemon's own connect, as the worker harness does (the test server takes any login)."""
    record = EnrollmentRecord(node_id=NODE, enrolled_at=datetime.now(UTC),
                              credentials=NatsCredentials(user=NODE, password="unused-by-test-server",
                                                          servers=[nats_server.url]))
    return await connect(AgentConfig(state_dir=tmp_path / "state", insecure=True), record, asyncio.Event())


@contextlib.asynccontextmanager
async def _bound_worker(nats_server, tmp_path):
    """The control plane, the agent's connection and a worker bound to its consumer (no run loop: the test reads)."""
    plane = await ControlPlane.connect(nats_server.url)
    await plane.create_streams()
    await plane.create_node_consumer(NODE, WorkerSettings(ack_wait_s=ACK_WAIT_S, fetch_timeout_s=2.0))
    nc = await _agent_connection(nats_server, tmp_path)
    store = StateStore.open(tmp_path / "state" / "state.db")
    worker = TaskWorker(nc, store, NODE, {}, WorkerSettings(ack_wait_s=ACK_WAIT_S, fetch_timeout_s=2.0))
    try:
        worker._sub = await worker._bind()
        yield plane, nc, store, worker
    finally:
        await nc.close()
        store.close()
        await plane.close()


async def _delivered(worker: TaskWorker, plane: ControlPlane):
    """A real task delivered into the worker's pull subscription, taken off its queue for the test to hand over."""
    envelope = plane.envelope(NODE, DISCOVER)
    await plane.enqueue(envelope)
    sub = worker._sub._sub
    request = json.dumps({"batch": 1, "expires": int(10e9)}).encode()
    await worker.nc.publish(worker._sub._nms, request, worker._sub._deliver)
    await wait_until(lambda: sub._pending_queue.qsize() == 1, 10, "the task delivered into the pull queue")
    msg = sub._pending_queue.get_nowait()
    sub._pending_size -= len(msg.data)
    return envelope, sub, msg


async def _cancel_as_handed_over(worker: TaskWorker, sub, msg):
    """Cancel a waiting read after the queue gave it ``msg`` and before it resumed (the bench's race)."""
    take = asyncio.ensure_future(worker._take(sub, 10.0))
    await asyncio.sleep(0)  # the read now waits on the queue (one loop turn, not a timing wait)
    sub._pending_queue.put_nowait(msg)
    sub._pending_size += len(msg.data)
    await asyncio.sleep(0)  # the queue hands the message over; the read has not resumed yet
    take.cancel()  # the reconnect kick
    with pytest.raises(asyncio.CancelledError):
        await take


def test_a_read_cancelled_at_any_moment_of_a_hand_over_never_drops_the_task(nats_server, tmp_path):
    async def body():
        async with _bound_worker(nats_server, tmp_path) as (plane, nc, store, worker):
            envelope, sub, msg = await _delivered(worker, plane)
            outcomes = set()
            for turns in range(8):  # the cancel lands 0 … 7 loop turns after the delivery reached the queue
                take = asyncio.ensure_future(worker._take(sub, 10.0))
                await asyncio.sleep(0)  # the read waits on the queue (a loop turn, not a timing wait)
                sub._pending_queue.put_nowait(msg)
                sub._pending_size += len(msg.data)
                for _ in range(turns):
                    await asyncio.sleep(0)
                take.cancel()  # the reconnect kick
                try:
                    got = await take
                    outcomes.add("returned")
                    assert got is msg
                except asyncio.CancelledError:
                    queued = [sub._pending_queue.get_nowait() for _ in range(sub._pending_queue.qsize())]
                    outcomes.add("carried" if worker._carried else "still queued")
                    assert worker._carried + queued == [msg], f"dropped at turn {turns}"
                    worker._carried.clear()
                sub._pending_size = 0
            assert "carried" in outcomes  # the moment that used to drop the task was reached
            # A carried task is what the next pull hands on, before it asks the server for more.
            take = asyncio.ensure_future(worker._take(sub, 10.0))
            await asyncio.sleep(0)
            sub._pending_queue.put_nowait(msg)
            await asyncio.sleep(0)
            take.cancel()
            with pytest.raises(asyncio.CancelledError):
                await take
            got = await worker._pull_one(None)
            assert json.loads(got[0].data)["task_id"] == envelope.task_id
            assert not worker._carried

    run_bounded(body(), 60)


def test_a_task_carried_at_stop_is_handed_back_at_once_not_at_ack_wait(nats_server, tmp_path):
    async def body():
        async with _bound_worker(nats_server, tmp_path) as (plane, nc, store, worker):
            envelope, sub, msg = await _delivered(worker, plane)
            await _cancel_as_handed_over(worker, sub, msg)
            await worker.drain(0.1)  # the stop: the carried task is nak'ed
            # A new agent on the same consumer gets it at once (redelivery 2), not ack_wait_s later.
            again = TaskWorker(nc, store, NODE, {}, WorkerSettings(ack_wait_s=ACK_WAIT_S, fetch_timeout_s=2.0))
            again._sub = await again._bind()
            got = None
            for _ in range(3):  # pulls of 2 s each: at most 6 s, far below the 30 s ack_wait
                try:
                    got = await again._pull_one(None)
                    break
                except Exception:
                    continue
            assert got is not None, "the task handed back at stop was not redelivered at once"
            assert json.loads(got[0].data)["task_id"] == envelope.task_id
            assert got[0].metadata.num_delivered == 2

    run_bounded(body(), 60)
