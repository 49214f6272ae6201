"""bench/protocol_node.py in the supported layout: a node's own account and its own task and result stream.

bench_fleet's ``--layout per-node --accounts per-node`` figures stand for the fleet only if a ProtocolNode logs in
as the node does (operator mode: its user JWT, the server's nonce signed with its seed), pulls its consumer under
the account's import prefix, and its result and ack reach the plane's account through the node's imports. And a
node that signs with another key than its JWT names is refused, so the bench cannot measure a login the server
did not check.
"""

from __future__ import annotations

import asyncio

import nkeys

from bench.protocol_node import ProtocolNode
from gpuaas_agent.contract.tasks import TaskResult, TaskType
from gpuaas_agent.control import accounts
from gpuaas_agent.control.connection import Backoff, connect_nats
from gpuaas_agent.control.enroll import node_inbox_prefix
from gpuaas_agent.control.streams import result_stream_name, task_stream_name
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.state.store import StateStore
from tests.natsauth.fleet import FleetOperator
from tests.natsauth.natsjwt import Key
from tests.support.controlplane import ControlPlane
from tests.support.deadline import run_bounded, wait_until
from tests.support.nats_server import configured_server, write_creds

NODE = "node-proto-acct"
TASK = TaskType.topology_discover
SETTINGS = WorkerSettings(fetch_timeout_s=1.0, js_api_prefix=accounts.NODE_JS_API_PREFIX)


def test_a_protocol_node_in_its_own_account_claims_answers_and_acks_and_a_wrong_key_is_refused(tmp_path):
    operator = FleetOperator()
    operator.node_account(NODE, task_stream_name(NODE))
    (tmp_path / "jwt").mkdir()
    server = configured_server(tmp_path, operator.resolver_config(tmp_path / "jwt"))
    server.start()

    async def body():
        plane_creds, _ = operator.user("control-plane")
        plane = await ControlPlane.connect(server.url, operator=operator, per_node_streams=True,
                                          user_credentials=str(write_creds(tmp_path, "plane", plane_creds)))
        nodes: list[ProtocolNode] = []
        try:
            assert await plane.create_node_consumer(NODE, SETTINGS)
            user = Key.new(nkeys.PREFIX_BYTE_USER)
            token = operator.node_user_jwt(NODE, user.public)
            creds = write_creds(tmp_path, NODE, operator.node_user(NODE)[0])
            nc = await connect_nats([server.url], timeout_s=10, name=NODE, inbox_prefix=node_inbox_prefix(NODE),
                                    security=TransportSecurity(insecure=True, creds_file=creds))
            store = StateStore.open(tmp_path / "state.db")
            try:
                worker = TaskWorker(nc, store, NODE, {}, SETTINGS)
                worker.pull.bind(await worker._bind())  # what bench_fleet calls, under the node's import prefix
            finally:
                await nc.close()
                store.close()
            assert worker.pull.next_subject.startswith(accounts.NODE_JS_API_PREFIX + ".")

            claims: list[str] = []

            def node(seed: bytes) -> ProtocolNode:
                made = ProtocolNode(node_id=NODE, host="127.0.0.1", port=server.port,
                                    inbox_prefix=node_inbox_prefix(NODE), next_subject=worker.pull.next_subject,
                                    task_type=TASK.value, expiry_s=1.0, bound_s=2.0, heartbeat_s=None,
                                    backoff=Backoff(0.1, 0.5), on_claim=lambda task_id, t: claims.append(task_id),
                                    on_reconnect=lambda t: None, trace=[], jwt=token, seed=seed)
                nodes.append(made)
                return made

            # Another key than the JWT's: the server refuses the login (no PONG, an -ERR), nothing is pulled.
            impostor = node(Key.new(nkeys.PREFIX_BYTE_USER).seed)
            impostor._closing = True  # refused for good: no reconnect loop
            await asyncio.get_running_loop().create_connection(lambda: impostor, "127.0.0.1", server.port)
            await wait_until(lambda: any("Authorization" in e for e in impostor.errors), 10, "the impostor refused")
            await wait_until(impostor.ready.done, 10, "the impostor's connection closed by the server")
            assert impostor.ready.result() is False  # lost before it was ready: no PONG, so it never pulled
            assert not any(event == "pull" for _, event in impostor.trace)

            good = node(user.seed)
            await good.connect()
            envelope = plane.envelope(NODE, TASK.value)
            await plane.enqueue(envelope, msg_id=envelope.task_id)
            await wait_until(lambda: claims == [envelope.task_id], 10, "the task claimed")
            await wait_until(lambda: sum(1 for _, e in good.trace if e == "pull") >= 2, 10, "the pull after the claim")
            stored = await plane.js.get_last_msg(result_stream_name(NODE), f"gpuaas.node.{NODE}.result")
            assert TaskResult.model_validate_json(stored.data).task_id == envelope.task_id
            assert stored.headers["Nats-Msg-Id"] == f"{envelope.task_id}-1"
            assert await plane.pending_tasks(NODE) == 0  # acked through the node's import: the work queue is empty
            assert not good.errors
        finally:
            for made in nodes:
                made.close()
            await plane.close()

    try:
        run_bounded(body(), 60)
    finally:
        server.stop()
