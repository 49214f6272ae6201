"""A provision cancelled mid-clone: qemu-img is killed, the slot is cleanup_blocked, the lease is kept.

Real pieces: a loop disk behind the recorded 8xH200 host (lab/loophost.py), the
image cache, qemu-img, the disk guard, the SQLite store, libvirt's test driver
(no running domain uses the disk). The cancellation comes from the task being
cancelled when the clone reports its first percent: the same path a task
deadline takes (the worker cancels the handler at the deadline).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from datetime import datetime, timedelta

import pytest

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.slots import ApprovedSlot, SlotStatus
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import TaskEnvelope, VmProvisionPayload
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.host.images.cache import ImageCache, SourcePolicy
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.provision import provision
from tests.conftest import fixture_host
from tests.support.provision_inputs import TENANT_KEY, TaskCtx, task_ctx
from tests.tasks.conftest import provision_failure, slice_loop_host

MiB = 1 << 20


@pytest.fixture
def loop_host(tmp_path):
    with slice_loop_host(tmp_path / "host", disk_bytes=512 * MiB) as host:
        yield host


def _approved(host, bridge: str = "ovsbr0") -> ApprovedSlot:
    c = discover(HostRoot.open(host.root)).candidate_slots[0]
    return ApprovedSlot(slot_id="s-0", slot_index=0, gpu_pci_address=c.gpu_pci_address, nvme_device=c.nvme_device,
                        storage_identity_kind=c.storage_identity_kind, fabric_vf_pci_address=c.fabric_vf_pci_address,
                        fabric_claim_mode=c.fabric_claim_mode, mac=c.mac, private_ip=c.private_ip,
                        ovs_bridge=bridge, numa_node=c.numa_node, status=SlotStatus.reserved)


def test_cancel_mid_clone_kills_qemu_img_and_leaves_the_slot_cleanup_blocked(loop_host, tmp_path, prepared_host):
    image = tmp_path / "image.raw"
    with open(image, "wb") as fh:  # dense: qemu-img must copy every block, so the clone takes a while
        for _ in range(384):
            fh.write(os.urandom(MiB))
    digest = hashlib.sha256(image.read_bytes()).hexdigest()
    sh = SliceDrivers(host_root=loop_host.root, slice=SliceConfig(**prepared_host.slice_config()),
                   images=ImageCache(tmp_path / "cache", policy=SourcePolicy(file_dir=tmp_path)),
                   libvirt=LibvirtLifecycle("test:///default"))
    store = StateStore.open(tmp_path / "state.db")
    alloc = str(uuid.uuid4())
    slot = _approved(loop_host, prepared_host.bridge)
    payload = VmProvisionPayload(allocation_id=alloc, slot=slot, image={"url": f"file://{image}", "sha256": digest},
                                 runtime_profile="lab_tcg_1c_512m", hostname="cancelled", user="tenant",
                                 ssh_authorized_keys=[TENANT_KEY])
    envelope = TaskEnvelope(task_id="t-cancel", type="slice.vm_provision", node_id="node-1", attempt=1,
                            deadline=datetime.now(UTC) + timedelta(minutes=10), payload={})
    ctx = TaskCtx(store=store, envelope=envelope)
    seen: list[float] = []

    async def scenario():
        task = asyncio.current_task()

        def on_progress(step, status, percent):
            if step == "clone" and status == "progress" and percent is not None:
                seen.append(percent)
                if 0 < percent < 100 and not task.cancelling():
                    task.cancel()  # the worker does exactly this when the task's deadline passes

        ctx.on_progress = on_progress
        try:
            await provision(sh, payload, ctx)
        finally:
            await sh.close()

    with pytest.raises(PipelineFailed) as info:
        asyncio.run(scenario())
    failure = info.value
    assert failure.cancelled and failure.code == "clone_cancelled" and failure.disk_touched
    assert any(0 < p < 100 for p in seen) and 100 not in seen  # stopped part-way, never finished
    # qemu-img is gone (killed with its process group), nothing holds the disk: an exclusive open succeeds.
    fd = os.open(loop_host.disks[0].loop, os.O_RDONLY | os.O_EXCL)
    os.close(fd)
    # The slot is blocked, its lease kept; the journal says where it stopped.
    record = store.slot_state(0)
    assert record.status is SlotStatus.cleanup_blocked and record.detail.cancelled is True
    assert [lease.allocation_id for lease in store.leases()] == [alloc]
    assert [(o.status.value, o.health_state.value) for o in ctx.slot_outcomes] == [("cleanup_blocked", "failed")]
    journal = [(e.step, e.status) for e in store.journal_of("t-cancel")]
    assert ("clone", StepStatus.failed) in journal and ("validate", StepStatus.compensated) in journal
    assert not any(step in ("seed", "ovs_port", "define") for step, _ in journal)
    store.close()


@pytest.mark.parametrize("reached", ["image", "clone", "seed"])
def test_a_provision_redelivered_after_an_agent_crash(tmp_path, reached):
    """The same task comes back with the slot still 'provisioning' (issue 17): up to the clone it runs again
    (a clone that had started is redone whole, never with --target-is-zero); past it, what it set up is
    undone as an in-process failure would, and the slot is blocked with its lease kept."""
    from gpuaas_agent.contract.runtime import get_profile
    from gpuaas_agent.contract.slots import HealthState
    from gpuaas_agent.contract.state import SlotRecord
    from gpuaas_agent.tasks.provision import (
        PROVISION_STEPS,
        RESTARTABLE,
        ProvisionRefused,
        ProvisionRun,
        check_admissible,
        close_interrupted,
        interrupted_run,
    )

    store = StateStore.open(tmp_path / "state.db")
    alloc = str(uuid.uuid4())
    c = discover(HostRoot.open(fixture_host("h200-slice-after-transition"))).candidate_slots[0]
    slot = ApprovedSlot(slot_id="s-0", slot_index=0, gpu_pci_address=c.gpu_pci_address, nvme_device=c.nvme_device,
                        storage_identity_kind=c.storage_identity_kind, fabric_vf_pci_address=c.fabric_vf_pci_address,
                        fabric_claim_mode=c.fabric_claim_mode, mac=c.mac, private_ip=c.private_ip,
                        ovs_bridge="ovsbr0", numa_node=c.numa_node, status=SlotStatus.reserved)
    payload = VmProvisionPayload(allocation_id=alloc, slot=slot, image={"url": "file:///x", "sha256": "0" * 64},
                                 runtime_profile="lab_tcg_1c_512m", hostname="h", user="tenant",
                                 ssh_authorized_keys=[TENANT_KEY])
    store.set_slot_state(SlotRecord(slot_index=0, allocation_id=alloc, status=SlotStatus.provisioning,
                                    health_state=HealthState.unknown, task_id="t-crash", updated_at=1.0))
    names = [d.name for d in PROVISION_STEPS]
    for step in names[:names.index(reached) + 1]:
        store.journal("t-crash", step, StepStatus.started)
    sh = SliceDrivers(host_root=fixture_host("h200-slice-after-transition"),
                   slice=SliceConfig(allow_emulated_domains=True, seed_dir=tmp_path / "seeds"),
                   images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle("test:///default"))
    ctx = task_ctx(store, "t-crash")
    run = ProvisionRun(drivers=sh, payload=payload, profile=get_profile("lab_tcg_1c_512m"), task_id="t-crash", ctx=ctx)
    steps = asyncio.run(interrupted_run(run))
    assert steps == names[:names.index(reached) + 1]
    if reached in RESTARTABLE:
        asyncio.run(check_admissible(run))  # the fresh run may go ahead (provision() marks a started clone disk_written_before)
        assert store.slot_state(0).status is SlotStatus.provisioning
    else:
        (tmp_path / "seeds").mkdir()
        seed_iso = sh.seed_path(alloc, 0)
        seed_iso.write_bytes(b"iso")
        detail = asyncio.run(close_interrupted(run, steps, why="provision_interrupted"))
        assert detail["disk_touched"] is True and not seed_iso.exists()  # the seed step was undone
        assert {c["step"] for c in detail["compensations"]} == {"validate", "image", "seed"}
        assert store.slot_state(0).status is SlotStatus.cleanup_blocked
        assert [(o.status.value, o.health_state.value) for o in ctx.slot_outcomes] == [("cleanup_blocked", "failed")]
    # Another task of the same allocation is never let in while the slot is busy or blocked.
    other = ProvisionRun(drivers=sh, payload=payload, profile=get_profile("lab_tcg_1c_512m"), task_id="t-other",
                         ctx=task_ctx(store, "t-other"))
    with pytest.raises(ProvisionRefused) as info:
        asyncio.run(check_admissible(other))
    assert info.value.code == ("already_provisioned" if reached in RESTARTABLE else "slot_cleanup_blocked")
    asyncio.run(sh.close())
    store.close()


def test_a_missing_relay_key_fails_before_the_disk_is_touched(loop_host, tmp_path):
    sh = SliceDrivers(host_root=loop_host.root,
                   slice=SliceConfig(allow_emulated_domains=True, terminal_relay_key_file=tmp_path / "absent.pub"),
                   images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle("test:///default"))
    store = StateStore.open(tmp_path / "state.db")
    payload = VmProvisionPayload(allocation_id=str(uuid.uuid4()), slot=_approved(loop_host),
                                 image={"url": "file:///nonexistent", "sha256": "0" * 64},
                                 runtime_profile="lab_tcg_1c_512m", hostname="h", user="tenant",
                                 ssh_authorized_keys=[TENANT_KEY])
    ctx = task_ctx(store, "t-relay")
    before = open(loop_host.disks[0].loop, "rb").read(1 << 20)

    failed = provision_failure(sh, payload, ctx)
    assert failed.code == "relay_key_missing" and failed.failed_step == "validate"
    assert failed.disk_touched is False
    assert store.leases() == [] and store.slot_state(0) is None
    assert [o.status.value for o in ctx.slot_outcomes] == ["reserved"]
    assert open(loop_host.disks[0].loop, "rb").read(1 << 20) == before
    store.close()
