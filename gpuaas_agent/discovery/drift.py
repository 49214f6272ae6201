"""Topology drift: what differs between two discoveries of the same host, keyed by stable identity.

GPUs and fabric functions are keyed by PCI address, NVMe disks by their
``/dev/disk/by-id`` path. Kernel names (``nvme4n1``, ``nvme4n1p3``, ``dm-0``)
move on reboot (docs/safety.md §2, seed 004), so they never key anything: a disk
whose kernel name moved is the same disk (``nvme_renamed``, advisory), and its
"in use" state is compared by mountpoints and counts, not by partition names.
Pure: two reports in, findings out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
from gpuaas_agent.contract.topology import FabricDevice, GpuDevice, NvmeDevice, TopologyReport

T = TypeVar("T")

PRESENT, ABSENT, UNBOUND = "present", "absent", "unbound"


def topology_drift(before: TopologyReport, after: TopologyReport) -> list[DriftFinding]:
    """Every GPU, NVMe disk, fabric function and fabric link that appeared, vanished or changed."""
    return [*_gpu_drift(before.gpus, after.gpus), *_nvme_drift(before.nvme_devices, after.nvme_devices),
            *_fabric_drift(before.fabric_devices, after.fabric_devices)]


def _by(items: Iterable[T], key: Callable[[T], str]) -> dict[str, T]:
    return {key(item): item for item in items}


def _pairs(before: dict[str, T], after: dict[str, T]) -> Iterator[tuple[str, T | None, T | None]]:
    """(key, before or None, after or None) over the union of keys, in key order."""
    for key in sorted(before.keys() | after.keys()):
        yield key, before.get(key), after.get(key)


# -- GPUs ---------------------------------------------------------------------------


def _gpu_drift(before: list[GpuDevice], after: list[GpuDevice]) -> list[DriftFinding]:
    out = []
    for address, old, new in _pairs(_by(before, lambda g: g.pci_address), _by(after, lambda g: g.pci_address)):
        if new is None:
            assert old is not None  # _pairs: every key is on one side at least
            out.append(DriftFinding(kind=DriftKind.gpu_vanished, subject=address, expected=PRESENT, actual=ABSENT,
                                    severity=DriftSeverity.error, detail=_gpu_detail(old)))
        elif old is None:
            out.append(DriftFinding(kind=DriftKind.gpu_appeared, subject=address, expected=ABSENT, actual=PRESENT,
                                    severity=DriftSeverity.warn, detail=_gpu_detail(new)))
        elif old.driver != new.driver:
            out.append(DriftFinding(kind=DriftKind.gpu_driver_changed, subject=address, expected=old.driver or UNBOUND,
                                    actual=new.driver or UNBOUND, severity=DriftSeverity.warn,
                                    detail={"iommu_group": new.iommu_group}))
    return out


def _gpu_detail(gpu: GpuDevice) -> dict[str, Any]:
    return {"driver": gpu.driver, "device_id": gpu.device_id, "numa_node": gpu.numa_node, "iommu_group": gpu.iommu_group}


# -- NVMe ---------------------------------------------------------------------------


def nvme_identity(disk: NvmeDevice) -> str:
    """The disk's stable name: its by-id path; the WWID or serial when udev left no link; the kernel name last."""
    if disk.by_id:
        return disk.by_id
    if disk.wwid:
        return f"wwid:{disk.wwid}"
    if disk.serial:
        return f"serial:{disk.serial}"
    return f"kernel:{disk.kernel_name}"  # nothing stable: a rename then reads as vanished + appeared


def nvme_in_use(disk: NvmeDevice) -> dict[str, Any]:
    """How a disk is in use, in terms that survive a reboot (mountpoints and counts, no kernel names)."""
    return {
        "mountpoints": sorted(disk.mountpoints),
        "child_mountpoints": sorted({c.mountpoint for c in disk.mounted_children}),
        "holders": len(disk.holders),
        "partitions": len(disk.partitions),
        "swap": disk.swap,
    }


def _describe_use(use: dict[str, Any]) -> str:
    parts = [f"mounted at {','.join(use['mountpoints'])}"] if use["mountpoints"] else []
    if use["child_mountpoints"]:
        parts.append(f"partitions mounted at {','.join(use['child_mountpoints'])}")
    if use["holders"]:
        parts.append(f"holders={use['holders']}")
    if use["partitions"]:
        parts.append(f"partitions={use['partitions']}")
    if use["swap"]:
        parts.append("swap")
    return "; ".join(parts) or "unused"


def _nvme_detail(disk: NvmeDevice) -> dict[str, Any]:
    return {"kernel_name": disk.kernel_name, "pci_address": disk.pci_address, "wwid": disk.wwid,
            "os_disk": disk.os_disk, "slice_eligible": disk.slice_eligible}


def _nvme_drift(before: list[NvmeDevice], after: list[NvmeDevice]) -> list[DriftFinding]:
    out = []
    for identity, old, new in _pairs(_by(before, nvme_identity), _by(after, nvme_identity)):
        if new is None:
            assert old is not None  # _pairs: every key is on one side at least
            out.append(DriftFinding(kind=DriftKind.nvme_vanished, subject=identity, expected=PRESENT, actual=ABSENT,
                                    severity=DriftSeverity.error, detail=_nvme_detail(old)))
            continue
        if old is None:
            out.append(DriftFinding(kind=DriftKind.nvme_appeared, subject=identity, expected=ABSENT, actual=PRESENT,
                                    severity=DriftSeverity.warn, detail=_nvme_detail(new)))
            continue
        if old.kernel_name != new.kernel_name:
            out.append(DriftFinding(kind=DriftKind.nvme_renamed, subject=identity, expected=old.kernel_name,
                                    actual=new.kernel_name, severity=DriftSeverity.info,
                                    detail={"advisory": True, "pci_address": new.pci_address}))
        old_use, new_use = nvme_in_use(old), nvme_in_use(new)
        if old_use != new_use:
            out.append(DriftFinding(kind=DriftKind.nvme_in_use_changed, subject=identity,
                                    expected=_describe_use(old_use), actual=_describe_use(new_use),
                                    severity=DriftSeverity.warn,
                                    detail={"before": old_use, "after": new_use, "kernel_name": new.kernel_name,
                                            "slice_eligible_before": old.slice_eligible,
                                            "slice_eligible_after": new.slice_eligible}))
    return out


# -- fabric functions and their links ------------------------------------------------


def _netdevs(fn: FabricDevice) -> set[str]:
    return set(fn.netdevs) | ({fn.netdev} if fn.netdev else set())


def _fabric_drift(before: list[FabricDevice], after: list[FabricDevice]) -> list[DriftFinding]:
    out = []
    for address, old, new in _pairs(_by(before, lambda f: f.pci_address), _by(after, lambda f: f.pci_address)):
        vf = (new or old).is_vf  # type: ignore[union-attr]  # _pairs: every key is on one side at least
        if new is None:
            assert old is not None  # the same
            kind = DriftKind.fabric_vf_vanished if vf else DriftKind.fabric_pf_vanished
            out.append(DriftFinding(kind=kind, subject=address, expected=PRESENT, actual=ABSENT,
                                    severity=DriftSeverity.error, detail=_fabric_detail(old)))
        elif old is None:
            kind = DriftKind.fabric_vf_appeared if vf else DriftKind.fabric_pf_appeared
            out.append(DriftFinding(kind=kind, subject=address, expected=ABSENT, actual=PRESENT,
                                    severity=DriftSeverity.info, detail=_fabric_detail(new)))
        elif old.driver != new.driver:
            # A driver change takes the function's links with it: reported here, not as link findings.
            kind = DriftKind.fabric_vf_driver_changed if vf else DriftKind.fabric_pf_driver_changed
            out.append(DriftFinding(kind=kind, subject=address, expected=old.driver or UNBOUND,
                                    actual=new.driver or UNBOUND, severity=DriftSeverity.warn,
                                    detail={"netdevs_before": sorted(_netdevs(old)), "netdevs_after": sorted(_netdevs(new))}))
        else:
            out += _link_drift(address, _netdevs(old), _netdevs(new))
    return out


def _link_drift(address: str, old: set[str], new: set[str]) -> list[DriftFinding]:
    out = [DriftFinding(kind=DriftKind.link_vanished, subject=name, expected=PRESENT, actual=ABSENT,
                        severity=DriftSeverity.warn, detail={"pci_address": address})
           for name in sorted(old - new)]
    out += [DriftFinding(kind=DriftKind.link_appeared, subject=name, expected=ABSENT, actual=PRESENT,
                         severity=DriftSeverity.info, detail={"pci_address": address})
            for name in sorted(new - old)]
    return out


def _fabric_detail(fn: FabricDevice) -> dict[str, Any]:
    return {"driver": fn.driver, "is_vf": fn.is_vf, "physfn": fn.physfn, "netdevs": sorted(_netdevs(fn))}
