"""A held slot's devices against the live host: is each one still there, and still the same one?

The lease names what the control plane approved and the agent leased: the GPU
and the fabric VF by PCI address, the disk by ``/dev/disk/by-id`` path and by
identity (``disk_identity``: what the namespace *is*, the same for every alias).
After a reboot, a firmware update, a reseated card or a failed drive, the live
host may no longer match (docs/safety.md §2: kernel names are advisory, identities
are not). Every mismatch is a typed :class:`DriftFinding` with its evidence:

* ``slot_device_missing`` (error): the GPU or VF address has no PCI function any
  more, or the by-id link resolves to no disk;
* ``slot_device_moved`` (error): the by-id link now names another disk (its
  identity differs from the lease's: never written, never started), the domain's
  PCI passthrough devices are not the leased ones, or the GPU sits on another NUMA
  node than the one the domain binds its memory to.

Read-only (sysfs through :class:`HostRoot`); blocking: call through ``asyncio.to_thread``.
Used by reconcile and by the boot recovery.
"""

from __future__ import annotations

from gpuaas_agent.contract.domain import DomainDevices
from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.errors import GuardError
from gpuaas_agent.guards.disk import read_disk_identity
from gpuaas_agent.hostfs import HostRoot

PCI_DEVICES = "/sys/bus/pci/devices"


def _numa_of(host: HostRoot, address: str) -> int | None:
    try:
        value = int(host.read_attr(f"{PCI_DEVICES}/{address}/numa_node"))
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def disk_check(host: HostRoot, lease: SlotLease) -> DriftFinding | None:
    """None when the lease's by-id path still resolves to the leased disk; else the finding saying why not.

    A legacy lease (``path:<by-id>`` identity, taken before identities existed) only asks that the
    link still resolve to a whole disk: the identity it was taken with is unknown.
    """
    base = {"allocation_id": lease.allocation_id, "slot_index": lease.slot_index, "device": "nvme",
            "disk_identity": lease.disk_identity}
    try:
        identity = read_disk_identity(host, lease.nvme_device)
    except GuardError as exc:
        return DriftFinding(kind=DriftKind.slot_device_missing, subject=lease.nvme_device, severity=DriftSeverity.error,
                            expected=lease.disk_identity, actual=f"{exc.code}: {exc.message}",
                            detail={**base, "code": exc.code, "evidence": exc.evidence})
    if lease.disk_identity.startswith("path:") or identity == lease.disk_identity:
        return None
    return DriftFinding(kind=DriftKind.slot_device_moved, subject=lease.nvme_device, severity=DriftSeverity.error,
                        expected=lease.disk_identity, actual=identity,
                        detail={**base, "field": "disk_identity", "live_identity": identity,
                                "note": "the by-id path names another disk now: it is never written or started"})


def slot_topology_findings(host: HostRoot, lease: SlotLease, devices: DomainDevices | None = None,
                           *, hostdevs: bool = True) -> list[DriftFinding]:
    """Every way the lease's devices differ from the live host (and from the domain's XML when given).

    ``devices``: the slot domain's devices read back from libvirt (None: no domain to compare).
    ``hostdevs``: whether the domain's profile passes the GPU and VF through.
    """
    fresh = host.fresh()
    findings: list[DriftFinding] = []
    base = {"allocation_id": lease.allocation_id, "slot_index": lease.slot_index}
    for device, address in (("gpu", lease.gpu_pci_address), ("fabric_vf", lease.fabric_vf_pci_address)):
        if not fresh.exists(f"{PCI_DEVICES}/{address}"):
            findings.append(DriftFinding(
                kind=DriftKind.slot_device_missing, subject=address, severity=DriftSeverity.error,
                expected=f"PCI function {address}", actual="absent",
                detail={**base, "device": device, "path": f"{PCI_DEVICES}/{address}"}))
    if (disk := disk_check(fresh, lease)) is not None:
        findings.append(disk)
    if devices is None:
        return findings
    leased_pci = {lease.gpu_pci_address, lease.fabric_vf_pci_address} if hostdevs else set()
    if set(devices.hostdevs) != leased_pci:
        findings.append(DriftFinding(
            kind=DriftKind.slot_device_moved, subject=lease.allocation_id, severity=DriftSeverity.error,
            expected=" ".join(sorted(leased_pci)) or "no PCI passthrough",
            actual=" ".join(sorted(devices.hostdevs)) or "no PCI passthrough",
            detail={**base, "field": "hostdevs", "domain": devices.name}))
    nodeset = devices.numa_nodeset
    if nodeset is not None and nodeset.isdigit() and fresh.exists(f"{PCI_DEVICES}/{lease.gpu_pci_address}"):
        numa = _numa_of(fresh, lease.gpu_pci_address)
        if numa is not None and numa != int(nodeset):
            findings.append(DriftFinding(
                kind=DriftKind.slot_device_moved, subject=lease.gpu_pci_address, severity=DriftSeverity.error,
                expected=f"numa_node {nodeset}", actual=f"numa_node {numa}",
                detail={**base, "device": "gpu", "field": "numa_node", "domain": devices.name,
                        "path": f"{PCI_DEVICES}/{lease.gpu_pci_address}/numa_node"}))
    return findings
