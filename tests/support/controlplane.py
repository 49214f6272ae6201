"""A small, real control plane for tests and the lab demo: streams, enrollment, task queue, results.

It talks to a real ``nats-server -js`` with the same contract models the agent
uses (``gpuaas_agent.contract``), so a test exercises the wire, not a mock:

* :meth:`ControlPlane.create_streams` — the task stream (``gpuaas.node.*.task.>``,
  work-queue retention) and the result stream (``gpuaas.node.*.result``, limits
  retention with a duplicate window so ``Nats-Msg-Id`` dedupes republished results).
* Streams per node (``ControlPlane(..., per_node_streams=True)``; the supported layout, docs/contract.md
  "The node's streams"): each node gets its own task stream and result stream
  (``gpuaas_agent/control/streams.py``), created with its consumer (:meth:`create_node_streams`), so a
  node's forged ack or message id reaches only its own stream. :meth:`pending_tasks` and
  :meth:`stored_results` read the node's own streams then.
* :meth:`ControlPlane.create_task_partitions` — the fleet layout (docs/performance.md "Fleet layout"):
  instead of one task stream for every node, streams of ``per_stream`` nodes each
  (``GPUAAS_TASKS_<k>``, one ``gpuaas.node.<node>.task.>`` subject per member). The
  agent finds its stream by subject, so nothing changes on the node.
* :meth:`ControlPlane.serve_enrollment` answers ``gpuaas.enroll.nonce`` (single-use nonces)
  and ``gpuaas.enroll``: one-time tokens from :meth:`issue_token`, checked by their proof
  (``gpuaas_agent/control/tokenproof.py``; the token never arrives), a request whose nonce is
  unknown or spent refused (``nonce_invalid``: a replay), the nonce bound to the reply key its request
  named (a request with another key neither spends nor uses it) and every answer echoing
  ``reply_key_id`` of the request's key (the agent takes no other), a user JWT minted for the node's own
  public key (``tests/natsauth``: the plane never sees a seed) with exactly the node's
  permissions, sealed to the request's ``reply_public_key``; then the node's consumer is created
  (:meth:`create_node_consumer`: the node cannot).
* :meth:`issue_host_login` (account-per-node layout): a token with a bootstrap user of its own, which the
  plane revokes in the bootstrap account (and pushes) once that token's host has enrolled: the bootstrap
  login of an enrolled node is refused by the server.
* :meth:`serve_rotation` answers ``gpuaas.node.*.creds.renew`` (a JWT for a node's new key,
  whose possession the request proves); :meth:`rotate` orders a rotation.
* The account-per-node layout (``operator`` a :class:`~tests.natsauth.fleet.FleetOperator`,
  :meth:`connect_system` given the system account's login): enrollment also creates the node's
  account (imports of ``gpuaas_agent/control/accounts.py``) and pushes it to the server's resolver;
  node JWTs are signed by the node's account; a rotation order names a reply the node's account
  imports (``gpuaas.node.<node>.creds.reply.<token>``), since a stream import carries no way back.
* :meth:`watch_consumers` re-creates a node consumer whose cluster member is lost.
* :meth:`enqueue` / :meth:`enqueue_raw` put tasks on the queue; :meth:`wait_result`
  waits (with a deadline) for a result seen live; :meth:`stored_results` reads
  what the result stream persisted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import Header, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.base import SCHEMA_VERSION_AUTH
from gpuaas_agent.contract.enrollment import (
    SCHEMA_VERSION_AUTH_PREFIX,
    CredsRenewReply,
    CredsRenewRequest,
    CredsRotation,
    CredsRotationReply,
    EnrollNonce,
    EnrollNonceRequest,
    EnrollReply,
    EnrollRequest,
    NatsCredentials,
    reply_key_id,
)
from gpuaas_agent.contract.tasks import Heartbeat, ProgressEvent, TaskEnvelope, TaskResult
from gpuaas_agent.control.accounts import NODE_JS_API_PREFIX
from gpuaas_agent.control.nkeyseed import verify
from gpuaas_agent.control.permissions import consumer_name, node_permissions
from gpuaas_agent.control.rotation import renew_message
from gpuaas_agent.control.sealed import b64url, b64url_decode, seal_credentials
from gpuaas_agent.control.streams import (
    node_result_stream_config,
    node_task_stream_config,
    result_stream_name,
    task_stream_name,
)
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.tokenproof import proof_holds, token_id
from tests.natsauth.fleet import CLAIMS_UPDATE, FleetOperator
from tests.natsauth.natsjwt import Operator

TASK_STREAM = "GPUAAS_TASKS"
RESULT_STREAM = "GPUAAS_RESULTS"
REQUEST_TIMEOUT_S = 5.0
NONCE_TTL_S = 60.0


@dataclass
class IssuedToken:
    token: str
    expires_at: float
    node_id: str | None = None  # set once the token was used
    machine_id: str | None = None
    bootstrap_user: str | None = None  # the public key of the bootstrap user issued with it (issue_host_login)


@dataclass
class _Seen:
    """Messages seen live on core subscriptions, with a condition to wait on."""

    results: list[TaskResult] = field(default_factory=list)
    progress: list[ProgressEvent] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class ControlPlane:
    """Connect with :meth:`connect`; close with :meth:`close` (unsubscribes, then closes)."""

    def __init__(self, nc: Client, url: str, *, clock=time.time, operator: Operator | None = None,
                 per_node_streams: bool = False) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        self.url = url
        # Signs the nodes' user JWTs. A server without operator auth ignores them (most tests); one started
        # with operator.server_config() verifies them (tests/control/test_auth_secrets.py).
        self.operator = operator or Operator()
        self.tokens: dict[str, IssuedToken] = {}  # token_id -> the token (the plane's own copy)
        self.nonces: dict[str, tuple[float, str | None]] = {}  # issued, not yet spent -> (expiry, reply key bound)
        self.enroll_requests: list[EnrollRequest] = []
        self.issued_credentials: dict[str, NatsCredentials] = {}  # node id -> what was sealed to it
        self.bootstrap_logins_revoked: list[str] = []  # bootstrap users revoked and pushed (issue_host_login)
        self.node_keys: dict[str, list[str]] = {}  # node id -> every public key a JWT was minted for, in order
        self.drop_renew_replies = 0  # the next N renewal replies are "lost" (minted, never sent)
        # The consumer created for every enrolled node (ack_wait, replicas...): what its agent is configured with.
        self.consumer_settings = WorkerSettings()
        self.consumers: dict[str, WorkerSettings] = {}  # node id -> the settings its consumer was created with
        self.consumers_recreated: list[tuple[str, float]] = []  # (node id, time.monotonic()) per re-creation
        self._watch_task: asyncio.Task | None = None
        self.seen = _Seen()
        self._clock = clock
        self._subs: list = []
        self.partitioned = False  # tasks go to whichever stream holds their subject
        # Each node's own task and result stream (control/streams.py), made with its consumer; False: the shared
        # GPUAAS_TASKS / GPUAAS_RESULTS of create_streams (a node's forged ack or message id reaches other nodes').
        self.per_node_streams = per_node_streams
        self.system_nc: Client | None = None  # the system account's login (account-per-node: pushes accounts)
        # The JetStream API prefix sealed into enrollment replies: the node account's import prefix in the
        # account-per-node layout, none (the agent's config decides) in one account. A test sets it to what a
        # hostile or broken plane would send.
        self.reply_js_api_prefix: str | None = None

    @property
    def fleet(self) -> FleetOperator | None:
        """The account-per-node layout's operator, or None (one account for everyone)."""
        return self.operator if isinstance(self.operator, FleetOperator) else None

    async def connect_system(self, credentials: str) -> None:
        """Log in to the system account (a creds file): :meth:`push_node_account` needs it."""
        self.system_nc = await nats.connect(self.url, connect_timeout=REQUEST_TIMEOUT_S, name="test-control-plane-sys",
                                            user_credentials=credentials)

    async def push_node_account(self, node_id: str) -> None:
        """Create (or re-issue) the node's account, its imports naming the stream that holds its tasks, and push
        it to the server's resolver as ``nsc push`` does."""
        assert self.fleet is not None and self.system_nc is not None, "account-per-node needs connect_system()"
        try:
            stream = await self.js.find_stream_name_by_subject(subjects.tasks(node_id))
        except NotFoundError:
            stream = self._default_task_stream(node_id)
        self.fleet.node_account(node_id, stream)
        reply = await self.system_nc.request(CLAIMS_UPDATE, self.fleet.node_jwt(node_id).encode(),
                                             timeout=REQUEST_TIMEOUT_S)
        answer = json.loads(reply.data)
        if answer.get("error") or (answer.get("data") or {}).get("code") != 200:
            raise RuntimeError(f"the resolver refused {node_id}'s account: {answer}")

    def _default_task_stream(self, node_id: str) -> str:
        """The stream a node's tasks go to when none holds its subject yet (its account's imports name it)."""
        return task_stream_name(node_id) if self.per_node_streams else TASK_STREAM

    @classmethod
    async def connect(cls, url, *, operator: Operator | None = None, per_node_streams: bool = False,
                      **options) -> ControlPlane:
        """``options``: more nats.py connect options (``tls``, ``user_credentials``) for a secured server."""
        nc = await nats.connect(url, connect_timeout=REQUEST_TIMEOUT_S, name="test-control-plane",
                                reconnect_time_wait=0.2, max_reconnect_attempts=-1, **options)
        plane = cls(nc, url if isinstance(url, str) else url[0], operator=operator, per_node_streams=per_node_streams)
        await plane._watch()
        return plane

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        if self.system_nc is not None:
            await asyncio.wait_for(self.system_nc.close(), REQUEST_TIMEOUT_S)
        await asyncio.wait_for(self.nc.close(), REQUEST_TIMEOUT_S)

    # -- streams ------------------------------------------------------------------

    async def create_streams(self) -> None:
        """Idempotent: an existing stream with the same config is left as it is.

        With :attr:`per_node_streams`: no shared stream; the streams of every node known so far (each node's are
        made with its consumer, :meth:`create_node_consumer`).
        """
        if self.per_node_streams:
            await self._create_known_consumers()
            return
        await self.js.add_stream(StreamConfig(
            name=TASK_STREAM, subjects=["gpuaas.node.*.task.>"],
            retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
        ))
        await self.js.add_stream(StreamConfig(
            name=RESULT_STREAM, subjects=["gpuaas.node.*.result"],
            retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, duplicate_window=120,
        ))
        await self._create_known_consumers()

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
        await self._create_known_consumers()
        return names

    # -- enrollment ---------------------------------------------------------------

    def issue_token(self, ttl_s: float = 600.0) -> str:
        token = secrets.token_urlsafe(32)
        self.tokens[token_id(token)] = IssuedToken(token=token, expires_at=self._clock() + ttl_s)
        return token

    def issue_host_login(self, ttl_s: float = 600.0) -> tuple[str, str]:
        """``(token, bootstrap creds)`` for one host (what cloud-init delivers), account-per-node layout: the
        bootstrap user is this host's own, and the plane revokes it once the token's host has enrolled."""
        assert self.fleet is not None, "a bootstrap user needs the account-per-node layout"
        token = self.issue_token(ttl_s)
        creds, user = self.fleet.bootstrap_login()
        self.tokens[token_id(token)].bootstrap_user = user.public
        return token, creds

    async def push_bootstrap_account(self) -> None:
        """The bootstrap account's JWT (its revocations) to the resolver, as ``nsc push`` does."""
        assert self.system_nc is not None and self.fleet is not None, "connect_system first"
        reply = await self.system_nc.request(CLAIMS_UPDATE, self.fleet.bootstrap_jwt().encode(),
                                             timeout=REQUEST_TIMEOUT_S)
        answer = json.loads(reply.data)
        if answer.get("error") or (answer.get("data") or {}).get("code") != 200:
            raise RuntimeError(f"the resolver refused the bootstrap account: {answer}")

    async def serve_enrollment(self) -> None:
        self._subs.append(await self.nc.subscribe(subjects.ENROLL_NONCE, cb=self._on_nonce))
        self._subs.append(await self.nc.subscribe(subjects.ENROLL, cb=self._on_enroll))
        await self.nc.flush(timeout=REQUEST_TIMEOUT_S)

    async def _on_nonce(self, msg: Msg) -> None:
        try:
            asked = EnrollNonceRequest.model_validate_json(msg.data or b"{}")
        except ValidationError:
            return  # not a nonce request: no answer (it could name anyone's inbox)
        nonce = b64url(secrets.token_bytes(32))
        expires = self._clock() + NONCE_TTL_S
        self.nonces[nonce] = (expires, asked.reply_public_key)
        bound = None if asked.reply_public_key is None else reply_key_id(asked.reply_public_key)
        reply = EnrollNonce(nonce=nonce, expires_at=datetime.fromtimestamp(expires, UTC), reply_key_id=bound)
        await msg.respond(reply.model_dump_json().encode())

    def mint_jwt(self, node_id: str, public_key: str) -> str:
        """A user JWT for the node's own key with exactly the node's permissions (control/permissions.py)."""
        self.node_keys.setdefault(node_id, []).append(public_key)
        if self.fleet is not None:  # signed by the node's own account (made here on enrollment)
            self.fleet.node_account(node_id, self.fleet.streams.get(node_id, self._default_task_stream(node_id)))
            return self.fleet.node_user_jwt(node_id, public_key)
        perms = node_permissions(node_id)
        return self.operator.user_jwt_for(public_key, node_id, pub=perms["publish"], sub=perms["subscribe"],
                                          responses=1)

    def _answer(self, raw: bytes) -> EnrollReply:
        try:
            request = EnrollRequest.model_validate_json(raw)
        except ValidationError:
            return EnrollReply(accepted=False, error="token_invalid", message="request does not match the contract")
        self.enroll_requests.append(request)
        bound = reply_key_id(request.reply_public_key)
        # A nonce bound to another attempt's key (heard on a shared inbox) is neither used nor spent: refused.
        held = self.nonces.get(request.server_nonce)
        if held is not None and held[1] is not None and held[1] != request.reply_public_key:
            return EnrollReply(accepted=False, error="nonce_invalid", reply_key_id=bound,
                               message="the server nonce was issued to another enrollment attempt")
        # The nonce is spent by the first request that names it, whatever comes next: a replay finds it gone.
        held = self.nonces.pop(request.server_nonce, None)
        if held is None or self._clock() >= held[0]:
            return EnrollReply(accepted=False, error="nonce_invalid", reply_key_id=bound,
                               message="unknown, spent or expired server nonce (a replayed request?)")
        issued = self.tokens.get(request.token_id)
        if issued is None or not proof_holds(issued.token, request):
            return EnrollReply(accepted=False, error="token_invalid", reply_key_id=bound,
                               message="unknown bootstrap token or bad proof")
        if issued.node_id is not None:
            return EnrollReply(accepted=False, error="token_reused", reply_key_id=bound,
                               message=f"token already used by {issued.node_id}")
        if self._clock() >= issued.expires_at:
            return EnrollReply(accepted=False, error="token_expired", reply_key_id=bound,
                               message="bootstrap token expired")
        node_id = "node-" + hashlib.sha256(request.machine_id.encode()).hexdigest()[:12]
        prefix = self.reply_js_api_prefix
        if prefix is None and self.fleet is not None:
            prefix = NODE_JS_API_PREFIX  # where the node's account imports the JetStream API (accounts.py)
        credentials = NatsCredentials(user_jwt=self.mint_jwt(node_id, request.node_public_key), servers=[self.url],
                                      js_api_prefix=prefix)
        try:
            sealed = seal_credentials(credentials, request, node_id)
        except ValueError:  # a low-order reply_public_key: nothing can be sealed to it; the token stays unused
            return EnrollReply(accepted=False, error="token_invalid", reply_key_id=bound,
                               message="reply_public_key is not usable")
        issued.node_id, issued.machine_id = node_id, request.machine_id
        self.issued_credentials[node_id] = credentials
        version = SCHEMA_VERSION_AUTH if prefix is None else SCHEMA_VERSION_AUTH_PREFIX  # v2.1 names the prefix
        return EnrollReply(schema_version=version, accepted=True, node_id=node_id, sealed_credentials=sealed,
                           reply_key_id=bound)

    async def _on_enroll(self, msg: Msg) -> None:
        reply = self._answer(msg.data)
        if reply.accepted and reply.node_id is not None:
            # Before the answer: the agent binds right after. Not created (no stream yet, a busy cluster): the
            # agent waits for it (consumer_missing); create_streams or watch_consumers creates it later.
            with contextlib.suppress(Exception):
                await self.create_node_consumer(reply.node_id)
            if self.fleet is not None:  # its account exists before its first login
                await self.push_node_account(reply.node_id)
        await msg.respond(reply.model_dump_json().encode())
        issued = next((t for t in self.tokens.values() if t.node_id == reply.node_id), None) if reply.accepted else None
        if issued is not None and issued.bootstrap_user is not None:
            # The answer must have reached the server before the revocation does: the revocation travels on the
            # system account's connection and closes the login at once, so an answer still in this client's
            # buffer would be lost with it and the host left with neither its credentials nor a login to ask again.
            await self.nc.flush(timeout=REQUEST_TIMEOUT_S)
        if self.fleet is not None and issued is not None and issued.bootstrap_user is not None:
            # After the answer (the revocation closes the login's connection at once): the host's own bootstrap
            # user has done its one job, and the server refuses it from now on.
            self.fleet.revoke_bootstrap(issued.bootstrap_user)
            await self.push_bootstrap_account()
            self.bootstrap_logins_revoked.append(issued.bootstrap_user)

    # -- rotation -----------------------------------------------------------------

    async def serve_rotation(self) -> None:
        self._subs.append(await self.nc.subscribe("gpuaas.node.*.creds.renew", cb=self._on_renew))
        await self.nc.flush(timeout=REQUEST_TIMEOUT_S)

    def _renew(self, subject: str, raw: bytes) -> CredsRenewReply:
        node_id = subject.split(".")[2]  # who sent it: the server lets a node publish only its own subject
        try:
            request = CredsRenewRequest.model_validate_json(raw)
        except ValidationError:
            return CredsRenewReply(accepted=False, error="invalid_message", message="not a CredsRenewRequest")
        if request.node_id != node_id:
            return CredsRenewReply(accepted=False, error="wrong_node", message="node id differs from the subject's")
        if not verify(request.node_public_key, b64url_decode(request.signature),
                      renew_message(node_id, request.node_public_key)):
            return CredsRenewReply(accepted=False, error="creds_renew_refused", message="no proof of the new key")
        return CredsRenewReply(accepted=True, user_jwt=self.mint_jwt(node_id, request.node_public_key))

    async def _on_renew(self, msg: Msg) -> None:
        reply = self._renew(msg.subject, msg.data)
        if self.drop_renew_replies > 0:
            self.drop_renew_replies -= 1
            return
        await msg.respond(reply.model_dump_json().encode())

    async def rotate(self, node_id: str, *, timeout: float = 15.0, order_for: str | None = None) -> CredsRotationReply:
        """Order ``node_id`` to rotate its key; the agent's answer (sent before it reconnects).

        ``order_for``: the node the order itself names, when a test sends ``node_id`` an order for another.
        """
        order = CredsRotation(node_id=order_for or node_id).model_dump_json().encode()
        if self.fleet is None:
            # No responders: the node's subscription is not on the server yet (just connected or reconnected; a
            # client resends its subscriptions after its connect). Nobody got the order, so it is sent again, as a
            # control plane must (docs/security-auth.md).
            deadline = time.monotonic() + timeout
            while True:
                try:
                    msg = await self.nc.request(subjects.creds(node_id), order,
                                                timeout=max(0.1, deadline - time.monotonic()))
                    return CredsRotationReply.model_validate_json(msg.data)
                except nats.errors.NoRespondersError:
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.1)  # a retry's pace, not a synchronisation: the loop waits on the answer
        # The order crosses into the node's account by a stream import, which carries no way back: the reply
        # names a subject the node's account imports as a service from ours.
        reply = subjects.creds_reply(node_id, secrets.token_hex(8))
        sub = await self.nc.subscribe(reply)
        deadline = time.monotonic() + timeout
        try:
            while True:
                await self.nc.publish(subjects.creds(node_id), order, reply=reply)
                msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
                if msg.data:
                    break
                # An empty answer with status 503 is the server's "no responders": the node's subscription is
                # not wired into this account yet (just logged in or reconnected). Nobody got the order: again.
                if (msg.headers or {}).get(Header.STATUS) != "503" or time.monotonic() >= deadline:
                    raise RuntimeError(f"empty answer to the rotation order: headers {msg.headers}")
                await asyncio.sleep(0.1)  # a retry's pace, not a synchronisation: the loop waits on the answer
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return CredsRotationReply.model_validate_json(msg.data)

    # -- node consumers -----------------------------------------------------------

    async def create_node_streams(self, node_id: str) -> None:
        """The node's own task and result streams (``control/streams.py``); idempotent."""
        await self.js.add_stream(node_task_stream_config(node_id))
        await self.js.add_stream(node_result_stream_config(node_id))

    async def create_node_consumer(self, node_id: str, settings: WorkerSettings | None = None, *,
                                   timeout: float = REQUEST_TIMEOUT_S) -> bool:
        """Create (or update) the node's pull consumer on the stream holding its tasks; False: no stream yet.

        ``settings``: what the node's agent is configured with (default :attr:`consumer_settings`). With
        :attr:`per_node_streams` the node's streams are made first (so there always is one).
        """
        settings = settings or self.consumers.get(node_id) or self.consumer_settings
        self.consumers[node_id] = settings
        if self.per_node_streams:
            await self.create_node_streams(node_id)
        try:
            stream = await self.js.find_stream_name_by_subject(subjects.tasks(node_id))
        except NotFoundError:
            return False  # create_streams / create_task_partitions creates it once the stream exists
        await self.js.add_consumer(stream, settings.consumer_config(node_id), timeout=timeout)
        fleet = self.fleet
        if fleet is not None and node_id in fleet.nodes and fleet.streams.get(node_id) != stream \
                and self.system_nc is not None:
            await self.push_node_account(node_id)  # its imports name the stream: re-issued when it moves
        return True

    async def _create_known_consumers(self) -> None:
        for node_id in list(self.consumers):
            await self.create_node_consumer(node_id)

    def watch_consumers(self, *, interval_s: float = 1.0, probe_timeout_s: float = 1.0) -> None:
        """Every ``interval_s``, look up each node consumer; one that does not answer (its R1 member is lost)
        is deleted and created again, on a member that is up. Mirrors what a control plane must do."""
        async def watch() -> None:
            while True:
                for node_id in list(self.consumers):
                    await self._probe(node_id, probe_timeout_s)
                await asyncio.sleep(interval_s)  # the watch's own period, not a synchronisation
        self._watch_task = asyncio.create_task(watch())

    async def _probe(self, node_id: str, timeout: float) -> None:
        try:
            stream = await self.js.find_stream_name_by_subject(subjects.tasks(node_id))
        except Exception:  # no stream (yet), or no meta leader now: the next round
            return
        try:
            await self.js.consumer_info(stream, consumer_name(node_id), timeout=timeout)
            return
        except NotFoundError:
            pass  # deleted: created again below
        except Exception:  # no answer: the consumer's only member is gone (or a stream election)
            pass
        # The meta leader applies a delete of a leaderless R1 consumer although its reply never comes.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.js.delete_consumer(stream, consumer_name(node_id)), timeout)
        with contextlib.suppress(Exception):  # no answer: placed on the lost member again; the next round retries
            if await self.create_node_consumer(node_id, timeout=2 * timeout):
                self.consumers_recreated.append((node_id, time.monotonic()))

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
        shared = not (self.partitioned or self.per_node_streams)
        ack = await self.js.publish(subject, data, timeout=REQUEST_TIMEOUT_S,
                                    stream=TASK_STREAM if shared else None, headers=headers)
        return ack.seq

    async def pending_tasks(self, node_id: str | None = None) -> int:
        """Tasks queued (not acked): ``node_id``'s own with :attr:`per_node_streams` (None: every known node's)."""
        if not self.per_node_streams:
            info = await self.js.stream_info(TASK_STREAM)
            return info.state.messages
        total = 0
        for node in [node_id] if node_id is not None else list(self.consumers):
            total += (await self.js.stream_info(task_stream_name(node))).state.messages
        return total

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
        """Every result the result stream persisted (duplicates dropped by ``Nats-Msg-Id`` are absent).

        With :attr:`per_node_streams`: ``node_id``'s own result stream (None: every known node's, node by node).
        """
        if not self.per_node_streams:
            return await self.stored_in(RESULT_STREAM, node_id)
        out: list[TaskResult] = []
        for node in [node_id] if node_id is not None else list(self.consumers):
            out += await self.stored_in(result_stream_name(node), node)
        return out

    async def stored_in(self, stream: str, node_id: str | None = None) -> list[TaskResult]:
        """What ``stream`` persisted (``node_id``'s results only, when given)."""
        info = await self.js.stream_info(stream)
        out: list[TaskResult] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            if info.state.messages == 0:
                break
            try:
                raw = await self.js.get_msg(stream, seq)
            except NotFoundError:
                continue
            if node_id is None or raw.subject == subjects.result(node_id):
                out.append(TaskResult.model_validate_json(raw.data))
        return out
