"""``gpuaas-agent status``: what this host is doing and whether it is healthy, without NATS and read-only.

Sources, each read-only, each allowed to be missing (the answer then says so):

- the enrollment record (node id) and the daemon's status file (NATS state, last
  heartbeat, in-flight tasks with their current step, its latest health checks);
- the state DB, opened ``mode=ro`` (a status command must never migrate, lock or
  create it): leases, slot records, stored task results (recent failures);
- libvirt, read-only, for each leased slot's domain (by the agent's domain name);
- the dnsmasq hosts file for the slot's reserved IP;
- the host itself: the health checks run now (``--no-checks`` skips them).

Exit code: 0 healthy, 1 degraded (a check, NATS, the daemon not running, a slot
``cleanup_blocked``), 3 broken (state unreadable, not enrolled, a check ``failed``).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import urllib.parse
from datetime import datetime
from pathlib import Path

import libvirt
from pydantic import Field, ValidationError

from gpuaas_agent import __version__
from gpuaas_agent.compat import UTC
from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.fleet import DrainReport, MaintenanceState, QuarantineRecord
from gpuaas_agent.contract.naming import domain_name
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.control.enroll import js_api_prefix_in_use, load_enrollment
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations
from gpuaas_agent.host.vm.consolelog import log_path as console_log_path
from gpuaas_agent.operator.daemonstatus import DaemonStatus, InFlightTask, read_status
from gpuaas_agent.operator.health import CheckThreads, HealthSettings
from gpuaas_agent.operator.health import run_checks as run_health
from gpuaas_agent.tasks.maintenance import MAINTENANCE_KEY

EXIT_HEALTHY, EXIT_DEGRADED, EXIT_BROKEN = 0, 1, 3
RECENT_FAILURES = 10
STALE_AFTER_INTERVALS = 3


class SlotView(WireModel):
    slot_index: int
    allocation_id: str | None = None
    lease_task_id: str | None = None
    leased_at: datetime | None = None
    nvme_device: str | None = None
    disk_identity: str | None = None  # None on a store the daemon has not migrated yet (before schema 4)
    gpu_pci_address: str | None = None
    fabric_vf_pci_address: str | None = None
    status: str | None = None  # the slot record's status (None: never touched by this host)
    health_state: str | None = None
    last_task_id: str | None = None
    updated_at: datetime | None = None
    domain: str | None = None
    vm_state: str | None = None  # running, shut off, absent, or why it could not be read
    ip: str | None = None
    console_log: str | None = None  # the allocation's serial console log on this host, when it exists


class FailureView(WireModel):
    task_id: str
    type: str
    status: str
    code: str | None = None
    message: str | None = None
    finished_at: str | None = None


class StatusReport(WireModel):
    verdict: str  # healthy | degraded | broken
    reasons: list[str] = Field(default_factory=list)
    node_id: str | None = None
    js_api_prefix: str | None = None  # "<prefix> (config|enrollment|default)": where JetStream requests go
    agent_version: str = __version__
    daemon: DaemonStatus | None = None
    daemon_running: bool = False
    nats_state: str | None = None
    last_heartbeat_at: datetime | None = None
    slots: list[SlotView] = Field(default_factory=list)
    in_flight: list[InFlightTask] = Field(default_factory=list)
    recent_failures: list[FailureView] = Field(default_factory=list)
    health: list[HealthCheck] = Field(default_factory=list)
    libvirt: str | None = None
    # Where every slice's serial console is captured (slice.console_log reads it; docs/console-logs.md).
    console_log_dir: str | None = None
    maintenance: DrainReport | None = None  # None: never set, or a store too old to have it
    quarantined: list[QuarantineRecord] = Field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return {"healthy": EXIT_HEALTHY, "degraded": EXIT_DEGRADED}.get(self.verdict, EXIT_BROKEN)


class StateUnreadable(AgentError):
    default_code = "state_unreadable"


def _utc(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)


def open_readonly(path: Path) -> sqlite3.Connection:
    """The state DB read-only (``mode=ro``): nothing is created, migrated or locked for writing."""
    if not path.is_file():
        raise StateUnreadable(f"state DB {path} does not exist or is not a file", evidence={"path": str(path)})
    uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=5)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        raise StateUnreadable(f"cannot read state DB {path}: {exc}", evidence={"path": str(path)}) from None
    return conn


def read_state(path: Path) -> tuple[dict[int, SlotView], list[FailureView]]:
    """Leases and slot records merged per slot, and the newest failed task results."""
    conn = open_readonly(path)
    try:
        slots: dict[int, SlotView] = {}
        cursor = conn.execute("SELECT * FROM slot_lease")  # by column name: an older schema lacks disk_identity
        names = [d[0] for d in cursor.description]
        for row in cursor:
            lease = dict(zip(names, row))
            slots[lease["slot_index"]] = SlotView(
                slot_index=lease["slot_index"], allocation_id=lease["allocation_id"], lease_task_id=lease["task_id"],
                leased_at=_utc(lease["taken_at"]), nvme_device=lease["nvme_device"],
                disk_identity=lease.get("disk_identity"), gpu_pci_address=lease["gpu_pci_address"],
                fabric_vf_pci_address=lease["fabric_vf_pci_address"])
        for slot_index, allocation_id, status, health, task_id, updated_at in conn.execute(
                "SELECT slot_index, allocation_id, status, health_state, task_id, updated_at FROM slot_state"):
            base = slots.get(slot_index) or SlotView(slot_index=slot_index, allocation_id=allocation_id)
            slots[slot_index] = base.model_copy(update={"status": status, "health_state": health,
                                                        "last_task_id": task_id, "updated_at": _utc(updated_at)})
        failures = []
        for (raw,) in conn.execute("SELECT result FROM task_result ORDER BY stored_at DESC LIMIT 500"):
            result = json.loads(raw)
            if result.get("status") == "succeeded":
                continue
            error = result.get("error") or {}
            failures.append(FailureView(task_id=result.get("task_id", "?"), type=result.get("type", "?"),
                                        status=result.get("status", "?"), code=error.get("code"),
                                        message=error.get("message"), finished_at=result.get("finished_at")))
            if len(failures) >= RECENT_FAILURES:
                break
        return slots, failures
    except (sqlite3.Error, ValueError) as exc:
        raise StateUnreadable(f"cannot read state DB {path}: {exc}", evidence={"path": str(path)}) from None
    finally:
        conn.close()


def read_fleet(path: Path) -> tuple[DrainReport | None, list[QuarantineRecord]]:
    """Maintenance (with its drain: the leases still held) and the quarantined components, read-only.

    A store the daemon has not migrated yet has neither: (None, []). A maintenance row that does not
    validate is ``StateUnreadable`` (status says so rather than guess the host is open for work).
    """
    conn = open_readonly(path)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        drain = None
        if "agent_meta" in tables:
            row = conn.execute("SELECT value FROM agent_meta WHERE key = ?", (MAINTENANCE_KEY,)).fetchone()
            if row is not None:
                state = MaintenanceState.model_validate_json(row[0])
                leases = conn.execute("SELECT slot_index, allocation_id FROM slot_lease ORDER BY slot_index").fetchall()
                drain = DrainReport(maintenance=state.on, reason=state.reason if state.on else "",
                                    since=state.since if state.on else None, leased_slots=[r[0] for r in leases],
                                    allocations=len({r[1] for r in leases}), drained=state.on and not leases,
                                    drained_at=state.drained_at if state.on else None)
        quarantined = []
        if "quarantine" in tables:
            for kind, identity, reason, evidence, at, task_id, slot_index in conn.execute(
                    "SELECT kind, identity, reason, evidence, quarantined_at, task_id, slot_index FROM quarantine"
                    " ORDER BY quarantined_at"):
                quarantined.append(QuarantineRecord.from_wire({
                    "kind": kind, "identity": identity, "reason": reason, "evidence": json.loads(evidence),
                    "quarantined_at": datetime.fromtimestamp(at, UTC).isoformat(), "task_id": task_id,
                    "slot_index": slot_index}))
        return drain, quarantined
    except (sqlite3.Error, ValueError) as exc:
        raise StateUnreadable(f"cannot read maintenance/quarantine from {path}: {exc}"[:2000],
                              evidence={"path": str(path)}) from None
    finally:
        conn.close()


def vm_states(uri: str, names: dict[int, str]) -> tuple[dict[int, str], str]:
    """Each slot's domain state through a read-only libvirt connection; (states, connection verdict)."""
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    try:
        conn = libvirt.openReadOnly(uri)
    except libvirt.libvirtError as exc:
        return {i: "unknown (libvirt unreachable)" for i in names}, f"unreachable: {uri}: {exc.get_error_message()}"
    labels = {libvirt.VIR_DOMAIN_RUNNING: "running", libvirt.VIR_DOMAIN_SHUTOFF: "shut off",
              libvirt.VIR_DOMAIN_PAUSED: "paused", libvirt.VIR_DOMAIN_SHUTDOWN: "shutting down",
              libvirt.VIR_DOMAIN_CRASHED: "crashed", libvirt.VIR_DOMAIN_PMSUSPENDED: "suspended"}
    states = {}
    try:
        for index, name in names.items():
            try:
                state, _ = conn.lookupByName(name).state()
                states[index] = labels.get(state, f"state {state}")
            except libvirt.libvirtError as exc:
                states[index] = "absent" if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN else \
                    f"unknown ({exc.get_error_message()})"
    finally:
        conn.close()
    return states, f"reachable: {uri}"


def _reserved_ips(config: AgentConfig) -> dict[int, str]:
    site = config.slice
    try:
        reservations = DnsmasqReservations(site.dnsmasq_hosts_file, site.subnet, site.gateway,
                                           site.dnsmasq_pid_file).reservations()
    except (OSError, AgentError):
        return {}
    return {r.slot_index: str(r.ip) for r in reservations}


def collect(config: AgentConfig, *, run_checks: bool = True, now: float | None = None) -> StatusReport:
    """Everything the status command shows; never raises for a missing source, says so instead."""
    now = time.time() if now is None else now
    reasons: list[str] = []
    broken = False
    node_id = js_api_prefix = None
    try:
        record = load_enrollment(config.state_dir)
        node_id = record.node_id if record else None
        js_api_prefix = "{} ({})".format(*js_api_prefix_in_use(config, record))
        if record is None:
            broken = True
            reasons.append(f"not enrolled: no enrollment record in {config.state_dir}")
    except (AgentError, OSError) as exc:
        broken = True
        reasons.append(f"enrollment record unreadable: {exc}")

    daemon = None
    try:
        daemon = read_status(config.state_dir)
    except AgentError as exc:
        reasons.append(str(exc))
    running = False
    if daemon is None:
        reasons.append("daemon: no status file (not running, or never ran)")
    else:
        age = now - daemon.written_at.timestamp()
        running = daemon.nats_state != "stopping" and age <= max(STALE_AFTER_INTERVALS * daemon.heartbeat_interval_s, 5)
        if not running:
            reasons.append(f"daemon: status file is {age:.0f}s old (pid {daemon.pid} not running or stuck)")
        elif daemon.nats_state != "connected":
            reasons.append(f"nats: {daemon.nats_state} (attempt {daemon.nats_connect_attempts})")

    slots: dict[int, SlotView] = {}
    failures: list[FailureView] = []
    drain: DrainReport | None = None
    quarantined: list[QuarantineRecord] = []
    try:
        slots, failures = read_state(config.state_db)
        drain, quarantined = read_fleet(config.state_db)
    except StateUnreadable as exc:
        broken = True
        reasons.append(str(exc))
    for q in quarantined:
        reasons.append(f"quarantined: {q.kind.value} {q.identity}"
                       f"{'' if q.slot_index is None else f' (slot {q.slot_index})'}: {q.reason.value} since "
                       f"{q.quarantined_at.isoformat(timespec='seconds')}, task {q.task_id}")

    libvirt_verdict = None
    with_alloc = {i: domain_name(s.allocation_id) for i, s in slots.items() if s.allocation_id}
    if with_alloc:
        states, libvirt_verdict = vm_states(config.slice.libvirt_uri, with_alloc)
        ips = _reserved_ips(config)
        for index, name in with_alloc.items():
            slots[index] = slots[index].model_copy(update={"domain": name, "vm_state": states.get(index),
                                                          "ip": ips.get(index)})
    for index, slot in slots.items():
        if slot.allocation_id:
            log = console_log_path(config.slice.console_log_dir, slot.allocation_id, index)
            if log.is_file():
                slots[index] = slot.model_copy(update={"console_log": str(log)})
    for slot in slots.values():
        if slot.status == "cleanup_blocked":
            reasons.append(f"slot {slot.slot_index}: cleanup_blocked (last task {slot.last_task_id})")

    checks: list[HealthCheck] = []
    if run_checks:

        leases, records = [], []
        for s in slots.values():
            try:  # rows as the store wrote them; one that does not validate is left out of the checks
                if s.lease_task_id:
                    # model_validate: the view's optional fields are what validation judges here
                    leases.append(SlotLease.model_validate(dict(allocation_id=s.allocation_id, slot_index=s.slot_index,
                                            gpu_pci_address=s.gpu_pci_address, nvme_device=s.nvme_device,
                                            disk_identity=s.disk_identity or f"path:{s.nvme_device}",
                                            fabric_vf_pci_address=s.fabric_vf_pci_address, task_id=s.lease_task_id,
                                            taken_at=s.leased_at.timestamp())))  # type: ignore[union-attr]  # a lease row has its time
                if s.status:
                    records.append(SlotRecord.model_validate(dict(slot_index=s.slot_index, allocation_id=s.allocation_id or "",
                                              status=s.status, health_state=s.health_state,
                                              task_id=s.last_task_id or "", updated_at=0.0)))
            except ValidationError:
                reasons.append(f"slot {s.slot_index}: stored lease or record does not validate")
        # A one-shot command: its own check threads (the daemon's are the daemon's).
        checks = asyncio.run(run_health(HealthSettings.from_config(config), leases, records, threads=CheckThreads()))
    elif daemon is not None:
        checks = list(daemon.health)
    worst = [c for c in checks if c.status in ("degraded", "failed")]
    reasons.extend(f"{c.name}: {c.detail}" for c in worst)
    if broken or any(c.status == "failed" for c in worst):
        verdict = "broken"
    elif reasons:
        verdict = "degraded"
    else:
        verdict = "healthy"
    return StatusReport(
        verdict=verdict, reasons=reasons, node_id=node_id, js_api_prefix=js_api_prefix, daemon=daemon, daemon_running=running,
        nats_state=daemon.nats_state if daemon else None,
        last_heartbeat_at=daemon.last_heartbeat_at if daemon else None,
        slots=[slots[i] for i in sorted(slots)], in_flight=list(daemon.in_flight) if daemon and running else [],
        recent_failures=failures, health=checks, libvirt=libvirt_verdict,
        console_log_dir=str(config.slice.console_log_dir), maintenance=drain, quarantined=quarantined)


def _age(then: datetime | None, now: datetime) -> str:
    if then is None:
        return "-"
    seconds = max(0, int((now - then).total_seconds()))
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m" if seconds < 7200 else f"{seconds // 3600}h"


def _section(title: str, rows: list[str]) -> list[str]:
    """A titled block of the human report: its rows, or ``(none)``."""
    return [title, *(rows or ["  (none)"])]


def render(report: StatusReport) -> str:
    """The human table: one block per question an operator asks."""
    now = datetime.now(UTC)
    lines = [f"host     {report.verdict.upper()}  node {report.node_id or '-'}  agent {report.agent_version}"]
    for reason in report.reasons:
        lines.append(f"  - {reason}")
    if report.daemon is not None:
        d = report.daemon
        lines.append(f"daemon   {'running' if report.daemon_running else 'NOT RUNNING'} pid {d.pid}, "
                     f"up {_age(d.started_at, now)}, status written {_age(d.written_at, now)} ago")
        lines.append(f"nats     {d.nats_state}, last heartbeat {_age(d.last_heartbeat_at, now)} ago, "
                     f"reconnects {d.nats_reconnects}")
        if d.registered is not None:
            r = d.registered
            rss = f"{r.rss_bytes / (1 << 20):.1f} MiB" if r.rss_bytes is not None else "-"
            lines.append(f"holds    {r.tasks} task(s), {r.terminal_sessions} terminal session(s) "
                         f"(+{r.terminal_opening} connecting), {r.power_tasks} power task(s), "
                         f"{r.subscriptions} NATS subscription(s); rss {rss}")
    else:
        lines.append("daemon   no status file")
    lines.append(f"js api   {report.js_api_prefix or '-'}")
    lines.append(f"libvirt  {report.libvirt or '-'}")
    lines.append(f"console  logs in {report.console_log_dir or '-'} (slice.console_log reads them)")
    m = report.maintenance
    if m is not None and m.maintenance:
        drain = (f"drained {_age(m.drained_at, now)} ago" if m.drained else
                 f"draining: {len(m.leased_slots)} slot(s) of {m.allocations} allocation(s) left "
                 f"({', '.join(map(str, m.leased_slots))})")
        lines.append(f"maint    ON for {_age(m.since, now)}: {m.reason}; {drain}")
    else:
        lines.append("maint    off")
    lines.append("")
    lines.append(f"{'SLOT':<5}{'STATUS':<16}{'HEALTH':<10}{'ALLOCATION':<38}{'VM':<12}{'IP':<16}LAST TASK")
    for s in report.slots:
        lines.append(f"{s.slot_index:<5}{(s.status or ('leased' if s.lease_task_id else '-')):<16}"
                     f"{(s.health_state or '-'):<10}{(s.allocation_id or '-'):<38}{(s.vm_state or '-'):<12}"
                     f"{(s.ip or '-'):<16}{s.last_task_id or s.lease_task_id or '-'}")
        if s.console_log:
            lines.append(f"     console log {s.console_log}")
    if not report.slots:
        lines.append("(no leased or recorded slots)")
    lines.append("")
    lines += _section("IN FLIGHT", [
        f"  {t.task_id} {t.type or '?'} step {t.step or '-'} for {_age(t.step_started_at, now)}, "
        f"task age {_age(t.started_at, now)}" for t in report.in_flight])
    lines += _section("RECENT FAILURES", [
        f"  {f.finished_at or '-'} {f.task_id} {f.type} {f.status} {f.code or '-'}: {f.message or ''}"
        for f in report.recent_failures])
    lines += _section("QUARANTINED", [
        f"  {q.kind.value:<10}{q.identity:<40}{q.reason.value:<26}slot {q.slot_index if q.slot_index is not None else '-'}"
        f"  since {_age(q.quarantined_at, now)}  task {q.task_id}" for q in report.quarantined])
    lines.append("HEALTH CHECKS")
    for c in report.health:
        lines.append(f"  {c.status:<12}{c.name:<18}{c.detail}")
    return "\n".join(lines)
