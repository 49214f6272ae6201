"""Provision throughput in the lab-in-a-box: one slice alone, then N slices at once, in the same run.

Prints, per provision, the agent's own step durations (from the task output) and
the wall time; then the ratio of the concurrent batch's wall time to its slowest
single provision (1.0 = perfectly parallel, N = serial) and the agent overhead
per provision: every step except the clone and the guest's boot (readiness).
Run as root: ``.venv/bin/python bench/bench_provision.py [--slots 8]``.
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


def _overhead(result) -> float:
    return sum(v or 0.0 for k, v in result.output["steps"].items() if k not in NOT_OVERHEAD)


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
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-bench-", dir="/var/tmp"))
    lab = Lab(LabSettings(workdir=workdir, slots=args.slots, readiness_timeout_s=900, say=lambda line: None))
    try:
        await lab.start()
        slots = (await lab.approve_slots())[: args.slots]
        # Warm-up (image into the cache, libvirt's QEMU capabilities probed): not measured.
        warm, _, alloc = await _provision(lab, slots[0])
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
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
