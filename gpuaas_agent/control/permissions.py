"""The exact NATS permissions one node needs, and nothing more: the control plane mints them into the node's user.

One source for the permission table (docs/security-auth.md), the least-privilege test (a real nats-server with
per-node users) and any control plane that signs user JWTs. With these a node can
publish only its own results/progress/heartbeats/drift, terminal output and renewal requests, receive
only replies on its own inbox (``_INBOX.<node>.``), its own rotation orders and its own terminal
input, look up its own consumer, pull and ack only through it, and find which stream holds its
tasks. It can neither read nor enqueue anyone's tasks, nor read anyone's results, replies or
credentials. ``allow_responses`` lets it answer the control plane's rotation order on the reply
subject that order carried (one reply, never a wildcard).

It can create, change or delete no consumer and no stream: a consumer's body is the node's to
write on ``CONSUMER.CREATE`` (a push ``deliver_subject``, a republish, ...), and the server then
publishes wherever that body says, beyond the node's own publish permissions. So the control
plane creates each node's pull consumer (:func:`gpuaas_agent.control.consumer.node_consumer_config`)
and re-creates it when its cluster member is lost.
"""

from __future__ import annotations

from typing import Any

from gpuaas_agent.contract import subjects


def consumer_name(node_id: str) -> str:
    return f"gpuaas-agent-{node_id}"


def node_permissions(node_id: str, js_api_prefix: str = "$JS.API") -> dict[str, list[str]]:
    """``{"publish": [...], "subscribe": [...]}`` for ``node_id`` (any task stream: ``*`` in its slot).

    ``js_api_prefix``: where the node sends its JetStream requests (``control/accounts.py``'s
    ``NODE_JS_API_PREFIX`` in the account-per-node layout; acks keep ``$JS.ACK``).
    """
    consumer = consumer_name(node_id)
    return {
        "publish": [
            subjects.result(node_id),
            subjects.progress(node_id),
            subjects.heartbeat(node_id),
            subjects.drift(node_id),
            subjects.terminal_out_any(node_id),  # a terminal session's guest output (slice.terminal_*)
            subjects.telemetry_any(node_id),  # slice telemetry, one subject per allocation (operator/telemetry.py)
            f"{js_api_prefix}.STREAM.NAMES",  # which task stream holds gpuaas.node.<node>.task.> (names only)
            subjects.creds_renew(node_id),  # a JWT for its new key (rotation; the key is born on the node)
            f"{js_api_prefix}.CONSUMER.INFO.*.{consumer}",  # look its consumer up; the control plane creates it
            f"{js_api_prefix}.CONSUMER.MSG.NEXT.*.{consumer}",
            f"$JS.ACK.*.{consumer}.>",
        ],
        "subscribe": [
            f"{subjects.inbox_prefix(node_id)}.>",
            subjects.creds(node_id),
            subjects.terminal_in_any(node_id),  # a terminal session's keystrokes and acks from the gateway
        ],
    }


def nats_server_user(node_id: str, password: str) -> dict[str, Any]:
    """A nats-server config ``authorization.users`` entry with exactly :func:`node_permissions`."""
    perms = node_permissions(node_id)
    return {"user": node_id, "password": password,
            "permissions": {"publish": {"allow": perms["publish"]}, "subscribe": {"allow": perms["subscribe"]},
                            "allow_responses": {"max": 1}}}


ENROLL_PERMISSIONS = {
    # The bootstrap identity: ask for a nonce and enroll, hear the answers on an enrollment inbox.
    "publish": [subjects.ENROLL, subjects.ENROLL_NONCE],
    "subscribe": [f"{subjects.ENROLL_INBOX_PREFIX}.*.>"],
}
