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

Real guests (``--libvirt qemu:///system --guests 8``, root, under ``flock /tmp/gpuaas-heavy.lock``): a libvirtd
started here (``tests/support/libvirtd_fixture.py``), N small TCG guests (1 vCPU, ``--guest-memory-mib``, the lab
guest's cached Debian kernel and initramfs booted directly to idle, a raw virtio disk behind the slot's by-id link,
a virtio vNIC on a tap with the agent's vNIC name, memballoon none as the agent's slices: :func:`guest_xml`), leases
for them in the real store, then the same loop and ``/metrics`` render through the agent's code against that
libvirtd: an idle window with no telemetry, ``--rounds`` rounds back to back, an idle window again. Reported: the CPU
per round of this process, of libvirtd and of the QEMUs (each window's CPU less its idle rate; the bulk call's work
is mostly theirs), the share of one core at the default interval, the RSS added; and what the collector made of the
real records (every slot's disk, vNIC, vCPU and memory found?) and how their fields differ from the recorded
fixture's. ``--save-record PATH`` keeps slot 0's record as a fixture. Every domain, disk, by-id link and tap it
makes carries :data:`MARK` and is removed at the end, also on error, and at start by name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
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
from gpuaas_agent.contract.naming import DOMAIN_PREFIX, VNIC_PREFIX, domain_name, vnic_name
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


MARK = "7e1e"  # every allocation, domain, tap and by-id link of this bench starts with it (cleanup by name)


def allocation(n: int) -> str:
    return f"{MARK}{n:04x}-0000-4000-8000-{n:012x}"


def by_id(n: int) -> str:
    return f"/dev/disk/by-id/nvme-eui.{MARK}{n:028x}"


def lease(n: int, guest: bool = False) -> SlotLease:
    return SlotLease(allocation_id=allocation(n), slot_index=n, gpu_pci_address=f"0000:{0x18 + n:02x}:00.0",
                     nvme_device=by_id(n), disk_identity=f"nguid:{n:032x}",
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
    records = [(domain_name(allocation(n)), {**recorded, "block.0.path": by_id(n),
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


# -- real guests: --libvirt qemu:///system --guests N ---------------------------------------------------------------

REAL_WORK = Path("/var/tmp/gpuaas-bench-telemetry-qemu")  # fixed: a leftover of an interrupted run is found by name
BOOT_DEADLINE_S = 900.0
# The lab guest's bring-up ends with its DHCP attempt (lab/guest/rc.sysinit); the tap has no DHCP server behind it.
IDLE_MARKS = ("GPUAAS-LAB-DHCP-FAILED", "GPUAAS-LAB-DHCP ")
BY_ID_DIR = Path("/dev/disk/by-id")
TICK = os.sysconf("SC_CLK_TCK")


def guest_xml(n: int, work: Path, memory_mib: int) -> str:
    """A slice domain shaped as the agent's is where the bulk stats call reads it (host/vm/domain_xml.py): the
    agent's domain name, a virtio disk whose source is the slot's by-id path, a virtio vNIC on a tap with the
    agent's vNIC name, a serial pty with a log, a virtio rng, memballoon none (so ``balloon.*`` comes from libvirt
    and the QEMU process, no guest driver). Not the agent's: direct kernel boot of the lab guest (no OVMF: seconds
    under TCG), a raw file behind the by-id link (no loop device), an ethernet tap libvirt creates (no OVS bridge).
    The counters are the same (QMP blockstats of the disk, the tap's own counters), with fewer shared parts."""
    return f"""<domain type='qemu'>
  <name>{domain_name(allocation(n))}</name>
  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu placement='static'>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{work / "vmlinuz"}</kernel>
    <initrd>{work / "initrd.gz"}</initrd>
    <cmdline>console=ttyS0 panic=-1</cmdline>
  </os>
  <features><acpi/><apic/></features>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='{by_id(n)}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <interface type='ethernet'>
      <mac address='52:54:00:7e:1e:{n:02x}'/>
      <target dev='{vnic_name(allocation(n), n)}'/>
      <model type='virtio'/>
    </interface>
    <serial type='pty'>
      <log file='{work / f"console-{n}.log"}' append='on'/>
      <target type='isa-serial' port='0'/>
    </serial>
    <console type='pty'><target type='serial' port='0'/></console>
    <rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>
    <memballoon model='none'/>
  </devices>
</domain>"""


def clean_by_name(conn: libvirt.virConnect) -> list[str]:
    """Every domain, by-id link and tap this bench names (the mark), whoever of its runs left it."""
    removed = []
    for dom in conn.listAllDomains():
        if dom.name().startswith(DOMAIN_PREFIX + MARK):
            if dom.isActive():
                dom.destroy()
            dom.undefine()
            removed.append(dom.name())
    for link in sorted(BY_ID_DIR.glob(f"nvme-eui.{MARK}*")):
        link.unlink()
        removed.append(str(link))
    for net in sorted(Path("/sys/class/net").glob(f"{VNIC_PREFIX}*-{MARK}*")):
        subprocess.run(["ip", "link", "del", net.name], capture_output=True, timeout=30, check=False)
        removed.append(net.name)
    return removed


def start_guests(conn: libvirt.virConnect, work: Path, guests: int, memory_mib: int) -> None:
    BY_ID_DIR.mkdir(parents=True, exist_ok=True)
    for n in range(guests):
        disk = work / f"disk-{n}.raw"
        with open(disk, "wb") as fh:
            fh.truncate(16 << 20)
        Path(by_id(n)).symlink_to(disk)
        conn.defineXML(guest_xml(n, work, memory_mib)).create()


def wait_idle(conn: libvirt.virConnect, work: Path, guests: int) -> float:
    """Seconds until every guest's console shows the end of its bring-up (deadline ``BOOT_DEADLINE_S``)."""
    started = time.monotonic()
    pending = set(range(guests))
    while pending:
        for n in sorted(pending):
            log = work / f"console-{n}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            if any(mark in text for mark in IDLE_MARKS):
                pending.discard(n)
            elif not conn.lookupByName(domain_name(allocation(n))).isActive() or "Kernel panic" in text:
                raise RuntimeError(f"guest {n} stopped booting; its console:\n{text[-3000:]}")
        if pending and time.monotonic() - started > BOOT_DEADLINE_S:
            raise RuntimeError(f"guests {sorted(pending)} not idle within {BOOT_DEADLINE_S:.0f} s")
        if pending:
            time.sleep(0.5)  # poll step of the deadline wait above
    return time.monotonic() - started


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (every thread), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def record_shape(record: dict[str, object]) -> set[str]:
    """A record's field names with device and vCPU indices folded (block.0.rd.bytes -> block.<n>.rd.bytes)."""
    return {re.sub(r"^(block|net|vcpu)\.\d+\.", r"\1.<n>.", key) for key in record}


def collector_view(loop: SliceTelemetryLoop, guests: int) -> dict[str, object]:
    """What the collector made of the real records: every slot's disk and vNIC found, vCPU and memory present,
    nothing unknown but what the bench has no source for (the fabric VF's PF, the BMC)."""
    unexpected: set[str] = set()
    found = {"disk": 0, "management_nic": 0, "vcpu_time": 0, "memory": 0, "memory_rss": 0}
    for n in range(guests):
        message = loop.latest[allocation(n)]
        slot, = message.slots
        found["disk"] += slot.disk is not None and slot.disk.device == "vda"
        found["management_nic"] += (slot.management_nic is not None
                                    and slot.management_nic.interface == vnic_name(allocation(n), n))
        found["vcpu_time"] += message.vcpu_time_ns is not None and message.vcpus == 1
        found["memory"] += message.memory_bytes is not None and message.memory_max_bytes is not None
        found["memory_rss"] += message.memory_rss_bytes is not None
        unexpected |= set(message.not_reported) - {f"slot.{n}.fabric_vf", f"slot.{n}.gpu"}
    return {"slots_with": found, "not_reported_beyond_vf_and_gpu": sorted(unexpected)}


async def measure_real(server: NatsServer, work: Path, guests: int, rounds: int, uri: str, idle_s: float,
                       others: dict[str, list[int]], save_record: Path | None, provenance: str) -> dict[str, object]:
    """The loop on real domains: idle (no telemetry), ``rounds`` rounds back to back, idle again; the CPU of this
    process, libvirtd and the QEMUs in each window. A round's cost is its window's CPU less the idle rate over it."""
    rss0 = rss_kib()
    store = StoreThread.open(work / "agent.db")
    nc = await nats.connect(server.url)
    lifecycle = LibvirtLifecycle(uri)
    try:
        for n in range(guests):
            await store.take_leases([lease(n)])

        async def leases() -> list[SlotLease]:
            return await store.leases()

        def snapshot() -> dict[str, float]:
            return {"agent": time.process_time(), "wall": time.perf_counter(),
                    **{name: sum(proc_cpu_s(pid) for pid in pids) for name, pids in others.items()}}

        loop = SliceTelemetryLoop("node-bench", lifecycle.all_domain_stats, leases, nc.publish)
        metrics = AgentMetrics()
        metrics.registry.register(SliceMetricsCollector(loop, lambda: {a for a in loop.latest}))
        libvirtd_rss0 = proc_rss_kib(others["libvirtd"][0])
        idle0 = snapshot()
        await asyncio.sleep(idle_s / 2)  # the daemon without telemetry: nothing runs (the idle window measured)
        idle1 = snapshot()
        assert await loop.round() == guests  # warm: the connection, the validators
        await asyncio.to_thread(metrics.render)
        busy0 = snapshot()
        for _ in range(rounds):
            sent = await loop.round()
            assert sent == guests, sent
            await asyncio.to_thread(metrics.render)
        busy1 = snapshot()
        await nc.flush()
        idle2 = snapshot()
        await asyncio.sleep(idle_s / 2)
        idle3 = snapshot()
        rss1 = rss_kib()
        libvirtd_rss1 = proc_rss_kib(others["libvirtd"][0])
        view = collector_view(loop, guests)
        records = await lifecycle.all_domain_stats()
    finally:
        await lifecycle.close()
        await nc.close()
        store.close()
    idle_wall = (idle1["wall"] - idle0["wall"]) + (idle3["wall"] - idle2["wall"])
    busy_wall = busy1["wall"] - busy0["wall"]
    per_round_ms: dict[str, float] = {}
    idle_share: dict[str, float] = {}
    for name in ("agent", *others):
        idle_rate = ((idle1[name] - idle0[name]) + (idle3[name] - idle2[name])) / idle_wall
        idle_share[name] = round(idle_rate * 100, 3)
        per_round_ms[name] = round((busy1[name] - busy0[name] - idle_rate * busy_wall) / rounds * 1000, 3)
    total_ms = sum(per_round_ms.values())
    mine = dict(records)[domain_name(allocation(0))]
    recorded = json.loads((REPO / "fixtures/libvirt/domstats-qemu-7.2-slice.json").read_text())["records"][0][1]
    if save_record is not None:
        conn = libvirt.open(uri)
        try:
            versions = {"hypervisor_version": conn.getVersion(), "libvirt_version": conn.getLibVersion()}
        finally:
            conn.close()
        save_record.write_text(json.dumps({**versions, "provenance": provenance,
                                           "records": [[domain_name(allocation(0)), mine]]}, indent=1, sort_keys=True)
                               + "\n")
    return {"guests": guests, "rounds": rounds, "idle_window_s": round(idle_wall, 1),
            "wall_ms_per_round": round(busy_wall / rounds * 1000, 3),
            "cpu_ms_per_round": per_round_ms, "cpu_ms_per_round_total": round(total_ms, 3),
            "core_share_at_default_interval_pct": {name: round(ms / 1000 / DEFAULT_INTERVAL_S * 100, 4)
                                                   for name, ms in {**per_round_ms, "total": total_ms}.items()},
            "idle_core_share_pct": idle_share,
            "rss_added_mib_incl_imports": round((rss1 - rss0) / 1024, 1),
            "libvirtd_rss_mib_before_after": [round(libvirtd_rss0 / 1024, 1), round(libvirtd_rss1 / 1024, 1)],
            "collector": view,
            "record_fields_not_in_fixture": sorted(record_shape(mine) - record_shape(recorded)),
            "fixture_fields_not_in_record": sorted(record_shape(recorded) - record_shape(mine))}


def version(number: int) -> str:
    """libvirt's version number as it is written (9000000 -> 9.0.0)."""
    return f"{number // 1000000}.{number // 1000 % 1000}.{number % 1000}"


def main_real(args: argparse.Namespace) -> dict[str, object]:
    """8 real TCG guests on a libvirtd started here (tests/support/libvirtd_fixture.py), the loop against them."""
    from lab.build_guest_image import DEFAULT_CACHE, build_initramfs, fetch_kernel
    from tests.support.libvirtd_fixture import running_libvirtd

    if args.libvirt != "qemu:///system" or os.geteuid() != 0:
        raise SystemExit("--libvirt takes qemu:///system, as root (this bench starts that libvirtd itself)")
    # A timeout's SIGTERM unwinds like an error: the guests, the links and the libvirtd started here go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shutil.rmtree(REAL_WORK, ignore_errors=True)
    REAL_WORK.mkdir(parents=True)
    REAL_WORK.chmod(0o755)  # the QEMU user reads the kernel, the initrd and the disks
    kernel = fetch_kernel(DEFAULT_CACHE)
    shutil.copyfile(kernel.vmlinuz, REAL_WORK / "vmlinuz")  # copies: libvirt relabels what a domain uses
    (REAL_WORK / "initrd.gz").write_bytes(build_initramfs(kernel))
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()[0]
    provenance = (f"Recorded on {time.strftime('%Y-%m-%d', time.gmtime())} by bench/bench_telemetry.py --libvirt "
                  f"qemu:///system --guests {args.guests} on the 2-core dev VM: libvirt {version(libvirt.getVersion())} "
                  f"(libvirtd started by tests/support/libvirtd_fixture.running_libvirtd), {qemu}, TCG. The domain of "
                  f"slot 0 (bench_telemetry.guest_xml): q35, 1 vCPU, {args.guest_memory_mib} MiB, memballoon none "
                  f"as the agent's slices, the lab guest's Debian kernel {kernel.version} and initramfs booted "
                  "directly to idle (console showed the end of its bring-up), a 16 MiB raw virtio disk whose source "
                  "is the slot's by-id path (a link to the file), a virtio-net on an ethernet tap named as the agent "
                  f"names a slot vNIC; read after the bench's {args.rounds} rounds: the record of "
                  "conn.getAllDomainStats(STATS_GROUPS, 0), host/vm/libvirt_lifecycle.py, unchanged.")
    server = NatsServer(nats_server_binary("the bench publishes on a real server"), REAL_WORK / "js",
                        REAL_WORK / "nats.log")
    try:
        with running_libvirtd(REAL_WORK / "libvirtd") as daemon:
            conn = libvirt.open(args.libvirt)
            try:
                left = clean_by_name(conn)
                started = time.monotonic()
                start_guests(conn, REAL_WORK, args.guests, args.guest_memory_mib)
                boot_s = wait_idle(conn, REAL_WORK, args.guests)
                qemus = [int(Path(f"/run/libvirt/qemu/{domain_name(allocation(n))}.pid").read_text())
                         for n in range(args.guests)]
                qemu_rss = sum(proc_rss_kib(pid) for pid in qemus)
                server.start()
                report = asyncio.run(measure_real(server, REAL_WORK, args.guests, args.rounds, args.libvirt,
                                                  args.idle_s, {"libvirtd": [daemon.pid], "qemu": qemus},
                                                  args.save_record, provenance))
                report = {"libvirt": version(libvirt.getVersion()), "qemu": qemu, "guest_kernel": kernel.version,
                          "guest_memory_mib": args.guest_memory_mib, "leftovers_removed_at_start": left,
                          "start_to_all_idle_s": round(boot_s, 1), "since_start_s": round(time.monotonic() - started),
                          "qemu_rss_mib_all_guests": round(qemu_rss / 1024, 1), **report}
            finally:
                clean_by_name(conn)
                conn.close()
    finally:
        server.stop()
        for link in BY_ID_DIR.glob(f"nvme-eui.{MARK}*"):
            link.unlink()
        shutil.rmtree(REAL_WORK, ignore_errors=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--guest-series", type=int, default=800)
    parser.add_argument("--guest-rounds", type=int, default=50)
    parser.add_argument("--serve-exporters", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--libvirt", metavar="URI", help="qemu:///system: real TCG guests on a libvirtd started here")
    parser.add_argument("--guests", type=int, default=8, help="with --libvirt: how many guests (slices)")
    parser.add_argument("--guest-memory-mib", type=int, default=192)
    parser.add_argument("--idle-s", type=float, default=30.0, help="with --libvirt: the windows without telemetry")
    parser.add_argument("--save-record", type=Path, help="with --libvirt: write slot 0's record here (a fixture)")
    args = parser.parse_args()
    if args.libvirt:
        print(json.dumps(main_real(args), indent=2))
        return 0
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
