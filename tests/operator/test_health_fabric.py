"""A Fabric Manager restart is found on the health interval and the leases' partitions are set active again.

FM's answers are the recorded ones of fixtures/fabricmanager/, replayed behind the real fmpm argv
(tests/support/fmpm_replay.py keeps FM's activated list: a restart empties it); the store is a real
SQLite state store on its thread; the round is the daemon's own (``Reporter.check_health`` with the
probe the daemon adds) on a recorded host.
"""

from __future__ import annotations

from gpuaas_agent.contract.fabric import PartitionLease, PartitionState
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotRecord, StepStatus
from gpuaas_agent.operator.health import CheckThreads, HealthSettings
from gpuaas_agent.operator.health_fabric import (
    CHECK_NAME,
    JOURNAL_TASK_ID,
    RESTORE_STEP,
    check_fabric_partitions,
    fabric_probe,
)
from gpuaas_agent.operator.reporter import Reporter, ReporterSettings
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.state.store import StateStore
from tests.support.deadline import run_bounded
from tests.support.fabric_manager import GPUS, recorded_answer, recorded_fm

RUNNING = "0f4b7c52-6a56-4d0e-9a43-2b1f3e6c1a01"  # a settled slice: partition 3 (GPUs 1-2), slots 0-1 active
STARTING = "158ea147-0115-407f-bbd5-1850c32b9517"  # a provision between activation and start: partition 5


def _hold(store: StateStore, alloc: str, partition_id: int, gpus: tuple[str, ...], slots: tuple[int, ...],
          status: SlotStatus) -> None:
    store.record_partition(PartitionLease(allocation_id=alloc, partition_id=partition_id, gpu_pci_addresses=gpus,
                                          state=PartitionState.active, task_id="t-provision", recorded_at=1.0))
    for slot in slots:
        store.set_slot_state(SlotRecord(slot_index=slot, allocation_id=alloc, status=status,
                                        health_state=HealthState.healthy, task_id="t-provision", updated_at=1.0))


async def _restores(state: StoreThread) -> list:
    return [e for e in await state.journal_of(JOURNAL_TASK_ID) if e.step == RESTORE_STEP]


def test_fm_restarted_between_two_health_rounds_is_restored_within_one_round_and_journaled(tmp_path, host_copy):
    fm, replay = recorded_fm(tmp_path, active=[3])
    state = StoreThread.open(tmp_path / "state.db")
    reporter = Reporter(ReporterSettings(node_id="node-1", state_dir=tmp_path, heartbeat_interval_s=5,
                                         health_interval_s=60, request_timeout_s=5),
                        state, HealthSettings(host_root=host_copy("h200-slice-after-transition"),
                                              libvirt_uri="test:///default"), None, lambda **_: True,
                        threads=CheckThreads())
    reporter.extra_checks.append(fabric_probe(fm, state))

    async def body():
        await state.run(_hold, RUNNING, 3, (GPUS[0], GPUS[1]), (0, 1), SlotStatus.active, write=True)
        await reporter.check_health()  # round 1: FM holds the partition; only read
        first = next(c for c in reporter.checks if c.name == CHECK_NAME)
        assert first.status == "ok" and "[3] active" in first.detail
        assert [c[0] for c in replay.calls] == ["-l"] and await _restores(state) == []
        replay.update(active=[])  # Fabric Manager restarts between the rounds: it forgets every partition
        await reporter.check_health()  # round 2: found and restored in this round
        second = next(c for c in reporter.checks if c.name == CHECK_NAME)
        assert second.status == "ok" and "lost partitions [3]" in second.detail
        assert replay.active == [3] and replay.calls[-2][:2] == ["--set-activated-list", "3"]
        assert replay.calls[-1][0] == "-l"  # read back
        [entry] = await _restores(state)
        assert entry.status is StepStatus.succeeded
        assert (entry.detail["restored"], entry.detail["allocations"]) == ([3], [RUNNING])
        await reporter.check_health()  # round 3: nothing lost, nothing set
        assert replay.calls[-1][0] == "-l" and len(await _restores(state)) == 1
    try:
        run_bounded(body(), 90)
    finally:
        state.close()


def test_a_provision_between_activation_and_start_is_left_to_its_own_check_and_kept_active(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[])  # FM restarted: both partitions lost
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_hold, RUNNING, 3, (GPUS[0], GPUS[1]), (0, 1), SlotStatus.active, write=True)
        await state.run(_hold, STARTING, 5, (GPUS[4], GPUS[5]), (4, 5), SlotStatus.provisioning, write=True)
        check = await check_fabric_partitions(fm, state)
        assert check.status == "ok" and "[5] left to the task in flight" in check.detail
        assert replay.active == [3]  # the settled slice's; the provision's own fabric_partition_check restores 5
        # The provision activated 5 meanwhile (FM lists it): a later restore keeps it on.
        replay.update(active=[5])
        check = await check_fabric_partitions(fm, state)
        assert replay.active == [3, 5] and replay.calls[-2][:2] == ["--set-activated-list", "3,5"]
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_a_partition_a_release_just_deactivated_is_never_switched_back_on(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[])
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        # The release deactivated 5 after undefine; its lease is dropped a moment later. Slot 4-5 are releasing.
        await state.run(_hold, STARTING, 5, (GPUS[4], GPUS[5]), (4, 5), SlotStatus.releasing, write=True)
        check = await check_fabric_partitions(fm, state)
        assert check.status == "ok" and replay.active == []
        assert not any(c[0] == "--set-activated-list" for c in replay.calls)
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_a_restore_fm_does_not_take_fails_the_check_and_is_journaled(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[], ignore_set_activated=True)  # fmpm 1.0.1's empty list
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        await state.run(_hold, RUNNING, 3, (GPUS[0], GPUS[1]), (0, 1), SlotStatus.active, write=True)
        check = await check_fabric_partitions(fm, state)
        assert check.status == "failed" and "fm_restore_unverified" in check.detail
        [entry] = await _restores(state)
        assert entry.status is StepStatus.failed and entry.detail["code"] == "fm_restore_unverified"
    try:
        run_bounded(body(), 60)
    finally:
        state.close()


def test_fm_not_answering_degrades_with_held_partitions_and_nothing_held_reads_nothing(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[3], answers={"-l": recorded_answer("fmpm.connect-failed.out", 247)})
    state = StoreThread.open(tmp_path / "state.db")

    async def body():
        idle = await check_fabric_partitions(fm, state)
        assert idle.status == "ok" and replay.calls == []  # no lease: FM is not asked
        await state.run(_hold, RUNNING, 3, (GPUS[0], GPUS[1]), (0, 1), SlotStatus.active, write=True)
        down = await check_fabric_partitions(fm, state)
        assert down.status == "degraded" and "fm_unavailable" in down.detail and "[3]" in down.detail
    try:
        run_bounded(body(), 60)
    finally:
        state.close()
