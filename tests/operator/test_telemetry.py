"""Slice telemetry: leases x one bulk stats call -> one message per allocation on its own subject; /metrics by slot.

Real parts: a nats-server (one per module), libvirt's test driver through the lifecycle driver, the SQLite store
on its thread; the counters of a real QEMU domain come from the recorded record (fixtures/libvirt/).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import libvirt
import nats
import pytest
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from gpuaas_agent.config import load_config
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.domain import DomainState
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.telemetry import DiskCounters, SliceTelemetry
from gpuaas_agent.daemon import run_agent
from gpuaas_agent.host.network.fabricvf import FabricVfError, FabricVfNetlink, vf_stats_of_link
from gpuaas_agent.host.vm.domstats import parse_all
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtError, LibvirtLifecycle
from gpuaas_agent.operator import bmc
from gpuaas_agent.operator.metrics import AgentMetrics
from gpuaas_agent.operator.telemetry import (
    GpuSensors,
    PfVfCounters,
    SliceMetricsCollector,
    SliceTelemetryLoop,
    default_bounds,
    slice_telemetry,
)
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.state.store import StateStore
from tests.conftest import REPO
from tests.support.agent_process import enrolled_setup
from tests.support.deadline import run_bounded
from tests.support.nats_server import NatsServer, free_port, nats_server_binary
from tests.support.redfish_server import PCI, editable_documents, serving_capture

NODE = "node-telemetry"
RECORDED_ALLOC = "01234567-89ab-cdef-0123-456789abcdef"  # the recorded domain's name is this allocation's
RECORDED_DISK = "/dev/disk/by-id/nvme-SAMSUNG_MZWLO3T8HCLS-00A07_S7PANE0W700123"
ALLOC_A = "23bd713b-6073-4ef7-8a51-2897e902365d"
ALLOC_B = "158ea147-0115-407f-bbd5-1850c32b9517"
URI = "test:///default"


def lease(alloc: str, slot: int, disk: str | None = None) -> SlotLease:
    return SlotLease(allocation_id=alloc, slot_index=slot, gpu_pci_address=f"0000:{0x18 + slot:02x}:00.0",
                     nvme_device=disk or f"/dev/disk/by-id/nvme-eui.{slot:032x}", disk_identity=f"nguid:{slot:032x}",
                     fabric_vf_pci_address=f"0000:{0x40 + slot:02x}:00.1", task_id="task-1", taken_at=1.0)


def recorded_stats():
    return parse_all(json.loads((REPO / "fixtures/libvirt/domstats-qemu-7.2-slice.json").read_text())["records"])


# -- pure matching -----------------------------------------------------------------------------------------


GUEST_RECORD = REPO / "fixtures/libvirt/domstats-qemu-7.2-guest-idle.json"
GUEST_ALLOC = "7e1e0000-0000-4000-8000-000000000000"  # bench/bench_telemetry.py allocation(0)
GUEST_DISK = "/dev/disk/by-id/nvme-eui.7e1e0000000000000000000000000000"  # its by_id(0)


def test_a_real_idle_guests_record_gives_disk_vnic_vcpu_and_memory_and_the_vnic_in_the_guests_view():
    """A record libvirt and QEMU really gave for a booted guest shaped as a slice (``bench/bench_telemetry.py
    --libvirt``: memballoon none as the agent's domains, the disk by the slot's by-id path, a tap by the agent's vNIC
    name): every counter the collector maps is found, nothing is unknown but what has no source there (the fabric
    VF's PF, the BMC). The vNIC's counters are the guest's view: the lab guest sent 20 DHCP discovers (udhcpc -t 20)
    into a tap with no server behind it, and they are ``tx``."""
    data = json.loads(GUEST_RECORD.read_text())
    (name, record), = data["records"]
    assert name == domain_name(GUEST_ALLOC)
    message, = slice_telemetry(NODE, [lease(GUEST_ALLOC, 0, GUEST_DISK)], parse_all(data["records"]),
                               collected_at=100.0, interval_s=15.0, bounds=default_bounds(5.0))
    assert message.state is DomainState.running
    assert message.not_reported == ["slot.0.fabric_vf", "slot.0.gpu"]
    assert (message.vcpus, message.vcpu_time_ns, message.cpu_time_ns) == (1, record["vcpu.0.time"], record["cpu.time"])
    # memballoon none: libvirt reports the configured size (no guest figure, no balloon.last-update) and QEMU's RSS.
    assert {key for key in record if key.startswith("balloon.")} == {"balloon.current", "balloon.maximum", "balloon.rss"}
    assert message.memory_bytes == message.memory_max_bytes == record["balloon.maximum"] * 1024
    assert message.memory_rss_bytes == record["balloon.rss"] * 1024
    slot, = message.slots
    assert slot.disk == DiskCounters(device="vda", read_bytes=record["block.0.rd.bytes"],
                                     read_ops=record["block.0.rd.reqs"], write_bytes=record["block.0.wr.bytes"],
                                     write_ops=record["block.0.wr.reqs"])
    assert slot.disk.read_ops > 0, "the guest kernel read its disk's partition table"
    nic = slot.management_nic
    assert nic is not None and nic.interface == vnic_name(GUEST_ALLOC, 0)
    assert nic.tx_packets >= 20 and nic.tx_bytes >= 20 * 300 > nic.rx_bytes, "the guest's DHCP discovers are tx"



CAPTURE = REPO / "fixtures/redfish/dgx-h100-viking/redfish/v1"
GPU_PORTS = "Systems/HGX_Baseboard_0/Processors/GPU_SXM_3/Ports"


@pytest.fixture(scope="module")
def bmc_capture(tmp_path_factory):
    """The real DGX H100 capture served over TLS as the BMC tests serve it (tests/operator/test_bmc_capture.py),
    ``$expand`` answered; one server for the module."""
    with serving_capture(tmp_path_factory.mktemp("capture"), CAPTURE) as srv:
        yield srv


@pytest.fixture
def capture(bmc_capture):
    """The served capture; ``capture.edit(rel, change)`` changes one document, restored after the test."""
    with editable_documents(bmc_capture) as served:
        yield served


def test_each_slot_carries_its_own_gpus_bmc_sensors_and_never_another_slots(capture):
    """The real DGX H100 capture read as the health pass reads it; each slot gets the GPU its lease names."""
    reading = bmc.read_bmc_verdicts(capture.config())
    gpus = GpuSensors(read_at=reading.read_at, by_pci_address=reading.sensors_by_pci_address())
    mine = lease(RECORDED_ALLOC, 0, RECORDED_DISK).model_copy(update={"gpu_pci_address": PCI["GPU_SXM_3"]})
    other = lease(ALLOC_A, 1).model_copy(update={"gpu_pci_address": PCI["GPU_SXM_7"]})
    unread = lease(ALLOC_B, 2).model_copy(update={"gpu_pci_address": "0000:ff:00.0"})  # not on this BMC's board
    messages = {m.allocation_id: m for m in slice_telemetry(
        NODE, [mine, other, unread], recorded_stats(), collected_at=100.0, interval_s=15.0,
        bounds=default_bounds(5.0), gpus=gpus)}
    slot, = messages[RECORDED_ALLOC].slots
    assert slot.gpu is not None and (slot.gpu.gpu_id, slot.gpu.sxm_slot) == ("GPU_SXM_3", "SXM3")
    assert slot.gpu.temperature is not None and slot.gpu.memory_temperature is not None
    assert slot.gpu.nvlink is not None and slot.gpu.nvlink.ports == 18
    assert slot.gpu_read_at == reading.read_at and "slot.0.gpu" not in messages[RECORDED_ALLOC].not_reported
    assert messages[ALLOC_A].slots[0].gpu.gpu_id == "GPU_SXM_7"
    wire = messages[RECORDED_ALLOC].model_dump_json()
    assert "GPU_SXM_7" not in wire and "GPU_SXM_3" in wire, "a tenant's message names no other GPU"
    assert messages[ALLOC_B].slots[0].gpu is None
    assert SliceTelemetry.from_wire(json.loads(wire)) == messages[RECORDED_ALLOC]


def _samples(scrape: str, prefix: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample whose line starts with ``prefix``."""
    out = {}
    for line in scrape.splitlines():
        if line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_each_slots_gpu_sensors_and_nvlink_are_on_metrics_by_slot_and_leave_with_its_lease(capture):
    """The real capture, GPU_SXM_3 with a down link, NVLink errors and throttle reasons written into its documents:
    slot 0 (GPU_SXM_3) and slot 1 (GPU_SXM_7) on /metrics, labelled by slot only (the GPU named once, in the info
    series), thresholds with whose they are, NVLink per slot and the down link by name; released, all gone."""
    capture.edit(f"{GPU_PORTS}/NVLink_4/Metrics", lambda d: d["Oem"]["Nvidia"]["NVLinkErrors"].update(
        ReplayCount=7, FlitCRCCount=3, RuntimeError=True))
    capture.edit(f"{GPU_PORTS}/NVLink_9/Metrics", lambda d: d["Oem"]["Nvidia"]["NVLinkErrors"].update(
        ReplayCount=5, RecoveryCount=2, DataCRCCount=1, TrainingError=True))
    capture.edit(f"{GPU_PORTS}/NVLink_9", lambda d: d.update(LinkStatus="LinkDown", LinkState="Disabled"))
    capture.edit("Systems/HGX_Baseboard_0/Processors/GPU_SXM_3/ProcessorMetrics",
                 lambda d: d["Oem"]["Nvidia"].update(ThrottleReasons=["HWThermalSlowdown", "SWPowerCap"]))
    reading = bmc.read_bmc_verdicts(capture.config())
    sensors = reading.sensors_by_pci_address()
    gpu3, gpu7 = sensors[PCI["GPU_SXM_3"]], sensors[PCI["GPU_SXM_7"]]
    held = {RECORDED_ALLOC: [lease(RECORDED_ALLOC, 0, RECORDED_DISK).model_copy(
        update={"gpu_pci_address": PCI["GPU_SXM_3"]})],
        ALLOC_A: [lease(ALLOC_A, 1).model_copy(update={"gpu_pci_address": PCI["GPU_SXM_7"]})]}

    async def stats():
        return json.loads((REPO / "fixtures/libvirt/domstats-qemu-7.2-slice.json").read_text())["records"]

    async def leases():
        return [lease for held_by in held.values() for lease in held_by]

    async def publish(subject: str, data: bytes) -> None:
        pass

    loop = SliceTelemetryLoop(NODE, stats, leases, publish, gpus=lambda: GpuSensors(
        read_at=reading.read_at, by_pci_address=sensors))
    assert asyncio.run(loop.round()) == 2
    metrics = AgentMetrics()
    metrics.registry.register(SliceMetricsCollector(loop, lambda: set(held)))
    scrape = metrics.render().decode()
    gpu = _samples(scrape, "gpuaas_agent_slice_gpu_")

    assert gpu['gpuaas_agent_slice_gpu_info{gpu_id="GPU_SXM_3",slot="0",sxm_slot="SXM3"}'] == 1
    assert gpu['gpuaas_agent_slice_gpu_info{gpu_id="GPU_SXM_7",slot="1",sxm_slot="SXM7"}'] == 1
    assert gpu['gpuaas_agent_slice_gpu_read_timestamp_seconds{slot="0"}'] == reading.read_at.timestamp()
    # Temperatures as the BMC read them; the thresholds the real BMC carries (HBM: its own UpperCritical) and
    # NVIDIA's limits where it carries none (the GPU die), each named by its source.
    assert gpu['gpuaas_agent_slice_gpu_temperature_celsius{sensor="gpu",slot="0"}'] == gpu3.temperature.reading_c
    assert gpu['gpuaas_agent_slice_gpu_temperature_celsius{sensor="memory",slot="1"}'] == (
        gpu7.memory_temperature.reading_c)
    assert {k: v for k, v in gpu.items() if k.startswith("gpuaas_agent_slice_gpu_temperature_threshold_celsius")
            and 'slot="0"' in k} == {
        'gpuaas_agent_slice_gpu_temperature_threshold_celsius{level="caution",sensor="gpu",slot="0",'
        'source="nvidia_limit"}': 87.0,
        'gpuaas_agent_slice_gpu_temperature_threshold_celsius{level="critical",sensor="gpu",slot="0",'
        'source="nvidia_limit"}': 95.0,
        'gpuaas_agent_slice_gpu_temperature_threshold_celsius{level="critical",sensor="memory",slot="0",'
        'source="bmc"}': 95.0}
    assert gpu['gpuaas_agent_slice_gpu_power_watts{slot="1"}'] == gpu7.power_w
    assert gpu['gpuaas_agent_slice_gpu_power_limit_watts{slot="0"}'] == 700.0
    assert gpu['gpuaas_agent_slice_gpu_dram_ecc_errors_total{severity="uncorrectable",slot="0"}'] == 0
    assert gpu['gpuaas_agent_slice_gpu_pcie_errors_total{severity="fatal",slot="1"}'] == 0
    assert gpu['gpuaas_agent_slice_gpu_row_remapping{slot="0",state="failed"}'] == 0
    # Throttle reasons by kind; ["NA"] (GPU_SXM_7, as captured) is "the BMC does not say": no sample, never 0.
    assert gpu['gpuaas_agent_slice_gpu_throttle_reasons{kind="hardware",slot="0"}'] == 1
    assert gpu['gpuaas_agent_slice_gpu_throttle_reasons{kind="other",slot="0"}'] == 1
    assert not any(k.startswith("gpuaas_agent_slice_gpu_throttle_reasons{") and 'slot="1"' in k for k in gpu)
    # NVLink per slot (the reading sums the ports), the down link by name (bounded by the BMC's own ports).
    nvlink = {k: v for k, v in gpu.items() if "_nvlink_" in k and 'slot="0"' in k}
    assert nvlink == {
        'gpuaas_agent_slice_gpu_nvlink_ports{slot="0",state="listed"}': 18,
        'gpuaas_agent_slice_gpu_nvlink_ports{slot="0",state="up"}': 17,
        'gpuaas_agent_slice_gpu_nvlink_ports{slot="0",state="disabled"}': 1,
        'gpuaas_agent_slice_gpu_nvlink_ports{slot="0",state="counted"}': 18,
        'gpuaas_agent_slice_gpu_nvlink_errors_total{kind="data_crc",slot="0"}': 1,
        'gpuaas_agent_slice_gpu_nvlink_errors_total{kind="flit_crc",slot="0"}': 3,
        'gpuaas_agent_slice_gpu_nvlink_errors_total{kind="recovery",slot="0"}': 2,
        'gpuaas_agent_slice_gpu_nvlink_errors_total{kind="replay",slot="0"}': 12,
        'gpuaas_agent_slice_gpu_nvlink_error_ports{error="runtime",slot="0"}': 1,
        'gpuaas_agent_slice_gpu_nvlink_error_ports{error="training",slot="0"}': 1,
        'gpuaas_agent_slice_gpu_nvlink_port_down{link="NVLink_9",slot="0"}': 1}
    assert gpu['gpuaas_agent_slice_gpu_nvlink_errors_total{kind="replay",slot="1"}'] == 0
    assert not any(k.startswith("gpuaas_agent_slice_gpu_nvlink_port_down{") and 'slot="1"' in k for k in gpu)
    # Bounded: every GPU series is labelled by slot and fixed values (the BMC names the GPU and a down link only),
    # never by allocation; at most one series per (family, label set) a slot.
    assert not any(ALLOC_A in k or RECORDED_ALLOC in k for k in gpu)
    assert all('slot="0"' in k or 'slot="1"' in k for k in gpu)

    del held[RECORDED_ALLOC]  # released: slot 0's series leave with the lease, at the next scrape
    after = metrics.render().decode()
    assert "GPU_SXM_3" not in after and not any('slot="0"' in line for line in after.splitlines()
                                                if line.startswith("gpuaas_agent_slice_"))
    assert 'gpuaas_agent_slice_gpu_info{gpu_id="GPU_SXM_7",slot="1",sxm_slot="SXM7"} 1.0' in after


def test_a_recorded_domain_is_matched_to_its_lease_slot_disk_and_vnic():
    bounds = default_bounds(5.0)
    message, = slice_telemetry(NODE, [lease(RECORDED_ALLOC, 0, RECORDED_DISK)], recorded_stats(),
                               collected_at=100.0, interval_s=15.0, bounds=bounds)
    assert (message.allocation_id, message.domain, message.state) == (
        RECORDED_ALLOC, domain_name(RECORDED_ALLOC), DomainState.running)
    assert (message.cpu_time_ns, message.vcpu_time_ns, message.vcpus) == (399498000, 190000000, 2)
    assert (message.memory_bytes, message.memory_rss_bytes) == (131072 * 1024, 50944 * 1024)
    slot, = message.slots
    assert slot.disk is not None and (slot.disk.device, slot.disk.read_bytes, slot.disk.read_ops) == ("vda", 512, 1)
    assert slot.management_nic is not None and (slot.management_nic.interface, slot.management_nic.rx_bytes) == (
        "gs0-0123456789", 90)
    # The slot's fabric VF: no PF counters were read, so unknown and named, never 0.
    assert slot.fabric_vf is None
    # Its GPU likewise: no BMC reading was given (no BMC configured).
    assert slot.gpu is None and slot.gpu_read_at is None
    assert message.not_reported == ["slot.0.fabric_vf", "slot.0.gpu"] and (message.interval_s, message.bounds) == (
        15.0, bounds)
    assert SliceTelemetry.from_wire(json.loads(message.model_dump_json())) == message  # the wire round trip


def test_only_leases_decide_what_is_reported():
    """A domain without a lease (another tenant's leftover, not ours) is never read into a message; a leased
    allocation without a domain is ``shutoff`` with its counters unknown, not 0; a slot disk the domain does
    not use has no disk counters."""
    stats = recorded_stats()
    stats[domain_name(ALLOC_B)] = stats[domain_name(RECORDED_ALLOC)]  # running, but nobody leased it here
    messages = slice_telemetry(NODE, [lease(ALLOC_A, 2), lease(RECORDED_ALLOC, 1)], stats, collected_at=1.0,
                               interval_s=15.0, bounds=default_bounds(5.0))
    by_alloc = {m.allocation_id: m for m in messages}
    assert set(by_alloc) == {ALLOC_A, RECORDED_ALLOC}
    down = by_alloc[ALLOC_A]
    assert (down.state, down.cpu_time_ns, down.not_reported) == (DomainState.shutoff, None, ["domain"])
    other_disk = by_alloc[RECORDED_ALLOC]
    assert other_disk.slots[0].disk is None and "slot.1.disk" in other_disk.not_reported
    assert other_disk.slots[0].management_nic is None and "management_nic" in other_disk.not_reported


def test_a_round_is_bounded_in_allocations_and_slots():
    bounds = default_bounds(5.0).model_copy(update={"max_allocations": 1, "max_slots_per_allocation": 2})
    held = [lease(ALLOC_B, n) for n in range(4)] + [lease(ALLOC_A, 5)]  # B sorts first
    messages = slice_telemetry(NODE, held, {}, collected_at=1.0, interval_s=15.0, bounds=bounds)
    assert len(messages) == 1 and len(messages[0].slots) == 2


def test_the_subject_carries_the_allocation_and_refuses_anything_else():
    assert subjects.telemetry(NODE, ALLOC_A) == f"gpuaas.node.{NODE}.telemetry.{ALLOC_A}"
    assert subjects.telemetry_any(NODE) == f"gpuaas.node.{NODE}.telemetry.*"
    for bad in ("*", ">", f"{ALLOC_A}.x", ALLOC_A.upper(), ""):
        with pytest.raises(ValueError):
            subjects.telemetry(NODE, bad)


# -- the loop on real parts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("telemetry-nats")
    (root / "store").mkdir()
    srv = NatsServer(nats_server_binary("slice telemetry publishes on a real server"), root / "store",
                     root / "nats.log")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def store(tmp_path):
    state = StoreThread.open(tmp_path / "agent.db")
    yield state
    state.close()


@pytest.fixture
def test_driver():
    """Two running domains named for ALLOC_A and ALLOC_B on test:///default (held open: the test driver forgets
    its domains when the last connection closes)."""
    conn = libvirt.open(URI)
    doms = []
    for alloc in (ALLOC_A, ALLOC_B):
        xml = (f"<domain type='test'><name>{domain_name(alloc)}</name><memory>1048576</memory><vcpu>2</vcpu>"
               "<os><type>hvm</type></os></domain>")
        dom = conn.defineXML(xml)
        dom.create()
        doms.append(dom)
    yield conn
    for dom in doms:
        dom.destroy()
        dom.undefine()
    conn.close()


async def _received(sub, count: int, timeout_s: float = 10.0) -> list[tuple[str, SliceTelemetry]]:
    got = []
    for _ in range(count):
        msg = await sub.next_msg(timeout=timeout_s)
        got.append((msg.subject, SliceTelemetry.model_validate_json(msg.data)))
    return got


def test_each_allocation_arrives_on_its_own_subject_and_release_removes_its_series(server, store, test_driver):
    async def scenario():
        nc = await nats.connect(server.url)
        lifecycle = LibvirtLifecycle(URI)
        try:
            await store.take_leases([lease(ALLOC_A, 0), lease(ALLOC_A, 1)])
            await store.take_leases([lease(ALLOC_B, 3)])
            every = await nc.subscribe(subjects.telemetry_any(NODE))
            only_a = await nc.subscribe(subjects.telemetry(NODE, ALLOC_A))
            await nc.flush()

            async def leases():
                return await store.leases()

            loop = SliceTelemetryLoop(NODE, lifecycle.all_domain_stats, leases, nc.publish, interval_s=15.0,
                                      stats_timeout_s=10.0)
            metrics = AgentMetrics()
            metrics.registry.register(SliceMetricsCollector(
                loop, lambda: {lease.allocation_id for lease in store.sync.leases()}))
            assert await loop.round() == 2
            on_every = await _received(every, 2)
            on_a = await _received(only_a, 1)
            # A tenant's subject carries its own allocation's body and nothing else.
            assert {(s, m.allocation_id) for s, m in on_every} == {
                (subjects.telemetry(NODE, ALLOC_A), ALLOC_A), (subjects.telemetry(NODE, ALLOC_B), ALLOC_B)}
            assert [m.allocation_id for _, m in on_a] == [ALLOC_A]
            assert [s.slot_index for s in on_a[0][1].slots] == [0, 1] and on_a[0][1].state is DomainState.running
            with pytest.raises(nats.errors.TimeoutError):  # B's round never reached A's subject
                await only_a.next_msg(timeout=0.2)

            before = (await asyncio.to_thread(metrics.render)).decode()
            await store.release_leases(ALLOC_A)
            after = (await asyncio.to_thread(metrics.render)).decode()
            await loop.round()
            kept = set(loop.latest)
            await nc.close()
            return before, after, kept
        finally:
            await lifecycle.close()

    before, after, kept = asyncio.run(scenario())
    info = [line for line in before.splitlines() if line.startswith("gpuaas_agent_slice_info{")]
    assert len(info) == 3 and all("allocation_id=" in line for line in info)
    assert 'gpuaas_agent_slice_running{slot="0"} 1.0' in before
    # The allocation is a label of the info series only: every other slice sample is labelled by slot alone.
    samples = [line for line in before.splitlines() if line.startswith("gpuaas_agent_slice_") and "{" in line]
    assert all(line.startswith("gpuaas_agent_slice_info{") for line in samples if ALLOC_A in line or ALLOC_B in line)
    # Released: A's slots are gone from the next scrape (not one round later) and from the loop's memory.
    assert ALLOC_A not in after and 'slot="0"' not in after and 'slot="1"' not in after
    assert ALLOC_B in after and 'gpuaas_agent_slice_running{slot="3"} 1.0' in after
    assert kept == {ALLOC_B}


def test_a_failed_or_late_stats_call_is_counted_and_publishes_nothing(store):
    published = []

    async def publish(subject: str, data: bytes) -> None:
        published.append(subject)

    async def failing():
        raise LibvirtError("libvirt all_domain_stats failed", code="libvirt_error", evidence={})

    async def stuck():
        await asyncio.Event().wait()
        return []

    async def scenario():
        await store.take_leases([lease(ALLOC_A, 0)])

        async def leases():
            return await store.leases()

        broken = SliceTelemetryLoop(NODE, failing, leases, publish)
        late = SliceTelemetryLoop(NODE, stuck, leases, publish, stats_timeout_s=0.05)
        return await broken.round(), broken.counters.rounds, await late.round(), late.counters.rounds

    sent_broken, broken_rounds, sent_late, late_rounds = asyncio.run(scenario())
    assert (sent_broken, sent_late, published) == (0, 0, [])
    assert broken_rounds["failed"] == 1 and late_rounds["timeout"] == 1


def test_no_lease_means_no_libvirt_call(store):
    calls = []

    async def source():
        calls.append(1)
        return []

    async def publish(subject: str, data: bytes) -> None:
        raise AssertionError("nothing to publish")

    async def leases():
        return await store.leases()

    loop = SliceTelemetryLoop(NODE, source, leases, publish)
    assert asyncio.run(loop.round()) == 0 and calls == [] and loop.latest == {}


FIXTURE_HOST = REPO / "fixtures/hosts/h200-slice-after-transition"  # mlx5_core PFs ibp25s0 (0000:19:00.0), ibp59s0
VF_19, VF_3B = "0000:19:00.1", "0000:3b:00.1"  # virtfn0 of each


class RecordedPf(FabricVfNetlink):
    """ibp25s0's RTM_NEWLINK as the kernel would send it for a ConnectX-7 with one VF (encoded and decoded by
    pyroute2, as tests/host/network/test_fabricvf.py builds them); any other PF is not there."""

    def stats(self, pf_netdev: str) -> dict[int, dict[str, int | None]]:
        if pf_netdev != "ibp25s0":
            raise FabricVfError(f"PF netdev {pf_netdev} does not exist", code="fabric_vf_missing")
        msg = ifinfmsg()
        msg["family"] = 0
        msg["attrs"] = [("IFLA_IFNAME", "ibp25s0"), ("IFLA_NUM_VF", 1), ("IFLA_VFINFO_LIST", {"attrs": [
            ("IFLA_VF_INFO", {"attrs": [("IFLA_VF_MAC", {"vf": 0, "mac": "02:11:22:33:44:55"}), ("IFLA_VF_STATS", {
                "attrs": [("IFLA_VF_STATS_RX_PACKETS", 1200), ("IFLA_VF_STATS_TX_PACKETS", 900),
                          ("IFLA_VF_STATS_RX_BYTES", 1_500_000), ("IFLA_VF_STATS_TX_BYTES", 700_000),
                          ("IFLA_VF_STATS_RX_DROPPED", 5), ("IFLA_VF_STATS_TX_DROPPED", 6)]})]})]})]
        msg.encode()
        decoded = ifinfmsg(msg.data)
        decoded.decode()
        return vf_stats_of_link(decoded)


def _vf_lease(slot: int, vf: str, disk: str | None = None) -> SlotLease:
    return lease(RECORDED_ALLOC, slot, disk).model_copy(update={"fabric_vf_pci_address": vf})


def test_the_slots_fabric_vf_counters_come_from_its_pf_and_an_unreadable_pf_leaves_them_unknown():
    """Slot 0's VF is virtfn0 of ibp25s0 (sysfs of the recorded host), whose PF answers with counters; slot 1's PF
    ibp59s0 cannot be read: its VF carries none and is named in ``not_reported``; /metrics has slot 0's only."""
    counters = PfVfCounters(FIXTURE_HOST, RecordedPf())
    read = counters.read([VF_19, VF_3B, "0000:99:00.1"])
    assert list(read) == [VF_19]
    assert (read[VF_19].pf_netdev, read[VF_19].vf_index, read[VF_19].rx_bytes, read[VF_19].tx_drops) == (
        "ibp25s0", 0, 1_500_000, 6)

    async def stats():
        return json.loads((REPO / "fixtures/libvirt/domstats-qemu-7.2-slice.json").read_text())["records"]

    async def leases():
        return [_vf_lease(0, VF_19, RECORDED_DISK), _vf_lease(1, VF_3B)]

    sent = []

    async def publish(subject: str, data: bytes) -> None:
        sent.append(SliceTelemetry.model_validate_json(data))

    loop = SliceTelemetryLoop(NODE, stats, leases, publish, fabric=counters)
    assert asyncio.run(loop.round()) == 1
    message, = sent
    assert [s.fabric_vf is not None for s in message.slots] == [True, False]
    assert message.slots[0].fabric_vf == read[VF_19]
    assert "slot.1.fabric_vf" in message.not_reported and "slot.0.fabric_vf" not in message.not_reported
    metrics = AgentMetrics()
    metrics.registry.register(SliceMetricsCollector(loop, lambda: {RECORDED_ALLOC}))
    scrape = metrics.render().decode()
    assert 'gpuaas_agent_slice_fabric_vf_receive_bytes_total{slot="0"} 1.5e+06' in scrape
    assert 'gpuaas_agent_slice_fabric_vf_transmit_drops_total{slot="0"} 6.0' in scrape
    assert 'gpuaas_agent_slice_fabric_vf_receive_bytes_total{slot="1"}' not in scrape


# -- the daemon: wired, on its interval -------------------------------------------------------------------


async def _leased_agent(nats_server, tmp_path, held_lease, **settings):
    """An enrolled ``run_agent`` (telemetry every 0.2 s, ``settings`` besides) whose store holds ``held_lease``, its
    node's telemetry subscribed first: (plane, node_id, subscription, stop event, the agent's task)."""
    plane, node_id, config_path = await enrolled_setup(nats_server, tmp_path, slice_telemetry_interval_s=0.2,
                                                       **settings)
    config = load_config(config_path)
    held = StateStore.open(config.state_db)
    try:
        held.take_leases([held_lease])
    finally:
        held.close()
    sub = await plane.nc.subscribe(subjects.telemetry_any(node_id))
    await plane.nc.flush()
    stop = asyncio.Event()
    return plane, node_id, sub, stop, asyncio.create_task(run_agent(config, stop))


def test_the_daemon_publishes_each_leased_allocation_on_its_subject_and_serves_slot_series(nats_server, tmp_path,
                                                                                          test_driver):
    """``run_agent`` in-process on the recorded host with the test driver: the slice host's bulk stats call,
    the leases from the daemon's own store, one message per allocation on its subject, the series on /metrics."""
    port = free_port()

    async def body():
        plane, node_id, sub, stop, agent = await _leased_agent(nats_server, tmp_path, lease(ALLOC_A, 0),
                                                               metrics_listen=f"127.0.0.1:{port}")
        try:
            msg = await sub.next_msg(timeout=30)
            telemetry = SliceTelemetry.model_validate_json(msg.data)
            scrape = await asyncio.to_thread(_scrape, port)
        finally:
            stop.set()
            code = await asyncio.wait_for(agent, 30)
            await plane.close()
        return node_id, msg.subject, telemetry, scrape, code

    node_id, subject, telemetry, scrape, code = run_bounded(body())
    assert code == 0 and subject == subjects.telemetry(node_id, ALLOC_A)
    assert (telemetry.allocation_id, telemetry.state, telemetry.interval_s) == (ALLOC_A, DomainState.running, 0.2)
    assert f'gpuaas_agent_slice_info{{allocation_id="{ALLOC_A}",domain="{domain_name(ALLOC_A)}",slot="0"}} 1.0' in scrape
    assert 'gpuaas_agent_slice_telemetry_rounds_total{outcome="ok"}' in scrape


async def _until(sub, done, timeout_s: float) -> list[tuple[str, bytes, SliceTelemetry]]:
    """Every message read until one for which ``done(message)`` holds (the last); fails after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    seen = []
    while True:
        msg = await sub.next_msg(timeout=max(0.01, deadline - asyncio.get_running_loop().time()))
        seen.append((msg.subject, msg.data, SliceTelemetry.model_validate_json(msg.data)))
        if done(seen[-1][2]):
            return seen


def test_the_daemon_sends_a_slot_its_own_gpus_bmc_sensors_and_never_a_reading_older_than_three_health_rounds(
        nats_server, tmp_path, test_driver, capture):
    """``run_agent`` with a ``[bmc]`` on the real DGX H100 capture (served over TLS, as the BMC tests serve it): the
    daemon's own health rounds read the BMC and its slice telemetry sends the leased slot GPU_SXM_3's sensors, no
    other GPU's. Then the BMC stops answering (SIGSTOP: its read hangs, no newer reading lands) and the last
    reading is sent only while it is younger than three health intervals; after that the slot's GPU is null and
    ``slot.0.gpu`` is named in ``not_reported``."""
    health_s = 2.0  # the reading may be 3 x 2 s old: a BMC pass here takes about 1 s
    max_age_s = 3 * health_s
    gpu3 = json.loads((CAPTURE / "Systems/HGX_Baseboard_0/Processors/GPU_SXM_3/index.json").read_text())
    # A hung request outlasts the test (60 s, and the check's own 45 s): no error reading replaces the last one.
    bmc_table = {"url": f"https://127.0.0.1:{capture.port}", "credentials_file": str(capture.creds),
                 "ca_file": str(capture.cert), "gpu_pci_addresses": PCI, "request_timeout_s": 60.0}

    async def body():
        leased = lease(ALLOC_A, 0).model_copy(update={"gpu_pci_address": PCI["GPU_SXM_3"]})
        plane, node_id, sub, stop, agent = await _leased_agent(nats_server, tmp_path, leased,
                                                               health_interval_s=health_s, bmc=bmc_table)
        try:
            fresh = await _until(sub, lambda m: m.slots[0].gpu is not None, 60)
            os.kill(capture.proc.pid, signal.SIGSTOP)
            try:
                after = await _until(sub, lambda m: m.slots[0].gpu is None, max_age_s + 30)
            finally:
                os.kill(capture.proc.pid, signal.SIGCONT)
        finally:
            stop.set()
            code = await asyncio.wait_for(agent, 30)
            await plane.close()
        return node_id, fresh, after, code

    node_id, fresh, after, code = run_bounded(body())
    assert code == 0
    assert {subject for subject, _, _ in fresh + after} == {subjects.telemetry(node_id, ALLOC_A)}
    _, data, first = fresh[-1]
    gpu = first.slots[0].gpu
    assert (gpu.gpu_id, gpu.sxm_slot, gpu.serial_number) == ("GPU_SXM_3", "SXM3", gpu3["SerialNumber"])
    assert gpu.temperature.reading_c is not None and gpu.memory_temperature.critical.source == "bmc"
    assert gpu.nvlink is not None and gpu.nvlink.ports == 18
    assert "slot.0.gpu" not in first.not_reported
    assert not [n for n in range(1, 9) if n != 3 and f"GPU_SXM_{n}".encode() in data], "another GPU's sensors"
    # Sent only while young: every message that carries the GPU was collected within three health intervals of
    # the reading; the first one after the BMC hung that does not is past that age, not cut short by anything.
    carried = [m for _, _, m in fresh + after if m.slots[0].gpu is not None]
    assert all(m.collected_at - m.slots[0].gpu_read_at.timestamp() <= max_age_s for m in carried)
    last_read = max(m.slots[0].gpu_read_at.timestamp() for m in carried)
    stale = after[-1][2]
    assert stale.slots[0].gpu is None and stale.slots[0].gpu_read_at is None
    assert "slot.0.gpu" in stale.not_reported
    assert stale.collected_at - last_read > max_age_s


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()
