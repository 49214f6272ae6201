"""Maintenance and quarantine tasks through the real JetStream worker, against a real store on disk.

The host is the recorded 8xH200 after its storage transition (a copy where a test writes AER counters).
"""

from __future__ import annotations

import asyncio

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.fleet import ComponentKind, ComponentRef, QuarantineReason
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.daemon import default_tasks
from gpuaas_agent.tasks.quarantine import quarantine_component
from gpuaas_agent.tasks.recheck import RECHECKS
from tests.conftest import fixture_host
from tests.support.deadline import run_bounded
from tests.support.provision_inputs import PLAN_ALLOCATION_ID, approved_slot, plan_payload, topology_of
from tests.support.worker_harness import NODE, Harness

HOST = "h200-slice-after-transition"
OTHER_ALLOCATION = "158ea147-0115-407f-bbd5-1850c32b9517"


def _disk_identity(report, index: int) -> str:
    slot = report.candidate_slots[index]
    return next(d.disk_identity for d in report.nvme_devices if slot.nvme_device in (d.by_id, *d.by_id_links))


async def _run(h: Harness, task_type: TaskType, payload: dict):
    return await h.run_task_to_result(h.plane.envelope(NODE, task_type.value, payload))


def test_maintenance_refuses_plans_before_any_lease_and_off_takes_them_again(nats_server, tmp_path):
    config = AgentConfig(host_root=fixture_host(HOST), state_dir=tmp_path / "state")
    report = topology_of()
    plan = plan_payload(approved_slot(report, 2)).model_dump(mode="json")

    async def body():
        async with Harness(nats_server, tmp_path, default_tasks(config).handlers) as h:
            on = await _run(h, TaskType.maintenance, {"mode": "on", "reason": "BIOS update, ticket 4711"})
            assert on.status == ResultStatus.succeeded, on.error
            assert on.output["maintenance"]["on"] and on.output["drain"]["drained"] is True  # nothing ran here
            refused = await _run(h, TaskType.plan, plan)
            assert (refused.status, refused.error.code) == (ResultStatus.failed, "host_in_maintenance")
            assert "BIOS update" in refused.error.message and h.store.leases() == []
            hostile = await _run(h, TaskType.maintenance, {"mode": "off", "reason": "ok\nevent=forged"})
            assert (hostile.status, hostile.error.code) == (ResultStatus.failed, "invalid_payload")
            assert hostile.error.evidence["field"] == "reason"
            refused_again = await _run(h, TaskType.plan, plan)
            assert refused_again.error.code == "host_in_maintenance"  # a refused toggle changed nothing
            off = await _run(h, TaskType.maintenance, {"mode": "off", "reason": "BIOS done"})
            assert off.status == ResultStatus.succeeded and off.output["changed"] is True
            planned = await _run(h, TaskType.plan, plan)
            assert planned.status == ResultStatus.succeeded, planned.error
            assert [lease.slot_index for lease in h.store.leases()] == [2]
            # Maintenance on with a slice on the host: the drain waits for it, the slice is not touched.
            draining = await _run(h, TaskType.maintenance, {"mode": "on", "reason": "drain"})
            assert draining.output["drain"]["drained"] is False and draining.output["drain"]["leased_slots"] == [2]
            assert [lease.slot_index for lease in h.store.leases()] == [2]

    run_bounded(body())


def test_a_quarantined_disk_takes_only_its_own_slot_away(nats_server, tmp_path):
    config = AgentConfig(host_root=fixture_host(HOST), state_dir=tmp_path / "state")
    report = topology_of()
    bad_disk = _disk_identity(report, 3)

    async def body():
        async with Harness(nats_server, tmp_path, default_tasks(config).handlers) as h:
            record = await quarantine_component(h.store, "nvme", bad_disk, "wipe_unverified",
                                                {"verified": False, "method": "write_zeroes"}, "task-release-1",
                                                slot_index=3)
            assert record.identity == bad_disk and record.slot_index == 3
            discovered = await _run(h, TaskType.topology_discover, {})
            slots = {s["slot_index"]: [b["code"] for b in s["blockers"]] for s in discovered.output["candidate_slots"]}
            assert slots[3] == ["component_quarantined"]
            assert all("component_quarantined" not in codes for i, codes in slots.items() if i != 3)
            assert discovered.output["summary"]["ready_candidate_slots"] == \
                report.summary.ready_candidate_slots - 1
            refused = await _run(h, TaskType.plan, plan_payload(approved_slot(report, 3)).model_dump(mode="json"))
            assert (refused.status, refused.error.code) == (ResultStatus.failed, "component_quarantined")
            assert refused.error.evidence["quarantined"][0]["identity"] == bad_disk and h.store.leases() == []
            planned = await _run(h, TaskType.plan, plan_payload(approved_slot(report, 2)).model_dump(mode="json"))
            assert planned.status == ResultStatus.succeeded, planned.error

    run_bounded(body())


def test_operator_quarantine_refuses_unknown_and_held_components_and_unquarantine_returns_it(nats_server, tmp_path):
    config = AgentConfig(host_root=fixture_host(HOST), state_dir=tmp_path / "state")
    report = topology_of()
    held_gpu, free_gpu = report.candidate_slots[2].gpu_pci_address, report.candidate_slots[5].gpu_pci_address

    async def body():
        async with Harness(nats_server, tmp_path, default_tasks(config).handlers) as h:
            assert (await _run(h, TaskType.plan, plan_payload(approved_slot(report, 2)).model_dump(mode="json"))
                    ).status == ResultStatus.succeeded
            unknown = await _run(h, TaskType.quarantine, {"component": {"kind": "gpu", "identity": "0000:ee:00.0"},
                                                          "reason": "flaky"})
            assert (unknown.status, unknown.error.code) == (ResultStatus.failed, "unknown_component")
            held = await _run(h, TaskType.quarantine, {"component": {"kind": "gpu", "identity": held_gpu},
                                                       "reason": "flaky"})
            assert held.error.code == "component_in_use" and held.error.evidence["held_by"] == PLAN_ALLOCATION_ID
            assert h.store.quarantined() == []
            taken = await _run(h, TaskType.quarantine, {"component": {"kind": "gpu", "identity": free_gpu},
                                                        "reason": "XID 79 seen by hand", "slot_index": 5})
            assert taken.status == ResultStatus.succeeded, taken.error
            assert taken.output["quarantined"]["reason"] == "operator"
            refused = await _run(h, TaskType.plan, plan_payload(approved_slot(report, 5),
                                                                 alloc=OTHER_ALLOCATION).model_dump(mode="json"))
            assert refused.error.code == "component_quarantined"
            back = await _run(h, TaskType.unquarantine, {"component": {"kind": "gpu", "identity": free_gpu},
                                                         "reason": "GPU reseated", "requested_by": "ops-jane"})
            assert back.status == ResultStatus.succeeded, back.error
            assert back.output["recheck"]["check"] == "operator" and h.store.quarantined() == []
            [history] = h.store.quarantine_history(ComponentRef(kind=ComponentKind.gpu, identity=free_gpu))
            assert history["released_by"] == "ops-jane" and history["reason"] == "GPU reseated"
            again = await _run(h, TaskType.unquarantine, {"component": {"kind": "gpu", "identity": free_gpu},
                                                          "reason": "twice"})
            assert again.error.code == "not_quarantined"

    run_bounded(body())


def test_unquarantine_reruns_the_failed_check_and_refuses_while_it_fails(nats_server, tmp_path, host_copy):
    root = host_copy(HOST)
    config = AgentConfig(host_root=root, state_dir=tmp_path / "state")
    report = topology_of()
    gpu, held_disk = report.candidate_slots[4].gpu_pci_address, _disk_identity(report, 2)
    device = (root / "sys/bus/pci/devices" / gpu).resolve()

    def fatal(count: int) -> None:
        (device / "aer_dev_fatal").write_text(f"Undefined 0\nDLP {count}\nTOTAL_ERR_FATAL {count}\n")

    async def unquarantine(h, kind, identity):
        return await _run(h, TaskType.unquarantine, {"component": {"kind": kind, "identity": identity},
                                                     "reason": "checked by hand"})

    async def body():
        async with Harness(nats_server, tmp_path, default_tasks(config).handlers) as h:
            await quarantine_component(h.store, "gpu", gpu, "gpu_aer_fatal", {"aer_dev_fatal": 1}, "task-health-1")
            no_counter = await unquarantine(h, "gpu", gpu)  # the recording exposes no AER: cannot be shown gone
            assert (no_counter.status, no_counter.error.code) == (ResultStatus.failed, "recheck_failed")
            fatal(1)
            still = await unquarantine(h, "gpu", gpu)
            assert still.error.code == "recheck_failed" and "fatal=1" in still.error.message
            assert [r.identity for r in h.store.quarantined()] == [gpu]
            fatal(0)  # after a reboot the kernel counts from zero
            back = await unquarantine(h, "gpu", gpu)
            assert back.status == ResultStatus.succeeded, back.error
            assert back.output["recheck"]["evidence"]["aer"]["fatal"] == 0

            # The XID re-check lives in the operator room (NVML) and the daemon injects it into this handler
            # (tasks/recheck.RECHECKS does not hold it): it runs, and NVML on this machine does not clear the GPU.
            assert QuarantineReason.gpu_xid not in RECHECKS
            reset = report.candidate_slots[5].gpu_pci_address
            await quarantine_component(h.store, "gpu", reset, "gpu_xid", {"xid": 79}, "task-r")
            rechecked = await unquarantine(h, "gpu", reset)
            assert rechecked.error.code == "recheck_failed" and "gpu_xid still fails" in rechecked.error.message
            # A disk whose wipe did not verify: its re-check reads the slot's latest proof, and there is none
            # that covers every byte.
            await quarantine_component(h.store, "nvme", held_disk, "wipe_unverified", {"verified": False}, "task-r",
                                       slot_index=2)
            unproven = await unquarantine(h, "nvme", held_disk)
            assert unproven.error.code == "recheck_failed" and "every byte" in unproven.error.message
            # The allocation whose release quarantined it still holds it: never returned under a lease.
            assert (await _run(h, TaskType.plan, plan_payload(approved_slot(report, 2)).model_dump(mode="json"))
                    ).error.code == "component_quarantined"
            await asyncio.to_thread(h.store.take_lease, _lease_of(report, 2, held_disk))
            in_use = await unquarantine(h, "nvme", held_disk)
            assert in_use.error.code == "component_in_use"
            missing = await unquarantine(h, "fabric_vf", report.candidate_slots[6].fabric_vf_pci_address)
            assert missing.error.code == "not_quarantined"

    run_bounded(body())


def _lease_of(report, index: int, disk_identity: str) -> SlotLease:
    slot = report.candidate_slots[index]
    return SlotLease(allocation_id=PLAN_ALLOCATION_ID, slot_index=index, gpu_pci_address=slot.gpu_pci_address,
                     nvme_device=slot.nvme_device, disk_identity=disk_identity,
                     fabric_vf_pci_address=slot.fabric_vf_pci_address, task_id="task-provision-1", taken_at=1.0)
