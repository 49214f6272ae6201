"""Least privilege per node in ONE shared account (the package lanes' layout), against a real nats-server whose
node users hold exactly ``node_permissions``, on Debian's nats-server and on the pinned current release. The supported layout, an account per node, is
``tests/control/test_accounts.py``.

Node A runs the real worker with only its permissions (find the stream, look up the consumer
the control plane created, pull, ack, publish results). Then A, as an attacker with the same
login, tries to read node B's tasks, results, inbox replies and credentials and anything of
enrollment, to create, change or drive any consumer (its own included), and to make the server
deliver onto B's subjects: a push consumer's deliver subject, a stream mirroring or sourcing the
task stream, a republish, direct gets. The server refuses each (a permissions violation), and
nothing reaches B or A.

One way is not refusable by NATS permissions in one account: a reply subject is checked against
nothing, so A can name B's subject as the reply of its own JetStream request and the server answers
there (an API response, or A's own pulled task). The last test pins that for this layout, and that B
acts on none of it (docs/security-auth.md "The single-account layout"); in the account-per-node
layout the answer stays in A's account (test_accounts.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets

import nats
import nats.errors
import pytest

from gpuaas_agent.contract.tasks import ResultStatus, TaskType
from gpuaas_agent.control.connection import connect_nats
from gpuaas_agent.control.enroll import node_inbox_prefix
from gpuaas_agent.control.permissions import ENROLL_PERMISSIONS, consumer_name, nats_server_user
from gpuaas_agent.control.rotation import CredsRotator
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.state.store import StateStore
from tests.support.controlplane import TASK_STREAM, ControlPlane
from tests.support.nats_server import NatsServer, nats_server_binary, release_nats_server

A, B = "node-perma", "node-permb"
SESSION = "0f8fad5b-d9cb-469f-a165-70867728950e"  # a terminal session id (lower-case UUID)
DEADLINE_S = 20.0
TEST_DEADLINE_S = 90.0


class PermLab:
    def __init__(self, root, binary: str) -> None:
        self.passwords = {A: secrets.token_urlsafe(12), B: secrets.token_urlsafe(12), "plane": secrets.token_urlsafe(12)}
        users = [nats_server_user(A, self.passwords[A]), nats_server_user(B, self.passwords[B]),
                 {"user": "plane", "password": self.passwords["plane"]}]
        config = root / "nats.conf"
        config.write_text(json.dumps({"authorization": {"users": users}}, indent=1))
        store = root / "store"
        store.mkdir()
        self.server = NatsServer(binary, store, root / "nats.log",
                                 extra_args=("-c", str(config)))

    def url(self, user: str) -> str:
        return f"nats://{user}:{self.passwords[user]}@127.0.0.1:{self.server.port}"


@pytest.fixture(scope="module", params=["debian", "release"])
def lab(request, tmp_path_factory):
    """The probes run on Debian's nats-server and on the pinned current release (the servers planes run)."""
    why = "the single-account probes run on Debian's nats-server and on the current release"
    binary = nats_server_binary(why) if request.param == "debian" else release_nats_server(why)
    lab = PermLab(tmp_path_factory.mktemp(f"perm-{request.param}"), binary)
    lab.server.start()
    try:
        async def streams():
            plane = await ControlPlane.connect(lab.url("plane"))
            await plane.create_streams()
            for node in (A, B):  # the control plane's job: a node cannot create its consumer
                await plane.create_node_consumer(node, WorkerSettings(keepalive_interval_s=0.5, ack_wait_s=5.0))
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
            # Not even its own consumer may it delete (or change): the control plane owns it.
            attacker = Attacker()
            nc_a = await attacker.connect(lab)
            subject = f"$JS.API.CONSUMER.DELETE.{TASK_STREAM}.{consumer_name(A)}"
            await nc_a.publish(subject, b"")
            await attacker.violation("publish", subject)
            await nc_a.close()
            assert (await plane.js.consumer_info(TASK_STREAM, consumer_name(A))).name == consumer_name(A)
        finally:
            await worker.drain(5)
            await asyncio.wait_for(run, DEADLINE_S)
            await nc.close()
            await plane.close()
            store.close()
    _run(body())


def test_a_node_cannot_read_another_nodes_tasks_results_replies_or_credentials(lab):
    forbidden = [f"gpuaas.node.{B}.task.>", f"gpuaas.node.{B}.result", f"gpuaas.node.{B}.creds",
                 f"gpuaas.node.{B}.creds.renew", "gpuaas.node.*.creds.renew", "gpuaas.enroll", "gpuaas.enroll.nonce",
                 "_INBOX.enroll.>", f"gpuaas.node.{B}.terminal.*.in", f"gpuaas.node.{B}.terminal.*.out",
                 f"gpuaas.node.{B}.telemetry.*", f"gpuaas.node.{A}.telemetry.*",  # slice telemetry goes to the plane
                 f"_INBOX.{B}.>", "_INBOX.>", "gpuaas.node.*.result", "gpuaas.node.*.task.>", "$JS.>", "$SYS.>", ">"]

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
                            f"gpuaas.node.{B}.telemetry.{SESSION}", f"_INBOX.{B}.reply"):
                await plane.nc.publish(subject, b"secret-of-b")
            await plane.nc.publish(f"_INBOX.{A}.sentinel", b"sentinel")
            assert (await own.next_msg(timeout=DEADLINE_S)).data == b"sentinel"
            assert {s: sub.pending_msgs for s, sub in subs.items()} == {s: 0 for s in forbidden}
        finally:
            await nc.close()
            await plane.close()
    _run(body())


def test_a_node_cannot_create_change_pull_ack_or_enqueue_on_any_consumer_or_anothers_subjects(lab):
    async def body():
        plane = await ControlPlane.connect(lab.url("plane"))
        attacker = Attacker()
        nc = await attacker.connect(lab)
        mine = consumer_name(A)
        queued_before = (await plane.js.stream_info(TASK_STREAM)).state.last_seq
        consumers_before = {(i.name, i.config.filter_subject, i.config.deliver_subject)
                            for i in await plane.js.consumers_info(TASK_STREAM)}
        own = {"stream_name": TASK_STREAM, "config": {"name": mine, "durable_name": mine, "ack_policy": "explicit",
                                                       "filter_subject": f"gpuaas.node.{A}.task.>"}}
        try:
            for subject in (f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}.{mine}.gpuaas.node.{A}.task.>",  # its own, too
                            f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}.{mine}.gpuaas.node.{B}.task.>",
                            f"$JS.API.CONSUMER.DURABLE.CREATE.{TASK_STREAM}.{mine}",
                            f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}",
                            f"$JS.API.CONSUMER.DELETE.{TASK_STREAM}.{mine}",
                            f"$JS.API.CONSUMER.INFO.{TASK_STREAM}.{consumer_name(B)}",
                            f"$JS.API.CONSUMER.MSG.NEXT.{TASK_STREAM}.{consumer_name(B)}",
                            f"$JS.API.CONSUMER.DELETE.{TASK_STREAM}.{consumer_name(B)}",
                            f"$JS.ACK.{TASK_STREAM}.{consumer_name(B)}.1.1.1.0.0",
                            f"gpuaas.node.{B}.task.topology.discover", f"gpuaas.node.{A}.task.topology.discover",
                            f"gpuaas.node.{B}.result", f"gpuaas.node.{B}.creds", f"gpuaas.node.{B}.creds.renew",
                            f"gpuaas.node.{B}.terminal.{SESSION}.out", f"gpuaas.node.{A}.terminal.{SESSION}.in",
                            f"gpuaas.node.{B}.telemetry.{SESSION}",  # another node's slice telemetry, forged
                            "gpuaas.enroll"):
                await nc.publish(subject, json.dumps(own).encode())
                await attacker.violation("publish", subject)
            after = {(i.name, i.config.filter_subject, i.config.deliver_subject)
                     for i in await plane.js.consumers_info(TASK_STREAM)}
            assert after == consumers_before  # the plane's two pull consumers, unchanged
            assert (await plane.js.stream_info(TASK_STREAM)).state.last_seq == queued_before  # nothing was enqueued
        finally:
            await nc.close()
            await plane.close()
    _run(body())


def _attacks() -> dict[str, dict]:
    """API subject -> body: every way A could ask the server to publish onto B's subjects (or copy B's data)."""
    mine, b_creds = consumer_name(A), f"gpuaas.node.{B}.creds"
    push = {"name": mine, "durable_name": mine, "ack_policy": "none", "deliver_subject": b_creds,
            "filter_subject": f"gpuaas.node.{A}.task.>"}
    republish = {"src": f"gpuaas.node.{A}.task.>", "dest": b_creds}
    return {
        # a push consumer whose deliver subject is B's (its own name and filter, then any name)
        f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}.{mine}.gpuaas.node.{A}.task.>": {"stream_name": TASK_STREAM,
                                                                                  "config": push},
        f"$JS.API.CONSUMER.DURABLE.CREATE.{TASK_STREAM}.{mine}": {"stream_name": TASK_STREAM, "config": push},
        f"$JS.API.CONSUMER.CREATE.{TASK_STREAM}": {"stream_name": TASK_STREAM,
                                                   "config": {**push, "name": None, "durable_name": None}},
        # a stream of its own: mirroring or sourcing the task stream, capturing B's subjects, republishing
        "$JS.API.STREAM.CREATE.EVIL_MIRROR": {"name": "EVIL_MIRROR", "mirror": {"name": TASK_STREAM},
                                              "republish": {"src": ">", "dest": b_creds}},
        "$JS.API.STREAM.CREATE.EVIL_SOURCES": {"name": "EVIL_SOURCES", "sources": [{"name": TASK_STREAM},
                                                                                  {"name": "GPUAAS_RESULTS"}]},
        "$JS.API.STREAM.CREATE.EVIL_CAPTURE": {"name": "EVIL_CAPTURE", "subjects": [b_creds, f"_INBOX.{B}.>"]},
        f"$JS.API.STREAM.UPDATE.{TASK_STREAM}": {"name": TASK_STREAM, "subjects": ["gpuaas.node.*.task.>"],
                                                 "retention": "workqueue", "republish": republish},
        # direct and API gets of what is stored (B's tasks, everyone's results)
        f"$JS.API.DIRECT.GET.{TASK_STREAM}": {"last_by_subj": f"gpuaas.node.{B}.task.x"},
        f"$JS.API.DIRECT.GET.{TASK_STREAM}.gpuaas.node.{B}.task.x": {},
        f"$JS.API.STREAM.MSG.GET.{TASK_STREAM}": {"seq": 1},
        "$JS.API.STREAM.MSG.GET.GPUAAS_RESULTS": {"seq": 1},
        f"$JS.API.STREAM.INFO.{TASK_STREAM}": {},
        "$JS.API.STREAM.LIST": {},
        f"$JS.API.CONSUMER.LIST.{TASK_STREAM}": {},
    }


def test_a_node_cannot_make_the_server_deliver_onto_another_nodes_subjects(lab):
    """Push deliver subjects, mirrors/sources, republish, direct gets: each refused, and nothing reaches B."""
    async def body():
        plane = await ControlPlane.connect(lab.url("plane"))
        b = await nats.connect(lab.url(B), inbox_prefix=node_inbox_prefix(B), allow_reconnect=False)
        attacker = Attacker()
        nc = await attacker.connect(lab)
        try:
            watched = [f"gpuaas.node.{B}.creds", f"gpuaas.node.{B}.terminal.{SESSION}.in", f"_INBOX.{B}.x"]
            b_subs = {s: await b.subscribe(s) for s in watched}
            plane_subs = {s: await plane.nc.subscribe(s) for s in
                          (f"gpuaas.node.{B}.result", f"gpuaas.node.{B}.heartbeat", f"gpuaas.node.{B}.drift")}
            await b.flush()
            await plane.nc.flush()
            await plane.enqueue(plane.envelope(A, TaskType.topology_discover.value))  # something to deliver
            for subject, request in _attacks().items():
                await nc.publish(subject, json.dumps(request).encode(), reply=f"_INBOX.{A}.attack")
                await attacker.violation("publish", subject)
            # A sentinel on the same ordered path from the plane: B sees the sentinel and nothing else.
            await plane.nc.publish(f"gpuaas.node.{B}.creds", b"sentinel")
            assert (await b_subs[f"gpuaas.node.{B}.creds"].next_msg(timeout=DEADLINE_S)).data == b"sentinel"
            await plane.nc.flush()
            assert {s: sub.pending_msgs for s, sub in {**b_subs, **plane_subs}.items()} == \
                {s: 0 for s in [*b_subs, *plane_subs]}
            names = await plane.js.streams_info()
            assert sorted(i.config.name for i in names) == ["GPUAAS_RESULTS", TASK_STREAM]  # no stream of A's
            info = await plane.js.stream_info(TASK_STREAM)
            assert info.config.republish is None
            assert all(i.config.deliver_subject is None for i in await plane.js.consumers_info(TASK_STREAM))
        finally:
            await nc.close()
            await b.close()
            await plane.close()
    _run(body())


def test_the_bootstrap_login_can_only_ask_for_a_nonce_and_enroll(lab):
    """What ENROLL_PERMISSIONS leaves open: no node subject, no JetStream API, no other enrollment's inbox."""
    assert ENROLL_PERMISSIONS == {"publish": ["gpuaas.enroll", "gpuaas.enroll.nonce"],
                                  "subscribe": ["_INBOX.enroll.*.>"]}


def test_a_reply_subject_naming_another_node_reaches_it_and_it_acts_on_none_of_it(lab, tmp_path):
    """NATS checks no reply subject against permissions: A's own allowed requests with B's subject as the reply
    make the server answer on B's subject (an API response, A's own pulled task). B's rotation listener (the
    only fixed subject B reads) refuses them all, answers none (an answer to a $JS.ACK reply would ack A's task),
    and B's credentials stay as they were."""
    async def body():
        plane = await ControlPlane.connect(lab.url("plane"))
        b = await nats.connect(lab.url(B), inbox_prefix=node_inbox_prefix(B), allow_reconnect=False)
        creds = tmp_path / "nats.creds"
        creds.write_text("unchanged")
        creds.chmod(0o600)
        rotator = CredsRotator(b, B, creds, timeout_s=2.0)
        heard: list = []
        attacker = Attacker()
        nc = await attacker.connect(lab)
        try:
            await rotator.start()
            async def listen(msg):
                heard.append(msg)
            spy = await b.subscribe(f"gpuaas.node.{B}.creds", cb=listen)
            await b.flush()
            await plane.enqueue(plane.envelope(A, TaskType.topology_discover.value))
            target = f"gpuaas.node.{B}.creds"
            await nc.publish(f"$JS.API.CONSUMER.INFO.{TASK_STREAM}.{consumer_name(A)}", b"", reply=target)
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{TASK_STREAM}.{consumer_name(A)}",
                             json.dumps({"batch": 1, "expires": 2_000_000_000}).encode(), reply=target)
            await nc.publish("$JS.API.STREAM.NAMES", b"{}", reply=target)
            await nc.flush()

            async def three():
                while len(heard) < 3:
                    await asyncio.sleep(0.05)  # poll interval of a condition with a deadline
            await asyncio.wait_for(three(), DEADLINE_S)
            # Pinned for one shared account: the day NATS refuses such replies this fails. An account per node
            # closes it today (test_accounts.py).
            assert {m.subject for m in heard} >= {target, f"gpuaas.node.{A}.task.{TaskType.topology_discover.value}"}
            await b.flush()
            assert rotator.rotations == 0 and creds.read_text() == "unchanged"
            assert not attacker.errors  # all three were A's own, allowed requests
            await spy.unsubscribe()
        finally:
            await rotator.stop()
            await nc.close()
            await b.close()
            await plane.close()
    _run(body())
