"""Credential rotation: a new NKEY pair born here, a JWT asked for it, the old seed deleted once the new login works.

The control plane orders a rotation on ``gpuaas.node.<node>.creds`` (a :class:`CredsRotation`
carrying no secret). The agent:

1. checks the order names this node (``wrong_node`` otherwise);
2. makes a new key pair in memory and asks ``gpuaas.node.<node>.creds.renew`` for a user JWT
   for its public key, proving possession with a signature by the new seed. Only the public key
   and the signature travel. No answer, a refusal, or a JWT for another key or already expired:
   nothing is written, the order is answered ``accepted=false``, the node keeps logging in with
   its current ``.creds`` (``creds_rotation_failed``);
3. keeps the current file as ``nats.creds.prev`` (0600), writes the new ``.creds`` atomically;
4. answers the order (``accepted``, the new public key) on the old login, then reconnects: nats.py
   re-reads the file at every (re)connect;
5. a reconnect that comes back up is the server's confirmation of the new credentials: only then is
   ``nats.creds.prev`` deleted (``creds_rotation_confirmed``). No confirmation within
   ``confirm_s`` (the server refuses the new JWT): the previous file is put back and the node goes on
   with its previous credentials (``creds_rotation_reverted``).

Running slices, handlers and the task consumer all live on; only the connection is renewed.
Only the control plane may publish on the order's subject (docs/security-auth.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.enrollment import (
    RENEW_SCHEME,
    CredsRenewReply,
    CredsRenewRequest,
    CredsRotation,
    CredsRotationReply,
)
from gpuaas_agent.control.nkeyseed import new_user_seed, public_key, sign
from gpuaas_agent.control.transport import TransportError, creds_text, jwt_claims
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)


def rotation_subject(node_id: str) -> str:
    return subjects.creds(node_id)


def renew_message(node_id: str, node_public_key: str) -> bytes:
    """The bytes the new seed signs in a :class:`CredsRenewRequest` (uint16 length-prefixed fields)."""
    return b"".join(len(p).to_bytes(2, "big") + p for p in (RENEW_SCHEME.encode(), node_id.encode(),
                                                              node_public_key.encode()))


def previous_path(creds_file: Path) -> Path:
    """Where the current ``.creds`` waits, during a rotation, until the new one is confirmed."""
    return creds_file.with_name(creds_file.name + ".prev")


def revert_unconfirmed_rotation(creds_file: Path) -> bool:
    """The server refused the installed ``.creds`` while a previous one waits (the agent stopped between a
    rotation's install and its confirmation): put the previous one back. True when it did."""
    previous = previous_path(creds_file)
    if not previous.exists():
        return False
    os.replace(previous, creds_file)
    log_event(log, "creds_rotation_reverted", logging.WARNING, file=str(creds_file),
              reason="the server refused the unconfirmed new credentials at connect")
    return True


class CredsRotator:
    """Subscribe with :meth:`start`; every valid order renews ``creds_file`` and reconnects ``nc``."""

    def __init__(self, nc: Client, node_id: str, creds_file: Path, *, timeout_s: float = 5.0,
                 confirm_s: float = 60.0) -> None:
        self.nc = nc
        self.node_id = node_id
        self.creds_file = creds_file
        self.timeout_s = timeout_s
        self.confirm_s = confirm_s
        self.rotations = 0  # new credentials installed
        self.confirmed = 0  # ... and confirmed by a reconnect
        self._sub: Subscription | None = None
        self._lock = asyncio.Lock()
        self._confirm: asyncio.Event | None = None
        self._watch: asyncio.Task[None] | None = None
        listeners = getattr(nc, "reconnect_listeners", None)
        if listeners is not None:
            listeners.append(self._on_reconnect)
        # A previous file left by a crash between install and confirmation: the next connect tells.
        if previous_path(creds_file).exists():
            self._confirm = asyncio.Event()

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(rotation_subject(self.node_id), cb=self._on_message)
        if self._confirm is not None and self.nc.is_connected:  # we are connected, so the file in place works
            self._confirmed()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def _on_message(self, msg: Msg) -> None:
        if msg.subject != rotation_subject(self.node_id) or (msg.reply or "").startswith("$JS."):
            # Another node named our subject as the reply of its own JetStream request (NATS checks no reply
            # subject against permissions): the server delivers its pulled task (original subject kept) or an
            # API response here. Never answered: a reply to a $JS.ACK subject would ack that node's task.
            log_event(log, "creds_rotation_ignored", logging.WARNING, subject=msg.subject,
                      reason="not a rotation order (a message the server delivered here on another's request)")
            return
        async with self._lock:  # one rotation at a time
            try:
                key = await self._rotate(msg.data)
            except TransportError as exc:
                log_event(log, "creds_rotation_failed", logging.WARNING, code=exc.code, message=exc.message,
                          keeps="the current credentials")
                await self._reply(msg, CredsRotationReply(accepted=False, error=exc.code, message=exc.message))
                return
            await self._reply(msg, CredsRotationReply(accepted=True, node_public_key=key))
            self._confirm = asyncio.Event()
            self._watch = asyncio.create_task(self._await_confirmation(self._confirm))
            await self.nc.force_reconnect()

    async def _rotate(self, data: bytes) -> str:
        """Steps 1-3: the new public key, with the new ``.creds`` installed and the old one kept aside."""
        from gpuaas_agent.control.sealed import b64url

        try:
            order = CredsRotation.model_validate_json(data)
        except ValidationError as exc:
            raise TransportError("rotation order does not match the contract", code="invalid_message",
                                 evidence={"errors": exc.errors(include_url=False, include_input=False)}) from None
        if order.node_id != self.node_id:
            raise TransportError(f"rotation names node {order.node_id}, this is {self.node_id}", code="wrong_node",
                                 evidence={"node_id": order.node_id})
        seed = new_user_seed()
        key = public_key(seed)
        request = CredsRenewRequest(node_id=self.node_id, node_public_key=key,
                                    signature=b64url(sign(seed, renew_message(self.node_id, key))))
        try:
            answer = await self.nc.request(subjects.creds_renew(self.node_id), request.model_dump_json().encode(),
                                           timeout=self.timeout_s)
        except (nats.errors.Error, TimeoutError) as exc:
            raise TransportError(f"no answer to the renewal request within {self.timeout_s:g}s ({exc!r})",
                                 code="creds_renew_unanswered", evidence={"node_public_key": key}) from None
        try:
            reply = CredsRenewReply.model_validate_json(answer.data)
        except ValidationError as exc:
            raise TransportError("renewal reply does not match the contract", code="invalid_message",
                                 evidence={"errors": exc.errors(include_url=False, include_input=False)}) from None
        if not reply.accepted or reply.user_jwt is None:
            raise TransportError(reply.message or "the control plane refused the renewal",
                                 code=reply.error or "creds_renew_refused", evidence={"node_public_key": key})
        claims = jwt_claims(reply.user_jwt)
        if claims.get("sub") != key:
            raise TransportError("the renewed JWT is not for the new key", code="creds_invalid",
                                 evidence={"jwt_subject": claims.get("sub"), "node_public_key": key})
        exp = claims.get("exp")
        if isinstance(exp, (int, float)) and 0 < exp <= time.time():
            raise TransportError("the renewed JWT is already expired", code="creds_expired",
                                 evidence={"expires_at": exp, "user": key})
        previous = previous_path(self.creds_file)
        if self.creds_file.exists() and not previous.exists():
            os.link(self.creds_file, previous)  # the same inode, 0600: the old login until the new one is confirmed
        write_atomic(self.creds_file, creds_text(reply.user_jwt, seed).encode(), mode=0o600)
        self.rotations += 1
        log_event(log, "creds_rotated", node_id=self.node_id, file=str(self.creds_file), node_public_key=key)
        return key

    def _on_reconnect(self) -> None:
        if self._confirm is not None:
            self._confirmed()

    def _confirmed(self) -> None:
        """Logged in with the file in place: the previous seed is deleted."""
        assert self._confirm is not None
        self._confirm.set()
        self._confirm = None
        with contextlib.suppress(FileNotFoundError):
            previous_path(self.creds_file).unlink()
            self.confirmed += 1
            log_event(log, "creds_rotation_confirmed", node_id=self.node_id, previous_deleted=True)

    async def _await_confirmation(self, confirmed: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(confirmed.wait(), self.confirm_s)
            return
        previous = previous_path(self.creds_file)
        if previous.exists():
            os.replace(previous, self.creds_file)
            self._confirm = None
            log_event(log, "creds_rotation_reverted", logging.WARNING, node_id=self.node_id,
                      reason=f"no login with the new credentials within {self.confirm_s:g}s")

    async def _reply(self, msg: Msg, reply: CredsRotationReply) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(reply.model_dump_json().encode())
            await self.nc.flush(timeout=self.timeout_s)  # type: ignore[arg-type]  # nats.py says int; seconds
        except (nats.errors.Error, TimeoutError) as exc:
            log_event(log, "creds_rotation_reply_failed", logging.WARNING, error=repr(exc))
