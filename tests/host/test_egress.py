"""Readiness proves egress from the host's conntrack (host/egress.py): answered + source-NATed, nothing less."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.egress import EgressTarget
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.host.egress import (
    EgressUnproven,
    Tracked,
    egress_target,
    judge,
    read_conntrack,
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


def test_the_live_conntrack_table_is_read_through_netlink():
    """A loopback connection of this test shows up with both directions seen (the reader's real source)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
    accepted.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        accepted.join(5)
        mine = [e for e in read_conntrack() if e.dport == port and e.src == "127.0.0.1"]
    server.close()
    assert mine and mine[0].status & 0x2, mine  # SEEN_REPLY
