"""The slot set of a multi-slot allocation: its refusals before any lease, free slots, and which disks a run touched.

Slots are approved from a fixture host's discovery; leases and slot records live in a real
state store, as the pipelines write them.
"""

from __future__ import annotations

import time
import uuid

import pytest

from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.provision_admission import AdmissionRefused
from gpuaas_agent.tasks.slotset import (
    check_allocation_holds_only,
    check_enough_free,
    check_slot_set,
    free_slot_indexes,
    touched_slots,
)
from tests.support.provision_inputs import approved_slot, topology_of

REPORT = topology_of("h200-slice-after-transition")
MINE, THEIRS = str(uuid.uuid4()), str(uuid.uuid4())


@pytest.fixture
def store(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    yield store
    store.close()


def _lease(allocation_id: str, index: int) -> SlotLease:
    c = REPORT.candidate_slots[index]
    disk = next(d for d in REPORT.nvme_devices if d.by_id == c.nvme_device)
    return SlotLease(allocation_id=allocation_id, slot_index=index, gpu_pci_address=c.gpu_pci_address,
                     nvme_device=c.nvme_device, disk_identity=disk.disk_identity,
                     fabric_vf_pci_address=c.fabric_vf_pci_address, task_id="t-lease", taken_at=time.time())


def _record(allocation_id: str, index: int, status: SlotStatus) -> SlotRecord:
    return SlotRecord(slot_index=index, allocation_id=allocation_id, status=status, health_state=HealthState.healthy,
                      task_id="t-record", updated_at=time.time())


def test_the_set_is_the_boot_slot_first_then_the_others_in_payload_order():
    boot, a, b = (approved_slot(REPORT, i) for i in (3, 1, 6))
    assert [s.slot_index for s in check_slot_set(boot, [a, boot, b])] == [3, 1, 6]
    assert check_slot_set(boot, []) == [boot]  # a v1.0 payload: the boot slot alone


def test_a_set_without_its_boot_slot_is_refused():
    with pytest.raises(AdmissionRefused) as caught:
        check_slot_set(approved_slot(REPORT, 3), [approved_slot(REPORT, 1)])
    assert caught.value.code == "boot_slot_not_in_set"
    assert caught.value.evidence == {"field": "slots", "boot_slot_index": 3, "slot_indexes": [1]}


def test_a_device_named_twice_in_the_set_is_refused_naming_the_field():
    boot = approved_slot(REPORT, 0)
    twin = approved_slot(REPORT, 1, mac=boot.mac)
    with pytest.raises(AdmissionRefused) as caught:
        check_slot_set(boot, [boot, twin])
    assert caught.value.code == "duplicate_slot"
    assert caught.value.evidence == {"field": "slots.mac", "values": [boot.mac]}


def test_slots_leased_or_kept_busy_by_another_allocation_are_not_free(store):
    store.take_lease(_lease(THEIRS, 1))
    store.set_slot_state(_record(THEIRS, 2, SlotStatus.active))
    store.set_slot_state(_record(MINE, 4, SlotStatus.provisioning))  # my own retry: still mine to use
    store.set_slot_state(_record(MINE, 5, SlotStatus.cleanup_blocked))  # never free until a release wipes it
    store.set_slot_state(_record(THEIRS, 6, SlotStatus.available))  # a released slot is available again
    assert free_slot_indexes(REPORT, store, MINE) == [0, 3, 4, 6, 7]


def test_a_set_larger_than_the_free_slots_is_refused_with_the_free_ones(store):
    for index in range(1, 8):
        store.take_lease(_lease(THEIRS, index))
    slots = [approved_slot(REPORT, 0), approved_slot(REPORT, 1)]
    with pytest.raises(AdmissionRefused) as caught:
        check_enough_free(REPORT, store, MINE, slots)
    assert caught.value.code == "not_enough_free_slots"
    assert caught.value.evidence["free_slots"] == [0] and caught.value.evidence["requested"] == [0, 1]
    assert check_enough_free(REPORT, store, MINE, slots[:1]) == [0]


def test_an_allocation_holding_a_slot_outside_the_set_is_refused(store):
    store.take_lease(_lease(MINE, 2))
    check_allocation_holds_only(store, MINE, {2, 3})  # inside the set: fine
    with pytest.raises(AdmissionRefused) as caught:
        check_allocation_holds_only(store, MINE, {3})
    assert caught.value.code == "allocation_has_slot"
    assert caught.value.evidence["held_slots"] == [2] and caught.value.evidence["leased_slots"] == [2]


def test_data_disks_count_as_touched_only_once_the_guest_started():
    assert touched_slots(0, [0, 1, 2], ["validate", "lease", "clone"], disk_touched=True) == {0}
    assert touched_slots(0, [0, 1, 2], ["validate", "lease"], disk_touched=False) == set()
    assert touched_slots(0, [0, 1, 2], ["clone", "define", "start"], disk_touched=True) == {0, 1, 2}
