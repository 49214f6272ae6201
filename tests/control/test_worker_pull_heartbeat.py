"""The pull's idle heartbeat: a pull whose consumer's server died is noticed in two heartbeats, not the 30 s expiry.

On a JetStream cluster with R1 memory node consumers (docs/performance.md "Fleet layout"), losing the
member that leads a node's consumer loses the node's waiting pull with it, while the agent's
own connection (to another member) stays up: no reconnect ends the pull. Measured before the
heartbeat (bench_fleet --restart-one): tasks claimed 28.7 s later; with the member gone for
good, never. Real servers: a 3-member cluster on loopback (one per module), and the
per-test single server for the idle case.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.enrollment import NatsCredentials
from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.enroll import EnrollmentRecord
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.daemon import connect
from gpuaas_agent.state.store import StateStore
from tests.support.controlplane import RESULT_STREAM, TASK_STREAM, ControlPlane
from tests.support.deadline import run_bounded, wait_until
from tests.support.nats_cluster import NatsCluster
from tests.support.nats_server import nats_server_binary
from tests.support.worker_harness import DISCOVER, NODE, Counting, Harness

HEARTBEAT_S = 1.0
LONG_PULL_S = 60.0  # longer than any bound below: a claim within CLAIM_BOUND_S was no pull expiry
REQUEST_TIMEOUT_S = 1.0
# The warning comes after 2 heartbeats of silence (+ slack for a loaded 2-core machine).
NOTICED_BOUND_S = 2 * HEARTBEAT_S + 3.0
# Then: the unanswered consumer check; the worker may not delete or create its consumer, so it looks it up
# (backoff 0.2 s doubling to 5 s) until the control plane, whose own probe (every PLANE_PROBE_S, timeout
# PLANE_PROBE_S) found it unanswered, has deleted it and created it on a live member. Right after a SIGKILL
# the meta leader may still place the new R1 consumer on the dead member, so the plane's round may repeat.
# Measured when the worker re-created the consumer itself: claimed 4-14 s after the kill; with the control
# plane doing it: see docs/security-auth.md "Recovery after a member loss". Without the heartbeat the pull
# would wait its whole expiry, and with the member gone never claim at all.
CLAIM_BOUND_S = 40.0  # generous for a loaded 2-core CI machine
PLANE_PROBE_S = 1.0
WORKER_LOG = "gpuaas_agent.control.worker"


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory):
    """One 3-server JetStream cluster for the module (a start costs seconds); every member stopped by PID."""
    binary = nats_server_binary("the cluster test needs real servers")
    cluster = NatsCluster(binary, tmp_path_factory.mktemp("nats-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _settings() -> WorkerSettings:
    return WorkerSettings(fetch_timeout_s=LONG_PULL_S, fetch_heartbeat_s=HEARTBEAT_S, keepalive_interval_s=0.5,
                          ack_wait_s=5.0, request_timeout_s=REQUEST_TIMEOUT_S, consumer_replicas=1,
                          consumer_memory=True)


async def _agent(node: str, url: str, tmp_path, store: StateStore, handler):
    """One agent connected to the member at ``url`` only (the daemon's own connect), its worker bound."""
    record = EnrollmentRecord(node_id=node, enrolled_at=datetime.now(UTC), credentials=NatsCredentials(
        user=node, password="unused-by-test-server", servers=[url]))
    nc = await connect(AgentConfig(state_dir=tmp_path / "state", insecure=True), record, asyncio.Event())
    worker = TaskWorker(nc, store, node, {TaskType.topology_discover: handler}, _settings())
    run = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 20)
    return nc, worker, run


async def _stop_agent(nc, worker: TaskWorker, run: asyncio.Task) -> None:
    await worker.drain(2)
    await asyncio.wait_for(run, 10)
    await asyncio.wait_for(nc.close(), 5)


async def _when_the_cluster_answers(call, deadline_s: float = 30.0):
    """``call()`` retried until it answers: a member restarted by the previous case may still be electing."""
    async def retry():
        while True:
            try:
                return await call()
            except (nats.errors.TimeoutError, nats.js.errors.APIError):
                await asyncio.sleep(0.2)  # retry pacing inside a deadline
    return await asyncio.wait_for(retry(), deadline_s)


# How the member is lost -> the warning that must say why the pull ended. A SIGKILL (a crash, a partition)
# tells nobody: the pull's heartbeats stop. A SIGTERM ends the pull with 409 Server Shutdown, after which the
# old code pulled again from the same, now leaderless, consumer and waited out the expiry (bench: 28.7 s).
LOSSES = {"killed": ("kill", "pull_heartbeat_missed"), "stopped": ("stop", "pull_ended_by_server")}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_losing_the_member_that_leads_the_consumer_costs_seconds_not_the_pull_expiry(nats_cluster, tmp_path, caplog,
                                                                                     loss):
    caplog.set_level(logging.WARNING, logger=WORKER_LOG)
    how, warning = LOSSES[loss]
    node = f"node-hb-{loss}"  # its own consumer and subjects: nothing left from the other case reaches it

    async def body():
        plane = await ControlPlane.connect(nats_cluster.urls)  # the control plane fails over to any member
        for config in (StreamConfig(name=TASK_STREAM, subjects=["gpuaas.node.*.task.>"], num_replicas=3,
                                    retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE),
                       StreamConfig(name=RESULT_STREAM, subjects=["gpuaas.node.*.result"], num_replicas=3,
                                    retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                                    duplicate_window=120)):
            await _when_the_cluster_answers(lambda config=config: plane.js.add_stream(config))
        # R1, memory: the fleet layout's node consumer; the control plane's to create (and re-create).
        await _when_the_cluster_answers(lambda: plane.create_node_consumer(node, _settings()))
        plane.watch_consumers(interval_s=PLANE_PROBE_S, probe_timeout_s=PLANE_PROBE_S)
        (tmp_path / "state").mkdir()
        store = StateStore.open(tmp_path / "state" / "state.db")
        handler = Counting()
        durable = _settings().durable_name(node)
        agent = await _agent(node, nats_cluster.urls[0], tmp_path, store, handler)
        try:
            leader = (await plane.js.consumer_info(TASK_STREAM, durable)).cluster.leader
            if nats_cluster.member(leader).url == nats_cluster.urls[0]:
                # The agent must keep its connection: move it to another member (the consumer stays where it is).
                await _stop_agent(*agent)
                agent = await _agent(node, nats_cluster.urls[1], tmp_path, store, handler)
                assert (await plane.js.consumer_info(TASK_STREAM, durable)).cluster.leader == leader
            nc, worker, _ = agent
            await wait_until(lambda: worker.pull_heartbeats >= 1, 10, "a first pull heartbeat")
            connected_to = nc.connected_url.port

            member = nats_cluster.member(leader)
            await asyncio.to_thread(getattr(member, how))  # by its PID; its R1 memory consumer goes with it
            lost, lost_at = time.monotonic(), time.time()
            envelope = plane.envelope(node, DISCOVER)

            async def enqueue_when_the_stream_has_a_leader():
                while True:
                    try:
                        return await plane.enqueue(envelope, msg_id=envelope.task_id)  # a retry is deduplicated
                    except Exception:
                        await asyncio.sleep(0.2)  # retry pacing inside a deadline (the stream may elect a leader)
            await asyncio.wait_for(enqueue_when_the_stream_has_a_leader(), CLAIM_BOUND_S)
            result = await plane.wait_result(envelope.task_id, timeout=CLAIM_BOUND_S)
            claimed_after_s = time.monotonic() - lost
            assert result.status == ResultStatus.succeeded
            assert handler.calls == 1
            assert claimed_after_s < CLAIM_BOUND_S < LONG_PULL_S
            assert nc.connected_url.port == connected_to  # no reconnect woke it: the heartbeat did
            warnings = [json.loads(r.getMessage()) for r in caplog.records if r.name == WORKER_LOG]
            [why, *_] = [w for w in warnings if w["event"] == warning]
            [noticed_at, *_] = [r.created for r in caplog.records if warning in r.getMessage()]
            assert noticed_at - lost_at < NOTICED_BOUND_S
            if loss == "killed":
                assert why["consumer"] == durable and why["stream"] == TASK_STREAM
                assert why["silent_s"] >= 2 * HEARTBEAT_S
            else:
                assert why["description"] == "Server Shutdown"
            # The worker waited for the control plane (when its check found the consumer unanswered; when the plane
            # was quicker, the check found it served again) and never deleted or created anything itself.
            for leaderless in [w for w in warnings if w["event"] == "consumer_leaderless"]:
                assert leaderless["consumer"] == durable and "control plane" in leaderless["waiting_for"]
            [(_, recreated_at), *_] = [r for r in plane.consumers_recreated if r[0] == node]
            info = await plane.js.consumer_info(TASK_STREAM, durable)
            assert info.cluster.leader != leader  # created again, by the control plane, on a member that is up
            print(f"recovery loss={loss} plane_recreated_after_s={recreated_at - lost:.2f} "
                  f"claimed_after_s={claimed_after_s:.2f}")
            assert info.config.filter_subject == f"gpuaas.node.{node}.task.>"
        finally:
            await _stop_agent(*agent)
            await plane.close()
            store.close()
            for m in nats_cluster.members:  # the next test gets the whole cluster again (same store dir)
                if m.proc is None:
                    await asyncio.to_thread(m.start)
    run_bounded(body(), 90)


def test_an_idle_pull_gets_heartbeats_and_neither_warns_nor_rebinds(nats_server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=WORKER_LOG)

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: Counting()},
                           fetch_timeout_s=LONG_PULL_S, fetch_heartbeat_s=0.25) as h:
            await wait_until(lambda: h.worker.pull_heartbeats >= 8, 10, "8 pull heartbeats (2 s idle)")
            assert h.worker.pull_heartbeats_missed == 0
            assert not [r for r in caplog.records if r.name == WORKER_LOG]  # no miss, no consumer check, no rebind
            envelope = h.plane.envelope(NODE, DISCOVER)  # and the pull still delivers at once
            assert (await h.run_task_to_result(envelope)).status == ResultStatus.succeeded
    run_bounded(body())
