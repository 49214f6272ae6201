"""The store keeps maintenance and quarantined components across restarts, one row per component."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime

from gpuaas_agent.contract.fleet import (
    ComponentKind,
    ComponentRef,
    QuarantineReason,
    QuarantineRecord,
    RecheckVerdict,
)
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.state.store import MIGRATIONS, StateStore
from gpuaas_agent.tasks.maintenance import maintenance_state

ALLOC = "0b7c1a9e-0000-4000-8000-000000000001"
DISK = "eui:000000000000000100a075244a103331"


def _record(kind=ComponentKind.nvme, identity=DISK, reason=QuarantineReason.wipe_unverified, **over):
    return QuarantineRecord(kind=kind, identity=identity, reason=reason, evidence={"verified": False},
                            quarantined_at=datetime(2026, 11, 27, 3, 0, tzinfo=UTC), task_id="t-release", **over)


def _lease(slot: int) -> SlotLease:
    return SlotLease(allocation_id=ALLOC, slot_index=slot, gpu_pci_address=f"0000:1{slot}:00.0",
                     nvme_device=f"/dev/disk/by-id/nvme-eui.{slot}", disk_identity=f"eui:{slot}",
                     fabric_vf_pci_address=f"0000:4{slot}:00.1", task_id="t", taken_at=1.0)


def test_a_schema_6_store_migrates_keeping_its_meta_and_leases(tmp_path):
    path = tmp_path / "agent.db"
    conn = sqlite3.connect(path)
    for migration in MIGRATIONS[:6]:
        for statement in filter(str.strip, migration.split(";")):
            conn.execute(statement)
    conn.execute("INSERT INTO agent_meta VALUES ('boot_id', 'b-1', 1.0)")
    conn.execute("PRAGMA user_version = 6")
    conn.commit()
    conn.close()
    store = StateStore.open(path)
    assert store.schema_version == len(MIGRATIONS) and store.meta("boot_id") == "b-1"
    assert store.quarantined() == [] and maintenance_state(store).on is False
    store.close()


def test_quarantine_keeps_the_first_record_survives_a_restart_and_release_keeps_history(tmp_path):
    store = StateStore.open(tmp_path / "agent.db")
    first, new = store.quarantine(_record(slot_index=3))
    assert new and first.slot_index == 3
    again, new = store.quarantine(_record(reason=QuarantineReason.smart_failing))
    assert not new and again.reason is QuarantineReason.wipe_unverified  # the first failure is the one to explain
    store.quarantine(_record(kind=ComponentKind.gpu, identity="0000:18:00.0", reason=QuarantineReason.gpu_reset_failed))
    store.close()

    store = StateStore.open(tmp_path / "agent.db")
    assert [(r.kind.value, r.identity) for r in store.quarantined()] == [("nvme", DISK), ("gpu", "0000:18:00.0")]
    ref = ComponentRef(kind=ComponentKind.nvme, identity=DISK)
    verdict = RecheckVerdict(check="wipe", passed=True, detail="read back zero")
    released = store.release_quarantine(ref, released_by="ops", reason="disk replaced", recheck=verdict, task_id="t-u")
    assert released == first
    assert store.quarantine_of(ref) is None
    assert store.release_quarantine(ref, released_by="ops", reason="twice", recheck=verdict, task_id="t-v") is None
    [history] = store.quarantine_history(ref)
    assert history["reason"] == "disk replaced" and history["recheck"]["passed"] is True
    assert history["record"]["reason"] == "wipe_unverified"
    store.close()
