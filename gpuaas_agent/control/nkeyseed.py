"""NKEY user keys without the ``nkeys`` package: make a pair, name its public key, sign the server's nonce.

Why: nats.py signs through ``nkeys`` (and PyNaCl), which exist on PyPI only as a source
tarball and an extra native library; the Ed25519 here (``control/ed25519.py``: the libcrypto
``ssl`` already maps, ``cryptography`` where that cannot be reached) is the same signature.
An NKEY seed is base32 (no padding) of two prefix bytes, the 32-byte Ed25519 seed and a
CRC-16/XMODEM (little endian) over the rest; a user seed starts ``SU``; a public key is base32 of
the prefix byte, the 32-byte Ed25519 public key and the same CRC (a user key starts ``U``). The seed is read from the file for each
signature, so a rotated ``.creds`` is used at the next (re)connect.

Keys are born here: enrollment and every rotation make a fresh pair with :func:`new_user_seed`,
and only :func:`public_key` of it leaves the host (the control plane signs a user JWT for it).
"""

from __future__ import annotations

import base64
import binascii

from gpuaas_agent.control import ed25519

PREFIX_BYTE_SEED = 18 << 3  # 'S'
PREFIX_BYTE_USER = 20 << 3  # 'U'


class NkeySeedError(ValueError):
    """The text is not a valid NKEY user seed (the message never contains the seed)."""


def _crc16_xmodem(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def user_private_key(seed: str | bytes) -> bytes:
    """The Ed25519 private key (32 bytes) of a user seed (``SU...``); :class:`NkeySeedError` for anything else."""
    text = seed.decode("ascii", "replace") if isinstance(seed, (bytes, bytearray)) else seed
    text = text.strip()
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError):
        raise NkeySeedError("not base32") from None
    if len(raw) != 36:
        raise NkeySeedError(f"decodes to {len(raw)} bytes, a seed is 36")
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if _crc16_xmodem(body) != crc:
        raise NkeySeedError("checksum mismatch")
    if body[0] & 0xF8 != PREFIX_BYTE_SEED:
        raise NkeySeedError("not a seed")
    prefix = ((body[0] & 0x07) << 5) | ((body[1] & 0xF8) >> 3)
    if prefix != PREFIX_BYTE_USER:
        raise NkeySeedError("not a user seed")
    return bytes(body[2:34])


def sign_nonce(seed: str | bytes, nonce: str) -> bytes:
    """What nats.py sends as ``sig``: base64 (standard alphabet) of the Ed25519 signature of the nonce."""
    return base64.b64encode(ed25519.sign(user_private_key(seed), nonce.encode()))


def _b32(body: bytes) -> str:
    raw = body + _crc16_xmodem(body).to_bytes(2, "little")
    return base64.b32encode(raw).decode("ascii").rstrip("=")


def new_user_seed() -> str:
    """A fresh user seed (``SU...``) from the OS's CSPRNG."""
    raw = ed25519.new_private_key()
    prefix = bytes([PREFIX_BYTE_SEED | (PREFIX_BYTE_USER >> 5), (PREFIX_BYTE_USER & 0x1F) << 3])
    return _b32(prefix + raw)


def public_key(seed: str | bytes) -> str:
    """The user public NKEY (``U...``) of a user seed: what may leave the host."""
    raw = ed25519.public_key(user_private_key(seed))
    return _b32(bytes([PREFIX_BYTE_USER]) + raw)


def user_public_key_bytes(key: str) -> bytes:
    """The Ed25519 public key of a user public NKEY; :class:`NkeySeedError` for anything else."""
    try:
        raw = base64.b32decode(key + "=" * (-len(key) % 8))
    except (binascii.Error, ValueError):
        raise NkeySeedError("not base32") from None
    if len(raw) != 35 or raw[0] != PREFIX_BYTE_USER or _crc16_xmodem(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise NkeySeedError("not a user public key")
    return raw[1:33]


def sign(seed: str | bytes, data: bytes) -> bytes:
    """The raw Ed25519 signature of ``data`` by the seed's key."""
    return ed25519.sign(user_private_key(seed), data)


def verify(key: str, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is the user public NKEY ``key``'s signature of ``data``."""
    try:
        return ed25519.verify(user_public_key_bytes(key), signature, data)
    except NkeySeedError:
        return False
