"""The node's terminal relay key (seed 004): one ed25519 key pair, generated once, never replaced.

The agent writes the public half (``[slice].terminal_relay_key_file``, a ``.pub``)
into every slice's ``ssh_authorized_keys``; the terminal relay opens an SSH PTY
into the guest with the private half beside it (the same path without
``.pub``). A provision on a host without it fails with ``relay_key_missing``, so
the package creates it (``gpuaas-agent prepare-host``), not the first provision.

Rules: an existing private key is never overwritten, re-permissioned or
re-generated (every running slice trusts it). It must be a regular file owned
by root, not readable by group or others, and an unencrypted OpenSSH ed25519
key; anything else is refused with a typed error and nothing is written. A
missing ``.pub`` beside a good private key is derived from it (the public blob
is stored in the key file's clear header); a ``.pub`` without its private key,
or one that does not match it, is refused. A new pair comes from
``ssh-keygen -t ed25519 -N ''`` (openssh-client is in the package's Depends),
written under temporary names and hard-linked into place, so a concurrent or
earlier key is never clobbered.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import os
import shutil
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from gpuaas_agent.atomicfile import fsync_dir, write_atomic
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.run import run

KEY_TYPE = "ssh-ed25519"
PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644
COMMENT = "gpuaas-terminal-relay"
KEYGEN_TIMEOUT_S = 30.0
MAX_KEY_BYTES = 64 << 10  # an ed25519 key file is ~400 bytes; refuse to slurp anything large
_PEM_BEGIN = "-----BEGIN OPENSSH PRIVATE KEY-----"
_PEM_END = "-----END OPENSSH PRIVATE KEY-----"
_MAGIC = b"openssh-key-v1\x00"


class RelayKeyError(AgentError):
    """The relay key on this host cannot be used as it is; nothing was written."""

    default_code = "relay_key_invalid"


@dataclass(frozen=True)
class RelayKey:
    """A checked key pair: the public blob (``ssh-ed25519`` wire form) and its comment."""

    private: Path
    public: Path
    blob: bytes
    comment: str

    @property
    def public_line(self) -> str:
        return f"{KEY_TYPE} {base64.b64encode(self.blob).decode()} {self.comment}".rstrip() + "\n"

    @property
    def fingerprint(self) -> str:
        """``SHA256:...`` exactly as ``ssh-keygen -l`` prints it."""
        return "SHA256:" + base64.b64encode(hashlib.sha256(self.blob).digest()).decode().rstrip("=")


def private_path(public: Path) -> Path:
    """The private key beside ``public`` (which must end in ``.pub``)."""
    public = Path(public)
    if public.suffix != ".pub" or not public.stem:
        raise RelayKeyError(f"terminal_relay_key_file {public} must name the public key (a .pub file)",
                            code="relay_key_path_invalid", evidence={"path": str(public)})
    return public.with_suffix("")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError("truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return cast(int, struct.unpack(">I", self.take(4))[0])

    def string(self) -> bytes:
        return self.take(self.u32())


def _check_blob(blob: bytes) -> None:
    r = _Reader(blob)
    if r.string() != KEY_TYPE.encode() or len(r.string()) != 32 or r.pos != len(blob):
        raise ValueError("not an ed25519 public key")


def _read_regular(path: Path, *, what: str, secret: bool) -> bytes:
    """Read ``path`` after checking it is a root-owned regular file with safe permissions."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RelayKeyError(f"{what} {path} cannot be read: {exc.strerror}", code="relay_key_unreadable",
                            evidence={"path": str(path), "errno": exc.errno}) from None
    mode = stat.S_IMODE(st.st_mode)
    evidence = {"path": str(path), "mode": f"{mode:04o}", "uid": st.st_uid}
    if stat.S_ISLNK(st.st_mode):
        raise RelayKeyError(f"{what} {path} is a symlink; it must be a regular file owned by root",
                            code="relay_key_insecure", evidence=evidence)
    if not stat.S_ISREG(st.st_mode):
        raise RelayKeyError(f"{what} {path} is not a regular file", code="relay_key_unreadable", evidence=evidence)
    if st.st_uid != os.geteuid():
        raise RelayKeyError(f"{what} {path} is owned by uid {st.st_uid}, not by uid {os.geteuid()} (root)",
                            code="relay_key_insecure", evidence=evidence)
    if secret and mode & 0o077:
        raise RelayKeyError(f"{what} {path} has mode {mode:04o}; it must be 0600 (owner only): fix it by hand "
                            "(chmod 0600) after checking who could have read it", code="relay_key_insecure",
                            evidence=evidence)
    if not secret and mode & 0o022:
        raise RelayKeyError(f"{what} {path} has mode {mode:04o}: writable by group or others", code="relay_key_insecure",
                            evidence=evidence)
    if st.st_size > MAX_KEY_BYTES:
        raise RelayKeyError(f"{what} {path} is {st.st_size} bytes: not an ed25519 key", evidence=evidence)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            return fh.read(MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise RelayKeyError(f"{what} {path} cannot be read: {exc.strerror}", code="relay_key_unreadable",
                            evidence={**evidence, "errno": exc.errno}) from None


def parse_private(data: bytes, path: Path) -> tuple[bytes, str]:
    """The public blob and comment of an unencrypted OpenSSH ed25519 private key; :class:`RelayKeyError` otherwise."""
    evidence = {"path": str(path)}
    try:
        text = data.decode("ascii").strip()
        if not (text.startswith(_PEM_BEGIN) and text.endswith(_PEM_END)):
            raise ValueError("not an OpenSSH private key (PEM header missing)")
        raw = base64.b64decode("".join(text[len(_PEM_BEGIN):-len(_PEM_END)].split()), validate=True)
        if not raw.startswith(_MAGIC):
            raise ValueError("not an openssh-key-v1 key")
        r = _Reader(raw[len(_MAGIC):])
        cipher, kdf, _kdfopts, nkeys = r.string(), r.string(), r.string(), r.u32()
        if nkeys != 1:
            raise ValueError(f"holds {nkeys} keys, expected 1")
        blob = r.string()
        key_type = _Reader(blob).string().decode(errors="replace")
        if key_type != KEY_TYPE:
            raise RelayKeyError(f"terminal relay key {path} is a {key_type} key; it must be {KEY_TYPE}",
                                evidence={**evidence, "key_type": key_type})
        _check_blob(blob)
        if cipher != b"none" or kdf != b"none":
            raise RelayKeyError(f"terminal relay key {path} is passphrase-protected; the relay runs unattended",
                                evidence=evidence)
        private = _Reader(r.string())
        if private.u32() != private.u32():
            raise ValueError("check integers differ (corrupt key)")
        if private.string() != KEY_TYPE.encode() or private.string() != blob[-32:]:
            raise ValueError("private section does not match the public key")
        if len(private.string()) != 64:
            raise ValueError("private scalar has the wrong length")
        comment = private.string().decode("utf-8", errors="replace")
    except (ValueError, UnicodeDecodeError, binascii.Error, struct.error) as exc:
        raise RelayKeyError(f"terminal relay key {path} is not a usable ed25519 key: {exc}",
                            evidence={**evidence, "reason": str(exc)}) from None
    return blob, comment


def _parse_public(data: bytes, path: Path) -> bytes:
    try:
        fields = data.decode("ascii").split()
        if len(fields) < 2 or fields[0] != KEY_TYPE:
            raise ValueError(f"expected '{KEY_TYPE} <base64> [comment]'")
        blob = base64.b64decode(fields[1], validate=True)
        _check_blob(blob)
    except (ValueError, UnicodeDecodeError, binascii.Error, struct.error) as exc:
        raise RelayKeyError(f"terminal relay public key {path} is not an ed25519 public key: {exc}",
                            evidence={"path": str(path)}) from None
    return blob


@dataclass(frozen=True)
class Inspection:
    """What is on disk now: ``key`` when the private key is good; ``public_ok`` when the .pub matches it."""

    key: RelayKey | None
    public_ok: bool


def inspect(public: Path) -> Inspection:
    """Check what exists at ``public`` and its private key, writing nothing; :class:`RelayKeyError` when unusable."""
    public = Path(public)
    private = private_path(public)
    try:
        blob, comment = parse_private(_read_regular(private, what="terminal relay key", secret=True), private)
    except FileNotFoundError:
        if os.path.lexists(public):
            raise RelayKeyError(f"terminal relay public key {public} exists without its private key {private}; "
                                "remove it or restore the private key", code="relay_key_incomplete",
                                evidence={"path": str(public), "private": str(private)}) from None
        return Inspection(key=None, public_ok=False)
    key = RelayKey(private=private, public=public, blob=blob, comment=comment)
    try:
        public_blob = _parse_public(_read_regular(public, what="terminal relay public key", secret=False), public)
    except FileNotFoundError:
        return Inspection(key=key, public_ok=False)
    if public_blob != blob:
        raise RelayKeyError(f"terminal relay public key {public} does not match its private key {private}",
                            code="relay_key_mismatch", evidence={"path": str(public), "private": str(private),
                                                                 "private_fingerprint": key.fingerprint})
    return Inspection(key=key, public_ok=True)


async def _generate(private: Path) -> None:
    """A new pair under temporary names in the key's directory, linked into place (never over a file)."""
    tmp = Path(tempfile.mkdtemp(prefix=".relaykey-", dir=private.parent))
    try:
        staged = tmp / "key"
        await run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", COMMENT, "-f", str(staged)],
                  timeout=KEYGEN_TIMEOUT_S)
        os.chmod(staged, PRIVATE_MODE)
        os.chmod(staged.with_suffix(".pub"), PUBLIC_MODE)
        parse_private(staged.read_bytes(), staged)  # what ssh-keygen wrote is what we accept later
        for src, dest in ((staged, private), (staged.with_suffix(".pub"), private.with_suffix(".pub"))):
            try:
                os.link(src, dest)
            except FileExistsError:
                raise RelayKeyError(f"{dest} appeared while the relay key was being generated; left it as it is",
                                    code="relay_key_incomplete", evidence={"path": str(dest)}) from None
        fsync_dir(private.parent)
    except OSError as exc:
        raise RelayKeyError(f"cannot write the terminal relay key in {private.parent}: {exc.strerror}",
                            code="relay_key_write_failed",
                            evidence={"path": str(private), "errno": exc.errno or errno.EIO}) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def ensure(public: Path) -> tuple[str, RelayKey]:
    """Make the key pair exist; returns the outcome (``unchanged``, ``public_written``, ``generated``) and the key.

    The key's directory must exist (``prepare-host`` creates it 0700 first).
    """
    public = Path(public)
    found = inspect(public)
    if found.key is not None and found.public_ok:
        return "unchanged", found.key
    if found.key is not None:
        write_atomic(public, found.key.public_line.encode(), mode=PUBLIC_MODE)
        return "public_written", found.key
    await _generate(private_path(public))
    made = inspect(public)
    if made.key is None or not made.public_ok:
        raise RelayKeyError(f"terminal relay key {public} is still missing after ssh-keygen", code="relay_key_write_failed",
                            evidence={"path": str(public)})
    return "generated", made.key
