"""The host-side handles a slice pipeline uses, built once per daemon from the config.

Tasks get drivers from here instead of constructing them, so the lab-in-a-box
and the tests point a whole pipeline at private daemons (ovsdb socket, libvirt
URI, dnsmasq files) by configuration alone; no code path differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from gpuaas_agent.config import AgentConfig, FabricManagerConfig, SliceConfig, tls_context
from gpuaas_agent.contract.terminal import CloseReason
from gpuaas_agent.host.devices.fabricmanager import FabricManager
from gpuaas_agent.host.images.cache import ImageCache, SourcePolicy
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations
from gpuaas_agent.host.network.fabricvf import FabricVfNetlink
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.host.vm.consolelog import log_path as console_log_path
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.tasks.isolation import unisolate_port
from gpuaas_agent.tasks.power_line import PowerLine

if TYPE_CHECKING:
    from gpuaas_agent.host.devices.gpuadmin import GpuAdminTool

# Files QEMU opens (firmware) live on the machine the agent runs on, whatever host_root says:
# on a recorded fixture (the lab) the sysfs is recorded but OVMF is this machine's.
SYSTEM_ROOT = Path("/")


class TerminalSessions(Protocol):
    """What the drivers ask of the node's terminal relay (``tasks/terminal.py`` builds it and imports this
    module; this module never imports it back): end every session, or the sessions into one slot."""

    async def close_all(self, reason: CloseReason) -> int: ...

    async def close_slot(self, allocation_id: str, slot_index: int, reason: CloseReason) -> int: ...

    def counts(self) -> tuple[int, int]: ...


RelayT = TypeVar("RelayT", bound=TerminalSessions)


def fabric_manager(config: FabricManagerConfig | None) -> FabricManager | None:
    """The host's Fabric Manager client from ``[slice.fabric_manager]`` (None where it is not configured)."""
    if config is None:
        return None
    return FabricManager(fmpm=str(config.fmpm), timeout_s=config.timeout_s, hostname=config.hostname)


@dataclass
class SliceDrivers:
    host_root: Path
    slice: SliceConfig
    images: ImageCache
    libvirt: LibvirtLifecycle
    # One provision per slot runs at a time, whatever the task ids say (two tasks for one slot race otherwise).
    _slot_locks: dict[int, asyncio.Lock] = field(default_factory=dict)
    # The power operations per slot: one runs, at most one waits, the newest wins (tasks/power_line.py).
    power_line: PowerLine = field(default_factory=PowerLine)
    # The node's live terminal sessions (slice.terminal_*), made on first use: one relay per daemon.
    _terminals: TerminalSessions | None = None
    # NVIDIA's GPU admin tool as the release's gpu_handover runs it; None: the configured or installed one.
    gpu_tool: GpuAdminTool | None = None
    # NVIDIA Fabric Manager (NVSwitch hosts whose config has [slice.fabric_manager]); None: not used.
    fabric: FabricManager | None = None
    # The slots' fabric VFs on their PFs (host/network/fabricvf.py): the host's own netlink.
    fabric_vf: FabricVfNetlink = field(default_factory=FabricVfNetlink)
    # The guest exporter's port (``guest_exporter_port``): the host may open it into an opted-in guest only
    # (host/network/nftguard.py); None: into no guest.
    guest_exporter_port: int | None = None

    @classmethod
    def from_config(cls, config: AgentConfig) -> SliceDrivers:
        return cls(
            host_root=config.host_root,
            slice=config.slice,
            images=ImageCache(
                config.image_cache_dir, state_dir=config.state_dir,
                policy=SourcePolicy(https_hosts=config.slice.image_https_hosts, file_dir=config.slice.image_file_dir,
                                    allow_loopback_http=config.slice.allow_loopback_http),
                ssl_context=functools.partial(tls_context, config.slice.image_ca_bundle),  # on first download
                max_bytes=config.slice.image_max_bytes, stall_timeout_s=config.slice.image_stall_timeout_s,
                cache_max_bytes=config.slice.image_cache_max_bytes,
                min_free_bytes=config.slice.image_cache_min_free_bytes),
            libvirt=LibvirtLifecycle(config.slice.libvirt_uri),
            fabric=fabric_manager(config.slice.fabric_manager),
            guest_exporter_port=config.guest_exporter_port,
        )

    def discovered_root(self) -> HostRoot:
        """The host as discovery reads it: the live host's /sys, /dev, /run, or a recorded fixture (the lab)."""
        return HostRoot.open(self.host_root)

    def local_root(self) -> HostRoot:
        """This machine's own / (where QEMU opens firmware and seeds), whatever host_root says."""
        return HostRoot.open(SYSTEM_ROOT)

    def gpu_admin(self) -> GpuAdminTool:
        """The GPU admin tool (refuses ``gpu_handover_tool_missing`` when it is not there)."""
        if self.gpu_tool is None:
            # The GPU handover's tools: a release's, not an idle host's (docs/performance.md, idle footprint).
            from gpuaas_agent.guards.gpureset import resolve_gpu_tool
            from gpuaas_agent.host.devices.gpuadmin import GpuAdminTool

            return GpuAdminTool(script=resolve_gpu_tool(self.slice.gpu_admin_tool))
        return self.gpu_tool

    def reservations(self) -> DnsmasqReservations:
        return DnsmasqReservations(self.slice.dnsmasq_hosts_file, self.slice.subnet, self.slice.gateway,
                                   self.slice.dnsmasq_pid_file)

    @contextlib.asynccontextmanager
    async def ovs(self) -> AsyncIterator[OvsDriver]:
        """An IDL connection for one pipeline; opened and closed off the event loop (it blocks)."""
        driver = await asyncio.to_thread(OvsDriver, self.slice.ovsdb_remote)
        try:
            yield driver
        finally:
            await asyncio.to_thread(driver.close)

    def slot_lock(self, slot_index: int) -> asyncio.Lock:
        return self._slot_locks.setdefault(slot_index, asyncio.Lock())

    def seed_path(self, allocation_id: str, slot_index: int) -> Path:
        return self.slice.seed_dir / f"{allocation_id}-slot{slot_index}.iso"

    def console_log_path(self, allocation_id: str, slot_index: int) -> Path:
        """Where libvirt writes the slot's serial console (prepare-host made the directory, 0700)."""
        return console_log_path(self.slice.console_log_dir, allocation_id, slot_index)

    # -- teardown shared by provision's compensations and release's steps (idempotent) --------------

    async def unplug(self, bridge: str, port: str, allocation_id: str) -> dict[str, Any]:
        """Remove the port, then its isolation flows (by its cookie) and its nft guard element."""
        async with self.ovs() as ovs:
            removed = await asyncio.to_thread(ovs.remove_vm_port, bridge, port, allocation_id=allocation_id)
        isolation = await unisolate_port(self, bridge, port)
        return {"port": port, "removed": removed, **isolation}

    async def unreserve(self, allocation_id: str, slot_index: int) -> dict[str, Any]:
        """Remove the slot's reservation; dnsmasq is signalled only when the file changed."""
        reservations = self.reservations()
        removed = await asyncio.to_thread(reservations.remove, allocation_id, slot_index)
        pid = await asyncio.to_thread(reservations.reload) if removed else None
        return {"removed": [r.model_dump(mode="json") for r in removed], "dnsmasq_pid": pid}

    def remove_seed(self, allocation_id: str, slot_index: int) -> dict[str, Any]:
        path = self.seed_path(allocation_id, slot_index)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return {"removed": existed}

    def terminals(self, make: Callable[[SliceDrivers], RelayT]) -> RelayT:
        """The node's one terminal relay, made by ``make`` on first use (``tasks.terminal.relay_of``)."""
        if self._terminals is None:
            self._terminals = make(self)
        return cast(RelayT, self._terminals)

    def registered(self) -> dict[str, int]:
        """Terminal sessions (registered, still connecting) and power tasks in the lines: the daemon's status."""
        live, opening = self._terminals.counts() if self._terminals is not None else (0, 0)
        return {"terminal_sessions": live, "terminal_opening": opening, "power_tasks": self.power_line.count()}

    async def close_terminals(self) -> int:
        """End every live terminal session (agent shutdown): each is audited and told why."""
        if self._terminals is None:
            return 0

        return await self._terminals.close_all(CloseReason.agent_shutdown)

    async def close_slot_terminals(self, allocation_id: str, slot_index: int) -> int:
        """End the terminal sessions into a slot that is being released (before its VM stops)."""
        if self._terminals is None:
            return 0

        return await self._terminals.close_slot(allocation_id, slot_index, CloseReason.allocation_inactive)

    async def close(self) -> None:
        await self.close_terminals()
        await self.libvirt.close()
