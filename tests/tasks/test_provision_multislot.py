"""One allocation, N slots (issue 20): refusals before any lease, all-or-nothing leases, per-slot rollback, set release.

Real pieces: loop disks behind the recorded 8xH200 host (lab/loophost.py), the real provision
pipeline and release, the SQLite store, the prepared host's OVS + dnsmasq, libvirt's test driver.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import libvirt
import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord, StepStatus
from gpuaas_agent.contract.tasks import VmReleasePayload
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.host.images.cache import ImageCache, SourcePolicy
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.provision import ProvisionRefused, provision
from gpuaas_agent.tasks.release_set import release_set
from tests.support.provision_inputs import approved_slot_of_host, provision_payload, slice_drivers_for, task_ctx
from tests.tasks.conftest import provision_failure, slice_loop_host

MiB = 1 << 20
LIBVIRT_TEST_URI = "test:///default"


@pytest.fixture(scope="module")
def loop_host(tmp_path_factory):
    with slice_loop_host(tmp_path_factory.mktemp("multislot") / "host", disk_bytes=64 * MiB, slots=3) as host:
        yield host


def _heads(host) -> list[bytes]:
    return [open(d.loop, "rb").read(MiB) for d in host.disks]


def _refused(host, tmp_path, payload, store) -> BaseException:
    """Run provision; it must be refused with nothing leased, recorded for this allocation, or written."""
    sh = slice_drivers_for(host, tmp_path)
    leases_before, heads = store.leases(), _heads(host)
    ctx = task_ctx(store, f"t-{uuid.uuid4().hex[:8]}")

    async def scenario():
        try:
            await provision(sh, payload, ctx)
        finally:
            await sh.close()

    with pytest.raises((PipelineFailed, ProvisionRefused)) as info:
        asyncio.run(scenario())
    if isinstance(info.value, PipelineFailed):
        assert info.value.failed_step == "validate" and info.value.disk_touched is False
    assert store.leases() == leases_before, "nothing leased"
    assert not [r for r in store.slot_states() if r.allocation_id == payload.allocation_id]
    assert _heads(host) == heads, "no disk written"
    return info.value


def test_duplicate_slots_in_the_set_are_refused_in_validate(loop_host, tmp_path):
    s0, s1 = approved_slot_of_host(loop_host, 0), approved_slot_of_host(loop_host, 1)
    store = StateStore.open(tmp_path / "state.db")
    failure = _refused(loop_host, tmp_path, provision_payload(s0, slots=[s0, s1, s1]), store)
    assert failure.code == "duplicate_slot" and failure.evidence["field"] == "slots.slot_index"
    other_ip = approved_slot_of_host(loop_host, 2, private_ip=s1.private_ip)
    failure = _refused(loop_host, tmp_path, provision_payload(s0, slots=[s0, s1, other_ip]), store)
    assert failure.code == "duplicate_slot" and failure.evidence["values"] == [s1.private_ip]
    failure = _refused(loop_host, tmp_path, provision_payload(s0, slots=[s1]), store)
    assert failure.code == "boot_slot_not_in_set"


def test_a_slot_of_another_host_in_the_set_is_not_approved(loop_host, tmp_path):
    s0 = approved_slot_of_host(loop_host, 0)
    elsewhere = approved_slot_of_host(loop_host, 1, gpu_pci_address="0000:c1:00.0")  # no GPU there on this host
    store = StateStore.open(tmp_path / "state.db")
    failure = _refused(loop_host, tmp_path, provision_payload(s0, slots=[s0, elsewhere]), store)
    assert failure.code == "not_approved" and failure.evidence["binding"] == "gpu_pci_address"


def test_a_set_larger_than_the_free_slots_is_refused_before_the_lease(loop_host, tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    other = str(uuid.uuid4())
    candidates = discover(HostRoot.open(loop_host.root)).candidate_slots
    store.take_leases([SlotLease(allocation_id=other, slot_index=c.slot_index, gpu_pci_address=c.gpu_pci_address,
                                 nvme_device=c.nvme_device, disk_identity=f"path:{c.nvme_device}",
                                 fabric_vf_pci_address=c.fabric_vf_pci_address, task_id="t-other", taken_at=1.0)
                       for c in candidates[2:]])
    slots = [approved_slot_of_host(loop_host, i) for i in range(3)]
    failure = _refused(loop_host, tmp_path, provision_payload(slots[0], slots=slots), store)
    assert failure.code == "not_enough_free_slots"
    assert failure.evidence["free_slots"] == [0, 1] and failure.evidence["requested"] == [0, 1, 2]


@pytest.mark.parametrize("where", ["host_record", "control_plane"])
def test_a_set_containing_a_cleanup_blocked_slot_is_refused(loop_host, tmp_path, where):
    store = StateStore.open(tmp_path / "state.db")
    s0, s1 = approved_slot_of_host(loop_host, 0), approved_slot_of_host(loop_host, 1)
    if where == "host_record":
        store.set_slot_state(SlotRecord(slot_index=1, allocation_id=str(uuid.uuid4()),
                                        status=SlotStatus.cleanup_blocked, health_state=HealthState.failed,
                                        task_id="t-old", updated_at=1.0))
    else:
        s1 = s1.model_copy(update={"status": SlotStatus.cleanup_blocked})
    failure = _refused(loop_host, tmp_path, provision_payload(s0, slots=[s0, s1]), store)
    assert failure.code == "slot_cleanup_blocked" and failure.evidence["slot_index"] == 1


def test_a_single_slot_payload_still_provisions_one_slot(loop_host, tmp_path):
    """A v1 payload (no ``slots``) is the set of its one slot: refusals name ``slot`` as before."""
    store = StateStore.open(tmp_path / "state.db")
    payload = provision_payload(approved_slot_of_host(loop_host, 0, private_ip="10.100.0.1"))
    assert payload.slots == []
    failure = _refused(loop_host, tmp_path, payload, store)
    assert failure.code == "ip_reserved" and failure.evidence["field"] == "slot.private_ip"


def test_failures_roll_back_every_slot_by_its_own_disk_and_release_frees_the_set(loop_host, tmp_path, prepared_host):
    image = tmp_path / "image.raw"
    image.write_bytes(b"\x5a" * MiB)
    digest = hashlib.sha256(image.read_bytes()).hexdigest()
    bridge = prepared_host.bridge
    store = StateStore.open(tmp_path / "state.db")
    keep = libvirt.open(LIBVIRT_TEST_URI)  # the test driver forgets its domains when its last connection closes

    # The set is provisioned under a host override that opts the lab profile into discard; the release runs
    # with the override gone. Each slot's wipe must follow what its own lease fixed at validate — the data
    # slot too, whose domain the boot slot's release has already undefined.
    discard = {"lab_tcg_1c_512m": WipePolicy(method=WipeMethod.discard)}

    def sh(wipe_policies=discard):
        return SliceDrivers(host_root=loop_host.root,
                            slice=SliceConfig(**prepared_host.slice_config(wipe_policies=wipe_policies)),
                         images=ImageCache(tmp_path / "cache", policy=SourcePolicy(file_dir=tmp_path)),
                         libvirt=LibvirtLifecycle(LIBVIRT_TEST_URI))

    def slots(*indexes):
        return [approved_slot_of_host(loop_host, i, ovs_bridge=bridge) for i in indexes]

    def run(payload, task_id):
        ctx = task_ctx(store, task_id)
        return provision_failure(sh(), payload, ctx), ctx

    try:
        # (a) Before any disk is touched (the image cannot be fetched): every slot of the set released.
        heads = _heads(loop_host)
        a = slots(0, 1, 2)
        failure, ctx = run(provision_payload(a[0], slots=a, image={"url": "file:///nonexistent", "sha256": "0" * 64}), "t-a")
        assert failure.failed_step == "image" and not failure.disk_touched
        validated = next(e for e in store.journal_of("t-a") if e.step == "validate" and e.status is StepStatus.succeeded)
        assert [d["slot_index"] for d in validated.detail["data_slots"]] == [1, 2]  # all three were leased
        assert store.leases() == [] and store.slot_states() == []
        assert [(o.slot_index, o.status.value) for o in ctx.slot_outcomes] == [(0, "reserved"), (1, "reserved"),
                                                                              (2, "reserved")]
        assert _heads(loop_host) == heads

        # (b) After the boot disk's clone, before the guest starts: only the boot slot is blocked.
        alloc_b = str(uuid.uuid4())
        keep.defineXML(f"<domain type='test'><name>gpuaas-slice-{uuid.UUID(alloc_b).hex}</name><memory>1024</memory>"
                       "<os><type>hvm</type></os></domain>")  # someone else's domain of that name: define refuses
        b = slots(0, 1)
        failure, ctx = run(provision_payload(b[0], alloc=alloc_b, slots=b,
                                    image={"url": f"file://{image}", "sha256": digest}), "t-b")
        assert failure.failed_step == "define" and failure.disk_touched
        assert [(o.slot_index, o.status.value) for o in ctx.slot_outcomes] == [(0, "cleanup_blocked"),
                                                                              (1, "reserved")]
        assert [(lease.allocation_id, lease.slot_index) for lease in store.leases()] == [(alloc_b, 0)]
        assert store.slot_state(0).status is SlotStatus.cleanup_blocked and store.slot_state(1) is None
        assert open(loop_host.disks[0].loop, "rb").read(16) == b"\x5a" * 16  # the image landed on slot 0 only
        assert _heads(loop_host)[1:] == heads[1:]
        keep.lookupByName(f"gpuaas-slice-{uuid.UUID(alloc_b).hex}").undefine()

        # (c) Once the guest was started, every disk of the set may hold data: every slot blocked, each with
        # its own evidence.
        alloc_c = str(uuid.uuid4())
        c = slots(1, 2)
        failure, ctx = run(provision_payload(c[0], alloc=alloc_c, slots=c, readiness_timeout_s=5, guest_telemetry=True,
                                    image={"url": f"file://{image}", "sha256": digest}), "t-c")
        assert failure.failed_step in ("start", "readiness"), failure
        # The start guarded the data slot's disk too, under its own lease (not only the boot slot's).
        started = [e for e in store.journal_of("t-c") if e.step == "start" and e.status is StepStatus.succeeded]
        assert failure.failed_step == "readiness", failure  # the guards of start passed, then no lease came
        assert [d["by_id"] for d in started[0].detail["data_disks"]] == [
            c[1].nvme_device]
        outcomes = {o.slot_index: o for o in ctx.slot_outcomes}
        assert {i: o.status.value for i, o in outcomes.items()} == {1: "cleanup_blocked", 2: "cleanup_blocked"}
        assert outcomes[1].health_detail["disk_role"] == "boot" and outcomes[2].health_detail["disk_role"] == "data"
        assert outcomes[2].health_detail["nvme_device"] == c[1].nvme_device
        assert sorted((lease.allocation_id, lease.slot_index) for lease in store.leases()) == sorted(
            [(alloc_b, 0), (alloc_c, 1), (alloc_c, 2)])
        # The guest telemetry opt-in travels with the provision onto every lease of its set, and only its own.
        assert {(lease.allocation_id, lease.slot_index): lease.guest_telemetry for lease in store.leases()} == {
            (alloc_b, 0): False, (alloc_c, 1): True, (alloc_c, 2): True}

        # Release of the set (v1.1 payload): the domain goes, each disk is wiped and verified, each slot freed.
        ctx = task_ctx(store, "t-release")
        assert {lease.slot_index: lease.handover.wipe.method for lease in store.leases_of(alloc_c)} == {
            1: WipeMethod.discard, 2: WipeMethod.discard}
        host = sh(wipe_policies={})

        async def released():
            try:
                return await release_set(host, VmReleasePayload(allocation_id=alloc_c, slot=c[0], slots=c,
                                                                graceful_timeout_s=1), ctx)
            finally:
                await host.close()

        out = asyncio.run(released())
        assert out["slots"] == [1, 2] and set(out["releases"]) == {"1", "2"}
        assert all(r["cleanup_proof"]["wipe"]["verified"] for r in out["releases"].values())
        assert {r["cleanup_proof"]["wipe"]["policy"] for r in out["releases"].values()} == {"discard"}
        # Every byte covered: a whole-device read after a discard, or Write Zeroes where the loop refuses discard.
        assert {r["cleanup_proof"]["wipe"]["guarantee"] for r in out["releases"].values()} <= {"whole_device_read",
                                                                                              "write_zeroes"}
        assert [(o.slot_index, o.status.value) for o in ctx.slot_outcomes] == [(1, "available"), (2, "available")]
        assert [(lease.allocation_id, lease.slot_index) for lease in store.leases()] == [(alloc_b, 0)]
        assert keep.listDefinedDomains() == [] and keep.listDomainsID() in ([], [1])
    finally:
        for dom in keep.listAllDomains():
            if dom.name().startswith("gpuaas-slice-"):
                if dom.isActive():
                    dom.destroy()
                dom.undefine()
        keep.close()
        store.close()


def test_a_set_crossing_the_profiles_placement_is_refused_in_validate(loop_host, tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    slots = [approved_slot_of_host(loop_host, 3), approved_slot_of_host(loop_host, 4)]  # NUMA node 0 and node 1
    failure = _refused(loop_host, tmp_path, provision_payload(slots[0], slots=slots, runtime_profile="h200_1g_24c_64g_numa"),
                       store)
    assert failure.code == "placement_violated" and failure.evidence["required"] == "same_numa"
    assert failure.evidence["achieved"] == "cross_numa" and failure.evidence["slot_indexes"] == [3, 4]
