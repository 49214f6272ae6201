"""``slice.preflight`` (and ``gpuaas-agent preflight|parity``): every slice-host prerequisite as a parity check.

Seed 002 Phase 5 (IOMMU, VFIO, SR-IOV, OVS, libvirt, UEFI, reboot state) and
the seed 004 parity target (ovsbr0 + gateway, dnsmasq, NAT, ip_forward, IPoIB
netplan/address/route, tmfifo, historical service names), one line each in
the seed's format; hard failures make the report FAIL.
"""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path

from gpuaas_agent.contract.parity import ParityReport, SliceNetworkEvidence
from gpuaas_agent.contract.tasks import PreflightPayload
from gpuaas_agent.discovery import prereqs
from gpuaas_agent.discovery.netevidence import NetTarget, read_network_evidence
from gpuaas_agent.hostfs import HostRoot


def build_parity_report(host: HostRoot, target: NetTarget | None = None, sockets: prereqs.SocketPaths | None = None,
                        *, answering_task: bool = False,
                        evidence: SliceNetworkEvidence | None = None) -> ParityReport:
    """Run every check against ``host`` (blocking: sysfs reads, netlink, iptables, socket probes)."""
    target = target or NetTarget()
    sockets = sockets or prereqs.SocketPaths.from_env()
    evidence = evidence or read_network_evidence(host, target)
    checks = [
        prereqs.check_node_agent(host, answering_task=answering_task),
        prereqs.check_kvm(host),
        prereqs.check_iommu(host),
        prereqs.check_vfio(host),
        prereqs.check_sriov(host),
        prereqs.check_ovmf(host),
        prereqs.check_hugepages(host),
        prereqs.check_rdma(host),
        prereqs.check_libvirt(host, sockets),
        prereqs.check_openvswitch(host, sockets),
        *prereqs.network_checks(evidence),
        prereqs.check_historical_service(host),
        prereqs.check_reboot_required(host),
    ]
    return ParityReport.from_checks(checks, source=evidence.source, root=str(host.root), netns=target.netns)


def preflight_handler(host_root: Path, *, subnet: str = "10.100.0.0/24", ovs_bridge: str = "ovsbr0",
                      sockets: prereqs.SocketPaths | None = None):
    """The worker's handler: the parity report as output; hard failures are in it, not a task failure.

    The control plane reads ``failures`` and the checks; a preflight that ran
    and found blockers has still succeeded at its job (saying what blocks).
    """

    async def handle(payload: PreflightPayload, ctx) -> dict:
        await ctx.progress("preflight", "started")
        target = NetTarget(subnet=ipaddress.IPv4Network(subnet, strict=True), ovs_bridge=ovs_bridge)
        report = await asyncio.to_thread(
            lambda: build_parity_report(HostRoot.open(host_root), target, sockets, answering_task=True))
        await ctx.progress("preflight", "succeeded", percent=100,
                           detail={"failures": report.failures, "warnings": report.warnings})
        return report.model_dump(mode="json")

    return handle
