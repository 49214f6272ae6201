"""control/taskpolicy.py: the order of the gates and the facts they judge by.

The gates run end to end (real nats-server, real store) in tests/control/test_worker*.py; here the
sequence itself, and the journal arithmetic the poison and crash gates rest on, on a real store.
"""

from __future__ import annotations

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import TaskErrorBody
from gpuaas_agent.control.taskpolicy import (
    STOPPED_STEP,
    TASK_GATES,
    TASK_STEP,
    TaskPolicy,
    handler_starts,
    is_handler_crash,
    task_history,
)
from gpuaas_agent.state.store import StateStore


def test_the_gates_run_in_the_contracts_order():
    """Replay before any deadline (a stored answer is the answer), the deadline before the payload (an expired
    task of an unknown type is still expired), the journal before poison, and the answer last."""
    assert [name for name, _ in TASK_GATES] == ["replay", "expired", "horizon", "payload", "handler", "journal",
                                                 "poison", "run", "crash", "answer"]
    assert all(gate is getattr(TaskPolicy, f"_gate_{name}") for name, gate in TASK_GATES)


def test_a_start_handed_back_at_a_stop_is_not_counted_toward_poison(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    try:
        for _ in range(3):
            store.journal("t1", TASK_STEP, StepStatus.started)
        store.journal("t1", STOPPED_STEP, StepStatus.succeeded, {"reason": "agent_stopping"})
        assert handler_starts(store.journal_of("t1")) == 2
        stored, history = task_history(store, "t1")
        assert stored is None and history == (2, [TASK_STEP])  # the last start is unfinished
        store.store_result("t1", {"task_id": "t1"})
        assert task_history(store, "t1") == ({"task_id": "t1"}, (0, []))  # a stored result: replayed, nothing read
    finally:
        store.close()


def test_only_a_bare_crash_is_retried_not_a_pipeline_that_answered():
    crash = TaskErrorBody(code="internal_error", message="KeyError: 'x'", retryable=True,
                          evidence={"exception": "KeyError"})
    answered = TaskErrorBody(code="internal_error", message="step failed", retryable=False,
                             evidence={"exception": "KeyError", "failed_step": "clone"})
    refusal = TaskErrorBody(code="slot_busy", message="busy", retryable=True, evidence={})
    assert is_handler_crash(crash)
    assert not is_handler_crash(answered) and not is_handler_crash(refusal) and not is_handler_crash(None)
