"""The bootstrap token, proven instead of sent: an HMAC keyed by the token over this request's own bytes.

Why: a token that travels can be read by whoever sees the request (``gpuaas.enroll`` is readable
by anyone the account lets subscribe there, and by the server's monitoring) and replayed while
its enrollment did not complete. So the request carries ``token_id`` (which token) and
``token_proof``, and the token stays on the host. The proof covers a single-use nonce the
control plane handed out (``gpuaas.enroll.nonce``), so a recorded request is refused the second
time; and it covers the node's public NKEY and the reply key, so a captured request cannot be
re-pointed at another key: the JWT it earns is for the node's key only, sealed to the node's
reply key.

Construction (``PROOF_SCHEME`` = ``gpuaas.agent.enroll-proof/v1``; a Go control plane needs only
``crypto/hmac`` and ``crypto/sha256``)::

    L(x)     = uint16 big-endian len(x) || x                  every field length-prefixed
    token_id = base64url(SHA-256(UTF-8 token))                sent; tells which token to check
    msg      = L(PROOF_SCHEME) || L(server_nonce) || L(token_id) || L(node_public_key)
               || L(machine_id) || L(reply_public_key)        each the UTF-8 of the request's field text
    proof    = base64url(HMAC-SHA256(key = UTF-8 token, msg)) sent as token_proof

base64url is unpadded (RFC 4648 §5). The control plane looks the token up by ``token_id``,
recomputes ``proof`` from the request's fields and compares in constant time; it spends the
nonce at the first request that names it, whatever the outcome. ``docs/contract.md`` holds a
test vector, checked by ``tests/control/test_tokenproof.py``.
"""

from __future__ import annotations

import hashlib
import hmac

from gpuaas_agent.contract.enrollment import PROOF_SCHEME, EnrollRequest
from gpuaas_agent.control.sealed import b64url


def _lp(*parts: str) -> bytes:
    out = b""
    for part in parts:
        raw = part.encode()
        out += len(raw).to_bytes(2, "big") + raw
    return out


def token_id(token: str) -> str:
    """``EnrollRequest.token_id`` of a bootstrap token: which token, not the token."""
    return b64url(hashlib.sha256(token.encode()).digest())


def proof_message(*, server_nonce: str, token_id: str, node_public_key: str, machine_id: str,
                  reply_public_key: str) -> bytes:
    """The exact bytes the HMAC covers."""
    return _lp(PROOF_SCHEME, server_nonce, token_id, node_public_key, machine_id, reply_public_key)


def token_proof(token: str, *, server_nonce: str, token_id: str, node_public_key: str, machine_id: str,
                reply_public_key: str) -> str:
    """``EnrollRequest.token_proof``: HMAC-SHA256 keyed by the token."""
    message = proof_message(server_nonce=server_nonce, token_id=token_id, node_public_key=node_public_key,
                            machine_id=machine_id, reply_public_key=reply_public_key)
    return b64url(hmac.new(token.encode(), message, hashlib.sha256).digest())


def proof_holds(token: str, request: EnrollRequest) -> bool:
    """The control plane's check: does ``request`` prove ``token``? (constant-time comparison)."""
    expected = token_proof(token, server_nonce=request.server_nonce, token_id=request.token_id,
                           node_public_key=request.node_public_key, machine_id=request.machine_id,
                           reply_public_key=request.reply_public_key)
    return hmac.compare_digest(expected, request.token_proof) and hmac.compare_digest(token_id(token),
                                                                                      request.token_id)
