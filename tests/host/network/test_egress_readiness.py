"""Readiness proves egress from the host's conntrack (host/network/egress_readiness.py): answered + source-NATed, nothing less."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.egress import EgressTarget
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.host.network.egress_readiness import (
    EgressUnproven,
    Tracked,
    egress_target,
    judge,
    wait_for_egress,
)

TARGET = EgressTarget(ip="192.0.2.2", port=7777)
GUEST = "10.100.0.13"
NATTED = 0x2 | 0x4 | 0x8 | 0x10 | 0x80  # SEEN_REPLY ASSURED CONFIRMED SRC_NAT SRC_NAT_DONE
UNNATTED = 0x8  # CONFIRMED only: left with the private source, never answered


def _entry(status: int, reply_dst: str, src: str = GUEST, dport: int = 7777) -> Tracked:
    return Tracked(proto=6, src=src, sport=40000, dst="192.0.2.2", dport=dport, reply_dst=reply_dst, status=status)


def test_only_a_source_natted_answered_connection_of_this_guest_to_the_target_proves_egress():
    proof, seen = judge([_entry(UNNATTED, GUEST), _entry(NATTED, "192.0.2.1"), _entry(NATTED, "192.0.2.1", src="10.100.0.14"),
                         _entry(NATTED, "192.0.2.1", dport=22)], GUEST, TARGET)
    assert proof is not None and proof.source_nat and proof.answered and proof.nat_source == "192.0.2.1"
    assert "SRC_NAT_DONE" in proof.status and len(seen) == 2
    proof, _ = judge([_entry(0x2 | 0x8, GUEST)], GUEST, TARGET)  # answered without NAT: not egress
    assert proof is None


def test_without_masquerade_readiness_fails_typed_naming_the_unnatted_connection():
    async def body():
        loop = asyncio.get_running_loop()
        return await wait_for_egress(GUEST, TARGET, deadline=loop.time() + 0.3, poll_s=0.1,
                                     reader=lambda: [_entry(UNNATTED, GUEST)])

    with pytest.raises(EgressUnproven) as err:
        asyncio.run(body())
    assert err.value.code == "readiness_egress_unproven"
    assert "without source NAT" in err.value.evidence["reason"]
    assert err.value.evidence["tracked"][0]["source_nat"] is False and err.value.evidence["tracked_count"] == 1


def test_a_profile_that_asks_for_egress_on_a_host_without_a_target_is_refused_before_anything():
    lab, egress = get_profile("lab_tcg_1c_512m"), get_profile("lab_tcg_1c_512m_egress")
    assert egress_target(lab, SliceConfig()) is None
    with pytest.raises(EgressUnproven) as err:
        egress_target(egress, SliceConfig())
    assert err.value.code == "readiness_egress_unconfigured"
    assert egress_target(egress, SliceConfig(readiness_egress_target=TARGET)) == TARGET


def test_real_nat_in_namespaces_without_masquerade_is_unproven_and_with_it_proven(net_lab, tmp_path):
    """guest ns -> host ns (routes, NATs) -> upstream ns with the lab's listener; conntrack read in the host ns."""
    import sys

    from tests.conftest import REPO
    from tests.support.dnsmasq_fixture import run_in_netns, sh

    guest, host, up = net_lab.netns("eg-guest"), net_lab.netns("eg-host"), net_lab.netns("eg-up")
    net_lab.veth("g0", guest, "h0", host)
    net_lab.veth("h1", host, "u0", up)
    net_lab.up(guest, "g0", address=f"{GUEST}/24")
    net_lab.up(host, "h0", address="10.100.0.1/24")
    net_lab.up(host, "h1", address="192.0.2.1/30")
    net_lab.up(up, "u0", address="192.0.2.2/30")
    sh("ip", "-n", guest, "route", "add", "default", "via", "10.100.0.1")
    sh("ip", "netns", "exec", host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    # Another subnet's NAT (conntrack is on in this namespace, as on any NAT host); not the slices'.
    sh("ip", "netns", "exec", host, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "198.18.0.0/24",
       "-j", "MASQUERADE")
    log = tmp_path / "peers.log"
    listener = net_lab.popen(up, [sys.executable, str(REPO / "lab/upstream.py"), "--serve", "--bind", "192.0.2.2",
                                  "--port", "7777", "--log", str(log)], tmp_path / "listener.out")
    deadline = time.monotonic() + 30
    while "listening" not in (tmp_path / "listener.out").read_text():
        assert listener.poll() is None and time.monotonic() < deadline, (tmp_path / "listener.out").read_text()
        time.sleep(0.05)  # poll step of a deadline wait

    def guest_connects() -> str:
        return sh("ip", "netns", "exec", guest, "busybox", "nc", "-w", "3", "192.0.2.2", "7777", check=False).stdout

    async def prove(within: float):
        return await wait_for_egress(GUEST, TARGET, deadline=asyncio.get_running_loop().time() + within, poll_s=0.2)

    assert guest_connects() == ""  # no NAT: the upstream cannot answer a private source
    with pytest.raises(EgressUnproven) as err:
        run_in_netns(host, lambda: prove(1.0))
    assert "without source NAT" in err.value.evidence["reason"], err.value.evidence
    assert all(not t["source_nat"] and not t["answered"] for t in err.value.evidence["tracked"])

    sh("ip", "netns", "exec", host, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "10.100.0.0/24",
       "-j", "MASQUERADE")
    assert "GPUAAS-UPSTREAM peer=192.0.2.1" in guest_connects()
    proof = run_in_netns(host, lambda: prove(10.0))
    assert proof.connection.source_nat and proof.connection.answered and proof.connection.nat_source == "192.0.2.1"
    assert log.read_text().split() == ["192.0.2.1"]
