"""An approved slot record binds only to this host's candidate slot of the same index (``slot_mismatch``).

Every record is made from a fixture host's discovery (what an operator approves) and then
changed the way a hostile or stale control plane would; the refusal names the first field
that differs, with what was asked and what the host has.
"""

from __future__ import annotations

import pytest

from gpuaas_agent.guards.slot_binding import SlotMismatch, check_slot_binding, disks_by_name
from tests.support.provision_inputs import approved_slot, topology_of

REPORT = topology_of("h200-slice-after-transition")


def _refusal(slot) -> SlotMismatch:
    with pytest.raises(SlotMismatch) as caught:
        check_slot_binding(slot, REPORT)
    assert caught.value.code == "slot_mismatch"
    return caught.value


def test_the_record_of_a_candidate_binds_to_that_candidate_and_its_disk():
    binding = check_slot_binding(approved_slot(REPORT, 2), REPORT)
    assert binding.candidate.slot_index == 2
    assert binding.disk.by_id == REPORT.candidate_slots[2].nvme_device


def test_any_by_id_alias_of_the_same_namespace_binds_to_the_same_disk():
    disk = disks_by_name(REPORT)[REPORT.candidate_slots[2].nvme_device]
    assert disk.by_id_links, "the fixture's slot 2 disk has by-id aliases"
    for alias in disk.by_id_links:
        binding = check_slot_binding(approved_slot(REPORT, 2, nvme_device=alias), REPORT)
        assert binding.disk.disk_identity == disk.disk_identity


def test_an_index_the_host_does_not_have_is_refused_naming_the_host_indexes():
    error = _refusal(approved_slot(REPORT, 2, slot_index=99))
    assert error.evidence["field"] == "slot_index"
    assert error.evidence["host_slot_indexes"] == list(range(8))


@pytest.mark.parametrize("field", ["gpu_pci_address", "fabric_vf_pci_address", "mac", "private_ip"])
def test_another_slots_device_or_address_under_this_index_is_refused_naming_the_field(field):
    other = approved_slot(REPORT, 5)
    error = _refusal(approved_slot(REPORT, 2, **{field: getattr(other, field)}))
    assert error.evidence["field"] == field
    assert error.evidence["requested"] == getattr(other, field)
    assert error.evidence["host"] == getattr(REPORT.candidate_slots[2], field)
    assert error.evidence["slot_index"] == 2


def test_another_bridge_is_refused():
    error = _refusal(approved_slot(REPORT, 2, ovs_bridge="br-other"))
    assert (error.evidence["field"], error.evidence["requested"]) == ("ovs_bridge", "br-other")


def test_another_slots_disk_is_refused_with_both_identities():
    other_disk = REPORT.candidate_slots[5].nvme_device
    error = _refusal(approved_slot(REPORT, 2, nvme_device=other_disk))
    names = disks_by_name(REPORT)
    assert error.evidence["field"] == "nvme_device"
    assert error.evidence["requested_identity"] == names[other_disk].disk_identity
    assert error.evidence["host_identity"] == names[REPORT.candidate_slots[2].nvme_device].disk_identity


def test_a_disk_this_host_does_not_have_is_refused():
    error = _refusal(approved_slot(REPORT, 2, nvme_device="/dev/disk/by-id/nvme-eui.00000000000000000000000000000000"))
    assert error.evidence["field"] == "nvme_device" and error.evidence["requested_identity"] is None
