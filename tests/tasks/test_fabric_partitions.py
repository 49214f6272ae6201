"""Fabric Manager partitions in placement, provision, release and reconcile (NVSwitch hosts).

FM's answers are the recorded ones of fixtures/fabricmanager/, replayed behind the real fmpm argv;
the store is a real SQLite state store on its thread; discovery reads the 8-GPU fixture host
(4 NVSwitches).
"""

from __future__ import annotations

import functools
import json

import pytest

from gpuaas_agent.contract.fabric import PartitionDriftKind, PartitionLease, PartitionState
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.guards.preconditions import PreconditionRefused
from gpuaas_agent.host.devices.fabricmanager import FabricManagerError, parse_partition_list
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.state.store import StateError, StateStore
from gpuaas_agent.tasks import fabric_partitions as fp
from gpuaas_agent.tasks.placement import NVSWITCH_WARNING
from gpuaas_agent.tasks.plan import lease_bundle, plan_bundle
from tests.support.deadline import run_bounded
from tests.support.fabric_manager import GPUS, LIST, recorded_fm
from tests.support.provision_inputs import PLAN_ALLOCATION_ID, approved_slot, plan_payload
from tests.support.provision_inputs import topology_of as _discover

NVLINK = get_profile("h200_nvlink_24c_64g")
PLAIN = get_profile("h200_1g_24c_64g")
OTHER = "158ea147-0115-407f-bbd5-1850c32b9517"
topology_of = functools.cache(_discover)  # one discovery of the fixture host for the module (reports are frozen)


def _listed(active=()):
    doc = json.loads(LIST.read_text())
    for info in doc["partitionInfo"]:
        info["isActive"] = int(info["partitionId"] in active)
    return parse_partition_list(json.dumps(doc))


# -- placement ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("slots", "partition"), [((0, 1), 3), ((0, 1, 2, 3), 1), (tuple(range(8)), 0), ((4,), 11)])
def test_a_set_that_is_exactly_a_partition_is_planned_and_the_verdict_names_it(slots, partition):
    report = topology_of()
    plan = plan_bundle(plan_payload(*(approved_slot(report, i) for i in slots)), report, fabric=_listed())
    assert plan.placement.fabric_partition_id == partition
    assert f"Fabric Manager partition {partition}" in plan.placement.decided_by
    assert NVSWITCH_WARNING not in {w.code for w in plan.placement.warnings}


def test_without_fabric_partitions_a_multi_gpu_set_keeps_the_nvswitch_warning():
    report = topology_of()
    plan = plan_bundle(plan_payload(approved_slot(report, 0), approved_slot(report, 1)), report)
    assert plan.placement.fabric_partition_id is None
    assert NVSWITCH_WARNING in {w.code for w in plan.placement.warnings}


def test_a_list_that_lacks_the_set_refuses_it_with_the_supported_sets():
    report = topology_of()
    with pytest.raises(fp.PartitionRefused) as err:  # GPUs 2 and 3 are in no 2-GPU partition (pairs are 1-2, 3-4)
        plan_bundle(plan_payload(approved_slot(report, 1), approved_slot(report, 2)), report, fabric=_listed())
    assert err.value.code == "fabric_partition_unsupported"
    assert err.value.evidence["gpus"] == [GPUS[1], GPUS[2]]
    assert {"partition_id": 3, "gpus": [GPUS[0], GPUS[1]], "active": False} in err.value.evidence["supported"]
    assert err.value.evidence["offer"] == [3, 4, 5, 6]  # the free 2-GPU partitions this host can give instead


def test_a_partition_with_a_gpu_missing_nvlinks_is_not_offered():
    doc = json.loads(LIST.read_text())
    doc["partitionInfo"][3]["gpuInfo"][1]["numNvLinksAvailable"] = 16
    with pytest.raises(fp.PartitionRefused) as err:
        fp.choose_partition(parse_partition_list(json.dumps(doc)), [GPUS[0], GPUS[1]])
    assert err.value.code == "fabric_partition_unhealthy"
    assert err.value.evidence["degraded_gpus"] == ["0000:3a:00.0 (16/18 NVLinks)"]


def test_a_set_overlapping_an_active_partition_is_in_use_unless_it_is_ours():
    with pytest.raises(fp.PartitionRefused) as err:
        fp.choose_partition(_listed(active=[1]), [GPUS[0], GPUS[1]])  # 1 = GPUs 1-4, active
    assert err.value.code == "fabric_partition_in_use" and err.value.evidence["active_overlapping"] == [1]
    assert fp.choose_partition(_listed(active=[3]), [GPUS[0], GPUS[1]], held=[3]).partition_id == 3


def test_fabric_manager_absent_refuses_a_partition_profile_before_the_lease(tmp_path):
    report = topology_of()
    with pytest.raises(PreconditionRefused) as err:
        run_bounded(fp.fabric_for(NVLINK, report, None), 30)
    assert err.value.code == "fabric_manager_missing" and len(err.value.evidence["nvswitches"]) == 4
    fm, _ = recorded_fm(tmp_path, answers={"-l": [(LIST.parent / "fmpm.connect-failed.out").read_text(), 247]})
    with pytest.raises(PreconditionRefused) as err:
        run_bounded(fp.fabric_for(NVLINK, report, fm), 30)
    assert "fm_unavailable" in err.value.evidence["fabric_manager"]
    # A profile without fabric_partitions never asks; nor does a host without NVSwitches.
    assert run_bounded(fp.fabric_for(PLAIN, report, None), 30) is None
    assert run_bounded(fp.fabric_for(NVLINK, report.model_copy(update={"nvswitches": []}), None), 30) is None


def test_the_lease_records_the_partition_and_a_conflict_takes_neither(tmp_path):
    report = topology_of()
    store = StateStore.open(tmp_path / "state.db")
    plan = plan_bundle(plan_payload(approved_slot(report, 0), approved_slot(report, 1)), report, fabric=_listed())
    lease_bundle(store, plan, "t-plan")
    held = store.partition_of(PLAN_ALLOCATION_ID)
    assert (held.partition_id, held.state, held.gpu_pci_addresses) == (3, PartitionState.leased, (GPUS[0], GPUS[1]))
    other = plan_bundle(plan_payload(approved_slot(report, 0), approved_slot(report, 1), alloc=OTHER), report,
                        fabric=_listed())
    with pytest.raises(StateError) as err:
        lease_bundle(store, other, "t-other")
    assert err.value.code == "partition_leased" and store.leases_of(OTHER) == []
    store.close()


# -- provision, release, restore ---------------------------------------------------------------------


def _leased(store: StateStore, partition_id: int = 3, gpus=(GPUS[0], GPUS[1]), alloc=PLAN_ALLOCATION_ID,
            state=PartitionState.leased) -> None:
    store.record_partition(PartitionLease(allocation_id=alloc, partition_id=partition_id, gpu_pci_addresses=gpus,
                                          state=state, task_id="t-plan", recorded_at=1.0))


def test_provision_activates_before_start_and_release_deactivates_after(tmp_path):
    fm, replay = recorded_fm(tmp_path)
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_leased, write=True)
        done = await fp.activate_leased(fm, state, PLAN_ALLOCATION_ID)
        assert done == {"partition_id": 3, "gpus": [GPUS[0], GPUS[1]], "was_active": False}
        assert replay.active == [3]
        assert (await state.partition_of(PLAN_ALLOCATION_ID)).state is PartitionState.active
        assert await fp.confirm_active(fm, state, PLAN_ALLOCATION_ID) == {"partition_id": 3, "active": True}
        gone = await fp.deactivate_leased(fm, state, PLAN_ALLOCATION_ID, release=True)
        assert gone == {"partition_id": 3, "deactivated": True, "released": True}
        assert replay.active == [] and await state.partition_of(PLAN_ALLOCATION_ID) is None
        # Released again (a redelivered release): nothing leased, nothing asked of FM.
        calls = len(replay.calls)
        assert await fp.deactivate_leased(fm, state, PLAN_ALLOCATION_ID, release=True) == {"partition_id": None}
        assert len(replay.calls) == calls
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_activation_failure_keeps_the_record_leased_and_the_compensation_is_idempotent(tmp_path):
    fm, replay = recorded_fm(tmp_path, answers={"-a 3": [(LIST.parent / "fmpm-a.in-use.out").read_text(), 249]})
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_leased, write=True)
        with pytest.raises(FabricManagerError) as err:
            await fp.activate_leased(fm, state, PLAN_ALLOCATION_ID)
        assert err.value.code == "fm_refused"
        assert (await state.partition_of(PLAN_ALLOCATION_ID)).state is PartitionState.leased
        undone = await fp.deactivate_leased(fm, state, PLAN_ALLOCATION_ID, release=False)
        assert undone == {"partition_id": 3, "deactivated": False, "released": False}
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_a_partition_fm_now_defines_differently_is_not_activated(tmp_path):
    fm, replay = recorded_fm(tmp_path)
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_leased, 3, (GPUS[0], GPUS[2]), write=True)
        with pytest.raises(fp.PartitionRefused) as err:
            await fp.activate_leased(fm, state, PLAN_ALLOCATION_ID)
        assert err.value.code == "fabric_partition_changed" and replay.active == []
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_fm_restart_between_activation_and_start_is_restored_after_start(tmp_path):
    fm, replay = recorded_fm(tmp_path)
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_leased, 5, (GPUS[4], GPUS[5]), OTHER, PartitionState.active, write=True)  # a running slice
        await state.run(_leased, write=True)
        replay.update(active=[5])
        await fp.activate_leased(fm, state, PLAN_ALLOCATION_ID)
        replay.update(active=[])  # Fabric Manager restarts: nothing is active any more
        checked = await fp.confirm_active(fm, state, PLAN_ALLOCATION_ID)
        assert checked == {"partition_id": 3, "active": True, "restored": [3, 5]}
        assert replay.active == [3, 5] and replay.calls[-2][:2] == ["--set-activated-list", "3,5"]
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_a_restore_fm_does_not_confirm_fails_the_check(tmp_path):
    fm, replay = recorded_fm(tmp_path, ignore_set_activated=True)
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_leased, 3, (GPUS[0], GPUS[1]), PLAN_ALLOCATION_ID, PartitionState.active, write=True)
        with pytest.raises(FabricManagerError) as err:
            await fp.confirm_active(fm, state, PLAN_ALLOCATION_ID)
        assert err.value.code == "fm_restore_unverified"
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_restore_sets_only_activated_leases_and_does_nothing_when_nothing_was_lost(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[5])
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_leased, 5, (GPUS[4], GPUS[5]), OTHER, PartitionState.active, write=True)
        await state.run(_leased, write=True)  # planned, never activated: not restored
        assert await fp.restore_after_restart(fm, state) == []
        replay.update(active=[])
        assert await fp.restore_after_restart(fm, state) == [5]
        assert replay.active == [5]
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


# -- reconcile ----------------------------------------------------------------------------------------


def test_drift_finds_active_partitions_without_domain_or_lease_and_domains_without_partition():
    leases = [PartitionLease(allocation_id=PLAN_ALLOCATION_ID, partition_id=3, gpu_pci_addresses=(GPUS[0], GPUS[1]),
                             state=PartitionState.active, task_id="t", recorded_at=1.0),
              PartitionLease(allocation_id=OTHER, partition_id=5, gpu_pci_addresses=(GPUS[4], GPUS[5]),
                             state=PartitionState.active, task_id="t", recorded_at=1.0)]
    found = fp.partition_drift(_listed(active=[3, 6]), leases, running_allocations=[OTHER])
    assert [(d.kind, d.partition_id) for d in found] == [
        (PartitionDriftKind.active_without_domain, 3),
        (PartitionDriftKind.active_without_lease, 6),
        (PartitionDriftKind.domain_without_partition, 5),
    ]
    assert fp.partition_drift(_listed(active=[3, 5]), leases, [PLAN_ALLOCATION_ID, OTHER]) == []


def test_reconcile_restores_a_running_slices_lost_partition_and_only_reports_the_rest(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[6])
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_leased, 5, (GPUS[4], GPUS[5]), OTHER, PartitionState.active, write=True)
        found = await fp.reconcile_findings(fm, state, {OTHER}, repair=False)
        assert [(f.kind.value, f.subject, f.repaired) for f in found] == [
            ("fabric_partition_without_lease", "partition 6", False), ("fabric_partition_lost", "partition 5", False)]
        assert replay.active == [6]  # report only: nothing changed, an unheld partition is a release's decision
        replay.update(active=[])  # Fabric Manager restarts (resiliency mode): nothing active until told
        found = await fp.reconcile_findings(fm, state, {OTHER}, repair=True)
        assert [(f.subject, f.repaired) for f in found] == [("partition 5", True)]
        assert replay.active == [5] and replay.calls[-2][:2] == ["--set-activated-list", "5"]
        # FM gone while a partition is leased: an error finding, never silence.
        gone = await fp.reconcile_findings(None, state, {OTHER}, repair=True)
        assert [(f.kind.value, f.severity.value) for f in gone] == [("fabric_manager_unavailable", "error")]
    try:
        run_bounded(body(), 60)
    finally:
        state.close()
