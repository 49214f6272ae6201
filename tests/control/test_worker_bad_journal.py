"""The worker given a journal an older agent wrote (issue 17, bad input): a clear failed result, no handler run."""

from __future__ import annotations

import sqlite3

from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from tests.support.deadline import run_bounded
from tests.support.worker_harness import NODE, Counting, Harness


def test_a_task_whose_journal_holds_a_row_this_agent_cannot_read_fails_clearly_without_running(nats_server, tmp_path):
    handler = Counting()

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            envelope = h.plane.envelope(NODE, TaskType.topology_discover.value)
            conn = sqlite3.connect(h.store.path, isolation_level=None)  # what an older version left behind
            conn.execute("INSERT INTO task_journal VALUES (?, 1, 'discover', 'running', '{}', 1.0)",
                         (envelope.task_id,))
            conn.close()
            result = await h.run_task_to_result(envelope)
            assert result.status == ResultStatus.failed and result.error.code == "journal_unreadable"
            assert result.error.evidence["status"] == "running" and not result.error.retryable
            assert handler.calls == 0
            assert h.store.result_of(envelope.task_id)["error"]["code"] == "journal_unreadable"  # stored: a
            # redelivery answers the same

    run_bounded(body())
