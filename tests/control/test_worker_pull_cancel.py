"""A pull cancelled (reconnect kick, stop) just as its task is handed over must not drop the task.

Found with bench_fleet (server restart, 5,000 agents): nats.py's ``next_msg`` takes the message off the
subscription's queue in an inner task; a cancel landing before the caller resumed dropped it, and
JetStream redelivered it only ``ack_wait_s`` later (60 s). The worker's pull now reads with
``TaskPull.take`` (control/pull.py).
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
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.daemon import connect
from gpuaas_agent.state.store import StateStore
from tests.support.controlplane import ControlPlane
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
        worker.pull.bind(await worker._bind())
        yield plane, nc, store, worker
    finally:
        await nc.close()
        store.close()
        await plane.close()


async def _delivered(worker: TaskWorker, plane: ControlPlane):
    """A real task delivered into the worker's pull subscription, taken off its queue for the test to hand over."""
    envelope = plane.envelope(NODE, DISCOVER)
    await plane.enqueue(envelope)
    await worker.pull.request(10.0, None)
    await wait_until(lambda: worker.pull.queued() == 1, 10, "the task delivered into the pull queue")
    msg = await worker.pull.take(1.0)
    return envelope, msg


def _requeue(worker: TaskWorker, msg) -> None:
    """Put the task back on the pull's delivery queue, as nats.py delivers it, to race a read against its hand-over.

    The one place a test reaches nats.py's internals itself (through the pull's own accessor)."""
    inbox = worker.pull._inbox()
    inbox._pending_queue.put_nowait(msg)
    inbox._pending_size += len(msg.data)


def _unread(worker: TaskWorker) -> list:
    """Take every message still on the pull's delivery queue off it."""
    inbox = worker.pull._inbox()
    queued = [inbox._pending_queue.get_nowait() for _ in range(inbox._pending_queue.qsize())]
    inbox._pending_size -= sum(len(m.data) for m in queued)
    return queued


async def _cancel_as_handed_over(worker: TaskWorker, msg):
    """Cancel a waiting read after the queue gave it ``msg`` and before it resumed (the bench's race)."""
    take = asyncio.ensure_future(worker.pull.take(10.0))
    await asyncio.sleep(0)  # the read now waits on the queue (one loop turn, not a timing wait)
    _requeue(worker, msg)
    await asyncio.sleep(0)  # the queue hands the message over; the read has not resumed yet
    take.cancel()  # the reconnect kick
    with pytest.raises(asyncio.CancelledError):
        await take


def test_a_read_cancelled_at_any_moment_of_a_hand_over_never_drops_the_task(nats_server, tmp_path):
    async def body():
        async with _bound_worker(nats_server, tmp_path) as (plane, nc, store, worker):
            envelope, msg = await _delivered(worker, plane)
            outcomes = set()
            for turns in range(8):  # the cancel lands 0 … 7 loop turns after the delivery reached the queue
                take = asyncio.ensure_future(worker.pull.take(10.0))
                await asyncio.sleep(0)  # the read waits on the queue (a loop turn, not a timing wait)
                _requeue(worker, msg)
                for _ in range(turns):
                    await asyncio.sleep(0)
                take.cancel()  # the reconnect kick
                try:
                    got = await take
                    outcomes.add("returned")
                    assert got is msg
                except asyncio.CancelledError:
                    queued = _unread(worker)
                    outcomes.add("carried" if worker.pull.carried else "still queued")
                    assert worker.pull.carried + queued == [msg], f"dropped at turn {turns}"
                    worker.pull.carried.clear()
            assert "carried" in outcomes  # the moment that used to drop the task was reached
            # A carried task is what the next pull hands on, before it asks the server for more.
            take = asyncio.ensure_future(worker.pull.take(10.0))
            await asyncio.sleep(0)
            _requeue(worker, msg)
            await asyncio.sleep(0)
            take.cancel()
            with pytest.raises(asyncio.CancelledError):
                await take
            got = await worker.pull.pull_one(2.0, None)
            assert json.loads(got[0].data)["task_id"] == envelope.task_id
            assert not worker.pull.carried

    run_bounded(body(), 60)


def test_a_task_carried_at_stop_is_handed_back_at_once_not_at_ack_wait(nats_server, tmp_path):
    async def body():
        async with _bound_worker(nats_server, tmp_path) as (plane, nc, store, worker):
            envelope, msg = await _delivered(worker, plane)
            await _cancel_as_handed_over(worker, msg)
            await worker.drain(0.1)  # the stop: the carried task is nak'ed
            # A new agent on the same consumer gets it at once (redelivery 2), not ack_wait_s later.
            again = TaskWorker(nc, store, NODE, {}, WorkerSettings(ack_wait_s=ACK_WAIT_S, fetch_timeout_s=2.0))
            again.pull.bind(await again._bind())
            got = None
            for _ in range(3):  # pulls of 2 s each: at most 6 s, far below the 30 s ack_wait
                try:
                    got = await again.pull.pull_one(2.0, None)
                    break
                except Exception:
                    continue
            assert got is not None, "the task handed back at stop was not redelivered at once"
            assert json.loads(got[0].data)["task_id"] == envelope.task_id
            assert got[0].metadata.num_delivered == 2

    run_bounded(body(), 60)
