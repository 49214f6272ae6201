"""``slice.topology_discover``: the discovery report of this host, for operator review of candidate slots."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path
from typing import Any

from gpuaas_agent.contract.tasks import TopologyDiscoverPayload
from gpuaas_agent.discovery.netevidence import NetTarget, read_network_evidence
from gpuaas_agent.discovery.quarantine import mark_quarantined
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.discovery.slots import PlanConfig
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.tasks.context import Handler, TaskContext


def topology_discover_handler(host_root: Path, gateway: ipaddress.IPv4Address | None = None) -> Handler:
    """Discovery over the configured host root, the report as JSON.

    ``gateway``: the host's slice gateway (``SliceConfig``); used when the payload's subnet holds
    it, so the suggested IPs are the ones a provision's validate compares against.
    """

    async def handle(payload: TopologyDiscoverPayload, ctx: TaskContext) -> dict[str, Any]:
        await ctx.progress("discover", "started")
        subnet = ipaddress.IPv4Network(payload.subnet, strict=True)
        plan = PlanConfig(subnet=subnet, gateway=gateway if gateway is not None and gateway in subnet else None,
                          ovs_bridge=payload.ovs_bridge)
        # sysfs walks block: keep them off the event loop so keepalives and heartbeats go on.
        quarantined = await as_store_thread(ctx.store).quarantined()  # their slots carry a blocker naming them
        report = await asyncio.to_thread(lambda: mark_quarantined(discover(HostRoot.open(host_root), plan), quarantined))
        await ctx.progress("discover", "succeeded", percent=100, detail={"candidate_slots": report.summary.candidate_slots})
        # Seed 004 (2026-04-24): topology also reports live slice_network evidence; the
        # discovery report itself stays as it was, the evidence sits beside it.
        target = NetTarget(subnet=plan.subnet, ovs_bridge=plan.ovs_bridge)
        network = await asyncio.to_thread(lambda: read_network_evidence(HostRoot.open(host_root), target))
        await ctx.progress("slice_network", "succeeded", detail={"blockers": [b.code for b in network.blockers]})
        return {**report.model_dump(mode="json"), "slice_network": network.model_dump(mode="json")}

    return handle
