"""Host health from real checks: what the heartbeat's ``health_state`` and the status command say.

"NATS is connected" is not health. A host whose NAT rule vanished (seed 004,
2026-04-24) or whose leased slot disk fell off the bus still heartbeats; these
checks are what an operator would look at by hand, each one a
:class:`HealthCheck` with a verdict and the evidence in one line:

- slice network: ``slice_gateway`` (bridge owns the gateway), ``slice_nat``
  (MASQUERADE for the subnet), ``slice_ip_forward``, ``dnsmasq`` (running and
  reading the agent's hosts file; the discovery evidence functions, one source of
  truth with preflight);
- ``libvirtd`` reachable (read-only connection, through a ``virsh -r`` child: an idle host never loads
  libvirt-python for it, :mod:`gpuaas_agent.host.vm.virsh`);
- leased slots: ``slot_disks`` (each leased by-id disk resolves to a block device),
  ``vfio_binding`` (an active slot's GPU and VF are on vfio-pci);
- hardware where the host exposes it: ``nvme_smart`` (nvme-cli's smart-log),
  ``pcie_aer`` (AER counters of GPU/NIC/NVMe functions), ``gpu_nvml`` (XID events,
  ECC, retired pages and remapped rows through NVML: :mod:`gpuaas_agent.operator.nvml`), and
  ``gpu_bmc`` where a ``[bmc]`` is configured (the HGX baseboard's BMC over Redfish, which sees
  the GPUs a slice holds on vfio-pci: :mod:`gpuaas_agent.operator.bmc`).

``unavailable`` means this host cannot answer (no nvme-cli, no NVML driver, a
recorded root): it never counts as ``ok`` and never degrades the host either.
A check that raises is ``unavailable`` with the error, not a crash of the loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import posixpath
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import AgentConfig, BmcConfig
from gpuaas_agent.contract.bmc import BmcReading
from gpuaas_agent.contract.slots import SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import CheckStatus, HealthCheck, HostHealth
from gpuaas_agent.discovery.aer import aer_counts
from gpuaas_agent.discovery.netevidence import NetTarget, judge_dnsmasq, read_dnsmasq_evidence, read_network_evidence
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.run import run
from gpuaas_agent.host.vm import virsh
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.operator import bmc, nvml

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECK_TIMEOUT_S = 20.0
VIRSH_TIMEOUT_S = 15.0  # under CHECK_TIMEOUT_S: a libvirtd that does not answer is named as such, its child killed
NVME_TIMEOUT_S = 10.0
_RANK = {"ok": 0, "unavailable": 0, "degraded": 1, "failed": 2}
PCI_DEVICES = "/sys/bus/pci/devices"
# GPU (NVIDIA), fabric (Mellanox) and NVMe (class 0x0108) functions are the slot's devices.
_SLOT_VENDORS = ("0x10de", "0x15b3")
_NVME_CLASS = "0x0108"


@dataclass(frozen=True)
class HealthSettings:
    """What the checks look at: the host root, the slice network's shape, and where its daemons are."""

    host_root: Path
    subnet: str = "10.100.0.0/24"
    ovs_bridge: str = "ovsbr0"
    netns: str | None = None
    dnsmasq_hosts_file: Path = Path("/var/lib/gpuaas-dnsmasq/hosts")
    dnsmasq_pid_file: Path | None = Path("/run/dnsmasq/dnsmasq.pid")
    libvirt_uri: str = "qemu:///system"
    nvml_fixture: Path | None = None  # a recorded NVML reading judged instead of the live NVML (tests, lab)
    # Where the slice network (bridge, NAT, ip_forward, dnsmasq) is read; None: host_root. The lab runs a
    # recorded host (host_root) with a real network: health_network_live reads that one on "/".
    network_root: Path | None = None
    bmc: BmcConfig | None = None  # the HGX baseboard's BMC: the gpu_bmc check (operator/bmc.py)

    @classmethod
    def from_config(cls, config: AgentConfig) -> HealthSettings:
        site = config.slice
        return cls(host_root=config.host_root, subnet=str(site.subnet), ovs_bridge=site.ovs_bridge,
                   netns=config.health_netns, dnsmasq_hosts_file=site.dnsmasq_hosts_file,
                   dnsmasq_pid_file=site.dnsmasq_pid_file, libvirt_uri=site.libvirt_uri,
                   nvml_fixture=getattr(config, "health_nvml_fixture", None),
                   network_root=Path("/") if getattr(config, "health_network_live", False) else None,
                   bmc=getattr(config, "bmc", None))


@dataclass
class RoundReadings:
    """What one health round read, kept for the quarantine pass (operator/health_quarantine.py) to judge
    the same reading instead of reading the hardware a second time. A field is set only when its check
    finished reading (a check past its deadline leaves it None, and the pass then reads for itself)."""

    aer: dict[str, dict[str, int]] | None = None  # PCI address -> AER counters (pcie_aer)
    nvml: nvml.NvmlReading | None = None  # the reading gpu_nvml judged
    bmc: BmcReading | None = None  # the reading gpu_bmc judged


def _now() -> datetime:
    return datetime.now(UTC)


def _check(name: str, status: CheckStatus, detail: str) -> HealthCheck:
    return HealthCheck(name=name, status=status, detail=detail[:4000], checked_at=_now())


# -- slice network ------------------------------------------------------------------------


def network_checks(settings: HealthSettings) -> list[HealthCheck]:
    """Bridge + gateway, NAT and ip_forward from one read of the slice network evidence (blocking)."""

    host = HostRoot.open(settings.network_root or settings.host_root)
    target = NetTarget(subnet=ipaddress.IPv4Network(settings.subnet), ovs_bridge=settings.ovs_bridge,
                       netns=settings.netns)
    try:
        ev = read_network_evidence(host, target)
    except AgentError as exc:
        return [_check(n, "unavailable", f"{exc.code}: {exc.message}")
                for n in ("slice_gateway", "slice_nat", "slice_ip_forward")]
    where = f" in netns {settings.netns}" if settings.netns else ""
    blocked = {f.code: f.detail for f in ev.blockers}
    unproven = {f.code: f.detail for f in ev.warnings}
    checks = []
    for name, bad_codes, unproven_codes, good in (
        ("slice_gateway", ("ovs_bridge_missing", "gateway_address_missing"),
         ("ovs_bridge_unproven", "gateway_address_unproven"), f"{ev.ovs_bridge} owns {ev.gateway}{where}"),
        ("slice_nat", ("nat_missing",), ("nat_unproven",), f"{ev.nat.rule} ({ev.nat.method}){where}"),
        ("slice_ip_forward", ("ip_forward_disabled",), ("ip_forward_unproven",), f"net.ipv4.ip_forward=1{where}"),
    ):
        bad = [f"{c}: {blocked[c]}" for c in bad_codes if c in blocked]
        maybe = [f"{c}: {unproven[c]}" for c in unproven_codes if c in unproven]
        if bad:
            checks.append(_check(name, "degraded", "; ".join(bad) + where))
        elif maybe:
            checks.append(_check(name, "unavailable", "; ".join(maybe) + where))
        else:
            checks.append(_check(name, "ok", good))
    return checks


def dnsmasq_check(settings: HealthSettings) -> HealthCheck:
    """A running dnsmasq reads the agent's hosts file and is the pid a reload signals (blocking)."""
    host = HostRoot.open(settings.network_root or settings.host_root)
    ev = read_dnsmasq_evidence(host, settings.dnsmasq_hosts_file, settings.dnsmasq_pid_file)
    finding = judge_dnsmasq(ev)
    if finding is None:
        return _check("dnsmasq", "ok", f"{ev.via}")
    status: CheckStatus = "unavailable" if finding.code == "dnsmasq_unproven" else "degraded"
    return _check("dnsmasq", status, f"{finding.code}: {finding.detail}")


async def libvirtd_check(settings: HealthSettings, *, threads: CheckThreads) -> HealthCheck:
    """A read-only connection to the configured libvirt URI opens and answers.

    Asked through ``virsh -r ... version --daemon`` (one short child per round, the same version number and
    error message as the binding's), run on the loop so that a daemon stopping mid-round kills it; in-process
    (in a check thread) only on a host without virsh."""
    try:
        answer = await asyncio.wait_for(virsh.read_version(settings.libvirt_uri, timeout=VIRSH_TIMEOUT_S),
                                        CHECK_TIMEOUT_S)
    except TimeoutError:
        return _check("libvirtd", "unavailable", f"check did not answer within {CHECK_TIMEOUT_S:g}s")
    except Exception as exc:
        return _check("libvirtd", "unavailable", f"check raised {type(exc).__name__}: {exc}")
    if answer is None:
        (check,) = await guarded_check("libvirtd", lambda: libvirtd_check_in_process(settings), threads=threads)
        return check
    if not answer.connected:
        return _check("libvirtd", "degraded", f"cannot connect to {settings.libvirt_uri}: {answer.error}")
    if answer.lib_version is None:
        return _check("libvirtd", "unavailable", f"check raised libvirtError: {answer.error}")
    return _check("libvirtd", "ok", f"{settings.libvirt_uri} answers (libvirt {answer.lib_version})")


def libvirtd_check_in_process(settings: HealthSettings) -> HealthCheck:
    """:func:`libvirtd_check` through libvirt-python (a host without virsh; imported here, not at start)."""
    import libvirt

    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # errors are returned, not printed
    try:
        conn = libvirt.openReadOnly(settings.libvirt_uri)
    except libvirt.libvirtError as exc:
        return _check("libvirtd", "degraded", f"cannot connect to {settings.libvirt_uri}: {exc.get_error_message()}")
    try:
        return _check("libvirtd", "ok", f"{settings.libvirt_uri} answers (libvirt {conn.getLibVersion()})")
    finally:
        conn.close()


# -- leased slots --------------------------------------------------------------------------


def slot_disk_check(settings: HealthSettings, leases: list[SlotLease]) -> HealthCheck:
    """Every leased slot's by-id disk resolves to a block device the kernel still has."""
    if not leases:
        return _check("slot_disks", "ok", "no leased slots")
    host = HostRoot.open(settings.host_root).fresh()
    missing = []
    for lease in leases:
        try:
            target = host.resolve(lease.nvme_device)
        except OSError as exc:
            missing.append(f"slot {lease.slot_index} {lease.nvme_device}: {exc}")
            continue
        name = posixpath.basename(target)
        if not host.exists(lease.nvme_device) and not host.exists(f"/sys/class/block/{name}"):
            missing.append(f"slot {lease.slot_index} {lease.nvme_device} -> {target}: no such block device")
    if missing:
        return _check("slot_disks", "failed", "; ".join(missing))
    return _check("slot_disks", "ok", f"{len(leases)} leased disk(s) present")


def _driver(host: HostRoot, address: str) -> str | None:
    link = f"{PCI_DEVICES}/{address}/driver"
    if not host.exists(link):
        return None
    return posixpath.basename(host.resolve(link))


def vfio_check(settings: HealthSettings, leases: list[SlotLease], records: list[SlotRecord]) -> HealthCheck:
    """An active slot's GPU and fabric VF are on vfio-pci (a host driver grabbing one breaks the guest)."""
    active = {r.slot_index for r in records if r.status == SlotStatus.active}
    checked = [lease for lease in leases if lease.slot_index in active]
    if not checked:
        return _check("vfio_binding", "ok", "no active leased slots")
    host = HostRoot.open(settings.host_root).fresh()
    wrong = []
    for lease in checked:
        for role, address in (("gpu", lease.gpu_pci_address), ("fabric_vf", lease.fabric_vf_pci_address)):
            driver = _driver(host, address)
            if driver != "vfio-pci":
                wrong.append(f"slot {lease.slot_index} {role} {address} on {driver or 'no driver'}")
    if wrong:
        return _check("vfio_binding", "degraded", "; ".join(wrong))
    return _check("vfio_binding", "ok", f"{len(checked)} active slot(s) on vfio-pci")


# -- hardware ------------------------------------------------------------------------------


def pcie_aer_check(settings: HealthSettings, readings: RoundReadings | None = None) -> HealthCheck:
    """AER counters of the slot's PCI functions: fatal errors fail the host, non-fatal degrade it."""
    host = HostRoot.open(settings.host_root)
    try:
        addresses = sorted(host.listdir(PCI_DEVICES))
    except OSError:
        return _check("pcie_aer", "unavailable", f"{PCI_DEVICES} unreadable")
    fatal, nonfatal, correctable, seen = [], [], 0, 0
    read: dict[str, dict[str, int]] = {}
    for address in addresses:
        base = f"{PCI_DEVICES}/{address}"
        try:
            vendor = host.read_attr(f"{base}/vendor")
            klass = host.read_attr(f"{base}/class")
        except OSError:
            continue
        if vendor not in _SLOT_VENDORS and not klass.startswith(_NVME_CLASS):
            continue
        counts = aer_counts(host, address)
        if not counts:
            continue
        read[address] = counts
        seen += 1
        if counts.get("fatal"):
            fatal.append(f"{address} fatal={counts['fatal']}")
        if counts.get("nonfatal"):
            nonfatal.append(f"{address} nonfatal={counts['nonfatal']}")
        correctable += counts.get("correctable", 0)
    if readings is not None:
        readings.aer = read
    if not seen:
        return _check("pcie_aer", "unavailable", "no slot device exposes AER counters")
    if fatal or nonfatal:
        return _check("pcie_aer", "failed" if fatal else "degraded", "; ".join(fatal + nonfatal))
    return _check("pcie_aer", "ok", f"{seen} device(s), 0 fatal, 0 non-fatal, {correctable} correctable")


def _smart_value(log_json: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = log_json.get(name)
        if isinstance(value, dict):  # nvme-cli 2.x: {"value": N, ...} for critical_warning
            value = value.get("value")
        if isinstance(value, (int, float)):
            return int(value)
    return None


async def nvme_smart_check(settings: HealthSettings) -> HealthCheck:
    """Critical warning, media errors and wear of every NVMe controller (nvme-cli, live host only)."""
    host = HostRoot.open(settings.host_root)
    if not host.is_live:
        return _check("nvme_smart", "unavailable", f"recorded root {settings.host_root}: SMART not readable")
    if shutil.which("nvme") is None:
        return _check("nvme_smart", "unavailable", "nvme-cli is not installed")
    try:
        controllers = sorted(n for n in host.listdir("/sys/class/nvme") if n.startswith("nvme"))
    except OSError:
        controllers = []
    if not controllers:
        return _check("nvme_smart", "unavailable", "no NVMe controllers")
    bad, failed, read = [], False, 0
    for name in controllers:
        try:
            done = await run(["nvme", "smart-log", "-o", "json", f"/dev/{name}"], timeout=NVME_TIMEOUT_S)
            data = json.loads(done.stdout)
        except (AgentError, ValueError) as exc:
            bad.append(f"{name}: smart-log unreadable ({exc})")
            continue
        read += 1
        critical = _smart_value(data, "critical_warning") or 0
        media = _smart_value(data, "media_errors") or 0
        used = _smart_value(data, "percent_used", "percentage_used") or 0
        if critical:
            failed = True
            bad.append(f"{name}: critical_warning={critical:#x}")
        if media:
            bad.append(f"{name}: media_errors={media}")
        if used >= 100:
            bad.append(f"{name}: percentage_used={used}")
    if not read:
        return _check("nvme_smart", "unavailable", "; ".join(bad))
    if bad:
        return _check("nvme_smart", "failed" if failed else "degraded", "; ".join(bad))
    return _check("nvme_smart", "ok", f"{read} controller(s): no critical warning, no media errors")


def gpu_nvml_check(settings: HealthSettings, source: nvml.NvmlSource | None = None,
                   readings: RoundReadings | None = None) -> HealthCheck:
    """XID events, uncorrected ECC, retired pages and remapped rows through NVML (operator/nvml.py).

    ``settings.nvml_fixture``: judge a recorded reading instead of the live NVML (tests, lab).
    A recorded root without one is ``unavailable``; so is a live host without the driver.
    """
    reading: nvml.NvmlReading | str
    if settings.nvml_fixture is not None:
        try:
            reading = nvml.load_reading(settings.nvml_fixture)
        except AgentError as exc:
            return _check("gpu_nvml", "unavailable", f"{exc.code}: {exc.message}")
        if readings is not None:
            readings.nvml = reading
        status, detail = nvml.judge(reading, now=reading.recorded_at)
        return _check("gpu_nvml", status, detail)
    if not HostRoot.open(settings.host_root).is_live:
        return _check("gpu_nvml", "unavailable", "recorded root: NVML not consulted")
    reading = (source or nvml.SOURCE).read()
    if isinstance(reading, str):
        return _check("gpu_nvml", "unavailable", reading)
    if readings is not None:
        readings.nvml = reading
    status, detail = nvml.judge(reading)
    return _check("gpu_nvml", status, detail)


# -- port isolation (docs/safety.md §9) ---------------------------------------------------------

# The fabric VF kinds too (tasks/fabricvf.py): a VF setting change on a PF is an RTM_NEWLINK of the PF, so the
# slice-network watch's netlink wake-up re-reads the VFs and its repair (the repairing reconcile) restores them.
ISOLATION_KINDS = frozenset({"flows_missing", "flows_altered", "flows_orphan",
                             "nft_guard_missing", "nft_guard_altered", "nft_guard_orphan",
                             "fabric_vf_drift", "fabric_vf_unreadable"})


def isolation_check(findings: list[Any]) -> HealthCheck:
    """``port_isolation`` from a read-only reconcile's findings: a guest port without its rules is degraded."""
    broken = [f for f in findings if getattr(f.kind, "value", f.kind) in ISOLATION_KINDS]
    if not broken:
        return _check("port_isolation", "ok", "every active slice port carries its flows and nft guard element")
    return _check("port_isolation", "degraded", "; ".join(
        f"{f.kind.value} {f.subject}" + (f" ({f.actual})" if f.actual else "") for f in broken))


# -- one round -----------------------------------------------------------------------------


class CheckThreads:
    """Blocking checks in daemon threads that nobody has to wait for.

    ``asyncio.to_thread`` runs on the loop's default executor, and ``asyncio.run`` joins that
    executor's threads before the process may exit: a check blocked on a hung mount, a FIFO or
    a wedged sysfs attribute would hold SIGTERM for as long as it blocks (CHECK_TIMEOUT_S at
    best, for ever at worst). Here each check runs in its own daemon thread; the round awaits
    it under its deadline and shutdown awaits nothing. A check whose previous thread is still
    blocked is not started again (one stuck thread per check at most, never one per round):
    it answers ``unavailable`` with the time it has been stuck.

    One per daemon, built and owned by ``daemon.py`` and passed down to the reporter's rounds and the network
    watch (both run ``slice_network`` and ``dnsmasq``: one registry is what keeps one stuck thread per check);
    a one-shot command (``gpuaas-agent status``) builds its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, float] = {}  # check name -> monotonic start of its thread

    def stuck_since(self, name: str) -> float | None:
        with self._lock:
            return self._running.get(name)

    async def run(self, name: str, work: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._running[name] = time.monotonic()

        def deliver(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def target() -> None:
            outcome: tuple[bool, object]
            try:
                outcome = (True, work())
            except BaseException as exc:
                outcome = (False, exc)
            finally:
                with self._lock:
                    self._running.pop(name, None)
            try:
                loop.call_soon_threadsafe(deliver, *outcome)
            except RuntimeError:  # the loop is closed: the daemon stopped without waiting for us, as meant
                pass

        threading.Thread(target=target, name=f"health-{name}", daemon=True).start()
        return await future


async def guarded_check(name: str, work: Callable[[], HealthCheck | list[HealthCheck]], *, threads: CheckThreads,
                        timeout_s: float = CHECK_TIMEOUT_S) -> list[HealthCheck]:
    """One check in a daemon thread under a deadline; what it raises becomes ``unavailable`` with the reason."""
    since = threads.stuck_since(name)
    if since is not None:
        return [_check(name, "unavailable",
                       f"previous run still blocked after {time.monotonic() - since:.0f}s; not started again")]
    try:
        result = await asyncio.wait_for(threads.run(name, work), timeout_s)
    except TimeoutError:
        return [_check(name, "unavailable", f"check did not answer within {timeout_s:g}s")]
    except Exception as exc:
        return [_check(name, "unavailable", f"check raised {type(exc).__name__}: {exc}")]
    return result if isinstance(result, list) else [result]


def bmc_checks(config: BmcConfig | None, readings: RoundReadings | None = None, *,
               threads: CheckThreads) -> list[Awaitable[list[HealthCheck]]]:
    """The ``gpu_bmc`` check where a BMC is configured, under its own deadline (a whole baseboard read)."""
    if config is None:
        return []

    def read_and_judge() -> HealthCheck:
        reading = bmc.read_bmc_verdicts(config)
        if readings is not None:
            readings.bmc = reading
        return bmc.check_of(reading)

    return [guarded_check(bmc.CHECK_NAME, read_and_judge, threads=threads, timeout_s=config.check_timeout_s)]


async def run_checks(settings: HealthSettings, leases: list[SlotLease], records: list[SlotRecord],
                     readings: RoundReadings | None = None, *, threads: CheckThreads) -> list[HealthCheck]:
    """Every check once, concurrently; sorted by name so heartbeats compare line by line.

    ``readings``: filled with what the AER, NVML and BMC checks read (the quarantine pass judges those).
    ``threads``: the daemon's (or a command's) :class:`CheckThreads`, which the blocking checks run in.
    """
    async def nvme() -> list[HealthCheck]:
        try:
            return [await asyncio.wait_for(nvme_smart_check(settings), CHECK_TIMEOUT_S)]
        except Exception as exc:
            return [_check("nvme_smart", "unavailable", f"check raised {type(exc).__name__}: {exc}")]

    async def libvirtd() -> list[HealthCheck]:
        return [await libvirtd_check(settings, threads=threads)]

    rounds = await asyncio.gather(
        guarded_check("slice_network", lambda: network_checks(settings), threads=threads),
        guarded_check("dnsmasq", lambda: dnsmasq_check(settings), threads=threads),
        libvirtd(),
        guarded_check("slot_disks", lambda: slot_disk_check(settings, leases), threads=threads),
        guarded_check("vfio_binding", lambda: vfio_check(settings, leases, records), threads=threads),
        guarded_check("pcie_aer", lambda: pcie_aer_check(settings, readings), threads=threads),
        guarded_check("gpu_nvml", lambda: gpu_nvml_check(settings, readings=readings), threads=threads),
        nvme(),
        *bmc_checks(settings.bmc, readings, threads=threads),
    )
    return sorted((c for group in rounds for c in group), key=lambda c: c.name)


def summarise(checks: list[HealthCheck]) -> tuple[HostHealth, str | None]:
    """(health_state, reason): the worst verdict, and the checks that set it (``name: detail``)."""
    worst = max((_RANK[c.status] for c in checks), default=0)
    if worst == 0:
        return "healthy", None
    state: HostHealth = "failed" if worst == 2 else "degraded"
    reason = "; ".join(f"{c.name}: {c.detail}" for c in checks if _RANK[c.status] == worst)
    return state, reason[:4000]
