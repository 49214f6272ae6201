"""The daemon as a real process: sd_notify over a socket we bind, heartbeats, SIGTERM grace, kill -9 recovery.

Run as ``python -m tests.control.test_daemon --config F --gate SOCK`` this module is
also the agent under test with one extra handler: ``slice.preflight`` connects to
the test's gate socket and waits there until the test releases it, so a test can
hold a task mid-run without sleeping.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuaas_agent.config import SliceConfig, load_config
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.daemon import (
    SLICE_HEALTH_PROBES,
    SdNotifier,
    default_tasks,
    run_agent,
    slice_health_probes,
    watchdog_interval_s,
)
from gpuaas_agent.host.devices.fabricmanager import FabricManager
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.run import run
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.logs import JsonLinesFormatter, configure_logging
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.registry import BuiltTasks
from tests.support.agent_process import (
    FIXTURE,
    AgentProcess,
    NotifyListener,
    agent_env,
    enrolled_setup,
)
from tests.support.controlplane import ControlPlane
from tests.support.daemon_hosts import ReadOnlyHost
from tests.support.deadline import run_bounded

# -- the gated agent (child process side) --------------------------------------------


def _gated_handler(gate: str):
    async def handle(payload, ctx) -> dict:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(gate), 10)
        try:
            writer.write(ctx.envelope.task_id.encode() + b"\n")
            await asyncio.wait_for(writer.drain(), 10)
            await asyncio.wait_for(reader.readline(), 300)  # the test's release
        finally:
            writer.close()
        return {"gated": True, "resumed_steps": ctx.resumed_steps}

    return handle


def _gated_agent_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--gate", required=True)
    args = parser.parse_args(argv)
    configure_logging()
    config = load_config(args.config)
    built = default_tasks(config)
    tasks = BuiltTasks(handlers={**built.handlers, TaskType.preflight: _gated_handler(args.gate)},
                       recoveries=built.recoveries)

    async def main() -> int:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        return await run_agent(config, stop, host=ReadOnlyHost(), tasks=tasks)

    return asyncio.run(main())


if __name__ == "__main__":
    sys.exit(_gated_agent_main())


# -- test side -----------------------------------------------------------------------


class Gate:
    """Unix socket the gated handler connects to; :meth:`release` lets every held task go."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arrivals: list[str] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._changed = asyncio.Condition()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._on_connect, str(self.path))

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task_id = (await asyncio.wait_for(reader.readline(), 10)).decode().strip()
        async with self._changed:
            self.arrivals.append(task_id)
            self._writers.append(writer)
            self._changed.notify_all()

    async def wait_arrivals(self, count: int, timeout: float = 30.0) -> None:
        async def waiter():
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.arrivals) >= count)

        await asyncio.wait_for(waiter(), timeout)

    async def release(self) -> None:
        for writer in self._writers:
            if writer.is_closing():
                continue
            try:
                writer.write(b"go\n")
                await asyncio.wait_for(writer.drain(), 5)
            except ConnectionError:  # the agent holding it was killed
                writer.close()

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._server.close()
        await asyncio.wait_for(self._server.wait_closed(), 5)


# -- unit-sized ----------------------------------------------------------------------


def test_sd_notifier_sends_one_datagram_per_call(short_dir, monkeypatch):
    listener = NotifyListener(short_dir / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", str(listener.path))
    notifier = SdNotifier()
    try:
        assert notifier.notify(READY=1, STATUS="pulling tasks") is True
        assert listener.sock.recv(4096) == b"READY=1\nSTATUS=pulling tasks"
    finally:
        notifier.close()
        listener.close()


def test_sd_notifier_reaches_abstract_socket(monkeypatch):
    name = f"gpuaas-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    notifier = SdNotifier()
    try:
        assert notifier.notify(WATCHDOG=1)
        sock.settimeout(5)
        assert sock.recv(4096) == b"WATCHDOG=1"
    finally:
        notifier.close()
        sock.close()


def test_sd_notifier_without_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert SdNotifier().notify(READY=1) is False


def test_the_slice_hosts_health_probes_are_the_rows_whose_needs_the_host_has(tmp_path):
    """The health round's slice-host checks come from one table (no block appends one): the Fabric Manager row
    is built only where the drivers have Fabric Manager."""
    assert [spec.name for spec in SLICE_HEALTH_PROBES] == ["port_isolation", "fabric_partitions"]
    drivers = SliceDrivers(host_root=tmp_path, slice=SliceConfig(), images=ImageCache(tmp_path / "cache"),
                           libvirt=LibvirtLifecycle("test:///default"))
    plain = StateStore.open(tmp_path / "state.db")
    store = as_store_thread(plain)
    try:
        assert [probe.__name__ for probe in slice_health_probes(drivers, store)] == ["port_isolation"]
        with_fm = dataclasses.replace(drivers, fabric=FabricManager())
        assert [probe.__name__ for probe in slice_health_probes(with_fm, store)] == ["port_isolation",
                                                                                    "fabric_partitions"]
    finally:
        plain.close()


def test_watchdog_interval_is_half_of_watchdog_usec():
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({}) is None


def test_log_lines_are_json_objects():
    import logging

    record = logging.LogRecord("gpuaas_agent.x", logging.INFO, __file__, 1, '{"event": "clone_progress", "percent": 42}', None, None)
    line = json.loads(JsonLinesFormatter().format(record))
    assert line["event"] == "clone_progress" and line["percent"] == 42 and line["level"] == "info"
    plain = logging.LogRecord("nats", logging.WARNING, __file__, 1, "prose %s", ("here",), None)
    assert json.loads(JsonLinesFormatter().format(plain))["msg"] == "prose here"


# -- the daemon process --------------------------------------------------------------


def test_not_enrolled_daemon_exits_3_with_code(tmp_path):
    """Not enrolled is the host's surroundings (exit 3, environment), not a failed job."""
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"state_dir": str(tmp_path / "state"), "host_root": str(FIXTURE)}))

    async def body():
        return await run([sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)],
                         timeout=60, check=False)

    done = run_bounded(body())
    assert done.returncode == 3
    events = [json.loads(line) for line in done.stderr.decode().splitlines()]
    assert any(e.get("event") == "agent_failed" and e.get("code") == "not_enrolled" for e in events)


def test_enroll_command_enrolls_from_host_identity(nats_server, tmp_path):
    config = tmp_path / "agent.json"
    token = tmp_path / "token"
    config.write_text(json.dumps({"state_dir": str(tmp_path / "state"), "host_root": str(FIXTURE),
                                  "nats_url": nats_server.url, "token_file": str(token), "insecure": True}))

    async def body():
        plane = await ControlPlane.connect(nats_server.url)
        try:
            await plane.serve_enrollment()
            token.write_text(plane.issue_token())
            argv = [sys.executable, "-m", "gpuaas_agent", "enroll", "--config", str(config)]
            first = await run(argv, timeout=60, check=False)
            token.write_text("some-reused-token-value-0000")
            again = await run(argv, timeout=60, check=False)
            return first, again, plane.enroll_requests
        finally:
            await plane.close()

    first, again, requests = run_bounded(body())
    assert first.returncode == 0, first.stderr.decode()
    assert first.stdout.decode().startswith("enrolled node_id=node-")
    assert again.returncode == 0 and len(requests) == 1  # already enrolled: nothing sent
    assert requests[0].machine_id == "1221a371a78ea21b24acbc2cf895b074" and requests[0].hostname == "j22u05"


def test_daemon_notifies_heartbeats_runs_tasks_and_exits_0_on_sigterm(nats_server, tmp_path, short_dir, agents):
    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path)
        listener = NotifyListener(short_dir / "notify")
        try:
            agent = AgentProcess([sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)],
                                 agent_env(listener.path, watchdog_usec=1_000_000), tmp_path / "agent.log")
            agents.append(agent.start())
            # READY as soon as config and state are loaded; STATUS says what it waits for, then that it pulls.
            assert "waiting for NATS (attempt 1)" in (await listener.wait_for("READY", "1"))["STATUS"]
            await listener.wait_for("WATCHDOG", "1")
            await listener.wait_for("STATUS", f"node {node_id}: pulling tasks")
            beats = await plane.wait_for(lambda s: [h for h in s.heartbeats if h.health_state == "healthy"])
            assert beats[0].node_id == node_id and beats[0].agent_version == "0.1.0"

            envelope = plane.envelope(node_id, TaskType.topology_discover.value)
            await plane.enqueue(envelope)
            result = await plane.wait_result(envelope.task_id, timeout=30)
            assert result.status == ResultStatus.succeeded
            assert result.output["summary"]["candidate_slots"] == 8

            agent.signal(signal.SIGTERM)
            assert await agent.wait() == 0
            await listener.wait_for("STOPPING", "1")
            events = [e.get("event") for e in agent.log_events()]  # every stderr line is a JSON object
            assert "agent_ready" in events and events[-1] == "agent_stopped"
        finally:
            listener.close()
            await plane.close()

    run_bounded(body())


def test_sigterm_lets_a_running_task_finish(nats_server, tmp_path, short_dir, agents):
    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path)
        listener = NotifyListener(short_dir / "notify")
        gate = Gate(short_dir / "gate")
        await gate.start()
        try:
            agent = AgentProcess([sys.executable, "-m", "tests.control.test_daemon", "--config", str(config),
                                  "--gate", str(gate.path)], agent_env(listener.path), tmp_path / "agent.log")
            agents.append(agent.start())
            await listener.wait_for("READY", "1")
            envelope = plane.envelope(node_id, TaskType.preflight.value)
            await plane.enqueue(envelope)
            await gate.wait_arrivals(1)
            await plane.wait_for(lambda s: [h for h in s.heartbeats if h.running_tasks == [envelope.task_id]])

            agent.signal(signal.SIGTERM)
            await listener.wait_for("STOPPING", "1")
            assert agent.proc.poll() is None  # still finishing the task
            await gate.release()
            result = await plane.wait_result(envelope.task_id, timeout=30)
            assert result.status == ResultStatus.succeeded and result.output["gated"] is True
            assert await agent.wait() == 0
            assert await plane.pending_tasks() == 0  # acked before exit
        finally:
            await gate.close()
            listener.close()
            await plane.close()

    run_bounded(body())


def test_kill_9_mid_task_is_journaled_and_completes_once_after_restart(nats_server, tmp_path, short_dir, agents):
    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path)
        gate = Gate(short_dir / "gate")
        await gate.start()
        argv = [sys.executable, "-m", "tests.control.test_daemon", "--config", str(config), "--gate", str(gate.path)]
        try:
            first = AgentProcess(argv, agent_env(), tmp_path / "agent-1.log")
            agents.append(first.start())
            envelope = plane.envelope(node_id, TaskType.preflight.value)
            await plane.enqueue(envelope)
            await gate.wait_arrivals(1)

            first.signal(signal.SIGKILL)
            assert await first.wait() == -signal.SIGKILL
            store = StateStore.open(tmp_path / "state" / "state.db")
            try:
                assert store.unfinished_steps(envelope.task_id) == ["task"]
                assert store.result_of(envelope.task_id) is None
            finally:
                store.close()

            second = AgentProcess(argv, agent_env(), tmp_path / "agent-2.log")
            agents.append(second.start())
            await gate.wait_arrivals(2)  # redelivered once ack_wait (2 s) ran out
            await gate.release()
            result = await plane.wait_result(envelope.task_id, timeout=30)
            assert result.status == ResultStatus.succeeded
            assert result.output["resumed_steps"] == ["task"]
            second.signal(signal.SIGTERM)
            assert await second.wait() == 0

            assert gate.arrivals == [envelope.task_id, envelope.task_id]
            assert [r.task_id for r in await plane.stored_results(node_id)] == [envelope.task_id]
            assert [r.task_id for r in plane.seen.results] == [envelope.task_id]
            assert await plane.pending_tasks() == 0
            store = StateStore.open(tmp_path / "state" / "state.db")
            try:
                assert [e.status.value for e in store.journal_of(envelope.task_id)] == ["started", "started", "succeeded"]
                assert store.unfinished_steps(envelope.task_id) == []
            finally:
                store.close()
        finally:
            await gate.close()
            await plane.close()

    run_bounded(body())


def test_run_agent_in_process_reconciles_on_its_timer_and_stops_cleanly(nats_server, tmp_path, short_dir, monkeypatch):
    calls: list[int] = []

    async def body():
        plane, node_id, config_path = await enrolled_setup(nats_server, tmp_path, reconcile_interval_s=0.1)
        listener = NotifyListener(short_dir / "notify")
        monkeypatch.setenv("NOTIFY_SOCKET", str(listener.path))
        stop = asyncio.Event()
        reconciled = asyncio.Event()

        async def reconcile() -> dict:
            calls.append(1)
            if len(calls) >= 2:
                reconciled.set()
            return {"drift": []}

        try:
            agent = asyncio.create_task(run_agent(load_config(config_path), stop, reconcile=reconcile,
                                                  notifier=SdNotifier()))
            await listener.wait_for("READY", "1")
            await asyncio.wait_for(reconciled.wait(), 10)
            stop.set()
            assert await asyncio.wait_for(agent, 30) == 0
        finally:
            listener.close()
            await plane.close()

    run_bounded(body())
    assert len(calls) >= 2


def test_enroll_without_a_token_says_why_through_status(short_dir, tmp_path):
    """ExecStartPre=gpuaas-agent enroll: a missing token must reach `systemctl status`, not only the journal."""
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"state_dir": str(tmp_path / "state"), "host_root": str(FIXTURE),
                                  "nats_url": "nats://127.0.0.1:1", "token_file": str(tmp_path / "absent"), "insecure": True}))
    listener = NotifyListener(short_dir / "notify")
    try:
        done = subprocess.run([sys.executable, "-m", "gpuaas_agent", "enroll", "--config", str(config)],
                              env=agent_env(listener.path), capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "token_missing" in done.stderr
        message = run_bounded(listener.wait_for("STATUS"))
        assert message["STATUS"].startswith("enroll failed: token_missing:")
    finally:
        listener.close()


class _FailingBootHost(ReadOnlyHost):
    """A host whose boot recovery fails after the daemon's loops (and the host's own) have started."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order
        self.loop_started = asyncio.Event()

    def loops(self, config, store):
        async def console_logs() -> None:
            self.loop_started.set()
            try:
                await asyncio.Event().wait()  # runs until cancelled
            except asyncio.CancelledError:
                self.order.append("host loop cancelled")
                raise

        return [("console-logs", console_logs())]

    async def boot_recovery(self, store):
        await self.loop_started.wait()
        raise RuntimeError("boot recovery exploded")

    async def aclose(self) -> None:
        self.order.append("host closed")
        await super().aclose()


def test_a_part_failing_to_start_closes_everything_started_before_it_in_reverse_order(nats_server, tmp_path):
    """The daemon's exit stack owns each loop and resource it started: a later part that fails to start
    (here boot recovery) still has every loop cancelled, then the host closed, then the store."""
    order: list[str] = []

    async def body():
        plane, node_id, config_path = await enrolled_setup(nats_server, tmp_path)
        config = load_config(config_path)
        host = _FailingBootHost(order)
        before = asyncio.all_tasks()
        try:
            with pytest.raises(RuntimeError, match="boot recovery exploded"):
                await run_agent(config, asyncio.Event(), host=host, notifier=SdNotifier())
        finally:
            await plane.close()
        left = [t.get_name() for t in asyncio.all_tasks() - before if not t.done()]
        assert left == [], f"tasks outlived the daemon: {left}"
        # The store thread was closed: the database opens and takes a write at once.
        store = StateStore.open(config.state_db)
        try:
            store.set_meta("probe", "1")
        finally:
            store.close()

    run_bounded(body(), 60)
    assert order == ["host loop cancelled", "host closed"]
