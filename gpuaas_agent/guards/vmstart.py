"""The checks a slot's domain passes right before ``start`` (docs/safety.md §4, seed 002 Phase 5).

A VM started on a host that cannot carry it fails late and messily: QEMU
without ``/dev/kvm`` falls back to TCG or dies, a missing OVS bridge leaves the
guest without its lease, missing hugepages on the GPU's node make QEMU abort
(numatune strict), a GPU still on ``nvidia`` makes libvirt try to detach it
while host services hold it (seed 004: nvidia-persistenced / fabric manager
blocked 0000:1b:00.0). So each is proven here, in that order, and the first
failure is a typed refusal naming what was seen. Reads go through
:meth:`HostRoot.fresh` (a driver may have changed since discovery); blocking,
so call it through ``asyncio.to_thread``. The KVM and hugepage checks are
shared with the validate step (``guards/preconditions.py``), which proves them
before the disk is touched; here they are asked again because time has passed.
"""

from __future__ import annotations

from typing import Any, Literal

from gpuaas_agent.contract.domain import DomainSpec, StartTarget, VmStartEvidence
from gpuaas_agent.contract.runtime import DomainType
from gpuaas_agent.contract.storage import DiskEvidence
from gpuaas_agent.errors import GuardError
from gpuaas_agent.guards.preconditions import KVM_DEVICE, BridgeCheck, check_hugepages  # noqa: F401  (re-exported)
from gpuaas_agent.guards.preconditions import check_kvm as shared_check_kvm
from gpuaas_agent.hostfs import HostRoot

VFIO_DRIVER = "vfio-pci"
# The disk guard checks a start depends on (names as guards/disk.py records them in checks_passed).
REQUIRED_DISK_CHECKS = (
    "by_id",
    "in_lease",
    "whole_disk",
    "not_os_disk",
    "not_mounted",
    "no_mounted_children",
    "no_holders",
    "not_in_use_by_domain",
)

class VmStartRefused(GuardError):
    """A domain start was refused; nothing was started.

    Codes: ``kvm_missing``, ``kvm_unusable``, ``ovs_bridge_missing``, ``hugepages_unknown``,
    ``hugepages_insufficient``, ``not_bound_to_vfio``, ``disk_guard_mismatch``.
    """

    default_code = "vm_start_refused"


def _refuse(code: str, message: str, **evidence: Any) -> VmStartRefused:
    return VmStartRefused(message, code=code, evidence=evidence)


def check_kvm(host: HostRoot) -> str:
    """``/dev/kvm`` usable: the one check validate (guards/preconditions.py) and parity also run."""
    return shared_check_kvm(host, VmStartRefused)


def check_vm_start(
    host: HostRoot,
    spec: DomainSpec | StartTarget,
    *,
    bridge_exists: BridgeCheck,
    disk: DiskEvidence,
) -> VmStartEvidence:
    """Prove ``spec``'s domain may start now, or raise :class:`VmStartRefused`.

    ``spec``: the whole domain spec (provision) or its :class:`StartTarget` (a power-on of an
    existing domain); only the fields they share are read.
    ``disk``: what the disk guard (``check_disk_writable``) returned for this slot's disk.
    """
    fresh = host.fresh()
    profile = spec.profile
    passed: list[str] = []
    base = {"domain": spec.domain_name, "profile": profile.name}

    kvm: Literal["usable", "not_required"] = "not_required"
    if profile.domain_type is DomainType.kvm:
        check_kvm(fresh)  # raises unless /dev/kvm is usable
        kvm = "usable"
        passed.append("kvm_usable")

    present = bridge_exists(spec.ovs_bridge) if callable(bridge_exists) else bridge_exists
    if present is not True:
        raise _refuse("ovs_bridge_missing", f"OVS bridge {spec.ovs_bridge} does not exist", **base,
                      ovs_bridge=spec.ovs_bridge, evidence_given=repr(present))
    passed.append("ovs_bridge_exists")

    # Validate proved this before the disk was touched; another slice may have taken the pages since.
    needed, free = check_hugepages(fresh, profile, spec.numa_node, VmStartRefused, **base)
    if profile.hugepages_1g:
        passed.append("hugepages_free")

    bound: list[str] = []
    if profile.hostdevs:
        for address in (spec.gpu_pci_address, spec.fabric_vf_pci_address):
            entry = f"/sys/bus/pci/devices/{address}"
            driver = fresh.link_name(f"{entry}/driver")
            if driver != VFIO_DRIVER:
                raise _refuse(
                    "not_bound_to_vfio",
                    f"{address} is bound to {driver or 'no driver'}, not {VFIO_DRIVER}",
                    **base, address=address, driver=driver, present=fresh.exists(entry), path=f"{entry}/driver",
                )
            bound.append(str(address))  # refused above when it is None (no such device)
        passed.append("hostdevs_on_vfio")

    missing_checks = [c for c in REQUIRED_DISK_CHECKS if c not in disk.checks_passed]
    if disk.by_id != spec.nvme_device or missing_checks:
        raise _refuse(
            "disk_guard_mismatch",
            f"the disk guard evidence is for {disk.by_id} (missing checks {missing_checks}), "
            f"the domain uses {spec.nvme_device}",
            **base, disk_evidence=disk.model_dump(), nvme_device=spec.nvme_device, missing_checks=missing_checks,
        )
    passed.append("disk_guard_passed")

    return VmStartEvidence(
        domain_name=spec.domain_name,
        domain_type=profile.domain_type,
        kvm=kvm,
        ovs_bridge=spec.ovs_bridge,
        hugepages_1g_needed=needed,
        hugepages_1g_free=free,
        numa_node=spec.numa_node,
        vfio_bound=bound,
        disk=disk,
        checks_passed=passed,
    )
