"""The lab-in-a-box demo (README command 1): enroll, discover, provision two slices, release one, reconcile.

Everything goes over the wire protocol to a real agent process; progress events
are printed as they arrive. Exits non-zero when a step does not do what it must,
and always tears the lab down (``--keep`` leaves the work directory for reading).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.fixture_hosts import fixture_host
from lab.harness import DEFAULT_FIXTURE_NAME, Lab, LabSettings


def _line(event) -> str:
    detail = ""
    if event.percent is not None:
        detail = f" {event.percent:.0f}%"
    elif event.detail:
        keys = {k: v for k, v in event.detail.items() if k in ("code", "event", "lease_state", "state", "action",
                                                                "skipped", "removed", "verified", "duration_s")}
        detail = " " + json.dumps(keys, sort_keys=True) if keys else ""
    return f"  [{event.task_id[-8:]}] {event.step:<18} {event.status}{detail}"


async def _progress_printer(lab: Lab, stop: asyncio.Event) -> None:
    """Print each progress event once, as it arrives (clone percentages at most every 25%)."""
    shown = 0
    last_pct: dict[str, float] = {}
    while not stop.is_set():
        async with lab.cp.seen.changed:
            await lab.cp.seen.changed.wait_for(lambda: len(lab.cp.seen.progress) > shown or stop.is_set())
            events = lab.cp.seen.progress[shown:]
            shown += len(events)
        for event in events:
            if event.percent is not None:
                key = event.task_id + event.step
                if event.percent < 100 and event.percent - last_pct.get(key, -100) < 25:
                    continue
                last_pct[key] = event.percent
            print(_line(event), flush=True)


def _check(ok: bool, what: str, failures: list[str]) -> None:
    print(f"{'OK  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


async def scenario(lab: Lab) -> list[str]:
    failures: list[str] = []
    stop = asyncio.Event()
    printer = asyncio.create_task(_progress_printer(lab, stop))
    try:
        print("\n== slice.topology_discover", flush=True)
        slots = await lab.approve_slots()
        _check(len(slots) >= 2, f"{len(slots)} complete candidate slots approved", failures)

        print("\n== slice.preflight (the lab is not a production host: FAIL lines are expected)", flush=True)
        pre = await lab.task("slice.preflight", {}, timeout=120)
        for line in pre.output.get("lines", [])[:40]:
            print("  " + line, flush=True)

        print("\n== slice.vm_provision x2 (concurrently)", flush=True)
        started = time.monotonic()
        payloads = [lab.provision_payload(slot) for slot in slots[:2]]
        payloads[0]["runtime_profile"] = "lab_tcg_1c_512m_egress"  # readiness proves its NAT'd egress (issue 16)
        results = await asyncio.gather(*(lab.task("slice.vm_provision", p, timeout=900) for p in payloads))
        took = time.monotonic() - started
        for payload, result in zip(payloads, results):
            out = result.output
            _check(result.status.value == "succeeded",
                   f"provision {payload['allocation_id'][:8]} slot {payload['slot']['slot_index']}: {result.status.value}"
                   f" vm={out.get('vm')} ip={out.get('actual_ip')} lease={out.get('lease_state')} "
                   f"ssh={out.get('ssh_banner')} {result.error.code + ': ' + result.error.message if result.error else ''}",
                   failures)
        print(f"   two provisions took {took:.1f} s together", flush=True)

        print("\n== state: what the agent's heartbeat says, what libvirt runs", flush=True)
        beat = await lab.cp.wait_for(lambda seen: [h for h in seen.heartbeats if h.leased_slots] or None, timeout=60)
        print(f"   heartbeat: health={beat[-1].health_state} leased_slots={beat[-1].leased_slots}", flush=True)
        for name, state in sorted(lab.domains().items()):
            print(f"   domain {name}: {state}", flush=True)

        if all(r.status.value == "succeeded" for r in results):
            failures += await network_scenario(lab, slots[:2])

        print("\n== slice.reconcile (read-only): the host agrees with the agent's records", flush=True)
        rec = await lab.task("slice.reconcile", {"repair": False}, timeout=120)
        _check(rec.status.value == "succeeded" and not rec.output.get("findings"),
               f"reconcile with both slices up: {len(rec.output.get('findings', []))} findings", failures)

        print("\n== slice.vm_release of the first slice", flush=True)
        first = payloads[0]
        rel = await lab.task("slice.vm_release", lab.release_payload(first["allocation_id"], slots[0]), timeout=600)
        wipe = rel.output.get("cleanup_proof", {}).get("wipe", {})
        _check(rel.status.value == "succeeded" and wipe.get("verified") is True,
               f"release: {rel.status.value}, graceful={rel.output.get('cleanup_proof', {}).get('domain', {}).get('shutdown', {}).get('graceful')}"
               f", wipe verified={wipe.get('verified')} method={wipe.get('method')}", failures)

        print("\n== slice.reconcile", flush=True)
        rec = await lab.task("slice.reconcile", {"repair": True}, timeout=120)
        _check(rec.status.value == "succeeded", f"reconcile: {len(rec.output.get('findings', []))} findings", failures)
        for finding in rec.output.get("findings", []):
            print(f"   {finding['kind']} {finding['subject']} repaired={finding['repaired']}", flush=True)

        print("\n== release of the second slice (the lab leaves nothing running)", flush=True)
        second = payloads[1]
        rel2 = await lab.task("slice.vm_release", lab.release_payload(second["allocation_id"], slots[1]), timeout=600)
        _check(rel2.status.value == "succeeded", f"release 2: {rel2.status.value}", failures)
    finally:
        stop.set()
        async with lab.cp.seen.changed:
            lab.cp.seen.changed.notify_all()
        await asyncio.wait({printer}, timeout=5)
    return failures


async def network_scenario(lab: Lab, slots) -> list[str]:
    """Issue 16: the isolation probes from slice A against slice B, then a NAT break under the running slices."""
    from lab.probes import Guest, run_probes
    from lab.upstream import set_masquerade

    failures: list[str] = []
    print("\n== network isolation: probes from slice A (root over SSH) against slice B, the host and the NAT", flush=True)
    a, b = slots
    for probe in await run_probes(lab, Guest(a.private_ip, a.mac), Guest(b.private_ip, b.mac)):
        if not probe.ok:
            failures.append(f"probe {probe.name}")

    print("\n== network watch: delete the NAT MASQUERADE rule under the running slices", flush=True)
    seen = len(lab.cp.seen.heartbeats)

    def nat(beat):
        return next((c for c in beat.health if c.name == "slice_nat"), None)

    started = time.monotonic()
    set_masquerade(lab.settings.subnet, False)
    try:
        beats = await lab.cp.wait_for(lambda s: [h for h in s.heartbeats[seen:] if (c := nat(h))
                                                 and c.status == "degraded"], timeout=30)
        took = time.monotonic() - started
        print(f"GPUAAS_LAB netwatch event=nat_deleted heartbeat=degraded after_s={took:.2f} "
              f"reason={json.dumps(beats[0].health_reason)}", flush=True)
    except TimeoutError:
        failures.append("netwatch: no degraded heartbeat within 30 s of the NAT rule's deletion")
        print("GPUAAS_LAB netwatch event=nat_deleted heartbeat=none within_s=30 result=FAIL", flush=True)
    finally:
        set_masquerade(lab.settings.subnet, True)
    seen, started = len(lab.cp.seen.heartbeats), time.monotonic()
    try:
        await lab.cp.wait_for(lambda s: [h for h in s.heartbeats[seen:] if (c := nat(h)) and c.status == "ok"],
                              timeout=30)
        print(f"GPUAAS_LAB netwatch event=nat_restored heartbeat=ok after_s={time.monotonic() - started:.2f}",
              flush=True)
    except TimeoutError:
        failures.append("netwatch: slice_nat not ok again within 30 s of the rule's return")
    return failures


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", type=Path, default=None,
                        help=f"host root (default: the fixture host {DEFAULT_FIXTURE_NAME}, materialised)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) afterwards")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpuaas-lab-", dir="/var/tmp"))
    fixture = args.fixture or fixture_host(DEFAULT_FIXTURE_NAME)
    lab = Lab(LabSettings(workdir=workdir, fixture=fixture, slots=2))
    print(f"== lab-in-a-box in {workdir}", flush=True)
    failures = ["lab did not start"]
    try:
        await lab.start()
        failures = await scenario(lab)
    finally:
        problems = await lab.stop()
        print(f"\n== lab stopped; cleanup problems: {len(problems)}", flush=True)
        if not args.keep and not failures and not problems:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"   logs kept in {workdir} (agent.log, dnsmasq.log, libvirtd/, nats.log)")
    print(f"\nGPUAAS_LAB summary failures={len(failures)}" + (" " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
