"""Stored task results and their journal rows are pruned after the retention; unfinished tasks keep theirs."""

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.state.store import StateStore


def test_prune_forgets_old_finished_tasks_and_keeps_unfinished_journals(tmp_path):
    now = [1000.0]
    store = StateStore.open(tmp_path / "state.db", clock=lambda: now[0])
    try:
        store.journal("old", "task", StepStatus.started)
        store.store_result("old", {"status": "succeeded"})
        store.journal("running", "task", StepStatus.started)  # no result: a restart must still resume it
        now[0] = 5000.0
        store.journal("new", "task", StepStatus.started)
        store.store_result("new", {"status": "failed"})
        assert store.prune_finished(before=2000.0) == (1, 1)
        assert store.result_of("old") is None and store.journal_of("old") == []
        assert store.unfinished_steps("running") == ["task"] and store.result_of("new") is not None
        assert store.prune_finished(before=2000.0) == (0, 0)
    finally:
        store.close()
