"""What slice telemetry costs per round, for N slices (issue 42 item 7: < 1 % of one core, < 5 MiB for 8 slices).

One process, the daemon's parts: a real ``nats-server``, the SQLite store on its thread with N leases, libvirt's
test driver through :class:`LibvirtLifecycle` with N running domains named for them (the one bulk stats call;
the test driver reports ``state`` only, so the QEMU-sized records are measured apart: the recorded record of
``fixtures/libvirt/`` parsed and matched N times), a ``/metrics`` render per round. It runs ``--rounds`` rounds
back to back and reports CPU seconds per round (``time.process_time``: this process, every thread), the share
of one core at the default interval, and the RSS the loop's state adds (``VmRSS`` before the loop is built and
after the last round: the module imports are counted too).

Run from the repo: ``.venv/bin/python bench/bench_telemetry.py [--slices 8] [--rounds 200]``.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import libvirt
import nats

from gpuaas_agent.contract.naming import domain_name
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.host.vm.domstats import parse_all
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.operator.metrics import AgentMetrics
from gpuaas_agent.operator.telemetry import (
    DEFAULT_INTERVAL_S,
    SliceMetricsCollector,
    SliceTelemetryLoop,
    default_bounds,
    slice_telemetry,
)
from gpuaas_agent.state.aio import StoreThread
from tests.support.nats_server import NatsServer, nats_server_binary

URI = "test:///default"


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def allocation(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-{n:012x}"


def lease(n: int) -> SlotLease:
    return SlotLease(allocation_id=allocation(n), slot_index=n, gpu_pci_address=f"0000:{0x18 + n:02x}:00.0",
                     nvme_device=f"/dev/disk/by-id/nvme-eui.{n:032x}", disk_identity=f"nguid:{n:032x}",
                     fabric_vf_pci_address=f"0000:{0x40 + n:02x}:00.1", task_id="bench", taken_at=1.0)


async def measure(server: NatsServer, work: Path, slices: int, rounds: int) -> dict[str, float]:
    rss0 = rss_kib()
    store = StoreThread.open(work / "agent.db")
    nc = await nats.connect(server.url)
    lifecycle = LibvirtLifecycle(URI)
    try:
        for n in range(slices):
            await store.take_leases([lease(n)])

        async def leases() -> list[SlotLease]:
            return await store.leases()

        loop = SliceTelemetryLoop("node-bench", lifecycle.all_domain_stats, leases, nc.publish)
        metrics = AgentMetrics()
        metrics.registry.register(SliceMetricsCollector(loop, lambda: {a for a in loop.latest}))
        await loop.round()  # warm: the connection, the models' validators
        await asyncio.to_thread(metrics.render)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(rounds):
            sent = await loop.round()
            assert sent == slices, sent
            await asyncio.to_thread(metrics.render)
        await nc.flush()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        rss1 = rss_kib()
    finally:
        await lifecycle.close()
        await nc.close()
        store.close()
    # The QEMU-sized record (the test driver reports state only): parse and match N recorded records per round.
    recorded = json.loads((REPO / "fixtures/libvirt/domstats-qemu-7.2-slice.json").read_text())["records"][0][1]
    records = [(domain_name(allocation(n)), {**recorded, "block.0.path": f"/dev/disk/by-id/nvme-eui.{n:032x}",
                                             "net.0.name": f"gs{n:x}-{allocation(n).replace('-', '')[:10]}"})
               for n in range(slices)]
    held = [lease(n) for n in range(slices)]
    p0 = time.process_time()
    for _ in range(rounds):
        messages = slice_telemetry("node-bench", held, parse_all(records), collected_at=time.time(),
                                   interval_s=DEFAULT_INTERVAL_S, bounds=default_bounds(10.0))
        for m in messages:
            m.model_dump_json()
    parse_cpu = time.process_time() - p0
    per_round = cpu / rounds + parse_cpu / rounds
    return {"slices": slices, "rounds": rounds, "cpu_ms_per_round_test_driver": round(cpu / rounds * 1000, 3),
            "cpu_ms_per_round_qemu_records_parse_match_dump": round(parse_cpu / rounds * 1000, 3),
            "wall_ms_per_round": round(wall / rounds * 1000, 3),
            "core_share_at_default_interval_pct": round(per_round / DEFAULT_INTERVAL_S * 100, 4),
            "rss_added_mib_incl_imports": round((rss1 - rss0) / 1024, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuaas-bench-telemetry-"))
    server = NatsServer(nats_server_binary("the bench publishes on a real server"), work / "js", work / "nats.log")
    conn = libvirt.open(URI)  # held: the test driver forgets its domains with its last connection
    doms = []
    try:
        server.start()
        for n in range(args.slices):
            dom = conn.defineXML(f"<domain type='test'><name>{domain_name(allocation(n))}</name><memory>1048576"
                                 "</memory><vcpu>2</vcpu><os><type>hvm</type></os></domain>")
            dom.create()
            doms.append(dom)
        report = asyncio.run(measure(server, work, args.slices, args.rounds))
    finally:
        for dom in doms:
            dom.destroy()
            dom.undefine()
        conn.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
