"""What slice telemetry costs per round, for N slices (< 1 % of one core, < 5 MiB for 8 slices).

One process, the daemon's parts: a real ``nats-server``, the SQLite store on its thread with N leases, libvirt's
test driver through :class:`LibvirtLifecycle` with N running domains named for them (the one bulk stats call;
the test driver reports ``state`` only, so the QEMU-sized records are measured apart: the recorded record of
``fixtures/libvirt/`` parsed and matched N times), a ``/metrics`` render per round. It runs ``--rounds`` rounds
back to back and reports CPU seconds per round (``time.process_time``: this process, every thread), the share
of one core at the default interval, and the RSS the loop's state adds (``VmRSS`` before the loop is built and
after the last round: the module imports are counted too).

Guest telemetry: in the same run, the same loop again with every slice opted in and
its exporter pulled (:mod:`gpuaas_agent.operator.guest_telemetry`) from a real HTTP server per slice (127.0.0.x, one
port, in a child process so its CPU is not counted) serving a node_exporter-sized exposition (``--guest-series``
samples, about 70 bytes each). Reported: the CPU per round and the share of one core at the default interval with
and without the guest pull, and the RSS the guest part adds (``VmRSS`` after its rounds minus after the plain ones).

Run from the repo: ``.venv/bin/python bench/bench_telemetry.py [--slices 8] [--rounds 200] [--guest-series 800]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import libvirt
import nats

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.dhcp import Reservation
from gpuaas_agent.contract.naming import domain_name
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.telemetry import GuestPullBounds
from gpuaas_agent.host.vm.domstats import parse_all
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.operator.guest_telemetry import GuestPuller, GuestTelemetrySource
from gpuaas_agent.operator.metrics import AgentMetrics
from gpuaas_agent.operator.telemetry import (
    DEFAULT_INTERVAL_S,
    SliceMetricsCollector,
    SliceTelemetryLoop,
    default_bounds,
    slice_telemetry,
)
from gpuaas_agent.state.aio import StoreThread
from tests.support.nats_server import NatsServer, free_port, nats_server_binary

URI = "test:///default"


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def allocation(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-{n:012x}"


def lease(n: int, guest: bool = False) -> SlotLease:
    return SlotLease(allocation_id=allocation(n), slot_index=n, gpu_pci_address=f"0000:{0x18 + n:02x}:00.0",
                     nvme_device=f"/dev/disk/by-id/nvme-eui.{n:032x}", disk_identity=f"nguid:{n:032x}",
                     fabric_vf_pci_address=f"0000:{0x40 + n:02x}:00.1", task_id="bench", taken_at=1.0,
                     guest_telemetry=guest)


def guest_ip(n: int) -> str:
    return f"127.0.0.{n + 2}"


def exposition(series: int) -> bytes:
    """node_exporter's shape: families of a few labelled samples each, with HELP and TYPE."""
    lines = []
    for family in range(series // 8):
        lines += [f"# HELP node_bench_{family}_total a counter of the bench.", f"# TYPE node_bench_{family}_total counter"]
        lines += [f'node_bench_{family}_total{{cpu="{c}",mode="user"}} {family * 1000 + c}.25' for c in range(8)]
    return ("\n".join(lines) + "\n").encode()


def serve_exporters(port: int, slices: int, series: int) -> None:
    """The child process: one HTTP/1.0 exporter per slice address, until killed."""
    body = exposition(series)
    head = f"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(body)}\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    async def main() -> None:
        for n in range(slices):
            await asyncio.start_server(handle, guest_ip(n), port)
        print("ready", flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())


async def rounds_cost(loop: SliceTelemetryLoop, metrics: AgentMetrics, slices: int, rounds: int) -> tuple[float, float]:
    """CPU and wall seconds of ``rounds`` rounds (each with a /metrics render), after one warm round."""
    await loop.round()
    await asyncio.to_thread(metrics.render)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        sent = await loop.round()
        assert sent == slices, sent
        await asyncio.to_thread(metrics.render)
    return time.process_time() - cpu0, time.perf_counter() - wall0


async def measure_guest(server: NatsServer, work: Path, slices: int, rounds: int, port: int,
                        series: int) -> dict[str, float]:
    """The same daemon parts, the same leases, plain then with every guest pulled: one run, both figures."""
    store = StoreThread.open(work / "guest.db")
    nc = await nats.connect(server.url)
    lifecycle = LibvirtLifecycle(URI)
    try:
        for n in range(slices):
            await store.take_leases([lease(n, guest=True)])

        async def leases() -> list[SlotLease]:
            return await store.leases()

        async def reservations() -> list[Reservation]:
            return [Reservation.from_wire({"allocation_id": allocation(n), "slot_index": n,
                                           "mac": f"52:54:00:00:00:{n:02x}", "ip": guest_ip(n), "hostname": f"g{n}"})
                    for n in range(slices)]

        plain = SliceTelemetryLoop("node-bench", lifecycle.all_domain_stats, leases, nc.publish)
        metrics = AgentMetrics()
        metrics.registry.register(SliceMetricsCollector(plain, lambda: {a for a in plain.latest}))
        cpu_plain, _ = await rounds_cost(plain, metrics, slices, rounds)
        rss_plain = rss_kib()
        defaults = AgentConfig.model_fields  # the agent's default bounds, as a host without a [guest] override runs
        bounds = GuestPullBounds(max_bytes=defaults["guest_pull_max_bytes"].default,
                                 max_series=defaults["guest_pull_max_series"].default,
                                 timeout_s=defaults["guest_pull_timeout_s"].default, min_interval_s=0)
        source = GuestTelemetrySource(GuestPuller(bounds), reservations, port=port, path="/metrics")
        largest = [0]

        async def publish(subject: str, data: bytes) -> None:
            largest[0] = max(largest[0], len(data))
            await nc.publish(subject, data)

        guest = SliceTelemetryLoop("node-bench", lifecycle.all_domain_stats, leases, publish, guest=source)
        metrics_g = AgentMetrics()
        metrics_g.registry.register(SliceMetricsCollector(guest, lambda: {a for a in guest.latest}))
        cpu_guest, wall_guest = await rounds_cost(guest, metrics_g, slices, rounds)
        await nc.flush()
        rss_guest = rss_kib()
        kept = {f"{allocation}/{slot}": f"{outcome}:{count}" for (allocation, slot), (outcome, count)
                in sorted(guest.guest_kept.items())}
        message_bytes = largest[0]
    finally:
        await lifecycle.close()
        await nc.close()
        store.close()
    added = (cpu_guest - cpu_plain) / rounds
    return {"guest_series_served": series, "guest_outcomes_series_kept": kept,
            "guest_largest_message_bytes": message_bytes,
            "cpu_ms_per_round_plain": round(cpu_plain / rounds * 1000, 3),
            "cpu_ms_per_round_with_guest_pull": round(cpu_guest / rounds * 1000, 3),
            "wall_ms_per_round_with_guest_pull": round(wall_guest / rounds * 1000, 3),
            "guest_pull_core_share_added_at_default_interval_pct": round(added / DEFAULT_INTERVAL_S * 100, 4),
            "guest_pull_rss_added_mib": round((rss_guest - rss_plain) / 1024, 1)}


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
        cpu, wall = await rounds_cost(loop, metrics, slices, rounds)  # warm first: the connection, the validators
        await nc.flush()
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
    parser.add_argument("--guest-series", type=int, default=800)
    parser.add_argument("--guest-rounds", type=int, default=50)
    parser.add_argument("--serve-exporters", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_exporters:
        serve_exporters(args.serve_exporters, args.slices, args.guest_series)
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpuaas-bench-telemetry-"))
    server = NatsServer(nats_server_binary("the bench publishes on a real server"), work / "js", work / "nats.log")
    conn = libvirt.open(URI)  # held: the test driver forgets its domains with its last connection
    doms = []
    port = free_port()
    exporters = subprocess.Popen([sys.executable, __file__, "--serve-exporters", str(port), "--slices",
                                  str(args.slices), "--guest-series", str(args.guest_series)], stdout=subprocess.PIPE)
    try:
        assert exporters.stdout is not None and exporters.stdout.readline() == b"ready\n"
        server.start()
        for n in range(args.slices):
            dom = conn.defineXML(f"<domain type='test'><name>{domain_name(allocation(n))}</name><memory>1048576"
                                 "</memory><vcpu>2</vcpu><os><type>hvm</type></os></domain>")
            dom.create()
            doms.append(dom)
        report = asyncio.run(measure(server, work, args.slices, args.rounds))
        report.update(asyncio.run(measure_guest(server, work, args.slices, args.guest_rounds, port,
                                                args.guest_series)))
    finally:
        exporters.kill()
        exporters.wait(10)
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
