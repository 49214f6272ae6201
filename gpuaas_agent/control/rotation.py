"""Credential rotation: the control plane sends a new `.creds` on ``gpuaas.node.<node>.creds``; we swap and reconnect.

Why a reconnect and not a restart: running slices, handlers and the task consumer all
live on, and nats.py re-reads the `.creds` file on every (re)connect and restores the
subscriptions (the worker's pull is kicked by the reconnect). Order:

1. the message must be a :class:`CredsRotation` for this node with a usable, unexpired
   user `.creds` (``control/transport.py`` reads it), else it is refused and the old file
   stays;
2. the new file replaces the old one atomically, 0600 (a crash leaves one or the other);
3. the reply (``accepted``) is sent and flushed on the old login;
4. ``force_reconnect``: the next CONNECT signs with the new seed. If the server refuses the
   new credentials, nats.py keeps retrying with backoff and the log says why — the old
   file is gone by then, which is what revocation wants.

Only the control plane may publish on this subject (docs/security.md "Permissions").
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.enrollment import CredsRotation, CredsRotationReply
from gpuaas_agent.control.transport import TransportError, parse_creds
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)


def rotation_subject(node_id: str) -> str:
    return subjects.creds(node_id)


class CredsRotator:
    """Subscribe with :meth:`start`; every valid rotation rewrites ``creds_file`` and reconnects ``nc``."""

    def __init__(self, nc: Client, node_id: str, creds_file: Path, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.node_id = node_id
        self.creds_file = creds_file
        self.timeout_s = timeout_s
        self.rotations = 0
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(rotation_subject(self.node_id), cb=self._on_message)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def _check(self, data: bytes) -> CredsRotation:
        try:
            rotation = CredsRotation.model_validate_json(data)
        except ValidationError as exc:
            raise TransportError("rotation message does not match the contract", code="invalid_message",
                                 evidence={"errors": exc.errors(include_url=False, include_input=False)}) from None
        if rotation.node_id != self.node_id:
            raise TransportError(f"rotation names node {rotation.node_id}, this is {self.node_id}", code="wrong_node",
                                 evidence={"node_id": rotation.node_id})
        info = parse_creds(rotation.creds, source="the rotated credentials")
        if info.expires_at is not None and info.expires_at <= time.time():
            raise TransportError("the rotated credentials are already expired", code="creds_expired",
                                 evidence={"expires_at": info.expires_at, "user": info.user_key})
        return rotation

    async def _on_message(self, msg: Msg) -> None:
        try:
            rotation = self._check(msg.data)
        except TransportError as exc:
            log_event(log, "creds_rotation_refused", logging.WARNING, code=exc.code, message=exc.message)
            await self._reply(msg, CredsRotationReply(accepted=False, error=exc.code, message=exc.message))
            return
        text = rotation.creds if rotation.creds.endswith("\n") else rotation.creds + "\n"
        write_atomic(self.creds_file, text.encode(), mode=0o600)
        self.rotations += 1
        log_event(log, "creds_rotated", node_id=self.node_id, file=str(self.creds_file),
                  user=parse_creds(text).user_key)
        await self._reply(msg, CredsRotationReply(accepted=True))
        await self.nc.force_reconnect()

    async def _reply(self, msg: Msg, reply: CredsRotationReply) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(reply.model_dump_json().encode())
            await self.nc.flush(timeout=self.timeout_s)
        except (nats.errors.Error, TimeoutError) as exc:
            log_event(log, "creds_rotation_reply_failed", logging.WARNING, error=repr(exc))
