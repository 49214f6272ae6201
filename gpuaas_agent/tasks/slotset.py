"""One allocation, N slots: the set a provision or release acts on, and its refusals before any lease.

A multi-GPU slice is one libvirt domain holding every slot's GPU, fabric VF and
NVMe (seed 002: "multi-GPU slice allocations must fit on one node"). The payload
names a boot slot (``slot``: its disk gets the image, its MAC/IP the vNIC) and,
from contract v1.1, the whole set (``slots``). Before anything is leased or
written, validate refuses:

* ``boot_slot_not_in_set`` / ``duplicate_slot``: the set does not contain its boot slot, or
  names one slot, GPU, VF, disk, MAC or IP twice;
* ``allocation_has_slot``: the allocation already holds a slot outside the set;
* ``not_enough_free_slots``: the set is larger than the slots this host has free for it;
* ``slot_cleanup_blocked``: a slot of the set is cleanup_blocked (``provision.check_admissible``, per slot);
* ``not_approved`` / ``slot_mismatch``: a slot whose bindings this host does not have
  (a slot of another host) or are not the host's candidate slot (``slice.plan``'s own check).

Which disks a failure has touched is per slot: the boot disk from the clone on, the
data disks from the guest's start on (the guest may write every disk it is given).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuaas_agent.contract.slots import ApprovedSlot, SlotStatus
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.provision_admission import AdmissionRefused

# Steps after which a data disk (a slot other than the boot slot) may hold tenant data.
DATA_DISK_TOUCHING_STEPS = frozenset({"start", "readiness"})
# A host record in one of these keeps its slot from being free for a new allocation.
NOT_FREE = frozenset({SlotStatus.provisioning, SlotStatus.active, SlotStatus.releasing, SlotStatus.cleanup_blocked})
_UNIQUE_FIELDS = ("slot_index", "slot_id", "gpu_pci_address", "nvme_device", "fabric_vf_pci_address", "mac",
                  "private_ip")


def slot_set(boot: ApprovedSlot, slots: Iterable[ApprovedSlot]) -> list[ApprovedSlot]:
    """The boot slot first, then the other slots of the set in payload order (no checks: see :func:`check_slot_set`)."""
    return [boot, *(s for s in slots if s != boot)]


def check_slot_set(boot: ApprovedSlot, slots: list[ApprovedSlot]) -> list[ApprovedSlot]:
    """The set, boot slot first; refuses one without its boot slot or with a slot or device named twice."""
    if not slots:
        return [boot]
    if boot not in slots:
        raise AdmissionRefused(
            f"slots does not contain the boot slot {boot.slot_index} ({boot.slot_id})",
            code="boot_slot_not_in_set",
            evidence={"field": "slots", "boot_slot_index": boot.slot_index, "slot_indexes": [s.slot_index for s in slots]})
    for field in _UNIQUE_FIELDS:
        values = [str(getattr(s, field)) for s in slots]
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            raise AdmissionRefused(
                f"slots names {field} {', '.join(dupes)} more than once",
                code="duplicate_slot",
                evidence={"field": f"slots.{field}", "values": dupes})
    return slot_set(boot, slots)


def check_allocation_holds_only(store: StateStore, allocation_id: str, indexes: set[int]) -> None:
    """``allocation_has_slot`` when the allocation holds a lease or record on a slot outside the set.

    The domain is named per allocation: a slot outside the set would meet this set's domain.
    """
    leases = {lease.slot_index for lease in store.leases_of(allocation_id)} - indexes
    records = {r.slot_index for r in store.slot_states() if r.allocation_id == allocation_id} - indexes
    if leases or records:
        held = sorted(leases | records)
        raise AdmissionRefused(
            f"allocation {allocation_id} already has slot {held[0]} outside the requested set "
            f"{sorted(indexes)}; nothing changed",
            code="allocation_has_slot",
            evidence={"field": "slots" if len(indexes) > 1 else "slot.slot_index", "requested": sorted(indexes),
                      "held_slots": held, "leased_slots": sorted(leases), "recorded_slots": sorted(records)})


def free_slot_indexes(report: TopologyReport, store: StateStore, allocation_id: str) -> list[int]:
    """Candidate slots of this host with no blocker that no other allocation holds and no record keeps busy."""
    taken = {lease.slot_index for lease in store.leases() if lease.allocation_id != allocation_id}
    records = {r.slot_index: r for r in store.slot_states()}
    free = []
    for slot in report.candidate_slots:
        record = records.get(slot.slot_index)
        if slot.blockers or slot.slot_index in taken:
            continue
        if record is not None and record.status in NOT_FREE and (
                record.allocation_id != allocation_id or record.status is SlotStatus.cleanup_blocked):
            continue
        free.append(slot.slot_index)
    return free


def check_enough_free(report: TopologyReport, store: StateStore, allocation_id: str, slots: list[ApprovedSlot]) -> list[int]:
    """``not_enough_free_slots`` when the set is larger than what this host can give the allocation now."""
    free = free_slot_indexes(report, store, allocation_id)
    if len(slots) > len(free):
        raise AdmissionRefused(
            f"{len(slots)} slots requested; this host has {len(free)} free",
            code="not_enough_free_slots",
            evidence={"field": "slots", "requested": [s.slot_index for s in slots], "free_slots": free,
                      "candidate_slots": len(report.candidate_slots)})
    return free


def touched_slots(boot_index: int, indexes: list[int], steps_started: Iterable[str], disk_touched: bool) -> set[int]:
    """Which slots' disks may hold data after a run that started ``steps_started``."""
    touched = {boot_index} if disk_touched else set()
    if DATA_DISK_TOUCHING_STEPS & set(steps_started):
        touched |= set(indexes)
    return touched
