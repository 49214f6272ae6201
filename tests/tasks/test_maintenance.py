"""Maintenance: kept in the store across restarts, refusing new work while on, its drain reported once."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpuaas_agent.contract.fleet import MaintenancePayload
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.state.store import StateError, StateStore
from gpuaas_agent.tasks.maintenance import (
    MAINTENANCE_KEY,
    HostInMaintenance,
    check_not_in_maintenance,
    drain_changed,
    drain_report,
    observe_drain,
    set_maintenance,
)

ALLOC = "0b7c1a9e-0000-4000-8000-000000000001"


def _lease(slot: int) -> SlotLease:
    return SlotLease(allocation_id=ALLOC, slot_index=slot, gpu_pci_address=f"0000:1{slot}:00.0",
                     nvme_device=f"/dev/disk/by-id/nvme-eui.{slot}", disk_identity=f"eui:{slot}",
                     fabric_vf_pci_address=f"0000:4{slot}:00.1", task_id="t", taken_at=1.0)


def test_maintenance_survives_a_restart_and_keeps_its_first_since(tmp_path):
    store = StateStore.open(tmp_path / "agent.db")
    t0 = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)
    state, changed = set_maintenance(store, MaintenancePayload(mode="on", reason="BIOS update"), "t-1", now=t0)
    assert changed and state.since == t0
    store.close()
    store = StateStore.open(tmp_path / "agent.db")
    state, changed = set_maintenance(store, MaintenancePayload(mode="on", reason="still BIOS"), "t-2",
                                     now=datetime(2026, 11, 27, 5, 0, tzinfo=UTC))
    assert not changed and state.since == t0 and state.reason == "still BIOS"
    with pytest.raises(HostInMaintenance) as refused:
        check_not_in_maintenance(store)
    assert refused.value.code == "host_in_maintenance" and "still BIOS" in refused.value.message
    state, changed = set_maintenance(store, MaintenancePayload(mode="off", reason="done"), "t-3")
    assert changed and not state.on
    check_not_in_maintenance(store)
    store.close()


def test_an_unreadable_maintenance_row_refuses_new_work(tmp_path):
    store = StateStore.open(tmp_path / "agent.db")
    store.set_meta(MAINTENANCE_KEY, '{"on": "yes"}')
    with pytest.raises(StateError) as refused:
        check_not_in_maintenance(store)
    assert refused.value.code == "maintenance_state_unreadable"
    set_maintenance(store, MaintenancePayload(mode="off", reason="reset"), "t-1")  # overwriting it repairs it
    check_not_in_maintenance(store)
    store.close()


def test_the_drain_is_reported_once_when_the_last_lease_goes(tmp_path):
    store = StateStore.open(tmp_path / "agent.db")
    store.take_leases([_lease(0), _lease(1)])
    set_maintenance(store, MaintenancePayload(mode="on", reason="drain for reboot"), "t-1")
    report, newly = observe_drain(store)
    assert (report.drained, newly, report.leased_slots, report.allocations) == (False, False, [0, 1], 1)
    assert not drain_changed(report)
    store.release_leases(ALLOC)
    assert drain_changed(drain_report(store))  # done, not yet recorded: the reporter writes it beside its tick
    report, newly = observe_drain(store)
    assert report.drained and newly and report.drained_at is not None
    again, newly = observe_drain(store)
    assert again.drained and not newly and again.drained_at == report.drained_at  # logged once, not every tick
    store.close()
    store = StateStore.open(tmp_path / "agent.db")
    assert observe_drain(store) == (again, False)  # a restart does not report it again
    store.take_lease(_lease(2))  # a provision admitted before maintenance went on: the drain is not done
    report, newly = observe_drain(store)
    assert (report.drained, report.drained_at, newly) == (False, None, False)
    store.close()

