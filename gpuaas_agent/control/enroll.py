"""Enrollment on ``gpuaas.enroll``: a key pair born here, the token proven, a user JWT back; stored 0600.

No secret travels. The agent makes its NKEY pair here (``control/nkeyseed.py``) and sends only
the public key; it asks ``gpuaas.enroll.nonce`` for a single-use nonce and proves the bootstrap
token with an HMAC over it (``control/tokenproof.py``) instead of sending the token. The reply is
a user JWT for the node's key, sealed to this attempt's X25519 key (``control/sealed.py``). The
seed is written once, with the JWT, to ``<state_dir>/nats.creds`` (0600, atomic), the file
nats.py reads on every connect; ``enrollment.json`` holds the node id, servers and JWT, never a
seed.

The record is written atomically (temp file created 0600, fsync, rename, fsync
of the directory) so a crash leaves either no record or a whole one; the token
file is removed only after the record is on disk. Enrolling when a record
exists sends nothing: the token was spent already and a second request would
be refused as ``token_reused``.

The exchange runs over the configured transport (TLS unless ``insecure``, see
``control/transport.py``), and the replies come on this attempt's inbox
(``_INBOX.enroll.<reply_key_id>.``). The bootstrap login is shared, and the server checks no
request's reply subject, so another holder of it can hear that inbox and have the plane answer
its own requests there: every answer taken is bound to this attempt (``reply_key_id`` of its
X25519 key, echoed by the plane; the nonce is bound to that key too), and an answer with any other
binding is ignored (``enroll_reply_not_ours``) while the request's deadline runs. Once enrolled,
the bootstrap login leaves the host: the file named ``nats_enroll_creds_file`` is deleted with the
token (the plane revokes a host's own bootstrap user at its enrollment,
docs/security-auth.md "The bootstrap login"). A reply that carries credentials in clear is refused
(``enroll_reply_unsealed``), one whose seal does not open too (``enroll_reply_tampered``), one
whose credentials carry a password (``enroll_reply_carries_secret``) or a JWT for another key
(``enroll_reply_wrong_key``) as well: nothing is written and the token stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.compat import UTC
from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.enrollment import (
    EnrollNonce,
    EnrollNonceRequest,
    EnrollReply,
    EnrollRequest,
    NatsCredentials,
    js_api_prefix_problem,
    reply_key_id,
)
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN
from gpuaas_agent.control.connection import connect_nats, safe_url
from gpuaas_agent.control.nkeyseed import new_user_seed, public_key
from gpuaas_agent.control.transport import (
    TransportError,
    TransportSecurity,
    creds_text,
    jwt_claims,
    parse_creds,
)
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

log = logging.getLogger(__name__)

ENROLL_SUBJECT = subjects.ENROLL
NONCE_SUBJECT = subjects.ENROLL_NONCE
RECORD_NAME = "enrollment.json"
RECORD_VERSION = "gpuaas.agent.enrollment/v2"  # v2: no seed in the record (v1 records are scrubbed on load)
RECORD_VERSION_V1 = "gpuaas.agent.enrollment/v1"
CREDS_NAME = "nats.creds"
ENROLL_INBOX_PREFIX = subjects.ENROLL_INBOX_PREFIX


class EnrollError(AgentError):
    """Enrollment refused or impossible; ``code`` is the control plane's (``token_reused``...) or ours."""

    default_code = "enroll_failed"


class EnrollIdentity(BaseModel):
    """What the agent says about itself (the host-side half of ``EnrollRequest``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    machine_id: str
    hostname: str
    dmi_serial: str | None = None
    maas_system_id: str | None = None
    agent_version: str


class EnrollmentRecord(WireModel):
    """``<state_dir>/enrollment.json``: who this node is and how it logs in (mode 0600)."""

    record_version: str = RECORD_VERSION
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    credentials: NatsCredentials  # the servers and the user JWT (public); the seed is in nats.creds only
    enrolled_at: datetime

    @model_validator(mode="after")
    def _js_api_prefix_is_plain(self) -> EnrollmentRecord:
        prefix = self.credentials.js_api_prefix
        problem = None if prefix is None else js_api_prefix_problem(prefix)
        if problem is not None:
            raise ValueError(f"credentials.js_api_prefix {self.credentials.js_api_prefix!r}: {problem}")
        return self


def record_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / RECORD_NAME


def creds_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / CREDS_NAME


def store_creds(state_dir: str | Path, creds: str) -> Path:
    """Write a ``.creds`` 0600 atomically (a reader sees the old file or the new one); ``creds_invalid`` first."""
    parse_creds(creds, source="the received credentials")
    path = creds_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, creds.encode() if creds.endswith("\n") else (creds + "\n").encode(), mode=0o600)
    return path


def load_enrollment(state_dir: str | Path) -> EnrollmentRecord | None:
    """The stored record, None when not enrolled; a damaged record is an error, never ignored."""
    path = record_path(state_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    with contextlib.suppress(ValueError, RecursionError):
        raw = _scrub_v1_record(Path(state_dir), json.loads(raw)) or raw
    try:
        return EnrollmentRecord.model_validate_json(raw)
    except ValidationError as exc:
        raise EnrollError(
            f"enrollment record {path} is damaged; move it away and enroll again with a new token",
            code="enrollment_record_invalid",
            evidence={"path": str(path), "errors": exc.errors(include_url=False, include_input=False)},
        ) from None



def _scrub_v1_record(state_dir: Path, doc: object) -> bytes | None:
    """A v1 record kept the NKEY seed (``credentials.creds``): rewrite it without, once; None if not v1.

    The seed's only home is ``nats.creds``. When that file exists the seed in the record is a copy
    and is dropped; when it is missing the record's copy is moved there (WARNING
    ``enrollment_record_migrated``), the one time a seed is written from the record.
    """
    if not isinstance(doc, dict) or doc.get("record_version") != RECORD_VERSION_V1:
        return None
    creds = (doc.get("credentials") or {}).pop("creds", None)
    restored = False
    if isinstance(creds, str):
        lines = [line.strip() for line in creds.splitlines()]
        with contextlib.suppress(ValueError, IndexError):
            doc["credentials"]["user_jwt"] = lines[lines.index("-----BEGIN NATS USER JWT-----") + 1]
        if not creds_path(state_dir).exists():
            store_creds(state_dir, creds)
            restored = True
    doc["record_version"] = RECORD_VERSION
    data = json.dumps(doc, indent=2).encode()
    write_atomic(record_path(state_dir), data, mode=0o600)
    log_event(log, "enrollment_record_migrated", logging.WARNING, path=str(record_path(state_dir)),
              seed_removed=creds is not None, creds_file_written=restored)
    return data


def _read_token(token_file: Path) -> str:
    try:
        token = token_file.read_text().strip()
    except FileNotFoundError:
        raise EnrollError(
            f"not enrolled and no bootstrap token at {token_file}",
            code="token_missing",
            evidence={"token_file": str(token_file)},
        ) from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, binary junk
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise EnrollError(f"bootstrap token {token_file} cannot be read: {reason}", code="token_unreadable",
                          evidence={"token_file": str(token_file), "error": reason}) from None
    if not token:
        raise EnrollError(f"bootstrap token file {token_file} is empty", code="token_missing",
                          evidence={"token_file": str(token_file)})
    return token


def _clear_credentials(data: bytes) -> bool:
    """Whether the reply carries a clear-text ``credentials`` object (what a pre-seal control plane sends)."""
    with contextlib.suppress(ValueError, RecursionError):  # junk is for the contract check below
        doc = json.loads(data)
        return isinstance(doc, dict) and doc.get("credentials") is not None
    return False


def _open_reply(data: bytes, reply_key: X25519PrivateKey, request: EnrollRequest, nats_url: str,
                identity: EnrollIdentity) -> tuple[NatsCredentials, str]:
    """``(credentials, node_id)`` of an accepted, sealed reply; EnrollError for anything else."""
    from gpuaas_agent.control.sealed import SealError, open_credentials

    where = {"nats_url": safe_url(nats_url), "hostname": identity.hostname}
    if _clear_credentials(data):
        # The secret was already readable on the inbox: refuse it, so a control plane that answers in
        # clear is noticed at its first host, and the operator rotates what it exposed.
        raise EnrollError("enrollment reply carries the credentials in clear (readable by anyone on the inbox); "
                          "refused, nothing stored: upgrade the control plane to seal them, then revoke what it sent",
                          code="enroll_reply_unsealed", evidence=where)
    try:
        reply = EnrollReply.model_validate_json(data)
    except ValidationError as exc:
        raise EnrollError("enrollment reply does not match the contract", code="invalid_message",
                          evidence={"errors": exc.errors(include_url=False, include_input=False)}) from None
    if not reply.accepted or reply.node_id is None:
        code = reply.error or "enroll_refused"
        raise EnrollError(reply.message or f"enrollment refused: {code}", code=code, evidence=where)
    if reply.sealed_credentials is None:
        raise EnrollError("enrollment reply accepted without sealed credentials; refused, nothing stored",
                          code="enroll_reply_unsealed", evidence={**where, "node_id": reply.node_id})
    try:
        credentials = open_credentials(reply.sealed_credentials, reply_key, request, reply.node_id)
    except SealError as exc:
        raise EnrollError(exc.message, code=exc.code, evidence={**where, **exc.evidence}) from None
    where = {**where, "node_id": reply.node_id}
    if credentials.user_jwt is None:
        # A password travelled (sealed, but a secret made off the host): refused, the keys are born here.
        raise EnrollError("enrollment reply carries a password instead of a user JWT for this node's key; "
                          "refused, nothing stored: the control plane must sign a JWT for node_public_key",
                          code="enroll_reply_carries_secret", evidence=where)
    subject = jwt_claims(credentials.user_jwt).get("sub")
    if subject != request.node_public_key:
        raise EnrollError("enrollment reply's user JWT is not for this node's public key; refused, nothing stored",
                          code="enroll_reply_wrong_key",
                          evidence={**where, "jwt_subject": subject, "node_public_key": request.node_public_key})
    prefix = credentials.js_api_prefix
    problem = None if prefix is None else js_api_prefix_problem(prefix)
    if problem is not None:
        # Where the node would send its JetStream requests: a wildcard or another node's subjects would have the
        # node publish (and the server answer) there. Refused whole: a reply with one bad field is not half-used.
        raise EnrollError(f"enrollment reply's js_api_prefix {prefix!r} is refused: {problem}; nothing stored, "
                          "the token was kept: check the control plane's account layout",
                          code="enroll_reply_bad_js_prefix", evidence={**where, "js_api_prefix": prefix})
    return credentials, reply.node_id


def _bound_to(data: bytes) -> str | None:
    """The ``reply_key_id`` an answer carries (None: junk, or an answer without a binding)."""
    with contextlib.suppress(ValueError, RecursionError):
        doc = json.loads(data)
        if isinstance(doc, dict) and isinstance(doc.get("reply_key_id"), str):
            return str(doc["reply_key_id"])
    return None


async def _request(nc: Client, subject: str, data: bytes, nats_url: str, timeout: float, *, bound_to: str) -> Msg:
    """One request/reply of enrollment, answered to this attempt (``reply_key_id`` = ``bound_to``).

    Any other message on the inbox (the plane's answer to another holder's request, made to name our
    inbox) is logged and ignored while the deadline runs; ``enroll_unreachable`` when nothing bound to
    us answers in time, nothing listens, or the connection breaks.
    """
    where = {"nats_url": safe_url(nats_url), "subject": subject}
    inbox = nc.new_inbox()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(subject, data, reply=inbox)
            while True:
                msg = await sub.next_msg(timeout=max(deadline - loop.time(), 0.001))
                if msg.headers and msg.headers.get("Status") == "503":
                    raise EnrollError(f"no enrollment answer on {subject} from {safe_url(nats_url)} "
                                      "(no responders)", code="enroll_unreachable", evidence=where)
                if _bound_to(msg.data) == bound_to:
                    return msg
                log_event(log, "enroll_reply_not_ours", logging.WARNING, subject=subject,
                          bound_to=_bound_to(msg.data), expected=bound_to, ignored=True)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
    except (nats.errors.TimeoutError, TimeoutError):
        raise EnrollError(f"no enrollment answer on {subject} from {safe_url(nats_url)} within {timeout:g}s "
                          "(timed out)", code="enroll_unreachable", evidence=where) from None
    except nats.errors.Error as exc:  # the connection broke under the request
        raise EnrollError(f"enrollment request to {safe_url(nats_url)} failed: {exc}", code="enroll_unreachable",
                          evidence={**where, "error": repr(exc)}) from None


def _nonce(data: bytes) -> str:
    try:
        return EnrollNonce.model_validate_json(data).nonce
    except ValidationError as exc:
        raise EnrollError("enrollment nonce reply does not match the contract (a control plane from before "
                          "token proofs?)", code="invalid_message",
                          evidence={"errors": exc.errors(include_url=False, include_input=False)}) from None


async def enroll(
    nats_url: str,
    token_file: str | Path,
    state_dir: str | Path,
    identity: EnrollIdentity,
    *,
    timeout: float = 10.0,
    connect_timeout: float | None = None,
    security: TransportSecurity | None = None,
) -> EnrollmentRecord:
    """Enroll this host once; returns the stored record (the existing one when already enrolled).

    ``connect_timeout`` bounds reaching NATS (default ``timeout``), ``timeout`` the request:
    a server that is down, silent or refuses us is one :class:`NatsConnectError`
    (``nats_unreachable``/``nats_auth_refused``) after at most ``connect_timeout``.
    """
    existing = load_enrollment(state_dir)
    if existing is not None:
        log_event(log, "enroll_skipped", reason="already_enrolled", node_id=existing.node_id)
        remove_bootstrap_login(security, state_dir)  # a crash after the record may have left it
        return existing

    token_file = Path(token_file)
    token = _read_token(token_file)
    from gpuaas_agent.control.sealed import new_reply_key, public_key_text
    from gpuaas_agent.control.tokenproof import token_id, token_proof

    seed = new_user_seed()  # the node's key, born here; only its public half is sent
    reply_key = new_reply_key()  # this attempt's only: the credentials come back sealed to it

    # Bounded: connect_timeout + 2 * timeout in all, so ExecStartPre ends well inside the unit's start timeout.
    # ``security``: TLS settings and the bootstrap login (TransportSecurity.from_config(config, enroll=True)).
    bound_to = reply_key_id(public_key_text(reply_key))  # what every answer to this attempt echoes
    nc = await connect_nats([nats_url], timeout_s=connect_timeout or timeout, name="gpuaas-agent-enroll",
                            security=security, inbox_prefix=subjects.enroll_inbox_prefix(bound_to))
    try:
        asked = EnrollNonceRequest(reply_public_key=public_key_text(reply_key))
        nonce = _nonce((await _request(nc, NONCE_SUBJECT, asked.model_dump_json().encode(), nats_url, timeout,
                                       bound_to=bound_to)).data)
        try:
            fields: dict[str, Any] = {"server_nonce": nonce, "token_id": token_id(token), "node_public_key": public_key(seed),
                      "machine_id": identity.machine_id, "reply_public_key": public_key_text(reply_key)}
            request = EnrollRequest(token_proof=token_proof(token, **fields), **fields,
                                    **identity.model_dump(exclude={"machine_id"}))
        except ValidationError as exc:
            raise EnrollError("host identity does not match the contract", code="invalid_identity",
                              evidence={"errors": exc.errors(include_url=False, include_input=False)}) from None
        msg = await _request(nc, ENROLL_SUBJECT, request.model_dump_json().encode(), nats_url, timeout,
                             bound_to=bound_to)
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await asyncio.wait_for(nc.close(), timeout)

    credentials, node_id = _open_reply(msg.data, reply_key, request, nats_url, identity)
    record = EnrollmentRecord(node_id=node_id, credentials=credentials, enrolled_at=datetime.now(UTC))
    path = record_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    assert credentials.user_jwt is not None  # _open_reply refuses anything else
    try:
        store_creds(state_dir, creds_text(credentials.user_jwt, seed))  # the seed's one home
    except TransportError as exc:
        raise EnrollError(f"enrollment reply carries unusable credentials: {exc.message}", code=exc.code,
                          evidence=exc.evidence) from None
    write_atomic(path, record.model_dump_json(indent=2).encode(), mode=0o600)  # no seed in it
    try:
        token_file.unlink(missing_ok=True)
    except OSError as exc:
        # Enrolled all the same: the token is single-use and the control plane refuses it from now on.
        log_event(log, "token_remove_failed", logging.WARNING, token_file=str(token_file), error=exc.strerror)
    remove_bootstrap_login(security, state_dir)
    log_event(log, "enrolled", node_id=record.node_id, node_public_key=public_key(seed))
    return record


def remove_bootstrap_login(security: TransportSecurity | None, state_dir: str | Path) -> None:
    """Delete the bootstrap login (``nats_enroll_creds_file``) once enrolled: it can enroll, and an enrolled host
    has nothing left to enroll. Never the node's own ``nats.creds``, should a config name the same file."""
    path = None if security is None else security.creds_file
    if path is None or Path(path).resolve() == creds_path(state_dir).resolve():
        return
    try:
        Path(path).unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        # Enrolled all the same; the plane revokes this host's bootstrap user (docs/security-auth.md).
        log_event(log, "bootstrap_login_remove_failed", logging.WARNING, path=str(path), error=exc.strerror)
        return
    log_event(log, "bootstrap_login_removed", path=str(path))


def js_api_prefix_in_use(config: AgentConfig, record: EnrollmentRecord | None) -> tuple[str, str]:
    """``(prefix, source)``: where the node sends its JetStream API requests, and why there.

    A prefix set in the config wins (``source`` "config"); else the one the control plane sent at
    enrollment ("enrollment": the account-per-node layout needs no per-host setting); else the
    config's default ``$JS.API`` ("default").
    """
    if "js_api_prefix" in config.model_fields_set:
        return config.js_api_prefix, "config"
    if record is not None and record.credentials.js_api_prefix is not None:
        return record.credentials.js_api_prefix, "enrollment"
    return config.js_api_prefix, "default"


def node_inbox_prefix(node_id: str) -> str:
    """``_INBOX.<node>``: this node's replies (JetStream API, PubAcks, pulled tasks) and no one else's."""
    return subjects.inbox_prefix(node_id)


def login_options(config: AgentConfig, record: EnrollmentRecord) -> dict[str, Any]:
    """``connect_nats`` keyword arguments for the daemon: transport security, credentials, per-node inbox.

    The ``.creds`` used is ``nats_creds_file`` from the config, else ``<state_dir>/nats.creds``
    (written by enrollment or a rotation) when the record holds a JWT, else the record's user +
    password. A missing ``nats.creds`` is ``creds_missing``: the seed exists nowhere else, by design.
    """
    security = TransportSecurity.from_config(config)
    options: dict[str, Any] = {"inbox_prefix": node_inbox_prefix(record.node_id)}
    creds_file = config.nats_creds_file
    if creds_file is None and record.credentials.user_jwt is not None:
        creds_file = creds_path(config.state_dir)
        if not creds_file.exists():
            raise EnrollError(f"{creds_file} is missing: it held this node's only key (enrollment.json holds none); "
                              "restore it from a backup, or move enrollment.json away and enroll with a new token",
                              code="creds_missing", evidence={"path": str(creds_file), "node_id": record.node_id})
    if creds_file is not None:
        security = TransportSecurity(ca_file=security.ca_file, server_name=security.server_name,
                                     cert_file=security.cert_file, key_file=security.key_file,
                                     creds_file=creds_file, insecure=security.insecure)
    else:
        options.update(user=record.credentials.user, password=record.credentials.password)
    options["security"] = security
    return options
