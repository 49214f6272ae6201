"""A provision refuses what it can before anything is leased or written, and its undo touches only its own.

Real pieces: loop disks behind the recorded 8xH200 host (lab/loophost.py), the
real pipeline (``provision``), the SQLite store, a real dnsmasq hosts file, and
libvirt's test driver for the domain of another slot. Each refusal leaves the
slot clean: no lease, no slot record, the disk's first MiB unchanged.
"""

from __future__ import annotations

import asyncio
import uuid

import libvirt
import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.domain import DomainSpec, DomainState
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.discovery.ovmf import find_ovmf
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations, make_reservation
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.provision import ProvisionRun, provision, provision_steps
from tests.support.provision_inputs import (
    LIBVIRT_TEST_URI,
    approved_slot_of_host,
    provision_payload,
    slice_drivers_for,
    task_ctx,
)
from tests.tasks.conftest import provision_failure, slice_loop_host

MiB = 1 << 20


@pytest.fixture
def loop_host(tmp_path):
    with slice_loop_host(tmp_path / "host", disk_bytes=64 * MiB, slots=2) as host:
        yield host


@pytest.fixture
def test_driver():
    """test:///default forgets its domains when the last connection closes: hold one for the test."""
    conn = libvirt.open(LIBVIRT_TEST_URI)
    yield conn
    conn.close()


def _refused_before_lease(host, tmp_path, payload, *, store=None) -> PipelineFailed:
    """Run the real pipeline; it must fail in validate with the slot clean and the disk as it was."""
    sh = slice_drivers_for(host, tmp_path)
    own_store = store is None
    store = store or StateStore.open(tmp_path / "state.db")
    leases_before = store.leases()
    ctx = task_ctx(store, f"t-{uuid.uuid4().hex[:8]}")
    disk = host.disks[payload.slot.slot_index].loop
    before = open(disk, "rb").read(MiB)

    failure = provision_failure(sh, payload, ctx)
    assert failure.failed_step == "validate" and failure.disk_touched is False, failure
    assert "\n" not in failure.message
    assert store.leases() == leases_before, "nothing leased"
    record = store.slot_state(payload.slot.slot_index)
    assert record is None or record.allocation_id != payload.allocation_id, "no slot record of this task"
    assert [o.status.value for o in ctx.slot_outcomes] == ["reserved"]
    assert open(disk, "rb").read(MiB) == before
    if own_store:
        store.close()
    return failure


def test_an_ip_equal_to_the_gateway_is_ip_reserved_before_the_lease(loop_host, tmp_path):
    failure = _refused_before_lease(loop_host, tmp_path, provision_payload(approved_slot_of_host(loop_host, 0, private_ip="10.100.0.1")))
    assert failure.code == "ip_reserved" and failure.evidence["role"] == "gateway"
    assert failure.evidence["field"] == "slot.private_ip"


def test_an_ip_outside_the_subnet_is_ip_outside_subnet_before_the_lease(loop_host, tmp_path):
    failure = _refused_before_lease(loop_host, tmp_path, provision_payload(approved_slot_of_host(loop_host, 0, private_ip="192.168.7.10")))
    assert failure.code == "ip_outside_subnet" and failure.evidence["subnet"] == "10.100.0.0/24"


@pytest.mark.parametrize("what", ["mac", "ip", "hostname"])
def test_a_mac_ip_or_hostname_reserved_by_another_slot_is_refused_before_the_lease(loop_host, tmp_path, what):
    slot = approved_slot_of_host(loop_host, 0)
    other = approved_slot_of_host(loop_host, 1)
    reservations = DnsmasqReservations(tmp_path / "hosts", SliceConfig().subnet, SliceConfig().gateway)
    reservations.add(make_reservation(
        str(uuid.uuid4()), 1,
        slot.mac if what == "mac" else other.mac,
        slot.private_ip if what == "ip" else other.private_ip,
        "tenant-vm" if what == "hostname" else "someone-else"))
    failure = _refused_before_lease(loop_host, tmp_path, provision_payload(slot))
    assert failure.code == f"{what}_in_use"
    assert failure.evidence["field"] == {"mac": "slot.mac", "ip": "slot.private_ip", "hostname": "hostname"}[what]


def test_slot_index_99_with_slot_1s_devices_is_slot_mismatch_before_the_lease(loop_host, tmp_path):
    slot = approved_slot_of_host(loop_host, 1, slot_index=99, slot_id="s-99")
    payload = provision_payload(slot)
    sh = slice_drivers_for(loop_host, tmp_path)
    store = StateStore.open(tmp_path / "state.db")

    async def scenario():
        try:
            await provision(sh, payload, task_ctx(store, "t-99"))
        finally:
            await sh.close()

    with pytest.raises(PipelineFailed) as info:
        asyncio.run(scenario())
    assert info.value.code == "slot_mismatch" and info.value.evidence["field"] == "slot_index"
    assert store.leases() == [] and store.slot_state(99) is None
    store.close()


def test_a_mac_that_is_not_the_slots_own_is_slot_mismatch_before_the_lease(loop_host, tmp_path):
    failure = _refused_before_lease(loop_host, tmp_path, provision_payload(approved_slot_of_host(loop_host, 0, mac="02:00:00:00:00:42")))
    assert failure.code == "slot_mismatch" and failure.evidence["field"] == "mac"
    assert failure.evidence["requested"] == "02:00:00:00:00:42"


def _first_slot_running(test_driver, host, alloc: str) -> str:
    """Slot 0 of ``alloc`` as a provision left it: the lease, the active record, its domain running."""
    spec = DomainSpec(allocation_id=alloc, slot_index=0, task_id="t-first", profile=get_profile("lab_tcg_1c_512m"),
                      nvme_device=approved_slot_of_host(host, 0).nvme_device, mac=approved_slot_of_host(host, 0).mac, ovs_bridge="ovsbr0",
                      seed_iso_path="/var/lib/gpuaas/seeds/first.iso", firmware=find_ovmf(HostRoot.open("/")),
                      agent_version="0.1.0")

    async def define():
        async with LibvirtLifecycle(LIBVIRT_TEST_URI) as lc:
            return (await lc.define(spec)).domain.uuid

    first_uuid = asyncio.run(define())
    test_driver.lookupByUUIDString(first_uuid).create()
    return first_uuid


def _first_domain_state(alloc_uuid: str, test_driver) -> DomainState:
    dom = test_driver.lookupByUUIDString(alloc_uuid)
    return DomainState.running if dom.isActive() else DomainState.shutoff


def test_a_second_slot_of_an_allocation_is_allocation_has_slot_and_the_first_vm_is_untouched(
        loop_host, tmp_path, test_driver):
    alloc = str(uuid.uuid4())
    first_uuid = _first_slot_running(test_driver, loop_host, alloc)
    try:
        store = StateStore.open(tmp_path / "state.db")
        first = approved_slot_of_host(loop_host, 0)
        store.take_lease(SlotLease(allocation_id=alloc, slot_index=0, gpu_pci_address=first.gpu_pci_address,
                                   nvme_device=first.nvme_device, disk_identity="nguid:000000000000000100a075244a103331",
                                   fabric_vf_pci_address=first.fabric_vf_pci_address, task_id="t-first", taken_at=1.0))
        failure = _refused_before_lease(loop_host, tmp_path, provision_payload(approved_slot_of_host(loop_host, 1), alloc=alloc),
                                        store=store)
        assert failure.code == "allocation_has_slot" and failure.evidence["held_slots"] == [0]
        assert [(l.allocation_id, l.slot_index) for l in store.leases()] == [(alloc, 0)]
        assert _first_domain_state(first_uuid, test_driver) is DomainState.running
        store.close()
    finally:
        dom = test_driver.lookupByUUIDString(first_uuid)
        dom.destroy()
        dom.undefine()


def test_undo_after_a_define_conflict_leaves_another_slots_domain_running(loop_host, tmp_path, test_driver,
                                                                        prepared_host):
    """The host lost its records of slot 0 (so admission cannot see it): slot 1's define meets slot 0's
    domain (the name is per allocation), and the define/start compensations must leave it alone."""
    alloc = str(uuid.uuid4())
    first_uuid = _first_slot_running(test_driver, loop_host, alloc)
    sh = slice_drivers_for(loop_host, tmp_path, prepared_host)
    store = StateStore.open(tmp_path / "state.db")
    payload = provision_payload(approved_slot_of_host(loop_host, 1, ovs_bridge=prepared_host.bridge), alloc=alloc)
    run = ProvisionRun(drivers=sh, payload=payload, profile=get_profile("lab_tcg_1c_512m"), task_id="t-second",
                       ctx=task_ctx(store, "t-second"))
    steps = {step.name: step for step in provision_steps(run)}

    async def scenario():
        try:
            await steps["validate"].run()  # real admission: nothing of slot 0 is recorded on this host
            with pytest.raises(Exception) as err:
                await steps["define"].run()
            undone = [await steps["define"].compensate(), await steps["start"].compensate()]
            return err.value, undone
        finally:
            await steps["validate"].compensate()
            await sh.close()

    try:
        err, undone = asyncio.run(scenario())
        assert getattr(err, "code", None) == "domain_name_conflict"
        assert all(u.get("left", "").startswith(f"domain of allocation {alloc} slot 0") for u in undone), undone
        assert _first_domain_state(first_uuid, test_driver) is DomainState.running
        assert test_driver.lookupByUUIDString(first_uuid).isPersistent()
        assert store.leases() == []
    finally:
        dom = test_driver.lookupByUUIDString(first_uuid)
        dom.destroy()
        dom.undefine()
        store.close()
