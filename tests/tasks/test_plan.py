"""slice.plan: approved records are checked against live discovery, then leased all or nothing."""

from __future__ import annotations

import pytest

from gpuaas_agent.contract.slots import ApprovedSlot
from gpuaas_agent.errors import AgentError
from gpuaas_agent.state.store import LeaseConflict, StateStore
from gpuaas_agent.tasks.plan import PlanError, lease_bundle, plan_bundle
from tests.support.provision_inputs import PLAN_ALLOCATION_ID, approved_slot, plan_payload, topology_of

OTHER = "158ea147-0115-407f-bbd5-1850c32b9517"


def test_two_slot_bundle_is_planned_from_live_state():
    report = topology_of()
    plan = plan_bundle(plan_payload(approved_slot(report, 0), approved_slot(report, 5)), report)
    assert [s.slot_index for s in plan.slots] == [0, 5]
    first = plan.slots[0]
    assert first.gpu_local_cpulist == "0-55,112-167" and first.nvme_kernel_name == "nvme3n1"
    assert first.fabric_pf_pci_address == "0000:19:00.0"


def test_after_reboot_the_same_record_resolves_to_the_new_kernel_name():
    approved = approved_slot(topology_of(), 0)
    plan = plan_bundle(plan_payload(approved), topology_of("h200-slice-after-reboot"))
    assert plan.slots[0].nvme_device == approved.nvme_device and plan.slots[0].nvme_kernel_name == "nvme5n1"


def _refusal(payload, report) -> PlanError:
    with pytest.raises(PlanError) as err:
        plan_bundle(payload, report)
    return err.value


def test_an_approved_id_without_record_is_not_approved():
    report = topology_of()
    err = _refusal(plan_payload(approved_slot(report, 0), ids=["s-0", "s-9"]), report)
    assert err.code == "not_approved" and err.evidence["missing_slot_ids"] == ["s-9"]


def test_mounted_disk_is_refused_with_its_mount_evidence():
    before = topology_of("h200-slice-before-transition")
    err = _refusal(plan_payload(approved_slot(topology_of(), 0)), before)
    assert err.code == "nvme_unsafe"
    assert "mounted_child" in {r["code"] for r in err.evidence["reasons"]}


def test_gpu_that_is_not_on_this_node_is_not_approved():
    report = topology_of()
    err = _refusal(plan_payload(approved_slot(report, 0, gpu_pci_address="0000:77:00.0")), report)
    assert err.code == "not_approved" and err.evidence["binding"] == "gpu_pci_address"


def test_a_pf_named_as_the_slot_vf_is_refused():
    report = topology_of()
    err = _refusal(plan_payload(approved_slot(report, 0, fabric_vf_pci_address="0000:19:00.0")), report)
    assert err.code == "not_approved" and err.evidence["binding"] == "fabric_vf_pci_address"


def test_no_vfs_host_cannot_plan_a_slot():
    approved = approved_slot(topology_of(), 0)
    err = _refusal(plan_payload(approved), topology_of("h200-slice-no-vfs"))
    assert err.code == "not_approved" and err.evidence["binding"] == "fabric_vf_pci_address"


def test_two_slots_sharing_a_disk_are_refused():
    report = topology_of()
    a, b = approved_slot(report, 0), approved_slot(report, 1)
    err = _refusal(plan_payload(a, b.model_copy(update={"nvme_device": a.nvme_device})), report)
    assert err.code == "duplicate_binding" and err.evidence["field"] == "nvme_device"


def test_cleanup_blocked_slot_is_not_plannable():
    report = topology_of()
    err = _refusal(plan_payload(approved_slot(report, 0, status="cleanup_blocked")), report)
    assert err.code == "slot_not_available"


def test_leases_are_all_or_nothing(tmp_path):
    report = topology_of()
    store = StateStore.open(tmp_path / "agent.db")
    lease_bundle(store, plan_bundle(plan_payload(approved_slot(report, 1), alloc=OTHER), report), "t-other")
    plan = plan_bundle(plan_payload(approved_slot(report, 0), approved_slot(report, 1)), report)
    with pytest.raises(LeaseConflict):
        lease_bundle(store, plan, "t-mine")
    assert store.leases_of(PLAN_ALLOCATION_ID) == []
    store.close()


# -- the approved slot is the only truth: exactly the host's candidate of that index (slot_mismatch) ----------

def _mismatch(slot: ApprovedSlot, report):
    from gpuaas_agent.errors import AgentError

    with pytest.raises(AgentError) as err:
        plan_bundle(plan_payload(slot), report)
    assert err.value.code == "slot_mismatch", err.value
    return err.value.evidence


def _alias(report, by_id: str) -> str:
    """Another by-id name (model_serial) of the same namespace."""
    disk = next(d for d in report.nvme_devices if d.by_id == by_id)
    assert disk.by_id_links, "the recorded host gives every namespace several names"
    return disk.by_id_links[0]


def test_slot_index_without_candidate_carrying_another_slots_devices_is_slot_mismatch():
    """Seen over the wire: slot_index 99 with slot 2's devices succeeded (port gs63-…, reservation slot 99)."""
    report = topology_of()
    evidence = _mismatch(approved_slot(report, 2, slot_index=99, slot_id="s-99"), report)
    assert evidence["field"] == "slot_index" and evidence["requested"] == 99 and evidence["host"] is None


def test_an_index_with_another_slots_devices_is_slot_mismatch_naming_the_first_field():
    report = topology_of()
    evidence = _mismatch(approved_slot(report, 2, slot_index=3, slot_id="s-3"), report)
    assert evidence["field"] == "gpu_pci_address"
    assert evidence["requested"] == report.candidate_slots[2].gpu_pci_address
    assert evidence["host"] == report.candidate_slots[3].gpu_pci_address


@pytest.mark.parametrize("field, value_from", [
    ("mac", lambda r: "02:00:00:00:00:99"),
    ("private_ip", lambda r: "10.100.0.99"),
    ("fabric_vf_pci_address", lambda r: r.candidate_slots[3].fabric_vf_pci_address),
])
def test_a_field_that_is_not_the_slots_own_is_slot_mismatch(field, value_from):
    report = topology_of()
    value = value_from(report)
    evidence = _mismatch(approved_slot(report, 2, **{field: value}), report)
    assert evidence["field"] == field and evidence["requested"] == value
    assert evidence["host"] == getattr(report.candidate_slots[2], field)


def test_the_disk_of_another_slot_under_an_alias_is_slot_mismatch():
    """An NVMe has several by-id names: a different namespace is refused whatever it is called."""
    report = topology_of()
    other = _alias(report, report.candidate_slots[5].nvme_device)
    evidence = _mismatch(approved_slot(report, 2, nvme_device=other), report)
    assert evidence["field"] == "nvme_device" and evidence["requested"] == other
    assert evidence["host"] == report.candidate_slots[2].nvme_device
    assert evidence["requested_identity"] != evidence["host_identity"]


def test_an_alias_of_the_slots_own_disk_is_the_same_disk_and_the_plan_carries_its_identity():
    report = topology_of()
    own = report.candidate_slots[2].nvme_device
    plan = plan_bundle(plan_payload(approved_slot(report, 2, nvme_device=_alias(report, own))), report)
    (planned,) = plan.slots
    assert planned.disk_identity == next(d.disk_identity for d in report.nvme_devices if d.by_id == own)


def test_leases_of_two_aliases_of_one_disk_conflict_on_identity(tmp_path):
    """The plan's lease holds the disk by identity: a second allocation naming it by another alias is refused."""
    report = topology_of()
    store = StateStore.open(tmp_path / "state.db")
    lease_bundle(store, plan_bundle(plan_payload(approved_slot(report, 2)), report), "t-1")
    alias = approved_slot(report, 2, nvme_device=_alias(report, report.candidate_slots[2].nvme_device))
    with pytest.raises(LeaseConflict) as err:
        lease_bundle(store, plan_bundle(plan_payload(alias, alloc=OTHER), report), "t-2")
    assert err.value.evidence["field"] in ("slot_index", "disk_identity")
    assert [lease.allocation_id for lease in store.leases()] == [PLAN_ALLOCATION_ID]
    store.close()


def test_a_string_slot_index_is_not_coerced():
    """Wire models are strict: "2" is not the slot index 2."""
    from gpuaas_agent.contract.tasks import TaskEnvelope, task_payload
    from gpuaas_agent.errors import ContractError

    report = topology_of()
    raw = approved_slot(report, 2).model_dump(mode="json")
    env = TaskEnvelope.from_wire(dict(
        task_id="t", type="slice.plan", node_id="n", attempt=1, deadline="2030-01-01T00:00:00Z",
        payload={"allocation_id": PLAN_ALLOCATION_ID, "approved_slot_ids": ["s-2"], "slots": [{**raw, "slot_index": "2"}]}))
    with pytest.raises(ContractError) as err:
        task_payload(env)
    assert err.value.code == "invalid_payload" and err.value.evidence["field"] == "slots.0.slot_index"
    assert "\n" not in err.value.message
    # the same record with the integer goes through, enums spelled as strings as JSON does
    env = env.model_copy(update={"payload": {**env.payload, "slots": [raw]}})
    assert task_payload(env)[1].slots[0].slot_index == 2


def test_a_disk_discovery_read_no_identity_for_is_a_typed_refusal_never_a_validation_error():
    report = topology_of()
    approved = approved_slot(report, 0)
    kernel_name = plan_bundle(plan_payload(approved), report).slots[0].nvme_kernel_name
    blind = report.model_copy(update={"nvme_devices": [
        d.model_copy(update={"disk_identity": None}) if d.kernel_name == kernel_name else d
        for d in report.nvme_devices]})
    with pytest.raises(AgentError) as err:
        plan_bundle(plan_payload(approved), blind)
    assert err.value.code == "slot_mismatch"  # the slot's disk is held by identity: none read, not this slot's
