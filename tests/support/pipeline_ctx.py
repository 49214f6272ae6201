"""A task context over a real state store for pipeline tests: the journal of task ``t-1`` and the progress events.

``journal_ctx`` is the fixture (a pytest plugin, registered in tests/conftest.py); ``sync`` runs an
async test body on a fresh loop; ``journal`` lists the (step, status) rows a run wrote.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest

from gpuaas_agent.contract.tasks import TaskEnvelope
from gpuaas_agent.state.store import StateStore


@dataclass
class JournalCtx:
    """The handler context a pipeline needs: a store for its journal, the envelope, and its progress events."""

    store: StateStore
    envelope: TaskEnvelope
    events: list = field(default_factory=list)

    async def progress(self, step, status, *, percent=None, detail=None):
        self.events.append((step, status))


@pytest.fixture
def journal_ctx(tmp_path):
    """The context of task ``t-1`` (a provision, attempt 1) on a fresh state store, closed afterwards."""
    store = StateStore.open(tmp_path / "state.db")
    env = TaskEnvelope(task_id="t-1", type="slice.vm_provision", node_id="node-1", attempt=1,
                       deadline=datetime.now(UTC) + timedelta(minutes=5), payload={})
    yield JournalCtx(store=store, envelope=env)
    store.close()


def sync(fn):
    """Run an async test body on a fresh event loop (the suite has no asyncio plugin)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return wrapper


def journal(ctx: JournalCtx) -> list:
    """The (step, status) rows the run of task ``t-1`` wrote, in order."""
    return [(e.step, e.status) for e in ctx.store.journal_of("t-1")]
