"""The worker's long pull (30 s expiry) never delays a task: back-to-back tasks, stop, a restart, a lost consumer.

With a 1 s poll any stall was hidden inside a second; with the 30 s pull expiry a stall
would cost up to 30 s. Each test bounds a claim far below the expiry.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from tests.support.controlplane import TASK_STREAM
from tests.support.deadline import run_bounded, wait_until
from tests.support.worker_harness import DISCOVER, NODE, Counting, Harness

LONG_PULL_S = 30.0
PROMPT_S = 3.0  # "at once" on a loaded 2-core CI machine; an expiry-bound stall would be ~30 s


def _long(nats_server, tmp_path, handler):
    return Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}, fetch_timeout_s=LONG_PULL_S)


def test_back_to_back_tasks_are_each_claimed_at_once_under_a_30s_pull(nats_server, tmp_path):
    async def body():
        async with _long(nats_server, tmp_path, Counting()) as h:
            envelopes = [h.plane.envelope(NODE, DISCOVER) for _ in range(3)]
            started = time.monotonic()
            await h.plane.enqueue(envelopes[0])
            await h.plane.enqueue(envelopes[1])
            for envelope in envelopes[:2]:
                assert (await h.plane.wait_result(envelope.task_id, timeout=PROMPT_S)).status == ResultStatus.succeeded
            await h.plane.enqueue(envelopes[2])  # while the next 30 s pull waits
            assert (await h.plane.wait_result(envelopes[2].task_id, timeout=PROMPT_S)).status == ResultStatus.succeeded
            assert time.monotonic() - started < 3 * PROMPT_S
    run_bounded(body())


def test_stop_ends_a_waiting_30s_pull_at_once(nats_server, tmp_path):
    async def body():
        async with _long(nats_server, tmp_path, Counting()) as h:
            started = time.monotonic()
            h.worker.stop()
            await asyncio.wait_for(h.run_task, PROMPT_S)
            assert time.monotonic() - started < PROMPT_S
    run_bounded(body())


def test_after_a_server_restart_the_pull_is_renewed_at_once(nats_server, tmp_path):
    async def body():
        async with _long(nats_server, tmp_path, Counting()) as h:
            await asyncio.to_thread(nats_server.restart)  # the server forgets the waiting pull
            envelope = h.plane.envelope(NODE, DISCOVER)

            async def enqueue_when_up():
                while True:
                    try:
                        return await h.plane.enqueue(envelope)
                    except Exception:
                        await asyncio.sleep(0.1)  # retry pacing inside a deadline
            await asyncio.wait_for(enqueue_when_up(), 30)
            published = time.monotonic()
            result = await h.plane.wait_result(envelope.task_id, timeout=LONG_PULL_S)
            assert result.status == ResultStatus.succeeded
            assert time.monotonic() - published < 10.0  # reconnect backoff + rebind, not the 30 s expiry
    run_bounded(body())


def test_a_consumer_deleted_under_the_worker_is_waited_for_until_the_control_plane_creates_it_again(
        nats_server, tmp_path, caplog):
    # A pull on a deleted consumer is never answered: the periodic consumer check finds it gone; the worker may
    # not create it (no CONSUMER.CREATE permission), it looks it up until the control plane has.
    caplog.set_level(logging.WARNING, logger="gpuaas_agent.control.worker")

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: Counting()}, fetch_timeout_s=2.0,
                           consumer_check_s=1.0) as h:
            await h.plane.js.delete_consumer(TASK_STREAM, h.settings.durable_name(NODE))
            envelope = h.plane.envelope(NODE, DISCOVER)
            await h.plane.enqueue(envelope)
            await wait_until(lambda: any('"consumer_missing"' in r.getMessage() and "control plane" in r.getMessage()
                                         for r in caplog.records), 30, "the worker waiting for its consumer")
            assert not await h.plane.js.consumers_info(TASK_STREAM)  # the worker created nothing
            await h.plane.create_node_consumer(NODE, h.settings)
            result = await h.plane.wait_result(envelope.task_id, timeout=30)
            assert result.status == ResultStatus.succeeded
            info = await h.plane.js.consumer_info(TASK_STREAM, h.settings.durable_name(NODE))
            assert info.config.filter_subject == f"gpuaas.node.{NODE}.task.>"
    run_bounded(body())
