"""``slice.console_log``: the last N KiB of an allocation's serial console, alive or dead.

Reads only: no slot lock, no lease change, no domain call, so a tenant's console read never
waits behind, or holds up, a provision or release of the same slot. Who may: the log is
found by the payload's own allocation id and slot (host/vm/consolelog.py names it), so a task can
reach no other allocation's file; and a slot another allocation holds now, for which this
allocation has no log, is refused ``not_this_allocation`` (the answer says whose it is not,
never what that allocation printed).

The output's ``text`` is the bytes decoded as UTF-8 with replacement characters (what an
operator reads); ``truncated`` says the log holds more than was returned.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from gpuaas_agent.contract.tasks import ConsoleLogPayload
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.vm.consolelog import ConsoleLogError, read_tail
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.context import Handler, TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers


class ConsoleLogRefused(AgentError):
    """The slot is another allocation's and this one has no log there: nothing was read."""

    default_code = "not_this_allocation"


def holder_of(store: StateStore, slot_index: int) -> str | None:
    """The allocation that holds the slot now (lease, else slot record), or None."""
    lease = next((held for held in store.leases() if held.slot_index == slot_index), None)
    if lease is not None:
        return lease.allocation_id
    record = store.slot_state(slot_index)
    return record.allocation_id if record is not None else None


async def console_log(drivers: SliceDrivers, payload: ConsoleLogPayload, ctx: TaskContext) -> dict[str, Any]:
    alloc, index = payload.allocation_id.lower(), payload.slot_index
    try:
        tail = await asyncio.to_thread(read_tail, drivers.slice.console_log_dir, alloc, index, payload.tail_kib << 10)
    except ConsoleLogError as exc:
        if exc.code == "console_log_missing":
            holder = await as_store_thread(ctx.store).run(holder_of, index)
            if holder is not None and holder.lower() != alloc:
                raise ConsoleLogRefused(f"slot {index} is held by another allocation, not {alloc}; "
                                        f"{alloc} has no console log there", evidence={"slot_index": index}) from None
        raise
    return {
        "allocation_id": alloc, "slot_index": index, "path": str(tail.path), "size_bytes": tail.size_bytes,
        "returned_bytes": len(tail.data), "truncated": tail.truncated,
        "modified": dt.datetime.fromtimestamp(tail.modified, dt.timezone.utc).isoformat(),
        "text": tail.data.decode("utf-8", errors="replace"),
    }


def console_log_handler(drivers: SliceDrivers) -> Handler:
    async def handle(payload: ConsoleLogPayload, ctx: TaskContext) -> dict[str, Any]:
        return await console_log(drivers, payload, ctx)

    return handle
