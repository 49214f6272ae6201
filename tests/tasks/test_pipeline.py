"""The step pipeline: journal order, compensation order, disk-touched and cancellation semantics."""

import asyncio

import pytest

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.errors import AgentError, HostError
from gpuaas_agent.tasks.pipeline import PipelineFailed, Step, run_pipeline
from tests.support.pipeline_ctx import journal, sync


def recorder(log, name, *, fail=None):
    async def fn():
        log.append(name)
        if fail is not None:
            raise fail
        return {"did": name}
    return fn


@sync
async def test_success_journals_each_step_before_and_after(journal_ctx):
    log = []
    out = await run_pipeline(journal_ctx, [Step("a", recorder(log, "a")), Step("b", recorder(log, "b"))])
    assert log == ["a", "b"]
    assert out["a"]["did"] == "a" and "duration_s" in out["b"]
    assert journal(journal_ctx) == [("a", StepStatus.started), ("a", StepStatus.succeeded),
                            ("b", StepStatus.started), ("b", StepStatus.succeeded)]
    assert journal_ctx.events == [("a", "started"), ("a", "succeeded"), ("b", "started"), ("b", "succeeded")]


@sync
async def test_failure_compensates_done_steps_and_the_failed_one_in_reverse(journal_ctx):
    log = []
    steps = [
        Step("lease", recorder(log, "lease"), recorder(log, "undo-lease")),
        Step("image", recorder(log, "image")),  # nothing to undo
        Step("port", recorder(log, "port"), recorder(log, "undo-port")),
        Step("define", recorder(log, "define", fail=HostError("boom", code="define_failed", evidence={"x": 1})),
             recorder(log, "undo-define")),
        Step("start", recorder(log, "start"), recorder(log, "undo-start")),
    ]
    with pytest.raises(PipelineFailed) as info:
        await run_pipeline(journal_ctx, steps)
    err = info.value
    assert log == ["lease", "image", "port", "define", "undo-define", "undo-port", "undo-lease"]
    assert err.code == "define_failed" and err.evidence["x"] == 1
    assert err.evidence["failed_step"] == "define" and err.evidence["disk_touched"] is False
    assert [c["step"] for c in err.evidence["compensations"]] == ["define", "port", "lease"]
    assert all(c["ok"] for c in err.evidence["compensations"])
    assert not err.cancelled
    assert ("define", StepStatus.failed) in journal(journal_ctx) and ("lease", StepStatus.compensated) in journal(journal_ctx)


@sync
async def test_disk_touched_from_the_moment_the_disk_step_starts(journal_ctx):
    log = []
    steps = [Step("clone", recorder(log, "clone", fail=HostError("io", code="clone_failed")), touches_disk=True)]
    with pytest.raises(PipelineFailed) as info:
        await run_pipeline(journal_ctx, steps)
    assert info.value.disk_touched is True


@sync
async def test_a_failing_compensation_is_reported_and_the_others_still_run(journal_ctx):
    log = []
    steps = [
        Step("a", recorder(log, "a"), recorder(log, "undo-a")),
        Step("b", recorder(log, "b"), recorder(log, "undo-b", fail=HostError("gone", code="ovsdb_unreachable"))),
        Step("c", recorder(log, "c", fail=AgentError("no", code="nope"))),
    ]
    with pytest.raises(PipelineFailed) as info:
        await run_pipeline(journal_ctx, steps)
    comps = info.value.evidence["compensations"]
    assert log[-2:] == ["undo-b", "undo-a"]
    assert comps[0] == {"step": "b", "ok": False, "code": "ovsdb_unreachable", "message": "ovsdb_unreachable: gone",
                        "evidence": {}}
    assert comps[1]["step"] == "a" and comps[1]["ok"] is True
    assert info.value.code == "nope"  # the original error is never masked by a compensation's


@sync
async def test_cancellation_mid_step_compensates_and_is_reported_cancelled(journal_ctx):
    log = []
    entered = asyncio.Event()

    async def slow():
        log.append("clone")
        entered.set()
        await asyncio.Event().wait()  # until cancelled

    steps = [Step("lease", recorder(log, "lease"), recorder(log, "undo-lease")),
             Step("clone", slow, touches_disk=True)]
    task = asyncio.create_task(run_pipeline(journal_ctx, steps))
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    with pytest.raises(PipelineFailed) as info:
        await task
    assert info.value.cancelled and info.value.disk_touched and info.value.code == "cancelled"
    assert log == ["lease", "clone", "undo-lease"]
    assert ("clone", StepStatus.failed) in journal(journal_ctx)


@sync
async def test_a_driver_cancel_code_counts_as_cancellation(journal_ctx):
    steps = [Step("clone", recorder([], "clone", fail=HostError("dirty", code="clone_cancelled")), touches_disk=True)]
    with pytest.raises(PipelineFailed) as info:
        await run_pipeline(journal_ctx, steps)
    assert info.value.cancelled and info.value.code == "clone_cancelled"


@sync
async def test_a_bug_in_a_step_becomes_internal_error_with_compensation(journal_ctx):
    log = []
    steps = [Step("a", recorder(log, "a"), recorder(log, "undo-a")), Step("b", recorder(log, "b", fail=KeyError("k")))]
    with pytest.raises(PipelineFailed) as info:
        await run_pipeline(journal_ctx, steps)
    assert info.value.code == "internal_error" and "KeyError" in info.value.message
    assert log == ["a", "b", "undo-a"]
