"""The release's ``gpu_handover`` step through the tasks layer: a failed handover never frees the slot.

Real pieces: the release pipeline and its journal, the SQLite store, libvirt's test driver, the
prepared host's OVS and dnsmasq, a loop device as slot 0's disk (wiped and verified when the
release gets that far). The GPU side is the synthetic 8xH200 host after a reboot (GPU and VF on
vfio-pci) with the kernel's reset methods and config space, and NVIDIA's tool replayed from
fixtures/gpu-admin-tools (tests/support/gpu_handover.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.gpuhandover import handover_meta_key
from gpuaas_agent.contract.handover import GpuHandoverPolicy, LeaseHandover
from gpuaas_agent.contract.nvmewipe import WipePolicy
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord, StepStatus
from gpuaas_agent.contract.tasks import VmReleasePayload
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.guards.disk import read_disk_identity
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.firmware_check import slot_firmware
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.recheck import RecheckContext, recheck_firmware, recheck_gpu_handover
from gpuaas_agent.tasks.release import RELEASE_STEPS, Found, ReleaseRun, gpu_handover, release
from lab.loophost import materialize
from tests.conftest import fixture_host
from tests.support.gpu_handover import DEVICES, GPU, HOST, VF, ReplayTool, between_tenants
from tests.support.provision_inputs import approved_slot_of_host, task_ctx
from tests.support.realdev import require_root

MiB = 1 << 20
LIBVIRT_TEST_URI = "test:///default"
FAILURES = {
    "reset_refused": "gpu_reset_failed",
    "memory_clear_flag_never_set": "gpu_memory_clear_unverified",
    "mig_left_on": "gpu_settings_not_restored",
}


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    require_root()
    host = materialize(fixture_host(HOST), tmp_path_factory.mktemp("gpuhandover") / "host", disk_bytes=16 * MiB,
                       slots=1, real_links=False)
    between_tenants(host.root)
    yield host
    assert host.close() == []


def test_gpu_handover_is_declared_after_undefine_and_the_partition_release():
    names = [d.name for d in RELEASE_STEPS]
    assert names.index("undefine") < names.index("fabric_partition_release") < names.index("fabric_vf_park") \
        < names.index("gpu_handover")
    assert names.index("gpu_handover") < names.index("wipe") < names.index("lease_release")


def _drivers(root, tmp_path, prepared, case: str | None) -> SliceDrivers:
    sh = SliceDrivers(host_root=root, slice=SliceConfig(**prepared.slice_config()), images=ImageCache(tmp_path / "c"),
                      libvirt=LibvirtLifecycle(LIBVIRT_TEST_URI))
    return sh if case is None else dataclasses.replace(sh, gpu_tool=ReplayTool(case).tool())


async def _released(sh, payload, ctx):
    """The release on ``sh``, its drivers closed after."""
    try:
        return await release(sh, payload, ctx)
    finally:
        await sh.close()


def _lease(root, slot, alloc: str, handover: LeaseHandover | None = None) -> SlotLease:
    return SlotLease(allocation_id=alloc, slot_index=slot.slot_index, gpu_pci_address=slot.gpu_pci_address,
                     nvme_device=slot.nvme_device, disk_identity=read_disk_identity(HostRoot.open(root), slot.nvme_device),
                     fabric_vf_pci_address=slot.fabric_vf_pci_address, task_id="t-provision", taken_at=time.time(),
                     handover=handover)


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_a_failed_handover_leaves_the_slot_cleanup_blocked_and_a_retry_that_succeeds_frees_it(
        case, gpu_host, tmp_path, prepared_host):
    slot = approved_slot_of_host(gpu_host, 0, ovs_bridge=prepared_host.bridge)
    assert (slot.gpu_pci_address, slot.fabric_vf_pci_address) == (GPU, VF)
    alloc = str(uuid.uuid4())
    store = StateStore.open(tmp_path / "state.db")
    # A lease from before handover policies (the store keeps none yet): the catalog's default policy applies.
    store.take_lease(_lease(gpu_host.root, slot, alloc))
    store.set_slot_state(SlotRecord(slot_index=0, allocation_id=alloc, status=SlotStatus.active,
                                    health_state=HealthState.healthy, task_id="t-provision", updated_at=time.time()))
    disk = gpu_host.disks[0].loop
    with open(disk, "r+b") as fh:
        fh.write(b"tenant data" * 100)
    payload = VmReleasePayload(allocation_id=alloc, slot=slot, graceful_timeout_s=1)

    try:
        ctx = task_ctx(store, "t-release-1")
        with pytest.raises(PipelineFailed) as failed:
            asyncio.run(_released(_drivers(gpu_host.root, tmp_path, prepared_host, case), payload, ctx))
        assert failed.value.failed_step == "gpu_handover" and failed.value.code == FAILURES[case]
        record = store.slot_state(0)
        assert record.status is SlotStatus.cleanup_blocked and record.health_state is HealthState.failed
        assert record.detail.failed_step == "gpu_handover" and record.detail.code == FAILURES[case]
        assert record.detail.evidence["address"] == GPU and record.detail.evidence["tool_runs"]
        assert [(o.slot_index, o.status) for o in ctx.slot_outcomes] == [(0, SlotStatus.cleanup_blocked)]
        assert [lease.allocation_id for lease in store.leases()] == [alloc]  # the lease is kept: not offered again
        steps = {e.step for e in store.journal_of("t-release-1")}
        assert "wipe" not in steps and "lease_release" not in steps
        with open(disk, "rb") as fh:
            assert fh.read(11) == b"tenant data"  # nothing after the failed step ran
        # The GPU itself is quarantined with the failure's evidence: plan and discovery never offer it again
        # until slice.unquarantine's re-check sees a later handover of it pass.
        [quarantined] = store.quarantined()
        assert (quarantined.kind.value, quarantined.identity, quarantined.slot_index) == ("gpu", GPU, 0)
        assert quarantined.reason.value == ("gpu_memory_clear_failed" if case == "memory_clear_flag_never_set"
                                            else "gpu_reset_failed")
        assert quarantined.evidence["code"] == FAILURES[case]
        verdict = asyncio.run(recheck_gpu_handover(RecheckContext(host_root=gpu_host.root, store=store), quarantined))
        assert not verdict.passed and "still holds" in verdict.detail

        # The next release of the slot hands the GPU over, wipes the disk and frees the slot.
        ctx = task_ctx(store, "t-release-2")
        out = asyncio.run(_released(_drivers(gpu_host.root, tmp_path, prepared_host, "success"), payload, ctx))
        proof = out["cleanup_proof"]["gpu_handover"]
        assert proof["policy_source"] == "catalog_default" and proof["gpus"][0]["reset"]["method"] == "sbr"
        assert proof["gpus"][0]["memory_clear_flag"] == "0x1" and proof["gpus"][0]["after"]["mig_enabled"] is False
        assert proof["fabric_vf"]["address"] == VF and (gpu_host.root / DEVICES / VF / "reset").read_text() == "1"
        assert out["cleanup_proof"]["wipe"]["verified"]
        # The proof names the disk it is of (what an unquarantine re-check of that disk compares).
        assert store.latest_wipe_proof(0).disk_identity == read_disk_identity(HostRoot.open(gpu_host.root),
                                                                               slot.nvme_device)
        assert [(o.slot_index, o.status) for o in ctx.slot_outcomes] == [(0, SlotStatus.available)]
        assert store.leases() == [] and store.slot_state(0) is None
        done = [e.step for e in store.journal_of("t-release-2") if e.status is StepStatus.succeeded]
        assert done.index("gpu_handover") < done.index("wipe")
        # Slot freed, GPU still out until an operator asks; the re-check now passes (a handover passed since).
        assert [r.identity for r in store.quarantined()] == [GPU]
        verdict = asyncio.run(recheck_gpu_handover(RecheckContext(host_root=gpu_host.root, store=store),
                                                   store.quarantined()[0]))
        assert verdict.passed and verdict.evidence["last_passed"]["task_id"] == "t-release-2"
    finally:
        store.close()


def _run(root, tmp_path, prepared, lease: SlotLease | None, domain: dict | None = None):
    sh = _drivers(root, tmp_path, prepared, "success")
    payload = VmReleasePayload(allocation_id=lease.allocation_id if lease else str(uuid.uuid4()),
                               slot=approved_slot_of_host(type("H", (), {"root": root}), 0))
    store = StateStore.open(tmp_path / f"state-{uuid.uuid4().hex[:8]}.db")
    run = ReleaseRun(drivers=sh, payload=payload, task_id="t", ctx=task_ctx(store, "t"), holders=(lease,) if lease else (),
                     record=None)
    found = Found(domain=domain, ports=[], reservations=[], lease=[], slot_record=None)

    async def go():
        try:
            return await gpu_handover(run, found)
        finally:
            await sh.close()

    try:
        done = asyncio.run(go())
        if done.proof is not None:  # a handover that passed is remembered per device (unquarantine reads it)
            assert store.meta(handover_meta_key(lease.gpu_pci_address)) is not None
            assert store.meta(handover_meta_key(lease.fabric_vf_pci_address)) is not None
        return done, sh.gpu_tool
    finally:
        store.close()


def test_the_leases_policy_decides_and_a_profile_without_gpus_skips(gpu_host, tmp_path, prepared_host):
    slot = approved_slot_of_host(gpu_host, 0)
    fixed = LeaseHandover(profile="h200_1g_24c_64g", wipe=WipePolicy(), zeros_guaranteed=True,
                          gpu=GpuHandoverPolicy(), fixed_at=time.time())
    done, _ = _run(gpu_host.root, tmp_path, prepared_host, _lease(gpu_host.root, slot, str(uuid.uuid4()), fixed))
    assert done.proof is not None and done.proof.policy_source == "lease" and done.proof.gpus[0].address == GPU

    lab = fixed.model_copy(update={"profile": "lab_tcg_1c_512m", "gpu": None})
    done, tool = _run(gpu_host.root, tmp_path, prepared_host, _lease(gpu_host.root, slot, str(uuid.uuid4()), lab))
    assert done.proof is None and "passes no GPU through" in done.skipped and tool.runner.calls == []

    done, tool = _run(gpu_host.root, tmp_path, prepared_host, None)
    assert done.proof is None and "no lease" in done.skipped and tool.runner.calls == []


def test_a_legacy_lease_skips_a_gpu_that_was_never_passed_through(gpu_host, tmp_path, prepared_host):
    slot = approved_slot_of_host(gpu_host, 0)
    legacy = _lease(gpu_host.root, slot, str(uuid.uuid4()))
    done, tool = _run(gpu_host.root, tmp_path, prepared_host, legacy,
                      domain={"metadata": {"profile": "lab_tcg_1c_512m"}})
    assert done.proof is None and "lab_tcg_1c_512m passes no GPU through" in done.skipped and tool.runner.calls == []
    # The lab's host: its GPUs stay on nvidia (never passed through); a legacy lease there resets nothing.
    driver = gpu_host.root / DEVICES / GPU / "driver"
    target = driver.readlink()
    driver.unlink()
    driver.symlink_to(str(target).replace("vfio-pci", "nvidia"))
    try:
        done, tool = _run(gpu_host.root, tmp_path, prepared_host, legacy)
        assert done.proof is None and "is on nvidia, not vfio-pci" in done.skipped and tool.runner.calls == []
    finally:
        driver.unlink()
        driver.symlink_to(target)


def test_firmware_changed_during_the_tenancy_blocks_and_quarantines_the_slot_until_it_reads_as_before(
        gpu_host, tmp_path, prepared_host):
    slot = approved_slot_of_host(gpu_host, 0, ovs_bridge=prepared_host.bridge)
    report = discover(HostRoot.open(gpu_host.root))
    recorded = slot_firmware(report, slot)
    nvme = next(c for c in recorded if c.kind == "nvme_fw")
    assert nvme.version == "E2MU200"
    alloc = str(uuid.uuid4())
    store = StateStore.open(tmp_path / "state.db")
    handover = LeaseHandover(profile="h200_1g_24c_64g", wipe=WipePolicy(), zeros_guaranteed=True,
                             gpu=GpuHandoverPolicy(), fixed_at=time.time(), firmware=recorded)
    store.take_lease(_lease(gpu_host.root, slot, alloc, handover))
    rev = (gpu_host.root / nvme.source.lstrip("/")).resolve()
    original = rev.read_text()
    payload = VmReleasePayload(allocation_id=alloc, slot=slot, graceful_timeout_s=1)

    try:
        rev.write_text("E2MU999\n")  # the tenant reflashed the slot's disk controller
        ctx = task_ctx(store, "t-release-fw")
        with pytest.raises(PipelineFailed) as failed:
            asyncio.run(_released(_drivers(gpu_host.root, tmp_path, prepared_host, "success"), payload, ctx))
        assert (failed.value.failed_step, failed.value.code) == ("firmware_check", "firmware_changed")
        assert "E2MU200 -> E2MU999" in failed.value.message
        assert store.slot_state(0).status is SlotStatus.cleanup_blocked
        assert [lease.allocation_id for lease in store.leases()] == [alloc]
        [quarantined] = store.quarantined()
        assert (quarantined.kind.value, quarantined.identity, quarantined.reason.value) == ("slot", "0",
                                                                                           "firmware_changed")
        check = RecheckContext(host_root=gpu_host.root, store=store)
        verdict = asyncio.run(recheck_firmware(check, quarantined))
        assert not verdict.passed and "E2MU999" in verdict.detail
        rev.write_text(original)  # reflashed back by the operator
        assert asyncio.run(recheck_firmware(check, quarantined)).passed
    finally:
        rev.write_text(original)
        store.close()
