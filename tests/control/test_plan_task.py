"""slice.plan end to end through the real JetStream worker: leases land in the state store."""

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.daemon import default_tasks
from tests.conftest import fixture_host
from tests.support.deadline import run_bounded
from tests.support.provision_inputs import PLAN_ALLOCATION_ID, approved_slot, plan_payload, topology_of
from tests.support.worker_harness import NODE, Harness


def test_plan_task_leases_the_slots_and_a_second_allocation_is_refused(nats_server, tmp_path):
    config = AgentConfig(host_root=fixture_host("h200-slice-after-transition"), state_dir=tmp_path / "state")
    report = topology_of()
    mine = plan_payload(approved_slot(report, 2), approved_slot(report, 3)).model_dump(mode="json")
    theirs = plan_payload(approved_slot(report, 3), alloc="158ea147-0115-407f-bbd5-1850c32b9517").model_dump(mode="json")

    async def body():
        async with Harness(nats_server, tmp_path, default_tasks(config).handlers) as h:
            done = await h.run_task_to_result(h.plane.envelope(NODE, TaskType.plan.value, mine))
            assert done.status == ResultStatus.succeeded, done.error
            assert [s["slot_index"] for s in done.output["slots"]] == [2, 3]
            assert [l.slot_index for l in h.store.leases_of(PLAN_ALLOCATION_ID)] == [2, 3]
            refused = await h.run_task_to_result(h.plane.envelope(NODE, TaskType.plan.value, theirs))
            assert (refused.status, refused.error.code) == (ResultStatus.failed, "lease_conflict")
            assert [l.slot_index for l in h.store.leases()] == [2, 3]

    run_bounded(body())
