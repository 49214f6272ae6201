"""Admission: a task is pulled only to start; one tenant's interactive flood never holds the node's lifecycle work.

Real pieces: nats-server with JetStream (the task and result streams of the test control plane), the
agent's worker on its own connection; the handlers are held on events so "in flight" is a fact the
test controls, not a timing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid

from gpuaas_agent.contract.tasks import ResultStatus, TaskClass, TaskType
from gpuaas_agent.control.admission import Admission, Refusal, Ticket, tenant_of, type_of_subject
from tests.support.deadline import run_bounded, wait_until
from tests.support.worker_harness import DISCOVER, NODE, Counting, Harness

POWER = TaskType.vm_power.value
DATA = TaskType.terminal_data.value


def _power(alloc: str) -> dict:
    return {"allocation_id": alloc, "slot_index": 0, "operation": "reboot"}


def _data(alloc: str, session: str) -> dict:
    return {"session_id": session, "allocation_id": alloc, "data": base64.b64encode(b"ls\n").decode()}


def test_an_interactive_flood_never_holds_lifecycle_work_and_a_tenant_over_its_bound_is_answered_busy(
        nats_server, tmp_path):
    power, data, discover = Counting(hold=True), Counting(hold=True), Counting()
    tenant_a, tenant_b = str(uuid.uuid4()), str(uuid.uuid4())
    session = str(uuid.uuid4())

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.vm_power: power, TaskType.terminal_data: data,
                                                   TaskType.topology_discover: discover},
                           interactive_per_allocation=3, handback_delay_s=0.2) as h:
            # Tenant A: 20 reboots of its slice; tenant B: 30 terminal inputs. Their handlers never finish.
            flood = [h.plane.envelope(NODE, POWER, _power(tenant_a)) for _ in range(20)]
            flood += [h.plane.envelope(NODE, DATA, _data(tenant_b, session)) for _ in range(30)]
            for envelope in flood:
                await h.plane.enqueue(envelope)
            await wait_until(lambda: power.active == 3 and data.active == 3, what="each tenant at its bound")
            # Tenant C's lifecycle task, queued behind all of it, is pulled and runs to its result.
            lifecycle = h.plane.envelope(NODE, DISCOVER, {})
            await h.plane.enqueue(lifecycle)
            result = await h.plane.wait_result(lifecycle.task_id)
            assert result.status is ResultStatus.succeeded and discover.calls == 1
            # Each flooding tenant has its bound in flight and no more; the rest were answered, not queued.
            assert power.max_active == 3 and data.max_active == 3
            busy = [await h.plane.wait_result(e.task_id) for e in flood
                    if e.task_id not in h.worker.running_task_ids]
            assert len(busy) == 44
            assert {(r.status, r.error.code, r.error.retryable) for r in busy} == {
                (ResultStatus.failed, "tenant_busy", True)}
            # The result is published before the task is acked, and its place is given back after the ack.
            await wait_until(lambda: h.worker.admission.snapshot()["in_flight"]["lifecycle"] == 0,
                             what="the lifecycle task's place given back after its ack")
            snapshot = h.worker.admission.snapshot()
            assert snapshot["in_flight"] == {"lifecycle": 0, "interactive": 6}
            assert snapshot["handed_back"]["allocation_full"] >= 44
            # Nothing of a turned-away task was stored: sent again once the tenant is under its bound, it runs.
            assert all(h.store.result_of(r.task_id) is None for r in busy)
            power.release.set()
            data.release.set()
            again = busy[0]
            await wait_until(lambda: h.worker.admission.snapshot()["in_flight"]["interactive"] == 0,
                             what="the held tasks finished")
            retry = next(e for e in flood if e.task_id == again.task_id).model_copy(update={"attempt": 2})
            await h.plane.enqueue(retry)
            ran = await h.plane.wait_result(retry.task_id, count=2)
            assert ran.status is ResultStatus.succeeded and ran.attempt == 2

    run_bounded(body(), 120)


def test_a_lifecycle_task_over_its_types_bound_waits_in_jetstream_not_in_the_agent(nats_server, tmp_path):
    handler = Counting(hold=True)

    async def body():
        async with Harness(nats_server, tmp_path, {TaskType.topology_discover: handler},
                           concurrency={TaskType.topology_discover: 1}, handback_delay_s=0.2) as h:
            tasks = [h.plane.envelope(NODE, DISCOVER) for _ in range(3)]
            for envelope in tasks:
                await h.plane.enqueue(envelope)
            await asyncio.wait_for(handler.started.wait(), 10)
            await wait_until(lambda: h.worker.admission.refused["type_full"] >= 2, what="the others handed back")
            assert len(h.worker.running_task_ids) == 1 and handler.active == 1  # nothing else held here
            handler.release.set()
            results = [await h.plane.wait_result(e.task_id) for e in tasks]
            assert {r.status for r in results} == {ResultStatus.succeeded}
            assert handler.max_active == 1 and handler.calls == 3

    run_bounded(body(), 60)


def test_admission_bounds_each_class_type_and_allocation_and_gives_places_back():
    admission = Admission({TaskType.vm_power: 2, TaskType.terminal_data: 2, TaskType.vm_provision: 1},
                          per_allocation=2)
    subject = f"gpuaas.node.{NODE}.task."
    alloc = str(uuid.uuid4())
    data = json.dumps({"payload": {"allocation_id": alloc, "slot_index": 0}}).encode()
    first = admission.admit(subject + POWER, data)
    second = admission.admit(subject + POWER, data)
    assert isinstance(first, Ticket) and first.task_class is TaskClass.interactive and isinstance(second, Ticket)
    third = admission.admit(subject + DATA, data)
    assert isinstance(third, Refusal) and third.reason == "allocation_full"  # the same tenant, another type
    other = json.dumps({"payload": {"allocation_id": str(uuid.uuid4())}}).encode()
    assert isinstance(admission.admit(subject + POWER, other), Refusal)  # vm_power's own bound (2) is taken
    assert isinstance(admission.admit(subject + DATA, other), Ticket)
    provision = admission.admit(subject + TaskType.vm_provision.value, b"{}")
    assert isinstance(provision, Ticket) and provision.task_class is TaskClass.lifecycle
    assert admission.admit(subject + TaskType.vm_provision.value, b"{}").reason == "type_full"
    admission.release(first)
    assert isinstance(admission.admit(subject + DATA, data), Ticket)  # the tenant is under its bound again
    # Junk (no known type) takes a lifecycle place: the worker rejects it at once.
    assert type_of_subject(subject + "slice.nonsense") is None and type_of_subject("elsewhere") is None
    assert tenant_of(b"not json") is None and tenant_of(b'{"payload": []}') is None
    assert tenant_of(b'{"payload": {"session_id": "s-1"}}') == "session_id:s-1"
