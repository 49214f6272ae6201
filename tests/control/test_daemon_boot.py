"""The daemon's side of boot recovery: a new boot_id at start runs the pass before any task and publishes it.

In process (``run_agent``), real nats-server, libvirt's ``test:///default``; the host root is a copy of
the after-reboot 8xH200 host with a kernel boot_id written, and the store holds an active slice from
the previous boot whose domain is gone (libvirt lost it): the one outcome that needs no OVS.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from gpuaas_agent.config import load_config
from gpuaas_agent.contract.drift import DriftReport
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.daemon import SdNotifier, run_agent
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.boot_recovery import BOOT_ID_KEY, BOOT_ID_PATH
from tests.support.agent_process import enrolled_setup
from tests.support.deadline import run_bounded

BOOT_A = "0b5a6c1e-4c0d-4a4e-9d7e-1f2a3b4c5d6e"
BOOT_B = "7d3c2b1a-9e8f-4a6b-8c7d-6e5f4a3b2c1d"


def test_the_first_start_in_a_new_boot_recovers_before_tasks_and_publishes_a_boot_report(nats_server, tmp_path,
                                                                                         host_copy):
    root = host_copy("h200-slice-after-reboot")
    (root / BOOT_ID_PATH.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / BOOT_ID_PATH.lstrip("/")).write_text(BOOT_B + "\n")
    slot = discover(HostRoot.open(root)).candidate_slots[0]
    identity = next(d.disk_identity for d in discover(HostRoot.open(root)).nvme_devices if d.by_id == slot.nvme_device)
    alloc = str(uuid.uuid4())

    async def body():
        plane, node_id, config_path = await enrolled_setup(nats_server, tmp_path, host_root=str(root),
                                                            uevent_watch=False)
        config = load_config(config_path)
        store = StateStore.open(config.state_db)
        store.take_lease(SlotLease(allocation_id=alloc, slot_index=0, gpu_pci_address=slot.gpu_pci_address,
                                   nvme_device=slot.nvme_device, disk_identity=identity,
                                   fabric_vf_pci_address=slot.fabric_vf_pci_address, task_id="t-p",
                                   taken_at=time.time()))
        store.set_slot_state(SlotRecord(slot_index=0, allocation_id=alloc, status=SlotStatus.active,
                                        health_state=HealthState.healthy, detail={"power_state": "running"},
                                        task_id="t-p", updated_at=time.time()))
        store.set_meta(BOOT_ID_KEY, BOOT_A)
        store.close()
        reports: list[DriftReport] = []
        got = asyncio.Event()

        async def on_drift(msg):
            reports.append(DriftReport.model_validate_json(msg.data))
            got.set()

        sub = await plane.nc.subscribe(f"gpuaas.node.{node_id}.drift", cb=on_drift)
        stop = asyncio.Event()
        agent = asyncio.create_task(run_agent(config, stop, notifier=SdNotifier()))
        try:
            await asyncio.wait_for(got.wait(), 60)
        finally:
            stop.set()
            assert await asyncio.wait_for(agent, 60) == 0
            await sub.unsubscribe()
            await plane.close()
        (report,) = reports
        assert report.trigger.value == "boot" and report.node_id == node_id
        assert [(f.kind.value, f.subject) for f in report.findings] == [("domain_missing", alloc)]
        store = StateStore.open(config.state_db)
        try:
            assert store.meta(BOOT_ID_KEY) == BOOT_B
            record = store.slot_state(0)
            assert record.health_state is HealthState.failed
            assert record.detail.boot_recovery.outcome == "refused"
            assert record.detail.boot_recovery.boot_id == BOOT_B
        finally:
            store.close()

    run_bounded(body())
