"""One table of task types: every contract type has exactly one row, and the daemon and worker read it."""

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.tasks import PAYLOADS, TaskType
from gpuaas_agent.control.worker import WorkerSettings
from gpuaas_agent.tasks.registry import TASKS, build_handlers, concurrency_for, default_concurrency


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
    handlers = build_handlers(AgentConfig())
    assert set(handlers) == {spec.type for spec in TASKS if not spec.needs_slice_host}
    # The fleet operations act on the host's own state: a box without slice drivers is put in maintenance too.
    assert set(handlers) == {TaskType.topology_discover, TaskType.preflight, TaskType.plan, TaskType.maintenance,
                             TaskType.quarantine, TaskType.unquarantine}
