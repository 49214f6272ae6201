"""Enrollment and credential rotation on the wire: no secret travels, in either direction.

* The node's NATS key is born on the node: the request carries only its public NKEY
  (``node_public_key``, ``U...``) and the reply a user JWT signed for that key (NATS
  decentralized auth). The seed stays in ``<state_dir>/nats.creds`` (0600) and nowhere else.
* The bootstrap token is proven, not sent: the agent first asks ``gpuaas.enroll.nonce`` for a
  single-use server nonce, then sends ``token_proof`` = HMAC-SHA256 keyed by the token over the
  nonce, the token id, the node's public key, its machine id and its reply key
  (``gpuaas_agent/control/tokenproof.py``). A recorded request cannot be replayed (the nonce is
  spent) and the token cannot be read off the wire. ``token_id`` (SHA-256 of the token) only
  tells the control plane which token to check.
* The reply's credentials are still sealed to the request's ``reply_public_key``
  (``gpuaas_agent/control/sealed.py``): a JWT is no secret, but the seal binds the answer to
  this attempt, and anyone on ``_INBOX.>`` sees ciphertext.
* Every answer is bound to the attempt that asked (``reply_key_id``: the first 32 hex digits of
  SHA-256 of the attempt's ``reply_public_key``): the nonce request names the attempt's reply key,
  the nonce is spent only by an enrollment request carrying that same key, and the nonce and
  enrollment replies echo its ``reply_key_id``; the agent ignores an answer with another (or none).
  Why: the bootstrap login is shared by every enrolling host and the server does not check a
  request's reply subject, so one holder could have the plane answer its own request into another
  host's inbox, or spend a nonce it heard there (docs/security-auth.md "The bootstrap login").
* A rotation (``gpuaas.node.<node>.creds``) is only a "rotate now" order: the agent makes a new
  key pair and asks ``gpuaas.node.<node>.creds.renew`` for a JWT for it.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from typing import Final, Literal

from pydantic import Field, model_validator

from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.base import SCHEMA_VERSION_AUTH, SchemaVersionAuth, WireModel
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN

# The one sealing scheme: its name is also the label bound into the key derivation and the associated data.
SEAL_SCHEME: Final = "gpuaas.agent.enroll-seal/v1"
# The token proof's label, bound into the HMAC's input (control/tokenproof.py).
PROOF_SCHEME: Final = "gpuaas.agent.enroll-proof/v1"
# The rotation's proof of possession of the new key: label of the signed bytes (control/rotation.py).
RENEW_SCHEME: Final = "gpuaas.agent.creds-renew/v1"
# Canonical unpadded base64url (RFC 4648 §5) of exactly 32 bytes: 42 free characters, then one whose
# low 2 bits are zero (the last character carries 4 data bits); one spelling per key.
X25519_KEY_PATTERN = r"^[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]$"
B64URL_32_PATTERN = X25519_KEY_PATTERN  # any 32 bytes: a server nonce, a token id, an HMAC-SHA256
REPLY_KEY_ID_PATTERN = r"^[0-9a-f]{32}$"


def reply_key_id(reply_public_key: str) -> str:
    """What binds an answer to the attempt that asked: 32 hex digits of SHA-256(UTF-8 ``reply_public_key``)."""
    return hashlib.sha256(reply_public_key.encode()).hexdigest()[:32]
# 12 bytes (96 bits) are exactly 16 base64url characters.
SEAL_NONCE_PATTERN = r"^[A-Za-z0-9_-]{16}$"
BASE64URL_PATTERN = r"^[A-Za-z0-9_-]+$"
# A user public NKEY: 'U' + base32 (no padding) of 35 bytes = 56 characters.
USER_NKEY_PATTERN = r"^U[A-Z2-7]{55}$"
JWT_PATTERN = r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$"
# 64 bytes of Ed25519 signature in unpadded base64url.
ED25519_SIG_PATTERN = r"^[A-Za-z0-9_-]{85}[AQgw]$"

# Where a node sends its JetStream API requests: "$JS.API" (its login shares the plane's account) or, in the
# account-per-node layout, the local subject its account imports the API under (control/accounts.py).
DEFAULT_JS_API_PREFIX: Final = "$JS.API"
# A plain token list: 1..8 tokens of letters, digits, '_' and '-', at most 64 characters in all. No wildcard
# ('*', '>'), no empty token, no '$' (the server's own namespaces) except the default above.
JS_API_PREFIX_PATTERN = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+){0,7}$"
JS_API_PREFIX_MAX = 64
# Namespaces a prefix may not lie in: every node's own subjects, enrollment's, and reply inboxes. A prefix
# there would send the node's JetStream requests (and their reply subjects) onto subjects others read.
JS_API_PREFIX_RESERVED: Final = subjects.NOT_JS_API


def js_api_prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` may not be a node's JetStream API prefix, or None when it may.

    The prefix arrives from the control plane (the enrollment reply) and is treated as
    attacker-written: it must be the default ``$JS.API`` or a plain token list outside the
    reserved namespaces.
    """
    if prefix == DEFAULT_JS_API_PREFIX:
        return None
    if len(prefix) > JS_API_PREFIX_MAX or re.fullmatch(JS_API_PREFIX_PATTERN, prefix) is None:
        return (f"not a plain subject prefix (1 to 8 tokens of A-Z a-z 0-9 _ -, at most {JS_API_PREFIX_MAX} "
                "characters, no wildcard, no empty token, no '$' but $JS.API)")
    for reserved in JS_API_PREFIX_RESERVED:
        if prefix == reserved or prefix.startswith(reserved + "."):
            return f"lies in {reserved}.>, subjects that are not the JetStream API's"
    return None


# v2.1: an enrollment reply whose sealed credentials may carry ``js_api_prefix``. Every v2 reply is a valid
# v2.1 reply; the agent accepts both (a reply without the field leaves the prefix to the agent's config).
SCHEMA_VERSION_AUTH_PREFIX: Final = "gpuaas.agent/v2.1"
EnrollReplyVersion = Literal["gpuaas.agent/v2", "gpuaas.agent/v2.1"]

EnrollRefusal = Literal["token_invalid", "token_expired", "token_reused", "host_mismatch", "nonce_invalid"]


class EnrollNonceRequest(WireModel):
    """``gpuaas.enroll.nonce``: ask for a fresh single-use nonce to bind the enrollment request to.

    ``reply_public_key``: the attempt's X25519 key (the one its ``EnrollRequest`` will carry). The
    nonce is bound to it: only an enrollment request with the same key spends it, so a holder of the
    shared bootstrap login who hears the nonce can neither use nor waste it. Optional on the wire
    for plans older than the binding; this agent always sends it.
    """

    schema_version: SchemaVersionAuth = SCHEMA_VERSION_AUTH
    reply_public_key: str | None = Field(default=None, pattern=X25519_KEY_PATTERN)


class EnrollNonce(WireModel):
    schema_version: SchemaVersionAuth = SCHEMA_VERSION_AUTH
    nonce: str = Field(pattern=B64URL_32_PATTERN)  # 32 random bytes; the control plane accepts it once
    expires_at: datetime
    # reply_key_id(the request's reply_public_key): the agent takes only a nonce answered to its own attempt.
    reply_key_id: str | None = Field(default=None, pattern=REPLY_KEY_ID_PATTERN)


class EnrollRequest(WireModel):
    schema_version: SchemaVersionAuth = SCHEMA_VERSION_AUTH
    # Which bootstrap token is proven: unpadded base64url of SHA-256(UTF-8 token). Not a secret (a token
    # has >= 128 bits of entropy), and not enough to enroll: that takes the token itself.
    token_id: str = Field(pattern=B64URL_32_PATTERN)
    server_nonce: str = Field(pattern=B64URL_32_PATTERN)  # from EnrollNonce, used once
    # HMAC-SHA256(key = UTF-8 token, control/tokenproof.py's bytes), unpadded base64url.
    token_proof: str = Field(pattern=B64URL_32_PATTERN)
    node_public_key: str = Field(pattern=USER_NKEY_PATTERN)  # the node's NKEY, born on the node
    machine_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    hostname: str = Field(min_length=1, max_length=253)
    dmi_serial: str | None = None
    maas_system_id: str | None = Field(default=None, pattern=r"^[a-z0-9]{4,12}$")
    agent_version: str
    # The agent's X25519 public key for this attempt only (a fresh key pair each time it asks); the
    # control plane seals the credentials to it. A reply sealed for another attempt does not open.
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
    """How the node logs in: a user JWT for its own NKEY (enrollment), or user + password (a static login).

    The JWT's seed is never here: it lives in ``<state_dir>/nats.creds`` only. An enrollment reply
    must carry ``user_jwt``; one carrying a password is refused (``enroll_reply_carries_secret``).
    ``user`` + ``password`` remain for a record an operator writes by hand for a password-auth server.
    """

    user: str | None = Field(default=None, min_length=1)
    password: str | None = Field(default=None, min_length=1, repr=False)
    user_jwt: str | None = Field(default=None, min_length=1, max_length=16384, pattern=JWT_PATTERN)
    servers: list[str] = Field(min_length=1)
    # Where this node's login sends its JetStream API requests (the account-per-node layout: "gpuaas.js.API").
    # Optional (contract v2.1): a reply without it leaves the agent's config (default "$JS.API") in charge.
    # Checked by the agent with js_api_prefix_problem (typed refusal), not here: the model takes any short text.
    # Left out when None, so a v2 plaintext (what the seal's test vector and a v2 agent expect) stays byte-identical.
    js_api_prefix: str | None = Field(default=None, max_length=256, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _one_login(self) -> NatsCredentials:
        if (self.user_jwt is None) == (self.user is None or self.password is None):
            raise ValueError("either user_jwt or user + password, not both and not neither")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together")
        return self


class CredsRotation(WireModel):
    """``gpuaas.node.<node>.creds`` (control plane -> agent, request/reply): rotate now. Carries no secret."""

    schema_version: SchemaVersionAuth = SCHEMA_VERSION_AUTH
    node_id: str = Field(pattern=NODE_ID_PATTERN)


class CredsRotationReply(WireModel):
    """The agent's answer, sent before it reconnects: the new public key it logs in with, or why not."""

    schema_version: SchemaVersionAuth = SCHEMA_VERSION_AUTH
    accepted: bool
    node_public_key: str | None = Field(default=None, pattern=USER_NKEY_PATTERN)
    error: str | None = None
    message: str | None = None


class CredsRenewRequest(WireModel):
    """``gpuaas.node.<node>.creds.renew`` (agent -> control plane): a JWT for this new key, please.

    Sent on the node's current login, so the subject's ``<node>`` is authenticated by the server;
    ``signature`` proves possession of the new key (Ed25519 by the new seed over
    ``L(RENEW_SCHEME) || L(node_id) || L(node_public_key)``, L = uint16 big-endian length prefix).
    """

    schema_version: SchemaVersionAuth = SCHEMA_VERSION_AUTH
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    node_public_key: str = Field(pattern=USER_NKEY_PATTERN)
    signature: str = Field(pattern=ED25519_SIG_PATTERN)


class CredsRenewReply(WireModel):
    schema_version: SchemaVersionAuth = SCHEMA_VERSION_AUTH
    accepted: bool
    user_jwt: str | None = Field(default=None, min_length=1, max_length=16384, pattern=JWT_PATTERN)
    error: str | None = None
    message: str | None = None


class EnrollReply(WireModel):
    """Either ``node_id`` + ``sealed_credentials`` (accepted) or an ``error`` code (refused).

    There is no clear-text ``credentials`` field: the agent refuses a reply that carries one
    (``enroll_reply_unsealed``), and an accepted reply without ``sealed_credentials``. A refusal
    carries no secret and stays in clear.
    """

    schema_version: EnrollReplyVersion = SCHEMA_VERSION_AUTH
    accepted: bool
    node_id: str | None = Field(default=None, pattern=NODE_ID_PATTERN)
    sealed_credentials: SealedCredentials | None = None
    error: EnrollRefusal | None = None
    message: str | None = None
    # reply_key_id(the request's reply_public_key), in every answer to a request that parsed (refusals too):
    # the agent takes only an answer to its own attempt, whatever else the plane was made to send its inbox.
    reply_key_id: str | None = Field(default=None, pattern=REPLY_KEY_ID_PATTERN)
