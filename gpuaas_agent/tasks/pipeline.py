"""A journaled step pipeline with a compensation for every step (DESIGN.md §2, STYLE rule 6).

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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import invalid_payload
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

StepFn = Callable[[], Awaitable[dict[str, Any] | None]]

# Driver codes that mean "this step was cancelled" (they turn CancelledError into a typed
# error so that the caller learns e.g. that the disk is dirty): the task is cancelled, not failed.
CANCELLED_CODES = frozenset({"clone_cancelled", "wipe_cancelled", "cancelled"})


class PipelineContext(Protocol):
    """What the pipeline needs from the worker's TaskContext: a journal and progress events."""

    store: Any
    envelope: Any

    async def progress(self, step: str, status: str, *, percent: float | None = None,
                       detail: dict | None = None) -> None: ...


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
        except Exception:  # noqa: BLE001 - observing must never change what the task does
            log.exception("step observer failed")
    return duration


@dataclass(frozen=True)
class Step:
    name: str
    run: StepFn
    compensate: StepFn | None = None  # None: nothing to undo (pure checks, reads, the shared image cache)
    touches_disk: bool = False  # once started, the slot disk may be dirty: no compensation can make it clean


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


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError) or (isinstance(exc, AgentError) and exc.code in CANCELLED_CODES)


async def _journal(ctx: PipelineContext, step: str, status: StepStatus, detail: dict[str, Any] | None = None) -> None:
    ctx.store.journal(ctx.envelope.task_id, step, status, detail or {})
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
            ctx.store.journal(ctx.envelope.task_id, step.name, StepStatus.failed, {"compensation": code})
            continue
        detail = {**detail, "duration_s": round(time.monotonic() - started, 3)}
        records.append(CompensationRecord(step.name, True, detail))
        await _journal(ctx, step.name, StepStatus.compensated, detail)
    return records


async def run_pipeline(ctx: PipelineContext, steps: list[Step]) -> dict[str, dict[str, Any]]:
    """Run ``steps`` in order; return each step's output by name, or raise :class:`PipelineFailed`."""
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
            output = await step.run() or {}
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, ValidationError):  # a model refused a value from the task: a refusal, not a bug
                exc = invalid_payload(f"step {step.name}", exc)
            cancelled = _is_cancel(exc)
            code = exc.code if isinstance(exc, AgentError) else ("cancelled" if cancelled else "internal_error")
            ctx.store.journal(ctx.envelope.task_id, step.name, StepStatus.failed, {"code": code})
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
