"""The checks a slot's domain passes right before ``start`` (DESIGN.md §4.4, seed 002 Phase 5).

A VM started on a host that cannot carry it fails late and messily: QEMU
without ``/dev/kvm`` falls back to TCG or dies, a missing OVS bridge leaves the
guest without its lease, missing hugepages on the GPU's node make QEMU abort
(numatune strict), a GPU still on ``nvidia`` makes libvirt try to detach it
while host services hold it (seed 004: nvidia-persistenced / fabric manager
blocked 0000:1b:00.0). So each is proven here, in that order, and the first
failure is a typed refusal naming what was seen. Reads go through
:meth:`HostRoot.fresh` (a driver may have changed since discovery); blocking,
so call it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

from gpuaas_agent.contract.domain import DomainSpec, StartTarget, VmStartEvidence
from gpuaas_agent.contract.runtime import HUGEPAGE_1G_MIB, DomainType
from gpuaas_agent.contract.storage import DiskEvidence
from gpuaas_agent.discovery.numa import free_hugepages_1g
from gpuaas_agent.errors import GuardError
from gpuaas_agent.hostfs import HostRoot

VFIO_DRIVER = "vfio-pci"
KVM_DEVICE = "/dev/kvm"
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

# Evidence that the slot's OVS bridge exists: a boolean already proven, or a check to call with the bridge name
# (e.g. the OVS driver's bridge lookup), so this guard does not depend on how OVS is reached.
BridgeCheck = bool | Callable[[str], bool]


class VmStartRefused(GuardError):
    """A domain start was refused; nothing was started.

    Codes: ``kvm_missing``, ``kvm_unusable``, ``ovs_bridge_missing``, ``hugepages_unknown``,
    ``hugepages_insufficient``, ``not_bound_to_vfio``, ``disk_guard_mismatch``.
    """

    default_code = "vm_start_refused"


def _refuse(code: str, message: str, **evidence: Any) -> VmStartRefused:
    return VmStartRefused(message, code=code, evidence=evidence)


def check_kvm(host: HostRoot) -> str:
    """``/dev/kvm`` is a character device this process can open read-write (on the live host)."""
    if not host.exists(KVM_DEVICE):
        raise _refuse("kvm_missing", f"{KVM_DEVICE} does not exist (KVM module not loaded or virtualisation off)",
                      path=KVM_DEVICE, root=str(host.root))
    real = str(host.real(host.resolve(KVM_DEVICE)))
    mode = os.stat(real).st_mode
    # A recording cannot keep device nodes in git: there a regular placeholder file stands for one.
    acceptable = stat.S_ISCHR(mode) or (not host.is_live and stat.S_ISREG(mode))
    if not acceptable:
        raise _refuse("kvm_unusable", f"{KVM_DEVICE} is not a character device", path=KVM_DEVICE,
                      mode=oct(mode), root=str(host.root))
    # On the live host it must also be openable by this process (it is root-only on CI machines).
    if host.is_live and not os.access(real, os.R_OK | os.W_OK):
        raise _refuse("kvm_unusable", f"{KVM_DEVICE} is not readable and writable by uid {os.getuid()}",
                      path=KVM_DEVICE, mode=oct(mode), uid=os.getuid())
    return "usable"


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

    if profile.domain_type is DomainType.kvm:
        kvm = check_kvm(fresh)
        passed.append("kvm_usable")
    else:
        kvm = "not_required"

    present = bridge_exists(spec.ovs_bridge) if callable(bridge_exists) else bridge_exists
    if present is not True:
        raise _refuse("ovs_bridge_missing", f"OVS bridge {spec.ovs_bridge} does not exist", **base,
                      ovs_bridge=spec.ovs_bridge, evidence_given=repr(present))
    passed.append("ovs_bridge_exists")

    needed = profile.memory_mib // HUGEPAGE_1G_MIB if profile.hugepages_1g else 0
    free: int | None = None
    if profile.hugepages_1g:
        if spec.numa_node is None:
            raise _refuse("hugepages_unknown", "hugepages are required but the slot has no NUMA node to take them from",
                          **base, needed=needed)
        path = f"/sys/devices/system/node/node{spec.numa_node}/hugepages/hugepages-1048576kB/free_hugepages"
        free = free_hugepages_1g(fresh, spec.numa_node)
        if free is None:
            raise _refuse("hugepages_unknown", f"NUMA node {spec.numa_node} has no 1 GiB hugepage pool", **base,
                          numa_node=spec.numa_node, path=path, needed=needed)
        if free < needed:
            raise _refuse(
                "hugepages_insufficient",
                f"NUMA node {spec.numa_node} has {free} free 1 GiB hugepages; profile {profile.name} needs {needed}",
                **base, numa_node=spec.numa_node, path=path, free=free, needed=needed,
            )
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
            bound.append(address)
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
