"""bench/protocol_node.py against a real nats-server: it must cause the server traffic of the agent's claim.

bench_fleet's ``--node-impl protocol`` figures stand for the agent's claim path only if a ProtocolNode
does what the worker does on the wire: pull the worker's own consumer, publish a ``TaskResult`` with
``Nats-Msg-Id`` and take its PubAck, ack the task (the work queue empties), pull again after a 408, and
come back after the server restarts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from bench.protocol_node import ProtocolNode
from gpuaas_agent.contract.tasks import ResultStatus, TaskResult, TaskType
from gpuaas_agent.control.connection import Backoff, connect_nats
from gpuaas_agent.control.enroll import node_inbox_prefix
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.state.store import StateStore
from tests.support.controlplane import RESULT_STREAM, ControlPlane
from tests.support.deadline import run_bounded, wait_until

NODE = "node-proto-1"
TASK = TaskType.topology_discover


async def _bound_node(server, tmp_path: Path, expiry_s: float, claims: list, reconnects: list) -> ProtocolNode:
    """The worker binds its consumer (as bench_fleet does), then a ProtocolNode pulls it."""
    nc = await connect_nats([server.url], timeout_s=10, name=NODE, inbox_prefix=node_inbox_prefix(NODE),
                            security=TransportSecurity(insecure=True))
    store = StateStore.open(tmp_path / "state.db")
    try:
        worker = TaskWorker(nc, store, NODE, {}, WorkerSettings(fetch_timeout_s=expiry_s))
        worker.pull.bind(await worker._bind())  # what bench_fleet calls
    finally:
        await nc.close()
        store.close()
    node = ProtocolNode(node_id=NODE, host="127.0.0.1", port=server.port, inbox_prefix=node_inbox_prefix(NODE),
                        next_subject=worker.pull.next_subject, task_type=TASK.value, expiry_s=expiry_s, bound_s=expiry_s + 1,
                        heartbeat_s=None, backoff=Backoff(0.1, 0.5),
                        on_claim=lambda task_id, t: claims.append(task_id), on_reconnect=reconnects.append,
                        trace=[])
    await node.connect()
    return node


def test_a_protocol_node_claims_answers_acks_and_pulls_again_after_expiry_and_a_restart(nats_server, tmp_path):
    async def body():
        plane = await ControlPlane.connect([nats_server.url])
        await plane.create_task_partitions([NODE], per_stream=100, replicas=1)
        await plane.create_node_consumer(NODE, WorkerSettings(fetch_timeout_s=1.0))
        await plane.js.add_stream(StreamConfig(name=RESULT_STREAM, subjects=["gpuaas.node.*.result"],
                                               retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                                               duplicate_window=120))
        claims: list[str] = []
        reconnects: list[float] = []
        node = await _bound_node(nats_server, tmp_path, 1.0, claims, reconnects)
        try:
            first = plane.envelope(NODE, TASK.value)
            await plane.enqueue(first, msg_id=first.task_id)
            await wait_until(lambda: claims == [first.task_id], 10, "the first task claimed")
            # The next pull goes out only once the result's PubAck is in; the result carries the worker's msg id.
            await wait_until(lambda: sum(1 for _, e in node.trace if e == "pull") >= 2, 10, "the pull after the claim")
            stored = await plane.js.get_last_msg(RESULT_STREAM, f"gpuaas.node.{NODE}.result")
            result = TaskResult.model_validate_json(stored.data)
            assert (result.task_id, result.status) == (first.task_id, ResultStatus.succeeded)
            assert stored.headers["Nats-Msg-Id"] == f"{first.task_id}-1"
            # Acked: the work queue is empty.
            stream = await plane.js.find_stream_name_by_subject(f"gpuaas.node.{NODE}.task.>")
            await wait_until_async(lambda: _messages(plane, stream), 0)

            # Idle past two expiries: each 408 is followed by a new pull; a task then is claimed at once.
            await wait_until(lambda: sum(1 for _, e in node.trace if e == "status 408") >= 2, 10, "two 408s")
            second = plane.envelope(NODE, TASK.value)
            await plane.enqueue(second, msg_id=second.task_id)
            await wait_until(lambda: second.task_id in claims, 5, "a task after expired pulls claimed")
            assert not node.errors

            # A server restart: the node reconnects (jittered backoff) and pulls again.
            nats_server.restart()
            await wait_until(lambda: len(reconnects) == 1, 20, "the node reconnected")
            third = plane.envelope(NODE, TASK.value)
            for _ in range(50):  # the plane's own connection may still be reconnecting
                try:
                    await plane.enqueue(third, msg_id=third.task_id)
                    break
                except Exception:
                    await asyncio.sleep(0.2)  # retry pacing of the plane's publish
            await wait_until(lambda: third.task_id in claims, 10, "a task after the restart claimed")
            assert claims == [first.task_id, second.task_id, third.task_id]
            assert not node.errors
        finally:
            node.close()
            await plane.close()

    run_bounded(body(), 90)


async def _messages(plane: ControlPlane, stream: str) -> int:
    return (await plane.js.stream_info(stream)).state.messages


async def wait_until_async(probe, expected, timeout: float = 10.0) -> None:
    """Poll an async probe until it returns ``expected``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (value := await probe()) != expected:
        if loop.time() > deadline:
            raise TimeoutError(f"probe gave {value!r}, not {expected!r}, within {timeout}s")
        await asyncio.sleep(0.05)  # poll interval of a condition with a deadline
