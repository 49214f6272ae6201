"""The enrollment seal (control/sealed.py): a fixed test vector, every binding, hostile keys and spellings.

No server here: these pin the construction byte for byte, so another implementation (the Go
control plane) can check itself against :data:`VECTOR`. The exchange over a real nats-server,
with an eavesdropper on the inbox, is tests/control/test_enroll.py.
"""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import ValidationError

from gpuaas_agent.contract.enrollment import EnrollReply, EnrollRequest, NatsCredentials, SealedCredentials
from gpuaas_agent.control.sealed import (
    SealError,
    b64url,
    b64url_decode,
    open_credentials,
    public_key_text,
    seal_credentials,
)
from gpuaas_agent.control.tokenproof import token_id

AGENT_KEY = X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
PLANE_KEY = X25519PrivateKey.from_private_bytes(bytes(range(33, 65)))
NONCE = bytes(range(100, 112))
NODE = "node-0123456789ab"
TOKEN = "bootstrap-token-0123456789"
# The token proof's vector request (tests/control/test_tokenproof.py, docs/contract.md), reused: the seal binds its
# token_id (= SHA-256 of the token, the fingerprint v1 bound) and machine id.
REQUEST = EnrollRequest(token_id=token_id(TOKEN), server_nonce="yMnKy8zNzs_Q0dLT1NXW19jZ2tvc3d7f4OHi4-Tl5uc",
                        token_proof="adk0VwLWEWmXV7NZ8aGJT_m6TrCji62nyjbaT3xT4ro",
                        node_public_key="UCW4CQAR7AWRYVWZK2VE7HLT3CCYGYNGAYCIKJPA2CGGHDOHLXMMPNDB",
                        machine_id="0123456789abcdef0123456789abcdef",
                        hostname="slice-host-01", agent_version="0.1.0", reply_public_key=public_key_text(AGENT_KEY))
CREDENTIALS = NatsCredentials(user=NODE, password="s3cret-password", servers=["tls://nats.example:4222"])
# Agent private key 01..20, control-plane ephemeral private key 21..40, nonce 64..6f (hex bytes), REQUEST,
# node id NODE; plaintext b'{"user":"node-0123456789ab","password":"s3cret-password","user_jwt":null,
# "servers":["tls://nats.example:4222"]}' (the seal is the same for any NatsCredentials; the agent refuses a
# password after opening it, control/enroll.py).
VECTOR = SealedCredentials(
    ephemeral_public_key="WGmv9FBUlzLLqu1eXfmzCm2jHLDldCutWtShp2jxpns",
    nonce="ZGVmZ2hpamtsbW5v",
    ciphertext="i_7qk1kaFQ5z_enrDNBXxBg1um4P6dD2rD-wb5L9eAPMIncY5k6ZFQrMEz1PGxaQHOjamdEIizF7vjNWiYDAVAEHfVwfV5izzWA0"
               "amvmFqORYYq7d2aOl_9jvLJCwgeAAsD40vC1UZU--RZJZyRo5MQLe1l_9y0irQtlzw3XnA",
)


def _lp(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def test_the_seal_matches_the_fixed_vector_and_the_documented_construction_step_by_step():
    assert REQUEST.reply_public_key == "B6N8vBQgk8i3VdwbEOhstCY3StFqqFPtC9_AsrhtHHw"
    assert seal_credentials(CREDENTIALS, REQUEST, NODE, ephemeral=PLANE_KEY, nonce=NONCE) == VECTOR
    # The module docstring's construction, spelled out with the primitives alone.
    server_pub, agent_pub = b64url_decode(VECTOR.ephemeral_public_key), b64url_decode(REQUEST.reply_public_key)
    shared = AGENT_KEY.exchange(X25519PublicKey.from_public_bytes(server_pub))
    label = b"gpuaas.agent.enroll-seal/v1"
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"\0" * 32,
               info=_lp(label, server_pub, agent_pub, REQUEST.machine_id.encode())).derive(shared)
    aad = _lp(label, hashlib.sha256(TOKEN.encode()).digest(), NODE.encode())
    plaintext = ChaCha20Poly1305(key).decrypt(b64url_decode(VECTOR.nonce), b64url_decode(VECTOR.ciphertext), aad)
    assert NatsCredentials.model_validate_json(plaintext) == CREDENTIALS
    assert open_credentials(VECTOR, AGENT_KEY, REQUEST, NODE) == CREDENTIALS


def test_two_seals_of_the_same_credentials_share_no_key_nonce_or_ciphertext():
    first, second = (seal_credentials(CREDENTIALS, REQUEST, NODE) for _ in range(2))
    assert first.ephemeral_public_key != second.ephemeral_public_key and first.nonce != second.nonce
    assert first.ciphertext != second.ciphertext
    assert b"s3cret-password" not in first.model_dump_json().encode()
    assert open_credentials(first, AGENT_KEY, REQUEST, NODE) == open_credentials(second, AGENT_KEY, REQUEST, NODE)


@pytest.mark.parametrize("change", ["another_reply_key", "another_token", "another_machine", "another_node_id",
                                    "flipped_ciphertext_bit", "flipped_nonce", "another_ephemeral_key", "truncated"])
def test_a_seal_opens_only_for_the_request_key_and_node_it_was_made_for(change):
    other_key = X25519PrivateKey.generate()
    request, node, key, sealed = REQUEST, NODE, AGENT_KEY, VECTOR
    if change == "another_reply_key":  # sealed to another attempt's key: this attempt cannot open it
        sealed = seal_credentials(CREDENTIALS, REQUEST.model_copy(update={"reply_public_key": public_key_text(other_key)}),
                                  NODE)
    elif change == "another_token":  # a reply made for another request of the same host
        sealed = seal_credentials(CREDENTIALS, REQUEST.model_copy(update={"token_id": token_id("another-token-0123456789")}),
                                  NODE)
    elif change == "another_machine":
        sealed = seal_credentials(CREDENTIALS, REQUEST.model_copy(update={"machine_id": "f" * 32}), NODE)
    elif change == "another_node_id":  # the clear node id swapped under a valid seal
        node = "node-ffffffffffff"
    elif change == "flipped_ciphertext_bit":
        raw = bytearray(b64url_decode(VECTOR.ciphertext))
        raw[5] ^= 0x01
        sealed = VECTOR.model_copy(update={"ciphertext": b64url(bytes(raw))})
    elif change == "flipped_nonce":
        sealed = VECTOR.model_copy(update={"nonce": b64url(bytes(range(101, 113)))})
    elif change == "another_ephemeral_key":
        sealed = VECTOR.model_copy(update={"ephemeral_public_key": public_key_text(other_key)})
    else:
        sealed = VECTOR.model_copy(update={"ciphertext": VECTOR.ciphertext[:24]})
    with pytest.raises(SealError) as err:
        open_credentials(sealed, key, request, node)
    assert err.value.code == "enroll_reply_tampered"
    assert "s3cret" not in str(err.value) and "s3cret" not in repr(err.value.evidence)


def test_low_order_keys_are_refused_on_both_sides():
    zero = b64url(bytes(32))  # a low-order point: X25519 with it gives the all-zero secret
    with pytest.raises(ValueError):
        seal_credentials(CREDENTIALS, REQUEST.model_copy(update={"reply_public_key": zero}), NODE)
    with pytest.raises(SealError) as err:
        open_credentials(VECTOR.model_copy(update={"ephemeral_public_key": zero}), AGENT_KEY, REQUEST, NODE)
    assert err.value.code == "enroll_reply_tampered"


@pytest.mark.parametrize("spelling", [
    "B6N8vBQgk8i3VdwbEOhstCY3StFqqFPtC9_AsrhtHHx",  # last character carries bits a 32-byte key has not
    "B6N8vBQgk8i3VdwbEOhstCY3StFqqFPtC9_AsrhtHHw=",  # padded
    "B6N8vBQgk8i3VdwbEOhstCY3StFqqFPtC9/AsrhtHHw",  # standard, not url-safe, alphabet
    "B6N8vBQgk8i3VdwbEOhstCY3StFqqFPtC9_AsrhtHH",  # 31.6 bytes
    "",
])
def test_a_reply_key_has_one_spelling_and_anything_else_is_refused_by_the_contract(spelling):
    with pytest.raises(ValidationError):
        EnrollRequest.model_validate({**REQUEST.model_dump(), "reply_public_key": spelling})


def test_the_request_needs_a_reply_key_and_the_reply_has_no_clear_credentials_field():
    with pytest.raises(ValidationError):
        EnrollRequest.model_validate({k: v for k, v in REQUEST.model_dump().items() if k != "reply_public_key"})
    with pytest.raises(ValidationError):
        EnrollReply.model_validate({"accepted": True, "node_id": NODE, "credentials": CREDENTIALS.model_dump()})
