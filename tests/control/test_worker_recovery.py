"""The worker's recovery (issue 17): a task interrupted mid-run that will not run again is undone.

A task the agent was killed under comes back with its journal showing started steps. When its
deadline has passed (``expired``) or it hit the start bound (``poison_task``), the handler never
runs again; the recovery its registry row declares (``TaskSpec.make_recovery``: provision's and
release's compensate or block the slot) runs instead, and its evidence and slot outcomes travel
with the one stored result. The recovery is found from the row, never from the handler object.
"""

from __future__ import annotations

import nats
import pytest

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.slots import HealthState, SlotOutcome, SlotStatus
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.taskpolicy import TASK_STEP
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.registry import BuiltTasks, TaskDeps, TaskSpec, build_tasks
from tests.support.deadline import run_bounded
from tests.support.worker_harness import DISCOVER, NODE, Counting, Harness


class Recovering(Counting):
    """A handler and its recovery, which records what it was given and reports the slot blocked."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.recovered: list[list[str]] = []

    async def recover(self, payload, ctx) -> dict:
        self.recovered.append(list(ctx.resumed_steps))
        ctx.slot_outcomes.append(SlotOutcome(slot_index=0, status=SlotStatus.cleanup_blocked,
                                             health_state=HealthState.failed, health_detail={"why": "interrupted"}))
        return {"compensated": ["ovs_port"]}


def declared(handler: Recovering, recover=None) -> BuiltTasks:
    """The handler and its recovery as a registry row declares them, built the way the daemon builds its rows."""
    row = TaskSpec(TaskType.topology_discover, lambda deps: handler, concurrency=2,
                   make_recovery=lambda deps: recover or handler.recover)
    return build_tasks(TaskDeps(AgentConfig()), (row,))


def harness(nats_server, tmp_path, tasks: BuiltTasks, **settings) -> Harness:
    return Harness(nats_server, tmp_path, tasks.handlers, recoveries=tasks.recoveries, **settings)


def test_an_interrupted_task_whose_deadline_passed_is_recovered_then_answered_expired(nats_server, tmp_path):
    handler = Recovering()

    async def body():
        async with harness(nats_server, tmp_path, declared(handler)) as h:
            envelope = h.plane.envelope(NODE, DISCOVER, deadline_s=-5)
            h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": 1})  # killed mid-run
            h.store.journal(envelope.task_id, "ovs_port", StepStatus.started)
            result = await h.run_task_to_result(envelope)
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            assert result.error.evidence["unfinished_steps"] == [TASK_STEP, "ovs_port"]
            assert result.error.evidence["recovery"] == {"compensated": ["ovs_port"]}
            assert [o.status for o in result.slot_outcomes] == [SlotStatus.cleanup_blocked]
            assert handler.calls == 0 and handler.recovered == [[TASK_STEP, "ovs_port"]]
            assert [r.task_id for r in await h.plane.stored_results(NODE)] == [envelope.task_id]

    run_bounded(body())


def test_an_expired_task_that_never_started_is_not_recovered(nats_server, tmp_path):
    handler = Recovering()

    async def body():
        async with harness(nats_server, tmp_path, declared(handler)) as h:
            result = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, deadline_s=-5))
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            assert "recovery" not in result.error.evidence and result.slot_outcomes == []
            assert handler.recovered == []

    run_bounded(body())


def test_a_poison_task_killed_mid_run_is_recovered_once_and_answered(nats_server, tmp_path):
    handler = Recovering()

    async def body():
        async with harness(nats_server, tmp_path, declared(handler), max_task_starts=2) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            for attempt in (1, 2):  # the agent died under it twice
                h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": attempt})
            h.store.journal(envelope.task_id, "clone", StepStatus.started)
            result = await h.run_task_to_result(envelope)
            assert (result.status, result.error.code) == (ResultStatus.failed, "poison_task")
            assert result.error.evidence["recovery"] == {"compensated": ["ovs_port"]}
            assert [o.status for o in result.slot_outcomes] == [SlotStatus.cleanup_blocked]
            assert handler.calls == 0 and handler.recovered == [[TASK_STEP, "clone"]]

    run_bounded(body())


def test_a_failing_recover_hook_is_reported_and_the_task_still_gets_its_answer(nats_server, tmp_path):
    handler = Recovering()

    async def broken(payload, ctx):
        raise RuntimeError("libvirt went away")

    async def body():
        async with harness(nats_server, tmp_path, declared(handler, broken)) as h:
            envelope = h.plane.envelope(NODE, DISCOVER, deadline_s=-5)
            h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": 1})
            result = await h.run_task_to_result(envelope)
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            recovery = result.error.evidence["recovery"]
            assert recovery["ok"] is False and recovery["code"] == "internal_error"
            assert "libvirt went away" in recovery["message"]

    run_bounded(body())


def test_a_recover_hook_that_killed_the_agent_each_time_is_not_run_again(nats_server, tmp_path):
    """The recovery's own starts are bounded like the handler's: no crash loop on recovery either."""
    handler = Recovering()

    async def body():
        async with harness(nats_server, tmp_path, declared(handler), max_task_starts=2) as h:
            envelope = h.plane.envelope(NODE, DISCOVER, deadline_s=-5)
            h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": 1})
            for _ in (1, 2):  # the recovery was started twice and the agent died under it
                h.store.journal(envelope.task_id, "recover", StepStatus.started)
            result = await h.run_task_to_result(envelope)
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            assert result.error.evidence["recovery"]["code"] == "recovery_poison"
            assert handler.recovered == []

    run_bounded(body())


def test_a_handler_whose_row_declares_no_recovery_is_not_recovered_whatever_attributes_it_has(nats_server, tmp_path):
    """The row is the declaration: a ``recover`` attribute on the handler object (the old hook) is never looked for."""
    handler = Recovering()  # has a recover method, but its row does not declare it

    async def body():
        undeclared = build_tasks(TaskDeps(AgentConfig()),
                                 (TaskSpec(TaskType.topology_discover, lambda deps: handler, concurrency=2),))
        async with harness(nats_server, tmp_path, undeclared) as h:
            envelope = h.plane.envelope(NODE, DISCOVER, deadline_s=-5)
            h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": 1})
            result = await h.run_task_to_result(envelope)
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            assert "recovery" not in result.error.evidence and handler.recovered == []

    run_bounded(body())


def test_a_recovery_for_a_type_the_worker_does_not_serve_is_refused_at_construction(nats_server, tmp_path):
    """A recovery with no handler beside it is a wiring bug: the worker refuses it when built, not when a
    crashed task needs it."""
    handler = Recovering()

    async def body():
        nc = await nats.connect(nats_server.url)
        store = StateStore.open(tmp_path / "state.db")
        try:
            with pytest.raises(ValueError, match="slice.vm_provision"):
                TaskWorker(nc, store, NODE, {TaskType.topology_discover: handler},
                           recoveries={TaskType.vm_provision: handler.recover})
        finally:
            store.close()
            await nc.close()

    run_bounded(body())
