"""``slice.console_log``: the last N KiB of an allocation's serial console, alive or dead.

Reads only: no slot lock, no lease change, no domain call, so a tenant's console read never
waits behind, or holds up, a provision or release of the same slot. Who may: the log is
found by the payload's own allocation id and slot (host/vm/consolelog.py names it), so a task can
reach no other allocation's file; and a slot another allocation holds now, for which this
allocation has no log, is refused ``not_this_allocation`` (the answer says whose it is not,
never what that allocation printed).

The output (``ConsoleLogResult``) has ``text``: the bytes decoded as UTF-8 with replacement characters
(what an operator reads); ``truncated`` says the log holds more than was returned. The output fits the
wire: the tenant writes these bytes, and JSON escapes each control byte six-fold (``\\u00XX``), so 1 MiB
of them is 6 MiB of result. The tail asked for is shortened from its start until the whole result fits
the server's ``max_payload`` (less ``RESULT_HEADROOM_BYTES`` for the result around it), ``cut_to_fit``
then says so; the latest bytes are the ones kept.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any

from gpuaas_agent.contract.tasks import RESULT_HEADROOM_BYTES, ConsoleLogPayload, ConsoleLogResult
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


def tail_that_fits(data: bytes, fits: Callable[[bytes], bool]) -> bytes:
    """The longest tail of ``data`` that ``fits`` (found by halving: a longer tail never encodes shorter,
    but for a replacement character at its start), never starting inside a UTF-8 sequence."""
    if fits(data):
        return data
    short, long = 0, len(data)  # a tail this long fits (the empty one is the caller's floor); this long does not
    while long - short > 1:
        middle = (short + long) // 2
        if fits(data[len(data) - middle:]):
            short = middle
        else:
            long = middle
    tail = data[len(data) - short:]
    start = 0
    while start < min(3, len(tail)) and tail[start] & 0xC0 == 0x80:  # a continuation byte: would decode to U+FFFD
        start += 1
    return tail[start:]


async def console_log(drivers: SliceDrivers, payload: ConsoleLogPayload, ctx: TaskContext, *,
                      max_payload: int) -> dict[str, Any]:
    """The tail of the allocation's console log, as much of it as the result can carry within ``max_payload``."""
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
    budget = max_payload - RESULT_HEADROOM_BYTES

    def output(data: bytes) -> ConsoleLogResult:
        return ConsoleLogResult(
            allocation_id=alloc, slot_index=index, path=str(tail.path), size_bytes=tail.size_bytes,
            returned_bytes=len(data), truncated=len(data) < tail.size_bytes, cut_to_fit=len(data) < len(tail.data),
            modified=dt.datetime.fromtimestamp(tail.modified, dt.timezone.utc),
            text=data.decode("utf-8", errors="replace"))

    def fits(data: bytes) -> bool:
        return len(output(data).model_dump_json()) <= budget

    # Off the loop: up to ~20 encodings of up to 6 MiB each for a console full of control bytes.
    data = await asyncio.to_thread(tail_that_fits, tail.data, fits)
    return output(data).model_dump(mode="json")


def console_log_handler(drivers: SliceDrivers) -> Handler:
    async def handle(payload: ConsoleLogPayload, ctx: TaskContext) -> dict[str, Any]:
        return await console_log(drivers, payload, ctx, max_payload=ctx.nc.max_payload)

    return handle
