"""Hosts a test injects into ``daemon.run_agent`` (its ``host=``) instead of the daemon branching on "no drivers".

:class:`ReadOnlyHost`: a node with no slice drivers, serving the read-only tasks only (discovery,
preflight, ...): no image cache, no console logs, no boot recovery, no reconcile timer, no isolation
probe. For agents whose test is about the control channel, not the slice host.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from nats.aio.client import Client

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.drift import DriftReport
from gpuaas_agent.daemon import Reconcile, default_tasks
from gpuaas_agent.operator.metrics import LiveState
from gpuaas_agent.operator.netwatch import Probe
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.tasks.registry import BuiltTasks


class ReadOnlyHost:
    """The daemon's host part without slice drivers (satisfies ``daemon.NodeHost``)."""

    def __init__(self) -> None:
        self.closed = False

    def tasks(self, config: AgentConfig) -> BuiltTasks:
        return default_tasks(config)

    def start(self) -> None:
        pass

    def isolation_probe(self, store: StoreThread) -> Probe | None:
        return None

    def health_probes(self, store: StoreThread) -> list[Probe]:
        return []

    def sample(self, live: LiveState) -> None:
        pass

    def registered(self) -> dict[str, int]:
        return {}

    def loops(self, config: AgentConfig, store: StoreThread) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return []

    async def boot_recovery(self, store: StoreThread) -> DriftReport | None:
        return None

    def reconcile(self, store: StoreThread, nc: Client, node_id: str) -> Reconcile | None:
        return None

    def domain_stats(self) -> None:
        return None  # no libvirt: no slice telemetry

    async def close_terminals(self) -> None:
        pass

    async def aclose(self) -> None:
        self.closed = True
