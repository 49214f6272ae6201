"""Guest telemetry end to end: a lab guest's exporter reaches the control plane on its own subject.

Slice A is provisioned with ``guest_telemetry: true``, slice B without; each guest runs busybox httpd on the agent's
configured exporter port (9100) serving a static exposition that names its own slice. The control plane listens on
``gpuaas.node.<node>.telemetry.*``: A's messages carry A's series (relabelled, the pull's outcome ``ok``), B's
messages carry no guest part (B never asked, so its exporter is never pulled) and no subject carries the other
slice's series. After A's release its subject falls silent while B's keeps coming.
The hostile exporters (garbage, 100 MB, slow drip, a million series) are tests/operator/test_guest_telemetry.py's.
"""

from __future__ import annotations

import asyncio
import json

from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.telemetry import SliceTelemetry
from lab.probes import Guest, GuestShell

SLOT_A, SLOT_B = 3, 4
EXPORTER = ("mkdir -p /tmp/www && printf '# TYPE lab_guest_marker gauge\\nlab_guest_marker{{slice=\"{name}\","
            "slot=\"99\"}} 1\\n' >/tmp/www/metrics && busybox httpd -p 9100 -h /tmp/www && echo started")
INTERVAL_S = 15.0  # the agent's default slice_telemetry_interval_s, which the lab keeps


def _slot(lab, index):
    lab_, runner = lab
    if not lab_.approved:
        runner.run(lab_.approve_slots(), timeout=120)
    return next(s for s in lab_.approved if s.slot_index == index)


def test_an_opted_in_guests_exporter_arrives_on_its_own_subject_only_and_stops_at_release(lab):
    lab_, runner = lab
    a, b = _slot(lab, SLOT_A), _slot(lab, SLOT_B)
    pa = {**lab_.provision_payload(a), "guest_telemetry": True}
    pb = lab_.provision_payload(b)
    subject_a = subjects.telemetry(lab_.node_id, pa["allocation_id"])
    subject_b = subjects.telemetry(lab_.node_id, pb["allocation_id"])

    async def scenario():
        ra, rb = await asyncio.gather(lab_.task("slice.vm_provision", pa, timeout=900),
                                      lab_.task("slice.vm_provision", pb, timeout=900))
        assert ra.status.value == "succeeded", ra.error
        assert rb.status.value == "succeeded", rb.error
        for slot, name in ((a, "a"), (b, "b")):
            shell = GuestShell(Guest(slot.private_ip, slot.mac), lab_.tenant_key_file)
            try:
                rc, out = await shell.run(EXPORTER.format(name=name), timeout=60)
            finally:
                shell.close()
            assert rc == 0 and "started" in out, out
        seen: list[tuple[str, SliceTelemetry]] = []
        released_a: list = []
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
            # B never asked: its messages carry no guest part, and nothing of B is on A's subject or vice versa.
            while not any(s == subject_b for s, _ in seen):
                await next_message()
            for subject, m in seen:
                assert subject == subjects.telemetry(lab_.node_id, m.allocation_id)
                if subject == subject_b:
                    assert m.guest == [] and m.guest_bounds is None
                assert all(s.labels.get("slice") != "b" for g in m.guest for s in g.series)
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
            if not any(r.status.value == "succeeded" for r in released_a):
                await lab_.task("slice.vm_release", lab_.release_payload(pa["allocation_id"], a), timeout=600)
            rb_rel = await lab_.task("slice.vm_release", lab_.release_payload(pb["allocation_id"], b), timeout=600)
            assert rb_rel.status.value == "succeeded", rb_rel.error

    runner.run(scenario(), timeout=1800)
