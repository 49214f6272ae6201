"""Quarantined components in the discovery report: each candidate slot using one carries a blocker naming it.

Discovery reads the host; the quarantine list is the store's (``tasks/quarantine.py`` passes it in):
this pure function joins them, so ``slice.topology_discover`` and ``slice.plan`` never offer a slot
whose GPU, disk, VF or the slot itself is quarantined. Only that slot: a bad disk blocks the one slot
that uses it, never the host's other slots.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuaas_agent.contract.fleet import ComponentKind, QuarantineRecord
from gpuaas_agent.contract.topology import CandidateSlot, Finding, TopologyReport

QUARANTINED = "component_quarantined"


def slot_components(slot: CandidateSlot, report: TopologyReport) -> list[tuple[ComponentKind, str]]:
    """The (kind, identity) of every component a candidate slot would hand to a tenant, the slot included."""
    out: list[tuple[ComponentKind, str]] = [(ComponentKind.slot, str(slot.slot_index)),
                                            (ComponentKind.gpu, slot.gpu_pci_address)]
    if slot.fabric_vf_pci_address:
        out.append((ComponentKind.fabric_vf, slot.fabric_vf_pci_address))
    if slot.nvme_device:
        # A lease taken before disk identities existed holds its disk as ``path:<by-id>``: a quarantine made
        # from such a lease names the disk that way, by any of its links.
        names = {slot.nvme_device}
        for disk in report.nvme_devices:
            if slot.nvme_device in (disk.by_id, *disk.by_id_links):
                names |= {n for n in (disk.by_id, *disk.by_id_links) if n}
                if disk.disk_identity:
                    out.append((ComponentKind.nvme, disk.disk_identity))
        out += [(ComponentKind.nvme, f"path:{name}") for name in sorted(names)]
    return out


def quarantine_finding(record: QuarantineRecord) -> Finding:
    return Finding(code=QUARANTINED,
                   detail=f"{record.kind.value} {record.identity} is quarantined ({record.reason.value}, "
                          f"{record.quarantined_at.isoformat()}, task {record.task_id}); "
                          "slice.unquarantine re-runs the failed check")


def mark_quarantined(report: TopologyReport, records: Iterable[QuarantineRecord]) -> TopologyReport:
    """The report with a ``component_quarantined`` blocker on each slot that uses a quarantined component."""
    by_ref = {(r.kind, r.identity): r for r in records}
    if not by_ref:
        return report
    slots = []
    for slot in report.candidate_slots:
        found = [by_ref[c] for c in slot_components(slot, report) if c in by_ref]
        slots.append(slot.model_copy(update={"blockers": [*slot.blockers, *map(quarantine_finding, found)]})
                     if found else slot)
    summary = report.summary.model_copy(update={"ready_candidate_slots": sum(not s.blockers for s in slots)})
    return report.model_copy(update={"candidate_slots": slots, "summary": summary})
