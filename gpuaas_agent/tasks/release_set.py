"""``slice.vm_release`` of a multi-slot allocation: release every slot of the set, boot slot first.

The boot slot's release stops and undefines the allocation's one domain (and its vNIC,
reservation and seed); each slot's release then wipes and verifies its own disk and frees
its own lease, exactly as a single-slot release does (``tasks/release.py``, unchanged).
One slot's failure does not stop the others from being wiped: every slot that can be
proven clean is freed, each failed one is ``cleanup_blocked`` with its own evidence, and
the task fails with the first failure (naming the slots released and failed).
"""

from __future__ import annotations

from typing import Any

from gpuaas_agent.contract.tasks import VmReleasePayload
from gpuaas_agent.errors import AgentError
from gpuaas_agent.tasks.context import Handler, TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.release import recover_release, release
from gpuaas_agent.tasks.slotset import check_slot_set


async def release_set(drivers: SliceDrivers, payload: VmReleasePayload, ctx: TaskContext) -> dict[str, Any]:
    slots = check_slot_set(payload.slot, payload.slots)  # boot_slot_not_in_set, duplicate_slot: nothing touched
    if len(slots) == 1:
        return await release(drivers, payload.model_copy(update={"slots": []}), ctx)
    results: dict[int, dict[str, Any]] = {}
    failures: list[tuple[int, AgentError]] = []
    for slot in slots:
        try:
            results[slot.slot_index] = await release(drivers, payload.model_copy(update={"slot": slot, "slots": []}), ctx)
        except AgentError as exc:
            failures.append((slot.slot_index, exc))
    if failures:
        index, first = failures[0]
        first.evidence.update({"slot_index": index, "released_slots": sorted(results),
                               "failed_slots": [i for i, _ in failures]})
        raise first
    boot = results[slots[0].slot_index]
    return {"vm": boot["vm"], "already_gone": all(r["already_gone"] for r in results.values()),
            "slots": [s.slot_index for s in slots],
            "releases": {str(index): result for index, result in results.items()}}


async def recover_release_set(drivers: SliceDrivers, payload: VmReleasePayload, ctx: TaskContext) -> dict[str, Any]:
    """The worker's recovery of an interrupted release it will not run again: each slot's, as release.py does."""
    slots = check_slot_set(payload.slot, payload.slots)
    out = {s.slot_index: await recover_release(drivers, payload.model_copy(update={"slot": s, "slots": []}), ctx)
           for s in slots}
    return out[slots[0].slot_index] if len(slots) == 1 else {str(i): r for i, r in out.items()}


def release_set_handler(drivers: SliceDrivers) -> Handler:
    async def handle(payload: VmReleasePayload, ctx: TaskContext) -> dict[str, Any]:
        return await release_set(drivers, payload, ctx)

    return handle


def release_set_recovery(drivers: SliceDrivers) -> Handler:
    """The recovery its registry row declares (``TaskSpec.make_recovery``): :func:`recover_release_set`."""

    async def recover(payload: VmReleasePayload, ctx: TaskContext) -> dict[str, Any]:
        return await recover_release_set(drivers, payload, ctx)

    return recover
