"""A journaled step pipeline with a compensation for every step (docs/architecture.md).

Each step is journaled ``started`` before it runs and ``succeeded``/``failed``
after, and announced as a progress event, so an operator (and a restarted
agent) can see exactly where a provision stopped. When a step fails or the
task is cancelled, the compensations of the completed steps *and of the failed
step itself* run in reverse order: a step's compensation undoes whatever part
of it happened, so it must be idempotent ("remove the port if it is there").

What cannot be undone is named, not hidden: a step marked ``touches_disk``
makes the failure report ``disk_touched=True`` from the moment it *starts*
(a clone interrupted at 3 % has still overwritten the partition table), and the
caller turns that into ``cleanup_blocked``. Compensation failures never mask
the original error; they are collected into its evidence so reconcile and the
operator know what was left behind.

Observation: one log line per step start and end (with its duration), and, when the
context carries a ``step_observer`` (the worker's, wired to the daemon's metrics),
a call ``observer(task_type, step, status, duration_s, output)`` per finished step.
The pipeline knows nothing of what observes it.

Declared pipelines (:class:`StepDef`): a task module declares its steps once, at module
level, as named functions with typed inputs and outputs (``PROVISION_STEPS``), so the
journal, the docs and a crash harness can enumerate them. :func:`bind_steps` turns such a
declaration into today's :class:`Step` objects for one run: each step gets the run's
read-only context plus the typed outputs of the steps it ``takes``; each compensation gets
the context and an :class:`Undo` view (the outputs so far, ``disk_touched``). The runner
below is unchanged by it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import TaskEnvelope, invalid_payload
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.tasks.context import AnyStore
from gpuaas_agent.tasks.crashpoint import crash_point

log = logging.getLogger(__name__)

StepFn = Callable[[], Awaitable[dict[str, Any] | None]]

# Driver codes that mean "this step was cancelled" (they turn CancelledError into a typed
# error so that the caller learns e.g. that the disk is dirty): the task is cancelled, not failed.
CANCELLED_CODES = frozenset({"clone_cancelled", "wipe_cancelled", "cancelled"})


class PipelineContext(Protocol):
    """What the pipeline needs from the worker's TaskContext: a journal and progress events.

    ``store``: the daemon's StoreThread (or a plain StateStore, wrapped into one): every journal
    write is awaited on the store thread, never run on the loop (a commit's fsync would stall every task).
    """

    @property
    def store(self) -> AnyStore: ...

    @property
    def envelope(self) -> TaskEnvelope: ...

    async def progress(self, step: str, status: str, *, percent: float | None = None,
                       detail: dict[str, Any] | None = None) -> None: ...


StepObserver = Callable[[str, str, str, float, dict[str, Any]], None]


def _observe(ctx: PipelineContext, step: str, status: str, started: float, output: dict[str, Any],
             *, log_it: bool = True) -> float:
    """Log the step's end with its duration and tell the context's observer (if any); returns the duration."""
    duration = round(time.monotonic() - started, 3)
    task_type = getattr(ctx.envelope, "type", None)
    if log_it:
        log_event(log, f"step_{status}", task_id=ctx.envelope.task_id, type=task_type, step=step, duration_s=duration)
    observer: StepObserver | None = getattr(ctx, "step_observer", None)
    if observer is not None:
        try:
            observer(str(task_type), step, status, duration, output)
        except Exception:
            log.exception("step observer failed")
    return duration


@dataclass(frozen=True)
class Step:
    name: str
    run: StepFn
    compensate: StepFn | None = None  # None: nothing to undo (pure checks, reads, the shared image cache)
    touches_disk: bool = False  # once started, the slot disk may be dirty: no compensation can make it clean


C = TypeVar("C")  # the run's read-only context (e.g. provision's ProvisionRun)


@dataclass(frozen=True)
class Undo:
    """What a compensation may read: the typed outputs of the steps that finished, and whether the disk
    may be dirty (a ``touches_disk`` step has *started*). A step that failed or never ran has no output."""

    outputs: Mapping[str, Any]
    disk_touched: bool
    # Steps that started (finished or not): a multi-slot provision's data disks are touched from "start" on.
    started: frozenset[str] = frozenset()

    def output(self, name: str) -> Any | None:
        return self.outputs.get(name)


@dataclass(frozen=True)
class StepDef(Generic[C]):
    """One declared step: ``run(context, *outputs_of(takes))`` returns its typed output;
    ``compensate(context, undo)`` undoes whatever part of it happened (idempotent).

    A step without a compensation names why in ``no_compensation`` (a check, a read, a
    state that is the host's steady state, or a write only a release can undo).
    """

    name: str
    run: Callable[..., Awaitable[Any]]
    compensate: Callable[[C, Undo], Awaitable[dict[str, Any] | None]] | None = None
    takes: tuple[str, ...] = ()
    touches_disk: bool = False
    no_compensation: str | None = None


def journal_detail(output: Any) -> dict[str, Any]:
    """A step's output as the JSON its journal entry and progress event carry."""
    if output is None:
        return {}
    if hasattr(output, "journal"):
        detail: dict[str, Any] = output.journal()
        return detail
    if isinstance(output, BaseModel):
        return output.model_dump(mode="json")
    return dict(output)


def bind_steps(defs: tuple[StepDef[C], ...] | list[StepDef[C]], context: C,
               outputs: dict[str, Any] | None = None) -> list[Step]:
    """Today's :class:`Step` objects for one run of ``defs``; the typed outputs stay in this binding
    (or in ``outputs``, when the caller passes a dict to read them from after the run).

    A step may only take outputs of steps declared before it (checked here, so a bad
    declaration fails at bind time, before anything runs).
    """
    outputs = {} if outputs is None else outputs
    started: set[str] = set()
    names = [d.name for d in defs]
    for index, d in enumerate(defs):
        unknown = [t for t in d.takes if t not in names[:index]]
        if unknown:
            raise ValueError(f"step {d.name} takes {unknown}, not outputs of earlier steps")
    touching = {d.name for d in defs if d.touches_disk}

    def undo_view() -> Undo:
        return Undo(outputs=dict(outputs), disk_touched=bool(started & touching), started=frozenset(started))

    def bound(d: StepDef[C]) -> Step:
        async def run() -> dict[str, Any]:
            started.add(d.name)
            output = await d.run(context, *(outputs[t] for t in d.takes))
            outputs[d.name] = output
            return journal_detail(output)

        compensate = None
        if d.compensate is not None:
            undo_fn = d.compensate

            async def compensate() -> dict[str, Any] | None:
                return await undo_fn(context, undo_view())

        return Step(d.name, run, compensate, touches_disk=d.touches_disk)

    return [bound(d) for d in defs]


@dataclass(frozen=True)
class CompensationRecord:
    step: str
    ok: bool
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ok": self.ok, **self.detail}


class PipelineFailed(AgentError):
    """A step failed (or the task was cancelled); compensations have run.

    ``code``/``message`` are the failed step's own; ``evidence`` adds
    ``failed_step``, ``disk_touched``, ``compensations`` and ``steps_done``.
    """

    default_code = "pipeline_failed"

    def __init__(self, cause: BaseException, *, failed_step: str, disk_touched: bool, cancelled: bool,
                 compensations: list[CompensationRecord], steps_done: list[str]) -> None:
        if isinstance(cause, AgentError):
            code, message, evidence = cause.code, cause.message, dict(cause.evidence)
        elif isinstance(cause, asyncio.CancelledError):
            code, message, evidence = "cancelled", f"cancelled during step {failed_step}", {}
        else:  # a bug inside a step: keep the type so the operator can find it in the log
            code, message, evidence = "internal_error", f"{type(cause).__name__}: {cause}", {}
        super().__init__(message, code=code, evidence={
            **evidence,
            "failed_step": failed_step,
            "disk_touched": disk_touched,
            "steps_done": steps_done,
            "compensations": [c.as_dict() for c in compensations],
        })
        self.cause = cause
        self.failed_step = failed_step
        self.disk_touched = disk_touched
        self.cancelled = cancelled
        self.compensations = compensations
        self.retryable = bool(getattr(cause, "retryable", False))


def _agent_stopping(ctx: PipelineContext) -> bool:
    """Whether the agent is stopping (the worker's drain cancelled the task): see :func:`run_pipeline`."""
    stopping = getattr(ctx, "agent_stopping", None)
    return bool(stopping is not None and stopping.is_set())


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError) or (isinstance(exc, AgentError) and exc.code in CANCELLED_CODES)


async def _journal(ctx: PipelineContext, step: str, status: StepStatus, detail: dict[str, Any] | None = None) -> None:
    await as_store_thread(ctx.store).journal(ctx.envelope.task_id, step, status, detail or {})
    await ctx.progress(step, status.value, detail=detail or {})


async def _compensate(ctx: PipelineContext, steps: list[Step]) -> list[CompensationRecord]:
    """Run the compensations in reverse order; a failing one is recorded and the rest still run."""
    records = []
    for step in reversed(steps):
        if step.compensate is None:
            continue
        started = time.monotonic()
        try:
            detail = await step.compensate() or {}
        except asyncio.CancelledError:
            # A second cancellation while undoing: stop undoing, but say what is left.
            records.append(CompensationRecord(step.name, False, {"code": "cancelled"}))
            log_event(log, "compensation_cancelled", logging.WARNING, task_id=ctx.envelope.task_id, step=step.name)
            break
        except Exception as exc:
            code = exc.code if isinstance(exc, AgentError) else "internal_error"
            evidence = exc.evidence if isinstance(exc, AgentError) else {"exception": type(exc).__name__}
            records.append(CompensationRecord(step.name, False, {"code": code, "message": str(exc), "evidence": evidence}))
            log_event(log, "compensation_failed", logging.WARNING, task_id=ctx.envelope.task_id, step=step.name,
                      code=code, error=str(exc))
            await as_store_thread(ctx.store).journal(ctx.envelope.task_id, step.name, StepStatus.failed,
                                                     {"compensation": code})
            continue
        detail = {**detail, "duration_s": round(time.monotonic() - started, 3)}
        records.append(CompensationRecord(step.name, True, detail))
        await _journal(ctx, step.name, StepStatus.compensated, detail)
    return records


async def run_pipeline(ctx: PipelineContext, steps: list[Step]) -> dict[str, dict[str, Any]]:
    """Run ``steps`` in order; return each step's output by name, or raise :class:`PipelineFailed`.

    A cancellation while the agent is stopping (``ctx.agent_stopping`` set: the worker's drain
    at SIGTERM, e.g. a package upgrade) is not a failure: nothing is compensated, the step stays
    journaled ``started`` and :class:`asyncio.CancelledError` goes up, so no result is stored and
    the redelivered task is resumed or compensated by the next agent (an upgrade never
    loses a step). A
    ``GPUAAS_AGENT_CRASH_AT`` crash point (tests only, :mod:`~gpuaas_agent.tasks.crashpoint`)
    sits before and after each step's side effect.
    """
    outputs: dict[str, dict[str, Any]] = {}
    done: list[Step] = []
    disk_touched = False
    for step in steps:
        disk_touched = disk_touched or step.touches_disk
        await _journal(ctx, step.name, StepStatus.started)
        log_event(log, "step_started", task_id=ctx.envelope.task_id, type=getattr(ctx.envelope, "type", None),
                  step=step.name)
        started = time.monotonic()
        try:
            crash_point(ctx, step.name, "before")
            output = await step.run() or {}
            crash_point(ctx, step.name, "after")
        except (Exception, asyncio.CancelledError) as exc:
            if _is_cancel(exc) and _agent_stopping(ctx):
                # An upgrade or a stop, not a failure: leave the step journaled ``started`` and undo
                # nothing, exactly as a kill would; the next agent resumes or compensates it.
                log_event(log, "pipeline_interrupted_by_stop", logging.WARNING, task_id=ctx.envelope.task_id,
                          step=step.name, disk_touched=disk_touched)
                raise asyncio.CancelledError(f"agent stopping during step {step.name}") from exc
            if isinstance(exc, ValidationError):  # a model refused a value from the task: a refusal, not a bug
                exc = invalid_payload(f"step {step.name}", exc)
            cancelled = _is_cancel(exc)
            code = exc.code if isinstance(exc, AgentError) else ("cancelled" if cancelled else "internal_error")
            await as_store_thread(ctx.store).journal(ctx.envelope.task_id, step.name, StepStatus.failed, {"code": code})
            duration = _observe(ctx, step.name, StepStatus.failed.value, started, {"code": code}, log_it=False)
            if not isinstance(exc, asyncio.CancelledError):  # a cancelled task publishes nothing more
                await ctx.progress(step.name, StepStatus.failed.value, detail={"code": code})
            log_event(log, "pipeline_step_failed", logging.WARNING, task_id=ctx.envelope.task_id, step=step.name,
                      code=code, disk_touched=disk_touched, cancelled=cancelled, duration_s=duration)
            compensations = await _compensate(ctx, [*done, step])
            raise PipelineFailed(exc, failed_step=step.name, disk_touched=disk_touched, cancelled=cancelled,
                                 compensations=compensations, steps_done=[s.name for s in done]) from exc
        output = {**output, "duration_s": _observe(ctx, step.name, StepStatus.succeeded.value, started, output)}
        outputs[step.name] = output
        done.append(step)
        await _journal(ctx, step.name, StepStatus.succeeded, output)
    return outputs
