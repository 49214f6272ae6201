"""Every task type the agent serves, in one table: its payload model, handler factory, concurrency, and needs.

The daemon builds its handlers from :data:`TASKS` (after building the host drivers once,
the :class:`~gpuaas_agent.tasks.drivers.SliceDrivers`), and the worker's concurrency from it
(:func:`concurrency_for`: the config's ``[concurrency]`` table, else these defaults; the config
never imports this table, which is above it). The wire types and payload models stay in
:mod:`gpuaas_agent.contract.tasks` (contract never imports upward); this table refers to them.

A type in the contract with no row here is answered ``not_implemented`` by the worker; a row
that ``needs_slice_host`` is served only when the daemon built the slice drivers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.tasks import PAYLOADS, TaskType
from gpuaas_agent.discovery.prereqs import SocketPaths
from gpuaas_agent.tasks.admission import slice_plan_config
from gpuaas_agent.tasks.console_log import console_log_handler
from gpuaas_agent.tasks.context import Handler
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.maintenance import maintenance_handler
from gpuaas_agent.tasks.plan import plan_handler
from gpuaas_agent.tasks.power import power_handler
from gpuaas_agent.tasks.preflight import preflight_handler
from gpuaas_agent.tasks.provision import provision_handler
from gpuaas_agent.tasks.quarantine import quarantine_handler, unquarantine_handler
from gpuaas_agent.tasks.reconcile import reconcile_handler
from gpuaas_agent.tasks.release_set import release_set_handler
from gpuaas_agent.tasks.terminal import terminal_handler
from gpuaas_agent.tasks.topology import topology_discover_handler

# A row's payload model (named outside TaskSpec, whose ``type`` field hides the builtin there).
PayloadModel: TypeAlias = type[WireModel]
# How a row builds its handler: from the config and the slice drivers (None: the daemon built none).
HandlerFactory: TypeAlias = Callable[[AgentConfig, SliceDrivers | None], Handler]


@dataclass(frozen=True)
class TaskSpec:
    """One task type: how to build its handler and how many may run at once on this host."""

    type: TaskType
    make_handler: HandlerFactory
    concurrency: int
    needs_slice_host: bool = False

    @property
    def payload_model(self) -> PayloadModel:
        return PAYLOADS[self.type]


def preflight_sockets(config: AgentConfig) -> SocketPaths:
    """Preflight probes the daemons the slice pipelines use: the configured ovsdb, not the default one."""
    remote = config.slice.ovsdb_remote
    return SocketPaths(ovsdb=remote.removeprefix("unix:")) if remote.startswith("unix:") else SocketPaths()


def with_drivers(make: Callable[[SliceDrivers], Handler]) -> HandlerFactory:
    """The factory of a row that ``needs_slice_host``: :func:`build_handlers` builds it only with the drivers."""

    def build(config: AgentConfig, drivers: SliceDrivers | None) -> Handler:
        assert drivers is not None, "a needs_slice_host row is built only when the daemon built the slice drivers"
        return make(drivers)

    return build


TASKS: tuple[TaskSpec, ...] = (
    TaskSpec(TaskType.topology_discover,
             lambda config, drivers: topology_discover_handler(config.host_root, config.slice.gateway), concurrency=2),
    TaskSpec(TaskType.preflight,
             lambda config, drivers: preflight_handler(config.host_root, sockets=preflight_sockets(config),
                                                       slice_config=config.slice), concurrency=1),
    TaskSpec(TaskType.plan,
             lambda config, drivers: plan_handler(config.host_root, slice_plan_config(config.slice),
                                                  fabric=drivers.fabric if drivers is not None else None),
             concurrency=1),
    # One per slot: 8 concurrent provisions take as long as the slowest.
    TaskSpec(TaskType.vm_provision, with_drivers(provision_handler), concurrency=8, needs_slice_host=True),
    # A multi-slot payload (v1.1 ``slots``) releases every slot of the set; one slot: tasks/release.py as before.
    TaskSpec(TaskType.vm_release, with_drivers(release_set_handler), concurrency=8, needs_slice_host=True),
    TaskSpec(TaskType.reconcile, with_drivers(reconcile_handler), concurrency=1, needs_slice_host=True),
    # One per slot; the slot lock serialises power, provision and release of one slot.
    TaskSpec(TaskType.vm_power, with_drivers(power_handler), concurrency=8, needs_slice_host=True),
    # The terminal relay: the sessions outlive their open task; these bound the tasks, the config bounds
    # the sessions ([slice.terminal] max_sessions, max_sessions_per_slice).
    TaskSpec(TaskType.terminal_open, with_drivers(lambda drivers: terminal_handler(drivers, "open")), concurrency=4,
             needs_slice_host=True),
    TaskSpec(TaskType.terminal_data, with_drivers(lambda drivers: terminal_handler(drivers, "data")), concurrency=8,
             needs_slice_host=True),
    TaskSpec(TaskType.terminal_resize, with_drivers(lambda drivers: terminal_handler(drivers, "resize")), concurrency=4,
             needs_slice_host=True),
    TaskSpec(TaskType.terminal_close, with_drivers(lambda drivers: terminal_handler(drivers, "close")), concurrency=4,
             needs_slice_host=True),
    # Reads a file: no slot lock, so it never waits behind a provision or release of the slot.
    TaskSpec(TaskType.console_log, with_drivers(console_log_handler), concurrency=4, needs_slice_host=True),
    # Fleet operations: the host's own state (store and a read of the host), so served with or without slice
    # drivers; one at a time, they are rare and an operator's.
    TaskSpec(TaskType.maintenance, lambda config, drivers: maintenance_handler(), concurrency=1),
    TaskSpec(TaskType.quarantine, lambda config, drivers: quarantine_handler(config), concurrency=1),
    TaskSpec(TaskType.unquarantine, lambda config, drivers: unquarantine_handler(config, drivers), concurrency=1),
)


def default_concurrency() -> dict[TaskType, int]:
    """How many tasks of each type may run at once unless the config says otherwise."""
    return {spec.type: spec.concurrency for spec in TASKS}


def concurrency_for(config: AgentConfig) -> dict[TaskType, int]:
    """The config's ``[concurrency]`` table when it has one (it replaces the defaults whole), else the defaults."""
    return dict(config.concurrency) if config.concurrency is not None else default_concurrency()


def build_handlers(config: AgentConfig, slice_host: SliceDrivers | None = None,
                   tasks: tuple[TaskSpec, ...] = TASKS) -> Mapping[TaskType, Handler]:
    """The worker's handlers; without ``slice_host`` only the read-only tasks are served."""
    return {spec.type: spec.make_handler(config, slice_host) for spec in tasks
            if slice_host is not None or not spec.needs_slice_host}
