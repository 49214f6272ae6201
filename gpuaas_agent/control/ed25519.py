"""Ed25519 (RFC 8032) through the libcrypto the interpreter's ``ssl`` module already maps.

Why: a connected daemon signs the server's nonce at every (re)connect. Through ``cryptography`` that
loads its Rust binding, which carries its own statically linked OpenSSL: ~8.8 MiB of RSS held for the
daemon's life (docs/performance.md "Idle footprint"), a second copy of what ``_ssl`` links already.
OpenSSL's EVP interface signs the same bytes (Ed25519 is deterministic: one key and one message have
one signature), so the nonce is signed through the ``libcrypto`` that ``_ssl`` was linked against,
looked up by ``dlsym`` on ``_ssl``'s own handle (its dependencies are searched; no library path is
guessed and no second copy is mapped).

Where ``_ssl`` is built into the interpreter or links OpenSSL statically without exporting it (a
self-contained Python build), the symbols are not there and :func:`backend` is ``cryptography``'s
Ed25519 instead, imported then: the same signatures, the larger footprint.

A private key here is the 32-byte RFC 8032 seed; a public key the 32-byte encoded point.
"""

from __future__ import annotations

import _ssl  # for its file, not its API: ``ssl`` (nats.py, the metrics server) imports it anyway
import ctypes
import functools
import os
from typing import Protocol

# NID_ED25519 (EVP_PKEY_ED25519), stable since OpenSSL 1.1.1.
_EVP_PKEY_ED25519 = 1087
KEY_BYTES = 32
SIGNATURE_BYTES = 64


class Ed25519Error(RuntimeError):
    """libcrypto refused an Ed25519 operation on a well-formed key (never carries the key)."""


class Ed25519Backend(Protocol):
    name: str

    def sign(self, private_key: bytes, data: bytes) -> bytes: ...

    def public_key(self, private_key: bytes) -> bytes: ...

    def verify(self, public_key: bytes, signature: bytes, data: bytes) -> bool: ...


def _check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError(f"an Ed25519 key is {KEY_BYTES} bytes, not {len(key)}")


class LibcryptoEd25519:
    """OpenSSL's ``EVP_PKEY_new_raw_*_key`` + ``EVP_DigestSign``/``EVP_DigestVerify`` (one-shot, no digest)."""

    name = "libcrypto"

    def __init__(self, library: ctypes.CDLL) -> None:
        vp, sz, ip = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._new_private = library.EVP_PKEY_new_raw_private_key
        self._new_private.argtypes, self._new_private.restype = [ip, vp, ctypes.c_char_p, sz], vp
        self._new_public = library.EVP_PKEY_new_raw_public_key
        self._new_public.argtypes, self._new_public.restype = [ip, vp, ctypes.c_char_p, sz], vp
        self._raw_public = library.EVP_PKEY_get_raw_public_key
        self._raw_public.argtypes, self._raw_public.restype = [vp, ctypes.c_char_p, ctypes.POINTER(sz)], ip
        self._free_key = library.EVP_PKEY_free
        self._free_key.argtypes, self._free_key.restype = [vp], None
        self._ctx_new = library.EVP_MD_CTX_new
        self._ctx_new.argtypes, self._ctx_new.restype = [], vp
        self._ctx_free = library.EVP_MD_CTX_free
        self._ctx_free.argtypes, self._ctx_free.restype = [vp], None
        self._sign_init = library.EVP_DigestSignInit
        self._sign_init.argtypes, self._sign_init.restype = [vp, vp, vp, vp, vp], ip
        self._sign = library.EVP_DigestSign
        self._sign.argtypes, self._sign.restype = [vp, ctypes.c_char_p, ctypes.POINTER(sz), ctypes.c_char_p, sz], ip
        self._verify_init = library.EVP_DigestVerifyInit
        self._verify_init.argtypes, self._verify_init.restype = [vp, vp, vp, vp, vp], ip
        self._verify = library.EVP_DigestVerify
        self._verify.argtypes, self._verify.restype = [vp, ctypes.c_char_p, sz, ctypes.c_char_p, sz], ip

    def _key(self, private_key: bytes) -> int:
        _check_key(private_key)
        key = self._new_private(_EVP_PKEY_ED25519, None, private_key, KEY_BYTES)
        if not key:
            raise Ed25519Error("libcrypto refused the Ed25519 private key")
        return int(key)

    def sign(self, private_key: bytes, data: bytes) -> bytes:
        key = self._key(private_key)
        ctx = self._ctx_new()
        try:
            if not ctx or self._sign_init(ctx, None, None, None, key) != 1:
                raise Ed25519Error("EVP_DigestSignInit failed")
            out = ctypes.create_string_buffer(SIGNATURE_BYTES)
            length = ctypes.c_size_t(SIGNATURE_BYTES)
            if self._sign(ctx, out, ctypes.byref(length), data, len(data)) != 1 or length.value != SIGNATURE_BYTES:
                raise Ed25519Error("EVP_DigestSign failed")
            return out.raw
        finally:
            self._ctx_free(ctx)
            self._free_key(key)

    def public_key(self, private_key: bytes) -> bytes:
        key = self._key(private_key)
        try:
            out = ctypes.create_string_buffer(KEY_BYTES)
            length = ctypes.c_size_t(KEY_BYTES)
            if self._raw_public(key, out, ctypes.byref(length)) != 1 or length.value != KEY_BYTES:
                raise Ed25519Error("EVP_PKEY_get_raw_public_key failed")
            return out.raw
        finally:
            self._free_key(key)

    def verify(self, public_key: bytes, signature: bytes, data: bytes) -> bool:
        _check_key(public_key)
        if len(signature) != SIGNATURE_BYTES:
            return False
        key = self._new_public(_EVP_PKEY_ED25519, None, public_key, KEY_BYTES)
        if not key:
            return False  # not a point on the curve: no signature verifies under it
        ctx = self._ctx_new()
        try:
            if not ctx or self._verify_init(ctx, None, None, None, key) != 1:
                raise Ed25519Error("EVP_DigestVerifyInit failed")
            return bool(self._verify(ctx, signature, SIGNATURE_BYTES, data, len(data)) == 1)
        finally:
            self._ctx_free(ctx)
            self._free_key(key)


class CryptographyEd25519:
    """``cryptography``'s Ed25519: where the interpreter's libcrypto cannot be reached."""

    name = "cryptography"

    def sign(self, private_key: bytes, data: bytes) -> bytes:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        _check_key(private_key)
        return Ed25519PrivateKey.from_private_bytes(private_key).sign(data)

    def public_key(self, private_key: bytes) -> bytes:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        _check_key(private_key)
        return Ed25519PrivateKey.from_private_bytes(private_key).public_key().public_bytes_raw()

    def verify(self, public_key: bytes, signature: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        _check_key(public_key)
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
        except (InvalidSignature, ValueError):
            return False
        return True


# RFC 8032 §7.1 test 1 (the empty message): a backend is used only once it gives this answer.
_KNOWN_KEY = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
_KNOWN_SIGNATURE = bytes.fromhex("e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9"
                                 "b46bd25bf5f0595bbe24655141438e7a100b")


def interpreter_libcrypto(path: str | None = getattr(_ssl, "__file__", None)) -> LibcryptoEd25519 | None:
    """The Ed25519 of the libcrypto the library at ``path`` (``_ssl``'s file) links, or None where it cannot sign.

    None where ``_ssl`` is built in (no file), where its handle reaches no EVP symbols, and where libcrypto does
    not give RFC 8032's answer (a provider configuration without Ed25519, a FIPS-only host): the connect must
    sign, so a libcrypto that cannot is passed over for ``cryptography``, not found out at the first connect.
    """
    if not path:
        return None
    try:
        impl = LibcryptoEd25519(ctypes.CDLL(path))
        if impl.sign(_KNOWN_KEY, b"") == _KNOWN_SIGNATURE:
            return impl
    except (OSError, AttributeError, Ed25519Error):  # not loadable, no such symbols, or refused
        pass
    return None


@functools.cache
def backend() -> Ed25519Backend:
    """The interpreter's libcrypto where reachable, else ``cryptography`` (chosen once per process)."""
    return interpreter_libcrypto() or CryptographyEd25519()


def new_private_key() -> bytes:
    """A fresh private key: an Ed25519 private key is 32 bytes from the OS's CSPRNG (RFC 8032 §5.1.5)."""
    return os.urandom(KEY_BYTES)


def sign(private_key: bytes, data: bytes) -> bytes:
    return backend().sign(private_key, data)


def public_key(private_key: bytes) -> bytes:
    return backend().public_key(private_key)


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    return backend().verify(public_key, signature, data)
