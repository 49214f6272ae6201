"""Claim latency of a tenant's provision and release on the lab-in-a-box, idle vs under a hostile neighbour.

The lab's real agent, guests, NATS, OVS and libvirt (lab/harness.py). In the same run:

1. idle: ``--rounds`` provisions and releases of tenant C's slice, one after the other, after one
   untimed warm-up round;
2. hostile: the load of tests/support/hostile_load.py — tenant A reboots (``--reboots`` at once) a
   guest that ignores ACPI and holds 8 terminal sessions that never read, tenant B floods
   ``slice.terminal_data`` (``--flood-rate`` per second) — and the same ``--rounds`` of C while it runs.

Claim latency: publish of the task -> the agent's first progress event for it (its handler started).
Prints each phase's latencies, the ratio of the medians (goal: within 2x), what A's and B's tasks were
answered, the daemon's RSS before the hostile run and after it (its own status file) and what it
still holds registered afterwards. Never asserts a time.
Run as root, alone on the lab lock:
``flock /tmp/lab.lock .venv/bin/python bench/bench_fairness_lab.py [--rounds 3]``.

``--memprobe DIR``: the agent runs with ``PYTHONTRACEMALLOC`` (``--memprobe-frames``) and the probe of
gpuaas_agent/operator/memprobe.py; it is probed (SIGUSR2) on the warmed idle node and idle after every hostile
run, and the bench prints what grew: the object types whose count rose, and tracemalloc's biggest growth by
traceback, from before to after run 1 and from run 1 to the last run (a leak grows in the second too, a cache
stops). Tracing slows the agent and adds to its RSS: the claim latencies of such a run are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import tracemalloc
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuaas_agent.operator import memprobe
from lab.harness import Lab, LabSettings
from tests.support.hostile_load import Hostile, daemon_status, idle, now, timed
from tests.support.terminal_gateway import Gateway

A_SLOTS, B_SLOT, C_SLOT = (1, 2), 3, 4


async def _c_round(lab: Lab, slot, *, warm: bool = False) -> tuple[float, float]:
    """One provision and release of tenant C: the two claim latencies. ``warm``: also a power task and a terminal
    session opened, typed into and closed in between, so every code path the hostile run takes was used once
    before the RSS baseline (imports and caches are not a leak)."""
    payload = lab.provision_payload(slot)
    provisioned, claim_p = await timed(lab, "slice.vm_provision", payload)
    if provisioned.status.value != "succeeded":
        raise SystemExit(f"C's provision failed: {provisioned.error}")
    if warm:
        await _warm_interactive(lab, slot, payload)
    released, claim_r = await timed(lab, "slice.vm_release", lab.release_payload(payload["allocation_id"], slot))
    if released.status.value != "succeeded":
        raise SystemExit(f"C's release failed: {released.error}")
    return claim_p, claim_r


async def _warm_interactive(lab: Lab, slot, payload: dict) -> None:
    alloc, sid = payload["allocation_id"], str(uuid.uuid4())
    power = await lab.task("slice.vm_power", {"allocation_id": alloc, "slot_index": slot.slot_index,
                                              "operation": "start"}, timeout=300)
    gw = await Gateway(lab.cp.nc, sid, node=lab.node_id).start()
    try:
        opened = await lab.task("slice.terminal_open", {
            "allocation_id": alloc, "slot_index": slot.slot_index, "user": payload["user"],
            "requested_by": "bench@lab", "capacity_shape": "gpu_slice", "target_host": slot.private_ip,
            "target_port": 22, "session_id": sid, "cols": 80, "rows": 24}, timeout=300)
        typed = await lab.task("slice.terminal_data", {"session_id": sid, "allocation_id": alloc,
                                                       "data": base64.b64encode(b"true\n").decode()}, timeout=300)
        closed = await lab.task("slice.terminal_close", {"session_id": sid, "allocation_id": alloc}, timeout=300)
    finally:
        await gw.sub.unsubscribe()
    bad = [r.error for r in (power, opened, typed, closed) if r.status.value != "succeeded"]
    if bad:
        raise SystemExit(f"the warm-up's interactive tasks failed: {bad}")


async def _hostile_run(lab: Lab, a_slots, b_slot, c_slot, args) -> tuple[list[float], dict, dict]:
    load = Hostile(lab, a_slots, b_slot, reboots=args.reboots, flood_rate=args.flood_rate)
    try:
        await load.setup()
        await load.start()
        running = await load.reboot_running()
        await load.b_answered_since(20)
        claims = [c for _ in range(args.rounds) for c in await _c_round(lab, c_slot)]
        still = {"reboot_running": load.result_of(running) is None, "flooding": load.flooding()}
        outcomes = await load.stop(running)
    finally:
        await load.release()
    return claims, still, outcomes


async def _probe(lab: Lab, directory: Path | None) -> dict | None:
    """Signal the agent's memory probe and read what it wrote (None without ``--memprobe``)."""
    if directory is None:
        return None
    n = len(list(directory.glob("*.json")))
    os.kill(lab.procs["agent"].pid, signal.SIGUSR2)
    path = directory / f"{n}.json"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 300
    while not path.exists():
        if loop.time() > deadline:
            raise SystemExit(f"the agent wrote no memory probe {path} within 300 s")
        await asyncio.sleep(0.5)  # a snapshot of a traced heap takes seconds
    return {"n": n, **json.loads(path.read_text())}


def _grown(a: dict, b: dict, top: int = 25) -> str:
    delta = {t: b["types"].get(t, 0) - a["types"].get(t, 0) for t in set(a["types"]) | set(b["types"])}
    grown = sorted(((d, t) for t, d in delta.items() if d), reverse=True)
    return "\n".join(f"    {d:+7d}  {t}" for d, t in grown[:top]) or "    (no type's count changed)"


def _traced(directory: Path, a: dict, b: dict, top: int = 12) -> str:
    pa, pb = directory / f"{a['n']}.tracemalloc", directory / f"{b['n']}.tracemalloc"
    if not (pa.exists() and pb.exists()):
        return "    (no tracemalloc snapshot: PYTHONTRACEMALLOC was not set)"
    filters = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    sa = tracemalloc.Snapshot.load(str(pa)).filter_traces(filters)
    sb = tracemalloc.Snapshot.load(str(pb)).filter_traces(filters)
    lines = []
    for stat in sb.compare_to(sa, "traceback")[:top]:
        lines.append(f"    {stat.size_diff / 1024:+8.1f} KiB {stat.count_diff:+6d} blocks")
        lines += [f"        {f.filename}:{f.lineno}" for f in list(stat.traceback)[-8:]]
    return "\n".join(lines)


def _memreport(directory: Path, probes: list[dict]) -> None:
    rss = [p["rss_bytes"] / (1 << 20) for p in probes]
    traced = [p["traced_bytes"] for p in probes]
    print("memory probe (idle before the hostile runs, then idle after each): RSS "
          + ", ".join(f"{r:.1f}" for r in rss) + " MiB; traced "
          + ", ".join("-" if t is None else f"{t / (1 << 20):.2f}" for t in traced) + " MiB; asyncio tasks "
          + ", ".join(str(p["asyncio_tasks"]) for p in probes) + "; threads "
          + ", ".join(str(p.get("threads")) for p in probes))
    if all(p.get("malloc") for p in probes):
        print("  glibc heap in use / free: " + ", ".join(
            f"{p['malloc']['in_use'] / (1 << 20):.1f}/{p['malloc']['free'] / (1 << 20):.1f}" for p in probes) + " MiB")
    if probes[-1].get("rss_after_trim_bytes"):
        print(f"  after the last run, RSS after malloc_trim(0): {probes[-1]['rss_after_trim_bytes'] / (1 << 20):.1f} MiB")
    pairs = [("before -> after run 1", probes[0], probes[1])]
    if len(probes) > 2:
        pairs.append((f"after run 1 -> after run {len(probes) - 1}", probes[1], probes[-1]))
    for what, a, b in pairs:
        print(f"  object counts by type, {what}:")
        print(_grown(a, b))
        print(f"  tracemalloc growth by traceback, {what}:")
        print(_traced(directory, a, b))


def _ms(xs: list[float]) -> str:
    return ", ".join(f"{x * 1000:.1f}" for x in xs) + " ms"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="C's provision+release rounds per phase")
    parser.add_argument("--reboots", type=int, default=20)
    parser.add_argument("--flood-rate", type=float, default=10.0, help="B's terminal_data tasks per second")
    parser.add_argument("--hostile-runs", type=int, default=2, help="hostile runs one after the other (RSS after each)")
    parser.add_argument("--memprobe", type=Path, help="a new directory: probe the agent's heap (see above)")
    parser.add_argument("--memprobe-frames", type=int, default=25, help="PYTHONTRACEMALLOC frames; 0: types only")
    parser.add_argument("--memprobe-trim", action="store_true", help="the last probe also malloc_trim(0)s the agent "
                        "and records the RSS after it: what glibc keeps free vs what the heap needs")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-bench-fair-lab-", dir="/var/tmp"))
    if args.memprobe is not None:  # the lab's agent inherits this environment
        args.memprobe.mkdir(parents=True)
        os.environ[memprobe.ENV] = str(args.memprobe.resolve())
        if args.memprobe_frames:
            os.environ["PYTHONTRACEMALLOC"] = str(args.memprobe_frames)
    probes: list[dict] = []
    lab = Lab(LabSettings(workdir=workdir, slots=8, readiness_timeout_s=900, say=lambda line: None))
    try:
        await lab.start()
        approved = {s.slot_index: s for s in await lab.approve_slots()}
        a_slots, b_slot, c_slot = [approved[i] for i in A_SLOTS], approved[B_SLOT], approved[C_SLOT]
        await _c_round(lab, c_slot, warm=True)  # warm-up: image cached, QEMU probed, every task type run once
        idle_claims = [c for _ in range(args.rounds) for c in await _c_round(lab, c_slot)]

        before = await daemon_status(lab, lambda s: s.registered is not None and s.registered.tasks == 0, after=now())
        subs = before.registered.subscriptions
        probes.append(await _probe(lab, args.memprobe))
        hostile_claims, runs = [], []
        for _ in range(args.hostile_runs):
            claims, still, outcomes = await _hostile_run(lab, a_slots, b_slot, c_slot, args)
            after = await daemon_status(lab, lambda s: idle(s, subs), after=now(), timeout=300)
            if args.memprobe is not None and args.memprobe_trim and len(runs) == args.hostile_runs - 1:
                (args.memprobe / memprobe.TRIM_MARK).touch()
            probes.append(await _probe(lab, args.memprobe))
            hostile_claims += claims
            runs.append((still, outcomes, after))
    finally:
        await lab.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    idle_m, hostile_m = statistics.median(idle_claims), statistics.median(hostile_claims)
    print(f"claim latency of tenant C, publish -> first progress, {args.rounds} provision+release rounds each")
    print(f"idle node:    median {idle_m * 1000:.1f} ms  (provision, release, ...: {_ms(idle_claims)})")
    print(f"hostile load: median {hostile_m * 1000:.1f} ms  (provision, release, ...: {_ms(hostile_claims)})")
    print(f"ratio hostile/idle: median {hostile_m / idle_m:.2f}x, max {max(hostile_claims) / max(idle_claims):.2f}x "
          f"(goal <= 2x)")
    rb = before.registered.rss_bytes
    print(f"agent RSS before the hostile runs (node warmed, idle): {rb / (1 << 20):.1f} MiB")
    for i, (still, outcomes, after) in enumerate(runs, 1):
        ra = after.registered.rss_bytes
        print(f"hostile run {i}: while C finished {still}; A's {sum(outcomes['A'].values())} tasks "
              f"{dict(outcomes['A'])}; B's {sum(outcomes['B'].values())} tasks {dict(outcomes['B'])}")
        print(f"  after it, idle: RSS {ra / (1 << 20):.1f} MiB ({(ra - rb) / rb * 100:+.1f} % of before; goal within "
              f"10 %); registered {after.registered.model_dump(exclude={'rss_bytes'})}; admission in flight "
              f"{after.admission.in_flight}, tenants {after.admission.tenants}")
    if args.memprobe is not None and len(probes) > 1:
        _memreport(args.memprobe, probes)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
