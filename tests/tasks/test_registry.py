"""One table of task types: every contract type has exactly one row, and the daemon and worker read it.

A row is the only declaration of its task: its handler, its recovery and what they need (``TaskDeps``,
which the daemon fills) are built from it, and nothing replaces a built row afterwards.
"""

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest

from gpuaas_agent.config import AgentConfig, SliceConfig
from gpuaas_agent.contract.fleet import ComponentKind, ComponentRef, QuarantineReason, RecheckVerdict
from gpuaas_agent.contract.tasks import PAYLOADS, TaskEnvelope, TaskType, UnquarantinePayload
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.daemon import default_tasks, task_deps
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.operator.health_quarantine import all_rechecks
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.quarantine import quarantine_component
from gpuaas_agent.tasks.registry import (
    TASKS,
    OnFirstTask,
    RegistryError,
    TaskDeps,
    TaskSpec,
    build_tasks,
    concurrency_for,
    default_concurrency,
)
from gpuaas_agent.tasks.release_set import release_set_recovery
from tests.support.pipeline_ctx import JournalCtx


def test_every_task_type_has_one_row_with_its_contract_payload():
    assert sorted(spec.type.value for spec in TASKS) == sorted(t.value for t in TaskType)
    assert all(spec.payload_model is PAYLOADS[spec.type] for spec in TASKS)
    assert all(spec.concurrency >= 1 for spec in TASKS)


def test_config_and_worker_defaults_are_the_registry_concurrency():
    assert default_concurrency()[TaskType.vm_provision] == 8
    assert WorkerSettings().concurrency == default_concurrency()
    assert AgentConfig().concurrency is None  # no [concurrency] table: the config names no number of its own
    assert concurrency_for(AgentConfig()) == default_concurrency()


def test_without_slice_drivers_only_the_read_only_tasks_are_served():
    handlers = build_tasks(TaskDeps(AgentConfig())).handlers
    assert set(handlers) == {spec.type for spec in TASKS if not spec.needs_slice_host}
    # The fleet operations act on the host's own state: a box without slice drivers is put in maintenance too.
    assert set(handlers) == {TaskType.topology_discover, TaskType.preflight, TaskType.plan, TaskType.maintenance,
                             TaskType.quarantine, TaskType.unquarantine}


def _drivers(tmp_path) -> SliceDrivers:
    return SliceDrivers(host_root=tmp_path, slice=SliceConfig(), images=ImageCache(tmp_path / "cache"),
                        libvirt=LibvirtLifecycle("test:///default"))


def test_the_recoveries_are_the_ones_the_rows_declare(tmp_path):
    """Provision and release declare their recovery in their rows; the built recoveries are exactly those."""
    declared = {spec.type for spec in TASKS if spec.make_recovery is not None}
    assert declared == {TaskType.vm_provision, TaskType.vm_release}
    built = build_tasks(TaskDeps(AgentConfig(), drivers=_drivers(tmp_path)))
    assert set(built.recoveries) == declared and set(built.handlers) == {spec.type for spec in TASKS}
    release_row = next(spec for spec in TASKS if spec.type is TaskType.vm_release)
    assert release_row.make_recovery is not None
    recovery = built.recoveries[TaskType.vm_release]
    assert isinstance(recovery, OnFirstTask)  # its module is imported by the first task that needs it
    assert recovery.resolve().__qualname__ == release_set_recovery(_drivers(tmp_path)).__qualname__
    # Without the drivers, neither the handlers nor the recoveries of the slice rows are built.
    assert build_tasks(TaskDeps(AgentConfig())).recoveries == {}


def test_a_recovery_is_found_from_its_row_never_from_an_attribute_of_the_handler():
    async def handle(payload, ctx):
        return {}

    async def recover(payload, ctx):
        return {"recovered": True}

    handle.recover = recover  # what the worker once looked for: now nothing reads it
    undeclared = TaskSpec(TaskType.maintenance, lambda deps: handle, concurrency=1)
    assert build_tasks(TaskDeps(AgentConfig()), (undeclared,)).recoveries == {}
    declared = TaskSpec(TaskType.maintenance, lambda deps: handle, concurrency=1, make_recovery=lambda deps: recover)
    assert build_tasks(TaskDeps(AgentConfig()), (declared,)).recoveries == {TaskType.maintenance: recover}


def test_a_row_whose_declared_recovery_builds_nothing_fails_loudly():
    async def handle(payload, ctx):
        return {}

    missing = TaskSpec(TaskType.maintenance, lambda deps: handle, concurrency=1, make_recovery=lambda deps: None)
    with pytest.raises(RegistryError, match="recovery factory of slice.maintenance"):
        build_tasks(TaskDeps(AgentConfig()), (missing,))


def test_every_row_builds_its_handler_module_when_its_first_task_arrives(tmp_path):
    """Each row's handler is an :class:`OnFirstTask` whose module is imported when it first runs: every row
    resolves to a callable (a broken import fails here, not at a host's first task of that type)."""
    built = build_tasks(TaskDeps(AgentConfig(host_root=tmp_path), drivers=_drivers(tmp_path)))
    for task_type, handler in [*built.handlers.items(), *built.recoveries.items()]:
        assert isinstance(handler, OnFirstTask), task_type
        resolved = handler.resolve()
        assert callable(resolved) and not isinstance(resolved, OnFirstTask), task_type
        assert handler.resolve() is resolved  # built once, then reused


def test_the_first_task_imports_its_handler_off_the_event_loop_and_once():
    built_on: list[int] = []

    async def handle(payload, ctx):
        return {"ran": True}

    def build():
        built_on.append(threading.get_ident())
        return handle

    deferred = OnFirstTask(build)

    async def two_tasks():
        return threading.get_ident(), await deferred(object(), None), await deferred(object(), None)

    loop_thread, first, second = asyncio.run(two_tasks())
    assert first == second == {"ran": True}
    assert len(built_on) == 1 and built_on[0] != loop_thread


def test_a_deferred_factory_that_builds_nothing_fails_loudly_at_its_first_task():
    deferred = OnFirstTask(lambda: None)
    with pytest.raises(RegistryError, match="not a callable"):
        asyncio.run(deferred(object(), None))


def test_a_slice_row_built_without_the_drivers_fails_loudly():
    slice_row = next(spec for spec in TASKS if spec.type is TaskType.vm_provision)
    with pytest.raises(RegistryError, match="needs_slice_host"):
        slice_row.make_handler(TaskDeps(AgentConfig()))


def test_the_daemon_passes_every_rooms_rechecks_to_the_unquarantine_row():
    """The BMC and XID re-checks live in the operator room, above this one: the daemon's TaskDeps carries them to
    the row (no block in the daemon replaces the row's handler)."""
    deps = task_deps(AgentConfig())
    assert dict(deps.rechecks).keys() == all_rechecks().keys()
    assert {QuarantineReason.bmc_failed, QuarantineReason.gpu_xid} <= set(deps.rechecks)
    assert QuarantineReason.bmc_failed not in TaskDeps(AgentConfig()).rechecks  # the tasks room's own table
    assert set(default_tasks(AgentConfig()).handlers) == set(build_tasks(TaskDeps(AgentConfig())).handlers)


def test_the_unquarantine_row_runs_the_rechecks_it_was_given(tmp_path):
    """What the row needs reaches the handler: a re-check passed in through TaskDeps is the one that runs."""
    seen: list[QuarantineReason] = []

    async def passing(ctx, record):
        seen.append(record.reason)
        return RecheckVerdict(check="injected", passed=True, detail="injected re-check")

    store = StateStore.open(tmp_path / "state.db")
    try:
        asyncio.run(quarantine_component(store, ComponentKind.gpu, "0000:18:00.0", QuarantineReason.bmc_failed,
                                         {"why": "test"}, "t-0"))
        row = next(spec for spec in TASKS if spec.type is TaskType.unquarantine)
        handler = row.make_handler(TaskDeps(AgentConfig(host_root=tmp_path),
                                            rechecks={QuarantineReason.bmc_failed: passing}))
        ctx = JournalCtx(store=store, envelope=TaskEnvelope(
            task_id="t-1", type=TaskType.unquarantine.value, node_id="node-1", attempt=1,
            deadline=datetime.now(UTC) + timedelta(minutes=5), payload={}))
        payload = UnquarantinePayload(component=ComponentRef(kind=ComponentKind.gpu, identity="0000:18:00.0"),
                                      reason="the BMC says it is fine again", requested_by="test")
        out = asyncio.run(handler(payload, ctx))
        assert seen == [QuarantineReason.bmc_failed] and out["recheck"]["check"] == "injected"
        assert store.quarantined() == []
    finally:
        store.close()
