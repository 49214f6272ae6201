"""The task worker against a real nats-server: contract order, idempotency, keepalive, restart."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime

import pytest

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.enrollment import NatsCredentials
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.enroll import EnrollmentRecord
from gpuaas_agent.control.worker import TASK_STEP, TaskWorker, WorkerSettings
from gpuaas_agent.daemon import connect, default_handlers
from gpuaas_agent.errors import GuardError
from gpuaas_agent.state.store import StateStore
from tests.conftest import fixture_host
from tests.controlplane import TASK_STREAM, ControlPlane

NODE = "node-test01"
DISCOVER = TaskType.topology_discover.value
TEST_DEADLINE_S = 90


async def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll a cheap condition until it holds or the deadline passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.05)


class Harness:
    """Control plane + one agent worker on its own connection, as in production."""

    def __init__(self, server, tmp_path, handlers, **settings) -> None:
        self.server, self.tmp_path, self.handlers = server, tmp_path, handlers
        self.settings = WorkerSettings(**{"keepalive_interval_s": 0.5, "ack_wait_s": 5.0, "fetch_timeout_s": 0.25, **settings})

    async def __aenter__(self):
        self.plane = await ControlPlane.connect(self.server.url)
        await self.plane.create_streams()
        # The daemon's own connect (its reconnect options are what the restart test exercises).
        record = EnrollmentRecord(node_id=NODE, enrolled_at=datetime.now(UTC),
                                  credentials=NatsCredentials(user=NODE, password="unused-by-test-server",
                                                              servers=[self.server.url]))
        self.nc = await connect(AgentConfig(state_dir=self.tmp_path / "state", insecure=True), record, asyncio.Event())
        self.store = StateStore.open(self.tmp_path / "state" / "state.db")
        self.worker = TaskWorker(self.nc, self.store, NODE, self.handlers, self.settings)
        self.run_task = asyncio.create_task(self.worker.run())
        await asyncio.wait_for(self.worker.ready.wait(), 10)
        return self

    async def __aexit__(self, *exc):
        await self.worker.drain(5)
        await asyncio.wait_for(self.run_task, 10)
        await asyncio.wait_for(self.nc.close(), 5)
        await self.plane.close()
        self.store.close()

    async def run_task_to_result(self, envelope, **kw):
        await self.plane.enqueue(envelope, **kw)
        return await self.plane.wait_result(envelope.task_id)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TEST_DEADLINE_S))


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


def test_topology_discover_over_fixture_succeeds(nats_server, tmp_path):
    config = AgentConfig(host_root=fixture_host("h200-slice-after-transition"), state_dir=tmp_path / "state")

    async def body():
        async with Harness(nats_server, tmp_path, default_handlers(config)) as h:
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

    _run(body())


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

    _run(body())


def test_expired_task_fails_without_running(nats_server, tmp_path):
    handler = Counting()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            result = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, deadline_s=-5))
            assert result.status == ResultStatus.failed
            assert result.error.code == "expired" and result.error.retryable is False
            assert handler.calls == 0

    _run(body())


def test_unsupported_unimplemented_and_invalid_payload_fail_with_codes(nats_server, tmp_path):
    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: Counting()}) as h:
            unknown = await h.run_task_to_result(h.plane.envelope(NODE, "slice.make_coffee"))
            assert (unknown.status, unknown.error.code) == (ResultStatus.failed, "unsupported_task")
            todo = await h.run_task_to_result(h.plane.envelope(NODE, TaskType.preflight.value))
            assert (todo.error.code, todo.error.retryable) == ("not_implemented", False)
            bad = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, {"subnet": 7, "colour": "red"}))
            assert bad.error.code == "invalid_payload"

    _run(body())


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

    _run(body())


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

    _run(body())


def test_concurrency_is_bounded_per_task_type(nats_server, tmp_path):
    handler = Counting(hold=True)

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler},
                           concurrency={TaskType.topology_discover: 1}) as h:
            tasks = [h.plane.envelope(NODE, DISCOVER) for _ in range(3)]
            for envelope in tasks:
                await h.plane.enqueue(envelope)
            await asyncio.wait_for(handler.started.wait(), 10)
            # All three are claimed (the worker has slots for other types), only one runs.
            await wait_until(lambda: len(h.worker.running_task_ids) == 3, what="three tasks claimed")
            assert handler.active == 1
            handler.release.set()
            for envelope in tasks:
                await h.plane.wait_result(envelope.task_id)
            assert handler.max_active == 1 and handler.calls == 3

    _run(body())


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

    _run(body())


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

    _run(body())


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

    _run(body())


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

    _run(body())


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

    _run(body())


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

    _run(body())


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

    _run(body())


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

    _run(body())
