"""Provision throughput in the lab-in-a-box: one slice alone, then N slices at once, in the same run.

Prints, per provision, the agent's own step durations (from the task output) and
the wall time; then the ratio of the concurrent batch's wall time to its slowest
single provision (1.0 = perfectly parallel, N = serial) and the agent overhead
per provision: every step except the clone and the guest's boot (readiness).
Also, in the same run on the same NATS server: an empty task round trip (a ``slice.vm_power``
task whose payload is refused at the edge: enqueue → claim → result stored → ack, no work),
the median of ``--round-trips`` of them, against which the agent overhead per provision is
printed. The warm-up provision meets an empty cache: its raw image streams onto the disk
(the ``image`` and ``clone`` steps are its transfer); the measured ones are cache hits.
Run as root: ``.venv/bin/python bench/bench_provision.py [--slots 8] [--round-trips 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.harness import Lab, LabSettings

NOT_OVERHEAD = ("clone", "readiness")


def _overhead(result, transfer: tuple[str, ...] = NOT_OVERHEAD) -> float:
    return sum(v or 0.0 for k, v in result.output["steps"].items() if k not in transfer)


async def _empty_round_trips(lab: Lab, count: int) -> list[float]:
    """Seconds from enqueue to stored result of tasks the agent refuses at once (no work done)."""
    samples = []
    for _ in range(count):
        started = time.monotonic()
        result = await lab.task("slice.vm_power", {}, timeout=60)
        samples.append(time.monotonic() - started)
        if result.status.value != "failed":
            raise SystemExit(f"the empty task was not refused: {result}")
    return samples


async def _provision(lab: Lab, slot) -> tuple[object, float, str]:
    payload = lab.provision_payload(slot)
    started = time.monotonic()
    result = await lab.task("slice.vm_provision", payload, timeout=1800)
    took = time.monotonic() - started
    if result.status.value != "succeeded":
        raise SystemExit(f"provision of slot {slot.slot_index} failed: {result.error}")
    return result, took, payload["allocation_id"]


async def _release_all(lab: Lab, done) -> None:
    await asyncio.gather(*(lab.task("slice.vm_release", lab.release_payload(alloc, slot), timeout=900)
                           for slot, alloc in done))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--round-trips", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-bench-", dir="/var/tmp"))
    lab = Lab(LabSettings(workdir=workdir, slots=args.slots, readiness_timeout_s=900, say=lambda line: None))
    try:
        await lab.start()
        slots = (await lab.approve_slots())[: args.slots]
        round_trips = await _empty_round_trips(lab, args.round_trips)
        # Warm-up (the image streamed onto the disk and into the cache, libvirt's QEMU capabilities probed).
        warm, warm_s, alloc = await _provision(lab, slots[0])
        await _release_all(lab, [(slots[0], alloc)])

        single, single_s, alloc = await _provision(lab, slots[0])
        await _release_all(lab, [(slots[0], alloc)])

        started = time.monotonic()
        batch = await asyncio.gather(*(_provision(lab, s) for s in slots))
        batch_s = time.monotonic() - started
        await _release_all(lab, [(s, a) for s, (_, _, a) in zip(slots, batch)])
    finally:
        await lab.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    slowest = max(t for _, t, _ in batch)
    overheads = [_overhead(r) for r, _, _ in batch]
    print(f"single provision: {single_s:.1f} s (agent overhead {_overhead(single):.2f} s; "
          f"steps {single.output['steps']})")
    for (result, took, _), slot in zip(batch, slots):
        print(f"  slot {slot.slot_index}: {took:.1f} s, overhead {_overhead(result):.2f} s, "
              f"clone {result.output['steps']['clone']:.2f} s, readiness {result.output['steps']['readiness']:.1f} s")
    print(f"{len(slots)} concurrent provisions: {batch_s:.1f} s wall; slowest single {slowest:.1f} s; "
          f"sum {sum(t for _, t, _ in batch):.1f} s")
    print(f"ratio wall/slowest = {batch_s / slowest:.2f} (1.0 = fully parallel, {len(slots)} = serial); "
          f"wall vs. one provision alone = {batch_s / single_s:.2f}x")
    print(f"agent overhead per provision: median {statistics.median(overheads):.2f} s, max {max(overheads):.2f} s")
    trip = statistics.median(round_trips)
    print(f"empty task round trip: median {trip * 1000:.1f} ms (min {min(round_trips) * 1000:.1f}, max "
          f"{max(round_trips) * 1000:.1f}, n={len(round_trips)}); single provision's overhead = "
          f"{_overhead(single) / trip:.1f} round trips")
    print(f"first provision (cache miss, streamed): {warm_s:.1f} s, image {warm.output['image']}, "
          f"clone method {warm.output['clone'].get('method')}; overhead without image+clone+readiness "
          f"{_overhead(warm, ('image', 'clone', 'readiness')):.2f} s; steps {warm.output['steps']}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
