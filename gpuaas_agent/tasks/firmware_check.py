"""The firmware a tenant could reach, read before the tenancy and again at its release.

A tenant with a GPU, a VF and a disk passed through can try to reflash them. The slot's lease keeps
the firmware its devices ran at validate (``LeaseHandover.firmware``: the GPU, the VF and its PF, the
disk's controller); the release reads them again after the GPU handover, and any change — a new
version, a version no longer readable, a device gone — fails the release with ``firmware_changed``:
the slot stays ``cleanup_blocked`` and is quarantined until ``slice.unquarantine`` sees the recorded
versions (or the site's baseline) again.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpuaas_agent.contract.firmware import FirmwareBaselineRule, FirmwareChange, FirmwareComponent, FirmwareInventory
from gpuaas_agent.contract.slots import ApprovedSlot
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.discovery.firmware import firmware_changes, read_firmware, slot_firmware_devices
from gpuaas_agent.errors import HostError
from gpuaas_agent.hostfs import HostRoot


class FirmwareChanged(HostError):
    """A device of the slot runs other firmware than before the tenancy (or can no longer say which)."""

    default_code = "firmware_changed"


def slot_firmware(report: TopologyReport, slot: ApprovedSlot) -> list[FirmwareComponent] | None:
    """The components of ``report``'s firmware inventory that ``slot``'s tenant could reach (None: no inventory)."""
    if report.firmware is None:
        return None
    devices = slot_firmware_devices(report, slot.gpu_pci_address, slot.fabric_vf_pci_address, slot.nvme_device)
    changes = firmware_changes(FirmwareInventory(source=report.firmware.source), report.firmware, devices)
    wanted = {c.id for c in changes}
    return [c for c in report.firmware.components if c.id in wanted]


async def check_slot_firmware(host: HostRoot, lease: SlotLease) -> dict[str, Any]:
    """Compare the lease's recorded firmware with a fresh reading; raise :class:`FirmwareChanged` on a difference."""
    recorded = lease.handover.firmware if lease.handover is not None else None
    if recorded is None:
        return {"skipped": "the lease recorded no firmware (taken before firmware inventories)"}
    now = await asyncio.to_thread(read_firmware, host)
    before = FirmwareInventory(source=now.source, components=list(recorded))
    changes = firmware_changes(before, now, [c.id for c in recorded])
    if changes:
        raise FirmwareChanged(
            f"firmware of slot {lease.slot_index} changed during the tenancy of {lease.allocation_id}: "
            + "; ".join(f"{c.kind} {c.id} {c.before} -> {c.after} ({c.change})" for c in changes),
            evidence={"slot_index": lease.slot_index, "changes": [c.model_dump(mode="json") for c in changes]})
    return {"unchanged": [c.model_dump(mode="json") for c in recorded]}


def firmware_restored(host: HostRoot, changes: list[FirmwareChange],
                      baseline: tuple[FirmwareBaselineRule, ...] = ()) -> tuple[bool, str]:
    """For ``slice.unquarantine``: every changed component reads its version from before the tenancy again,
    or a version the site's baseline allows for it. Reads sysfs only."""
    current = {c.key: c for c in read_firmware(host).components}
    for change in changes:
        component = current.get(f"{change.kind}:{change.id}")
        if component is None or component.version is None:
            return False, f"{change.kind} {change.id} is gone or its firmware version is unreadable"
        if component.version == change.before:
            continue
        rule = next((r for r in baseline if r.kind == component.kind and r.model in (None, component.model)), None)
        if rule is not None and component.version in rule.versions:
            continue
        return False, f"{change.kind} {change.id} runs {component.version}, not {change.before} (nor a baseline version)"
    return True, f"{len(changes)} component(s) back at their recorded (or a baseline) firmware"
