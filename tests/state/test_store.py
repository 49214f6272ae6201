"""The SQLite state store on real files: leases are exclusive, the journal survives restarts."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from gpuaas_agent.contract.state import SlotLease, StepStatus
from gpuaas_agent.contract.storage import WipeProof, WipeSample
from gpuaas_agent.state.store import MIGRATIONS, LeaseConflict, StateError, StateStore

ALLOC_A = "23bd713b-6073-4ef7-8a51-2897e902365d"
ALLOC_B = "158ea147-0115-407f-bbd5-1850c32b9517"


def _lease(alloc=ALLOC_A, slot=0, **over):
    fields = dict(
        allocation_id=alloc, slot_index=slot, gpu_pci_address=f"0000:{0x18 + slot:02x}:00.0",
        nvme_device=f"/dev/disk/by-id/nvme-eui.{slot:032x}", disk_identity=f"nguid:{slot:032x}",
        fabric_vf_pci_address=f"0000:{0x40 + slot:02x}:00.1",
        task_id="task-1", taken_at=1.0,
    )
    fields.update(over)
    return SlotLease(**fields)


@pytest.fixture
def store(tmp_path):
    s = StateStore.open(tmp_path / "state" / "agent.db", clock=lambda: 42.0)
    yield s
    s.close()


def test_file_is_private_wal_and_migrated(store):
    assert oct(store.path.stat().st_mode & 0o777) == "0o600"
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.schema_version == len(MIGRATIONS)


def test_a_slot_cannot_be_leased_twice(store):
    store.take_lease(_lease())
    with pytest.raises(LeaseConflict) as err:
        store.take_lease(_lease(alloc=ALLOC_B))
    assert err.value.evidence["held"]["allocation_id"] == ALLOC_A
    assert [l.allocation_id for l in store.leases()] == [ALLOC_A]


def test_no_device_of_a_leased_slot_can_go_to_another_slot(store):
    store.take_lease(_lease())
    with pytest.raises(LeaseConflict, match="nvme_device"):
        store.take_lease(_lease(alloc=ALLOC_B, slot=1, nvme_device=_lease().nvme_device))


def test_same_lease_again_is_idempotent(store):
    first = store.take_lease(_lease())
    assert store.take_lease(_lease(task_id="task-redelivered", taken_at=9.0)) == first
    assert len(store.leases()) == 1


def test_a_multi_gpu_allocation_leases_all_its_slots_or_none(store):
    store.take_lease(_lease(alloc=ALLOC_B, slot=2))
    with pytest.raises(LeaseConflict, match="slot_index=2"):
        store.take_leases([_lease(slot=0), _lease(slot=1), _lease(slot=2)])
    assert store.leases_of(ALLOC_A) == []  # nothing taken: slots 0 and 1 stay free
    taken = store.take_leases([_lease(slot=0), _lease(slot=1)])
    assert [l.slot_index for l in store.leases_of(ALLOC_A)] == [0, 1] == [l.slot_index for l in taken]


def test_one_call_leases_for_one_allocation_only(store):
    with pytest.raises(StateError) as err:
        store.take_leases([_lease(), _lease(alloc=ALLOC_B, slot=1)])
    assert err.value.code == "lease_request_invalid" and store.leases() == []


def test_release_frees_every_slot_of_the_allocation(store):
    store.take_leases([_lease(slot=0), _lease(slot=1)])
    assert [l.slot_index for l in store.release_leases(ALLOC_A)] == [0, 1]
    assert store.release_leases(ALLOC_A) == []
    store.take_lease(_lease(alloc=ALLOC_B))


def test_racing_threads_get_exactly_one_lease(tmp_path):
    path = tmp_path / "agent.db"
    StateStore.open(path).close()
    winners, losers = [], []
    barrier = threading.Barrier(8)

    def contend(i: int) -> None:
        store = StateStore.open(path)
        alloc = f"{i:08x}-0000-4000-8000-000000000000"
        barrier.wait()
        try:
            store.take_lease(_lease(alloc=alloc))
            winners.append(alloc)
        except LeaseConflict:
            losers.append(alloc)
        finally:
            store.close()

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(winners) == 1 and len(losers) == 7


def test_journal_survives_reopen_and_names_unfinished_steps(tmp_path):
    path = tmp_path / "agent.db"
    store = StateStore.open(path)
    store.journal("t1", "validate", StepStatus.started)
    store.journal("t1", "validate", StepStatus.succeeded, {"slot": 0})
    store.journal("t1", "clone", StepStatus.started)
    store.close()  # the agent dies mid-clone
    store = StateStore.open(path)
    assert [(e.seq, e.step, e.status) for e in store.journal_of("t1")] == [
        (1, "validate", StepStatus.started), (2, "validate", StepStatus.succeeded), (3, "clone", StepStatus.started),
    ]
    assert store.journal_of("t1")[1].detail == {"slot": 0}
    assert store.unfinished_steps("t1") == ["clone"]
    store.close()


def test_stored_result_is_returned_and_never_replaced(store):
    assert store.result_of("t1") is None
    store.store_result("t1", {"status": "succeeded", "output": {"vm": "x"}})
    assert store.store_result("t1", {"output": {"vm": "x"}, "status": "succeeded"}) == {"status": "succeeded", "output": {"vm": "x"}}
    with pytest.raises(StateError) as err:
        store.store_result("t1", {"status": "failed"})
    assert err.value.code == "result_conflict"


def test_state_from_a_newer_agent_is_refused(tmp_path):
    path = tmp_path / "agent.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(StateError) as err:
        StateStore.open(path)
    assert err.value.code == "state_schema_newer"


def test_lease_fields_are_validated_before_anything_is_written(store):
    with pytest.raises(ValueError):
        _lease(alloc="not-a-uuid")
    with pytest.raises(ValueError):
        _lease(nvme_device="/dev/nvme0n1")  # a kernel name is never a slot disk
    assert store.leases() == []


def _proof(verified: bool) -> WipeProof:
    return WipeProof(
        by_id="/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331", kernel_name="nvme3n1", dev="259:3",
        method="discard", bytes=3840755982336, seed=7,
        samples=[WipeSample(offset=0, length=1048576, all_zero=verified)],
        signatures_found=[] if verified else ["gpt"], partitions_left=[], duration_s=1.5, verified=verified,
    )


def test_wipe_proofs_are_kept_with_the_slot_newest_first(tmp_path):
    store = StateStore.open(tmp_path / "agent.db")
    assert store.latest_wipe_proof(3) is None
    store.record_wipe_proof(3, _proof(False))
    store.record_wipe_proof(3, _proof(True))
    store.close()
    store = StateStore.open(tmp_path / "agent.db")
    assert store.latest_wipe_proof(3) == _proof(True) and store.latest_wipe_proof(4) is None
    store.close()


def test_a_version_1_file_is_migrated_keeping_its_leases(tmp_path):
    path = tmp_path / "agent.db"
    conn = sqlite3.connect(path)
    for statement in filter(str.strip, MIGRATIONS[0].split(";")):
        conn.execute(statement)
    conn.execute("INSERT INTO slot_lease (slot_index, allocation_id, gpu_pci_address, nvme_device,"
                 " fabric_vf_pci_address, task_id, taken_at) VALUES (0, ?, '0000:18:00.0',"
                 " '/dev/disk/by-id/nvme-eui.0', '0000:40:00.1', 't', 1.0)", (ALLOC_A,))
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    store = StateStore.open(path)
    assert store.schema_version == len(MIGRATIONS) == 10  # 7: lease handover; 8: quarantine; 9: fabric partition leases; 10: guest telemetry opt-in
    assert [l.allocation_id for l in store.leases()] == [ALLOC_A]
    assert store.leases()[0].handover is None  # from before handover policies: release takes the strictest
    assert store.leases()[0].guest_telemetry is False  # from before the opt-in: no guest is pulled
    # A lease from before identities holds its disk by the path it was taken under (migration 4).
    assert store.leases()[0].disk_identity == "path:/dev/disk/by-id/nvme-eui.0"
    store.record_wipe_proof(0, _proof(True))
    store.close()


def test_an_alias_of_a_leased_disk_is_the_same_disk(store):
    """Two leases on one NVMe through two of its by-id names: the second is a lease_conflict on the identity."""
    store.take_lease(_lease(nvme_device="/dev/disk/by-id/nvme-eui.0000000000000001", disk_identity="nguid:00aa"))
    alias = _lease(alloc=ALLOC_B, slot=1, nvme_device="/dev/disk/by-id/nvme-SAMSUNG_MZ_S3XNA0R123456",
                   disk_identity="nguid:00aa")
    with pytest.raises(LeaseConflict) as err:
        store.take_lease(alias)
    assert err.value.code == "lease_conflict" and err.value.evidence["field"] == "disk_identity"
    assert err.value.evidence["held"]["allocation_id"] == ALLOC_A
    assert [l.allocation_id for l in store.leases()] == [ALLOC_A]


def test_the_database_itself_refuses_a_second_lease_on_one_identity(store):
    """The uniqueness is the index's, not only a Python check two tasks could race past."""
    store.take_lease(_lease(disk_identity="nguid:00aa"))
    with pytest.raises(sqlite3.IntegrityError):
        store._conn.execute(
            "INSERT INTO slot_lease (slot_index, allocation_id, gpu_pci_address, nvme_device, disk_identity,"
            " fabric_vf_pci_address, task_id, taken_at) VALUES (5, ?, '0000:99:00.0', '/dev/disk/by-id/other',"
            " 'nguid:00aa', '0000:99:00.1', 't', 1.0)", (ALLOC_B,))


def test_a_version_3_file_gets_identities_for_its_leases_and_stays_usable(tmp_path):
    path = tmp_path / "agent.db"
    conn = sqlite3.connect(path)
    for migration in MIGRATIONS[:3]:
        for statement in filter(str.strip, migration.split(";")):
            conn.execute(statement)
    conn.execute("INSERT INTO slot_lease (slot_index, allocation_id, gpu_pci_address, nvme_device,"
                 " fabric_vf_pci_address, task_id, taken_at) VALUES (2, ?, '0000:18:00.0',"
                 " '/dev/disk/by-id/nvme-eui.2', '0000:40:00.1', 't', 1.0)", (ALLOC_A,))
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    store = StateStore.open(path)
    (old,) = store.leases()
    assert old.disk_identity == "path:/dev/disk/by-id/nvme-eui.2" and old.slot_index == 2
    store.take_lease(_lease(alloc=ALLOC_B, slot=3))  # new leases go on beside it
    with pytest.raises(LeaseConflict):
        store.take_lease(_lease(alloc=ALLOC_B, slot=4, nvme_device="/dev/disk/by-id/nvme-eui.2"))
    store.close()


def test_slot_records_survive_reopen_and_are_replaced_per_slot(tmp_path):
    from gpuaas_agent.contract.slots import HealthState, SlotStatus
    from gpuaas_agent.contract.state import SlotRecord

    store = StateStore.open(tmp_path / "state.db")
    blocked = SlotRecord(slot_index=3, allocation_id=ALLOC_A, status=SlotStatus.cleanup_blocked,
                         health_state=HealthState.failed, detail={"failed_step": "clone"}, task_id="t1", updated_at=1.0)
    store.set_slot_state(blocked)
    store.close()
    store = StateStore.open(tmp_path / "state.db")
    assert store.slot_state(3) == blocked
    assert store.slot_state(4) is None
    active = blocked.model_copy(update={"status": SlotStatus.active, "health_state": HealthState.healthy, "task_id": "t2"})
    store.set_slot_state(active)
    assert store.slot_states() == [active]
    store.clear_slot_state(3)
    assert store.slot_states() == []


def test_releasing_one_slot_keeps_the_allocations_other_slots(store):
    store.take_leases([_lease(slot=0), _lease(slot=1)])
    assert store.release_slot_lease(ALLOC_A, 0).slot_index == 0
    assert [held.slot_index for held in store.leases_of(ALLOC_A)] == [1]
    assert store.release_slot_lease(ALLOC_A, 0) is None  # idempotent
    assert store.release_slot_lease(ALLOC_B, 1) is None  # another allocation cannot drop it
    assert [held.slot_index for held in store.leases_of(ALLOC_A)] == [1]


def _handover(method: str = "zeroout"):
    from gpuaas_agent.contract.handover import LeaseHandover
    from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy

    return LeaseHandover(profile="h200_1g_24c_64g", wipe=WipePolicy(method=WipeMethod(method)),
                         zeros_guaranteed=method != "discard", fixed_at=1.0)


def test_the_handover_fixed_at_validate_is_kept_with_the_lease_and_never_changed_by_a_later_take(tmp_path):
    store = StateStore.open(tmp_path / "agent.db")
    planned = store.take_lease(_lease())  # slice.plan's lease: no handover yet
    assert planned.handover is None
    validated = store.take_lease(_lease().model_copy(update={"handover": _handover("nvme_sanitize")}))
    assert validated.handover == _handover("nvme_sanitize")
    # A redelivered validate (or any later take) cannot weaken what was fixed.
    again = store.take_lease(_lease().model_copy(update={"handover": _handover("discard")}))
    assert again.handover == _handover("nvme_sanitize")
    store.close()
    store = StateStore.open(tmp_path / "agent.db")
    assert store.leases()[0].handover == _handover("nvme_sanitize")
    store.close()


def test_an_unreadable_stored_handover_reads_as_none_so_release_takes_the_strictest(tmp_path):
    store = StateStore.open(tmp_path / "agent.db")
    store.take_lease(_lease().model_copy(update={"handover": _handover()}))
    store._conn.execute("UPDATE slot_lease SET handover = ?", ('{"profile": "x", "wipe": {"method": "shred"}}',))
    assert store.leases()[0].handover is None
    store.close()


def test_the_provisions_guest_telemetry_opt_in_replaces_the_plans_lease(store):
    """slice.plan took the lease without the opt-in; the provision's take of the same lease records it, and back."""
    store.take_lease(_lease())
    assert store.leases()[0].guest_telemetry is False
    taken = store.take_lease(_lease().model_copy(update={"guest_telemetry": True}))
    assert taken.guest_telemetry is True and store.leases()[0].guest_telemetry is True
    store.take_lease(_lease())
    assert store.leases()[0].guest_telemetry is False
