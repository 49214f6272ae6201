"""Every task type the agent serves, in one table: its payload model, handler factory, recovery, concurrency, needs.

The daemon builds one :class:`TaskDeps` (the config, the host's slice drivers when it built them,
the quarantine re-checks of the rooms above this one) and the worker's handlers and recoveries
from :data:`TASKS` with it (:func:`build_tasks`); the worker's concurrency comes from the same
rows (:func:`concurrency_for`: the config's ``[concurrency]`` table, else these defaults; the
config never imports this table, which is above it). The wire types and payload models stay in
:mod:`gpuaas_agent.contract.tasks` (contract never imports upward); this table refers to them.

A row is the only place its task is declared: nothing overrides a row after it is built. What a
factory needs is a field of :class:`TaskDeps`, which the daemon fills (a row's factory never
reaches for a module-level table the daemon would have to replace). A row that declares a
``make_recovery`` gets its recovery run by the worker for a task interrupted mid-run that will not
run again (deadline passed, or poison): compensation only (control/taskpolicy.py).

A type in the contract with no row here is answered ``not_implemented`` by the worker; a row
that ``needs_slice_host`` is served only when the daemon built the slice drivers.

A row's handler module is imported when the row's first task arrives, not with the daemon
(:class:`OnFirstTask`; the factories below import inside their bodies): an idle daemon does not carry the
provision, release and terminal code it may never run (docs/performance.md, idle footprint). What a
factory checks up front (the slice drivers of a ``needs_slice_host`` row) it still checks when built.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.fleet import QuarantineReason
from gpuaas_agent.contract.tasks import PAYLOADS, TaskType
from gpuaas_agent.tasks.context import Handler, TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.recheck import RECHECKS, Recheck

if TYPE_CHECKING:
    from gpuaas_agent.discovery.prereqs import SocketPaths


class RegistryError(Exception):
    """A row of :data:`TASKS` that does not build what it declares (a wiring bug: the daemon must not start)."""


@dataclass(frozen=True)
class TaskDeps:
    """What the rows' factories are given, built once by the daemon and passed in.

    ``drivers``: the slice drivers (None: the daemon built none; only rows without ``needs_slice_host``
    are built). ``rechecks``: what ``slice.unquarantine`` re-runs per quarantine reason; the daemon merges
    the operator room's (BMC, NVML: ``operator/health_quarantine.all_rechecks``) into this room's
    :data:`~gpuaas_agent.tasks.recheck.RECHECKS`, which is the default.
    """

    config: AgentConfig
    drivers: SliceDrivers | None = None
    rechecks: Mapping[QuarantineReason, Recheck] = field(default_factory=lambda: dict(RECHECKS))

    def slice_drivers(self) -> SliceDrivers:
        """The drivers of a ``needs_slice_host`` row (built only when the daemon built them)."""
        if self.drivers is None:
            raise RegistryError("a needs_slice_host row is built only when the daemon built the slice drivers")
        return self.drivers


# A row's payload model (named outside TaskSpec, whose ``type`` field hides the builtin there).
PayloadModel: TypeAlias = type[WireModel]
# How a row builds its handler (or its recovery) from what the daemon passes in.
HandlerFactory: TypeAlias = Callable[[TaskDeps], Handler]


@dataclass(frozen=True)
class TaskSpec:
    """One task type: how to build its handler and its recovery, and how many may run at once on this host."""

    type: TaskType
    make_handler: HandlerFactory
    concurrency: int
    needs_slice_host: bool = False
    # The recovery of a run interrupted mid-way that will not run again (control/taskpolicy.py): None, nothing
    # to undo (a read, a task whose own next run or reconcile finishes what it left).
    make_recovery: HandlerFactory | None = None

    @property
    def payload_model(self) -> PayloadModel:
        return PAYLOADS[self.type]


@dataclass(frozen=True)
class BuiltTasks:
    """The worker's handlers and the recoveries their rows declare, keyed by task type."""

    handlers: Mapping[TaskType, Handler]
    recoveries: Mapping[TaskType, Handler] = field(default_factory=dict)


def preflight_sockets(config: AgentConfig) -> SocketPaths:
    """Preflight probes the daemons the slice pipelines use: the configured ovsdb, not the default one."""
    from gpuaas_agent.discovery.prereqs import SocketPaths  # preflight's readers: a preflight task's, not the daemon's

    remote = config.slice.ovsdb_remote
    return SocketPaths(ovsdb=remote.removeprefix("unix:")) if remote.startswith("unix:") else SocketPaths()


class OnFirstTask:
    """A row's handler, built (its module imported) when the first task of the row arrives.

    ``build`` is the row's factory with what it was given bound; it runs once (two tasks that arrive
    together may both run it: the import is idempotent and the factories are pure closures). The first
    task runs it in a thread: importing provision's pipeline took ~0.37 s on the loaded 2-core dev VM,
    which the event loop (heartbeats, keepalives, the other tasks) must not wait out.
    """

    def __init__(self, build: Callable[[], Handler]) -> None:
        self._build = build
        self._handler: Handler | None = None

    def resolve(self) -> Handler:
        """The row's handler itself, built now if no task has built it yet."""
        if self._handler is None:
            made = self._build()
            if not callable(made):
                raise RegistryError(f"a deferred factory built {made!r}, not a callable")
            self._handler = made
        return self._handler

    async def __call__(self, payload: Any, ctx: TaskContext) -> dict[str, Any]:
        handler = self._handler
        if handler is None:
            handler = await asyncio.to_thread(self.resolve)  # the module's import blocks: off the loop
        return await handler(payload, ctx)


def on_first_task(make: Callable[[TaskDeps], Handler]) -> HandlerFactory:
    """The factory of a row whose handler module is imported by its first task (``make`` imports it)."""

    def build(deps: TaskDeps) -> Handler:
        return OnFirstTask(lambda: make(deps))

    return build


def with_drivers(make: Callable[[SliceDrivers], Handler]) -> HandlerFactory:
    """The factory of a row that ``needs_slice_host``: :func:`build_tasks` builds it only with the drivers (checked
    when built); ``make`` imports the handler's module when the row's first task arrives."""

    def build(deps: TaskDeps) -> Handler:
        drivers = deps.slice_drivers()
        return OnFirstTask(lambda: make(drivers))

    return build


# -- the rows' factories: each imports its handler's module, so only a task of the row loads it -------------


def load_topology_discover(deps: TaskDeps) -> Handler:
    from gpuaas_agent.tasks.topology import topology_discover_handler

    return topology_discover_handler(deps.config.host_root, deps.config.slice.gateway)


def load_preflight(deps: TaskDeps) -> Handler:
    from gpuaas_agent.tasks.preflight import preflight_handler

    return preflight_handler(deps.config.host_root, sockets=preflight_sockets(deps.config),
                             slice_config=deps.config.slice)


def load_plan(deps: TaskDeps) -> Handler:
    from gpuaas_agent.tasks.plan import plan_handler
    from gpuaas_agent.tasks.provision_admission import slice_plan_config

    return plan_handler(deps.config.host_root, slice_plan_config(deps.config.slice),
                        fabric=deps.drivers.fabric if deps.drivers is not None else None)


def load_provision(drivers: SliceDrivers) -> Handler:
    from gpuaas_agent.tasks.provision import provision_handler

    return provision_handler(drivers)


def load_provision_recovery(drivers: SliceDrivers) -> Handler:
    from gpuaas_agent.tasks.provision import provision_recovery as recovery

    return recovery(drivers)


def load_release_set(drivers: SliceDrivers) -> Handler:
    from gpuaas_agent.tasks.release_set import release_set_handler

    return release_set_handler(drivers)


def load_release_set_recovery(drivers: SliceDrivers) -> Handler:
    from gpuaas_agent.tasks.release_set import release_set_recovery as recovery

    return recovery(drivers)


def load_reconcile(drivers: SliceDrivers) -> Handler:
    from gpuaas_agent.tasks.reconcile import reconcile_handler

    return reconcile_handler(drivers)


def load_power(drivers: SliceDrivers) -> Handler:
    from gpuaas_agent.tasks.power import power_handler

    return power_handler(drivers)


def load_terminal(operation: Literal["open", "data", "resize", "close"]) -> Callable[[SliceDrivers], Handler]:
    def load_terminal_operation(drivers: SliceDrivers) -> Handler:
        from gpuaas_agent.tasks.terminal import terminal_handler

        return terminal_handler(drivers, operation)

    return load_terminal_operation


def load_console_log(drivers: SliceDrivers) -> Handler:
    from gpuaas_agent.tasks.console_log import console_log_handler

    return console_log_handler(drivers)


def load_maintenance(deps: TaskDeps) -> Handler:
    from gpuaas_agent.tasks.maintenance import maintenance_handler

    return maintenance_handler()


def load_quarantine(deps: TaskDeps) -> Handler:
    from gpuaas_agent.tasks.quarantine import quarantine_handler

    return quarantine_handler(deps.config)


def load_unquarantine(deps: TaskDeps) -> Handler:
    from gpuaas_agent.tasks.quarantine import unquarantine_handler

    return unquarantine_handler(deps.config, deps.drivers, rechecks=deps.rechecks)


TASKS: tuple[TaskSpec, ...] = (
    TaskSpec(TaskType.topology_discover, on_first_task(load_topology_discover), concurrency=2),
    TaskSpec(TaskType.preflight, on_first_task(load_preflight), concurrency=1),
    TaskSpec(TaskType.plan, on_first_task(load_plan), concurrency=1),
    # One per slot: 8 concurrent provisions take as long as the slowest. An interrupted provision that will not
    # run again is compensated (or its slot blocked) by its recovery.
    TaskSpec(TaskType.vm_provision, with_drivers(load_provision), concurrency=8, needs_slice_host=True,
             make_recovery=with_drivers(load_provision_recovery)),
    # A multi-slot payload (v1.1 ``slots``) releases every slot of the set; one slot: tasks/release.py as before.
    TaskSpec(TaskType.vm_release, with_drivers(load_release_set), concurrency=8, needs_slice_host=True,
             make_recovery=with_drivers(load_release_set_recovery)),
    TaskSpec(TaskType.reconcile, with_drivers(load_reconcile), concurrency=1, needs_slice_host=True),
    # One per slot; the slot lock serialises power, provision and release of one slot.
    TaskSpec(TaskType.vm_power, with_drivers(load_power), concurrency=8, needs_slice_host=True),
    # The terminal relay: the sessions outlive their open task; these bound the tasks, the config bounds
    # the sessions ([slice.terminal] max_sessions, max_sessions_per_slice).
    TaskSpec(TaskType.terminal_open, with_drivers(load_terminal("open")), concurrency=4, needs_slice_host=True),
    TaskSpec(TaskType.terminal_data, with_drivers(load_terminal("data")), concurrency=8, needs_slice_host=True),
    TaskSpec(TaskType.terminal_resize, with_drivers(load_terminal("resize")), concurrency=4, needs_slice_host=True),
    TaskSpec(TaskType.terminal_close, with_drivers(load_terminal("close")), concurrency=4, needs_slice_host=True),
    # Reads a file: no slot lock, so it never waits behind a provision or release of the slot.
    TaskSpec(TaskType.console_log, with_drivers(load_console_log), concurrency=4, needs_slice_host=True),
    # Fleet operations: the host's own state (store and a read of the host), so served with or without slice
    # drivers; one at a time, they are rare and an operator's.
    TaskSpec(TaskType.maintenance, on_first_task(load_maintenance), concurrency=1),
    TaskSpec(TaskType.quarantine, on_first_task(load_quarantine), concurrency=1),
    # Returns a component only after the check that failed passes again: the re-checks the daemon passes in.
    TaskSpec(TaskType.unquarantine, on_first_task(load_unquarantine), concurrency=1),
)


def default_concurrency() -> dict[TaskType, int]:
    """How many tasks of each type may run at once unless the config says otherwise."""
    return {spec.type: spec.concurrency for spec in TASKS}


def concurrency_for(config: AgentConfig) -> dict[TaskType, int]:
    """The config's ``[concurrency]`` table when it has one (it replaces the defaults whole), else the defaults."""
    return dict(config.concurrency) if config.concurrency is not None else default_concurrency()


def _built(spec: TaskSpec, what: str, make: HandlerFactory, deps: TaskDeps) -> Handler:
    made = make(deps)
    if not callable(made):
        raise RegistryError(f"the {what} factory of {spec.type.value} built {made!r}, not a callable")
    return made


def build_tasks(deps: TaskDeps, tasks: tuple[TaskSpec, ...] = TASKS) -> BuiltTasks:
    """The worker's handlers and recoveries from the rows; without ``deps.drivers`` only the rows that do not
    ``needs_slice_host`` (the read-only tasks and the fleet operations). A factory that builds no callable
    raises :class:`RegistryError`: a row's declared recovery is never silently absent."""
    rows = [spec for spec in tasks if deps.drivers is not None or not spec.needs_slice_host]
    handlers = {spec.type: _built(spec, "handler", spec.make_handler, deps) for spec in rows}
    recoveries = {spec.type: _built(spec, "recovery", spec.make_recovery, deps)
                  for spec in rows if spec.make_recovery is not None}
    return BuiltTasks(handlers=handlers, recoveries=recoveries)
