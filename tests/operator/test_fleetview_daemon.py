"""A real daemon shows maintenance, the drain and quarantined components in its heartbeat, /metrics, status file
and `gpuaas-agent status`; the local `gpuaas-agent maintenance` CLI and the control plane's task share one state."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from tests.conftest import REPO
from tests.support.agent_process import NotifyListener, enrolled_setup, pulling_agent
from tests.support.deadline import run_bounded
from tests.support.nats_server import free_port
from tests.support.provision_inputs import topology_of


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", *argv], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


async def _log_has(path, text: str, timeout_s: float = 20.0) -> None:
    """Wait (bounded) until the daemon's log names ``text``: the event is written after the store commit."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while text not in path.read_text():
        assert asyncio.get_running_loop().time() < deadline, f"{text} never logged"
        await asyncio.sleep(0.05)  # polling a file for a condition, with a deadline


def test_maintenance_and_quarantine_show_in_heartbeat_metrics_and_status(nats_server, tmp_path, short_dir, agents):
    port = free_port()
    gpu = topology_of().candidate_slots[6].gpu_pci_address

    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path, metrics_listen=f"127.0.0.1:{port}")
        listener = NotifyListener(short_dir / "notify")
        try:
            await pulling_agent(config, listener, tmp_path / "agent.log", agents, node_id)
            beat = await plane.wait_for(lambda s: s.heartbeats[-1:])
            assert beat[0].maintenance is not None and beat[0].maintenance.maintenance is False

            # The person at the host: the CLI writes the same store the daemon reads.
            hostile = await asyncio.to_thread(_cli, "maintenance", "on", "--reason", "x\x1b[2J", "--config", str(config))
            assert hostile.returncode == 2 and "invalid_payload" in hostile.stderr, hostile.stderr
            local = await asyncio.to_thread(_cli, "maintenance", "on", "--reason", "PSU swap", "--config", str(config))
            assert local.returncode == 0 and "drained" in local.stdout, local.stdout + local.stderr
            # drained_at: the drain was recorded (beside a tick, once); the heartbeat then carries when.
            drained = await plane.wait_for(lambda s: [h for h in s.heartbeats
                                                      if h.maintenance and h.maintenance.drained_at is not None])
            assert drained[-1].maintenance.reason == "PSU swap" and drained[-1].maintenance.leased_slots == []
            metrics = await asyncio.to_thread(_scrape, port)
            assert "gpuaas_agent_maintenance 1.0" in metrics and "gpuaas_agent_drained 1.0" in metrics
            assert "gpuaas_agent_maintenance_since_timestamp_seconds" in metrics
            await _log_has(tmp_path / "agent.log", "host_drained")

            envelope = plane.envelope(node_id, TaskType.quarantine.value,
                                      {"component": {"kind": "gpu", "identity": gpu}, "reason": "XID 48 by hand"})
            await plane.enqueue(envelope)
            result = await plane.wait_result(envelope.task_id, timeout=30)
            assert result.status == ResultStatus.succeeded, result.error
            named = await plane.wait_for(lambda s: [h for h in s.heartbeats if h.quarantined])
            assert [(q.kind.value, q.identity, q.reason.value) for q in named[-1].quarantined] == \
                [("gpu", gpu, "operator")]
            metrics = await asyncio.to_thread(_scrape, port)
            assert "gpuaas_agent_quarantined_components 1.0" in metrics
            assert f'gpuaas_agent_quarantined{{identity="{gpu}",kind="gpu",reason="operator",slot=""}} 1.0' in metrics

            assert (tmp_path / "agent.log").read_text().count("host_drained") == 1, "the drain is reported once"
            status = await asyncio.to_thread(_cli, "status", "--json", "--no-checks", "--config", str(config))
            report = json.loads(status.stdout)
            assert report["maintenance"]["maintenance"] is True and report["maintenance"]["drained"] is True
            assert [q["identity"] for q in report["quarantined"]] == [gpu]
            assert any(r.startswith(f"quarantined: gpu {gpu}") for r in report["reasons"])
            assert status.returncode == 1  # a quarantined component wants an operator: degraded
            human = await asyncio.to_thread(_cli, "status", "--no-checks", "--config", str(config))
            assert "maint    ON for" in human.stdout and "PSU swap" in human.stdout and gpu in human.stdout

            off = await asyncio.to_thread(_cli, "maintenance", "off", "--reason", "PSU ok", "--config", str(config))
            assert off.returncode == 0, off.stderr
            await plane.wait_for(lambda s: [h for h in s.heartbeats[-1:] if h.maintenance and not h.maintenance.maintenance])
            metrics = await asyncio.to_thread(_scrape, port)
            assert "gpuaas_agent_maintenance 0.0" in metrics
            assert "gpuaas_agent_maintenance_since_timestamp_seconds" not in metrics
        finally:
            listener.close()
            await plane.close()

    run_bounded(body())
