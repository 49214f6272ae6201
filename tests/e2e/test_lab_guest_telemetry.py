"""Guest telemetry end to end: a lab guest's exporter reaches the control plane on its own subject.

Slice A is provisioned with ``guest_telemetry: true``, slice B without; each guest runs busybox httpd on the agent's
configured exporter port (9100) serving a static exposition that names its own slice. The control plane listens on
``gpuaas.node.<node>.telemetry.*``: A's messages carry A's series (relabelled, the pull's outcome ``ok``), B's
messages carry no guest part (B never asked, so its exporter is never pulled) and no subject carries the other
slice's series. After A's release its subject falls silent while B's keeps coming.

Slice C (opted in) is hostile: its busybox httpd serves 3 MB of garbage on the exporter port. Its pulls end
``too_large`` (or ``timeout`` under a slow TCG guest) with nothing kept and at most the bound read, while A's
pulls in the same rounds stay ``ok``. The narrow path (docs/security.md "Guest telemetry") is proven from the
host itself: the lab's nft guard lets the host open A's exporter, never B's (opt-out: its httpd runs, the SYN
never leaves the host). The other hostile exporters (slow drip, a million series) are
tests/operator/test_guest_telemetry.py's, on loopback.
"""

from __future__ import annotations

import asyncio
import json

from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.telemetry import SliceTelemetry
from lab.probes import Guest, GuestShell

SLOT_A, SLOT_B, SLOT_C = 3, 4, 5
EXPORTER = ("mkdir -p /tmp/www && printf '# TYPE lab_guest_marker gauge\\nlab_guest_marker{{slice=\"{name}\","
            "slot=\"99\"}} 1\\n' >/tmp/www/metrics && busybox httpd -p 9100 -h /tmp/www && echo started")
# 3 MB of text that is no exposition, three times the agent's default guest_pull_max_bytes (1 MiB).
HOSTILE = ("mkdir -p /tmp/www && yes 'garbage{le=' | head -c 3000000 >/tmp/www/metrics && "
           "busybox httpd -p 9100 -h /tmp/www && echo started")
MAX_BYTES = 1024 * 1024  # the agent's default guest_pull_max_bytes, which the lab keeps
READ_CHUNK = 64 * 1024  # operator/guest_telemetry.py reads at most one chunk past the bound
INTERVAL_S = 15.0  # the agent's default slice_telemetry_interval_s, which the lab keeps
CONNECT_S = 3.0  # a connect from the host: an open path answers within it, a dropped SYN never does


async def _host_reaches(ip: str, port: int) -> bool:
    """A TCP connect from the host itself (the lab's agent and nft guard live in this namespace)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), CONNECT_S)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


def _slot(lab, index):
    lab_, runner = lab
    if not lab_.approved:
        runner.run(lab_.approve_slots(), timeout=120)
    return next(s for s in lab_.approved if s.slot_index == index)


def test_an_opted_in_guests_exporter_arrives_on_its_own_subject_only_and_stops_at_release(lab):
    lab_, runner = lab
    a, b, c = _slot(lab, SLOT_A), _slot(lab, SLOT_B), _slot(lab, SLOT_C)
    pa = {**lab_.provision_payload(a), "guest_telemetry": True}
    pb = lab_.provision_payload(b)
    pc = {**lab_.provision_payload(c), "guest_telemetry": True}
    subject_a = subjects.telemetry(lab_.node_id, pa["allocation_id"])
    subject_b = subjects.telemetry(lab_.node_id, pb["allocation_id"])
    subject_c = subjects.telemetry(lab_.node_id, pc["allocation_id"])

    async def scenario(released_a: list) -> None:
        ra, rb, rc_ = await asyncio.gather(lab_.task("slice.vm_provision", pa, timeout=900),
                                           lab_.task("slice.vm_provision", pb, timeout=900),
                                           lab_.task("slice.vm_provision", pc, timeout=900))
        assert ra.status.value == "succeeded", ra.error
        assert rb.status.value == "succeeded", rb.error
        assert rc_.status.value == "succeeded", rc_.error
        for slot, command in ((a, EXPORTER.format(name="a")), (b, EXPORTER.format(name="b")), (c, HOSTILE)):
            shell = GuestShell(Guest(slot.private_ip, slot.mac), lab_.tenant_key_file)
            try:
                rc, out = await shell.run(command, timeout=120)
            finally:
                shell.close()
            assert rc == 0 and "started" in out, out
        # The narrow path, from the host: A's exporter opens (opted in), B's does not (its httpd runs: opt-out).
        assert await _host_reaches(a.private_ip, 9100)
        assert not await _host_reaches(b.private_ip, 9100)
        seen: list[tuple[str, SliceTelemetry]] = []
        sub = await lab_.cp.nc.subscribe(f"gpuaas.node.{lab_.node_id}.telemetry.*")

        async def next_message() -> tuple[str, SliceTelemetry]:
            msg = await sub.next_msg(timeout=INTERVAL_S * 3)
            got = (msg.subject, SliceTelemetry.from_wire(json.loads(msg.data)))
            seen.append(got)
            return got

        try:
            # A's exporter read within a few intervals (the first pull may precede httpd's start).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + INTERVAL_S * 6
            while True:
                subject, message = await next_message()
                if subject == subject_a and message.guest and message.guest[0].outcome == "ok":
                    break
                assert loop.time() < deadline, [(s, [g.outcome for g in m.guest]) for s, m in seen]
            guest = message.guest[0]
            assert guest.target == f"{a.private_ip}:9100/metrics" and guest.slot_index == SLOT_A
            assert [(s.name, s.labels, s.value) for s in guest.series] == [("lab_guest_marker", {"slice": "a"}, 1.0)]
            assert guest.dropped == {"label_collision": 1}  # the guest's slot="99" is not the slot
            # C's hostile exporter: bounded, nothing kept, and A's next pull after it is still ok.
            hostile: list[SliceTelemetry] = []
            while not hostile or not any(s == subject_a for s, _ in seen[-1:]):
                subject, message = await next_message()
                if subject == subject_c and message.guest:
                    hostile.append(message)
                assert loop.time() < deadline + INTERVAL_S * 6, [(s, [g.outcome for g in m.guest]) for s, m in seen]
            c_pull = hostile[-1].guest[0]
            assert c_pull.outcome in ("too_large", "timeout") and c_pull.series == [], c_pull
            assert c_pull.bytes_read <= MAX_BYTES + READ_CHUNK, c_pull.bytes_read
            assert seen[-1][1].guest[0].outcome == "ok" and seen[-1][1].guest[0].series, seen[-1]
            # B never asked: its messages carry no guest part, and nothing of B is on A's subject or vice versa.
            while not any(s == subject_b for s, _ in seen):
                await next_message()
            for subject, m in seen:
                assert subject == subjects.telemetry(lab_.node_id, m.allocation_id)
                if subject == subject_b:
                    assert m.guest == [] and m.guest_bounds is None
                assert all(s.labels.get("slice") != "b" for g in m.guest for s in g.series)
                if subject == subject_c:
                    assert all(g.series == [] for g in m.guest)
            released = await lab_.task("slice.vm_release", lab_.release_payload(pa["allocation_id"], a), timeout=600)
            released_a.append(released)
            assert released.status.value == "succeeded", released.error
            # After the release: one of B's messages lets a round that read A's lease before it finish, then two
            # more rounds of B's and none of A's.
            seen.clear()
            while not any(s == subject_b for s, _ in seen):
                await next_message()
            seen.clear()
            while sum(s == subject_b for s, _ in seen) < 2:
                await next_message()
            assert all(s != subject_a for s, _ in seen), [s for s, _ in seen]
        finally:
            await sub.unsubscribe()

    async def released_whatever_happened() -> None:
        """The three slices are released however the scenario ended (a failed assert before its own release
        left them leased, and every later test of the shared lab on slots 3-5 failed with slot_busy)."""
        released_a: list = []
        try:
            await scenario(released_a)
        finally:
            if not any(r.status.value == "succeeded" for r in released_a):
                await lab_.task("slice.vm_release", lab_.release_payload(pa["allocation_id"], a), timeout=600)
            rb_rel = await lab_.task("slice.vm_release", lab_.release_payload(pb["allocation_id"], b), timeout=600)
            rc_rel = await lab_.task("slice.vm_release", lab_.release_payload(pc["allocation_id"], c), timeout=600)
            assert rb_rel.status.value == "succeeded", rb_rel.error
            assert rc_rel.status.value == "succeeded", rc_rel.error

    runner.run(released_whatever_happened(), timeout=1800)
