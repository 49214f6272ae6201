"""Least privilege per node, against a real nats-server whose node users hold exactly ``node_permissions``.

Node A runs the real worker with only its permissions (find the stream, create its
consumer, pull, ack, publish results). Then A, as an attacker with the same login, tries
to read node B's tasks, results, inbox replies and credentials, to create or drive a
consumer on B's subjects, and to enqueue tasks: the server refuses each (a permissions
violation, or JetStream error 10131 for a body filter that differs from the subject),
and nothing of B's reaches A.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil

import nats
import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.connection import connect_nats
from gpuaas_agent.control.enroll import node_inbox_prefix
from gpuaas_agent.control.permissions import consumer_name, nats_server_user
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.worker import TaskWorker, WorkerSettings
from gpuaas_agent.state.store import StateStore
from tests.controlplane import TASK_STREAM, ControlPlane
from tests.support.nats_server import NatsServer

A, B = "node-perma", "node-permb"
SESSION = "0f8fad5b-d9cb-469f-a165-70867728950e"  # a terminal session id (lower-case UUID)
DEADLINE_S = 20.0
TEST_DEADLINE_S = 90.0


class PermLab:
    def __init__(self, root) -> None:
        self.passwords = {A: secrets.token_urlsafe(12), B: secrets.token_urlsafe(12), "plane": secrets.token_urlsafe(12)}
        users = [nats_server_user(A, self.passwords[A]), nats_server_user(B, self.passwords[B]),
                 {"user": "plane", "password": self.passwords["plane"]}]
        config = root / "nats.conf"
        config.write_text(json.dumps({"authorization": {"users": users}}, indent=1))
        store = root / "store"
        store.mkdir()
        self.server = NatsServer(shutil.which("nats-server") or "nats-server", store, root / "nats.log",
                                 extra_args=("-c", str(config)))

    def url(self, user: str) -> str:
        return f"nats://{user}:{self.passwords[user]}@127.0.0.1:{self.server.port}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = PermLab(tmp_path_factory.mktemp("perm"))
    lab.server.start()
    try:
        async def streams():
            plane = await ControlPlane.connect(lab.url("plane"))
            await plane.create_streams()
            await plane.close()
        asyncio.run(streams())
        yield lab
    finally:
        lab.server.stop()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TEST_DEADLINE_S))


class Attacker:
    """Node A's login on a plain client that records every error the server sends it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.changed = asyncio.Event()

    async def connect(self, lab: PermLab):
        async def on_error(exc):
            self.errors.append(str(exc))
            self.changed.set()
        self.nc = await nats.connect(lab.url(A), inbox_prefix=node_inbox_prefix(A), error_cb=on_error,
                                     allow_reconnect=False)
        return self.nc

    async def violation(self, kind: str, subject: str) -> str:
        """Wait (deadline) for the server's 'Permissions Violation for <kind> to "<subject>"'."""
        needle = f'permissions violation for {kind} to "{subject}"'.lower()

        async def seen():
            while not any(needle in e.lower() for e in self.errors):
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(seen(), DEADLINE_S)
        return needle


def test_a_node_with_exactly_its_permissions_runs_its_own_tasks(lab, tmp_path):
    async def body():
        plane = await ControlPlane.connect(lab.url("plane"))
        nc = await connect_nats([lab.url(A)], timeout_s=5.0, name="node-a", inbox_prefix=node_inbox_prefix(A),
                                security=TransportSecurity(insecure=True))
        store = StateStore.open(tmp_path / "state.db")

        async def handler(payload, ctx):
            return {"ran_on": ctx.node_id}
        worker = TaskWorker(nc, store, A, {TaskType.topology_discover: handler},
                            WorkerSettings(keepalive_interval_s=0.5, ack_wait_s=5.0))
        run = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), DEADLINE_S)
            assert worker.stream == TASK_STREAM  # found by subject through $JS.API.STREAM.NAMES
            envelope = plane.envelope(A, TaskType.topology_discover.value)
            await plane.enqueue(envelope)
            result = await plane.wait_result(envelope.task_id, timeout=DEADLINE_S)
            assert result.status == ResultStatus.succeeded and result.output == {"ran_on": A}
            # Its own consumer it may delete: the worker re-creates an R1 consumer whose cluster member is lost.
            assert await worker.js.delete_consumer(TASK_STREAM, consumer_name(A))
        finally:
            await worker.drain(5)
            await asyncio.wait_for(run, DEADLINE_S)
            await nc.close()
            await plane.close()
            store.close()
    _run(body())


def test_a_node_cannot_read_another_nodes_tasks_results_replies_or_credentials(lab):
    forbidden = [f"gpuaas.node.{B}.task.>", f"gpuaas.node.{B}.result", f"gpuaas.node.{B}.creds",
                 f"gpuaas.node.{B}.terminal.*.in", f"gpuaas.node.{B}.terminal.*.out", f"_INBOX.{B}.>", "_INBOX.>", "gpuaas.node.*.result", "gpuaas.node.*.task.>", ">"]

    async def body():
        plane = await ControlPlane.connect(lab.url("plane"))
        attacker = Attacker()
        nc = await attacker.connect(lab)
        try:
            subs = {subject: await nc.subscribe(subject) for subject in forbidden}
            own = await nc.subscribe(f"_INBOX.{A}.sentinel")
            await nc.flush()
            for subject in forbidden:
                await attacker.violation("subscription", subject)
            # B's traffic flows; then a sentinel to A on the same ordered path: A sees the sentinel only.
            for subject in (f"gpuaas.node.{B}.task.x", f"gpuaas.node.{B}.result", f"gpuaas.node.{B}.creds",
                            f"gpuaas.node.{B}.terminal.{SESSION}.in", f"gpuaas.node.{B}.terminal.{SESSION}.out",
                            f"_INBOX.{B}.reply"):
                await plane.nc.publish(subject, b"secret-of-b")
            await plane.nc.publish(f"_INBOX.{A}.sentinel", b"sentinel")
            assert (await own.next_msg(timeout=DEADLINE_S)).data == b"sentinel"
            assert {s: sub.pending_msgs for s, sub in subs.items()} == {s: 0 for s in forbidden}
        finally:
            await nc.close()
            await plane.close()
    _run(body())


def test_a_node_cannot_create_pull_ack_or_enqueue_on_another_nodes_subjects(lab):
    async def body():
        plane = await ControlPlane.connect(lab.url("plane"))
        attacker = Attacker()
        nc = await attacker.connect(lab)
        js = nc.jetstream(timeout=2.0)
        mine = consumer_name(A)
        queued_before = (await plane.js.stream_info(TASK_STREAM)).state.last_seq
        try:
            # 1. Its own consumer name with B's filter: the subject carries the filter, the permission pins it.
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await js.add_consumer(TASK_STREAM, ConsumerConfig(name=mine, durable_name=mine,
                                                                  filter_subject=f"gpuaas.node.{B}.task.>",
                                                                  ack_policy=AckPolicy.EXPLICIT))
            await attacker.violation("publish", f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}.{mine}.gpuaas.node.{B}.task.>")
            # 2. Its own subject, B's filter in the body: the server itself refuses the mismatch (10131).
            body = {"stream_name": TASK_STREAM, "config": {"name": mine, "durable_name": mine, "ack_policy": "explicit",
                                                            "filter_subject": f"gpuaas.node.{B}.task.>"}}
            reply = await nc.request(f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}.{mine}.gpuaas.node.{A}.task.>",
                                     json.dumps(body).encode(), timeout=DEADLINE_S)
            assert json.loads(reply.data)["error"]["err_code"] == 10131
            # 3. The legacy durable API (name only, filter unchecked), B's consumer, B's acks, tasks to anyone.
            for subject in (f"$JS.API.CONSUMER.DURABLE.CREATE.{TASK_STREAM}.{mine}",
                            f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}",
                            f"$JS.API.CONSUMER.MSG.NEXT.{TASK_STREAM}.{consumer_name(B)}",
                            f"$JS.API.CONSUMER.DELETE.{TASK_STREAM}.{consumer_name(B)}",
                            f"$JS.ACK.{TASK_STREAM}.{consumer_name(B)}.1.1.1.0.0",
                            f"gpuaas.node.{B}.task.topology.discover", f"gpuaas.node.{A}.task.topology.discover",
                            f"gpuaas.node.{B}.result", f"gpuaas.node.{B}.creds",
                            f"gpuaas.node.{B}.terminal.{SESSION}.out", f"gpuaas.node.{A}.terminal.{SESSION}.in"):
                await nc.publish(subject, json.dumps(body).encode())
                await attacker.violation("publish", subject)
            for info in await plane.js.consumers_info(TASK_STREAM):  # only A's worker's own, on A's subject
                assert (info.name, info.config.filter_subject) == (mine, f"gpuaas.node.{A}.task.>")
            assert (await plane.js.stream_info(TASK_STREAM)).state.last_seq == queued_before  # nothing was enqueued
        finally:
            await nc.close()
            await plane.close()
    _run(body())

