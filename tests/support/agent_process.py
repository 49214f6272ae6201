"""The agent as a real process under test: enrolled config, environment, notify socket, processes stopped by PID.

``enrolled_setup`` enrolls against a real control plane and writes the agent's config;
``AgentProcess`` runs it under ``Popen`` and the ``agents`` fixture (a pytest plugin, see
tests/conftest.py) kills whatever a test started; ``NotifyListener`` stands in for systemd's
notify socket. Used by the daemon tests of tests/control and tests/operator.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpuaas_agent.config import load_config
from gpuaas_agent.control.enroll import EnrollIdentity, enroll
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.daemon import worker_settings
from tests.conftest import REPO, fixture_host
from tests.support.controlplane import ControlPlane
from tests.support.tiers import starts

FIXTURE = fixture_host("h200-slice-after-transition")
IDENTITY = EnrollIdentity(machine_id="1221a371a78ea21b24acbc2cf895b074", hostname="j22u05", agent_version="0.1.0")


class NotifyListener:
    """A bound AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[dict[str, str]] = []

    async def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for message in self.messages:
                if key in message and (value is None or message[key] == value):
                    return message
            raw = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), max(0.01, deadline - loop.time()))
            self.messages.append(dict(line.split("=", 1) for line in raw.decode().splitlines()))

    def close(self) -> None:
        self.sock.close()


@starts("agent")
class AgentProcess:
    """One agent process under ``Popen``; stopped by PID."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=log)
        return self

    async def wait(self, timeout: float = 30.0) -> int:
        return await asyncio.to_thread(self.proc.wait, timeout)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_events(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]


@pytest.fixture
def short_dir():
    """AF_UNIX paths must fit in 108 bytes: pytest's tmp_path does not always."""
    with tempfile.TemporaryDirectory(prefix="gpuaas-") as path:
        yield Path(path)


@pytest.fixture
@starts("agent")
def agents():
    """The agent processes a test starts (append them); each is killed by PID afterwards."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


@starts("agent")
async def pulling_agent(config: Path, listener: NotifyListener, log_path: Path, agents: list[AgentProcess],
                        node_id: str) -> AgentProcess:
    """``gpuaas_agent run --config config`` started (appended to ``agents``, which kills it after the test), once it
    tells ``listener`` that it pulls tasks."""
    agent = AgentProcess([sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)],
                         agent_env(listener.path), log_path)
    agents.append(agent.start())
    await listener.wait_for("STATUS", f"node {node_id}: pulling tasks")
    return agent


async def enrolled_setup(nats_server, tmp_path, **overrides):
    """A control plane with streams and enrollment served; this host enrolled; the agent's config written.

    Returns (plane, node id, config path); ``overrides`` are config keys.
    """
    plane = await ControlPlane.connect(nats_server.url)
    await plane.create_streams()
    await plane.serve_enrollment()
    token = tmp_path / "token"
    token.write_text(plane.issue_token())
    config = {
        "state_dir": str(tmp_path / "state"), "host_root": str(FIXTURE), "nats_url": nats_server.url, "insecure": True,
        "heartbeat_interval_s": 0.5, "keepalive_interval_s": 0.5, "ack_wait_s": 2, "shutdown_grace_s": 30,
        "health_interval_s": 0.5, "metrics_listen": "", "slice": {"libvirt_uri": "test:///default"},
        **overrides,
    }
    config_path = tmp_path / "agent.json"
    config_path.write_text(json.dumps(config))
    # The consumer the plane creates at enrollment is the one an agent with this config expects (ack_wait...).
    plane.consumer_settings = worker_settings(load_config(config_path))
    record = await enroll(nats_server.url, token, tmp_path / "state", IDENTITY, timeout=5,
                          security=TransportSecurity(insecure=True))
    return plane, record.node_id, config_path


def agent_env(notify: Path | None = None, watchdog_usec: int | None = None) -> dict[str, str]:
    """This process's environment without systemd's variables, plus the notify socket and watchdog given."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    if notify is not None:
        env["NOTIFY_SOCKET"] = str(notify)
    if watchdog_usec is not None:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    return env
