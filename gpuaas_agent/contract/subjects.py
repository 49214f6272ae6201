"""The NATS subjects of a node, built in one place (docs/contract.md).

Every subject of a node lives under ``gpuaas.node.<node>.``: the least-privilege
permissions of a node (its own subjects only) hold for what is added here too. The
terminal relay's subjects carry the session id, a UUID, so a session's bytes can be
neither read nor injected under another session's name by a typo.

Every module that publishes, subscribes or grants a permission asks here (a test scans the
package for subjects spelled anywhere else).
"""

from __future__ import annotations

from collections.abc import Callable

from gpuaas_agent.contract.types import UUID_RE

ENROLL = "gpuaas.enroll"
ENROLL_NONCE = "gpuaas.enroll.nonce"  # a single-use server nonce the enrollment request's token proof covers
ENROLL_INBOX_PREFIX = "_INBOX.enroll"  # + the attempt's reply_key_id (contract/enrollment.py): answers are bound by content
# The namespaces a JetStream API prefix sent by the control plane may not lie in (contract/enrollment.py): every
# node's own subjects, enrollment's, and the reply inboxes.
NOT_JS_API: tuple[str, ...] = ("gpuaas.node", ENROLL, "_INBOX")


def _node(node_id: str) -> str:
    if not node_id or any(c in node_id for c in ".*> \t\r\n"):
        raise ValueError(f"node id {node_id!r} cannot be a subject token")
    return f"gpuaas.node.{node_id}"


def task(node_id: str, task_type: str) -> str:
    return f"{_node(node_id)}.task.{task_type}"


def tasks(node_id: str) -> str:
    """The agent's consumer filter: every task type of the node."""
    return f"{_node(node_id)}.task.>"


def result(node_id: str) -> str:
    return f"{_node(node_id)}.result"


def progress(node_id: str) -> str:
    return f"{_node(node_id)}.progress"


def heartbeat(node_id: str) -> str:
    return f"{_node(node_id)}.heartbeat"


def drift(node_id: str) -> str:
    return f"{_node(node_id)}.drift"


def telemetry(node_id: str, allocation_id: str) -> str:
    """Agent -> control plane: one allocation's slice telemetry (contract/telemetry.py); the allocation is a token
    of the subject, so the plane routes each tenant its own slices by subject, never by reading the body."""
    if not UUID_RE.match(allocation_id):
        raise ValueError(f"allocation id {allocation_id!r} is not a lower-case UUID")
    return f"{_node(node_id)}.telemetry.{allocation_id}"


def telemetry_any(node_id: str) -> str:
    """Every allocation's telemetry subject of the node (a permission or the plane's subscription)."""
    return f"{_node(node_id)}.telemetry.*"


def _session(session_id: str) -> str:
    if not UUID_RE.match(session_id):
        raise ValueError(f"terminal session id {session_id!r} is not a lower-case UUID")
    return session_id


def terminal_in(node_id: str, session_id: str) -> str:
    """Gateway -> agent: keystrokes and output credit of one terminal session."""
    return f"{_node(node_id)}.terminal.{_session(session_id)}.in"


def terminal_out(node_id: str, session_id: str) -> str:
    """Agent -> gateway: the guest's PTY output, input acks and the closing frame of one session."""
    return f"{_node(node_id)}.terminal.{_session(session_id)}.out"


def terminal_in_any(node_id: str) -> str:
    """Every terminal session's input subject of the node (a permission, never a subscription)."""
    return f"{_node(node_id)}.terminal.*.in"


def terminal_out_any(node_id: str) -> str:
    """Every terminal session's output subject of the node (a permission)."""
    return f"{_node(node_id)}.terminal.*.out"


def creds(node_id: str) -> str:
    """Control plane -> agent: a credential rotation (request/reply)."""
    return f"{_node(node_id)}.creds"


def creds_renew(node_id: str) -> str:
    """Agent -> control plane: a user JWT for the node's new public key (request/reply)."""
    return f"{_node(node_id)}.creds.renew"


def creds_reply(node_id: str, token: str) -> str:
    """Agent -> control plane: the answer to one rotation order, where the order named it as its reply.

    The account-per-node layout (control/accounts.py): an order reaches the node by a stream import,
    which carries no way back, so the plane names a reply the node's account imports as a service.
    """
    if not token or any(c in token for c in ".*> \t\r\n"):
        raise ValueError(f"reply token {token!r} cannot be a subject token")
    return f"{_node(node_id)}.creds.reply.{token}"


def creds_reply_any(node_id: str) -> str:
    """Every rotation answer of the node (an import or a permission, never a subscription of the node)."""
    return f"{_node(node_id)}.creds.reply.*"


_ANY_NODE = "any-node"


def every_node(subject_of: Callable[[str], str]) -> str:
    """``subject_of``'s subject with ``*`` in the node's slot: a control plane's stream or export, never a
    node's permission (``every_node(result)`` is ``gpuaas.node.*.result``)."""
    subject = subject_of(_ANY_NODE)
    return subject.replace(f"{_node(_ANY_NODE)}.", "gpuaas.node.*.", 1)


def inbox_prefix(node_id: str) -> str:
    """``_INBOX.<node>``: this node's replies (JetStream API, PubAcks, pulled tasks) and no one else's."""
    _node(node_id)
    return f"_INBOX.{node_id}"


def enroll_inbox_prefix(token: str) -> str:
    return f"{ENROLL_INBOX_PREFIX}.{token}"
