"""The check before a PCI function is handed to vfio-pci (docs/safety.md §3).

A guest given one function of an IOMMU group can DMA to every function in it:
binding a GPU whose group also holds, say, the BOSS NVMe controller would hand
the OS disk to a tenant. So a function goes to vfio-pci only when it belongs to
the approved slot and every other endpoint of its group is approved too, already
on vfio-pci, or a PCI bridge (bridges do not do DMA on a guest's behalf).
No IOMMU group means no IOMMU isolation at all: refused.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from gpuaas_agent.contract.vfio import IommuGroupMember, VfioGuardEvidence
from gpuaas_agent.discovery.pci import BDF_RE, iommu_group_members, read_function
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.errors import GuardError
from gpuaas_agent.hostfs import HostRoot


class VfioGuardError(GuardError):
    """Binding to vfio-pci was refused; nothing was written.

    Codes: ``not_approved``, ``device_missing``, ``no_iommu_group``, ``iommu_group_not_isolated``.
    """

    default_code = "vfio_guard_refused"


def _refuse(code: str, message: str, **evidence: Any) -> VfioGuardError:
    return VfioGuardError(message, code=code, evidence=evidence)


def check_vfio_bindable(host: HostRoot, address: str, approved: Collection[str]) -> VfioGuardEvidence:
    """Prove ``address`` may be bound to vfio-pci now, or raise :class:`VfioGuardError`.

    ``approved``: the leased slot's PCI functions (GPU and fabric VF addresses).
    Reads sysfs afresh on every call (a driver may have changed since discovery);
    blocking, so call it through ``asyncio.to_thread`` right before binding.
    """
    approved_set = {a.lower() for a in approved if isinstance(a, str) and BDF_RE.match(a.lower())}
    if not isinstance(address, str) or address not in approved_set:
        raise _refuse(
            "not_approved",
            f"{address!r} is not one of the approved slot's PCI functions",
            address=address,
            approved=sorted(approved_set),
        )
    reader = SysReader(host)
    function = read_function(reader, address)
    if function is None:
        raise _refuse("device_missing", f"PCI function {address} is not present on this host", address=address)
    if function.iommu_group is None:
        raise _refuse(
            "no_iommu_group",
            f"{address} has no IOMMU group: the IOMMU is off or the device is not translated; it cannot be isolated",
            address=address,
            driver=function.driver,
        )
    members = []
    for member_address in iommu_group_members(reader, function.iommu_group):
        member = function if member_address == address else read_function(reader, member_address)
        members.append(
            IommuGroupMember(
                address=member_address,
                driver=None if member is None else member.driver,
                is_bridge=member is not None and member.is_bridge,
                approved=member_address in approved_set,
            )
        )
    if not any(m.address == address for m in members):
        raise _refuse(
            "no_iommu_group",
            f"IOMMU group {function.iommu_group} does not list {address}; its isolation cannot be proven",
            address=address,
            iommu_group=function.iommu_group,
            members=[m.model_dump() for m in members],
        )
    offending = [m for m in members if not m.isolated]
    if offending:
        raise _refuse(
            "iommu_group_not_isolated",
            f"IOMMU group {function.iommu_group} of {address} holds devices outside the slot "
            f"that are not on vfio-pci: {', '.join(f'{m.address} ({m.driver})' for m in offending)}",
            address=address,
            iommu_group=function.iommu_group,
            offending=[m.model_dump() for m in offending],
            members=[m.model_dump() for m in members],
        )
    return VfioGuardEvidence(address=address, iommu_group=function.iommu_group, members=members)
