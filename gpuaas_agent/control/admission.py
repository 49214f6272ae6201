"""Which pulled task may start now: a bound per class, per task type and per allocation, checked before it runs.

A node serves many tenants through one consumer. Without this, a task waiting for its type's
semaphore held the worker's pull capacity, so a tenant who queued ~50 legal power or terminal
tasks stopped every other tenant's provisions and releases from being pulled. Now each pulled
task is *admitted* before anything runs: its class (``contract.tasks.task_class``) has a free
place, its type is under its concurrency, and — for interactive work — its allocation is under
``per_allocation`` tasks in flight. A task that is not admitted is handed straight back to
JetStream (a nak with a short delay) and holds nothing; one that is admitted starts at once, so
no task waits in the agent for capacity while holding it.

The pull itself goes on while any class has a free place; lifecycle and interactive work each
have their own capacity (the sums of their types' concurrency), so neither can starve the other.
Why not two consumers per node: JetStream 2.9 takes one filter subject per consumer and the
task subjects carry no class token, so a class split would double the fleet's consumers (or
change the contract's subjects) for the same effect (docs/fairness.md).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from gpuaas_agent.contract.tasks import TaskClass, TaskType, task_class

TASK_TOKEN = ".task."


@dataclass(frozen=True)
class Ticket:
    """An admitted task's places, given back when it ends."""

    task_class: TaskClass
    task_type: TaskType | None
    tenant: str | None


@dataclass(frozen=True)
class Refusal:
    """Why a pulled task was handed back (the log and the metric say which bound it met)."""

    reason: str
    task_class: TaskClass
    task_type: TaskType | None


def type_of_subject(subject: str) -> TaskType | None:
    """The task type a subject ``gpuaas.node.<node>.task.<type>`` names, or None (junk: the worker rejects it)."""
    _, sep, tail = subject.partition(TASK_TOKEN)
    if not sep:
        return None
    try:
        return TaskType(tail)
    except ValueError:
        return None


def tenant_of(data: bytes) -> str | None:
    """The allocation (else the terminal session) an interactive task's payload names; None when it names none.

    Read without validation: only a bound is keyed on it. The envelope is validated by the worker before
    anything runs, and a forged key can only put a task under some other key's bound, never around all bounds.
    """
    try:
        payload = json.loads(data).get("payload")
    except (ValueError, AttributeError):
        return None
    if not isinstance(payload, dict):
        return None
    for key in ("allocation_id", "session_id"):
        value = payload.get(key)
        if isinstance(value, str) and 0 < len(value) <= 64:
            return f"{key}:{value}"
    return None


class Admission:
    """The places of one worker. Not thread-safe: the worker's event loop is its only user."""

    def __init__(self, concurrency: Mapping[TaskType, int], *, per_allocation: int) -> None:
        self.concurrency = {t: max(1, concurrency.get(t, 1)) for t in TaskType}
        self.capacity = Counter({c: 0 for c in TaskClass})
        for t, n in self.concurrency.items():
            self.capacity[task_class(t)] += n
        self.per_allocation = max(1, per_allocation)
        self._classes: Counter[TaskClass] = Counter()
        self._types: Counter[TaskType | None] = Counter()
        self._tenants: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # handed back so far, by reason (observability)

    def any_free(self) -> bool:
        return any(self._classes[c] < self.capacity[c] for c in TaskClass)

    def free(self, cls: TaskClass) -> int:
        return self.capacity[cls] - self._classes[cls]

    def admit(self, subject: str, data: bytes) -> Ticket | Refusal:
        """Take the places a task needs, or say which bound it met (nothing taken)."""
        task_type = type_of_subject(subject)
        cls = task_class(task_type)
        reason = None
        tenant = tenant_of(data) if cls is TaskClass.interactive else None
        if self._classes[cls] >= self.capacity[cls]:
            reason = f"{cls.value}_full"
        elif task_type is not None and self._types[task_type] >= self.concurrency[task_type]:
            reason = "type_full"
        elif tenant is not None and self._tenants[tenant] >= self.per_allocation:
            reason = "allocation_full"
        if reason is not None:
            self.refused[reason] += 1
            return Refusal(reason=reason, task_class=cls, task_type=task_type)
        self._classes[cls] += 1
        self._types[task_type] += 1
        if tenant is not None:
            self._tenants[tenant] += 1
        return Ticket(task_class=cls, task_type=task_type, tenant=tenant)

    def release(self, ticket: Ticket) -> None:
        self._classes[ticket.task_class] -= 1
        self._types[ticket.task_type] -= 1
        if ticket.tenant is not None:
            self._tenants[ticket.tenant] -= 1
            if self._tenants[ticket.tenant] <= 0:
                del self._tenants[ticket.tenant]

    def snapshot(self) -> dict[str, object]:
        """In flight per class and per tenant key, the capacities, and how many were handed back by reason."""
        return {"in_flight": {c.value: self._classes[c] for c in TaskClass},
                "capacity": {c.value: self.capacity[c] for c in TaskClass},
                "tenants": len(self._tenants), "handed_back": dict(self.refused)}
