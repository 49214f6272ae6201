"""A quarantined component blocks exactly the candidate slots that use it (the recorded 8xH200 host)."""

from __future__ import annotations

from datetime import UTC, datetime

from gpuaas_agent.contract.fleet import ComponentKind, QuarantineReason, QuarantineRecord
from gpuaas_agent.discovery.quarantine import QUARANTINED, mark_quarantined, slot_components
from tests.support.provision_inputs import topology_of


def _record(kind: ComponentKind, identity: str) -> QuarantineRecord:
    return QuarantineRecord(kind=kind, identity=identity, reason=QuarantineReason.gpu_reset_failed, evidence={},
                            quarantined_at=datetime(2026, 11, 27, tzinfo=UTC), task_id="t-1")


def _blocked(report) -> list[int]:
    return [s.slot_index for s in report.candidate_slots if any(b.code == QUARANTINED for b in s.blockers)]


def test_each_kind_blocks_only_the_slot_that_uses_it():
    report = topology_of()
    ready = report.summary.ready_candidate_slots
    slot = report.candidate_slots[1]
    disk = dict(slot_components(slot, report))[ComponentKind.nvme]
    for record in (_record(ComponentKind.gpu, slot.gpu_pci_address),
                   _record(ComponentKind.fabric_vf, slot.fabric_vf_pci_address),
                   _record(ComponentKind.nvme, disk), _record(ComponentKind.slot, "1")):
        marked = mark_quarantined(report, [record])
        assert _blocked(marked) == [1], record.kind
        assert marked.summary.ready_candidate_slots == ready - 1
        [finding] = [b for b in marked.candidate_slots[1].blockers if b.code == QUARANTINED]
        assert record.identity in finding.detail and "gpu_reset_failed" in finding.detail


def test_a_component_this_host_does_not_have_changes_nothing():
    report = topology_of()
    assert mark_quarantined(report, [_record(ComponentKind.gpu, "0000:ee:00.0")]) == report
    assert mark_quarantined(report, []) is report


def test_two_bad_disks_take_two_slots_and_leave_the_other_six():
    report = topology_of()
    disks = [dict(slot_components(report.candidate_slots[i], report))[ComponentKind.nvme] for i in (2, 6)]
    marked = mark_quarantined(report, [_record(ComponentKind.nvme, d) for d in disks])
    assert _blocked(marked) == [2, 6]
    assert len(marked.candidate_slots) == len(report.candidate_slots) == 8


def test_a_disk_named_by_the_path_of_an_old_lease_blocks_its_slot():
    report = topology_of()
    slot = report.candidate_slots[4]
    marked = mark_quarantined(report, [_record(ComponentKind.nvme, f"path:{slot.nvme_device}")])
    assert _blocked(marked) == [4]
