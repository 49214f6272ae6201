"""The task worker against a real nats-server: contract order, idempotency, keepalive, restart."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.taskpolicy import STOPPED_STEP, TASK_STEP
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.daemon import default_tasks
from gpuaas_agent.errors import GuardError
from tests.conftest import fixture_host
from tests.support.controlplane import TASK_STREAM
from tests.support.deadline import run_bounded, wait_until
from tests.support.worker_harness import DISCOVER, NODE, Counting, Harness


def test_topology_discover_over_fixture_succeeds(nats_server, tmp_path):
    config = AgentConfig(host_root=fixture_host("h200-slice-after-transition"), state_dir=tmp_path / "state")

    async def body():
        async with Harness(nats_server, tmp_path, default_tasks(config).handlers) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            result = await h.run_task_to_result(envelope)
            assert result.status == ResultStatus.succeeded, result.error
            assert result.output["summary"]["candidate_slots"] == 8
            assert result.attempt == 1 and result.node_id == NODE
            assert h.store.result_of(envelope.task_id)["status"] == "succeeded"
            assert [e.status.value for e in h.store.journal_of(envelope.task_id)] == ["started", "succeeded"]
            await h.plane.wait_for(lambda s: [p for p in s.progress if p.status == "succeeded"])
            await wait_until_acked(h)
            assert len(await h.plane.stored_results(NODE)) == 1

    run_bounded(body())


async def wait_until_acked(h, timeout: float = 10.0) -> None:
    """The work-queue stream drops a task once it is acked."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await h.plane.pending_tasks():
        if loop.time() > deadline:
            raise TimeoutError("task not acked")
        await asyncio.sleep(0.05)


def test_redelivered_finished_task_replays_stored_result(nats_server, tmp_path):
    handler = Counting(output={"answer": 42})

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            first = await h.run_task_to_result(envelope)
            await h.plane.enqueue(envelope)  # the same task delivered again
            second = await h.plane.wait_result(envelope.task_id, count=2)
            assert second == first
            assert handler.calls == 1
            await wait_until_acked(h)
            # Same Nats-Msg-Id: the result stream kept the result once.
            assert [r.task_id for r in await h.plane.stored_results(NODE)] == [envelope.task_id]

    run_bounded(body())


def test_expired_task_fails_without_running(nats_server, tmp_path):
    handler = Counting()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            result = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, deadline_s=-5))
            assert result.status == ResultStatus.failed
            assert result.error.code == "expired" and result.error.retryable is False
            assert handler.calls == 0

    run_bounded(body())


def test_unsupported_unimplemented_and_invalid_payload_fail_with_codes(nats_server, tmp_path):
    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: Counting()}) as h:
            unknown = await h.run_task_to_result(h.plane.envelope(NODE, "slice.make_coffee"))
            assert (unknown.status, unknown.error.code) == (ResultStatus.failed, "unsupported_task")
            todo = await h.run_task_to_result(h.plane.envelope(NODE, TaskType.preflight.value))
            assert (todo.error.code, todo.error.retryable) == ("not_implemented", False)
            bad = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, {"subnet": 7, "colour": "red"}))
            assert bad.error.code == "invalid_payload"

    run_bounded(body())


def test_handler_errors_become_failed_results(nats_server, tmp_path):
    refusal = Counting(raises=GuardError("disk is mounted", code="mounted_child", evidence={"disk": "x"}))
    crash = Counting(raises=RuntimeError("boom"))

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: refusal, TaskType.preflight: crash},
                           max_task_starts=1) as h:
            refused = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER))
            assert refused.error.code == "mounted_child" and refused.error.evidence == {"disk": "x"}
            assert refused.error.retryable is False
            assert refusal.calls == 1  # a refusal is an answer: never retried
            # A crash is retried up to max_task_starts (here 1), then answered poison_task with the crash's text.
            crashed = await h.run_task_to_result(h.plane.envelope(NODE, TaskType.preflight.value))
            assert crashed.error.code == "poison_task" and crashed.error.retryable is False
            assert "boom" in crashed.error.message
            assert crashed.error.evidence["last_error"]["code"] == "internal_error"

    run_bounded(body())


def test_malformed_message_is_terminated_and_next_task_completes(nats_server, tmp_path):
    handler = Counting()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            await h.plane.enqueue_raw(f"gpuaas.node.{NODE}.task.{DISCOVER}", b"{not json")
            await h.plane.enqueue_raw(f"gpuaas.node.{NODE}.task.{DISCOVER}",
                                      h.plane.envelope("node-other", DISCOVER).model_dump_json().encode())
            good = h.plane.envelope(NODE, DISCOVER)
            result = await h.run_task_to_result(good)
            assert result.status == ResultStatus.succeeded
            assert handler.calls == 1
            assert [r.task_id for r in h.plane.seen.results] == [good.task_id]

    run_bounded(body())


def test_concurrency_is_bounded_per_task_type(nats_server, tmp_path):
    handler = Counting(hold=True)

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler},
                           concurrency={TaskType.topology_discover: 1}) as h:
            tasks = [h.plane.envelope(NODE, DISCOVER) for _ in range(3)]
            for envelope in tasks:
                await h.plane.enqueue(envelope)
            await asyncio.wait_for(handler.started.wait(), 10)
            # Only one runs; the others are handed back to JetStream (control/admission.py), none waits here.
            await wait_until(lambda: h.worker.admission.refused["type_full"] >= 2, what="two handed back")
            assert handler.active == 1 and len(h.worker.running_task_ids) == 1
            handler.release.set()
            for envelope in tasks:
                await h.plane.wait_result(envelope.task_id)
            assert handler.max_active == 1 and handler.calls == 3

    run_bounded(body())


def test_keepalive_keeps_a_long_task_from_being_redelivered(nats_server, tmp_path):
    handler = Counting(hold=True)

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler},
                           ack_wait_s=1.0, keepalive_interval_s=0.2) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            await h.plane.enqueue(envelope)
            await asyncio.wait_for(handler.started.wait(), 10)
            # The behaviour under test is time passing: three ack_wait periods without a redelivery.
            await asyncio.sleep(3.0)
            info = await h.plane.js.consumer_info(TASK_STREAM, h.settings.durable_name(NODE))
            assert info.num_redelivered == 0
            handler.release.set()
            await h.plane.wait_result(envelope.task_id)
            assert handler.calls == 1

    run_bounded(body())


def test_server_restart_mid_task_completes_once(nats_server, tmp_path):
    handler = Counting(hold=True, output={"survived": "restart"})

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            await h.plane.enqueue(envelope)
            await asyncio.wait_for(handler.started.wait(), 10)

            await asyncio.to_thread(nats_server.restart)
            await wait_until(lambda: h.nc.is_connected and h.plane.nc.is_connected, what="clients reconnected")
            await h.plane.nc.flush(timeout=5)  # the plane's result subscription is back on the server
            handler.release.set()

            result = await h.plane.wait_result(envelope.task_id, timeout=30)
            assert result.status == ResultStatus.succeeded and result.output == {"survived": "restart"}
            await wait_until_acked(h, timeout=20)
            assert handler.calls == 1
            assert [r.task_id for r in await h.plane.stored_results(NODE)] == [envelope.task_id]
            assert h.store.unfinished_steps(envelope.task_id) == []
            assert [e.step for e in h.store.journal_of(envelope.task_id)] == [TASK_STEP, TASK_STEP]

    run_bounded(body())


# -- replay and forgery (issue 19) ------------------------------------------------------


def test_redelivery_with_another_attempt_is_answered_from_the_stored_result(nats_server, tmp_path):
    handler = Counting(output={"answer": 42})

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            first = h.plane.envelope(NODE, DISCOVER, attempt=1)
            answered = await h.run_task_to_result(first)
            again = first.model_copy(update={"attempt": 7, "payload": {"ovs_bridge": "other"}})
            await h.plane.enqueue(again)
            replayed = await h.plane.wait_result(first.task_id, count=2)
            assert replayed == answered and replayed.attempt == 1  # the stored answer, not a new run
            assert handler.calls == 1
            await wait_until_acked(h)
            assert [r.task_id for r in await h.plane.stored_results(NODE)] == [first.task_id]

    run_bounded(body())


def _rejections(caplog, code: str) -> list[dict]:
    out = []
    for record in caplog.records:
        try:
            fields = json.loads(record.getMessage())
        except ValueError:
            continue
        if fields.get("event") == "task_rejected" and fields.get("code") == code:
            assert record.levelno == logging.WARNING
            out.append(fields)
    return out


@pytest.mark.parametrize("variant", ["wrong_node", "wrong_subject"])
def test_forged_task_is_terminated_unanswered_and_never_shadows_the_genuine_one(nats_server, tmp_path, caplog, variant):
    """A forged task that reuses a genuine task_id must leave no result behind that the genuine one would replay."""
    caplog.set_level(logging.WARNING, logger="gpuaas_agent.control.worker")
    handler = Counting(output={"genuine": True})

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler,
                                                   TaskType.preflight: handler}) as h:
            genuine = h.plane.envelope(NODE, DISCOVER)
            if variant == "wrong_node":
                forged = genuine.model_copy(update={"node_id": "node-victim"})
                subject = f"gpuaas.node.{NODE}.task.{DISCOVER}"
            else:  # right envelope, published on the subject of another type
                forged = genuine
                subject = f"gpuaas.node.{NODE}.task.{TaskType.preflight.value}"
            await h.plane.enqueue_raw(subject, forged.model_dump_json().encode())
            await wait_until(lambda: _rejections(caplog, variant), what=f"{variant} rejection logged")
            await wait_until_acked(h)  # terminated: the work queue dropped it, it is not redelivered
            assert handler.calls == 0
            assert h.store.result_of(genuine.task_id) is None and h.store.journal_of(genuine.task_id) == []

            result = await h.run_task_to_result(genuine)  # the genuine task still runs, once
            assert result.status == ResultStatus.succeeded and result.output == {"genuine": True}
            assert handler.calls == 1
            assert [r.task_id for r in h.plane.seen.results] == [genuine.task_id]
            rejected = _rejections(caplog, variant)[0]
            assert rejected["task_id"] == genuine.task_id and rejected["subject"] == subject

    run_bounded(body())


def test_deadline_beyond_the_horizon_is_refused_invalid_deadline(nats_server, tmp_path):
    handler = Counting()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler},
                           max_task_deadline_s=3600) as h:
            far = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, deadline_s=10 * 365 * 86400))
            assert (far.status, far.error.code, far.error.retryable) == (ResultStatus.failed, "invalid_deadline", False)
            assert far.error.evidence["max_task_deadline_s"] == 3600
            near = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, deadline_s=3000))
            assert near.status == ResultStatus.succeeded
            assert handler.calls == 1

    run_bounded(body())


def test_expired_interrupted_task_is_refused_and_names_its_unfinished_steps(nats_server, tmp_path):
    """Today's behaviour (TODO issue 17 in worker.py): no recovery runs, but the result says what was left."""
    handler = Counting()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            envelope = h.plane.envelope(NODE, DISCOVER, deadline_s=-5)
            h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": 1})  # killed mid-run
            result = await h.run_task_to_result(envelope)
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            assert result.error.evidence["unfinished_steps"] == [TASK_STEP]
            assert handler.calls == 0

    run_bounded(body())


# -- poison messages (issue 17) --------------------------------------------------------


def test_handler_crashing_every_time_fails_once_after_the_bound_and_the_next_task_is_served(nats_server, tmp_path):
    crash = Counting(raises=RuntimeError("segfault-ish"))
    fine = Counting(output={"next": "served"})

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.preflight: crash, TaskType.topology_discover: fine},
                           max_task_starts=3, retry_backoff_s=0.2) as h:
            poison = h.plane.envelope(NODE, TaskType.preflight.value)
            result = await h.run_task_to_result(poison)
            assert (result.status, result.error.code, result.error.retryable) == (ResultStatus.failed, "poison_task", False)
            assert result.error.evidence["starts"] == 3 and "segfault-ish" in result.error.message
            assert crash.calls == 3  # bounded: three starts, then an answer
            await wait_until_acked(h)  # the message is gone from the work queue
            info = await h.plane.js.consumer_info(TASK_STREAM, h.settings.durable_name(NODE))
            assert info.delivered.consumer_seq == 3 and info.num_ack_pending == 0  # three deliveries of one message
            assert [r.task_id for r in await h.plane.stored_results(NODE)] == [poison.task_id]  # exactly one result
            assert h.store.result_of(poison.task_id)["error"]["code"] == "poison_task"

            nxt = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER))
            assert nxt.status == ResultStatus.succeeded and nxt.output == {"next": "served"}
            assert crash.calls == 3

    run_bounded(body())


def test_task_started_too_often_without_finishing_is_poison_without_running(nats_server, tmp_path):
    """The agent killed under a task on every start: the journal's start count ends the crash loop."""
    handler = Counting()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}, max_task_starts=3) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            for attempt in (1, 2, 3):  # three starts, each killed before it finished
                h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": attempt})
            result = await h.run_task_to_result(envelope.model_copy(update={"attempt": 4}))
            assert (result.status, result.error.code) == (ResultStatus.failed, "poison_task")
            assert result.error.evidence == {"starts": 3, "max_task_starts": 3, "last_error": None}
            assert handler.calls == 0
            await wait_until_acked(h)

    run_bounded(body())


# -- a stop (package upgrade) during a task (issue 17 item 5) ---------------------------------


class SlowToCancel:
    """A handler whose cancellation takes a while to see through (a killed qemu-img finishing in-flight writes)."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.cancelled_at: float | None = None
        self.reaped = asyncio.Event()
        self.settled = False

    async def __call__(self, payload, ctx):
        self.calls += 1
        self.started.set()
        if self.calls > 1:
            return {"resumed": True}
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled_at = asyncio.get_running_loop().time()
            await self.reaped.wait()
            self.settled = True
            raise
        return {}


def test_a_stop_waits_for_the_cancelled_handler_to_settle_then_hands_the_task_back_at_once(nats_server, tmp_path):
    """The drain cancels a handler past the grace, waits for it to settle (longer than one request timeout,
    up to ``cancel_settle_s``), and naks the task: the next worker takes it up at once, not ack_wait_s later."""
    handler = SlowToCancel()
    settings = {"request_timeout_s": 0.2, "cancel_settle_s": 20.0, "ack_wait_s": 30.0, "keepalive_interval_s": 1.0}

    async def body():
        loop = asyncio.get_running_loop()
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}, **settings) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            await h.plane.enqueue(envelope)
            await asyncio.wait_for(handler.started.wait(), 10)

            async def reaped_later() -> None:
                # The condition is time itself: settling outlasts five request timeouts.
                await wait_until(lambda: handler.cancelled_at is not None
                                 and loop.time() > handler.cancelled_at + 5 * settings["request_timeout_s"])
                handler.reaped.set()

            reaper = asyncio.create_task(reaped_later())
            cancelled = await h.worker.drain(0.1)
            assert cancelled == [envelope.task_id] and handler.settled  # drain returned after the handler settled
            await reaper
            await asyncio.wait_for(h.run_task, 10)
            assert h.store.unfinished_steps(envelope.task_id) == [TASK_STEP]
            assert await h.plane.stored_results(NODE) == []

            # The next agent (an upgrade's new version): the handed-back task is its first pull.
            h.worker = TaskWorker(h.nc, h.store, NODE, {TaskType.topology_discover: handler}, h.settings)
            h.run_task = asyncio.create_task(h.worker.run())
            result = await h.plane.wait_result(envelope.task_id, timeout=settings["ack_wait_s"] / 2)
            assert result.status == ResultStatus.succeeded and result.output == {"resumed": True}
            assert handler.calls == 2
            assert [(e.step, e.status.value) for e in h.store.journal_of(envelope.task_id)] == [
                (TASK_STEP, "started"), (STOPPED_STEP, "succeeded"), (TASK_STEP, "started"), (TASK_STEP, "succeeded")]

    run_bounded(body())


class StoppedUntil:
    """Runs until cancelled (a long clone) for its first ``stops`` calls; the call after them finishes."""

    def __init__(self, stops: int) -> None:
        self.stops, self.calls = stops, 0
        self.started = asyncio.Event()

    async def __call__(self, payload, ctx):
        self.calls += 1
        self.started.set()
        if self.calls > self.stops:
            return {"finished_after_stops": self.stops}
        await asyncio.Event().wait()
        return {}


def test_stops_that_hand_the_task_back_never_count_toward_the_poison_bound(nats_server, tmp_path):
    """An upgrade, a rollback and two restarts during one long clone: four clean stops, more than
    max_task_starts (3). Each hand-back is journaled and not counted as a crash, so the fifth agent runs
    the task to its end instead of answering poison_task."""
    handler = StoppedUntil(stops=4)
    settings = {"request_timeout_s": 0.2, "cancel_settle_s": 5.0, "ack_wait_s": 30.0, "keepalive_interval_s": 1.0}

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}, **settings) as h:
            assert h.settings.max_task_starts == 3
            envelope = h.plane.envelope(NODE, DISCOVER)
            await h.plane.enqueue(envelope)
            for stop in range(handler.stops):
                await asyncio.wait_for(handler.started.wait(), 20)
                handler.started.clear()
                assert await h.worker.drain(0.1) == [envelope.task_id], f"stop {stop + 1}"
                await h.restart_agent()
            result = await h.plane.wait_result(envelope.task_id, timeout=settings["ack_wait_s"])
            assert result.status == ResultStatus.succeeded, result.error
            assert result.output == {"finished_after_stops": 4} and handler.calls == 5
            journal = [(e.step, e.status.value) for e in h.store.journal_of(envelope.task_id)]
            assert journal.count((STOPPED_STEP, "succeeded")) == 4
            assert journal.count((TASK_STEP, "started")) == 5 and journal[-1] == (TASK_STEP, "succeeded")

    run_bounded(body())
