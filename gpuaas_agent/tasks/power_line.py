"""Per-slot fairness of ``slice.vm_power``: one operation runs and at most one waits per slot; the newest wins.

A tenant whose guest ignores ACPI can send ``reboot`` again and again. Queued behind each
other, every one would hold the slot lock for its whole graceful timeout and, together,
the node's task capacity for hours. So the power operations of one slot collapse to the
latest request:

* nothing runs on the slot: the operation runs;
* the same operation already runs and nothing waits: the new task is answered
  ``superseded`` at once (the running one does what it asks; nothing is queued);
* otherwise the task becomes the slot's one waiter, and a waiter already there is answered
  ``superseded`` (the newest request is the tenant's intent).

A waiter holds no lock: it waits for its turn in this line and takes the slot lock only
when the running operation has ended. So at most :data:`MAX_POWER_TASKS_PER_SLOT` power
tasks of one slot are ever inside the agent, whatever the tenant sends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gpuaas_agent.errors import AgentError

# The running operation and one waiter: the most power tasks of one slot the agent holds at once.
MAX_POWER_TASKS_PER_SLOT = 2


class PowerSuperseded(AgentError):
    """A newer power request of the same slot took this one's place (or the running one already does it)."""

    default_code = "superseded"
    retryable = False


@dataclass
class _Turn:
    task_id: str
    operation: str
    ready: asyncio.Future[None]


@dataclass
class _Slot:
    running: _Turn | None = None
    waiting: _Turn | None = None


@dataclass
class PowerLine:
    """The node's power operations per slot; one per daemon (kept by :class:`~gpuaas_agent.tasks.drivers.SliceDrivers`)."""

    _slots: dict[int, _Slot] = field(default_factory=dict)

    def tasks_of(self, slot_index: int) -> dict[str, str | None]:
        """The task ids running and waiting on a slot (status, tests)."""
        slot = self._slots.get(slot_index)
        return {"running": slot.running.task_id if slot and slot.running else None,
                "waiting": slot.waiting.task_id if slot and slot.waiting else None}

    def count(self) -> int:
        """Power tasks in the line on every slot, running and waiting (the agent's status: 0 when idle)."""
        return sum((slot.running is not None) + (slot.waiting is not None) for slot in self._slots.values())

    @contextlib.asynccontextmanager
    async def turn(self, slot_index: int, task_id: str, operation: str) -> AsyncIterator[None]:
        """Hold the slot's power turn for the body; raises :class:`PowerSuperseded` when a newer request wins."""
        slot = self._slots.setdefault(slot_index, _Slot())
        me = _Turn(task_id, operation, asyncio.get_running_loop().create_future())
        if slot.running is None:
            slot.running = me
        elif slot.waiting is None and slot.running.operation == operation:
            raise PowerSuperseded(
                f"{operation} of slot {slot_index} is already running (task {slot.running.task_id}); "
                f"task {task_id} was not queued behind it", evidence={
                    "slot_index": slot_index, "operation": operation, "superseded_by": slot.running.task_id,
                    "running": {"task_id": slot.running.task_id, "operation": slot.running.operation}})
        else:
            displaced, slot.waiting = slot.waiting, me
            if displaced is not None and not displaced.ready.done():
                displaced.ready.set_exception(PowerSuperseded(
                    f"{displaced.operation} of slot {slot_index} (task {displaced.task_id}) was superseded by "
                    f"{operation} (task {task_id}) before it started; nothing was done", evidence={
                        "slot_index": slot_index, "operation": displaced.operation, "superseded_by": task_id,
                        "superseded_by_operation": operation,
                        "running": {"task_id": slot.running.task_id, "operation": slot.running.operation}}))
            try:
                await me.ready
            except BaseException:
                # Superseded, or cancelled (its deadline) while waiting: out of the line. A turn handed over
                # just as the cancel landed is passed on, never kept by a task that will not run.
                self._leave(slot_index, me)
                raise
        try:
            yield
        finally:
            self._leave(slot_index, me)

    def _leave(self, slot_index: int, me: _Turn) -> None:
        slot = self._slots.get(slot_index)
        if slot is None:
            return
        if slot.waiting is me:
            slot.waiting = None
        if slot.running is me:
            nxt, slot.waiting = slot.waiting, None
            if nxt is not None and nxt.ready.done():  # its task was cancelled meanwhile and leaves by itself
                nxt = None
            slot.running = nxt
            if nxt is not None:
                nxt.ready.set_result(None)
        if slot.running is None and slot.waiting is None:
            del self._slots[slot_index]
