"""A slot record's detail is typed (contract/state.SlotDetail), and rows the current release wrote still load.

The rows below are byte for byte what the release before the typed detail stored (``json.dumps(detail,
sort_keys=True)`` into ``slot_state.detail``), one per writer: provision (active, failed, interrupted),
release (failed, interrupted), power, boot recovery. They are written with plain SQL, as that release's
store did, and read back with this one.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import PowerState, SlotDetail, SlotFailure, SlotRecord
from gpuaas_agent.state.store import StateStore

ALLOC = "5b0f3c1e-8a3d-4c55-9f7e-2d1c0b9a8e7f"

# (slot, status, health, detail) as the previous release's writers built them.
PREVIOUS_RELEASE_ROWS = [
    (0, "active", "healthy", {  # provision succeeded, then slice.vm_power stop (power.py merged its keys in)
        "readiness": {"lease": {"expected_ip": "10.88.0.10", "actual_ip": "10.88.0.10", "lease_state": "bound"},
                      "ssh_banner": "SSH-2.0-OpenSSH_8.9p1", "duration_s": 41.2},
        "domain": "gpuaas-5b0f3c1e-slot0",
        "power_state": "stopped",
        "last_power_operation": {"operation": "stop", "task_id": "t-stop", "at": 1795700000.5, "changed": True,
                                 "succeeded": True, "code": None}}),
    (1, "active", "healthy", {  # a data slot of a two-slot provision, after a boot recovery restarted it
        "readiness": {"lease": {"expected_ip": "10.88.0.10"}}, "domain": "gpuaas-5b0f3c1e-slot0",
        "boot_slot_index": 0, "power_state": "running",
        "boot_recovery": {"boot_id": "7d3c2b1a-9e8f-4a6b-8c7d-6e5f4a3b2c1d", "outcome": "restarted",
                          "at": 1795700100.0, "findings": []}}),
    (2, "cleanup_blocked", "failed", {  # provision failed at clone, a two-slot set (own disk named)
        "failed_step": "clone", "code": "clone_failed", "message": "qemu-img exited 1",
        "evidence": {"steps_done": ["validate", "image"], "stderr": "No space left on device"},
        "cancelled": False, "nvme_device": "/dev/disk/by-id/nvme-SAMSUNG_X_2", "disk_role": "data",
        "boot_slot_index": 3}),
    (4, "cleanup_blocked", "failed", {  # an interrupted provision closed by its recovery
        "code": "provision_interrupted", "steps_reached": ["validate", "image", "clone"], "disk_touched": True,
        "compensations": [{"step": "clone", "ok": True, "removed": False}]}),
    (5, "cleanup_blocked", "failed", {  # release failed at wipe
        "failed_step": "wipe", "code": "wipe_verify_failed", "evidence": {"mismatch_at": 4096}}),
    (6, "cleanup_blocked", "failed", {  # an interrupted release closed by its recovery
        "code": "release_interrupted", "unfinished_steps": ["wipe"]}),
    (7, "provisioning", "unknown", {}),  # provision's first write
]


def _write_as_previous_release(path, rows) -> None:
    with sqlite3.connect(path) as conn:
        for slot, status, health, detail in rows:
            conn.execute("INSERT OR REPLACE INTO slot_state VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (slot, ALLOC, status, health, json.dumps(detail, sort_keys=True), "t-old", 1.0))


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "state.db"
    StateStore.open(path).close()  # this release's schema (the table is the same)
    return path


def test_every_row_the_previous_release_wrote_loads_typed_and_is_written_back_unchanged(db):
    _write_as_previous_release(db, PREVIOUS_RELEASE_ROWS)
    store = StateStore.open(db)
    try:
        records = {r.slot_index: r for r in store.slot_states()}
        assert sorted(records) == [row[0] for row in PREVIOUS_RELEASE_ROWS]
        for slot, _, _, detail in PREVIOUS_RELEASE_ROWS:
            assert records[slot].detail.unknown == {}, f"slot {slot}: a key of the previous release is not typed"
            assert records[slot].detail.to_stored() == detail  # the same JSON object, no key added or lost
        stopped = records[0].detail
        assert stopped.power_state is PowerState.stopped and stopped.last_power_operation is not None
        assert stopped.last_power_operation.operation == "stop" and stopped.failure is None
        data = records[1].detail
        assert data.boot_slot_index == 0 and data.power_state is PowerState.running
        assert data.boot_recovery is not None and data.boot_recovery.outcome == "restarted"
        assert records[2].detail.failure == SlotFailure(step="clone", code="clone_failed")
        assert records[4].detail.failure == SlotFailure(step=None, code="provision_interrupted")
        assert records[6].detail.unfinished_steps == ["wipe"]
        # Written back by this release (a power operation's merge), the row still holds what it held.
        store.set_slot_state(records[2])
        with sqlite3.connect(db) as conn:
            (stored,) = conn.execute("SELECT detail FROM slot_state WHERE slot_index = 2").fetchone()
        assert json.loads(stored) == PREVIOUS_RELEASE_ROWS[2][3]
    finally:
        store.close()


def test_a_row_with_keys_or_values_this_release_does_not_type_loads_and_keeps_them(db):
    odd = {"power_state": "hibernating", "future_key": {"x": 1}, "domain": "gpuaas-a-slot0", "boot_slot_index": -1}
    _write_as_previous_release(db, [(0, "active", "healthy", odd)])
    store = StateStore.open(db)
    try:
        record = store.slot_state(0)
        assert record is not None and record.detail.domain == "gpuaas-a-slot0"
        assert record.detail.power_state is None and record.detail.boot_slot_index is None  # not read by name
        assert record.detail.unknown == {"power_state": "hibernating", "future_key": {"x": 1}, "boot_slot_index": -1}
        store.set_slot_state(record.model_copy(update={"detail": record.detail.updated(power_state="running")}))
        again = store.slot_state(0)
        assert again is not None and again.detail.power_state is PowerState.running
        assert again.detail.unknown == {"future_key": {"x": 1}, "boot_slot_index": -1}  # the typed key replaced its own
    finally:
        store.close()


def test_a_new_write_with_a_key_the_model_does_not_know_is_refused():
    with pytest.raises(ValidationError):
        SlotRecord(slot_index=0, allocation_id=ALLOC, status=SlotStatus.active, health_state=HealthState.healthy,
                   detail={"power_sate": "running"}, task_id="t", updated_at=0.0)
    with pytest.raises(ValidationError):
        SlotDetail.model_validate({"power_state": "on"})
    with pytest.raises(ValidationError):
        SlotDetail().updated(disk_role="spare")
