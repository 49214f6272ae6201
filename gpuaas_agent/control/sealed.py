"""The enrollment reply's credentials, sealed to the one agent that asked for them.

Why: the reply travels on an ``_INBOX`` subject. The inbox name is random, but anyone the
account lets subscribe on ``_INBOX.>`` (a shared bootstrap user allowed ``_INBOX.enroll.*.>``,
a full-access user, a server operator's monitoring, a misconfigured export) reads it, and TLS
only protects the hops, not the server's fan-out. So the credentials are
encrypted to a key that never leaves the requesting process: each enrollment attempt makes
a fresh X25519 key pair, sends the public half in ``EnrollRequest.reply_public_key`` and keeps
the private half in memory only. Since the node's key is born on the node, what is sealed is a user
JWT (no secret by itself); the seal still binds the answer to this one attempt and keeps which
node got which JWT off the inbox.

This gives confidentiality to the requester, not authentication of the answer: who may
publish an enrollment reply is the NATS permissions' job (the bootstrap login may publish only
``gpuaas.enroll``). The seal also binds the answer to its request (the token's fingerprint,
the machine id, both public keys), so a captured sealed reply neither opens for another
attempt nor for another host.

Construction (``SEAL_SCHEME`` = ``gpuaas.agent.enroll-seal/v1``; a Go control plane builds it with
``x/crypto/curve25519``, ``x/crypto/hkdf`` and ``x/crypto/chacha20poly1305``)::

    A    = base64url-decode(request.reply_public_key)            32 bytes, the agent's public key
    e, E = fresh X25519 key pair of the control plane, per reply  E is sent as ephemeral_public_key
    Z    = X25519(e, A)                                           all-zero Z (a low-order A) is refused
    L(x) = uint16 big-endian len(x) || x                          every field length-prefixed
    fp   = base64url-decode(request.token_id)                     = SHA-256(UTF-8 bootstrap token)
    info = L(SEAL_SCHEME) || L(E) || L(A) || L(UTF-8 request.machine_id)
    K    = HKDF-SHA256(IKM = Z, salt = none (32 zero bytes), info, 32 bytes)
    n    = 12 random bytes                                        sent as nonce
    aad  = L(SEAL_SCHEME) || L(fp) || L(UTF-8 reply.node_id)
    c    = ChaCha20-Poly1305(K).seal(n, UTF-8 JSON of NatsCredentials, aad)   ciphertext || 16-byte tag

Every binary field is unpadded base64url (RFC 4648 §5) on the wire. The agent opens it with its
private key and the request it sent; any mismatch (another key, another request, another node
id, a flipped bit) fails the tag and is ``enroll_reply_tampered``. ``tests/control/test_sealed.py``
holds a fixed test vector for another implementation to check against.
"""

from __future__ import annotations

import base64
import binascii
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import ValidationError

from gpuaas_agent.contract.enrollment import SEAL_SCHEME, EnrollRequest, NatsCredentials, SealedCredentials
from gpuaas_agent.errors import AgentError

NONCE_BYTES = 12
KEY_BYTES = 32


class SealError(AgentError):
    """A sealed reply that does not open for this request (another key, request or node; altered)."""

    default_code = "enroll_reply_tampered"


def b64url(data: bytes) -> str:
    """Unpadded base64url, the wire spelling of every binary field of the seal."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Strict inverse of :func:`b64url`: a non-canonical spelling is refused (ValueError), never guessed."""
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url") from None
    if b64url(data) != text:
        raise ValueError("not canonical unpadded base64url")
    return data


def new_reply_key() -> X25519PrivateKey:
    """A fresh key pair for one enrollment attempt; the private half stays in this process's memory."""
    return X25519PrivateKey.generate()


def public_key_text(key: X25519PrivateKey) -> str:
    """``EnrollRequest.reply_public_key`` of ``key``."""
    return b64url(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def _lp(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def _key(shared: bytes, server_public: bytes, requester_public: bytes, request: EnrollRequest) -> bytes:
    info = _lp(SEAL_SCHEME.encode(), server_public, requester_public, request.machine_id.encode())
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def _aad(request: EnrollRequest, node_id: str) -> bytes:
    fingerprint = b64url_decode(request.token_id)  # SHA-256 of the token: the bytes v1 bound, unchanged
    return _lp(SEAL_SCHEME.encode(), fingerprint, node_id.encode())


def seal_credentials(credentials: NatsCredentials, request: EnrollRequest, node_id: str, *,
                     ephemeral: X25519PrivateKey | None = None, nonce: bytes | None = None) -> SealedCredentials:
    """The control plane's half: ``credentials`` for ``node_id`` sealed to ``request.reply_public_key``.

    ``ephemeral`` and ``nonce`` are for test vectors only; a control plane leaves them to chance.
    ValueError when the requester's key is a low-order point (the shared secret would be zero).
    """
    requester_public = b64url_decode(request.reply_public_key)
    ephemeral = ephemeral or X25519PrivateKey.generate()
    nonce = secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
    server_public = ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(requester_public))  # ValueError on zero
    key = _key(shared, server_public, requester_public, request)
    ciphertext = ChaCha20Poly1305(key).encrypt(nonce, credentials.model_dump_json().encode(), _aad(request, node_id))
    return SealedCredentials(ephemeral_public_key=b64url(server_public), nonce=b64url(nonce),
                             ciphertext=b64url(ciphertext))


def open_credentials(sealed: SealedCredentials, key: X25519PrivateKey, request: EnrollRequest,
                     node_id: str) -> NatsCredentials:
    """The agent's half: the credentials, or :class:`SealError` when the seal does not open for this request."""
    evidence = {"scheme": sealed.scheme, "node_id": node_id, "reply_public_key": request.reply_public_key,
                "ephemeral_public_key": sealed.ephemeral_public_key}
    try:
        server_public = b64url_decode(sealed.ephemeral_public_key)
        nonce = b64url_decode(sealed.nonce)
        ciphertext = b64url_decode(sealed.ciphertext)
        requester_public = b64url_decode(request.reply_public_key)
        shared = key.exchange(X25519PublicKey.from_public_bytes(server_public))
        plaintext = ChaCha20Poly1305(_key(shared, server_public, requester_public, request)).decrypt(
            nonce, ciphertext, _aad(request, node_id))
    except (ValueError, InvalidTag) as exc:
        reason = "the seal does not open (another key or request, or altered)" if isinstance(exc, InvalidTag) \
            else f"unusable seal ({exc})"
        raise SealError(f"enrollment reply refused: {reason}; nothing was stored", evidence=evidence) from None
    try:
        return NatsCredentials.model_validate_json(plaintext)
    except ValidationError as exc:
        raise SealError("enrollment reply refused: the sealed credentials do not match the contract",
                        code="invalid_message",
                        evidence={**evidence, "errors": exc.errors(include_url=False, include_input=False)}) from None
