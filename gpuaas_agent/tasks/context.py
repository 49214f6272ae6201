"""What a task handler is given besides its payload, and the shape of a handler.

The worker (control/, a room above this one) builds the context; the handlers here only
read it. Declaring it as a protocol in the room that uses it types every handler's ``ctx``
without an upward import: the worker's record of a run (``control/taskpolicy.TaskRun``) satisfies it
structurally, and mypy checks that where the worker calls a :data:`Handler` (or a task's recovery,
which has the same shape and is declared in its ``tasks/registry.py`` row).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias

from nats.aio.client import Client

from gpuaas_agent.contract.slots import SlotOutcome
from gpuaas_agent.contract.tasks import TaskEnvelope
from gpuaas_agent.state.aio import BlockingStore, StoreThread
from gpuaas_agent.state.store import StateStore

# What a task function outside a handler may be handed as its store: the daemon's store thread, its blocking
# view, or (tests, the CLI) a plain store; ``state.aio.as_store_thread`` makes each a StoreThread.
AnyStore: TypeAlias = StateStore | StoreThread | BlockingStore


class TaskContext(Protocol):
    """One task's view of the agent: its envelope, the store thread, progress events, slot outcomes."""

    envelope: TaskEnvelope
    node_id: str
    # The daemon's store thread: handlers ``await ctx.store.journal(...)``, never block the loop.
    store: StoreThread
    resumed_steps: list[str]
    # What the task did to slots; reported with the result whether it succeeded or not.
    slot_outcomes: list[SlotOutcome]
    # Called per finished pipeline step (task type, step, status, duration_s, output): metrics.
    step_observer: Callable[[str, str, str, float, dict[str, Any]], None] | None
    # Set when the agent is stopping: a cancelled pipeline leaves its step journaled for the next agent.
    agent_stopping: asyncio.Event | None

    @property
    def nc(self) -> Client:
        """The NATS connection, for work that outlives the task (a terminal session's subjects)."""
        ...

    async def progress(self, step: str, status: str, *, percent: float | None = None,
                       detail: dict[str, Any] | None = None) -> None:
        """Publish a step event (advisory: a lost one does not fail the task)."""
        ...


class SlotRequest(Protocol):
    """A task aimed at one slot of one allocation (a power operation, a terminal): what slot admission reads."""

    @property
    def allocation_id(self) -> str: ...

    @property
    def slot_index(self) -> int: ...


# (validated payload, the model its TaskSpec names; the context) -> the task's output.
# The payload is Any: each handler takes its own payload model, which a Callable over the
# WireModel base would refuse (parameters are contravariant).
Handler = Callable[[Any, TaskContext], Awaitable[dict[str, Any]]]
