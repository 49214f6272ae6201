"""The task policy: what the worker does with one pulled task, as an ordered sequence of named gates.

Order per message is the contract's (docs/contract.md "Tasks"):

1. ``parse_task`` — junk is terminated and logged; the loop goes on. So is a task whose
   envelope names another node (``wrong_node``) or that arrived on a subject other than
   ``gpuaas.node.<node>.task.<its type>`` (``wrong_subject``): logged at WARNING, nothing
   runs, and **no result is stored or published** — a result keyed by a forged
   ``task_id`` would shadow the genuine task's (our stored-result replay, and the result
   stream's ``Nats-Msg-Id`` dedupe), which is what a forger would want.
2. A stored result for ``task_id`` → publish it again (same ``Nats-Msg-Id``, so the
   result stream keeps it once) and ack; nothing runs. Whatever the redelivery's
   ``attempt``: the stored result (with its own attempt) is the answer.
3. ``deadline`` passed → ``failed``/``expired``; a deadline further ahead than
   ``max_task_deadline_s`` → ``failed``/``invalid_deadline``. When the journal shows the
   task was interrupted mid-run (the agent was killed or stopped under it), the recovery its
   registry row declares (``TaskSpec.make_recovery``: provision's, release's) runs first —
   compensation only, no new side effect — and its evidence and slot outcomes go into
   the ``expired`` result: an interrupted provision is never left half built.
4./5. ``task_payload`` errors → ``failed`` with its code (``unsupported_task``, ``invalid_payload``).
6. Poison bound: the journal counts the handler's starts for ``task_id``; at
   ``max_task_starts`` starts without a finish (the handler crashed, or the agent died
   under it each time) → ``failed``/``poison_task`` without running it again (its
   recovery runs, as for 3.).
7. The handler runs under its type's semaphore; ``in_progress`` keepalives every
   ``keepalive_interval_s`` keep JetStream from redelivering it meanwhile. A crash (an
   exception that is not an ``AgentError``) below the bound is nak'ed with a delay
   (``retry_backoff_s`` doubled per start, at most ``ack_wait_s``), not answered. A stop
   (SIGTERM: ``drain``) cancels a handler still running after the grace: its pipeline step
   stays journaled ``started``, nothing is undone, no result; once the handler has seen the
   cancellation through (its children reaped, ``cancel_settle_s``) the task is nak'ed, so the
   next agent (an upgrade's new version) resumes it at once; the hand-back is journaled
   (``task.handed_back``) and that start is not counted toward the poison bound, so upgrades,
   rollbacks and restarts during one long clone never make it ``poison_task``.
8. ``StateStore.store_result`` → publish with ``Nats-Msg-Id: <task_id>-<attempt>`` and
   await the PubAck → only then ack the task (``ack_sync``: the server confirms it).

Steps 2 to 8 are :data:`TASK_GATES` (``replay``, ``expired``, ``horizon``, ``payload``, ``handler``,
``journal``, ``poison``, ``run``, ``crash``, ``answer``): each gate is a method that settles the task
(answers it, hands it back) or lets it through to the next. Before them, the worker's pull loop
(control/worker.py) admits the message or hands it back (control/admission.py, :meth:`TaskPolicy.turn_away`),
and :meth:`TaskPolicy.process` checks its route (step 1).

The consumer keeps ``max_deliver=-1``: JetStream's own bound would drop a task silently
(no result, the control plane waits for the deadline), and it counts deliveries that were
no start at all (a shutdown's handed-back tasks, a lost ack). The journal's start count above
is the bound instead, and it also holds across agent restarts.

A crash anywhere before the ack means redelivery; the stored result makes that
redelivery a republish, never a second run. A crash before the result is stored
means the handler runs again: the journal's ``unfinished_steps`` are handed to it
(``ctx.resumed_steps``) so a pipeline can resume or compensate.

:class:`TaskPolicy` is an object the :class:`~gpuaas_agent.control.worker.TaskWorker` builds and owns, given
what it needs in its constructor (the connection, the store thread, the handlers and their recoveries, the
settings, the worker's stop event); it knows nothing of how a task was pulled. Each task it runs gets a
:class:`TaskRun`, the worker's record of that run, which is what a handler sees as its
:class:`~gpuaas_agent.tasks.context.TaskContext`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig
from nats.js.client import JetStreamContext
from pydantic import ValidationError

from gpuaas_agent import compat
from gpuaas_agent.compat import UTC
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.slots import SlotOutcome
from gpuaas_agent.contract.state import JournalEntry, StepStatus
from gpuaas_agent.contract.tasks import (
    ProgressEvent,
    ResultStatus,
    TaskEnvelope,
    TaskErrorBody,
    TaskResult,
    TaskType,
    invalid_payload,
    parse_task,
    task_payload,
)
from gpuaas_agent.control.admission import Refusal
from gpuaas_agent.control.consumer import node_consumer_config
from gpuaas_agent.control.permissions import consumer_name
from gpuaas_agent.control.resultfit import fit_result
from gpuaas_agent.errors import AgentError, ContractError
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.state.store import StateError, StateStore
from gpuaas_agent.tasks.context import Handler
from gpuaas_agent.tasks.registry import default_concurrency

log = logging.getLogger(__name__)

TASK_STREAM = "GPUAAS_TASKS"
RESULT_STREAM = "GPUAAS_RESULTS"
TASK_STEP = "task"  # the worker's own journal step around a handler run
RECOVER_STEP = "recover"  # the worker's own journal step around a task's declared recovery
# Journaled when a stop (SIGTERM: an upgrade, a restart) hands a task back after its handler saw the
# cancellation through: that start was no crash, so it does not count toward ``max_task_starts``.
STOPPED_STEP = "task.handed_back"
CRASH_CODE = "internal_error"  # what _run_handler reports for an exception that is not an AgentError

_event = functools.partial(log_event, log)
_warn = functools.partial(log_event, log, level=logging.WARNING)

T = TypeVar("T")


class TaskObserver(Protocol):
    """The daemon's metrics as the worker sees them: one call per stored result, one per pipeline step."""

    def task_finished(self, task_type: str, status: str, duration_s: float | None) -> None: ...

    def step_finished(self, task_type: str, step: str, status: str, duration_s: float,
                      output: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class WorkerSettings:
    # None: with an account per node (js_api_prefix NODE_JS_API_PREFIX) the node's own GPUAAS_NODE_TASKS_<node>,
    # in one shared account the stream that holds gpuaas.node.<node>.task.> (asked by subject).
    task_stream: str | None = None
    # None: no expected stream; whichever stream holds gpuaas.node.<node>.result stores it (the node's own,
    # control/streams.py; GPUAAS_RESULTS in one shared stream) and the PubAck says which.
    result_stream: str | None = None
    concurrency: Mapping[TaskType, int] = field(default_factory=default_concurrency)  # the registry's
    keepalive_interval_s: float = 10.0
    ack_wait_s: float = 60.0  # must be well above keepalive_interval_s
    max_deliver: int = -1  # a task is never dropped for having been redelivered; its deadline ends it
    fetch_timeout_s: float = 30.0  # pull expiry: how long one pull request waits on the server
    # The server sends an idle heartbeat on a waiting pull this often; none for 2x this long ends the pull and
    # checks the consumer (its server may be gone while ours is not). None (or >= half the expiry): no heartbeat.
    # Off by default (config pull_heartbeat_s): it costs the server ~30 % more idle CPU and buys nothing where a
    # lost server drops our connection too (one server; replicated consumers). On an R1-consumer cluster set it (5).
    fetch_heartbeat_s: float | None = None
    # None: the consumer lives until the control plane deletes it (a node cannot create it again itself).
    inactive_threshold_s: float | None = None
    consumer_replicas: int | None = None  # None: the stream's; 1 keeps a 5,000-node cluster off per-node Raft groups
    consumer_check_s: float = 300.0  # after this long of empty pulls, check that the consumer still exists
    consumer_memory: bool = False  # consumer state in memory (with R1 on a replicated stream: docs/performance.md "Fleet layout")
    request_timeout_s: float = 5.0  # one JetStream API call / PubAck / ack confirmation
    publish_deadline_s: float = 60.0  # retrying a result publish across a reconnect, then give up (redelivery retries)
    max_task_deadline_s: float = 86400.0  # a deadline further ahead is refused: invalid_deadline
    max_task_starts: int = 3  # handler starts without a finish before a task is poison_task
    retry_backoff_s: float = 5.0  # nak delay after a crash: doubled per start, at most ack_wait_s
    recovery_timeout_s: float = 600.0  # a task's recovery (compensations of an interrupted run)
    # At a stop, a cancelled handler gets this long to see its cancellation through (a clone's qemu-img killed,
    # its in-flight writes done, reaped) before the agent exits: no writer of a slot disk outlives the agent.
    cancel_settle_s: float = 20.0
    # Interactive tasks (power, terminal, console) one allocation may have in flight; more are answered
    # tenant_busy at once (control/admission.py). 4 x 8 slots stays under the interactive capacity.
    interactive_per_allocation: int = 4
    # A task whose class or type is full goes back to JetStream with this delay, doubled per delivery (at most 8x).
    handback_delay_s: float = 0.5
    # JetStream's API prefix as the node's account sees it (control/accounts.py: another in a node account).
    js_api_prefix: str = "$JS.API"

    # The fields below down to consumer_memory describe the consumer the control plane creates for an agent
    # configured this way (consumer_config); the worker itself creates nothing.

    def durable_name(self, node_id: str) -> str:
        return consumer_name(node_id)

    def consumer_config(self, node_id: str) -> ConsumerConfig:
        """What the control plane creates for an agent with these settings (``control/consumer.py``)."""
        inflight = max(1, sum(self.concurrency.get(t, 1) for t in TaskType))
        return node_consumer_config(node_id, ack_wait_s=self.ack_wait_s, max_ack_pending=inflight * 4,
                                    replicas=self.consumer_replicas, memory=self.consumer_memory,
                                    inactive_threshold_s=self.inactive_threshold_s)


@dataclass
class TaskRun:
    """The worker's record of one task run: what a handler gets besides its payload (its
    :class:`~gpuaas_agent.tasks.context.TaskContext`, which this satisfies structurally)."""

    envelope: TaskEnvelope
    node_id: str
    # The daemon's store thread (state/aio.py): handlers ``await ctx.store.journal(...)``, never block the loop.
    # A plain StateStore or its blocking view (tests) is wrapped into its StoreThread.
    store: StoreThread
    resumed_steps: list[str]
    _nc: Client
    # What the task did to slots; reported with the result whether it succeeded or not
    # (a provision that failed after writing the disk reports its slot cleanup_blocked).
    slot_outcomes: list[SlotOutcome] = field(default_factory=list)
    # Called by the step pipeline per finished step (task type, step, status, duration_s, output): metrics.
    step_observer: Callable[[str, str, str, float, dict[str, Any]], None] | None = None
    # Set when the agent is stopping (SIGTERM): a pipeline cancelled then leaves its step journaled for the
    # next agent instead of compensating it (tasks/pipeline.py).
    agent_stopping: asyncio.Event | None = None

    def __post_init__(self) -> None:
        self.store = as_store_thread(self.store)

    @property
    def nc(self) -> Client:
        """The NATS connection, for work that outlives the task (a terminal session's subjects)."""
        return self._nc

    async def progress(self, step: str, status: str, *, percent: float | None = None,
                       detail: dict[str, Any] | None = None) -> None:
        """Publish a step event on ``gpuaas.node.<node>.progress`` (core NATS, fire and forget)."""
        # status: a str here (the pipeline passes StepStatus values); the model refuses one outside its Literal.
        event = ProgressEvent(task_id=self.envelope.task_id, node_id=self.node_id, step=step,
                              status=status,  # type: ignore[arg-type]
                              percent=percent, detail=detail or {}, at=datetime.now(UTC))
        try:
            await self._nc.publish(subjects.progress(self.node_id), event.model_dump_json().encode())
        except nats.errors.Error as exc:  # progress is advisory: losing one must not fail the task
            _warn("progress_publish_failed", task_id=self.envelope.task_id, error=repr(exc))

def _not_implemented(task_type: TaskType) -> AgentError:
    return AgentError(f"{task_type.value} is not implemented by this agent yet", code="not_implemented",
                      evidence={"type": task_type.value})



class TaskPolicy:
    """The gates and what they call (result, publish, ack, recover, poison), for one worker.

    ``handlers``: every served type's handler; ``recoveries``: the recovery of each type whose registry row
    declares one (``tasks/registry.build_tasks``). A recovery for a type with no handler is a wiring bug and
    refused here (``ValueError``), not found missing when a crashed task needs it. ``observer``: the daemon's
    metrics (``task_finished`` per stored result, ``step_finished`` per pipeline step).
    ``stopping``: the worker's stop event (a handler cancelled once it is set hands its task back).
    """

    def __init__(self, *, nc: Client, js: JetStreamContext, state: StoreThread, node_id: str,
                 handlers: Mapping[TaskType, Handler], recoveries: Mapping[TaskType, Handler],
                 settings: WorkerSettings, observer: TaskObserver | None, stopping: asyncio.Event) -> None:
        orphans = sorted(t.value for t in recoveries if t not in handlers)
        if orphans:
            raise ValueError(f"recoveries for task types this worker has no handler for: {orphans}")
        self.nc, self.js, self.state, self.node_id = nc, js, state, node_id
        self.handlers: dict[TaskType, Handler] = dict(handlers)
        self.recoveries: dict[TaskType, Handler] = dict(recoveries)
        self.settings = settings
        self.observer = observer
        self.step_observer: Callable[[str, str, str, float, dict[str, Any]], None] | None = \
            observer.step_finished if observer is not None else None
        self.stopping = stopping
        self.semaphores = {t: asyncio.Semaphore(settings.concurrency.get(t, 1)) for t in TaskType}
        self.received: dict[str, float] = {}  # task id -> loop time its processing began (the result's duration)
        self.inflight: dict[str, asyncio.Future[None]] = {}  # task id -> done when its processing ends

    async def turn_away(self, msg: Msg, refusal: Refusal) -> None:
        """A task that may not start now: over its allocation's bound it is answered ``tenant_busy`` (retryable)
        and acked, so a tenant's flood waits nowhere, not even in JetStream's ack-pending window, which every
        tenant of the node shares; a full class or type hands it back with a short delay (those are bounded by
        the node's slots). Nothing is journaled or stored: it did not run."""
        if refusal.reason != "allocation_full":
            try:
                delivered = max(1, int(msg.metadata.num_delivered))
            except Exception:  # not a JetStream delivery (tests): the base delay
                delivered = 1
            delay = self.settings.handback_delay_s * 2 ** min(delivered - 1, 3)
            _event("task_handed_back", subject=msg.subject, reason=refusal.reason, delay_s=delay)
            with contextlib.suppress(nats.errors.Error, OSError):
                await msg.nak(delay=delay)
            return
        try:
            envelope = parse_task(msg.data)
            self._check_route(msg.subject, envelope)
        except ContractError:
            await self.process(msg)  # junk is rejected there (terminated, never answered)
            return
        if await self.state.run(lambda store: store.result_of(envelope.task_id)) is not None:
            await self.process(msg)  # a redelivery of a task that ran: its stored result is replayed, never "busy"
            return
        _warn("task_tenant_busy", task_id=envelope.task_id, type=envelope.type,
              bound=self.settings.interactive_per_allocation)
        error = TaskErrorBody(
            code="tenant_busy", retryable=True,
            message=f"this allocation already has {self.settings.interactive_per_allocation} interactive tasks in "
                    "flight on this node: not started, send it again later",
            evidence={"bound": self.settings.interactive_per_allocation, "type": envelope.type})
        result = TaskResult(task_id=envelope.task_id, node_id=self.node_id, type=envelope.type,
                            attempt=envelope.attempt, status=ResultStatus.failed, error=error,
                            finished_at=datetime.now(UTC))
        # Not stored: a later delivery of the same task must run it, and its real result is published under
        # the task's own message id, which this answer must not take.
        await self._publish_and_ack(msg, result, msg_id=f"{envelope.task_id}-{envelope.attempt}-busy-"
                                                        f"{uuid.uuid4().hex[:12]}")

    async def process(self, msg: Msg) -> None:
        """One admitted message: route checked, then through :data:`TASK_GATES` (a redelivery of a task running
        here waits for that run and is answered from the store)."""
        try:
            envelope = parse_task(msg.data)
            self._check_route(msg.subject, envelope)
        except ContractError as exc:
            # Terminated, never answered: see the module docstring (1.) for why no result is published.
            _warn("task_rejected", code=exc.code, subject=msg.subject, task_id=exc.evidence.get("task_id"),
                  evidence=exc.evidence)
            with contextlib.suppress(nats.errors.Error, OSError):
                await msg.term()
            return

        task_id = envelope.task_id
        running = self.inflight.get(task_id)
        if running is not None:
            # Redelivered while still running here: wait for that run, then answer from the store.
            _event("task_redelivered_while_running", task_id=task_id)
            await self._keepalive_while(msg, asyncio.shield(running))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.inflight[task_id] = done
        self.received[task_id] = asyncio.get_running_loop().time()
        try:
            await self._process_envelope(msg, envelope)
        except Exception:  # e.g. the store refused (result_conflict): leave it unacked, JetStream redelivers
            log_event(log, "task_processing_error", logging.ERROR, task_id=task_id, exc_info=True)
        finally:
            self.inflight.pop(task_id, None)
            self.received.pop(task_id, None)
            done.set_result(None)

    def _check_route(self, subject: str, envelope: TaskEnvelope) -> None:
        """The envelope must be ours and must have come on our subject for its own type."""
        if envelope.node_id != self.node_id:
            raise ContractError(f"task {envelope.task_id} names node {envelope.node_id}, this is {self.node_id}",
                                code="wrong_node", evidence={"task_id": envelope.task_id, "node_id": envelope.node_id,
                                                             "subject": subject})
        expected = subjects.task(self.node_id, envelope.type)
        if subject != expected:
            raise ContractError(f"task {envelope.task_id} of type {envelope.type} arrived on {subject}",
                                code="wrong_subject", evidence={"task_id": envelope.task_id, "subject": subject,
                                                                "expected": expected})

    def _retry_delay(self, starts: int) -> float:
        backoff: float = self.settings.retry_backoff_s * 2 ** max(starts - 1, 0)  # int ** int is Any to mypy
        return min(self.settings.ack_wait_s, backoff)

    async def _poison(self, msg: Msg, envelope: TaskEnvelope, starts: int, last_error: TaskErrorBody | None) -> None:
        last = f"{last_error.message}" if last_error is not None else "the agent stopped while it ran"
        _warn("task_poisoned", task_id=envelope.task_id, starts=starts, last_error=last)
        evidence = {"starts": starts, "max_task_starts": self.settings.max_task_starts,
                    "last_error": last_error.model_dump() if last_error is not None else None}
        outcomes: list[SlotOutcome] = []
        interrupted = await self.state.unfinished_steps(envelope.task_id)
        if interrupted:
            recovery, outcomes = await self._recover(msg, envelope, interrupted)
            if recovery is not None:
                evidence.update(unfinished_steps=interrupted, recovery=recovery)
        error = TaskErrorBody(
            code="poison_task", retryable=False,
            message=f"handler started {starts} times without finishing (bound {self.settings.max_task_starts}); "
                    f"last: {last}",
            evidence=evidence)
        await self._finish(msg, envelope, ResultStatus.failed, error=error, slot_outcomes=outcomes)

    async def _recover(self, msg: Msg, envelope: TaskEnvelope,
                       interrupted: list[str]) -> tuple[dict[str, Any] | None, list[SlotOutcome]]:
        """Run the declared recovery of a task interrupted mid-run that will not run again.

        Returns (its evidence, the slot outcomes it reported); (None, []) when the type's row declares none.
        A failing hook is reported in the evidence, never raised: the task must still get its answer.
        Its starts are journaled and bounded like the handler's: a hook that kills the agent every
        time is not run again after ``max_task_starts`` (no crash loop on recovery either).
        """
        try:
            task_type, payload = task_payload(envelope)
        except ContractError:
            return None, []
        recover = self.recoveries.get(task_type)
        if recover is None:
            return None, []
        tries = sum(1 for e in await self.state.journal_of(envelope.task_id)
                    if e.step == RECOVER_STEP and e.status == StepStatus.started)
        if tries >= self.settings.max_task_starts:
            return {"ok": False, "code": "recovery_poison", "message": f"recovery started {tries} times without "
                    "finishing: not run again; the slot is left to reconcile and a release"}, []
        ctx = TaskRun(envelope=envelope, node_id=self.node_id, store=self.state,
                      resumed_steps=[s for s in interrupted if s != RECOVER_STEP],
                      _nc=self.nc, agent_stopping=self.stopping)
        _warn("task_recovering", task_id=envelope.task_id, unfinished_steps=interrupted)
        await self.state.journal(envelope.task_id, RECOVER_STEP, StepStatus.started)

        async def guarded() -> dict[str, Any]:
            async with self.semaphores[task_type], compat.timeout(self.settings.recovery_timeout_s):
                return await recover(payload, ctx)

        try:
            evidence = await self._keepalive_while(msg, guarded())
        except AgentError as exc:
            evidence = {"ok": False, "code": exc.code, "message": exc.message, "evidence": exc.evidence}
        except Exception as exc:
            log.exception(json.dumps({"event": "task_recovery_crashed", "task_id": envelope.task_id}))
            evidence = {"ok": False, "code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
        await self.state.journal(envelope.task_id, RECOVER_STEP, StepStatus.succeeded)
        return evidence, list(ctx.slot_outcomes)

    async def _process_envelope(self, msg: Msg, envelope: TaskEnvelope) -> None:
        """Put a routed task through :data:`TASK_GATES` in order; the first gate that settles it ends the walk."""
        stored, history = await self.state.run(task_history, envelope.task_id)  # one store-thread hop per claim
        claim = Claim(msg=msg, envelope=envelope, stored=stored, history=history,
                      deadline=envelope.deadline if envelope.deadline.tzinfo else envelope.deadline.replace(tzinfo=UTC))
        for name, gate in TASK_GATES:
            if await gate(self, claim):
                claim.settled_by = name
                return

    # -- the gates, in TASK_GATES order: each returns True once the task is settled (answered, handed back) --

    async def _gate_replay(self, claim: Claim) -> bool:
        """A stored result is the answer: published again (same message id) and acked; nothing runs."""
        if claim.stored is None:
            return False
        _event("task_result_replayed", task_id=claim.envelope.task_id)
        await self._publish_and_ack(claim.msg, TaskResult.from_wire(claim.stored))
        return True

    async def _gate_expired(self, claim: Claim) -> bool:
        """The deadline passed: ``expired``, after the declared recovery of a run interrupted mid-way."""
        envelope, deadline = claim.envelope, claim.deadline
        if datetime.now(UTC) < deadline:
            return False
        evidence: dict[str, Any] = {"deadline": deadline.isoformat()}
        outcomes: list[SlotOutcome] = []
        try:
            interrupted = await self.state.unfinished_steps(envelope.task_id)
        except StateError as exc:  # journal_unreadable: still expired; the result names the journal's problem
            interrupted, evidence["journal_error"] = [], _error_body(exc, retryable=False).model_dump()
        if interrupted:
            # Interrupted mid-run (the agent was killed or stopped under it) and not to run again: the
            # handler's recovery undoes what the interrupted run left (compensation only), then expired.
            evidence["unfinished_steps"] = interrupted
            _warn("expired_task_interrupted", task_id=envelope.task_id, unfinished_steps=interrupted)
            recovery, outcomes = await self._recover(claim.msg, envelope, interrupted)
            if recovery is not None:
                evidence["recovery"] = recovery
        error = TaskErrorBody(code="expired", message=f"deadline {deadline.isoformat()} passed before the task ran",
                              retryable=False, evidence=evidence)
        await self._finish(claim.msg, envelope, ResultStatus.failed, error=error, slot_outcomes=outcomes)
        return True

    async def _gate_horizon(self, claim: Claim) -> bool:
        """A deadline further ahead than ``max_task_deadline_s``: ``invalid_deadline``."""
        horizon, deadline = self.settings.max_task_deadline_s, claim.deadline
        if (deadline - datetime.now(UTC)).total_seconds() <= horizon:
            return False
        error = TaskErrorBody(code="invalid_deadline", retryable=False,
                              message=f"deadline {deadline.isoformat()} is more than {horizon:g}s ahead",
                              evidence={"deadline": deadline.isoformat(), "max_task_deadline_s": horizon})
        await self._finish(claim.msg, claim.envelope, ResultStatus.failed, error=error)
        return True

    async def _gate_payload(self, claim: Claim) -> bool:
        """The payload must parse for its type (``unsupported_task``, ``invalid_payload``)."""
        try:
            claim.task_type, claim.payload = task_payload(claim.envelope)
        except ContractError as exc:
            await self._finish(claim.msg, claim.envelope, ResultStatus.failed, error=_error_body(exc, retryable=False))
            return True
        return False

    async def _gate_handler(self, claim: Claim) -> bool:
        """This agent must have a handler for the type (``not_implemented``)."""
        assert claim.task_type is not None  # set by the payload gate
        claim.handler = self.handlers.get(claim.task_type)
        if claim.handler is not None:
            return False
        await self._finish(claim.msg, claim.envelope, ResultStatus.failed,
                           error=_error_body(_not_implemented(claim.task_type), retryable=False))
        return True

    async def _gate_journal(self, claim: Claim) -> bool:
        """The task's journal must be readable: else the handler cannot know what was done (``journal_unreadable``)."""
        if not isinstance(claim.history, StateError):
            claim.starts, claim.resumed = claim.history
            return False
        # journal_unreadable (a row an older version wrote): the handler does not run; the answer names the
        # row. A redelivery answers the same from the stored result.
        exc = claim.history
        _warn("task_journal_unreadable", task_id=claim.envelope.task_id, code=exc.code, evidence=exc.evidence)
        await self._finish(claim.msg, claim.envelope, ResultStatus.failed, error=_error_body(exc, retryable=False))
        return True

    async def _gate_poison(self, claim: Claim) -> bool:
        """``max_task_starts`` starts without a finish: ``poison_task``, not run again (its recovery runs)."""
        if claim.starts < self.settings.max_task_starts:
            return False
        await self._poison(claim.msg, claim.envelope, claim.starts, None)
        return True

    async def _gate_run(self, claim: Claim) -> bool:
        """Run the handler under keepalives. A stop cancelling it hands the task back (settled, no answer)."""
        envelope, msg = claim.envelope, claim.msg
        assert claim.task_type is not None and claim.handler is not None and claim.payload is not None
        if claim.resumed:
            _event("task_resumed", task_id=envelope.task_id, unfinished_steps=claim.resumed)
        ctx = claim.ctx = TaskRun(envelope=envelope, node_id=self.node_id, store=self.state,
                                  resumed_steps=claim.resumed, _nc=self.nc, step_observer=self.step_observer,
                                  agent_stopping=self.stopping)
        run = asyncio.ensure_future(self._run_handler(claim.task_type, claim.handler, claim.payload, ctx))
        try:
            claim.status, claim.output, claim.error = await self._keepalive_while(msg, run)
        except asyncio.CancelledError:
            run.cancel()
            # Let the handler see its cancellation through (a clone kills qemu-img) before the agent exits.
            await asyncio.wait({run}, timeout=self.settings.cancel_settle_s)
            if self.stopping.is_set() and run.done():
                # A stop (a package upgrade): hand the task back now, journaled where it stopped, so the next
                # agent resumes it at its first pull rather than ack_wait_s later. Journaled
                # first: this start was no crash and does not count toward the poison bound.
                with contextlib.suppress(StateError, OSError):
                    await self.state.journal(envelope.task_id, STOPPED_STEP, StepStatus.succeeded,
                                             {"reason": "agent_stopping"})
                with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
                    await asyncio.wait_for(msg.nak(), self.settings.request_timeout_s)
                _warn("task_handed_back_at_stop", task_id=envelope.task_id)
            raise
        return False

    async def _gate_crash(self, claim: Claim) -> bool:
        """A crash is not an answer: nak'ed with a delay to run again, or ``poison_task`` at the bound."""
        if not is_handler_crash(claim.error):
            return False
        claim.starts += 1
        if claim.starts >= self.settings.max_task_starts:
            await self._poison(claim.msg, claim.envelope, claim.starts, claim.error)
            return True
        delay = self._retry_delay(claim.starts)
        _warn("task_crash_retry", task_id=claim.envelope.task_id, starts=claim.starts, retry_in_s=delay)
        try:
            await claim.msg.nak(delay=delay)
        except (nats.errors.Error, OSError) as exc:  # not nak'ed: ack_wait redelivers it all the same
            _warn("task_nak_failed", task_id=claim.envelope.task_id, error=repr(exc))
        return True

    async def _gate_answer(self, claim: Claim) -> bool:
        """Store the result, publish it (PubAck), then ack the task."""
        assert claim.status is not None and claim.ctx is not None  # set by the run gate
        await self._finish(claim.msg, claim.envelope, claim.status, output=claim.output, error=claim.error,
                           slot_outcomes=claim.ctx.slot_outcomes)
        return True

    async def _run_handler(self, task_type: TaskType, handler: Handler, payload: WireModel,
                           ctx: TaskRun) -> tuple[ResultStatus, dict[str, Any], TaskErrorBody | None]:
        task_id = ctx.envelope.task_id
        async with self.semaphores[task_type]:
            await self.state.journal(task_id, TASK_STEP, StepStatus.started,
                               {"type": task_type.value, "attempt": ctx.envelope.attempt})
            _event("task_started", task_id=task_id, type=task_type.value, attempt=ctx.envelope.attempt)
            try:
                async with compat.timeout(_seconds_left(ctx.envelope)):
                    output = await handler(payload, ctx)
            except TimeoutError:
                # The deadline passed and the handler let the cancellation through (nothing to undo).
                await self.state.journal(task_id, TASK_STEP, StepStatus.failed, {"code": "deadline_exceeded"})
                _warn("task_cancelled", task_id=task_id, code="deadline_exceeded")
                return ResultStatus.cancelled, {}, TaskErrorBody(
                    code="deadline_exceeded", message="the task's deadline passed while it ran", retryable=False,
                    evidence={"deadline": ctx.envelope.deadline.isoformat()})
            except (AgentError, ValidationError) as exc:
                if isinstance(exc, ValidationError):  # a model refused a value built from the task: a refusal
                    exc = invalid_payload(task_type.value, exc)
                # A pipeline that was cancelled (deadline) has compensated and says so: the task is cancelled.
                status = ResultStatus.cancelled if getattr(exc, "cancelled", False) else ResultStatus.failed
                await self.state.journal(task_id, TASK_STEP, StepStatus.failed, {"code": exc.code})
                _warn("task_failed" if status is ResultStatus.failed else "task_cancelled", task_id=task_id,
                      code=exc.code, message=exc.message)
                return status, {}, _error_body(exc, retryable=bool(getattr(exc, "retryable", False)))
            except Exception as exc:  # a bug, not a refusal: report it with a code, keep the agent alive
                log.exception(json.dumps({"event": "task_crashed", "task_id": task_id}))
                await self.state.journal(task_id, TASK_STEP, StepStatus.failed, {"code": "internal_error"})
                return ResultStatus.failed, {}, TaskErrorBody(
                    code="internal_error", message=f"{type(exc).__name__}: {exc}", retryable=True,
                    evidence={"exception": type(exc).__name__})
            await self.state.journal(task_id, TASK_STEP, StepStatus.succeeded)
            _event("task_succeeded", task_id=task_id, type=task_type.value)
            return ResultStatus.succeeded, dict(output), None

    async def _keepalive_while(self, msg: Msg, work: Awaitable[T]) -> T:
        """Await ``work``, sending ``in_progress`` every keepalive interval so JetStream does not redeliver."""
        work = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({work}, timeout=self.settings.keepalive_interval_s)
            if done:
                return work.result()
            try:
                await msg.in_progress()
            except nats.errors.Error as exc:  # disconnected: the reconnect re-sends nothing, the next tick will
                _warn("keepalive_failed", subject=msg.subject, error=repr(exc))

    async def _finish(self, msg: Msg, envelope: TaskEnvelope, status: ResultStatus, *,
                      output: dict[str, Any] | None = None, error: TaskErrorBody | None = None,
                      slot_outcomes: list[SlotOutcome] | None = None) -> None:
        result = TaskResult(task_id=envelope.task_id, node_id=self.node_id, type=envelope.type,
                            attempt=envelope.attempt, status=status, output=output or {}, error=error,
                            slot_outcomes=slot_outcomes or [], finished_at=datetime.now(UTC))
        stored = await self.state.store_result(envelope.task_id, result.model_dump(mode="json"))
        if self.observer is not None:
            received = self.received.get(envelope.task_id)
            self.observer.task_finished(envelope.type, status.value,
                                        None if received is None else asyncio.get_running_loop().time() - received)
        await self._publish_and_ack(msg, TaskResult.from_wire(stored))

    async def _publish_and_ack(self, msg: Msg, result: TaskResult, *, msg_id: str | None = None) -> None:
        """PubAck first, then ack; a failure leaves the task unacked so redelivery replays the stored result."""
        subject = subjects.result(self.node_id)
        msg_id = msg_id or f"{result.task_id}-{result.attempt}"
        headers = {"Nats-Msg-Id": msg_id}
        # A result the server's max_payload cannot carry would fail every retry and the task be redelivered
        # without end: answered ``result_too_large`` instead, then acked (control/resultfit.py).
        sent, data = fit_result(result, headers, self.nc.max_payload)
        if sent is not result and sent.error is not None:
            _warn("result_too_large", task_id=result.task_id, type=result.type, **sent.error.evidence)
        result = sent
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.settings.publish_deadline_s
        backoff = 0.2
        while True:
            try:
                ack = await self.js.publish(subject, data, timeout=self.settings.request_timeout_s,
                                            stream=self.settings.result_stream, headers=headers)
                break
            except (nats.errors.Error, TimeoutError) as exc:
                if loop.time() + backoff >= give_up_at:
                    _warn("result_publish_gave_up", task_id=result.task_id, error=repr(exc))
                    return
                _warn("result_publish_retry", task_id=result.task_id, error=repr(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)  # backoff between retries, not synchronisation
                backoff = min(backoff * 2, 5.0)
        _event("result_published", task_id=result.task_id, status=result.status.value, stream=ack.stream, seq=ack.seq,
               duplicate=bool(ack.duplicate))
        try:
            await msg.ack_sync(timeout=self.settings.request_timeout_s)
        except (nats.errors.Error, TimeoutError) as exc:
            # The result is stored and published: a redelivery will only replay it.
            _warn("task_ack_failed", task_id=result.task_id, error=repr(exc))


@dataclass
class Claim:
    """One routed task on its way through the gates: what they read, and what each learns for the next."""

    msg: Msg
    envelope: TaskEnvelope
    stored: dict[str, Any] | None  # the stored result, if the task already ran
    history: tuple[int, list[str]] | StateError  # (handler starts, unfinished steps), or the journal's error
    deadline: datetime  # aware (a naive deadline is UTC)
    task_type: TaskType | None = None  # the payload gate's
    payload: WireModel | None = None
    handler: Handler | None = None  # the handler gate's
    starts: int = 0  # the journal gate's; the crash gate counts the run that crashed
    resumed: list[str] = field(default_factory=list)
    ctx: TaskRun | None = None  # the run gate's
    status: ResultStatus | None = None
    output: dict[str, Any] = field(default_factory=dict)
    error: TaskErrorBody | None = None
    settled_by: str | None = None  # the gate that settled it


Gate = Callable[[TaskPolicy, Claim], Awaitable[bool]]

# The task policy, in order (the module docstring's steps 2 to 8): the first gate returning True settled the
# task; the ones after it never see it. Route checks and admission come before (``_process``, ``run``).
TASK_GATES: tuple[tuple[str, Gate], ...] = (
    ("replay", TaskPolicy._gate_replay),      # a stored result is the answer
    ("expired", TaskPolicy._gate_expired),    # deadline passed (declared recovery first when interrupted)
    ("horizon", TaskPolicy._gate_horizon),    # deadline too far ahead
    ("payload", TaskPolicy._gate_payload),    # unsupported type, invalid payload
    ("handler", TaskPolicy._gate_handler),    # not implemented here
    ("journal", TaskPolicy._gate_journal),    # journal unreadable
    ("poison", TaskPolicy._gate_poison),      # started too often without finishing
    ("run", TaskPolicy._gate_run),            # the handler, under keepalives; a stop hands it back
    ("crash", TaskPolicy._gate_crash),        # a crash: nak to run again, or poison at the bound
    ("answer", TaskPolicy._gate_answer),      # store, publish, ack
)


def task_history(store: StateStore, task_id: str) -> tuple[dict[str, Any] | None, tuple[int, list[str]] | StateError]:
    """The stored result of ``task_id``, else its journaled handler starts and unfinished steps (or the
    StateError reading the journal raised), read in one go on the store thread: every claim needs them, and
    each separate hop costs the event loop a thread round trip (bench_fleet: 5 hops per claim were ~30% of
    the simulated nodes' loop CPU in a 5,000-node burst)."""
    stored = store.result_of(task_id)
    if stored is not None:
        return stored, (0, [])
    try:
        return None, (handler_starts(store.journal_of(task_id)), store.unfinished_steps(task_id))
    except StateError as exc:  # journal_unreadable: answered by the journal gate, after the deadline checks
        return None, exc


def handler_starts(entries: list[JournalEntry]) -> int:
    """How many times a handler was started and neither finished nor was handed back at a stop.

    Journaled before it runs, so a kill -9 counts toward the poison bound; a clean stop's hand-back
    (``STOPPED_STEP``: an upgrade, a rollback, a restart during a long clone) does not.
    """
    started = sum(1 for e in entries if e.step == TASK_STEP and e.status == StepStatus.started)
    handed_back = sum(1 for e in entries if e.step == STOPPED_STEP and e.status == StepStatus.succeeded)
    return max(started - handed_back, 0)


def is_handler_crash(error: TaskErrorBody | None) -> bool:
    """An exception escaped the handler (``_run_handler``'s last resort), as opposed to an answer with a code.

    A pipeline that caught a bug in a step, compensated and reported ``internal_error`` with its
    ``failed_step`` has answered: running a provision again for a deterministic bug would redo
    its side effects for nothing, so only the bare crash (evidence ``exception``) is retried.
    """
    return error is not None and error.code == CRASH_CODE and "exception" in error.evidence \
        and "failed_step" not in error.evidence


def _seconds_left(envelope: TaskEnvelope) -> float:
    """Seconds until the task's deadline (a naive deadline is UTC); the handler is cancelled then."""
    deadline = envelope.deadline if envelope.deadline.tzinfo else envelope.deadline.replace(tzinfo=UTC)
    return max(0.0, (deadline - datetime.now(UTC)).total_seconds())


def _error_body(exc: AgentError, *, retryable: bool) -> TaskErrorBody:
    return TaskErrorBody(code=exc.code, message=exc.message, retryable=retryable, evidence=exc.evidence)
