"""Every result fits the wire: sized to the server's max_payload, else ``result_too_large``, acked, never redelivered.

Against a real nats-server started with a small ``max_payload`` (one per module), the real
``slice.console_log`` handler reads a console full of bytes that JSON escapes six-fold.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.slots import HealthState, SlotOutcome, SlotStatus
from gpuaas_agent.contract.tasks import ResultStatus, TaskResult, TaskType
from gpuaas_agent.control.resultfit import fit_result, header_bytes, wire_size
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.consolelog import ensure_log_dir
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.tasks.console_log import console_log_handler
from gpuaas_agent.tasks.drivers import SliceDrivers
from tests.support.controlplane import TASK_STREAM
from tests.support.deadline import run_bounded
from tests.support.nats_server import configured_server
from tests.support.worker_harness import DISCOVER, NODE, Counting, Harness

MAX_PAYLOAD = 64 << 10
ALLOC = str(uuid.uuid4())


@pytest.fixture(scope="module")
def small_payload_server(tmp_path_factory):
    server = configured_server(tmp_path_factory.mktemp("small-payload"), f"max_payload: {MAX_PAYLOAD}\n",
                               why="results must fit a real server's max_payload")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _result(**fields) -> TaskResult:
    return TaskResult(**{"task_id": "t-1", "node_id": NODE, "type": DISCOVER, "attempt": 1,
                         "status": ResultStatus.succeeded, "finished_at": datetime.now(UTC), **fields})


def test_the_header_block_is_counted_as_the_server_counts_it():
    assert header_bytes({"Nats-Msg-Id": "t-1-1"}) == len(b"NATS/1.0\r\nNats-Msg-Id: t-1-1\r\n\r\n")
    assert wire_size(b"{}", {}) == 2


def test_a_result_that_fits_is_sent_as_it_is():
    result = _result(output={"ok": True})
    sent, data = fit_result(result, {"Nats-Msg-Id": "t-1-1"}, MAX_PAYLOAD)
    assert sent is result and data == result.model_dump_json().encode()


def test_an_oversized_result_becomes_result_too_large_and_keeps_its_slot_outcomes():
    outcome = SlotOutcome(slot_index=3, status=SlotStatus.cleanup_blocked, health_state=HealthState.degraded)
    result = _result(output={"blob": "\x01" * MAX_PAYLOAD}, slot_outcomes=[outcome])
    headers = {"Nats-Msg-Id": "t-1-1"}
    sent, data = fit_result(result, headers, MAX_PAYLOAD)
    assert wire_size(data, headers) <= MAX_PAYLOAD and TaskResult.model_validate_json(data) == sent
    assert sent.status == ResultStatus.failed and sent.output == {} and sent.slot_outcomes == [outcome]
    assert sent.error is not None and sent.error.code == "result_too_large" and not sent.error.retryable
    assert sent.error.evidence["max_payload"] == MAX_PAYLOAD
    assert sent.error.evidence["result_bytes"] > 6 * MAX_PAYLOAD
    assert sent.error.evidence["original_status"] == "succeeded"


async def _settled_without_redelivery(h, handler_calls) -> None:
    """The task is acked: gone from the work queue, nothing pending or redelivered on its consumer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while await h.plane.pending_tasks():
        assert loop.time() < deadline, "task not acked"
        await asyncio.sleep(0.05)  # polling a condition with a deadline
    info = await h.plane.js.consumer_info(TASK_STREAM, h.settings.durable_name(NODE))
    assert info.num_ack_pending == 0 and info.num_redelivered == 0 and info.num_pending == 0
    assert handler_calls() == 1


def test_a_console_full_of_control_bytes_arrives_cut_to_fit_and_is_acked(small_payload_server, tmp_path):
    drivers = SliceDrivers(host_root=tmp_path, slice=SliceConfig(console_log_dir=tmp_path / "console"),
                           images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle("test:///default"))
    ensure_log_dir(drivers.slice.console_log_dir)
    # 1 MiB the tenant wrote: escaped in JSON that is 6 MiB, 96 times the server's max_payload.
    drivers.console_log_path(ALLOC, 0).write_bytes(b"\x01" * (1 << 20) + b"the last line\n")
    inner = console_log_handler(drivers)
    calls = 0

    async def handler(payload, ctx):
        nonlocal calls
        calls += 1
        return await inner(payload, ctx)

    async def body():
        async with Harness(small_payload_server, tmp_path, {TaskType.console_log: handler}) as h:
            assert h.nc.max_payload == MAX_PAYLOAD  # read from the server, not assumed
            envelope = h.plane.envelope(NODE, TaskType.console_log.value,
                                        {"allocation_id": ALLOC, "slot_index": 0, "tail_kib": 1024})
            result = await h.run_task_to_result(envelope)
            assert result.status == ResultStatus.succeeded, result.error
            assert result.output["truncated"] and result.output["cut_to_fit"]
            assert result.output["text"].endswith("\x01the last line\n")
            await _settled_without_redelivery(h, lambda: calls)
            assert [r.task_id for r in await h.plane.stored_results(NODE)] == [envelope.task_id]

    run_bounded(body())


def test_any_other_oversized_result_is_answered_result_too_large_acked_and_replayed_the_same(small_payload_server,
                                                                                             tmp_path):
    handler = Counting(output={"report": "\x00" * MAX_PAYLOAD})

    async def body():
        async with Harness(small_payload_server, tmp_path, {TaskType.topology_discover: handler}) as h:
            envelope = h.plane.envelope(NODE, DISCOVER)
            result = await h.run_task_to_result(envelope)
            assert result.status == ResultStatus.failed and result.error.code == "result_too_large"
            assert result.error.evidence["max_payload"] == MAX_PAYLOAD
            await _settled_without_redelivery(h, lambda: handler.calls)
            await h.plane.enqueue(envelope)  # the control plane sends it again: the stored answer, refitted
            again = await h.plane.wait_result(envelope.task_id, count=2)
            assert again == result and handler.calls == 1

    run_bounded(body())
