"""The agent's own NKEY seed signer gives exactly the signature the ``nkeys`` reference library gives."""

import base64
import os

import nkeys
import pytest

from gpuaas_agent.control.nkeyseed import NkeySeedError, sign_nonce, user_private_key


def test_signature_matches_the_reference_library_for_user_seeds():
    for _ in range(20):
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        nonce = base64.b64encode(os.urandom(12)).decode()
        reference = base64.b64encode(nkeys.from_seed(bytearray(seed)).sign(nonce.encode()))
        assert sign_nonce(seed, nonce) == reference


def test_only_a_well_formed_user_seed_is_accepted():
    account_seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    flipped = user_seed[:10] + ("A" if user_seed[10] != "A" else "B") + user_seed[11:]
    for bad, why in ((account_seed, "not a user seed"), (flipped, "checksum"), ("SUxx!!", "not base32"),
                     (user_seed[:-8], "bytes")):
        with pytest.raises(NkeySeedError, match=why) as err:
            user_private_key(bad)
        assert user_seed not in str(err.value)


def test_a_pair_born_here_is_a_user_seed_whose_public_key_the_reference_library_agrees_with():
    from gpuaas_agent.control.nkeyseed import new_user_seed, public_key, sign, verify

    seeds = {new_user_seed() for _ in range(20)}
    assert len(seeds) == 20  # fresh randomness each time
    for seed in seeds:
        reference = nkeys.from_seed(bytearray(seed.encode()))
        assert seed.startswith("SU") and public_key(seed) == reference.public_key.decode()
        signature = sign(seed, b"renew")
        assert reference.verify(b"renew", signature) and verify(public_key(seed), signature, b"renew")
        assert not verify(public_key(seed), signature, b"other")
