"""A small, real control plane for tests and the lab demo: streams, enrollment, task queue, results.

It talks to a real ``nats-server -js`` with the same contract models the agent
uses (``gpuaas_agent.contract``), so a test exercises the wire, not a mock:

* :meth:`ControlPlane.create_streams` — the task stream (``gpuaas.node.*.task.>``,
  work-queue retention) and the result stream (``gpuaas.node.*.result``, limits
  retention with a duplicate window so ``Nats-Msg-Id`` dedupes republished results).
* :meth:`ControlPlane.create_task_partitions` — the fleet layout (docs/performance.md "Fleet layout"):
  instead of one task stream for every node, streams of ``per_stream`` nodes each
  (``GPUAAS_TASKS_<k>``, one ``gpuaas.node.<node>.task.>`` subject per member). The
  agent finds its stream by subject, so nothing changes on the node.
* :meth:`ControlPlane.serve_enrollment` answers ``gpuaas.enroll``: one-time tokens
  from :meth:`issue_token`, refusals with the contract's codes, credentials sealed to the
  request's ``reply_public_key`` (``gpuaas_agent/control/sealed.py``), never in clear.
* :meth:`enqueue` / :meth:`enqueue_raw` put tasks on the queue; :meth:`wait_result`
  waits (with a deadline) for a result seen live; :meth:`stored_results` reads
  what the result stream persisted.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.enrollment import EnrollReply, EnrollRequest, NatsCredentials
from gpuaas_agent.contract.tasks import Heartbeat, ProgressEvent, TaskEnvelope, TaskResult
from gpuaas_agent.control.sealed import seal_credentials

TASK_STREAM = "GPUAAS_TASKS"
RESULT_STREAM = "GPUAAS_RESULTS"
REQUEST_TIMEOUT_S = 5.0


@dataclass
class IssuedToken:
    token: str
    expires_at: float
    node_id: str | None = None  # set once the token was used
    machine_id: str | None = None


@dataclass
class _Seen:
    """Messages seen live on core subscriptions, with a condition to wait on."""

    results: list[TaskResult] = field(default_factory=list)
    progress: list[ProgressEvent] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class ControlPlane:
    """Connect with :meth:`connect`; close with :meth:`close` (unsubscribes, then closes)."""

    def __init__(self, nc: Client, url: str, *, clock=time.time) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        self.url = url
        self.tokens: dict[str, IssuedToken] = {}
        self.enroll_requests: list[EnrollRequest] = []
        self.issued_credentials: dict[str, NatsCredentials] = {}  # node id -> what was sealed to it
        self.seen = _Seen()
        self._clock = clock
        self._subs: list = []
        self.partitioned = False  # tasks go to whichever stream holds their subject

    @classmethod
    async def connect(cls, url: str) -> ControlPlane:
        nc = await nats.connect(url, connect_timeout=REQUEST_TIMEOUT_S, name="test-control-plane",
                                reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        plane = cls(nc, url)
        await plane._watch()
        return plane

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        await asyncio.wait_for(self.nc.close(), REQUEST_TIMEOUT_S)

    # -- streams ------------------------------------------------------------------

    async def create_streams(self) -> None:
        """Idempotent: an existing stream with the same config is left as it is."""
        await self.js.add_stream(StreamConfig(
            name=TASK_STREAM, subjects=["gpuaas.node.*.task.>"],
            retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
        ))
        await self.js.add_stream(StreamConfig(
            name=RESULT_STREAM, subjects=["gpuaas.node.*.result"],
            retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, duplicate_window=120,
        ))

    async def create_task_partitions(self, node_ids: list[str], *, per_stream: int = 100,
                                     storage: StorageType = StorageType.FILE, replicas: int = 1) -> list[str]:
        """Task streams of at most ``per_stream`` nodes each; returns their names. Idempotent per layout.

        Why: an empty pull on a filtered consumer scans its stream's backlog for other
        subjects, so one stream for N nodes makes a fleet-wide burst cost O(N²); a stream of
        G nodes bounds that scan at G.
        """
        names = []
        for k in range(0, len(node_ids), per_stream):
            name = f"{TASK_STREAM}_{k // per_stream:04d}"
            await self.js.add_stream(StreamConfig(
                name=name, subjects=[f"gpuaas.node.{n}.task.>" for n in node_ids[k:k + per_stream]],
                retention=RetentionPolicy.WORK_QUEUE, storage=storage, num_replicas=replicas,
            ))
            names.append(name)
        self.partitioned = True
        return names

    # -- enrollment ---------------------------------------------------------------

    def issue_token(self, ttl_s: float = 600.0) -> str:
        token = secrets.token_urlsafe(32)
        self.tokens[token] = IssuedToken(token=token, expires_at=self._clock() + ttl_s)
        return token

    async def serve_enrollment(self) -> None:
        self._subs.append(await self.nc.subscribe("gpuaas.enroll", cb=self._on_enroll))
        await self.nc.flush(timeout=REQUEST_TIMEOUT_S)

    def _answer(self, raw: bytes) -> EnrollReply:
        try:
            request = EnrollRequest.model_validate_json(raw)
        except ValidationError:
            return EnrollReply(accepted=False, error="token_invalid", message="request does not match the contract")
        self.enroll_requests.append(request)
        issued = self.tokens.get(request.bootstrap_token)
        if issued is None:
            return EnrollReply(accepted=False, error="token_invalid", message="unknown bootstrap token")
        if issued.node_id is not None:
            return EnrollReply(accepted=False, error="token_reused", message=f"token already used by {issued.node_id}")
        if self._clock() >= issued.expires_at:
            return EnrollReply(accepted=False, error="token_expired", message="bootstrap token expired")
        node_id = "node-" + hashlib.sha256(request.machine_id.encode()).hexdigest()[:12]
        credentials = NatsCredentials(user=node_id, password=secrets.token_urlsafe(24), servers=[self.url])
        try:
            sealed = seal_credentials(credentials, request, node_id)
        except ValueError:  # a low-order reply_public_key: nothing can be sealed to it; the token stays unused
            return EnrollReply(accepted=False, error="token_invalid", message="reply_public_key is not usable")
        issued.node_id, issued.machine_id = node_id, request.machine_id
        self.issued_credentials[node_id] = credentials
        return EnrollReply(accepted=True, node_id=node_id, sealed_credentials=sealed)

    async def _on_enroll(self, msg: Msg) -> None:
        await msg.respond(self._answer(msg.data).model_dump_json().encode())

    # -- tasks --------------------------------------------------------------------

    @staticmethod
    def envelope(node_id: str, task_type: str, payload: dict | None = None, *, task_id: str | None = None,
                 attempt: int = 1, deadline_s: float = 600.0) -> TaskEnvelope:
        return TaskEnvelope(
            task_id=task_id or f"task-{secrets.token_hex(6)}",
            type=task_type,
            node_id=node_id,
            attempt=attempt,
            deadline=datetime.now(UTC) + timedelta(seconds=deadline_s),
            payload=payload or {},
        )

    async def enqueue(self, envelope: TaskEnvelope, *, msg_id: str | None = None) -> int:
        """Put a task on ``gpuaas.node.<node>.task.<type>``; returns its stream sequence."""
        subject = f"gpuaas.node.{envelope.node_id}.task.{envelope.type}"
        return await self.enqueue_raw(subject, envelope.model_dump_json().encode(), msg_id=msg_id)

    async def enqueue_raw(self, subject: str, data: bytes, *, msg_id: str | None = None) -> int:
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        ack = await self.js.publish(subject, data, timeout=REQUEST_TIMEOUT_S,
                                    stream=None if self.partitioned else TASK_STREAM, headers=headers)
        return ack.seq

    async def pending_tasks(self) -> int:
        info = await self.js.stream_info(TASK_STREAM)
        return info.state.messages

    # -- what the agent sent ------------------------------------------------------

    async def _watch(self) -> None:
        async def on_result(msg: Msg) -> None:
            await self._record(self.seen.results, TaskResult, msg.data)

        async def on_progress(msg: Msg) -> None:
            await self._record(self.seen.progress, ProgressEvent, msg.data)

        async def on_heartbeat(msg: Msg) -> None:
            await self._record(self.seen.heartbeats, Heartbeat, msg.data)

        self._subs.append(await self.nc.subscribe("gpuaas.node.*.result", cb=on_result))
        self._subs.append(await self.nc.subscribe("gpuaas.node.*.progress", cb=on_progress))
        self._subs.append(await self.nc.subscribe("gpuaas.node.*.heartbeat", cb=on_heartbeat))
        await self.nc.flush(timeout=REQUEST_TIMEOUT_S)

    async def _record(self, into: list, model, data: bytes) -> None:
        async with self.seen.changed:
            into.append(model.model_validate_json(data))
            self.seen.changed.notify_all()

    async def wait_for(self, predicate, *, timeout: float = 20.0):
        """Wait until ``predicate(self.seen)`` is truthy; returns its value; TimeoutError at the deadline."""
        async def waiter():
            async with self.seen.changed:
                while not (value := predicate(self.seen)):
                    await self.seen.changed.wait()
                return value

        return await asyncio.wait_for(waiter(), timeout)

    async def wait_result(self, task_id: str, *, count: int = 1, timeout: float = 20.0) -> TaskResult:
        """The ``count``-th result published (live) for ``task_id``."""
        results = await self.wait_for(
            lambda seen: [r for r in seen.results if r.task_id == task_id][count - 1:] or None, timeout=timeout
        )
        return results[0]

    async def stored_results(self, node_id: str | None = None) -> list[TaskResult]:
        """Every result the result stream persisted (duplicates dropped by ``Nats-Msg-Id`` are absent)."""
        info = await self.js.stream_info(RESULT_STREAM)
        out: list[TaskResult] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            if info.state.messages == 0:
                break
            try:
                raw = await self.js.get_msg(RESULT_STREAM, seq)
            except NotFoundError:
                continue
            if node_id is None or raw.subject == f"gpuaas.node.{node_id}.result":
                out.append(TaskResult.model_validate_json(raw.data))
        return out
