"""The slice network watch (operator/netwatch.py): netlink wakes it, a break reaches the heartbeat and the
drift subject within seconds (not one health period later), and a repair is reported as restored."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.drift import DriftKind, DriftReport
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.discovery.netevidence import TMFIFO
from gpuaas_agent.operator.health import CheckThreads, HealthSettings
from gpuaas_agent.operator.netwatch import ROUTE_GROUPS, NetWatch, drift_findings, open_netlink_sockets
from tests.support.agent_process import AgentProcess, NotifyListener, agent_env, enrolled_setup
from tests.support.deadline import run_bounded
from tests.support.dnsmasq_fixture import sh
from tests.support.netns_thread import run_in_netns, until
from tests.support.realdev import require_root
from tests.support.slice_netns import MASQ, ns_exec, run_argv, set_ip_forward, slice_namespace


def _readable_within(sockets, seconds: float) -> list:
    ready, _, _ = select.select(sockets, [], [], seconds)
    for sock in ready:
        while True:
            try:
                sock.recv(1 << 16)
            except BlockingIOError:
                break
    return ready


def test_a_link_and_an_nftables_change_each_wake_the_watch_sockets():
    sockets = open_netlink_sockets()
    route, netfilter = sockets
    name = f"gnw{uuid.uuid4().hex[:8]}"
    table = f"gpuaas_netwatch_test_{uuid.uuid4().hex[:8]}"
    try:
        _readable_within(sockets, 0)  # whatever other tests did before this one
        sh("ip", "link", "add", name, "type", "veth", "peer", "name", name + "p")
        assert route in _readable_within([route], 10), "no rtnetlink message for a new link"
        sh("nft", "add", "table", "inet", table)
        assert netfilter in _readable_within([netfilter], 10), "no NFNLGRP_NFTABLES message for a new table"
    finally:
        sh("ip", "link", "del", name, check=False)
        sh("nft", "delete", "table", "inet", table, check=False)
        for sock in sockets:
            sock.close()


WATCH_DEADLINE_S = 30.0


def test_over_a_live_network_only_the_bridge_addresses_ip_forward_and_the_nat_table_wake_a_round():
    """The network checks read this namespace: an address on the bridge, net.ipv4.ip_forward and the table that
    proved the MASQUERADE rule wake the watch; an address, a per-link forwarding switch and an nftables table of
    other work do not. Each "no round" is asserted after a control event that does wake one, read later from the
    same socket (a round the unrelated event had woken would have run first or name it in ``woken_by``)."""
    require_root()
    with slice_namespace() as ns:
        run_argv("ip", "-n", ns, "link", "add", "other0", "type", "bridge")

        async def body():
            watch = NetWatch(HealthSettings(host_root=Path("/"), dnsmasq_pid_file=None), SimpleNamespace(checks=None),
                             interval_s=3600.0, debounce_s=0.05, min_gap_s=0.1, threads=CheckThreads())
            task = asyncio.create_task(watch.run())
            seen: list[tuple[int, list[str]]] = []

            async def round_after(*steps) -> None:
                before = watch.rounds
                for step in steps:
                    await asyncio.to_thread(step)
                await until(lambda: watch.rounds > before, "a round after the watched change", WATCH_DEADLINE_S)
                seen.append((watch.rounds - before, sorted(set(watch.woken_by))))

            try:
                await until(lambda: watch.rounds >= 1, "the first round", WATCH_DEADLINE_S)
                interest = watch.filter.interest
                assert watch.nat is not None and watch.nat.status == "ok", watch.nat
                assert interest.links == interest.addresses_of == frozenset({"ovsbr0", TMFIFO}), interest
                assert interest.nft_tables == frozenset({"nat"}) and interest.ip_forward, interest  # iptables -C's table
                assert watch.route_groups == ROUTE_GROUPS
                ignored = watch.filter.ignored
                await round_after(lambda: run_argv("ip", "-n", ns, "addr", "add", "10.9.9.1/24", "dev", "other0"),
                                  lambda: run_argv("ip", "-n", ns, "addr", "add", "10.100.0.2/24", "dev", "ovsbr0"))
                await round_after(lambda: ns_exec(ns, "sysctl", "-qw", "net.ipv4.conf.other0.forwarding=0"),
                                  lambda: set_ip_forward(ns, 0))
                await round_after(lambda: ns_exec(ns, "nft", "add", "table", "inet", "other_service"),
                                  lambda: ns_exec(ns, "iptables", "-t", "nat", "-D", *MASQ))
                return seen, watch.filter.ignored - ignored, watch.failing
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        seen, ignored, failing = run_in_netns(ns, body, WATCH_DEADLINE_S * 3)
    assert seen == [(1, ["address on ovsbr0"]), (1, ["ip_forward"]), (1, ["nft table nat"])], seen
    assert ignored >= 3  # other0's address, its forwarding switch, the other service's table
    assert {"slice_ip_forward", "slice_nat"} <= set(failing), failing  # what the rounds then read


def _check(name: str, status: str, detail: str) -> HealthCheck:
    return HealthCheck(name=name, status=status, detail=detail, checked_at=datetime.now(UTC))


def test_drift_findings_name_a_new_failure_a_changed_reason_and_a_repair_once():
    nat = _check("slice_nat", "degraded", "nat_missing: no MASQUERADE")
    first = drift_findings({}, {"slice_nat": nat})
    assert [(f.kind, f.subject) for f in first] == [(DriftKind.slice_network_degraded, "slice_nat")]
    assert "nat_missing" in first[0].actual
    assert drift_findings({"slice_nat": nat}, {"slice_nat": nat}) == []  # unchanged: nothing to say again
    other = _check("slice_nat", "degraded", "nat_unreadable")
    assert [f.kind for f in drift_findings({"slice_nat": nat}, {"slice_nat": other})] == \
        [DriftKind.slice_network_degraded]
    back = drift_findings({"slice_nat": nat}, {})
    assert [(f.kind, f.subject, f.actual) for f in back] == [(DriftKind.slice_network_restored, "slice_nat", "ok")]


def test_deleting_the_masquerade_rule_degrades_the_heartbeat_within_seconds_and_restoring_it_heals(
        nats_server, dhcp_lab, tmp_path, short_dir, agents):
    """The health round is 10 min away: only the watch can see the break in time (≤ 30 s, issue 16)."""
    ns = dhcp_lab.server
    rule = dhcp_lab.masquerade()

    async def body():
        plane, node_id, config = await enrolled_setup(
            nats_server, tmp_path, host_root="/", health_netns=ns, uevent_watch=False,
            health_interval_s=600, netwatch_interval_s=1,
            slice=dhcp_lab.agent_slice())
        drift: list[DriftReport] = []

        async def on_drift(msg):
            drift.append(DriftReport.model_validate_json(msg.data))

        sub = await plane.nc.subscribe(f"gpuaas.node.{node_id}.drift", cb=on_drift)
        listener = NotifyListener(short_dir / "notify")
        try:
            agent = AgentProcess([sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)],
                                 agent_env(listener.path), tmp_path / "agent.log")
            agents.append(agent.start())
            healthy = await plane.wait_for(lambda s: [h for h in s.heartbeats if h.health_state == "healthy"],
                                           timeout=60)
            checks = {c.name: c for c in healthy[-1].health}
            assert checks["slice_nat"].status == "ok", healthy[-1].health

            broken_at = time.monotonic()
            await asyncio.to_thread(sh, "ip", "netns", "exec", ns, "iptables", "-t", "nat", "-D", *rule)
            degraded = await plane.wait_for(
                lambda s: [h for h in s.heartbeats if h.health_state == "degraded"
                           and any(c.name == "slice_nat" and c.status == "degraded" for c in h.health)], timeout=30)
            latency = time.monotonic() - broken_at
            beat = degraded[-1]
            nat = next(c for c in beat.health if c.name == "slice_nat")
            assert "slice_nat" in beat.health_reason and "nat_missing" in nat.detail
            assert nat.checked_at > checks["slice_nat"].checked_at  # says when it was checked: after the break
            assert latency < 30, latency
            print(f"netwatch: MASQUERADE deleted -> degraded heartbeat in {latency:.2f} s (timer 1 s, netns)")

            await asyncio.to_thread(sh, "ip", "netns", "exec", ns, "iptables", "-t", "nat", "-A", *rule)
            await plane.wait_for(lambda s: s.heartbeats[-1].health_state == "healthy" or None, timeout=30)

            async def reported():
                while not any(f.kind is DriftKind.slice_network_restored for r in drift for f in r.findings):
                    await asyncio.sleep(0.1)  # poll step of a deadline wait (the callback appends)
            await asyncio.wait_for(reported(), 20)
            kinds = [(f.kind, f.subject) for r in drift for f in r.findings]
            assert (DriftKind.slice_network_degraded, "slice_nat") in kinds, json.dumps([str(k) for k in kinds])
            assert kinds.index((DriftKind.slice_network_degraded, "slice_nat")) < \
                kinds.index((DriftKind.slice_network_restored, "slice_nat"))
        finally:
            listener.close()
            await sub.unsubscribe()
            await plane.close()

    run_bounded(body())


def test_health_network_live_reads_the_slice_network_on_the_live_host_whatever_host_root_is(tmp_path):
    from pathlib import Path

    from gpuaas_agent.config import AgentConfig
    from gpuaas_agent.operator.health import HealthSettings

    base = {"state_dir": str(tmp_path), "host_root": str(tmp_path / "recorded"), "nats_url": "nats://127.0.0.1:4222"}
    assert HealthSettings.from_config(AgentConfig.model_validate(base)).network_root is None
    live = HealthSettings.from_config(AgentConfig.model_validate({**base, "health_network_live": True}))
    assert live.network_root == Path("/") and live.host_root == tmp_path / "recorded"
