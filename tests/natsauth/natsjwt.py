"""NATS decentralized auth for tests: operator, account and user JWTs signed with real NKEYs.

What ``nsc`` would produce, minus the tool (not packaged for this distribution): JWTs
are ``base64url(header).base64url(claims).base64url(ed25519 signature)`` with
``alg: ed25519-nkey``, the signer's public NKEY in ``iss``. The server verifies the
chain operator → account → user itself; this module only signs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field

import nkeys


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class Key:
    seed: bytes
    public: str

    @classmethod
    def new(cls, prefix: int) -> Key:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        return cls(seed=seed, public=nkeys.from_seed(bytearray(seed)).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(bytearray(self.seed)).sign(data)


def encode_jwt(signer: Key, subject: str, name: str, nats: dict, *, expires_at: float | None = None,
               issued_at: float | None = None) -> str:
    claims = {"iat": int(issued_at or time.time()), "iss": signer.public, "name": name, "sub": subject, "nats": nats}
    if expires_at is not None:
        claims["exp"] = int(expires_at)
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()) \
        .decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{header}.{body}.{_b64(signer.sign(f'{header}.{body}'.encode()))}"


def creds_text(user_jwt: str, user_seed: bytes) -> str:
    return (f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n------END USER NKEY SEED------\n")


ACCOUNT_LIMITS = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                  "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


@dataclass
class Operator:
    """One operator with one application account; :meth:`user` issues users, :meth:`revoke` revokes them."""

    key: Key = field(default_factory=lambda: Key.new(nkeys.PREFIX_BYTE_OPERATOR))
    account: Key = field(default_factory=lambda: Key.new(nkeys.PREFIX_BYTE_ACCOUNT))
    system: Key = field(default_factory=lambda: Key.new(nkeys.PREFIX_BYTE_ACCOUNT))
    revocations: dict[str, int] = field(default_factory=dict)

    @property
    def jwt(self) -> str:
        return encode_jwt(self.key, self.key.public, "test-operator",
                          {"type": "operator", "version": 2, "system_account": self.system.public})

    def account_jwt(self) -> str:
        nats = {"type": "account", "version": 2, "limits": ACCOUNT_LIMITS, "default_permissions": {"pub": {}, "sub": {}}}
        if self.revocations:
            nats["revocations"] = dict(self.revocations)
        return encode_jwt(self.key, self.account.public, "gpuaas", nats)

    def system_jwt(self) -> str:
        limits = {k: v for k, v in ACCOUNT_LIMITS.items() if k not in ("mem_storage", "disk_storage", "streams", "consumer")}
        return encode_jwt(self.key, self.system.public, "SYS", {"type": "account", "version": 2, "limits": limits})

    def user(self, name: str, *, expires_at: float | None = None, issued_at: float | None = None,
             pub: list[str] | None = None, sub: list[str] | None = None) -> tuple[str, Key]:
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        perms: dict = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
                       "pub": {"allow": pub} if pub else {}, "sub": {"allow": sub} if sub else {}}
        token = encode_jwt(self.account, user.public, name, perms, expires_at=expires_at, issued_at=issued_at)
        return creds_text(token, user.seed), user

    def user_jwt_for(self, public_key: str, name: str, *, pub: list[str] | None = None, sub: list[str] | None = None,
                     responses: int | None = None, expires_at: float | None = None) -> str:
        """A user JWT for a key born elsewhere (the node's): the control plane never sees its seed."""
        perms: dict = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
                       "pub": {"allow": pub} if pub else {}, "sub": {"allow": sub} if sub else {}}
        if responses is not None:
            perms["resp"] = {"max": responses, "ttl": 0}
        return encode_jwt(self.account, public_key, name, perms, expires_at=expires_at)

    def revoke(self, user: Key | str, at: float | None = None) -> None:
        self.revocations[user if isinstance(user, str) else user.public] = int(at or time.time())

    def server_config(self) -> str:
        """The resolver part of a nats-server config (memory resolver, accounts preloaded)."""
        return (f'operator: "{self.jwt}"\nsystem_account: {self.system.public}\nresolver: MEMORY\n'
                f'resolver_preload: {{\n  {self.account.public}: "{self.account_jwt()}"\n'
                f'  {self.system.public}: "{self.system_jwt()}"\n}}\n')
