"""Enrollment on ``gpuaas.enroll``: bootstrap token + host identity in, node id + NATS credentials stored 0600.

The record is written atomically (temp file created 0600, fsync, rename, fsync
of the directory) so a crash leaves either no record or a whole one; the token
file is removed only after the record is on disk. Enrolling when a record
exists sends nothing: the token was spent already and a second request would
be refused as ``token_reused``.

The exchange runs over the configured transport (TLS unless ``insecure``, see
``control/transport.py``), and the reply comes on an inbox no one can guess
(``_INBOX.enroll.<128 random bits>.``), not on the account-wide default ``_INBOX.``.
Whoever can read that inbox anyway (``_INBOX.>``) sees no secret: the request carries a fresh
X25519 public key and the credentials come back only sealed to it (``control/sealed.py``). A
reply that carries credentials in clear is refused (``enroll_reply_unsealed``), one whose seal
does not open too (``enroll_reply_tampered``): nothing is written and the token stays.
Credentials that arrive as a ``.creds`` (JWT + NKEY seed) are also written, 0600 and
atomically, to ``<state_dir>/nats.creds``, the file nats.py reads on every connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from datetime import datetime
from pathlib import Path

import nats.errors
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.compat import UTC
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.enrollment import EnrollReply, EnrollRequest, NatsCredentials
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN
from gpuaas_agent.control.connection import connect_nats, safe_url
from gpuaas_agent.control.sealed import SealError, new_reply_key, open_credentials, public_key_text
from gpuaas_agent.control.transport import (
    TransportError,
    TransportSecurity,
    parse_creds,
)
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

ENROLL_SUBJECT = subjects.ENROLL
RECORD_NAME = "enrollment.json"
RECORD_VERSION = "gpuaas.agent.enrollment/v1"
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
    credentials: NatsCredentials
    enrolled_at: datetime


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
    try:
        return EnrollmentRecord.model_validate_json(raw)
    except ValidationError as exc:
        raise EnrollError(
            f"enrollment record {path} is damaged; move it away and enroll again with a new token",
            code="enrollment_record_invalid",
            evidence={"path": str(path), "errors": exc.errors(include_url=False, include_input=False)},
        ) from None




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
        return open_credentials(reply.sealed_credentials, reply_key, request, reply.node_id), reply.node_id
    except SealError as exc:
        raise EnrollError(exc.message, code=exc.code, evidence={**where, **exc.evidence}) from None


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
        return existing

    token_file = Path(token_file)
    reply_key = new_reply_key()  # this attempt's only: the credentials come back sealed to it
    try:
        request = EnrollRequest(bootstrap_token=_read_token(token_file), reply_public_key=public_key_text(reply_key),
                                **identity.model_dump())
    except ValidationError as exc:
        raise EnrollError("host identity or token does not match the contract", code="invalid_identity",
                          evidence={"errors": exc.errors(include_url=False, include_input=False)}) from None

    # Bounded: connect_timeout + timeout in all, so ExecStartPre ends well inside the unit's start timeout.
    # ``security``: TLS settings and the bootstrap login (TransportSecurity.from_config(config, enroll=True)).
    nc = await connect_nats([nats_url], timeout_s=connect_timeout or timeout, name="gpuaas-agent-enroll",
                            security=security, inbox_prefix=subjects.enroll_inbox_prefix(secrets.token_hex(16)))
    try:
        msg = await nc.request(ENROLL_SUBJECT, request.model_dump_json().encode(), timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError) as exc:
        raise EnrollError(f"no enrollment answer on {ENROLL_SUBJECT} from {safe_url(nats_url)} within {timeout:g}s "
                          f"({'no responders' if isinstance(exc, nats.errors.NoRespondersError) else 'timed out'})",
                          code="enroll_unreachable", evidence={"nats_url": safe_url(nats_url)}) from None
    except nats.errors.Error as exc:  # the connection broke under the request
        raise EnrollError(f"enrollment request to {safe_url(nats_url)} failed: {exc}", code="enroll_unreachable",
                          evidence={"nats_url": safe_url(nats_url), "error": repr(exc)}) from None
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await asyncio.wait_for(nc.close(), timeout)

    credentials, node_id = _open_reply(msg.data, reply_key, request, nats_url, identity)
    record = EnrollmentRecord(node_id=node_id, credentials=credentials, enrolled_at=datetime.now(UTC))
    # repr=False hides the password from logs only; the record on disk must carry it (hence 0600).
    path = record_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if credentials.creds is not None:
        try:
            store_creds(state_dir, credentials.creds)
        except TransportError as exc:
            raise EnrollError(f"enrollment reply carries unusable credentials: {exc.message}", code=exc.code,
                              evidence=exc.evidence) from None
    write_atomic(path, record.model_dump_json(indent=2).encode(), mode=0o600)
    try:
        token_file.unlink(missing_ok=True)
    except OSError as exc:
        # Enrolled all the same: the token is single-use and the control plane refuses it from now on.
        log_event(log, "token_remove_failed", logging.WARNING, token_file=str(token_file), error=exc.strerror)
    log_event(log, "enrolled", node_id=record.node_id)
    return record


def node_inbox_prefix(node_id: str) -> str:
    """``_INBOX.<node>``: this node's replies (JetStream API, PubAcks, pulled tasks) and no one else's."""
    return subjects.inbox_prefix(node_id)


def login_options(config, record: EnrollmentRecord) -> dict:
    """``connect_nats`` keyword arguments for the daemon: transport security, credentials, per-node inbox.

    The ``.creds`` used is ``nats_creds_file`` from the config, else ``<state_dir>/nats.creds``
    (written by enrollment or a rotation; restored from the record if it was lost), else the
    record's user + password.
    """
    security = TransportSecurity.from_config(config)
    options: dict = {"inbox_prefix": node_inbox_prefix(record.node_id)}
    creds_file = config.nats_creds_file
    if creds_file is None and record.credentials.creds is not None:
        creds_file = creds_path(config.state_dir)
        if not creds_file.exists():
            store_creds(config.state_dir, record.credentials.creds)
    if creds_file is not None:
        security = TransportSecurity(ca_file=security.ca_file, server_name=security.server_name,
                                     cert_file=security.cert_file, key_file=security.key_file,
                                     creds_file=creds_file, insecure=security.insecure)
    else:
        options.update(user=record.credentials.user, password=record.credentials.password)
    options["security"] = security
    return options
