"""Two real TCG slices on one bridge (issue 16): A cannot spoof, reach B or the host; the network is re-proven.

Slice A (runtime profile ``lab_tcg_1c_512m_egress``: readiness proved its NAT'd egress) and
slice B share the lab bridge. ``lab/probes.py`` attacks from A as root over SSH: taking B's
IP or MAC, announcing B's or the gateway's address, reaching B and a listener on the
gateway address all fail; A's lease, SSH to A and egress through the NAT to the upstream
namespace work. Then the NAT rule is deleted under the running slices: the daemon's heartbeat
says ``degraded`` naming ``slice_nat`` within 30 s, and a third slice whose profile asks for
egress is refused at readiness with ``readiness_egress_unproven``; restoring the rule heals both.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from lab.probes import Guest, run_probes
from lab.upstream import set_masquerade

SLOT_A, SLOT_B, SLOT_C = 0, 1, 2
EGRESS_PROFILE = "lab_tcg_1c_512m_egress"


def _task(lab, task_type, payload, timeout=900):
    lab_, runner = lab
    return runner.run(lab_.task(task_type, payload, timeout=timeout), timeout=timeout + 30)


def _slot(lab, index):
    lab_, runner = lab
    if not lab_.approved:
        runner.run(lab_.approve_slots(), timeout=120)
    return next(s for s in lab_.approved if s.slot_index == index)


@pytest.fixture(scope="module")
def slices(lab):
    """A (egress profile) and B, provisioned together; both released when the module is done."""
    lab_, runner = lab
    a, b = _slot(lab, SLOT_A), _slot(lab, SLOT_B)
    pa = {**lab_.provision_payload(a), "runtime_profile": EGRESS_PROFILE}
    pb = lab_.provision_payload(b)

    async def both():
        return await asyncio.gather(lab_.task("slice.vm_provision", pa, timeout=900),
                                    lab_.task("slice.vm_provision", pb, timeout=900))

    ra, rb = runner.run(both(), timeout=960)
    try:
        assert ra.status.value == "succeeded", ra.error
        assert rb.status.value == "succeeded", rb.error
        yield {"a": (a, pa, ra), "b": (b, pb, rb)}
    finally:
        for slot, payload in ((a, pa), (b, pb)):
            released = _task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], slot))
            assert released.status.value == "succeeded", released.error


def test_readiness_of_an_egress_profile_carries_the_natted_connection_to_the_upstream(lab, slices):
    lab_, _ = lab
    _, _, result = slices["a"]
    egress = result.output["egress"]
    assert egress["connection"]["source_nat"] and egress["connection"]["answered"], egress
    assert egress["connection"]["nat_source"] == lab_.upstream.host_ip
    assert egress["target"] == {"ip": lab_.upstream.peer_ip, "port": lab_.upstream.port}
    assert slices["b"][2].output["egress"] is None  # B's profile did not ask


def test_guest_a_cannot_spoof_or_reach_b_or_the_host_but_keeps_its_lease_ssh_and_nat_egress(lab, slices):
    lab_, runner = lab
    (a, _, _), (b, _, _) = slices["a"], slices["b"]
    probes = runner.run(run_probes(lab_, Guest(a.private_ip, a.mac), Guest(b.private_ip, b.mac)), timeout=600)
    lines = "\n".join(p.line() for p in probes)
    print(lines)
    assert len(probes) == 11
    assert {p.name for p in probes if p.expect == "allowed"} == {"ssh_to_a", "dhcp_lease_a", "egress_nat"}
    assert all(p.ok for p in probes), lines


def _nat_check(beat):
    return next((c for c in beat.health if c.name == "slice_nat"), None)


def test_deleting_the_nat_rule_degrades_the_heartbeat_and_refuses_readiness_until_it_is_restored(lab, slices):
    lab_, runner = lab
    cp = lab_.cp
    ok = runner.run(cp.wait_for(lambda s: [h for h in s.heartbeats if (c := _nat_check(h)) and c.status == "ok"],
                                timeout=60), timeout=90)
    assert ok, "the lab's NAT was never seen ok"
    seen_before = len(cp.seen.heartbeats)
    c_slot = _slot(lab, SLOT_C)
    payload = {**lab_.provision_payload(c_slot), "runtime_profile": EGRESS_PROFILE}
    broken_at = time.monotonic()
    set_masquerade(lab_.settings.subnet, False)
    try:
        degraded = runner.run(cp.wait_for(
            lambda s: [h for h in s.heartbeats[seen_before:] if (c := _nat_check(h)) and c.status == "degraded"
                       and h.health_state != "healthy"], timeout=30), timeout=60)
        latency = time.monotonic() - broken_at
        beat = degraded[0]
        print(f"netwatch: MASQUERADE deleted under running slices -> degraded heartbeat in {latency:.2f} s; "
              f"reason: {beat.health_reason}")
        assert "nat_missing" in _nat_check(beat).detail
        assert latency <= 30

        refused = _task(lab, "slice.vm_provision", payload, timeout=900)
        assert refused.status.value == "failed" and refused.error.code == "readiness_egress_unproven", refused.error
        assert "without source NAT" in refused.error.evidence["reason"], refused.error.evidence
        tracked = refused.error.evidence["tracked"]
        assert tracked and not any(t["source_nat"] for t in tracked), tracked
    finally:
        set_masquerade(lab_.settings.subnet, True)
    healed_from = len(cp.seen.heartbeats)
    runner.run(cp.wait_for(lambda s: [h for h in s.heartbeats[healed_from:] if (c := _nat_check(h)) and c.status == "ok"],
                           timeout=30), timeout=60)
    released = _task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], c_slot))
    assert released.status.value == "succeeded", released.error
