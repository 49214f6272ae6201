"""Test-only fault injection: SIGKILL the agent at one named point of a journaled pipeline.

The crash harness (``tests/e2e/test_crash_matrix.py``) kills a real agent at every step of
``PROVISION_STEPS`` and ``RELEASE_STEPS``, before and after the step's side effect, then
restarts it and checks what the restarted agent does with the half-done task
(``tests/crash/test_gpu_handover_crash.py`` does the same for the GPU handover's steps, named
``gpu_handover.<step>`` inside the release). The kill
must come from inside the step runner (a signal from outside cannot hit "after the side
effect, before the journal says so"), so the runner calls :func:`crash_point` at both
places.

Armed only by the environment variable ``GPUAAS_AGENT_CRASH_AT`` (never by the config
file, which production deploys write), with the value
``<task type>:<step>:<before|after>[:<task id>]``, e.g.
``slice.vm_provision:clone:after:7f0c...``:

* ``before``: the step is journaled ``started``; its side effect has not begun;
* ``after``: its side effect is done; the journal still says only ``started``.

With a task id only that task dies (the harness arms the next point while the restarted
agent recovers the previous one). Unset (always, in production: the systemd unit sets
no such variable), :func:`crash_point` is one dictionary lookup. The daemon logs
``crash_point_armed`` at WARNING when it starts with the variable set.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Protocol

from gpuaas_agent.contract.tasks import TaskEnvelope
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

ENV = "GPUAAS_AGENT_CRASH_AT"
WHEN = ("before", "after")


class CrashContext(Protocol):
    """What a crash point reads of the pipeline's context: the task's envelope (its type and id)."""

    @property
    def envelope(self) -> TaskEnvelope: ...


def armed() -> str | None:
    """The armed crash point, or None (the production case)."""
    return os.environ.get(ENV) or None


def _matches(spec: str, task_type: str, task_id: str, step: str, when: str) -> bool:
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        return False
    if (parts[0], parts[1], parts[2]) != (task_type, step, when):
        return False
    return len(parts) == 3 or parts[3] == task_id


def crash_point(ctx: CrashContext, step: str, when: str) -> None:
    """SIGKILL this process if ``GPUAAS_AGENT_CRASH_AT`` names this task's ``step`` at ``when``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    task_type = str(getattr(ctx.envelope, "type", ""))
    if _matches(spec, task_type, ctx.envelope.task_id, step, when):
        log_event(log, "crash_point_hit", logging.WARNING, task_id=ctx.envelope.task_id, step=step, when=when)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
