"""libvirt's bulk stats record parsed without a connection: a real QEMU record, the test driver's, and junk."""

from __future__ import annotations

import asyncio
import json

import libvirt
import pytest

from gpuaas_agent.contract.domain import DomainState
from gpuaas_agent.host.vm.domstats import MAX_DEVICES, parse_all, parse_domain_stats
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from tests.conftest import REPO

RECORDED = REPO / "fixtures/libvirt/domstats-qemu-7.2-slice.json"
URI = "test:///default"


def recorded() -> list[tuple[str, dict]]:
    return [(name, record) for name, record in json.loads(RECORDED.read_text())["records"]]


def test_a_recorded_qemu_record_gives_cpu_memory_disk_and_nic_counters():
    (name, record), = recorded()
    stats = parse_domain_stats(name, record)
    assert stats.state is DomainState.running
    assert (stats.cpu_time_ns, stats.vcpu_time_ns, stats.vcpus) == (399498000, 190000000 + 0, 2)
    assert (stats.balloon_current_kib, stats.balloon_maximum_kib, stats.balloon_rss_kib) == (131072, 131072, 50944)
    disk, = stats.blocks
    assert (disk.name, disk.path) == ("vda", "/dev/disk/by-id/nvme-SAMSUNG_MZWLO3T8HCLS-00A07_S7PANE0W700123")
    assert (disk.rd_bytes, disk.rd_reqs, disk.wr_bytes, disk.wr_reqs) == (512, 1, 0, 0)
    nic, = stats.nets
    assert (nic.name, nic.rx_bytes, nic.rx_pkts, nic.rx_drop, nic.tx_bytes) == ("gs0-0123456789", 90, 1, 0, 0)
    assert {"state", "cpu", "balloon", "vcpu", "net", "block"} <= stats.groups


def test_the_test_driver_reports_state_only_and_every_counter_stays_unknown():
    """One real bulk call on libvirt's test driver: its record carries ``state.*`` only; nothing reads as 0."""
    conn = libvirt.open(URI)  # held: test:///default forgets its domains when the last connection closes
    try:
        async def read():
            async with LibvirtLifecycle(URI) as lc:
                return await lc.all_domain_stats()

        records = asyncio.run(read())
    finally:
        conn.close()
    stats = parse_all(records)["test"]
    assert stats.state is DomainState.running and stats.groups == frozenset({"state"})
    assert (stats.cpu_time_ns, stats.vcpu_time_ns, stats.vcpus, stats.balloon_current_kib) == (None,) * 4
    assert stats.blocks == () and stats.nets == ()


def test_malformed_values_are_not_reported_and_counts_are_bounded():
    record = {"state.state": 99, "cpu.time": -1, "balloon.current": "1024", "balloon.rss": True,
              "vcpu.maximum": 10**9, "vcpu.0.time": 5, "block.count": 10**9, "block.0.name": "vda",
              "block.0.rd.bytes": 1.5, "block.1.path": "/dev/x", "net.count": 1, "net.0.name": ""}
    stats = parse_domain_stats("d", record)
    assert stats.state is DomainState.nostate
    assert (stats.cpu_time_ns, stats.balloon_current_kib, stats.balloon_rss_kib) == (None, None, None)
    assert stats.vcpu_time_ns == 5
    assert [b.name for b in stats.blocks] == ["vda"] and stats.blocks[0].rd_bytes is None  # block.1 has no name
    assert stats.nets == ()
    assert MAX_DEVICES < 10**9  # the loop above ran to the bound, not to the claimed count
    long_name = parse_domain_stats("d", {"block.count": 1, "block.0.name": "v" * 65, "net.count": 1,
                                         "net.0.name": "g" * 65})
    assert long_name.blocks == () and long_name.nets == ()  # a name the agent never gave is not reported


@pytest.mark.parametrize("value", range(8))
def test_the_state_table_is_libvirts(value):
    names = {libvirt.VIR_DOMAIN_NOSTATE: "nostate", libvirt.VIR_DOMAIN_RUNNING: "running",
             libvirt.VIR_DOMAIN_BLOCKED: "blocked", libvirt.VIR_DOMAIN_PAUSED: "paused",
             libvirt.VIR_DOMAIN_SHUTDOWN: "shutdown", libvirt.VIR_DOMAIN_SHUTOFF: "shutoff",
             libvirt.VIR_DOMAIN_CRASHED: "crashed", libvirt.VIR_DOMAIN_PMSUSPENDED: "pmsuspended"}
    assert parse_domain_stats("d", {"state.state": value}).state.value == names[value]
