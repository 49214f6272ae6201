"""Every result fits the wire: one that would exceed the server's ``max_payload`` is answered ``result_too_large``.

Why: a publish larger than ``max_payload`` never succeeds (nats.py refuses it, ``MaxPayloadError``;
a server sent one closes the connection), so retrying it until the publish deadline and leaving the
task unacked made JetStream redeliver it without end, and a tenant whose console filled with
control bytes (each ``\\u00XX`` in JSON: six bytes) made its own task a permanent load on the node.
Handlers that return bulk data size it themselves (``slice.console_log`` returns the tail that fits,
``cut_to_fit``); any other result that does not fit is replaced here by a failed result with the
stable code ``result_too_large`` and the sizes as evidence, keeping the task's ``slot_outcomes``
(what the task did to slots is never dropped), then published and acked like any answer.

The size counted is what the server counts: the JSON body plus the header block
(``NATS/1.0``, ``Nats-Msg-Id``), against the ``max_payload`` of the server we are connected to
(``INFO``; nats.py ``Client.max_payload``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuaas_agent.contract.tasks import ResultStatus, TaskErrorBody, TaskResult


def header_bytes(headers: Mapping[str, str]) -> int:
    """The size of the header block a publish with ``headers`` sends (``NATS/1.0\\r\\n``, ``K: V\\r\\n``..., ``\\r\\n``)."""
    if not headers:
        return 0
    return len(b"NATS/1.0\r\n") + sum(len(k.encode()) + 2 + len(v.encode()) + 2 for k, v in headers.items()) + 2


def wire_size(data: bytes, headers: Mapping[str, str]) -> int:
    """What the server compares with its ``max_payload``: the body and the header block together."""
    return len(data) + header_bytes(headers)


def fit_result(result: TaskResult, headers: Mapping[str, str], max_payload: int) -> tuple[TaskResult, bytes]:
    """``(result, its JSON)`` when it fits ``max_payload``; else the ``result_too_large`` answer in its place."""
    data = result.model_dump_json().encode()
    size = wire_size(data, headers)
    if size <= max_payload:
        return result, data
    evidence = {"result_bytes": size, "max_payload": max_payload, "original_status": result.status.value,
                "original_error": None if result.error is None else result.error.code,
                "output_keys": sorted(result.output)[:50]}
    for outcomes in (result.slot_outcomes, []):  # its slot outcomes alone not fitting: said, without them
        if not outcomes and result.slot_outcomes:
            evidence["slot_outcomes_dropped"] = len(result.slot_outcomes)
        too_large = TaskResult(
            task_id=result.task_id, node_id=result.node_id, type=result.type, attempt=result.attempt,
            status=ResultStatus.failed, output={}, slot_outcomes=outcomes, finished_at=result.finished_at,
            error=TaskErrorBody(code="result_too_large", retryable=False, evidence=evidence,
                                message=f"the {result.type} result of {size} bytes does not fit the NATS server's "
                                        f"max_payload of {max_payload} bytes; it was not sent"))
        data = too_large.model_dump_json().encode()
        if wire_size(data, headers) <= max_payload:
            break
    return too_large, data
