"""How the agent may reach NATS: TLS (CA bundle, server name, optional client certificate) and `.creds` files.

Every slice host receives tenant secrets (SSH keys, user-data) and orders that wipe
disks over this connection, so:

* **TLS is required.** A ``nats://`` URL without TLS is refused (``plaintext_refused``,
  naming the URL and the setting) unless the config says ``insecure = true`` (the lab);
  loopback included, so a config that forgot TLS fails the same way on a test bench as
  in the fleet, and plaintext is always a visible decision (a WARNING names the server
  once the plaintext connection is up). With TLS the server certificate is verified against
  ``nats_tls_ca_file`` (or the system bundle) and its name against
  ``nats_tls_server_name`` (default: the URL's host); ``nats_tls_cert_file`` +
  ``nats_tls_key_file`` add a client certificate (mutual TLS).
* nats.py upgrades to TLS only when the server's INFO says ``tls_required``; a server
  (or a man in the middle) that answers a ``tls://`` URL in plaintext would receive
  our CONNECT in the clear. :class:`TlsEnforcingClient` refuses such an INFO before
  anything is sent.
* **Decentralized auth** (recommended): a ``.creds`` file (the user JWT + NKEY seed).
  It must be a regular file owned by us and readable by nobody else (0600/0400), or
  it is refused (``creds_insecure``) — nothing is sent. Its JWT is read to name an
  expiry before the server does (``creds_expired``). nats.py re-reads the file on every
  (re)connect, so rotating credentials is: replace the file atomically, reconnect
  (:func:`gpuaas_agent.control.rotation`); running slices are never touched.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import ssl
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats.errors
from nats.aio.client import Client

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.control.nkeyseed import sign_nonce
from gpuaas_agent.errors import AgentError

CREDS_JWT_BEGIN = "-----BEGIN NATS USER JWT-----"
CREDS_SEED_BEGIN = "-----BEGIN USER NKEY SEED-----"


class TransportError(AgentError):
    """The connection's security settings refuse this connection; nothing was sent."""

    default_code = "transport_refused"


@dataclass(frozen=True)
class TransportSecurity:
    """The TLS and credential settings of one connection (from :class:`~gpuaas_agent.config.AgentConfig`)."""

    ca_file: Path | None = None
    server_name: str | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    creds_file: Path | None = None
    insecure: bool = False

    @classmethod
    def from_config(cls, config: AgentConfig, *, enroll: bool = False) -> TransportSecurity:
        """The daemon's settings; ``enroll``: the bootstrap login (``nats_enroll_creds_file``, if any)."""
        return cls(ca_file=config.nats_tls_ca_file, server_name=config.nats_tls_server_name,
                   cert_file=config.nats_tls_cert_file, key_file=config.nats_tls_key_file,
                   creds_file=config.nats_enroll_creds_file if enroll else config.nats_creds_file,
                   insecure=config.insecure)

    @property
    def tls_configured(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def uses_tls(self, url: str) -> bool:
        return urlsplit(url).scheme == "tls" or self.tls_configured

    def check_servers(self, servers: list[str]) -> list[str]:
        """The URLs to dial (``tls://`` when TLS is configured); ``plaintext_refused`` for a plaintext one.

        Loopback is no exception: the rule is the config's ``insecure``, not where the server is.
        """
        out = []
        for url in servers:
            parts = urlsplit(url)
            if self.uses_tls(url):
                out.append(parts._replace(scheme="tls").geturl())
                continue
            if not self.insecure:
                shown = f"{parts.scheme}://{parts.hostname}:{parts.port}" if parts.port else f"{parts.scheme}://{parts.hostname}"
                raise TransportError(
                    f"refusing plaintext NATS to {shown}: use tls:// (and nats_tls_ca_file), "
                    "or set insecure = true in the agent config (labs only)", code="plaintext_refused",
                    evidence={"server": shown, "scheme": parts.scheme, "setting": "insecure"})
            out.append(url)
        return out

    def ssl_context(self) -> ssl.SSLContext:
        """Verify the server against ``ca_file`` (or the system bundle); present our certificate if given."""
        if (self.cert_file is None) != (self.key_file is None):
            raise TransportError("mutual TLS needs both nats_tls_cert_file and nats_tls_key_file",
                                 code="tls_config_invalid",
                                 evidence={"cert_file": str(self.cert_file), "key_file": str(self.key_file)})
        try:
            context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.cert_file is not None:
                check_secret_file(self.key_file, what="TLS key")
                context.load_cert_chain(str(self.cert_file), str(self.key_file))
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(f"TLS files cannot be used: {exc}", code="tls_config_invalid",
                                 evidence={"ca_file": str(self.ca_file), "cert_file": str(self.cert_file),
                                           "error": repr(exc)}) from None
        return context

    def connect_options(self, servers: list[str]) -> dict[str, Any]:
        """nats.py ``connect()`` options for TLS and credentials; raises before anything is dialled."""
        options: dict[str, Any] = {}
        if any(self.uses_tls(s) for s in servers):
            options["tls"] = self.ssl_context()
            if self.server_name:
                options["tls_hostname"] = self.server_name
        if self.creds_file is not None:
            check_creds_file(self.creds_file)
            options["user_credentials"] = str(self.creds_file)
        return options


class TlsEnforcingClient(Client):
    """A nats.py client that refuses a server whose first INFO does not require TLS, when we dialled TLS."""

    require_tls = False

    def __init__(self) -> None:
        super().__init__()
        # Called (no arguments) after every reconnect: the worker ends a pull the restarted server forgot.
        self.reconnect_listeners: list[Callable[[], None]] = []

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and self.require_tls and not info.get("tls_required"):
            raise nats.errors.Error("nats: server offered no TLS on a tls:// connection (refused before CONNECT)")
        await super()._process_info(info, initial_connection=initial_connection)

    def _setup_nkeys_jwt_connect(self) -> None:
        """Sign with :mod:`nkeyseed` (the Ed25519 of control/ed25519.py) instead of the ``nkeys`` package.

        The agent passes ``user_credentials`` as a path: the JWT and the seed are read from the
        file at each (re)connect, so a rotated ``.creds`` is what the next handshake uses.
        """
        creds = self._user_credentials
        if not isinstance(creds, (str, Path)):  # a (jwt, seed) pair of paths or raw bytes: nats.py's own way
            super()._setup_nkeys_jwt_connect()
            return
        self._user_jwt_cb = lambda: self._read_creds_user_jwt(creds)
        self._signature_cb = lambda nonce: sign_nonce(bytes(self._read_creds_user_nkey(creds)), nonce)


def check_secret_file(path: Path | None, *, what: str) -> os.stat_result:
    """``path`` is a regular file owned by us (or root) and neither group- nor world-accessible."""
    assert path is not None
    try:
        info = os.stat(path)
    except OSError as exc:
        raise TransportError(f"{what} {path} cannot be read: {exc.strerror}", code="creds_unreadable",
                             evidence={"path": str(path), "error": exc.strerror}) from None
    if not stat.S_ISREG(info.st_mode):
        raise TransportError(f"{what} {path} is not a regular file", code="creds_unreadable",
                             evidence={"path": str(path)})
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077 or info.st_uid not in (os.geteuid(), 0):
        raise TransportError(
            f"{what} {path} is mode {mode:04o} owned by uid {info.st_uid}: it must be 0600 (or 0400) and ours",
            code="creds_insecure", evidence={"path": str(path), "mode": f"{mode:04o}", "uid": info.st_uid})
    return info


@dataclass(frozen=True)
class CredsInfo:
    """What a `.creds` file's user JWT says (read, not verified: the server verifies the signatures)."""

    user_key: str
    name: str | None
    expires_at: float | None  # unix seconds; None: no expiry


def _b64url(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def parse_creds(text: str, *, source: str = "creds") -> CredsInfo:
    """The JWT's subject, name and expiry; ``creds_invalid`` for anything that is not a user `.creds`."""
    lines = [line.strip() for line in text.splitlines()]
    try:
        token = lines[lines.index(CREDS_JWT_BEGIN) + 1]
        seed = lines[lines.index(CREDS_SEED_BEGIN) + 1]
        claims = json.loads(_b64url(token.split(".")[1]))
    except (ValueError, IndexError, binascii.Error, UnicodeDecodeError) as exc:
        raise TransportError(f"{source} is not a NATS user .creds file (JWT + NKEY seed)", code="creds_invalid",
                             evidence={"source": source, "error": type(exc).__name__}) from None
    if not isinstance(claims, dict) or not seed.startswith("SU") or not str(claims.get("sub", "")).startswith("U"):
        raise TransportError(f"{source} does not hold a user JWT and user seed", code="creds_invalid",
                             evidence={"source": source})
    exp = claims.get("exp")
    return CredsInfo(user_key=str(claims["sub"]), name=claims.get("name"),
                     expires_at=float(exp) if isinstance(exp, (int, float)) and exp > 0 else None)


def creds_text(user_jwt: str, seed: str) -> str:
    """A NATS user ``.creds`` (the layout ``nsc`` writes): the JWT, then the NKEY seed."""
    return (f"{CREDS_JWT_BEGIN}\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"{CREDS_SEED_BEGIN}\n{seed}\n------END USER NKEY SEED------\n")


def jwt_claims(user_jwt: str) -> dict[str, Any]:
    """The claims of a JWT (read, not verified: the server verifies); ``{}`` when unreadable."""
    try:
        claims = json.loads(_b64url(user_jwt.split(".")[1]))
    except (ValueError, IndexError, binascii.Error, UnicodeDecodeError):
        return {}
    return claims if isinstance(claims, dict) else {}


def check_creds_file(path: Path, *, now: float | None = None) -> CredsInfo:
    """Permissions, shape and expiry of a `.creds` file, before it is offered to a server."""
    check_secret_file(path, what="NATS credentials")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TransportError(f"NATS credentials {path} cannot be read", code="creds_unreadable",
                             evidence={"path": str(path), "error": repr(exc)}) from None
    info = parse_creds(text, source=str(path))
    now = time.time() if now is None else now
    if info.expires_at is not None and info.expires_at <= now:
        raise TransportError(
            f"NATS credentials {path} expired at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(info.expires_at))}; "
            "enroll again or install rotated credentials", code="creds_expired",
            evidence={"path": str(path), "expires_at": info.expires_at, "user": info.user_key})
    return info
