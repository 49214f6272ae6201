"""The token proof (control/tokenproof.py): a fixed test vector, spelled out with the primitives, and every binding.

No server here: the vector is the one in docs/contract.md, for the Go control plane to check
itself against. The exchange over a real nats-server (nonce, replay refused) is test_enroll.py.
"""

from __future__ import annotations

import hashlib
import hmac

import nkeys
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gpuaas_agent.contract.enrollment import EnrollRequest
from gpuaas_agent.control.nkeyseed import public_key
from gpuaas_agent.control.sealed import b64url, public_key_text
from gpuaas_agent.control.tokenproof import proof_holds, proof_message, token_id, token_proof

TOKEN = "bootstrap-token-0123456789"
NODE_SEED = nkeys.encode_seed(bytes(range(65, 97)), nkeys.PREFIX_BYTE_USER).decode()  # Ed25519 seed 41..60 (hex)
FIELDS = {
    "server_nonce": b64url(bytes(range(200, 232))),  # nonce bytes c8..e7
    "token_id": token_id(TOKEN),
    "node_public_key": public_key(NODE_SEED),
    "machine_id": "0123456789abcdef0123456789abcdef",
    "reply_public_key": public_key_text(X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))),
}
# docs/contract.md "Token proof: test vector" (the same values).
VECTOR = {
    "server_nonce": "yMnKy8zNzs_Q0dLT1NXW19jZ2tvc3d7f4OHi4-Tl5uc",
    "token_id": "HoMD4zKGWgbv_J3toZNe7D7hbtnsewEBOgRjgp8Lo0Q",
    "node_public_key": "UCW4CQAR7AWRYVWZK2VE7HLT3CCYGYNGAYCIKJPA2CGGHDOHLXMMPNDB",
    "machine_id": "0123456789abcdef0123456789abcdef",
    "reply_public_key": "B6N8vBQgk8i3VdwbEOhstCY3StFqqFPtC9_AsrhtHHw",
}
PROOF = "adk0VwLWEWmXV7NZ8aGJT_m6TrCji62nyjbaT3xT4ro"


def _request(**changes) -> EnrollRequest:
    return EnrollRequest(token_proof=PROOF, hostname="slice-host-01", agent_version="0.1.0", **{**VECTOR, **changes})


def test_the_proof_matches_the_fixed_vector_and_the_documented_construction_step_by_step():
    assert FIELDS == VECTOR
    assert token_proof(TOKEN, **FIELDS) == PROOF
    assert NODE_SEED == "SUAECQSDIRCUMR2IJFFEWTCNJZHVAUKSKNKFKVSXLBMVUW24LVPF6YE5XM"
    # The docstring's construction with hashlib/hmac alone.
    assert token_id(TOKEN) == b64url(hashlib.sha256(TOKEN.encode()).digest())
    parts = ["gpuaas.agent.enroll-proof/v1", *(VECTOR[k] for k in ("server_nonce", "token_id", "node_public_key",
                                                                   "machine_id", "reply_public_key"))]
    message = b"".join(len(p.encode()).to_bytes(2, "big") + p.encode() for p in parts)
    assert message == proof_message(**VECTOR)
    assert b64url(hmac.new(TOKEN.encode(), message, hashlib.sha256).digest()) == PROOF
    assert proof_holds(TOKEN, _request())


@pytest.mark.parametrize("field", sorted(VECTOR))
def test_the_proof_binds_every_field_so_no_recorded_request_can_be_re_pointed(field):
    other = {"server_nonce": b64url(bytes(32)), "token_id": token_id("another-token-0123456789"),
             "node_public_key": public_key(nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_USER)),
             "machine_id": "f" * 32, "reply_public_key": b64url(bytes(range(32)))}[field]
    assert not proof_holds(TOKEN, _request(**{field: other}))


def test_another_token_does_not_hold_and_the_token_is_not_in_the_request():
    assert not proof_holds("bootstrap-token-0123456780", _request())
    assert TOKEN not in _request().model_dump_json()


def test_the_vector_in_docs_contract_md_is_this_one():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "contract.md").read_text()
    for value in (*VECTOR.values(), PROOF, TOKEN):
        assert f"`{value}`" in doc
    block = doc[doc.index("(hex, 257 bytes):"):].split("\n\n")[1]
    assert bytes.fromhex("".join(line.strip() for line in block.splitlines())) == proof_message(**VECTOR)
