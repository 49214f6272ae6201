"""An account per node: what each NATS account of the fleet exports and imports, in one place.

Why accounts and not only permissions: NATS checks a message's *reply* subject against nothing,
so in one shared account a node could name another node's subject as the reply of its own
allowed requests (a consumer lookup, a pull, a publish the result stream acknowledges) and the
server answered there. Across accounts the server rewrites every request's reply into a private
``_R_`` subject of the exporting account and sends the answer back into the requester's account
only: a node's answers stay in its own account, where no other node can listen.

The layout, as ``nsc`` makes it (operator → accounts → users, account JWTs on a resolver):

* the **control plane's account** holds JetStream (each node's own task and result stream,
  ``control/streams.py``; the node consumers)
  and exports, each ``token_req`` (an activation JWT signed by the plane's account names the one
  importing account and the one subject it may import): the JetStream requests a node needs on its
  own consumer (``CONSUMER.INFO``, ``CONSUMER.MSG.NEXT`` with response type ``Stream``, ``$JS.ACK``;
  no ``STREAM.NAMES``: the node binds its own stream by name, and a listing would name every node), the subjects a node publishes (services, so a publish the result stream
  acknowledges gets its ack back), the rotation answers, and — as streams — what the plane sends a
  node (rotation orders, terminal input);
* **one account per node**, without JetStream, importing exactly its own subjects of those
  (:func:`node_imports`). The JetStream requests are imported under :data:`NODE_JS_API_PREFIX`:
  an account without JetStream answers ``$JS.API.>`` itself (503 "JetStream not enabled"), so
  the agent is configured with ``js_api_prefix`` (config) and asks there;
* one **bootstrap account** for the shared enrollment login, importing ``gpuaas.enroll`` and
  ``gpuaas.enroll.nonce`` (:func:`enroll_imports`).

This module gives the claims (the ``nats`` part of account and activation JWTs) as plain data; a
control plane signs them (``tests/natsauth/fleet.py`` with ``nkeys``, the Go control plane with
``nats-io/jwt``). The node's user keeps :func:`~gpuaas_agent.control.permissions.node_permissions`
(with the prefix) inside its account: the account boundary closes the reply-subject hole, the
user permissions keep the rest as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gpuaas_agent.contract import subjects
from gpuaas_agent.control.permissions import consumer_name

JS_API = "$JS.API"  # JetStream's API prefix in the account that has JetStream
NODE_JS_API_PREFIX = "gpuaas.js.API"  # where a node account imports it (config js_api_prefix)
JS_ACK = "$JS.ACK"  # ack subjects are not intercepted by an account without JetStream: imported as they are

Kind = Literal["service", "stream"]
ResponseType = Literal["Singleton", "Stream"]


@dataclass(frozen=True)
class Export:
    """One export of the control plane's account."""

    name: str
    subject: str
    kind: Kind
    # Services: Stream when one request gets many answers (a pull). The server keeps a request's way back for the
    # export's response threshold (nats-server's default, 2 min), which must outlast a pull's expiry (30 s).
    response_type: ResponseType = "Singleton"
    token_req: bool = True  # only an account holding an activation for (a part of) it may import it

    def claim(self) -> dict[str, Any]:
        claim: dict[str, Any] = {"name": self.name, "subject": self.subject, "type": self.kind}
        if self.token_req:
            claim["token_req"] = True
        if self.kind == "service" and self.response_type != "Singleton":
            claim["response_type"] = self.response_type
        return claim


@dataclass(frozen=True)
class Import:
    """One import of a node's (or the bootstrap) account from the control plane's account."""

    name: str
    subject: str  # the subject in the control plane's account (within one of its exports)
    kind: Kind
    local_subject: str | None = None  # where the importing account sees it; None: the same subject

    def claim(self, exporter: str, token: str) -> dict[str, Any]:
        """The import's entry in the importing account's JWT; ``token``: the activation JWT for it."""
        claim: dict[str, Any] = {"name": self.name, "subject": self.subject, "account": exporter,
                                 "token": token, "type": self.kind}
        if self.local_subject is not None:
            claim["local_subject"] = self.local_subject
        return claim

    def activation_claims(self) -> dict[str, Any]:
        """The ``nats`` part of the activation JWT (issuer: the plane's account; subject: the importer)."""
        return {"type": "activation", "version": 2, "subject": self.subject, "kind": self.kind}


def _js(api: str, prefix: str = JS_API) -> str:
    return f"{prefix}.{api}"


def plane_exports() -> tuple[Export, ...]:
    """The control plane account's exports: fixed, whatever the fleet's size (each node imports a part)."""
    every = subjects.every_node
    return (
        Export("js-consumer-info", _js("CONSUMER.INFO.*.*"), "service"),
        Export("js-consumer-next", _js("CONSUMER.MSG.NEXT.*.*"), "service", response_type="Stream"),
        Export("js-ack", f"{JS_ACK}.*.*.>", "service"),
        Export("result", every(subjects.result), "service"),
        Export("progress", every(subjects.progress), "service"),
        Export("heartbeat", every(subjects.heartbeat), "service"),
        Export("drift", every(subjects.drift), "service"),
        Export("terminal-out", every(subjects.terminal_out_any), "service"),
        Export("telemetry", every(subjects.telemetry_any), "service"),
        Export("creds-renew", every(subjects.creds_renew), "service"),
        Export("creds-reply", every(subjects.creds_reply_any), "service"),
        Export("creds", every(subjects.creds), "stream"),
        Export("terminal-in", every(subjects.terminal_in_any), "stream"),
        Export("enroll", subjects.ENROLL, "service"),
        Export("enroll-nonce", subjects.ENROLL_NONCE, "service"),
    )


def node_imports(node_id: str, task_stream: str) -> tuple[Import, ...]:
    """What ``node_id``'s account imports: its own consumer on ``task_stream`` and its own subjects, no more.

    ``task_stream``: the node's own (``control/streams.py`` ``task_stream_name``), so its acks can name
    sequences of its own tasks only.

    ``task_stream`` is named, not wildcarded (nats-server 2.9 does not serve a wildcard service
    import renamed to a local subject): a control plane that moves a node's consumer to another
    stream re-issues the node's account JWT.
    """
    consumer = consumer_name(node_id)

    def js(name: str, api: str) -> Import:
        return Import(name, _js(api), "service", local_subject=_js(api, NODE_JS_API_PREFIX))
    return (
        js("js-consumer-info", f"CONSUMER.INFO.{task_stream}.{consumer}"),
        js("js-consumer-next", f"CONSUMER.MSG.NEXT.{task_stream}.{consumer}"),
        Import("js-ack", f"{JS_ACK}.{task_stream}.{consumer}.>", "service"),
        Import("result", subjects.result(node_id), "service"),
        Import("progress", subjects.progress(node_id), "service"),
        Import("heartbeat", subjects.heartbeat(node_id), "service"),
        Import("drift", subjects.drift(node_id), "service"),
        Import("terminal-out", subjects.terminal_out_any(node_id), "service"),
        Import("telemetry", subjects.telemetry_any(node_id), "service"),
        Import("creds-renew", subjects.creds_renew(node_id), "service"),
        Import("creds-reply", subjects.creds_reply_any(node_id), "service"),
        Import("creds", subjects.creds(node_id), "stream"),
        Import("terminal-in", subjects.terminal_in_any(node_id), "stream"),
    )


def enroll_imports() -> tuple[Import, ...]:
    """The bootstrap account's imports: a nonce and an enrollment, answered in its own account only."""
    return (Import("enroll", subjects.ENROLL, "service"), Import("enroll-nonce", subjects.ENROLL_NONCE, "service"))


# Account limits (the ``limits`` of an account JWT). -1: unlimited. A node account has no JetStream
# (all four JetStream limits 0): its JetStream requests go to the plane's account through its imports.
UNLIMITED = -1
NODE_ACCOUNT_LIMITS: dict[str, int | bool] = {
    "subs": UNLIMITED, "conn": 4, "leaf": 0, "imports": 16, "exports": 0, "data": UNLIMITED, "payload": UNLIMITED,
    "wildcards": True, "mem_storage": 0, "disk_storage": 0, "streams": 0, "consumer": 0,
}


def account_claims(imports: list[dict[str, Any]] | None = None, exports: list[dict[str, Any]] | None = None,
                   limits: dict[str, int | bool] | None = None) -> dict[str, Any]:
    """The ``nats`` part of an account JWT (operator-signed)."""
    claims: dict[str, Any] = {"type": "account", "version": 2,
                              "default_permissions": {"pub": {}, "sub": {}}}
    if imports:
        claims["imports"] = imports
    if exports:
        claims["exports"] = exports
    if limits is not None:
        claims["limits"] = dict(limits)
    return claims
