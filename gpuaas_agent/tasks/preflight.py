"""``slice.preflight`` (and ``gpuaas-agent preflight|parity``): every slice-host prerequisite as a parity check.

Seed 002 Phase 5 (IOMMU, VFIO, SR-IOV, OVS, libvirt, UEFI, reboot state) and
the seed 004 parity target (ovsbr0 + gateway, dnsmasq, NAT, ip_forward, IPoIB
netplan/address/route, tmfifo, historical service names), one line each in
the seed's format; hard failures make the report FAIL.

Where a provision's validate step checks the same thing (``/dev/kvm``, the
seed dir QEMU must reach, OVMF, the dnsmasq that reads the reservations), the
parity check *is* that check (``guards/preconditions.py``), so parity cannot
PASS what a provision would refuse. A host with no ready candidate slot is not
a slice host yet: FAIL with the remediation its blockers call for.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from pathlib import Path
from typing import Any

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.parity import ParityCheck, ParityReport, ParityStatus, SliceNetworkEvidence
from gpuaas_agent.contract.runtime import DEFAULT_PROFILE, RuntimeProfile, get_profile
from gpuaas_agent.contract.tasks import PreflightPayload
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.deploy.sysfswrites import plan_writes, slot_functions, sysfs_writable_check
from gpuaas_agent.discovery import prereqs
from gpuaas_agent.discovery.firmware import check_firmware_baseline, read_firmware
from gpuaas_agent.discovery.netevidence import NetTarget, read_dnsmasq_evidence, read_network_evidence
from gpuaas_agent.discovery.nvswitch import check_nvswitch_partition
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.discovery.slots import PlanConfig
from gpuaas_agent.errors import GuardError
from gpuaas_agent.guards.preconditions import KVM_DEVICE, check_kvm, check_seed_dir, qemu_user
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.tasks.context import Handler, TaskContext
from gpuaas_agent.tasks.fabricvf import fabric_isolation_check

PASS, WARN, FAIL = ParityStatus.PASS, ParityStatus.WARN, ParityStatus.FAIL
LIBVIRT_IMAGES = "/var/lib/libvirt/images"


def _kv(evidence: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in evidence.items() if v not in (None, [], {}))


def kvm_check(host: HostRoot) -> ParityCheck:
    """The start step's own KVM check: present *and* a character device this uid can open."""
    fix = "enable VT-x/VMX (AMD-V) in firmware and load kvm_intel/kvm_amd"
    try:
        check_kvm(host)
    except GuardError as exc:
        return ParityCheck(status=FAIL, check="kvm", detail=f"{exc.code}: {exc.message}", remediation=fix, hard=True,
                           evidence=_kv(exc.evidence))
    mode = oct(os.stat(host.real(host.resolve(KVM_DEVICE))).st_mode)
    how = "character device, opened rw by this uid" if host.is_live else "recorded placeholder"
    return ParityCheck(status=PASS, check="kvm", detail=f"{KVM_DEVICE} usable", hard=True,
                       evidence=f"{KVM_DEVICE} mode={mode} {how}")


def qemu_access_check(host: HostRoot, seed_dir: Path) -> ParityCheck:
    """libvirt's image dir and the agent's seed dir are reachable by QEMU's user (seed 004: /var/lib/libvirt 0700)."""
    fix = (f"make every directory down to {seed_dir} traversable by QEMU's user (chmod o+x /var/lib/libvirt; "
           f"install -d -m 0755 {seed_dir})")
    if not host.is_live and not host.is_dir(str(seed_dir)) and not host.is_dir(LIBVIRT_IMAGES):
        return ParityCheck(status=WARN, check="qemu_access", hard=True, remediation=fix,
                           detail=f"not provable from a recording: {LIBVIRT_IMAGES} and {seed_dir} were not recorded",
                           evidence=f"is_dir({LIBVIRT_IMAGES}) is_dir({seed_dir}) under {host.root}")
    try:
        user = qemu_user(host)
        seen = []
        for directory in (LIBVIRT_IMAGES, str(seed_dir)):
            evidence = check_seed_dir(host, directory, user=user)
            seen.append(" ".join(f"{c.path}:{c.mode}:{c.uid}:{c.gid}" for c in evidence.components))
    except GuardError as exc:
        ev = exc.evidence
        comps = " ".join(f"{c['path']}:{c['mode']}:{c['uid']}:{c['gid']}:{'ok' if c['ok'] else 'BLOCKED'}"
                         for c in ev.get("components", []))
        who = ev.get("qemu_user") or {}
        return ParityCheck(status=FAIL, check="qemu_access", detail=f"{exc.code}: {exc.message}", remediation=fix,
                           hard=True, evidence=f"qemu user {who.get('name', '?')} uid={who.get('uid', '?')} "
                                               f"({who.get('source', '?')}); {comps or _kv(ev)}")
    return ParityCheck(status=PASS, check="qemu_access", hard=True,
                       detail=f"{user.name} (uid {user.uid}) can reach {LIBVIRT_IMAGES} and {seed_dir}",
                       evidence=f"qemu user from {user.source}; path:mode:uid:gid " + " | ".join(seen))


def build_parity_report(host: HostRoot, target: NetTarget | None = None, sockets: prereqs.SocketPaths | None = None,
                        *, answering_task: bool = False,
                        evidence: SliceNetworkEvidence | None = None,
                        slice_config: SliceConfig | None = None,
                        profiles: list[RuntimeProfile] | None = None,
                        report: TopologyReport | None = None) -> ParityReport:
    """Run every check against ``host`` (blocking: sysfs reads, /proc, netlink, iptables, socket probes).

    ``slice_config``: where the agent writes reservations and seed ISOs (defaults: the agent's);
    ``profiles``: the runtime profiles this host is to run (default: the catalog default, which asks
    for 1 GiB hugepages).
    """
    target = target or NetTarget()
    sockets = sockets or prereqs.SocketPaths.from_env()
    slice_config = slice_config or SliceConfig()
    profiles = profiles if profiles is not None else [get_profile(DEFAULT_PROFILE)]
    evidence = evidence or read_network_evidence(host, target)
    report = report or discover(host, PlanConfig(subnet=target.subnet, ovs_bridge=target.ovs_bridge))
    dnsmasq = read_dnsmasq_evidence(host, slice_config.dnsmasq_hosts_file, slice_config.dnsmasq_pid_file)
    checks = [
        prereqs.check_node_agent(host, answering_task=answering_task),
        kvm_check(host),
        prereqs.check_iommu(host),
        prereqs.check_vfio(host),
        prereqs.check_sriov(host),
        prereqs.check_slot_candidates(report),
        prereqs.check_gpu_driver(report),
        prereqs.check_gpu_host_services(host, report),
        # Inside the unit's sandbox: a slot device added since the sysfs drop-in was loaded is named here.
        sysfs_writable_check(*plan_writes(host, slot_functions(report))),
        check_nvswitch_partition(report),
        prereqs.check_ovmf(host),
        prereqs.check_hugepages(host, profiles, [s.numa_node for s in report.candidate_slots if not s.blockers]
                                or [s.numa_node for s in report.candidate_slots]),
        prereqs.check_rdma(host),
        fabric_isolation_check(host, slice_config.fabric_isolation, report),
        prereqs.check_libvirt(host, sockets),
        qemu_access_check(host, slice_config.seed_dir),
        prereqs.check_openvswitch(host, sockets),
        *prereqs.network_checks(evidence, dnsmasq),
        prereqs.check_historical_service(host),
        prereqs.check_reboot_required(host),
    ]
    if slice_config.firmware_baseline:  # judged only where the site says what it allows
        checks.append(check_firmware_baseline(read_firmware(host), slice_config.firmware_baseline))
    return ParityReport.from_checks(checks, source=evidence.source, root=str(host.root), netns=target.netns)


def preflight_handler(host_root: Path, *, subnet: str = "10.100.0.0/24", ovs_bridge: str = "ovsbr0",
                      sockets: prereqs.SocketPaths | None = None, slice_config: SliceConfig | None = None,
                      profiles: list[RuntimeProfile] | None = None) -> Handler:
    """The worker's handler: the parity report as output; hard failures are in it, not a task failure.

    The control plane reads ``failures`` and the checks; a preflight that ran
    and found blockers has still succeeded at its job (saying what blocks).
    ``slice_config``: the daemon's ``[slice]`` (hosts file, pid file, seed dir); ``subnet`` and
    ``ovs_bridge`` are taken from it when given.
    """

    async def handle(payload: PreflightPayload, ctx: TaskContext) -> dict[str, Any]:
        await ctx.progress("preflight", "started")
        if slice_config is not None:
            target = NetTarget(subnet=slice_config.subnet, ovs_bridge=slice_config.ovs_bridge)
        else:
            target = NetTarget(subnet=ipaddress.IPv4Network(subnet, strict=True), ovs_bridge=ovs_bridge)
        report = await asyncio.to_thread(
            lambda: build_parity_report(HostRoot.open(host_root), target, sockets, answering_task=True,
                                        slice_config=slice_config, profiles=profiles))
        await ctx.progress("preflight", "succeeded", percent=100,
                           detail={"failures": report.failures, "warnings": report.warnings})
        return report.model_dump(mode="json")

    return handle
