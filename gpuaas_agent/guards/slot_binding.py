"""Does an approved slot record name exactly what this host offers as that slot? (``slot_mismatch``)

The control plane's record of a slot is input like any other: a hostile or
buggy one sent ``slot_index: 99`` with slot 2's devices, or slot 2's index with
slot 5's disk under another by-id alias, and the agent used to check only that
each device *existed*. The live discovery's candidate slot with the same index
is the only truth: its GPU, fabric VF, disk (by identity: any by-id alias of
the same namespace is fine, another namespace never is), MAC, private IP and
bridge must all be the record's, or the task is refused before anything is
leased. Pure: values in, evidence or a typed refusal out.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import AddressValueError, IPv4Address

from gpuaas_agent.contract.slots import ApprovedSlot
from gpuaas_agent.contract.topology import CandidateSlot, NvmeDevice, TopologyReport
from gpuaas_agent.errors import GuardError


class SlotMismatch(GuardError):
    """The record does not match the host's candidate slot; ``evidence.field`` names the first difference."""

    default_code = "slot_mismatch"


@dataclass(frozen=True)
class SlotBinding:
    """The host's candidate slot a record matched, and the disk its ``nvme_device`` resolves to."""

    candidate: CandidateSlot
    disk: NvmeDevice


def disks_by_name(report: TopologyReport) -> dict[str, NvmeDevice]:
    """Every by-id name (primary and aliases) of every discovered namespace -> that namespace."""
    names: dict[str, NvmeDevice] = {}
    for disk in report.nvme_devices:
        for name in filter(None, [disk.by_id, *disk.by_id_links]):
            names[name] = disk
    return names


def _mismatch(slot: ApprovedSlot, field: str, requested: object, host: object, **more: object) -> SlotMismatch:
    return SlotMismatch(
        f"slot {slot.slot_index}: {field} {requested} is not this host's slot {slot.slot_index} ({host})",
        evidence={"field": field, "requested": requested, "host": host, "slot_index": slot.slot_index,
                  "slot_id": slot.slot_id, **more})


def _same_ip(a: str, b: str | None) -> bool:
    try:
        return b is not None and IPv4Address(a) == IPv4Address(b)
    except AddressValueError:
        return False


def check_slot_binding(slot: ApprovedSlot, report: TopologyReport) -> SlotBinding:
    """The candidate slot ``slot`` is, or :class:`SlotMismatch` naming the first field that differs."""
    candidate = next((c for c in report.candidate_slots if c.slot_index == slot.slot_index), None)
    if candidate is None:
        raise _mismatch(slot, "slot_index", slot.slot_index, None,
                        host_slot_indexes=[c.slot_index for c in report.candidate_slots])
    for field in ("gpu_pci_address", "fabric_vf_pci_address", "mac"):
        if getattr(slot, field) != getattr(candidate, field):
            raise _mismatch(slot, field, getattr(slot, field), getattr(candidate, field))
    if not _same_ip(slot.private_ip, candidate.private_ip):
        raise _mismatch(slot, "private_ip", slot.private_ip, candidate.private_ip)
    if slot.ovs_bridge != candidate.ovs_bridge:
        raise _mismatch(slot, "ovs_bridge", slot.ovs_bridge, candidate.ovs_bridge)
    names = disks_by_name(report)
    host_disk = names.get(candidate.nvme_device) if candidate.nvme_device else None
    requested = names.get(slot.nvme_device)
    if (host_disk is None or requested is None or host_disk.disk_identity is None
            or requested.disk_identity != host_disk.disk_identity):
        raise _mismatch(slot, "nvme_device", slot.nvme_device, candidate.nvme_device,
                        requested_identity=requested.disk_identity if requested else None,
                        host_identity=host_disk.disk_identity if host_disk else None)
    return SlotBinding(candidate=candidate, disk=requested)
