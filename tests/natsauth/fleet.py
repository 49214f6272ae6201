"""The account-per-node fleet layout for tests: the claims of ``gpuaas_agent/control/accounts.py``, signed.

What a control plane does with ``nsc``/``nats-io/jwt``: the operator signs the control plane's
account (JetStream, the exports), a bootstrap account (the shared enrollment login) and one
account per node (no JetStream, the node's imports, each with an activation JWT signed by the
plane's account for that node's account and subject). The node's user JWT is signed by the
node's account. Account JWTs reach the server through a full resolver: preloaded in its config,
or pushed later (``$SYS.REQ.CLAIMS.UPDATE`` by a system-account user, as ``nsc push`` does).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import nkeys

from gpuaas_agent.control import accounts
from gpuaas_agent.control.permissions import ENROLL_PERMISSIONS, node_permissions
from tests.natsauth.natsjwt import ACCOUNT_LIMITS, Key, Operator, creds_text, encode_jwt

CLAIMS_UPDATE = "$SYS.REQ.CLAIMS.UPDATE"


@dataclass
class FleetOperator(Operator):
    """:class:`Operator` whose ``account`` is the control plane's; plus a bootstrap account and one per node."""

    bootstrap: Key = field(default_factory=lambda: Key.new(nkeys.PREFIX_BYTE_ACCOUNT))
    nodes: dict[str, Key] = field(default_factory=dict)  # node id -> its account (the plane keeps the seed)
    streams: dict[str, str] = field(default_factory=dict)  # node id -> the task stream its imports name
    # Bootstrap users revoked (public key -> unix time): a host's own bootstrap login once it has enrolled.
    bootstrap_revocations: dict[str, int] = field(default_factory=dict)

    def account_jwt(self) -> str:
        """The control plane's account: JetStream and the fixed exports."""
        nats = accounts.account_claims(exports=[e.claim() for e in accounts.plane_exports()], limits=ACCOUNT_LIMITS)
        if self.revocations:
            nats["revocations"] = dict(self.revocations)
        return encode_jwt(self.key, self.account.public, "gpuaas-control-plane", nats)

    def _imports(self, importer: Key, imports: tuple[accounts.Import, ...]) -> list[dict]:
        return [i.claim(self.account.public, encode_jwt(self.account, importer.public, i.name, i.activation_claims()))
                for i in imports]

    def bootstrap_jwt(self) -> str:
        nats = accounts.account_claims(imports=self._imports(self.bootstrap, accounts.enroll_imports()),
                                       limits=accounts.NODE_ACCOUNT_LIMITS | {"conn": -1})
        if self.bootstrap_revocations:
            nats["revocations"] = dict(self.bootstrap_revocations)
        return encode_jwt(self.key, self.bootstrap.public, "gpuaas-bootstrap", nats)

    def revoke_bootstrap(self, public_key: str) -> None:
        """Refuse a bootstrap user from now on (JWTs issued up to this second): its host has enrolled."""
        self.bootstrap_revocations[public_key] = int(time.time()) + 1

    def node_account(self, node_id: str, task_stream: str) -> Key:
        """The node's account key (made on first use); its imports name ``task_stream``."""
        self.streams[node_id] = task_stream
        return self.nodes.setdefault(node_id, Key.new(nkeys.PREFIX_BYTE_ACCOUNT))

    def node_jwt(self, node_id: str) -> str:
        key = self.nodes[node_id]
        nats = accounts.account_claims(
            imports=self._imports(key, accounts.node_imports(node_id, self.streams[node_id])),
            limits=accounts.NODE_ACCOUNT_LIMITS)
        return encode_jwt(self.key, key.public, f"gpuaas-node-{node_id}", nats)

    def node_user_jwt(self, node_id: str, public_key: str) -> str:
        """A user JWT in the node's account for a key born on the node, with the node's permissions."""
        perms = node_permissions(node_id, accounts.NODE_JS_API_PREFIX)
        claims = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
                  "pub": {"allow": perms["publish"]}, "sub": {"allow": perms["subscribe"]},
                  "resp": {"max": 1, "ttl": 0}}
        return encode_jwt(self.nodes[node_id], public_key, node_id, claims)

    def node_user(self, node_id: str) -> tuple[str, Key]:
        """Creds text for a fresh key in the node's account (a test harness standing in for enrollment)."""
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        return creds_text(self.node_user_jwt(node_id, user.public), user.seed), user

    def wide_user(self, node_id: str) -> str:
        """Creds for a user in the node's account with no permission limits: only the account's imports bound it."""
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        claims = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1, "pub": {}, "sub": {}}
        return creds_text(encode_jwt(self.nodes[node_id], user.public, f"wide-{node_id}", claims), user.seed)

    def bootstrap_user(self) -> str:
        return self.bootstrap_login()[0]

    def bootstrap_login(self) -> tuple[str, Key]:
        """Creds text and key of a new user of the bootstrap account (enrollment's permissions only)."""
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        claims = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
                  "pub": {"allow": ENROLL_PERMISSIONS["publish"]}, "sub": {"allow": ENROLL_PERMISSIONS["subscribe"]}}
        return creds_text(encode_jwt(self.bootstrap, user.public, "bootstrap", claims), user.seed), user

    def system_user(self) -> str:
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        claims = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1, "pub": {}, "sub": {}}
        return creds_text(encode_jwt(self.system, user.public, "sys", claims), user.seed)

    def resolver_config(self, directory: Path) -> str:
        """A full resolver in ``directory``, preloaded with the system, plane, bootstrap and known node accounts."""
        preload = {self.system.public: self.system_jwt(), self.account.public: self.account_jwt(),
                   self.bootstrap.public: self.bootstrap_jwt(),
                   **{key.public: self.node_jwt(node) for node, key in self.nodes.items()}}
        lines = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in preload.items())
        return (f'operator: "{self.jwt}"\nsystem_account: {self.system.public}\n'
                f'resolver: {{type: full, dir: {json.dumps(str(directory))}, allow_delete: false}}\n'
                f"resolver_preload: {{\n{lines}}}\n")
