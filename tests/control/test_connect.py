"""Connecting fails fast and stops cleanly: `enroll` and `run` as real processes against NATS that is down,
silent or refusing, and a real nats-server that dies or appears later.

Bounds, not speed claims: `enroll` must end inside the unit's start timeout (systemd's 90 s
default: the unit sets no TimeoutStartSec), `run` must honour SIGTERM within seconds
whether NATS is up, down, or gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.enrollment import NatsCredentials
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.connection import Backoff
from gpuaas_agent.control.enroll import EnrollmentRecord, record_path
from gpuaas_agent.control.taskpolicy import WorkerSettings
from tests.conftest import HOSTS, REPO
from tests.support.controlplane import ControlPlane
from tests.support.daemons import stop_pid
from tests.support.nats_server import NatsServer, free_port, nats_server_binary
from tests.support.tiers import starts

FIXTURE = HOSTS / "h200-slice-after-transition"
AGENT = REPO / ".venv" / "bin" / "gpuaas-agent"
UNIT = REPO / "systemd" / "gpuaas-agent.service"
SYSTEMD_DEFAULT_START_TIMEOUT_S = 90.0
SIGTERM_BOUND_S = 10.0  # "within seconds": what a person waiting on `systemctl stop` would accept
NODE = "node-conn01"


def unit_start_timeout_s() -> float:
    """TimeoutStartSec= of the shipped unit, or systemd's default when it sets none."""
    for line in UNIT.read_text().splitlines():
        if line.startswith(("TimeoutStartSec=", "TimeoutSec=")):
            value = line.split("=", 1)[1].strip()
            return float(value.removesuffix("s"))
    return SYSTEMD_DEFAULT_START_TIMEOUT_S


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _config(tmp_path: Path, nats_url: str, **overrides) -> Path:
    config = {"state_dir": str(tmp_path / "state"), "host_root": str(FIXTURE), "nats_url": nats_url,
              "token_file": str(tmp_path / "token"), "connect_timeout_s": 2.0, "uevent_watch": False, "insecure": True,
              "heartbeat_interval_s": 0.5, "keepalive_interval_s": 0.5, "ack_wait_s": 2, **overrides}
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(config))
    return path


def _enrolled_record(tmp_path: Path, server_url: str) -> None:
    """The record `enroll` would have written: this node logs in to ``server_url``."""
    record = EnrollmentRecord(node_id=NODE, enrolled_at=datetime.now(UTC),
                              credentials=NatsCredentials(user=NODE, password=secrets.token_urlsafe(16),
                                                          servers=[server_url]))
    path = record_path(tmp_path / "state")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, record.model_dump_json().encode(), mode=0o600)


class SilentListener:
    """A TCP listener that accepts and never says a word (no NATS INFO)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)  # the kernel completes handshakes into the backlog; nobody ever writes
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


# A real agent, but one that cannot connect: it fails fast or stops on SIGTERM within seconds (the bounds these
# tests assert), so these tests stay in the fast tier, unlike the `agent` marker's agents that serve tasks.
@starts()
class AgentRun:
    """`gpuaas-agent run` under Popen, stderr (JSON lines: no journald here) to a file."""

    def __init__(self, config: Path, log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen([str(AGENT), "run", "--config", str(config)], cwd=REPO, env=_env(),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"event": "not_json", "line": line})
        return out

    def wait_event(self, name: str, count: int = 1, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            seen = [e for e in self.events() if e.get("event") == name]
            if len(seen) >= count:
                return seen
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode} before {name}:\n{self.log_path.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} x{count} not logged within {timeout}s:\n{self.log_path.read_text()}")
            time.sleep(0.05)  # poll step of the deadline wait above

    def sigterm_and_time(self) -> tuple[int, float]:
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=SIGTERM_BOUND_S * 3)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - start

    def stop(self) -> None:
        stop_pid(self.proc, timeout_s=5, sig=signal.SIGKILL)


@pytest.fixture
def runs():
    started: list[AgentRun] = []
    yield started
    for run in started:
        run.stop()


@pytest.fixture
def nats_binary() -> str:
    return nats_server_binary("the connection tests need a real server")


# -- the backoff schedule --------------------------------------------------------------


def test_backoff_ceiling_doubles_from_initial_up_to_the_max():
    backoff = Backoff(initial_s=0.5, max_s=30.0)
    assert [backoff.ceiling(n) for n in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.ceiling(10_000) == 30.0  # no overflow on a server that stays down for weeks


def test_backoff_full_jitter_spreads_over_the_whole_window_and_never_exceeds_it():
    backoff = Backoff(initial_s=0.5, max_s=30.0)
    rng = random.Random(1234)
    for attempt in (0, 3, 20):
        delays = [backoff.delay(attempt, rng) for _ in range(2000)]
        ceiling = backoff.ceiling(attempt)
        assert all(0.0 <= d <= ceiling for d in delays)
        # Full jitter: the samples cover the window, not a narrow band around the ceiling.
        assert min(delays) < ceiling * 0.05 and max(delays) > ceiling * 0.95
        assert abs(sum(delays) / len(delays) - ceiling / 2) < ceiling * 0.05
    # Same seed, same schedule: the jitter is the RNG's, nothing else.
    assert [backoff.delay(n, random.Random(7)) for n in range(5)] == [backoff.delay(n, random.Random(7)) for n in range(5)]


# -- enroll fails fast, in one line ---------------------------------------------------


def _enroll_against(tmp_path: Path, nats_url: str) -> tuple[subprocess.CompletedProcess, float]:
    config = _config(tmp_path, nats_url)
    (tmp_path / "token").write_text(secrets.token_urlsafe(32))
    start = time.monotonic()
    done = subprocess.run([str(AGENT), "enroll", "--config", str(config)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=unit_start_timeout_s() * 2)
    return done, time.monotonic() - start


def _assert_one_clear_line(done: subprocess.CompletedProcess, code: str) -> str:
    assert done.returncode == 3, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[0].startswith(f"gpuaas-agent: enroll failed: {code}: "), lines[0]
    return lines[0]


def test_enroll_against_a_closed_port_exits_3_in_one_line(tmp_path):
    port = free_port()  # bound then closed: nothing listens there
    done, took = _enroll_against(tmp_path, f"nats://127.0.0.1:{port}")
    line = _assert_one_clear_line(done, "nats_unreachable")
    assert f"127.0.0.1:{port}" in line and "connection refused" in line
    assert took < unit_start_timeout_s()
    assert (tmp_path / "token").exists()  # nothing was spent


def test_enroll_against_a_silent_listener_exits_3_after_the_connect_timeout(tmp_path):
    silent = SilentListener()
    try:
        done, took = _enroll_against(tmp_path, f"nats://127.0.0.1:{silent.port}")
    finally:
        silent.close()
    line = _assert_one_clear_line(done, "nats_unreachable")
    assert "within 2s" in line  # connect_timeout_s of the config
    assert took < unit_start_timeout_s()


def test_enroll_against_a_server_refusing_credentials_exits_3_in_one_line(tmp_path, nats_binary):
    store = tmp_path / "nats-store"
    store.mkdir()
    server = NatsServer(nats_binary, store, tmp_path / "nats.log", extra_args=("--user", "admin", "--pass", "s3cret-pw"))
    server.start()
    try:
        done, took = _enroll_against(tmp_path, server.url)
    finally:
        server.stop()
    line = _assert_one_clear_line(done, "nats_auth_refused")
    assert "Authorization Violation" in line
    assert took < unit_start_timeout_s()


def _connections_ever(server: NatsServer) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/varz", timeout=5) as resp:
        return json.load(resp)["total_connections"]


def test_enroll_over_loopback_plaintext_without_insecure_is_refused_before_dialling(tmp_path, nats_server):
    config = _config(tmp_path, nats_server.url, insecure=False)
    (tmp_path / "token").write_text(secrets.token_urlsafe(32))
    before = _connections_ever(nats_server)  # the fixture's readiness probe counts as one
    done = subprocess.run([str(AGENT), "enroll", "--config", str(config)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    line = _assert_one_clear_line(done, "plaintext_refused")
    assert nats_server.url in line and "insecure = true" in line
    assert _connections_ever(nats_server) == before  # nothing was dialled, so no token could be sent
    assert (tmp_path / "token").exists() and not record_path(tmp_path / "state").exists()


def test_run_over_loopback_plaintext_without_insecure_exits_3_and_never_connects(tmp_path, nats_server):
    _enrolled_record(tmp_path, nats_server.url)
    config = _config(tmp_path, nats_server.url, insecure=False)
    before = _connections_ever(nats_server)
    done = subprocess.run([str(AGENT), "run", "--config", str(config)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "plaintext_refused" in done.stderr and "insecure = true" in done.stderr and "Traceback" not in done.stderr
    assert _connections_ever(nats_server) == before  # no consumer, no pull: no task could have run


def _creds_file(tmp_path: Path, *, mode: int, expired: bool = False) -> Path:
    from tests.natsauth.natsjwt import Operator

    times = {"issued_at": time.time() - 7200, "expires_at": time.time() - 60} if expired else {}
    text, _ = Operator().user(NODE, **times)
    creds = tmp_path / "node.creds"
    creds.write_text(text)
    creds.chmod(mode)
    return creds


def test_run_with_a_creds_file_readable_by_others_exits_3_naming_it_and_never_connects(tmp_path, nats_server):
    """Bad input of the control channel, end to end: the daemon refuses before it dials, so no task can run."""
    creds = _creds_file(tmp_path, mode=0o644)
    _enrolled_record(tmp_path, nats_server.url)
    config = _config(tmp_path, nats_server.url, nats_creds_file=str(creds))
    before = _connections_ever(nats_server)
    done = subprocess.run([str(AGENT), "run", "--config", str(config)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "creds_insecure" in done.stderr and str(creds) in done.stderr and "0644" in done.stderr
    assert "Traceback" not in done.stderr
    assert _connections_ever(nats_server) == before


def test_run_with_expired_creds_never_connects_and_retries_for_a_rotated_file(tmp_path, nats_server, runs):
    creds = _creds_file(tmp_path, mode=0o600, expired=True)
    _enrolled_record(tmp_path, nats_server.url)
    config = _config(tmp_path, nats_server.url, nats_creds_file=str(creds),
                     reconnect_backoff_initial_s=0.1, reconnect_backoff_max_s=0.5)
    before = _connections_ever(nats_server)
    run = AgentRun(config, tmp_path / "agent.log")
    runs.append(run)
    attempts = run.wait_event("nats_connect_failed", count=2)
    assert all(a["code"] == "creds_expired" and "expired at" in a["message"] for a in attempts)
    assert _connections_ever(nats_server) == before  # refused before dialling, every attempt
    rc, took = run.sigterm_and_time()
    assert rc == 0 and took < SIGTERM_BOUND_S, (rc, took)


# -- run: backoff while down, SIGTERM always honoured, connects when NATS appears ------


def test_run_with_nats_down_logs_attempts_and_exits_0_on_sigterm(tmp_path, runs):
    port = free_port()
    _enrolled_record(tmp_path, f"nats://127.0.0.1:{port}")
    config = _config(tmp_path, f"nats://127.0.0.1:{port}", reconnect_backoff_initial_s=0.1, reconnect_backoff_max_s=0.5)
    run = AgentRun(config, tmp_path / "agent.log")
    runs.append(run)
    attempts = run.wait_event("nats_connect_failed", count=3)
    assert [a["attempt"] for a in attempts[:3]] == [1, 2, 3]
    assert all(a["code"] == "nats_unreachable" and 0 <= a["retry_in_s"] <= 0.5 for a in attempts)
    assert "connection refused" in attempts[0]["message"]
    rc, took = run.sigterm_and_time()
    assert rc == 0 and took < SIGTERM_BOUND_S, (rc, took)
    events = run.events()
    assert all(e.get("event") != "not_json" for e in events), events  # no traceback, no stray prose
    assert events[-1]["event"] == "agent_stopped"


def test_run_mid_connect_to_a_silent_listener_exits_0_on_sigterm(tmp_path, runs):
    silent = SilentListener()
    try:
        _enrolled_record(tmp_path, f"nats://127.0.0.1:{silent.port}")
        # A connect attempt that would hang for 30 s: SIGTERM must not wait for it.
        config = _config(tmp_path, f"nats://127.0.0.1:{silent.port}", connect_timeout_s=30.0)
        run = AgentRun(config, tmp_path / "agent.log")
        runs.append(run)
        run.wait_event("agent_starting")
        rc, took = run.sigterm_and_time()
    finally:
        silent.close()
    assert rc == 0 and took < SIGTERM_BOUND_S, (rc, took)


def test_run_after_nats_was_killed_exits_0_on_sigterm_promptly(nats_server, tmp_path, runs):
    async def prepare():
        plane = await ControlPlane.connect(nats_server.url)
        try:
            await plane.create_streams()
            await plane.create_node_consumer(NODE, WorkerSettings(ack_wait_s=2))  # as _config's agent expects
        finally:
            await plane.close()

    asyncio.run(prepare())
    _enrolled_record(tmp_path, nats_server.url)
    config = _config(tmp_path, nats_server.url, reconnect_backoff_initial_s=0.2, reconnect_backoff_max_s=1.0)
    run = AgentRun(config, tmp_path / "agent.log")
    runs.append(run)
    run.wait_event("agent_ready")
    nats_server.kill()
    run.wait_event("nats_disconnected")
    run.wait_event("nats_reconnect_attempt", count=2)
    rc, took = run.sigterm_and_time()
    assert rc == 0 and took < SIGTERM_BOUND_S, (rc, took)
    assert all(e.get("event") != "not_json" for e in run.events())


def test_run_started_while_nats_is_down_connects_when_it_appears_and_claims_a_task(tmp_path, runs, nats_binary):
    store = tmp_path / "nats-store"
    store.mkdir()
    server = NatsServer(nats_binary, store, tmp_path / "nats.log")  # port chosen, not started yet
    _enrolled_record(tmp_path, server.url)
    config = _config(tmp_path, server.url, reconnect_backoff_initial_s=0.2, reconnect_backoff_max_s=1.0)
    run = AgentRun(config, tmp_path / "agent.log")
    runs.append(run)
    run.wait_event("nats_connect_failed", count=2)

    async def body():
        server.start()
        plane = await ControlPlane.connect(server.url)
        try:
            await plane.create_streams()
            await plane.create_node_consumer(NODE, WorkerSettings(ack_wait_s=2))  # as _config's agent expects
            envelope = plane.envelope(NODE, TaskType.topology_discover.value)
            await plane.enqueue(envelope)
            return await plane.wait_result(envelope.task_id, timeout=60)
        finally:
            await plane.close()

    try:
        result = asyncio.run(asyncio.wait_for(body(), 90))
        assert result.status == ResultStatus.succeeded
        assert run.wait_event("nats_connected")[0]["attempts"] >= 3
        rc, took = run.sigterm_and_time()
        assert rc == 0 and took < SIGTERM_BOUND_S, (rc, took)
    finally:
        server.stop()
