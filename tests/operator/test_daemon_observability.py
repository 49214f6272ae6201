"""A real daemon against a real nats-server: /metrics moves with a task, the status command reads it,
READY comes while NATS is down, and the heartbeat turns degraded when the NAT rule is deleted; and a health
round's checks are in /metrics before a heartbeat can carry them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from tests.conftest import REPO
from tests.support.agent_process import AgentProcess, NotifyListener, agent_env, enrolled_setup, pulling_agent
from tests.support.deadline import run_bounded, wait_until
from tests.support.dnsmasq_fixture import sh
from tests.support.nats_server import free_port


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _status(config, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", "status", "--config", str(config), *extra],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_metrics_move_when_a_task_runs_and_status_reads_the_running_daemon(nats_server, tmp_path, short_dir, agents):
    port = free_port()

    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path, metrics_listen=f"127.0.0.1:{port}",
                                                       metrics_textfile=str(tmp_path / "agent.prom"))
        listener = NotifyListener(short_dir / "notify")
        try:
            await pulling_agent(config, listener, tmp_path / "agent.log", agents, node_id)
            before = await asyncio.to_thread(_scrape, port)
            key = 'gpuaas_agent_tasks_total{status="succeeded",type="slice.topology_discover"}'
            assert before.get(key, 0) == 0 and before["gpuaas_agent_nats_connected"] == 1

            envelope = plane.envelope(node_id, TaskType.topology_discover.value)
            await plane.enqueue(envelope)
            result = await plane.wait_result(envelope.task_id, timeout=30)
            assert result.status == ResultStatus.succeeded
            after = await asyncio.to_thread(_scrape, port)
            assert after[key] == 1
            assert after['gpuaas_agent_task_duration_seconds_count{type="slice.topology_discover"}'] == 1
            # health checks ran on the fixture host: the network of the recording is healthy. Waited for by the
            # check itself: a round whose network read missed its deadline reports it unavailable, which is
            # healthy too (seen after a long test session), and the next round reads it.
            await plane.wait_for(lambda s: [h for h in s.heartbeats if h.health_state == "healthy" and any(
                c.name == "slice_nat" and c.status == "ok" for c in h.health)])
            after = await asyncio.to_thread(_scrape, port)
            assert after['gpuaas_agent_health_check{check="slice_nat",status="ok"}'] == 1
            # the textfile is written at the end of each tick: a later one has the task's sample
            textfile = tmp_path / "agent.prom"
            await wait_until(lambda: textfile.exists() and f"{key} 1.0" in textfile.read_text(), timeout=30,
                             what="the task's sample in the textfile")

            done = await asyncio.to_thread(_status, config, "--json", "--no-checks")
            report = json.loads(done.stdout)
            assert report["node_id"] == node_id and report["daemon_running"] is True, done.stdout + done.stderr
            assert report["nats_state"] == "connected" and report["last_heartbeat_at"]
            # What it holds, counted by the daemon itself: once a status is written after the task ended,
            # nothing is left registered.
            def held_now() -> dict:
                return json.loads(_status(config, "--json", "--no-checks").stdout)["daemon"]["registered"]

            deadline = asyncio.get_running_loop().time() + 60
            while (held := await asyncio.to_thread(held_now))["tasks"] and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)  # the next heartbeat's status file
            assert (held["tasks"], held["terminal_sessions"], held["terminal_opening"], held["power_tasks"]) == (
                0, 0, 0, 0), held
            assert held["subscriptions"] >= 1 and held["rss_bytes"] > 0, held
            human = await asyncio.to_thread(_status, config, "--no-checks")
            assert human.stdout.startswith("host     HEALTHY") and human.returncode == 0, human.stdout
        finally:
            listener.close()
            await plane.close()

    run_bounded(body())


def test_metrics_port_in_use_is_one_log_line_and_the_daemon_runs_on(nats_server, tmp_path, short_dir, agents):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]

    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path, metrics_listen=f"127.0.0.1:{port}")
        listener = NotifyListener(short_dir / "notify")
        try:
            agent = await pulling_agent(config, listener, tmp_path / "agent.log", agents, node_id)
            failed = [e for e in agent.log_events() if e.get("event") == "metrics_listen_failed"]
            assert len(failed) == 1 and str(port) in failed[0]["msg"]
        finally:
            listener.close()
            await plane.close()

    try:
        run_bounded(body())
    finally:
        taken.close()


def test_nats_down_at_boot_is_ready_waiting_with_watchdog_then_pulls_when_it_comes(nats_server, tmp_path, short_dir,
                                                                                  agents):
    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path, reconnect_backoff_max_s=0.5)
        await plane.close()
        nats_server.stop()
        listener = NotifyListener(short_dir / "notify")
        try:
            agent = AgentProcess([sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)],
                                 agent_env(listener.path, watchdog_usec=1_000_000), tmp_path / "agent.log")
            agents.append(agent.start())
            ready = await listener.wait_for("READY", "1")
            assert "waiting for NATS (attempt 1)" in ready["STATUS"]
            await listener.wait_for("STATUS", f"node {node_id}: waiting for NATS (attempt 3)")
            pets = sum(1 for m in listener.messages if m.get("WATCHDOG") == "1")
            await listener.wait_for("STATUS", f"node {node_id}: waiting for NATS (attempt 4)")
            assert sum(1 for m in listener.messages if m.get("WATCHDOG") == "1") >= pets  # still petting
            await listener.wait_for("WATCHDOG", "1")
            down = await asyncio.to_thread(_status, config, "--json", "--no-checks")
            assert json.loads(down.stdout)["nats_state"] == "waiting" and down.returncode == 1
            await asyncio.to_thread(nats_server.start)
            await listener.wait_for("STATUS", f"node {node_id}: pulling tasks", timeout=30)
        finally:
            listener.close()

    run_bounded(body())


def test_heartbeat_turns_degraded_naming_the_nat_check_when_the_rule_is_deleted(nats_server, dhcp_lab, tmp_path,
                                                                                short_dir, agents):
    ns = dhcp_lab.server
    rule = dhcp_lab.masquerade()

    async def body():
        plane, node_id, config = await enrolled_setup(
            nats_server, tmp_path, host_root="/", health_netns=ns, uevent_watch=False,
            slice=dhcp_lab.agent_slice())
        listener = NotifyListener(short_dir / "notify")
        try:
            agent = AgentProcess([sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)],
                                 agent_env(listener.path), tmp_path / "agent.log")
            agents.append(agent.start())
            healthy = await plane.wait_for(lambda s: [h for h in s.heartbeats if h.health], timeout=30)
            checks = {c.name: c.status for c in healthy[-1].health}
            assert healthy[-1].health_state == "healthy", healthy[-1].health_reason
            assert checks["slice_nat"] == "ok" and checks["slice_gateway"] == "ok" and checks["dnsmasq"] == "ok", \
                healthy[-1].health
            assert checks["slice_ip_forward"] == "ok" and checks["libvirtd"] == "ok"
            # Bad input: this host has no NVIDIA driver and no NVMe controller; the daemon runs on, healthy,
            # and says what it cannot see.
            assert checks["gpu_nvml"] == "unavailable" and checks["nvme_smart"] == "unavailable", healthy[-1].health
            assert {c.name: c.detail for c in healthy[-1].health}["gpu_nvml"].startswith("nvmlInit failed")

            await asyncio.to_thread(sh, "ip", "netns", "exec", ns, "iptables", "-t", "nat", "-D", *rule)
            degraded = await plane.wait_for(
                lambda s: [h for h in s.heartbeats if h.health_state == "degraded"
                           and any(c.name == "slice_nat" and c.status == "degraded" for c in h.health)], timeout=20)
            assert "slice_nat" in degraded[-1].health_reason
        finally:
            listener.close()
            await plane.close()

    run_bounded(body())


def test_a_rounds_checks_are_in_the_metrics_before_anything_can_publish_them(tmp_path, host_copy, monkeypatch):
    """A heartbeat carries ``reporter.checks``; a scrape right after it must find the same checks.

    The round's quarantine pass awaits (the store thread) after the checks are set: with the gauges written
    only after it, a tick in between published checks that /metrics did not have yet (a CI failure).
    """
    from gpuaas_agent.operator import reporter as reporter_module
    from gpuaas_agent.operator.health import CheckThreads, HealthSettings
    from gpuaas_agent.operator.metrics import AgentMetrics
    from gpuaas_agent.state.aio import as_store_thread
    from gpuaas_agent.state.store import StateStore

    root = host_copy("h200-slice-after-transition")
    metrics = AgentMetrics()
    real_pass, seen = reporter_module.quarantine_failing_devices, []

    async def observed_pass(*args, **kwargs):
        seen.append(metrics.render().decode())  # what a scrape during the await would read
        return await real_pass(*args, **kwargs)

    monkeypatch.setattr(reporter_module, "quarantine_failing_devices", observed_pass)
    store = StateStore.open(tmp_path / "state.db")
    try:
        reporter = reporter_module.Reporter(
            reporter_module.ReporterSettings(node_id="node-1", state_dir=tmp_path, heartbeat_interval_s=5,
                                             health_interval_s=60, request_timeout_s=5),
            as_store_thread(store), HealthSettings(host_root=root, libvirt_uri="test:///default"), metrics,
            lambda **_: True, threads=CheckThreads())
        asyncio.run(reporter.check_health())
        [during] = seen
        assert reporter.checks, "the round produced no checks"
        missing = [(c.name, c.status) for c in reporter.checks
                   if f'gpuaas_agent_health_check{{check="{c.name}",status="{c.status}"}} 1.0' not in during]
        assert missing == [], "checks set but not yet in /metrics"
    finally:
        store.close()
