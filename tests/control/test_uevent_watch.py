"""The drift watcher end to end: a real kernel event, real rediscovery of a fixture copy, a real NATS message.

The host under discovery is a copy of a recorded fixture that the test breaks
(a GPU removed, a slot disk mounted); the trigger is a real uevent from this
machine's kernel (a loop partition, a veth), read by the real monitor. The
drift report must arrive on ``gpuaas.node.<node>.drift`` within a deadline and
name what changed by its stable identity. Other tests on this machine make
uevents too, so reports are matched by content, never by count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import uuid
from pathlib import Path

import nats
import pytest

from gpuaas_agent.config import load_config
from gpuaas_agent.contract.drift import DriftKind, DriftReport, DriftSeverity, DriftTrigger
from gpuaas_agent.control.enroll import EnrollIdentity, enroll
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.uevent_watch import DriftWatcher, drift_subject
from gpuaas_agent.daemon import run_agent
from gpuaas_agent.discovery.drift import topology_drift
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.host.devices.uevents import UeventMonitor, udevd_running
from gpuaas_agent.hostfs import HostRoot
from tests.support.controlplane import ControlPlane
from tests.support.realdev import require_root, sh

AFTER = "h200-slice-after-transition"
GPU0 = "0000:18:00.0"
SLOT0_DISK = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331"
NODE = "node-drift-1"
DEADLINE_S = 20.0
DEBOUNCE_S = 0.3


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _until(predicate, what: str, timeout: float = DEADLINE_S):
    """Poll ``predicate`` (a condition with a deadline, not a sleep for ordering)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


class DriftInbox:
    """Every message on a node's drift subject, parsed; a marker message ends a 'nothing more' check."""

    def __init__(self) -> None:
        self.reports: list[DriftReport] = []
        self.markers: list[bytes] = []

    async def subscribe(self, nc, node_id: str) -> None:
        async def on_msg(msg) -> None:
            if msg.data.startswith(b"marker:"):
                self.markers.append(msg.data)
            else:
                self.reports.append(DriftReport.model_validate_json(msg.data))

        self.sub = await nc.subscribe(drift_subject(node_id), cb=on_msg)
        await nc.flush(timeout=5)

    def naming(self, kind: DriftKind, subject: str) -> list[DriftReport]:
        return [r for r in self.reports if any(f.kind == kind and f.subject == subject for f in r.findings)]

    def with_event(self, name: str) -> list[DriftReport]:
        return [r for r in self.reports if any(e.name == name for e in r.events)]


def _gpu_removed(root: Path, address: str) -> None:
    link = root / "sys/bus/pci/devices" / address
    shutil.rmtree(link.resolve())
    link.unlink()


def _disk_mounted(root: Path, by_id: str) -> None:
    report = discover(HostRoot.open(root))
    name = next(d.kernel_name for d in report.nvme_devices if d.by_id == by_id)
    mountinfo = root / "proc/self/mountinfo"
    mountinfo.write_text(mountinfo.read_text() + f"300 1 0:77 / /scratch rw,relatime shared:90 - btrfs /dev/{name} rw\n")


def _watcher(nc, root: Path, **kwargs) -> DriftWatcher:
    return DriftWatcher(nc, NODE, lambda: discover(HostRoot.open(root)), topology_drift, publish_timeout_s=5, **kwargs)


async def _drift_inbox(url: str) -> tuple[nats.NATS, DriftInbox]:
    """A connection to the test's server, and the inbox that collects what is published for ``NODE``."""
    nc = await nats.connect(url, connect_timeout=5)
    inbox = DriftInbox()
    await inbox.subscribe(nc, NODE)
    return nc, inbox


async def _nothing_published(nc: nats.NATS, inbox: DriftInbox) -> None:
    """No drift report reached ``inbox``: one connection's messages arrive in order, so a report the watcher
    published would be there before the marker this sends on the same connection."""
    await nc.publish(drift_subject(NODE), b"marker:1")
    await _until(lambda: inbox.markers, "the marker")
    assert inbox.reports == []


async def _start_watching(watcher: DriftWatcher) -> asyncio.Task:
    task = asyncio.create_task(watcher.watch(UeventMonitor(), debounce_s=DEBOUNCE_S, max_burst_s=5.0))
    await _until(lambda: watcher.last_report is not None or task.done(), "the baseline discovery")
    assert not task.done(), "the watcher stopped before its baseline"
    return task


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _link_name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def _del_link(name: str) -> None:
    if Path(f"/sys/class/net/{name}").exists():
        sh("ip", "link", "del", name, check=False)


def test_gpu_removed_meanwhile_is_published_after_a_real_block_event(host_copy, nats_server, realdev):
    root = host_copy(AFTER)

    async def body():
        nc, inbox = await _drift_inbox(nats_server.url)
        watcher = _watcher(nc, root, publish_empty=True)  # every check is sent: the test finds its own
        task = await _start_watching(watcher)
        try:
            _gpu_removed(root, GPU0)
            disk = await asyncio.to_thread(realdev.disk, 16, partitions_mib=[4], link=False)
            part = Path(disk.partitions[0]).name  # the kernel's block "add" for it is the trigger
            await _until(lambda: inbox.with_event(part), f"a drift report triggered by {part}")
            (report,) = inbox.naming(DriftKind.gpu_vanished, GPU0)  # once: the next checks compare with it
            assert report.trigger == DriftTrigger.uevent and report.node_id == NODE and report.events
            (finding,) = [f for f in report.findings if f.subject == GPU0]
            assert finding.severity == DriftSeverity.error and finding.detail["driver"] == "nvidia"
            assert inbox.reports.index(report) <= inbox.reports.index(inbox.with_event(part)[0])
            assert watcher.last_report is not None and GPU0 not in {g.pci_address for g in watcher.last_report.gpus}
        finally:
            await _stop(task)
            await nc.close()

    _run(body())


def test_slot_disk_mounted_meanwhile_is_published_after_a_real_link_event(host_copy, nats_server):
    require_root()
    root = host_copy(AFTER)
    a, b = _link_name("uwa"), _link_name("uwb")

    async def body():
        nc, inbox = await _drift_inbox(nats_server.url)
        task = await _start_watching(_watcher(nc, root))  # publish only drift
        try:
            _disk_mounted(root, SLOT0_DISK)
            await asyncio.to_thread(sh, "ip", "link", "add", a, "type", "veth", "peer", "name", b)
            reports = await _until(lambda: inbox.naming(DriftKind.nvme_in_use_changed, SLOT0_DISK),
                                   "the in-use change of the slot disk")
            (finding,) = [f for f in reports[0].findings if f.subject == SLOT0_DISK]
            assert (finding.expected, finding.actual) == ("unused", "mounted at /scratch")
            assert reports[0].trigger == DriftTrigger.uevent and reports[0].events
        finally:
            await _stop(task)
            await nc.close()

    try:
        _run(body())
    finally:
        _del_link(a)


def test_a_check_without_drift_publishes_nothing(host_copy, nats_server):
    root = host_copy(AFTER)

    async def body():
        nc, inbox = await _drift_inbox(nats_server.url)
        watcher = _watcher(nc, root)
        try:
            await watcher.baseline()
            report = await watcher.check(DriftTrigger.timer)
            assert report is not None and report.findings == [] and watcher.checks == 2
            await _nothing_published(nc, inbox)
        finally:
            await nc.close()

    _run(body())


def test_failed_rediscovery_keeps_the_last_report_and_publishes_nothing(host_copy, nats_server, caplog):
    root = host_copy(AFTER)

    async def body():
        nc, inbox = await _drift_inbox(nats_server.url)
        watcher = _watcher(nc, root, publish_empty=True)
        try:
            baseline = await watcher.baseline()
            shutil.rmtree(root)  # the host root is gone: discovery refuses with root_missing
            with caplog.at_level(logging.WARNING, logger="gpuaas_agent.control.uevent_watch"):
                assert await watcher.check(DriftTrigger.timer) is None
            assert watcher.last_report is baseline
            failed = [json.loads(r.getMessage()) for r in caplog.records if "drift_discovery_failed" in r.getMessage()]
            assert [f["code"] for f in failed] == ["root_missing"]
            await _nothing_published(nc, inbox)
        finally:
            await nc.close()

    _run(body())


# -- the daemon ---------------------------------------------------------------------------


class _EventLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.events.append(json.loads(record.getMessage()))
        except ValueError:
            pass

    def named(self, event: str) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and e.get("event") == event]


def test_daemon_publishes_drift_from_kernel_events(host_copy, nats_server, tmp_path):
    require_root()
    root = host_copy(AFTER)
    a, b = _link_name("uda"), _link_name("udb")
    events = _EventLog()
    watch_log = logging.getLogger("gpuaas_agent.control.uevent_watch")
    source_log = logging.getLogger("gpuaas_agent.host.devices.uevents")

    async def body():
        plane = await ControlPlane.connect(nats_server.url)
        await plane.create_streams()
        await plane.serve_enrollment()
        token = tmp_path / "token"
        token.write_text(plane.issue_token())
        identity = EnrollIdentity(machine_id="1221a371a78ea21b24acbc2cf895b074", hostname="j22u05", agent_version="0.1.0")
        record = await enroll(nats_server.url, token, tmp_path / "state", identity, timeout=5, security=TransportSecurity(insecure=True))
        config_path = tmp_path / "agent.json"
        config_path.write_text(json.dumps({
            "state_dir": str(tmp_path / "state"), "host_root": str(root), "nats_url": nats_server.url, "insecure": True,
            "heartbeat_interval_s": 0.5, "keepalive_interval_s": 0.5, "ack_wait_s": 2, "shutdown_grace_s": 5,
            "uevent_debounce_s": DEBOUNCE_S,
        }))
        inbox = DriftInbox()
        await inbox.subscribe(plane.nc, record.node_id)
        stop = asyncio.Event()
        agent = asyncio.create_task(run_agent(load_config(config_path), stop))
        try:
            await _until(lambda: events.named("drift_baseline") or agent.done(), "the watcher's baseline")
            assert not agent.done()
            (started,) = events.named("uevent_monitor_started")
            # No udevd on this machine or CI: the kernel's own netlink group; udevd's when it answers.
            assert started["source"] == ("udev" if udevd_running() else "kernel")
            _gpu_removed(root, GPU0)
            await asyncio.to_thread(sh, "ip", "link", "add", a, "type", "veth", "peer", "name", b)
            reports = await _until(lambda: inbox.naming(DriftKind.gpu_vanished, GPU0), "the daemon's drift report")
            assert reports[0].node_id == record.node_id and reports[0].trigger == DriftTrigger.uevent
        finally:
            stop.set()
            assert await asyncio.wait_for(agent, 30) == 0
            await plane.close()

    for logger in (watch_log, source_log):
        logger.addHandler(events)
    old_levels = [(lg, lg.level) for lg in (watch_log, source_log)]
    for lg, _ in old_levels:
        lg.setLevel(logging.INFO)
    try:
        _run(body())
    finally:
        for lg, level in old_levels:
            lg.removeHandler(events)
            lg.setLevel(level)
        _del_link(a)
