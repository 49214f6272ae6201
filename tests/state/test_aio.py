"""The store thread (state/aio.py): a blocking store call on the event loop's thread is a bug caught at once,
a cancelled write still lands, and closing a plain store waits for the calls queued on its thread."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import TaskEnvelope
from gpuaas_agent.control.taskpolicy import TaskRun
from gpuaas_agent.state.aio import StoreCallOnLoop, StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore


def test_the_blocking_view_refuses_the_event_loop_thread_and_serves_a_worker_thread(tmp_path):
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        with pytest.raises(StoreCallOnLoop, match="journal called synchronously on the event loop"):
            state.sync.journal("t-1", "step", StepStatus.started)
        # Off the loop (asyncio.to_thread) the same view works, on the store thread.
        await asyncio.to_thread(state.sync.journal, "t-1", "step", StepStatus.started)
        return [e.step for e in await state.journal_of("t-1")]

    try:
        assert asyncio.run(body()) == ["step"]  # the refused call wrote nothing
        assert [e.step for e in state.sync.journal_of("t-1")] == ["step"]  # no loop here: allowed
    finally:
        state.close()


def test_a_write_whose_caller_is_cancelled_still_lands_in_order(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    state = as_store_thread(store)

    async def body():
        gate = asyncio.Event()
        blocker = asyncio.ensure_future(state.run(lambda s: asyncio.run_coroutine_threadsafe(
            gate.wait(), loop).result(10), write=True))  # the store thread is busy until the gate opens
        writes = [asyncio.ensure_future(state.journal("t-1", f"s{n}", StepStatus.started)) for n in range(3)]
        await asyncio.sleep(0)  # let them queue behind the blocker
        writes[1].cancel()
        gate.set()
        await blocker
        await asyncio.gather(*writes, return_exceptions=True)
        return [e.step for e in await state.journal_of("t-1")]

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(body()) == ["s0", "s1", "s2"]
    finally:
        loop.close()
        store.close()


def test_a_task_context_given_a_plain_store_awaits_it_on_a_store_thread(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    envelope = TaskEnvelope(task_id="t-1", type="slice.plan", node_id="node-1", attempt=1,
                            deadline=datetime(2099, 1, 1, tzinfo=UTC), payload={})
    ctx = TaskRun(envelope=envelope, node_id="node-1", store=store, resumed_steps=[], _nc=None)
    assert isinstance(ctx.store, StoreThread) and ctx.store.store is store
    asyncio.run(ctx.store.journal("t-1", "a", StepStatus.started))
    store.close()  # waits for the store thread's queue: never closes under a running statement
    reopened = StateStore.open(tmp_path / "state.db")
    assert [e.step for e in reopened.journal_of("t-1")] == ["a"]
    reopened.close()
