"""Host-side slice telemetry: one libvirt bulk stats call per interval, one message per allocation.

Every ``interval_s``: the host's leases (state store), libvirt's bulk stats of every domain in one call
(:meth:`~gpuaas_agent.host.vm.libvirt_lifecycle.LibvirtLifecycle.all_domain_stats`), matched by
:func:`slice_telemetry` (pure) into one :class:`~gpuaas_agent.contract.telemetry.SliceTelemetry` per
allocation, published on that allocation's own subject (contract/subjects.py ``telemetry``): the body of one
allocation never travels on another's subject, so a control plane that forwards a tenant its subjects shows it
its own slices only (DESIGN.md §4 rule 16).

The operator's side is the agent's ``/metrics`` (:class:`SliceMetricsCollector`): each series carries the
``slot`` label only (bounded by the host's slots), and ``gpuaas_agent_slice_info{slot, allocation_id, domain}``
maps a slot to its allocation, so a new allocation adds no series beyond its slots' and nothing is labelled
per allocation. Nothing per slice outlives its lease: a scrape shows only allocations that hold a lease at that
moment, and each round keeps only what it read for the leased allocations.

Each slot's GPU, as the health pass's last BMC reading gave it (``SlotTelemetry.gpu``), is on ``/metrics`` too
(:func:`_gpu_families`): temperatures with their thresholds (``source`` says whose), power, ECC, row remaps, PCIe,
throttle reasons counted by kind, and NVLink **per slot**: the reading sums each counter over the GPU's ports
(contract/bmc.py ``NvLinkTelemetry``), so there is no per-link counter to show; the one per-link series is
``gpuaas_agent_slice_gpu_nvlink_port_down{slot, link}`` for a port the BMC reports down, bounded by the BMC's own
port count (operator/redfish.py ``MAX_PORT_MEMBERS``, 18 on an H100/H200) and empty while every link is up.

What a round may cost is bounded: one stats call with a deadline (a late or failed round is logged, counted
and skipped, never retried within the interval), at most ``max_allocations`` messages.

A slot's fabric VF is counted by its PF, not by libvirt (the VF is passed through): :class:`PfVfCounters`
reads the PF and the VF's index from sysfs and the PF's IFLA_VF_STATS with one netlink call per PF, only for a
PF whose driver fills them (host/network/fabricvf.py ``VF_STATS_DRIVERS``: mlx5_core; igb reports zeroes it
never counted). A slot whose VF has no counters carries none and names ``slot.<n>.fabric_vf`` in
``not_reported``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import nats.errors
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from pydantic import ValidationError

from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.bmc import GpuTelemetry, TemperatureReading
from gpuaas_agent.contract.domain import DomainState
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.telemetry import (
    MAX_SLOTS,
    DiskCounters,
    FabricVfCounters,
    NicCounters,
    SliceTelemetry,
    SlotTelemetry,
    TelemetryBounds,
)
from gpuaas_agent.discovery.fabric import vf_on_pf
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.fabricvf import VF_STATS_DRIVERS, FabricVfError, FabricVfNetlink, vf_counters
from gpuaas_agent.host.vm.domstats import DomainStats, parse_all
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.logs import log_event
from gpuaas_agent.operator.guest_telemetry import GuestTelemetrySource

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 15.0
DomainStatsSource = Callable[[], Awaitable[list[tuple[str, dict[str, Any]]]]]
Publish = Callable[[str, bytes], Awaitable[None]]
Leases = Callable[[], Awaitable[list[SlotLease]]]
FabricCounters = Callable[[list[SlotLease]], Awaitable[dict[str, FabricVfCounters]]]  # VF PCI address -> counters


class PfVfCounters:
    """The leased slots' fabric VF counters from their PFs (a :data:`FabricCounters`).

    Per round: a few sysfs readlinks per slot (``physfn``, the PF's ``virtfn<N>``, its netdev and driver), then
    one netlink read per PF whose driver fills IFLA_VF_STATS; a PF that cannot be read leaves its VFs unknown.
    """

    def __init__(self, host_root: Path, netlink: FabricVfNetlink | None = None) -> None:
        self.host_root, self.netlink = host_root, netlink or FabricVfNetlink()

    async def __call__(self, leases: list[SlotLease]) -> dict[str, FabricVfCounters]:
        vfs = sorted({lease.fabric_vf_pci_address for lease in leases if lease.fabric_vf_pci_address})
        return await asyncio.to_thread(self.read, vfs) if vfs else {}

    def read(self, vfs: list[str]) -> dict[str, FabricVfCounters]:
        reader = SysReader(HostRoot.open(self.host_root))
        located = [where for vf in vfs if (where := vf_on_pf(reader, vf)) is not None
                   and where.pf_driver in VF_STATS_DRIVERS]
        out: dict[str, FabricVfCounters] = {}
        for pf_netdev in sorted({where.pf_netdev for where in located}):
            try:
                stats = self.netlink.stats(pf_netdev)
            except FabricVfError as exc:  # that PF's VFs are unknown this round; the rest of the message goes out
                log_event(log, "fabric_vf_counters_failed", logging.DEBUG, pf_netdev=pf_netdev, code=exc.code)
                continue
            for where in located:
                if where.pf_netdev == pf_netdev and (counters := vf_counters(
                        where.vf_pci_address, pf_netdev, where.vf_index, stats, where.pf_driver)) is not None:
                    out[where.vf_pci_address] = counters
        return out


def default_bounds(stats_timeout_s: float) -> TelemetryBounds:
    return TelemetryBounds(max_allocations=MAX_SLOTS, max_slots_per_allocation=MAX_SLOTS,
                           stats_timeout_s=stats_timeout_s)


def _by_allocation(leases: list[SlotLease]) -> dict[str, list[SlotLease]]:
    grouped: dict[str, list[SlotLease]] = {}
    for lease in sorted(leases, key=lambda lease: (lease.allocation_id, lease.slot_index)):
        grouped.setdefault(lease.allocation_id, []).append(lease)
    return grouped


@dataclass(frozen=True)
class GpuSensors:
    """The health pass's last BMC reading of the GPUs, by host PCI address (``BmcReading.sensors_by_pci_address``)."""

    read_at: datetime
    by_pci_address: Mapping[str, GpuTelemetry]


GpuSensorsSource = Callable[[], "GpuSensors | None"]


def _slot(lease: SlotLease, stats: DomainStats | None, fabric: Mapping[str, FabricVfCounters],
          gpus: GpuSensors | None = None) -> SlotTelemetry:
    disk = nic = None
    gpu = gpus.by_pci_address.get(str(lease.gpu_pci_address)) if gpus is not None else None
    vf = fabric.get(lease.fabric_vf_pci_address) if lease.fabric_vf_pci_address else None
    if stats is not None:
        block = next((b for b in stats.blocks if b.path == str(lease.nvme_device)), None)
        if block is not None:
            disk = DiskCounters(device=block.name, read_bytes=block.rd_bytes, read_ops=block.rd_reqs,
                                write_bytes=block.wr_bytes, write_ops=block.wr_reqs)
        tap = vnic_name(lease.allocation_id, lease.slot_index)
        net = next((n for n in stats.nets if n.name == tap), None)
        if net is not None:
            nic = NicCounters(interface=net.name, rx_bytes=net.rx_bytes, rx_packets=net.rx_pkts,
                              rx_drops=net.rx_drop, tx_bytes=net.tx_bytes, tx_packets=net.tx_pkts,
                              tx_drops=net.tx_drop)
    return SlotTelemetry(slot_index=lease.slot_index, disk=disk, management_nic=nic, fabric_vf=vf, gpu=gpu,
                         gpu_read_at=gpus.read_at if gpu is not None and gpus is not None else None)


def _not_reported(stats: DomainStats | None, slots: list[SlotTelemetry], held: list[SlotLease]) -> list[str]:
    if stats is None:
        return ["domain"]
    missing = [name for name, value in (("cpu_time_ns", stats.cpu_time_ns), ("vcpu_time_ns", stats.vcpu_time_ns),
                                        ("memory_bytes", stats.balloon_current_kib),
                                        ("memory_rss_bytes", stats.balloon_rss_kib)) if value is None]
    missing += [f"slot.{s.slot_index}.disk" for s in slots if s.disk is None]
    if not any(s.management_nic is not None for s in slots):
        missing.append("management_nic")
    missing += [f"slot.{s.slot_index}.fabric_vf" for s, lease in zip(slots, held)
                if lease.fabric_vf_pci_address and s.fabric_vf is None]
    missing += [f"slot.{s.slot_index}.gpu" for s in slots if s.gpu is None]
    return missing


def _kib(value: int | None) -> int | None:
    return None if value is None else value * 1024


def slice_telemetry(node_id: str, leases: list[SlotLease], stats: Mapping[str, DomainStats], *, collected_at: float,
                    interval_s: float, bounds: TelemetryBounds,
                    fabric: Mapping[str, FabricVfCounters] | None = None,
                    gpus: GpuSensors | None = None) -> list[SliceTelemetry]:
    """One message per leased allocation (at most ``bounds.max_allocations``), from one round's stats.

    ``fabric``: the round's VF counters by VF PCI address (:class:`PfVfCounters`); a slot's VF absent from it
    is unknown. ``gpus``: the health pass's last BMC reading; a slot's GPU absent from it is unknown.

    Only the leases decide what is reported: a domain without a lease (not ours, or a leftover) is never
    read into a message, and a leased allocation whose domain is absent from the stats reports ``shutoff``
    with no counters.
    """
    out = []
    for allocation_id, held in list(_by_allocation(leases).items())[:bounds.max_allocations]:
        held = held[:bounds.max_slots_per_allocation]
        name = domain_name(allocation_id)
        found = stats.get(name)
        slots = [_slot(lease, found, fabric or {}, gpus) for lease in held]
        out.append(SliceTelemetry(
            node_id=node_id, allocation_id=allocation_id, domain=name, collected_at=collected_at,
            interval_s=interval_s, bounds=bounds, state=found.state if found else DomainState.shutoff,
            cpu_time_ns=found.cpu_time_ns if found else None, vcpu_time_ns=found.vcpu_time_ns if found else None,
            vcpus=found.vcpus if found else None,
            memory_bytes=_kib(found.balloon_current_kib) if found else None,
            memory_max_bytes=_kib(found.balloon_maximum_kib) if found else None,
            memory_rss_bytes=_kib(found.balloon_rss_kib) if found else None,
            slots=slots, not_reported=_not_reported(found, slots, held)))
    return out


@dataclass
class TelemetryCounters:
    """The rounds themselves, for the operator (``gpuaas_agent_slice_telemetry_rounds_total{outcome}``)."""

    rounds: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0, "timeout": 0})
    published: int = 0
    last_ok_at: float | None = None


class SliceTelemetryLoop:
    """Reads, matches and publishes every ``interval_s``; keeps the last round's messages for ``/metrics``."""

    def __init__(self, node_id: str, source: DomainStatsSource, leases: Leases, publish: Publish, *,
                 interval_s: float = DEFAULT_INTERVAL_S, stats_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time, guest: GuestTelemetrySource | None = None,
                 fabric: FabricCounters | None = None, gpus: GpuSensorsSource | None = None) -> None:
        self.node_id, self.source, self.leases, self.publish = node_id, source, leases, publish
        self.gpus = gpus  # None: no BMC configured (every slot's GPU reads unknown)
        self.fabric = fabric  # None: no VF counters are read (every slot's VF reads unknown)
        self.guest = guest  # None: no allocation's guest is ever pulled (operator/guest_telemetry.py)
        self.interval_s, self.clock = interval_s, clock
        self.bounds = default_bounds(stats_timeout_s)
        self.latest: dict[str, SliceTelemetry] = {}
        self.guest_kept: dict[tuple[str, int], tuple[str, int]] = {}  # (allocation, slot) -> (outcome, samples kept)
        self.counters = TelemetryCounters()

    async def collect(self) -> list[SliceTelemetry]:
        """One round: leases, one bulk stats call (bounded), the messages; ``latest`` holds leased ones only."""
        held = await self.leases()
        if self.guest is not None:  # nothing per slice outlives its lease
            self.guest.puller.forget_except(lease.allocation_id for lease in held)
        if not held:  # no slice: no libvirt call at all
            self.latest, self.guest_kept = {}, {}
            self.counters.rounds["ok"] += 1
            return []
        collected_at = self.clock()
        records = await asyncio.wait_for(self.source(), self.bounds.stats_timeout_s)
        fabric = await self._fabric(held)
        messages = slice_telemetry(self.node_id, held, parse_all(records), collected_at=collected_at,
                                   interval_s=self.interval_s, bounds=self.bounds, fabric=fabric,
                                   gpus=self.gpus() if self.gpus is not None else None)
        messages = await self._with_guest(held, messages)
        # /metrics needs the guest pulls' outcome and size only: the series themselves are published, not kept.
        self.guest_kept = {(m.allocation_id, g.slot_index): (g.outcome, len(g.series)) for m in messages for g in m.guest}
        self.latest = {m.allocation_id: m.model_copy(update={"guest": []}) if m.guest else m for m in messages}
        self.counters.rounds["ok"] += 1
        self.counters.last_ok_at = collected_at
        return messages

    async def _fabric(self, held: list[SlotLease]) -> dict[str, FabricVfCounters]:
        """The VF counters of this round, within the stats deadline; a failed read costs only them."""
        if self.fabric is None:
            return {}
        try:
            return await asyncio.wait_for(self.fabric(held), self.bounds.stats_timeout_s)
        except (TimeoutError, AgentError, OSError) as exc:
            log_event(log, "fabric_vf_counters_failed", logging.WARNING, error=repr(exc))
            return {}

    async def _with_guest(self, held: list[SlotLease], messages: list[SliceTelemetry]) -> list[SliceTelemetry]:
        """The opted-in allocations' messages with their guests' pulls; a failed guest round costs only itself."""
        opted = [(lease.allocation_id, lease.slot_index) for lease in held if lease.guest_telemetry]
        if self.guest is None or not opted:
            return messages
        try:
            pulled = await self.guest.round(opted)
        except (AgentError, OSError) as exc:  # the reservations unreadable: the host-side counters still go out
            log_event(log, "guest_telemetry_failed", logging.WARNING, error=repr(exc))
            return messages
        wanted = {allocation for allocation, _ in opted}
        return [m.model_copy(update={"guest_bounds": self.guest.puller.bounds, "guest": pulled.get(m.allocation_id, [])})
                if m.allocation_id in wanted else m for m in messages]

    async def round(self) -> int:
        """``collect`` then publish each message on its allocation's subject; a failed round is logged, not fatal."""
        try:
            messages = await self.collect()
        except TimeoutError:
            self.counters.rounds["timeout"] += 1
            log_event(log, "slice_telemetry_failed", logging.WARNING, code="libvirt_timeout",
                      timeout_s=self.bounds.stats_timeout_s)
            return 0
        except AgentError as exc:
            self.counters.rounds["failed"] += 1
            log_event(log, "slice_telemetry_failed", logging.WARNING, code=exc.code, message=exc.message)
            return 0
        except ValidationError as exc:  # a record that fits no bound of the contract: that round is lost, not the loop
            self.counters.rounds["failed"] += 1
            log_event(log, "slice_telemetry_failed", logging.WARNING, code="invalid_message",
                      message=str(exc.errors(include_url=False, include_input=False)[:3]))
            return 0
        sent = 0
        for message in messages:
            try:
                await self.publish(subjects.telemetry(self.node_id, message.allocation_id),
                                   message.model_dump_json().encode())
            except (nats.errors.Error, OSError) as exc:  # NATS down: the next round sends fresh counters, none queued
                log_event(log, "slice_telemetry_publish_failed", logging.WARNING, error=repr(exc),
                          allocation_id=message.allocation_id)
                break
            sent += 1
        self.counters.published += sent
        return sent

    async def run(self) -> None:
        while True:
            await self.round()
            await asyncio.sleep(self.interval_s)  # the telemetry interval


class SliceMetricsCollector:
    """The slices on ``/metrics``: ``slot``-labelled series, the allocation in ``gpuaas_agent_slice_info`` only.

    ``leased``: the allocations holding a lease now (read at scrape time, off the loop): a released slice's
    series are gone from the next scrape, not one round later.
    """

    def __init__(self, loop: SliceTelemetryLoop, leased: Callable[[], set[str]]) -> None:
        self.loop, self.leased = loop, leased

    def collect(self) -> Iterator[Metric]:
        try:
            leased = self.leased()
        except Exception as exc:  # a scrape must render the rest of the agent's metrics
            log_event(log, "metrics_sample_failed", logging.WARNING, error=repr(exc), part="slice_telemetry")
            return
        rounds = CounterMetricFamily("gpuaas_agent_slice_telemetry_rounds", "slice telemetry rounds by outcome",
                                     labels=["outcome"])
        for outcome, count in sorted(self.loop.counters.rounds.items()):
            rounds.add_metric([outcome], count)
        yield rounds
        yield CounterMetricFamily("gpuaas_agent_slice_telemetry_published", "slice telemetry messages published",
                                  value=self.loop.counters.published)
        messages = [m for a, m in sorted(self.loop.latest.items()) if a in leased]
        yield from _slice_families(messages)
        if self.loop.guest is not None:
            kept = {key: value for key, value in sorted(self.loop.guest_kept.items()) if key[0] in leased}
            yield from _guest_families(self.loop.guest, kept)


_DOMAIN_SERIES: tuple[tuple[str, str, str, Callable[[SliceTelemetry], float | None]], ...] = (
    ("gpuaas_agent_slice_cpu_seconds", "counter", "CPU time of the slice's VM (QEMU included), by its first slot",
     lambda m: None if m.cpu_time_ns is None else m.cpu_time_ns / 1e9),
    ("gpuaas_agent_slice_vcpu_seconds", "counter", "CPU time of the slice's vCPUs, by its first slot",
     lambda m: None if m.vcpu_time_ns is None else m.vcpu_time_ns / 1e9),
    ("gpuaas_agent_slice_memory_bytes", "gauge", "the slice guest's memory (balloon current), by its first slot",
     lambda m: m.memory_bytes),
    ("gpuaas_agent_slice_memory_rss_bytes", "gauge", "host memory the slice's VM holds, by its first slot",
     lambda m: m.memory_rss_bytes),
)
_DISK_SERIES: tuple[tuple[str, str], ...] = (
    ("read_bytes", "gpuaas_agent_slice_disk_read_bytes"), ("read_ops", "gpuaas_agent_slice_disk_read_ops"),
    ("write_bytes", "gpuaas_agent_slice_disk_written_bytes"), ("write_ops", "gpuaas_agent_slice_disk_write_ops"),
)
_NIC_SERIES: tuple[tuple[str, str], ...] = (
    ("rx_bytes", "gpuaas_agent_slice_nic_receive_bytes"), ("rx_packets", "gpuaas_agent_slice_nic_receive_packets"),
    ("rx_drops", "gpuaas_agent_slice_nic_receive_drops"), ("tx_bytes", "gpuaas_agent_slice_nic_transmit_bytes"),
    ("tx_packets", "gpuaas_agent_slice_nic_transmit_packets"), ("tx_drops", "gpuaas_agent_slice_nic_transmit_drops"),
)


_VF_SERIES: tuple[tuple[str, str], ...] = tuple(
    (attr, name.replace("gpuaas_agent_slice_nic_", "gpuaas_agent_slice_fabric_vf_")) for attr, name in _NIC_SERIES)


def _slice_families(messages: list[SliceTelemetry]) -> Iterator[Metric]:
    info = GaugeMetricFamily("gpuaas_agent_slice_info", "1 for each leased slot: its allocation and domain",
                             labels=["slot", "allocation_id", "domain"])
    up = GaugeMetricFamily("gpuaas_agent_slice_running", "1 while the slot's VM runs", labels=["slot"])
    for m in messages:
        for s in m.slots:
            info.add_metric([str(s.slot_index), m.allocation_id, m.domain], 1)
            up.add_metric([str(s.slot_index)], int(m.state is DomainState.running))
    yield info
    yield up
    for name, kind, doc, read in _DOMAIN_SERIES:
        family: CounterMetricFamily | GaugeMetricFamily = (
            CounterMetricFamily(name, doc, labels=["slot"]) if kind == "counter"
            else GaugeMetricFamily(name, doc, labels=["slot"]))
        for m in messages:
            value = read(m)
            if value is not None and m.slots:
                family.add_metric([str(m.slots[0].slot_index)], value)
        yield family
    for part, series, what in (("disk", _DISK_SERIES, "the slot disk's {} as the guest did them"),
                               ("management_nic", _NIC_SERIES, "the slot management vNIC's {} (host tap side)"),
                               ("fabric_vf", _VF_SERIES, "the slot fabric VF's {} as its PF counts them")):
        for attr, name in series:
            counter = CounterMetricFamily(name, what.format(attr.replace("_", " ")), labels=["slot"])
            for m in messages:
                for s in m.slots:
                    device = getattr(s, part)
                    if device is not None and (v := getattr(device, attr)) is not None:
                        counter.add_metric([str(s.slot_index)], v)
            yield counter
    yield from _gpu_families([(str(s.slot_index), s) for m in messages for s in m.slots])


def _family(kind: str, name: str, doc: str, labels: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    return (CounterMetricFamily(name, doc, labels=labels) if kind == "counter"
            else GaugeMetricFamily(name, doc, labels=labels))


# (kind, series, help, extra label, (label value, GpuTelemetry field) ...): one family each, labelled by slot and,
# where it has one, a label whose values are fixed here (never a string the BMC chose).
_GPU_SERIES: tuple[tuple[str, str, str, str | None, tuple[tuple[str, str], ...]], ...] = (
    ("gauge", "gpuaas_agent_slice_gpu_power_watts", "the slot GPU's power draw (BMC)", None, (("", "power_w"),)),
    ("gauge", "gpuaas_agent_slice_gpu_power_limit_watts", "the slot GPU's power limit (BMC)", None,
     (("", "power_limit_w"),)),
    ("counter", "gpuaas_agent_slice_gpu_sram_ecc_errors", "the slot GPU's SRAM ECC errors (BMC, lifetime)",
     "severity", (("correctable", "sram_ecc_correctable"), ("uncorrectable", "sram_ecc_uncorrectable"))),
    ("counter", "gpuaas_agent_slice_gpu_dram_ecc_errors", "the slot GPU's HBM ECC errors (BMC, lifetime)",
     "severity", (("correctable", "dram_ecc_correctable"), ("uncorrectable", "dram_ecc_uncorrectable"))),
    ("gauge", "gpuaas_agent_slice_gpu_remapped_rows", "the slot GPU's HBM rows remapped, by the error that caused it",
     "severity", (("correctable", "row_remap_correctable"), ("uncorrectable", "row_remap_uncorrectable"))),
    ("gauge", "gpuaas_agent_slice_gpu_row_remapping", "1 when the slot GPU's row remapping failed / is pending",
     "state", (("failed", "row_remapping_failed"), ("pending", "row_remapping_pending"))),
    ("counter", "gpuaas_agent_slice_gpu_pcie_errors", "the slot GPU's PCIe errors (BMC)", "severity",
     (("correctable", "pcie_correctable"), ("nonfatal", "pcie_nonfatal"), ("fatal", "pcie_fatal"))),
)
# NVLink, summed over the GPU's ports by the reading (contract/bmc.py NvLinkTelemetry): per slot, not per link.
_NVLINK_SERIES: tuple[tuple[str, str, str, str | None, tuple[tuple[str, str], ...]], ...] = (
    ("gauge", "gpuaas_agent_slice_gpu_nvlink_ports", "the slot GPU's NVLink ports (BMC), by link status", "state",
     (("listed", "ports"), ("up", "ports_up"), ("disabled", "ports_disabled"), ("counted", "metrics_read"))),
    ("counter", "gpuaas_agent_slice_gpu_nvlink_errors",
     "the slot GPU's NVLink error counters, summed over its counted ports (BMC)", "kind",
     (("data_crc", "data_crc_count"), ("flit_crc", "flit_crc_count"), ("recovery", "recovery_count"),
      ("replay", "replay_count"))),
    ("gauge", "gpuaas_agent_slice_gpu_nvlink_error_ports", "the slot GPU's NVLink ports reporting an error (BMC)",
     "error", (("runtime", "runtime_error_ports"), ("training", "training_error_ports"))),
)


def _value(model: object, attr: str) -> float | None:
    value = getattr(model, attr)
    return None if value is None else float(value)


def _gpu_families(slots: list[tuple[str, SlotTelemetry]]) -> Iterator[Metric]:
    """The leased slots' GPU sensors from the health pass's last BMC reading; a value the BMC did not give has no
    sample (unknown is never 0). Bounded: a few series per slot, each label's values fixed here, ``link`` by the
    BMC's own port count."""
    gpus = [(slot, s.gpu, s.gpu_read_at) for slot, s in slots if s.gpu is not None]
    info = GaugeMetricFamily("gpuaas_agent_slice_gpu_info", "1 for each slot whose GPU the BMC read: its BMC id",
                             labels=["slot", "gpu_id", "sxm_slot"])
    read_at = GaugeMetricFamily("gpuaas_agent_slice_gpu_read_timestamp_seconds",
                                "when the health pass read the slot GPU from the BMC", labels=["slot"])
    for slot, gpu, at in gpus:
        info.add_metric([slot, gpu.gpu_id, gpu.sxm_slot or ""], 1)
        if at is not None:
            read_at.add_metric([slot], at.timestamp())
    yield info
    yield read_at
    yield from _temperature_families(gpus)
    for kind, name, doc, label, fields in _GPU_SERIES:
        family = _family(kind, name, doc, ["slot"] + ([label] if label else []))
        for slot, gpu, _ in gpus:
            for value_label, attr in fields:
                if (v := _value(gpu, attr)) is not None:
                    family.add_metric([slot] + ([value_label] if label else []), v)
        yield family
    throttle = GaugeMetricFamily("gpuaas_agent_slice_gpu_throttle_reasons",
                                 "the slot GPU's throttle reasons now, counted by kind (hardware: HW*, what degrades "
                                 "health); no sample where the BMC does not say (NA)", labels=["slot", "kind"])
    for slot, gpu, _ in gpus:
        if gpu.throttle_reasons is not None:
            hardware = sum(1 for r in gpu.throttle_reasons if r.startswith("HW"))
            throttle.add_metric([slot, "hardware"], hardware)
            throttle.add_metric([slot, "other"], len(gpu.throttle_reasons) - hardware)
    yield throttle
    for kind, name, doc, label, fields in _NVLINK_SERIES:
        family = _family(kind, name, doc, ["slot", label or ""])
        for slot, gpu, _ in gpus:
            for value_label, attr in fields:
                if gpu.nvlink is not None and (v := _value(gpu.nvlink, attr)) is not None:
                    family.add_metric([slot, value_label], v)
        yield family
    down = GaugeMetricFamily("gpuaas_agent_slice_gpu_nvlink_port_down",
                             "1 for each NVLink port of the slot GPU the BMC reports not LinkUp", labels=["slot", "link"])
    for slot, gpu, _ in gpus:
        for link in gpu.nvlink.ports_down if gpu.nvlink is not None else ():
            down.add_metric([slot, link], 1)
    yield down


def _temperature_families(gpus: list[tuple[str, GpuTelemetry, datetime | None]]) -> Iterator[Metric]:
    """GPU and memory (HBM) temperatures, and the thresholds they are judged by with whose each is: ``bmc`` (the
    sensor's own) or ``nvidia_limit`` (NVIDIA's, where the BMC gives none: the GPU temperature on a real HGX)."""
    temperature = GaugeMetricFamily("gpuaas_agent_slice_gpu_temperature_celsius",
                                    "the slot GPU's temperatures (BMC): the die (gpu) and the HBM (memory)",
                                    labels=["slot", "sensor"])
    threshold = GaugeMetricFamily("gpuaas_agent_slice_gpu_temperature_threshold_celsius",
                                  "the threshold each slot GPU temperature is judged by, and whose it is",
                                  labels=["slot", "sensor", "level", "source"])
    for slot, gpu, _ in gpus:
        readings: tuple[tuple[str, TemperatureReading | None], ...] = (
            ("gpu", gpu.temperature), ("memory", gpu.memory_temperature))
        for sensor, reading in readings:
            if reading is None:
                continue
            if reading.reading_c is not None:
                temperature.add_metric([slot, sensor], reading.reading_c)
            for level, limit in (("caution", reading.caution), ("critical", reading.critical)):
                if limit is not None:
                    threshold.add_metric([slot, sensor, level, limit.source], limit.reading_c)
    yield temperature
    yield threshold


def _guest_families(guest: GuestTelemetrySource, kept: dict[tuple[str, int], tuple[str, int]]) -> Iterator[Metric]:
    """The guest pulls for the operator: outcomes and drop reasons (fixed sets), series kept per slot. The guest's
    own series are the tenant's (its allocation's subject), never the host dashboard's."""
    counters = guest.puller.counters
    pulls = CounterMetricFamily("gpuaas_agent_guest_telemetry_pulls", "guest exporter pulls by outcome",
                                labels=["outcome"])
    for outcome, count in sorted(counters.pulls.items()):
        pulls.add_metric([outcome], count)
    yield pulls
    dropped = CounterMetricFamily("gpuaas_agent_guest_telemetry_dropped",
                                  "guest samples (or whole bodies) dropped, by reason", labels=["reason"])
    for reason, count in sorted(counters.dropped.items()):
        dropped.add_metric([reason], count)
    yield dropped
    yield CounterMetricFamily("gpuaas_agent_guest_telemetry_read_bytes", "bytes read from guest exporters",
                              value=counters.bytes_read)
    series = GaugeMetricFamily("gpuaas_agent_slice_guest_series", "samples kept from the slot's last guest pull",
                               labels=["slot", "outcome"])
    for (_, slot), (outcome, count) in kept.items():
        series.add_metric([str(slot), outcome], count)
    yield series
