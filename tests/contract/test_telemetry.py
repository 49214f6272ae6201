"""The SliceTelemetry contract: bounded, strict, unknown is None (never 0), and it round-trips through JSON."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.domain import DomainState
from gpuaas_agent.contract.telemetry import (
    MAX_SLOTS,
    DiskCounters,
    SliceTelemetry,
    SlotTelemetry,
    TelemetryBounds,
)

ALLOC = "23bd713b-6073-4ef7-8a51-2897e902365d"
BOUNDS = TelemetryBounds(max_allocations=8, max_slots_per_allocation=8, stats_timeout_s=10.0)


def message(**over) -> dict:
    fields = dict(node_id="node-1", allocation_id=ALLOC, domain="gpuaas-slice-x", collected_at=1.0, interval_s=15.0,
                  bounds=BOUNDS.model_dump(), state="running", slots=[{"slot_index": 0}])
    fields.update(over)
    return fields


def test_a_message_round_trips_and_unreported_counters_stay_none():
    m = SliceTelemetry.from_wire(message())
    assert m.state is DomainState.running and m.cpu_time_ns is None and m.slots == [SlotTelemetry(slot_index=0)]
    assert SliceTelemetry.model_validate_json(m.model_dump_json()) == m


@pytest.mark.parametrize("over", [
    {"allocation_id": "not-a-uuid"},
    {"node_id": "node.1"},  # a subject token
    {"cpu_time_ns": -1},
    {"interval_s": 0},
    {"slots": [{"slot_index": n} for n in range(MAX_SLOTS + 1)]},
    {"not_reported": ["x"] * 65},
    {"extra": 1},
    {"bounds": {**BOUNDS.model_dump(), "stats_timeout_s": 0}},
])
def test_a_message_out_of_bounds_or_with_unknown_fields_is_refused(over):
    with pytest.raises(ValidationError):
        SliceTelemetry.from_wire(message(**over))


def test_counters_are_strict_ints():
    with pytest.raises(ValidationError):
        DiskCounters(device="vda", read_bytes="12")  # type: ignore[arg-type]
