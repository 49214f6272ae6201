"""Ed25519 through the interpreter's libcrypto signs exactly what RFC 8032 and ``cryptography`` sign."""

import os

import pytest

from gpuaas_agent.control.ed25519 import (
    CryptographyEd25519,
    Ed25519Backend,
    LibcryptoEd25519,
    backend,
    interpreter_libcrypto,
)

# RFC 8032 §7.1, tests 1, 2 and 3: (secret key, public key, message, signature).
RFC8032 = [
    ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
     "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
     "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"),
    ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
     "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
     "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"),
    ("c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
     "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025", "af82",
     "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc6594a7c15e9716ed28dc027beceea1ec40a"),
]


def _backends() -> list[Ed25519Backend]:
    libcrypto = interpreter_libcrypto()
    assert libcrypto is not None  # the development interpreter's _ssl links libcrypto: the path the daemon takes
    return [libcrypto, CryptographyEd25519()]


@pytest.mark.parametrize("impl", _backends(), ids=lambda b: b.name)
def test_rfc8032_vectors_sign_verify_and_derive_the_public_key(impl):
    for secret, public, message, signature in RFC8032:
        sk, pk, msg, sig = (bytes.fromhex(x) for x in (secret, public, message, signature))
        assert impl.sign(sk, msg) == sig
        assert impl.public_key(sk) == pk
        assert impl.verify(pk, sig, msg)
        assert not impl.verify(pk, sig, msg + b"x")
        assert not impl.verify(pk, sig[:-1] + bytes([sig[-1] ^ 1]), msg)
        assert not impl.verify(pk, sig[:63], msg)  # a truncated signature is a refusal, not an error


def test_libcrypto_signs_byte_identically_to_cryptography_on_random_keys():
    libcrypto, reference = _backends()
    for _ in range(50):
        sk, msg = os.urandom(32), os.urandom(int.from_bytes(os.urandom(1), "big"))
        assert libcrypto.sign(sk, msg) == reference.sign(sk, msg)
        assert libcrypto.public_key(sk) == reference.public_key(sk)
        assert reference.verify(libcrypto.public_key(sk), libcrypto.sign(sk, msg), msg)


@pytest.mark.parametrize("impl", _backends(), ids=lambda b: b.name)
def test_a_key_of_the_wrong_length_is_refused_and_an_off_curve_public_key_verifies_nothing(impl):
    with pytest.raises(ValueError, match="32 bytes"):
        impl.sign(b"\x01" * 31, b"m")
    with pytest.raises(ValueError, match="32 bytes"):
        impl.verify(b"\x01" * 33, b"\x00" * 64, b"m")
    # y = 2 is not the y of any point on the curve (no square root for x²): decoding fails, nothing verifies.
    off_curve = (2).to_bytes(32, "little")
    assert not impl.verify(off_curve, b"\x00" * 64, b"m")


def test_the_daemon_signs_through_the_interpreters_libcrypto():
    assert isinstance(backend(), LibcryptoEd25519)


def test_a_library_that_reaches_no_libcrypto_is_passed_over():
    """A real extension module that links no libcrypto (``_ctypes``), no file at all (a built-in ``_ssl``), a
    missing file: no backend, so :func:`backend` takes ``cryptography``; never a missing symbol at a connect."""
    import _ctypes

    assert interpreter_libcrypto(_ctypes.__file__) is None
    assert interpreter_libcrypto(None) is None
    assert interpreter_libcrypto("/nonexistent/_ssl.so") is None
