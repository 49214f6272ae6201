"""Simulated nodes that speak the NATS client protocol themselves, for ``bench_fleet --node-impl protocol``.

Why: nats.py costs about half a millisecond of Python per claim (a reader and a flusher task per
connection, a future per request), and the bench's 5,000 nodes share the machine's cores with the
server under test, so in ``--node-impl wire`` the simulator, not the server, sets the burst's tail.
A :class:`ProtocolNode` sends the server the same traffic as the agent's worker for a claim — a pull
on the consumer's next-message subject (batch 1, the worker's expiry, its idle heartbeat when asked),
the delivery, a ``TaskResult`` published with ``Nats-Msg-Id`` and its PubAck awaited, then the ack and
the next pull — from ``asyncio.Protocol`` callbacks, with no task or future per message.

The consumer is created by the worker's own ``TaskWorker._bind`` (on a nats.py connection that is
closed afterwards), so its config and the filtered create API are the agent's.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import Callable
from datetime import datetime

import nkeys

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.tasks import ResultStatus, TaskResult
from gpuaas_agent.control.connection import Backoff
from gpuaas_agent.control.pull import pull_request

CRLF = b"\r\n"


class ProtocolError(RuntimeError):
    """The server said ``-ERR`` or sent something this client does not speak."""


class ProtocolNode(asyncio.Protocol):
    """One node's connection: CONNECT, one wildcard inbox subscription, the pull/claim/result/ack loop.

    ``on_claim(task_id, t)`` is called at each delivery (the bench's "claim"); ``on_reconnect(t)``
    after a lost connection is back and pulling. ``trace`` (optional list) gets ``(t, event)`` rows.
    """

    def __init__(self, *, node_id: str, host: str, port: int, inbox_prefix: str, next_subject: str,
                 task_type: str, expiry_s: float, bound_s: float, heartbeat_s: float | None, backoff: Backoff,
                 on_claim: Callable[[str, float], None], on_reconnect: Callable[[float], None],
                 trace: list | None = None, jwt: str | None = None, seed: bytes | None = None) -> None:
        self.node_id, self.host, self.port = node_id, host, port
        self.task_type = task_type
        self.bound_s = bound_s  # the client's own wait on one pull, from sending it (bench_fleet.pull_bound_s)
        self.backoff, self.on_claim, self.on_reconnect, self.trace = backoff, on_claim, on_reconnect, trace
        self.pull_inbox = f"{inbox_prefix}.p.pull"
        self.ack_inbox = f"{inbox_prefix}.p.ack"
        self.result_subject = f"gpuaas.node.{node_id}.result"
        body = pull_request(expiry_s, heartbeat_s or None)  # the worker's own request body (control/pull.py)
        self._pull = b"PUB %s %s %d\r\n%s\r\n" % (next_subject.encode(), self.pull_inbox.encode(), len(body), body)
        self._connect = {"verbose": False, "pedantic": False, "name": node_id, "lang": "python-bench", "version": "0",
                         "protocol": 1, "headers": True, "no_responders": True}
        self._subs = b"SUB %s 1\r\nSUB %s 2\r\nPING\r\n" % (self.pull_inbox.encode(), self.ack_inbox.encode())
        # Operator-mode auth (a user JWT and its seed, as a creds file holds them): CONNECT waits for the
        # server's INFO and signs its nonce, as nats.py does; without it CONNECT goes out at once.
        self._jwt = jwt
        self._signer = nkeys.from_seed(bytearray(seed)) if seed is not None else None
        self.transport: asyncio.Transport | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self._buf = bytearray()
        self._pending: tuple[bytes, bytes | None, int | None, int] | None = None  # sid, reply, hdr len, size
        self._ack_reply: bytes | None = None  # the delivery whose result's PubAck we wait for
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._attempt = 0
        self.errors: list[str] = []
        self._greeted = False
        self._reconnecting = False

    # -- connection ---------------------------------------------------------------

    async def connect(self, deadline_s: float = 120.0) -> None:
        """Connected and pulling within ``deadline_s``; a login the server drops meanwhile is tried again with the
        reconnect's backoff (each try has a new ``ready``), as the agent's first connect is."""
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: self, self.host, self.port)
        end = loop.time() + deadline_s
        while True:
            ready = self.ready
            try:
                if await asyncio.wait_for(asyncio.shield(ready), max(0.01, min(1.0, end - loop.time()))):
                    return
            except asyncio.TimeoutError:
                pass
            if loop.time() >= end:
                raise asyncio.TimeoutError(f"{self.node_id}: not connected within {deadline_s}s: {self.errors[-3:]}")
            if ready is self.ready and ready.done():
                await asyncio.sleep(0.05)  # lost; the reconnect has not made its next try yet

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self._buf.clear()
        self._pending = None
        self._greeted = self._jwt is None  # later INFOs (a cluster's topology updates) need no answer
        if self._jwt is None:
            transport.write(self._hello(None))

    def _hello(self, nonce: bytes | None) -> bytes:
        connect = dict(self._connect)
        if self._jwt is not None and self._signer is not None and nonce is not None:
            connect["jwt"] = self._jwt
            connect["sig"] = base64.urlsafe_b64encode(self._signer.sign(nonce)).rstrip(b"=").decode()
        return b"CONNECT " + json.dumps(connect).encode() + CRLF + self._subs

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self._timer is not None:
            self._timer.cancel()
        if not self.ready.done():
            self.ready.set_result(False)  # lost before it was ready (a login the server refused)
        if not self._closing and not self._reconnecting:
            asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        """One reconnect loop at a time, one connection at a time: a try that is lost or not ready in 30 s is
        closed before the next."""
        loop = asyncio.get_running_loop()
        rng = random.Random()
        self._reconnecting = True
        try:
            while not self._closing:
                await asyncio.sleep(self.backoff.delay(self._attempt, rng))  # full jitter, as the agent
                self._attempt += 1
                self.ready = loop.create_future()
                try:
                    await loop.create_connection(lambda: self, self.host, self.port)
                    ok = await asyncio.wait_for(asyncio.shield(self.ready), 30)
                except (OSError, asyncio.TimeoutError):
                    ok = False
                if not ok:
                    if self.transport is not None:
                        self.transport.close()
                    continue
                self._attempt = 0
                self.on_reconnect(time.time())
                return
        finally:
            self._reconnecting = False

    def close(self) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        if self.transport is not None:
            self.transport.close()

    # -- the claim loop -----------------------------------------------------------

    def _send_pull(self) -> None:
        if self.transport is None:
            return
        self.transport.write(self._pull)
        self._note("pull")
        self._arm()

    def _arm(self) -> None:
        """The client's own bound on a pull, for a pull whose end the server never sent."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.bound_s, self._client_timeout)

    def _client_timeout(self) -> None:
        self._note("client-timeout")
        self._send_pull()

    def _note(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append((round(time.time(), 3), event))

    def _on_message(self, sid: bytes, reply: bytes | None, hdr: bytes | None, payload: bytes) -> None:
        """Dispatch by subscription: a delivery keeps the task's own subject, so the sid says it was our pull."""
        if sid == b"1":
            if reply:  # a stored message always has its ack subject as reply, a status never
                self._note("msg")
                task_id = json.loads(payload)["task_id"]
                self.on_claim(task_id, time.time())
                self._ack_reply = reply
                self._publish_result(task_id)
                return
            status = hdr.split(CRLF, 1)[0][9:12].decode() if hdr else ""
            self._note(f"status {status}")
            if status == "100":
                return  # an idle heartbeat: the pull is alive (its bound still counts from the request)
            self._send_pull()  # 404/408 the pull ended empty, 409 ended by the server: pull again
        elif sid == b"2":
            if b'"error"' in payload:
                self.errors.append(payload.decode(errors="replace"))
            reply, self._ack_reply = self._ack_reply, None
            if reply is not None and self.transport is not None:
                self.transport.write(b"PUB %s 4\r\n+ACK\r\n" % reply)
            self._send_pull()

    def _publish_result(self, task_id: str) -> None:
        result = TaskResult(task_id=task_id, node_id=self.node_id, type=self.task_type, attempt=1,
                            status=ResultStatus.succeeded, finished_at=datetime.now(UTC))
        body = result.model_dump_json().encode()
        hdr = b"NATS/1.0\r\nNats-Msg-Id: %s-1\r\n\r\n" % task_id.encode()
        if self.transport is not None:
            self.transport.write(b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
                self.result_subject.encode(), self.ack_inbox.encode(), len(hdr), len(hdr) + len(body), hdr, body))

    # -- protocol parsing ---------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while True:
            if self._pending is not None:
                sid, reply, hdr_len, size = self._pending
                if len(buf) < size + 2:
                    return
                raw = bytes(buf[:size])
                del buf[:size + 2]
                self._pending = None
                if hdr_len is None:
                    self._on_message(sid, reply, None, raw)
                else:
                    self._on_message(sid, reply, raw[:hdr_len], raw[hdr_len:])
                continue
            end = buf.find(CRLF)
            if end < 0:
                return
            line = bytes(buf[:end])
            del buf[:end + 2]
            op = line[:4].upper()
            if op == b"MSG ":
                parts = line.split()
                reply = parts[3] if len(parts) == 5 else None
                self._pending = (parts[2], reply, None, int(parts[-1]))
            elif op == b"HMSG":
                parts = line.split()
                reply = parts[3] if len(parts) == 6 else None
                self._pending = (parts[2], reply, int(parts[-2]), int(parts[-1]))
            elif op == b"PING":
                if self.transport is not None:
                    self.transport.write(b"PONG\r\n")
            elif op == b"PONG":
                if not self.ready.done():
                    self.ready.set_result(True)
                    self._send_pull()
            elif op.startswith(b"-ERR"):
                self.errors.append(line.decode(errors="replace"))
            elif op == b"INFO":
                if not self._greeted and self.transport is not None:
                    self._greeted = True
                    nonce = json.loads(line[5:]).get("nonce", "")
                    self.transport.write(self._hello(nonce.encode()))
            # +OK needs nothing from us
