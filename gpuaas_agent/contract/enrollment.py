"""``gpuaas.enroll`` request/reply: a bootstrap token and host identity in, a node id and NATS credentials out.

The credentials never travel in clear: the request carries the agent's ephemeral X25519
public key (``reply_public_key``) and the reply carries them only as ``sealed_credentials``,
sealed to that key (the construction: ``gpuaas_agent/control/sealed.py``). The reply's inbox is
readable by anyone the account lets subscribe on ``_INBOX.>`` (or a server's monitoring, or a
misconfigured export); what they see there is ciphertext.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, model_validator

from gpuaas_agent.contract.base import SCHEMA_VERSION, SchemaVersion, WireModel
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN

# The one sealing scheme: its name is also the label bound into the key derivation and the associated data.
SEAL_SCHEME: Final = "gpuaas.agent.enroll-seal/v1"
# Canonical unpadded base64url (RFC 4648 §5) of exactly 32 bytes: 42 free characters, then one whose
# low 2 bits are zero (the last character carries 4 data bits); one spelling per key.
X25519_KEY_PATTERN = r"^[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]$"
# 12 bytes (96 bits) are exactly 16 base64url characters.
SEAL_NONCE_PATTERN = r"^[A-Za-z0-9_-]{16}$"
BASE64URL_PATTERN = r"^[A-Za-z0-9_-]+$"


class EnrollRequest(WireModel):
    schema_version: SchemaVersion = SCHEMA_VERSION
    # repr=False keeps secrets out of logs and tracebacks; they still serialise onto the wire.
    bootstrap_token: str = Field(min_length=16, max_length=512, repr=False)
    machine_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    hostname: str = Field(min_length=1, max_length=253)
    dmi_serial: str | None = None
    maas_system_id: str | None = Field(default=None, pattern=r"^[a-z0-9]{4,12}$")
    agent_version: str
    # The agent's X25519 public key for this attempt only (a fresh key pair each time it asks); the
    # control plane seals the credentials to it. Also the request's nonce: a reply sealed for another
    # attempt does not open.
    reply_public_key: str = Field(pattern=X25519_KEY_PATTERN)


class SealedCredentials(WireModel):
    """``NatsCredentials`` sealed to the requester's ``reply_public_key`` (``control/sealed.py``)."""

    scheme: Literal["gpuaas.agent.enroll-seal/v1"] = SEAL_SCHEME
    # The control plane's X25519 public key, fresh for this reply.
    ephemeral_public_key: str = Field(pattern=X25519_KEY_PATTERN)
    nonce: str = Field(pattern=SEAL_NONCE_PATTERN)
    # ChaCha20-Poly1305 ciphertext with its 16-byte tag appended (at least 17 bytes: 23 characters).
    ciphertext: str = Field(min_length=23, max_length=32768, pattern=BASE64URL_PATTERN)


class NatsCredentials(WireModel):
    """How the node logs in: a NATS user ``.creds`` (JWT + NKEY seed; recommended) or user + password."""

    user: str | None = Field(default=None, min_length=1)
    password: str | None = Field(default=None, min_length=1, repr=False)
    # The text of a NATS user .creds file; the agent stores it as <state_dir>/nats.creds (0600).
    creds: str | None = Field(default=None, min_length=1, max_length=16384, repr=False)
    servers: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_login(self) -> NatsCredentials:
        if (self.creds is None) == (self.user is None or self.password is None):
            raise ValueError("either creds or user + password, not both and not neither")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together")
        return self


class CredsRotation(WireModel):
    """``gpuaas.node.<node>.creds``: the control plane's new ``.creds`` for this node (request/reply)."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    creds: str = Field(min_length=1, max_length=16384, repr=False)


class CredsRotationReply(WireModel):
    schema_version: SchemaVersion = SCHEMA_VERSION
    accepted: bool
    error: str | None = None
    message: str | None = None


class EnrollReply(WireModel):
    """Either ``node_id`` + ``sealed_credentials`` (accepted) or an ``error`` code (refused).

    There is no clear-text ``credentials`` field: the agent refuses a reply that carries one
    (``enroll_reply_unsealed``), and an accepted reply without ``sealed_credentials``. A refusal
    carries no secret and stays in clear.
    """

    schema_version: SchemaVersion = SCHEMA_VERSION
    accepted: bool
    node_id: str | None = Field(default=None, pattern=NODE_ID_PATTERN)
    sealed_credentials: SealedCredentials | None = None
    error: Literal["token_invalid", "token_expired", "token_reused", "host_mismatch"] | None = None
    message: str | None = None
