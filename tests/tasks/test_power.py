"""``slice.vm_power`` driven with a store and a SliceDrivers over real pieces.

Real: libvirt's test driver (``test:///default``: it rejects the ACPI shutdown flag, so
``stop`` takes the plain-shutdown fallback, docs/testing.md), a private ovsdb-server and
ovs-vswitchd, the recorded 8xH200 host with its slot disk backed by a loop device (the
disk guard runs for real), the SQLite store. The domain is defined by the lifecycle
driver exactly as provision defines it.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import libvirt
import pytest

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.domain import DomainSpec, DomainState, GuestSlot, OvmfFirmware
from gpuaas_agent.contract.isolation import GUARD_TABLE
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import TaskEnvelope, TaskType, VmPowerPayload, task_payload
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import ContractError
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.network.dnsmasq import make_reservation
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle, parse_domain_devices
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.boot_recovery import recover_slot
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.power import PowerRefused, power
from gpuaas_agent.tasks.power_line import PowerSuperseded
from tests.conftest import HOSTS
from tests.support.ovsdb_fixture import OvsSwitch, root_netns_lock
from tests.support.provision_inputs import TaskCtx
from tests.tasks.conftest import slice_loop_host

URI = "test:///default"
MiB = 1 << 20
FIRMWARE = OvmfFirmware(code_path="/usr/share/OVMF/OVMF_CODE_4M.fd",
                        vars_template_path="/usr/share/OVMF/OVMF_VARS_4M.fd")


@dataclass
class Ctx(TaskCtx):
    """The shared task context, keeping the (step, status) progress events the power handler reports."""

    events: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.on_progress = lambda step, status, percent: self.events.append((step, status))


@pytest.fixture(autouse=True)
def test_driver():
    """test:///default forgets its domains when its last connection closes: hold one for the test."""
    conn = libvirt.open(URI)
    yield conn
    conn.close()


@pytest.fixture
def loop_host(tmp_path):
    with slice_loop_host(tmp_path / "host", disk_bytes=16 * MiB) as host:
        yield host


@dataclass
class Slice:
    sh: SliceDrivers
    store: StateStore
    alloc: str
    lease: SlotLease
    spec: DomainSpec
    bridge: str
    remote: str
    data_leases: list = field(default_factory=list)  # a multi-slot slice's other slots

    @property
    def name(self) -> str:
        return domain_name(self.alloc)

    def state(self, conn) -> DomainState:
        return {libvirt.VIR_DOMAIN_RUNNING: DomainState.running,
                libvirt.VIR_DOMAIN_SHUTOFF: DomainState.shutoff}[conn.lookupByName(self.name).state()[0]]

    def snapshot(self, conn) -> tuple:
        """Everything a refusal must leave as it was."""
        return (self.store.leases(), self.store.slot_states(), self.state(conn),
                self.store.journal_of("t-power"))


@pytest.fixture
def root_nft_guard():
    """The start's host-side guard tables live in the root namespace, where a lab's do: one session at a time
    (another session's teardown deleting them under a running lab opened its guests)."""
    with root_netns_lock():
        yield


def _provisioned(host, ovs_switch: OvsSwitch, tmp_path, test_driver, indexes=(0,)):
    """The slots ``indexes`` (the first boots) as a successful provision leaves them: leased, records active,
    one domain holding every slot's disk, defined and running."""
    report = discover(HostRoot.open(host.root))
    candidates = [report.candidate_slots[i] for i in indexes]
    identity = {d.by_id: d.disk_identity for d in report.nvme_devices}
    boot = candidates[0]
    alloc = str(uuid.uuid4())
    spec = DomainSpec(allocation_id=alloc, slot_index=boot.slot_index, task_id="t-provision",
                      profile=get_profile("lab_tcg_1c_512m"), nvme_device=boot.nvme_device, mac=boot.mac,
                      ovs_bridge=ovs_switch.bridge, seed_iso_path=str(tmp_path / "seed.iso"), firmware=FIRMWARE,
                      agent_version="0.1.0",
                      extra_slots=[GuestSlot(slot_index=c.slot_index, nvme_device=c.nvme_device) for c in candidates[1:]])
    sh = SliceDrivers(host_root=host.root,
                   slice=SliceConfig(allow_emulated_domains=True, ovsdb_remote=ovs_switch.remote,
                                     dnsmasq_hosts_file=tmp_path / "dnsmasq-hosts",
                                     dnsmasq_pid_file=tmp_path / "dnsmasq.pid"),
                   images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle(URI))
    # The boot slot's reservation: a start isolates the port by the reserved MAC and IP.
    sh.reservations().add(make_reservation(alloc, boot.slot_index, boot.mac, boot.private_ip, "slice-0"))
    store = StateStore.open(tmp_path / "state.db")
    leases = [SlotLease(allocation_id=alloc, slot_index=c.slot_index, gpu_pci_address=c.gpu_pci_address,
                        nvme_device=c.nvme_device, disk_identity=identity[c.nvme_device],
                        fabric_vf_pci_address=c.fabric_vf_pci_address, task_id="t-provision", taken_at=time.time())
              for c in candidates]
    store.take_leases(leases)
    for c in candidates:
        store.set_slot_state(SlotRecord(slot_index=c.slot_index, allocation_id=alloc, status=SlotStatus.active,
                                        health_state=HealthState.healthy, detail={"domain": spec.domain_name},
                                        task_id="t-provision", updated_at=time.time()))

    async def define():
        await sh.libvirt.define(spec)

    asyncio.run(define())
    test_driver.lookupByName(spec.domain_name).create()
    return Slice(sh=sh, store=store, alloc=alloc, lease=leases[0], spec=spec, bridge=ovs_switch.bridge,
                 remote=ovs_switch.remote, data_leases=leases[1:])


def _teardown(s: Slice, test_driver) -> None:
    for family in ("inet", "arp"):  # the start's host-side guard, made in this (root) namespace
        subprocess.run(["nft", "delete", "table", family, GUARD_TABLE], capture_output=True, timeout=30)
    for name in (s.spec.domain_name, "gpuaas-other-disk-user"):
        try:
            dom = test_driver.lookupByName(name)
        except libvirt.libvirtError:
            continue
        if dom.isActive():
            dom.destroy()
        dom.undefine()
    s.store.close()


@pytest.fixture
def active_slice(root_nft_guard, loop_host, ovs_switch: OvsSwitch, tmp_path, test_driver):
    """Slot 0 as a successful provision leaves it: leased, record active, domain defined and running."""
    s = _provisioned(loop_host, ovs_switch, tmp_path, test_driver)
    yield s
    _teardown(s, test_driver)


def _ctx(store, task_id="t-power") -> Ctx:
    envelope = TaskEnvelope(task_id=task_id, type="slice.vm_power", node_id="node-1", attempt=1,
                            deadline=datetime.now(UTC) + timedelta(minutes=10), payload={})
    return Ctx(store=store, envelope=envelope)


def _power(s: Slice, operation: str, task_id: str = "t-power", **over):
    payload = VmPowerPayload(**{"allocation_id": s.alloc, "slot_index": 0, "operation": operation,
                                "graceful_timeout_s": 5, **over})
    ctx = _ctx(s.store, task_id)

    async def go():
        # A fresh lifecycle per call: asyncio.run closes the loop its executor futures belong to.
        s.sh.libvirt = LibvirtLifecycle(URI)
        try:
            return await power(s.sh, payload, ctx)
        finally:
            await s.sh.libvirt.close()

    return asyncio.run(go()), ctx


def _agent_port(s: Slice):
    with OvsDriver(s.remote, timeout_s=10.0) as ovs:
        return [p for p in ovs.list_agent_ports(s.bridge) if p.allocation_id == s.alloc]


def test_stop_start_reset_reboot_keep_the_slice_active_and_leased(active_slice, test_driver):
    s = active_slice
    out, ctx = _power(s, "stop", "t-stop")
    assert out["changed"] and out["done"] == ["shutdown"] and out["state"] == "shutoff"
    assert out["power_state"] == "stopped" and s.state(test_driver) is DomainState.shutoff
    # The test driver rejects the ACPI flag: plain shutdown() within the deadline, no destroy.
    assert out["steps"]["shutdown"]["graceful"] and not out["steps"]["shutdown"]["destroyed"]
    record = s.store.slot_state(0)
    assert record.status is SlotStatus.active and record.detail.power_state == "stopped"
    assert record.detail.domain == s.name  # provision's detail is kept
    assert record.detail.last_power_operation.operation == "stop" and record.task_id == "t-stop"
    assert s.store.leases() == [s.lease]  # a stopped slice keeps its lease (and its disk)
    assert [(o.status.value, o.health_detail["power_state"]) for o in ctx.slot_outcomes] == [("active", "stopped")]
    assert ("shutdown", "succeeded") in ctx.events

    again, _ = _power(s, "stop", "t-stop-2")
    assert not again["changed"] and again["done"] == ["nothing: domain was already shutoff"]

    out, _ = _power(s, "start", "t-start")
    assert out["changed"] and out["state"] == "running" and s.state(test_driver) is DomainState.running
    started = out["steps"]["start"]
    assert "disk_guard_passed" in started["preconditions"]["checks_passed"]
    assert started["preconditions"]["disk"]["by_id"] == s.lease.nvme_device
    # The agent's port ids are back on the port libvirt would have re-created.
    (port,) = _agent_port(s)
    assert port.name == vnic_name(s.alloc, 0) and port.attached_mac == s.spec.mac and port.slot_index == 0
    assert s.store.slot_state(0).detail.power_state == "running"

    again, _ = _power(s, "start", "t-start-2")
    assert not again["changed"] and again["state"] == "running"

    out, _ = _power(s, "reset", "t-reset")
    assert out["done"] == ["reset"] and out["steps"]["reset"]["state"] == "running"
    assert s.state(test_driver) is DomainState.running

    out, ctx = _power(s, "reboot", "t-reboot")
    assert out["done"] == ["shutdown", "start"] and out["state"] == "running"
    assert [e for e in ctx.events if e[1] == "succeeded"] == [("shutdown", "succeeded"), ("start", "succeeded")]
    record = s.store.slot_state(0)
    assert record.status is SlotStatus.active and record.detail.last_power_operation.task_id == "t-reboot"
    assert s.store.leases() == [s.lease]


def test_reconcile_reports_a_slice_the_tenant_stopped_as_info_and_a_dead_one_as_error(active_slice, test_driver,
                                                                                       tmp_path):
    """A shut-off domain of an active slot is always a finding (issue 17): ``info`` when the slot record says the
    tenant stopped it, ``error`` when nobody did (a crash, a host reboot); nothing else about the slice is reported."""
    from gpuaas_agent.host.network.dnsmasq import make_reservation
    from gpuaas_agent.tasks.reconcile import reconcile

    s = active_slice
    s.sh.slice = s.sh.slice.model_copy(update={"dnsmasq_hosts_file": tmp_path / "hosts",
                                               "dnsmasq_lease_file": tmp_path / "leases"})
    ip = str(s.sh.slice.subnet.network_address + 10)
    s.sh.reservations().add(make_reservation(s.alloc, 0, s.spec.mac, ip, "tenant"))
    _power(s, "stop", "t-stop")
    assert s.store.slot_state(0).detail.power_state == "stopped"

    async def go():
        s.sh.libvirt = LibvirtLifecycle(URI)
        try:
            return await reconcile(s.sh, s.store, repair=False)
        finally:
            await s.sh.libvirt.close()

    def mine(report):
        return [f for f in report.findings if s.alloc in (f.subject, f.detail.get("allocation_id"))]

    (finding,) = mine(asyncio.run(go()))
    assert (finding.kind.value, finding.severity.value, finding.actual) == ("domain_shutoff", "info", "shutoff")
    assert finding.detail["power_state"] == "stopped" and finding.detail["last_power_operation"]["operation"] == "stop"

    # The record says running (as after a host reboot): the same shut-off domain is an error.
    record = s.store.slot_state(0)
    s.store.set_slot_state(record.model_copy(update={"detail": record.detail.updated(power_state="running")}))
    (finding,) = mine(asyncio.run(go()))
    assert (finding.kind.value, finding.severity.value) == ("domain_shutoff", "error")


def test_a_stopped_slice_started_by_reboot_just_starts(active_slice, test_driver):
    s = active_slice
    test_driver.lookupByName(s.name).destroy()
    out, _ = _power(s, "reboot", "t-reboot")
    assert out["done"] == ["start"] and out["state"] == "running"


def _start_after_a_lease_moved_is_a_mismatch(s: Slice, conn, lease, *, other_disk: int) -> None:
    """``lease`` re-taken for another candidate slot's disk (``other_disk``) while the domain is off: a start is
    ``domain_lease_mismatch`` and the domain stays off."""
    s.store.release_slot_lease(s.alloc, lease.slot_index)
    candidates = discover(HostRoot.open(HOSTS / "h200-slice-after-transition")).candidate_slots
    s.store.take_lease(lease.model_copy(update={"nvme_device": candidates[other_disk].nvme_device}))
    conn.lookupByName(s.name).destroy()
    with pytest.raises(PipelineFailed) as info:
        _power(s, "start")
    assert info.value.code == "domain_lease_mismatch"
    assert s.state(conn) is DomainState.shutoff


def _start_while_another_domain_uses(s: Slice, conn, disk: str) -> None:
    """Another running domain uses ``disk`` while the slice is off: a start is refused (``in_use_by_domain``) at the
    start step, and nothing is started."""
    conn.lookupByName(s.name).destroy()
    conn.defineXML(
        "<domain type='test'><name>gpuaas-other-disk-user</name><memory>1024</memory><os><type>hvm</type></os>"
        f"<devices><disk type='block' device='disk'><source dev='{disk}'/>"
        "<target dev='vda' bus='virtio'/></disk></devices></domain>").create()
    with pytest.raises(PipelineFailed) as info:
        _power(s, "start")
    assert info.value.code == "in_use_by_domain" and info.value.failed_step == "start"
    assert s.state(conn) is DomainState.shutoff  # nothing started


def _refusal(s: Slice, conn, operation: str, code: str):
    before = s.snapshot(conn)
    with pytest.raises(PowerRefused) as info:
        _power(s, operation)
    assert info.value.code == code, info.value
    assert s.snapshot(conn) == before  # nothing changed: lease, record, domain, journal
    return info.value


@pytest.mark.parametrize("operation", ["stop", "start", "reboot", "reset"])
def test_a_slot_this_host_does_not_lease_is_refused(active_slice, test_driver, operation):
    s = active_slice
    s.store.release_slot_lease(s.alloc, 0)
    s.store.clear_slot_state(0)
    refused = _refusal(s, test_driver, operation, "slot_not_active")
    assert refused.evidence["lease_held"] is False


@pytest.mark.parametrize("status", [SlotStatus.provisioning, SlotStatus.releasing])
def test_a_slot_that_is_not_active_is_refused(active_slice, test_driver, status):
    s = active_slice
    s.store.set_slot_state(s.store.slot_state(0).model_copy(update={"status": status}))
    refused = _refusal(s, test_driver, "stop", "slot_not_active")
    assert refused.evidence["host_status"] == status.value


def test_a_cleanup_blocked_slot_is_refused(active_slice, test_driver):
    s = active_slice
    s.store.set_slot_state(s.store.slot_state(0).model_copy(update={"status": SlotStatus.cleanup_blocked}))
    _refusal(s, test_driver, "start", "slot_cleanup_blocked")


def test_another_allocations_slot_is_refused(active_slice, test_driver):
    s = active_slice
    other = str(uuid.uuid4())
    before = s.snapshot(test_driver)
    with pytest.raises(PowerRefused) as info:
        _power(s, "stop", allocation_id=other)
    assert info.value.code == "not_this_allocation" and info.value.evidence["held_by"] == s.alloc
    assert s.snapshot(test_driver) == before


def test_a_domain_whose_metadata_names_another_slot_is_not_ours(active_slice, test_driver):
    s = active_slice
    # The domain with this allocation's name claims slot 1: the agent did not define it for slot 0.
    dom = test_driver.lookupByName(s.name)
    dom.destroy()
    dom.undefine()
    foreign = s.spec.model_copy(update={"slot_index": 1})

    async def define():
        async with LibvirtLifecycle(URI) as lc:
            await lc.define(foreign)

    asyncio.run(define())
    test_driver.lookupByName(s.name).create()
    refused = _refusal(s, test_driver, "stop", "domain_not_ours")
    assert refused.evidence["domain"]["metadata"]["slot_index"] == 1


def test_a_domain_without_agent_metadata_is_not_ours(active_slice, test_driver):
    s = active_slice
    dom = test_driver.lookupByName(s.name)
    dom.destroy()
    dom.undefine()
    test_driver.defineXML(f"<domain type='test'><name>{s.name}</name><memory>1024</memory>"
                          "<os><type>hvm</type></os></domain>").create()
    _refusal(s, test_driver, "reset", "domain_not_ours")


def test_a_reset_of_a_stopped_slice_is_refused(active_slice, test_driver):
    s = active_slice
    test_driver.lookupByName(s.name).destroy()
    _refusal(s, test_driver, "reset", "domain_not_running")


def test_start_is_refused_while_another_running_domain_uses_the_slot_disk(active_slice, test_driver):
    s = active_slice
    _start_while_another_domain_uses(s, test_driver, s.lease.nvme_device)
    record = s.store.slot_state(0)
    assert record.status is SlotStatus.active and record.detail.power_state == "stopped"
    last = record.detail.last_power_operation
    assert last is not None and last.succeeded is False and last.code == "in_use_by_domain"
    assert s.store.leases() == [s.lease]


def test_start_is_refused_when_the_domain_does_not_use_the_leased_disk(active_slice, test_driver):
    _start_after_a_lease_moved_is_a_mismatch(active_slice, test_driver, active_slice.lease, other_disk=1)


def test_the_domain_devices_are_read_back_from_its_xml(active_slice, test_driver):
    s = active_slice
    devices = parse_domain_devices(s.name, test_driver.lookupByName(s.name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
    assert devices.block_disks == [s.lease.nvme_device] and devices.hostdevs == []
    assert [(i.mac, i.bridge, i.target_dev) for i in devices.interfaces] == [(s.spec.mac, s.bridge,
                                                                              vnic_name(s.alloc, 0))]


def test_parse_domain_devices_reads_hostdev_addresses_and_the_numa_node():
    xml = ("<domain type='kvm'><name>d</name><numatune><memory mode='strict' nodeset='1'/></numatune><devices>"
           "<hostdev mode='subsystem' type='pci'><source><address domain='0x0000' bus='0x1b' slot='0x00' "
           "function='0x0'/></source></hostdev></devices></domain>")
    devices = parse_domain_devices("d", xml)
    assert devices.hostdevs == ["0000:1b:00.0"] and devices.numa_nodeset == "1" and devices.domain_type == "kvm"


@pytest.mark.parametrize("bad", [
    {"operation": "hibernate"}, {"slot_index": -1}, {"slot_index": 256}, {"graceful_timeout_s": 3601},
    {"allocation_id": "not-a-uuid"}, {"slot": {}},
])
def test_a_bad_power_payload_is_an_invalid_payload(bad):
    payload = {"allocation_id": str(uuid.uuid4()), "slot_index": 0, "operation": "stop", **bad}
    envelope = TaskEnvelope(task_id="t", type=TaskType.vm_power.value, node_id="n", attempt=1,
                            deadline=datetime.now(UTC), payload=payload)
    with pytest.raises(ContractError) as info:
        task_payload(envelope)
    assert info.value.code == "invalid_payload"


# -- fairness: one slot's power operations collapse to the latest; the graceful timeout is the host's to cap --


def _payload(s: Slice, operation: str, **over) -> VmPowerPayload:
    return VmPowerPayload(**{"allocation_id": s.alloc, "slot_index": s.lease.slot_index, "operation": operation,
                             "graceful_timeout_s": 5, **over})


async def _until(condition, what: str) -> None:
    """Wait for ``condition()`` on the loop; the deadline is a failure bound, never a timer."""
    deadline = asyncio.get_running_loop().time() + 60.0
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)  # poll step of a deadline wait


def test_a_repeat_of_the_running_power_operation_is_superseded_and_the_newest_waiting_one_wins(active_slice,
                                                                                             test_driver):
    """A tenant hammering reboot: the second reboot is answered at once, a waiting stop is displaced by a newer
    start, and nothing is ever queued behind the running operation beyond that one waiter."""
    s = active_slice

    async def scenario():
        s.sh.libvirt = LibvirtLifecycle(URI)
        lock = s.sh.slot_lock(0)
        try:
            await lock.acquire()  # a release of the slot holds it: the first reboot is in its turn, on the lock
            first = asyncio.create_task(power(s.sh, _payload(s, "reboot"), _ctx(s.store, "t-reboot-1")))
            await _until(lambda: s.sh.power_line.tasks_of(0)["running"] == "t-reboot-1", "the first reboot runs")
            with pytest.raises(PowerSuperseded) as again:
                await power(s.sh, _payload(s, "reboot"), _ctx(s.store, "t-reboot-2"))
            assert again.value.code == "superseded" and again.value.evidence["superseded_by"] == "t-reboot-1"
            stop = asyncio.create_task(power(s.sh, _payload(s, "stop"), _ctx(s.store, "t-stop")))
            await _until(lambda: s.sh.power_line.tasks_of(0)["waiting"] == "t-stop", "the stop waits")
            start = asyncio.create_task(power(s.sh, _payload(s, "start"), _ctx(s.store, "t-start")))
            with pytest.raises(PowerSuperseded) as displaced:
                await stop
            assert displaced.value.evidence["superseded_by"] == "t-start"
            assert displaced.value.evidence["superseded_by_operation"] == "start"
            assert s.sh.power_line.tasks_of(0) == {"running": "t-reboot-1", "waiting": "t-start"}
            lock.release()
            rebooted, started = await first, await start
            return rebooted, started
        finally:
            if lock.locked():
                lock.release()
            await s.sh.libvirt.close()

    rebooted, started = asyncio.run(scenario())
    assert rebooted["done"] == ["shutdown", "start"] and rebooted["state"] == "running"
    assert not started["changed"] and started["state"] == "running"  # ran after the reboot, in its turn
    assert s.store.journal_of("t-reboot-2") == [] and s.store.journal_of("t-stop") == []  # never touched anything
    assert s.store.slot_state(0).detail.last_power_operation.task_id == "t-start"
    assert s.sh.power_line.tasks_of(0) == {"running": None, "waiting": None}
    assert s.state(test_driver) is DomainState.running


def test_a_graceful_timeout_above_the_hosts_cap_is_cut_to_it_and_the_result_says_so(active_slice, test_driver):
    s = active_slice
    s.sh.slice = s.sh.slice.model_copy(update={"max_graceful_timeout_s": 7})
    out, _ = _power(s, "stop", "t-stop", graceful_timeout_s=3600)
    assert out["graceful_timeout_s"] == 7
    assert out["graceful_timeout_capped"] == {"requested_s": 3600, "max_graceful_timeout_s": 7}
    out, _ = _power(s, "start", "t-start", graceful_timeout_s=5)  # within the cap: as asked, nothing said
    assert out["graceful_timeout_s"] == 5 and "graceful_timeout_capped" not in out


@pytest.mark.parametrize("value", [-1, 3601])
def test_max_graceful_timeout_outside_0_to_3600_is_refused_by_the_config(value):
    with pytest.raises(ValueError, match="max_graceful_timeout_s"):
        SliceConfig(max_graceful_timeout_s=value)


# -- a multi-slot slice (one allocation, two slots, one domain) ------------------------------------------------


@pytest.fixture
def loop_host_2(tmp_path):
    with slice_loop_host(tmp_path / "host", disk_bytes=16 * MiB, slots=2) as host:
        yield host


@pytest.fixture
def active_set(root_nft_guard, loop_host_2, ovs_switch: OvsSwitch, tmp_path, test_driver):
    """Slots 0 (boot) and 1 (data disk) of one allocation in one running domain, as a 2-slot provision leaves them."""
    s = _provisioned(loop_host_2, ovs_switch, tmp_path, test_driver, indexes=(0, 1))
    yield s
    _teardown(s, test_driver)


def test_stop_start_reboot_and_reset_of_a_two_slot_slice(active_set, test_driver):
    s = active_set
    (data,) = s.data_leases
    devices = parse_domain_devices(s.name, test_driver.lookupByName(s.name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
    assert devices.block_disks == [s.lease.nvme_device, data.nvme_device]  # the domain holds both disks

    out, _ = _power(s, "stop", "t-stop")
    assert out["done"] == ["shutdown"] and s.state(test_driver) is DomainState.shutoff and out["slots"] == [0, 1]
    out, _ = _power(s, "start", "t-start")
    assert out["state"] == "running" and s.state(test_driver) is DomainState.running
    started = out["steps"]["start"]
    # The data slot's disk was guarded under its own lease, not only the boot slot's (provision's start guard).
    assert [d["by_id"] for d in started["data_disks"]] == [data.nvme_device]
    assert started["preconditions"]["disk"]["by_id"] == s.lease.nvme_device
    out, _ = _power(s, "reboot", "t-reboot")
    assert out["done"] == ["shutdown", "start"] and out["state"] == "running"
    out, _ = _power(s, "reset", "t-reset")
    assert out["done"] == ["reset"] and s.state(test_driver) is DomainState.running
    for index in (0, 1):  # every slot stays active and leased
        assert s.store.slot_state(index).status is SlotStatus.active
    assert sorted(lease.slot_index for lease in s.store.leases()) == [0, 1]


def test_start_of_a_two_slot_slice_guards_the_data_disk_under_its_own_lease(active_set, test_driver):
    (data,) = active_set.data_leases
    # Another domain uses the data slot's disk: the start is refused by the data disk's guard, nothing started.
    _start_while_another_domain_uses(active_set, test_driver, data.nvme_device)


def test_start_of_a_two_slot_slice_whose_domain_lacks_a_leased_disk_is_a_lease_mismatch(active_set, test_driver):
    (data,) = active_set.data_leases
    _start_after_a_lease_moved_is_a_mismatch(active_set, test_driver, data, other_disk=2)


def test_power_of_a_two_slot_slice_whose_data_slot_is_releasing_is_refused(active_set, test_driver):
    s = active_set
    s.store.set_slot_state(s.store.slot_state(1).model_copy(update={"status": SlotStatus.releasing}))
    refused = _refusal(s, test_driver, "start", "slot_not_active")
    assert refused.evidence["slot_index"] == 1 and refused.evidence["host_status"] == "releasing"


def test_boot_recovery_restarts_a_two_slot_slice_with_every_slot_guarded(active_set, test_driver):
    """The same start plan serves boot recovery: a 2-slot slice shut off by a host reboot starts again, its data
    disk guarded under its own lease."""
    s = active_set
    (data,) = s.data_leases
    test_driver.lookupByName(s.name).destroy()

    async def go():
        s.sh.libvirt = LibvirtLifecycle(URI)
        try:
            domain = await s.sh.libvirt.lookup(s.name)
            return await recover_slot(s.sh, s.lease, s.store.slot_state(0), domain, data_slots=(data,))
        finally:
            await s.sh.libvirt.close()

    rec = asyncio.run(go())
    assert rec.outcome == "restarted", [f.model_dump(mode="json") for f in rec.findings]
    assert s.state(test_driver) is DomainState.running
