"""The worker's ``recover`` hook (issue 17): a task interrupted mid-run that will not run again is undone.

A task the agent was killed under comes back with its journal showing started steps. When its
deadline has passed (``expired``) or it hit the start bound (``poison_task``), the handler never
runs again; its ``recover`` attribute (provision's and release's compensate or block the slot)
runs instead, and its evidence and slot outcomes travel with the one stored result.
"""

from __future__ import annotations

from gpuaas_agent.contract.slots import HealthState, SlotOutcome, SlotStatus
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.worker import TASK_STEP
from tests.support.deadline import run_bounded
from tests.support.worker_harness import DISCOVER, NODE, Counting, Harness


class Recovering(Counting):
    """A handler with a recover hook that records what it was given and reports the slot blocked."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.recovered: list[list[str]] = []

    async def recover(self, payload, ctx) -> dict:
        self.recovered.append(list(ctx.resumed_steps))
        ctx.slot_outcomes.append(SlotOutcome(slot_index=0, status=SlotStatus.cleanup_blocked,
                                             health_state=HealthState.failed, health_detail={"why": "interrupted"}))
        return {"compensated": ["ovs_port"]}


def test_an_interrupted_task_whose_deadline_passed_is_recovered_then_answered_expired(nats_server, tmp_path):
    handler = Recovering()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
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
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            result = await h.run_task_to_result(h.plane.envelope(NODE, DISCOVER, deadline_s=-5))
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            assert "recovery" not in result.error.evidence and result.slot_outcomes == []
            assert handler.recovered == []

    run_bounded(body())


def test_a_poison_task_killed_mid_run_is_recovered_once_and_answered(nats_server, tmp_path):
    handler = Recovering()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}, max_task_starts=2) as h:
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

    handler.recover = broken

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
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
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}, max_task_starts=2) as h:
            envelope = h.plane.envelope(NODE, DISCOVER, deadline_s=-5)
            h.store.journal(envelope.task_id, TASK_STEP, StepStatus.started, {"attempt": 1})
            for _ in (1, 2):  # the recovery was started twice and the agent died under it
                h.store.journal(envelope.task_id, "recover", StepStatus.started)
            result = await h.run_task_to_result(envelope)
            assert (result.status, result.error.code) == (ResultStatus.failed, "expired")
            assert result.error.evidence["recovery"]["code"] == "recovery_poison"
            assert handler.recovered == []

    run_bounded(body())
