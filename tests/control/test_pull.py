"""control/pull.py: the pull is the one reader of nats.py's internals, and those internals are pinned here.

If an upgrade of nats.py renames or retypes one of them, ``test_the_nats_py_internals_the_pull_reads_are_there``
fails, naming the attribute and the version: nowhere else (the package and the benches read them only
through :class:`TaskPull`, which ``test_no_other_module_reads_nats_py_internals`` keeps true).
"""

from __future__ import annotations

import contextlib
import re

import nats.errors
import pytest

from gpuaas_agent.control.connection import connect_nats
from gpuaas_agent.control.enroll import node_inbox_prefix
from gpuaas_agent.control.permissions import consumer_name
from gpuaas_agent.control.pull import NATS_PY_INTERNALS, TaskPull, nats_py_version, pull_request
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.worker import TaskWorker
from gpuaas_agent.state.store import StateStore
from tests.conftest import REPO
from tests.support.controlplane import ControlPlane
from tests.support.deadline import run_bounded
from tests.support.worker_harness import DISCOVER, NODE

# The private names of nats.py objects; `._sub._` is the pull subscription's inner subscription.
_INTERNAL = re.compile(r"\b(_nms|_deliver|_pending_queue|_pending_size)\b|\._sub\._")


@contextlib.asynccontextmanager
async def _bound_pull(nats_server, tmp_path):
    """(plane, node connection, pull subscription, pull) bound to the node's consumer; all closed on exit."""
    async with contextlib.AsyncExitStack() as stack:
        plane = await ControlPlane.connect(nats_server.url)
        stack.push_async_callback(plane.close)
        await plane.create_streams()
        await plane.create_node_consumer(NODE, WorkerSettings(fetch_timeout_s=1.0))
        nc = await connect_nats([nats_server.url], timeout_s=10, name=NODE, inbox_prefix=node_inbox_prefix(NODE),
                                security=TransportSecurity(insecure=True))
        stack.push_async_callback(nc.close)
        store = StateStore.open(tmp_path / "state.db")
        stack.callback(store.close)
        worker = TaskWorker(nc, store, NODE, {}, WorkerSettings(fetch_timeout_s=1.0))
        psub = await worker._bind()  # the worker's own lookup of the control plane's consumer
        pull = TaskPull(nc)
        pull.bind(psub)
        yield plane, nc, psub, pull


def test_the_nats_py_internals_the_pull_reads_are_there(nats_server, tmp_path):
    async def body():
        async with _bound_pull(nats_server, tmp_path) as (plane, nc, psub, pull):
            owners = {"PullSubscription": psub, "Subscription": psub._sub}
            for owner, attribute, kind in NATS_PY_INTERNALS:
                obj = owners[owner]
                assert hasattr(obj, attribute), (
                    f"nats.py {nats_py_version()}: {owner}.{attribute} is gone; control/pull.py reads it")
                value = getattr(obj, attribute)
                assert isinstance(value, kind), (
                    f"nats.py {nats_py_version()}: {owner}.{attribute} is a {type(value).__name__}, "
                    f"control/pull.py expects a {kind.__name__}")
            # What they mean, not only that they exist: the request goes to the consumer's next-message
            # subject, the reply inbox is the one the subscription listens on.
            stream = await plane.js.find_stream_name_by_subject(f"gpuaas.node.{NODE}.task.>")
            assert pull.next_subject == f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer_name(NODE)}"
            assert psub._sub.subject == pull.deliver_subject

    run_bounded(body(), 60)


def test_a_pull_hands_on_a_task_and_counts_its_accounting_back(nats_server, tmp_path):
    async def body():
        async with _bound_pull(nats_server, tmp_path) as (plane, nc, psub, pull):
            with pytest.raises(nats.errors.TimeoutError):  # nothing queued: the pull expires (its 408)
                await pull.pull_one(0.5, None)
            envelope = plane.envelope(NODE, DISCOVER)
            await plane.enqueue(envelope)
            got = await pull.pull_one(5.0, None)
            assert len(got) == 1 and envelope.task_id in got[0].data.decode()
            assert psub._sub._pending_size == 0  # taken off nats.py's slow-consumer accounting too
            await got[0].ack()
            await pull.unbind(5.0)
            assert not pull.bound and await pull.close(5.0) == []

    run_bounded(body(), 60)


def test_a_pull_request_is_one_message_expiring_before_the_expiry():
    assert pull_request(30.0, None) == b'{"batch": 1, "expires": 29999900000}'
    assert b'"idle_heartbeat": 5000000000' in pull_request(30.0, 5.0)


def test_no_other_module_reads_nats_py_internals():
    """The package and the benches reach nats.py's private state only through control/pull.py."""
    offenders = []
    for root in ("gpuaas_agent", "bench"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "gpuaas_agent" / "control" / "pull.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _INTERNAL.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "nats.py internals read outside control/pull.py:\n" + "\n".join(offenders)
