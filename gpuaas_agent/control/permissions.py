"""The exact NATS permissions one node needs, and nothing more: the control plane mints them into the node's user.

One source for the table in docs/security.md, the least-privilege test (a real nats-server with
per-node users) and any control plane that issues `.creds`. With these a node can
publish only its own results/progress/heartbeats/drift and terminal output, receive only replies on its own
inbox (``_INBOX.<node>.``), its own credential rotations and its own terminal input, create only its own consumer
on the filtered-subject API (the server refuses a body filter that differs from the
subject: 10131), pull and ack only through that consumer, and find which stream holds its
tasks. It can neither read nor enqueue anyone's tasks, nor read anyone's results,
replies or credentials. ``allow_responses`` lets it answer the control plane's rotation
request on the reply subject that request carried (one reply, never a wildcard).
"""

from __future__ import annotations

from gpuaas_agent.contract import subjects


def consumer_name(node_id: str) -> str:
    return f"gpuaas-agent-{node_id}"


def node_permissions(node_id: str) -> dict[str, list[str]]:
    """``{"publish": [...], "subscribe": [...]}`` for ``node_id`` (any task stream: ``*`` in its slot)."""
    consumer = consumer_name(node_id)
    return {
        "publish": [
            subjects.result(node_id),
            subjects.progress(node_id),
            subjects.heartbeat(node_id),
            subjects.drift(node_id),
            subjects.terminal_out_any(node_id),  # a terminal session's guest output (slice.terminal_*)
            "$JS.API.STREAM.NAMES",  # which task stream holds gpuaas.node.<node>.task.> (names only)
            f"$JS.API.CONSUMER.CREATE.*.{consumer}.{subjects.tasks(node_id)}",
            f"$JS.API.CONSUMER.INFO.*.{consumer}",
            # Its own consumer only: an R1 consumer whose cluster member is gone is deleted and created
            # again on a live member (control/worker.py, consumer_leaderless); the work queue keeps the tasks.
            f"$JS.API.CONSUMER.DELETE.*.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.*.{consumer}",
            f"$JS.ACK.*.{consumer}.>",
        ],
        "subscribe": [
            f"{subjects.inbox_prefix(node_id)}.>",
            subjects.creds(node_id),
            subjects.terminal_in_any(node_id),  # a terminal session's keystrokes and acks from the gateway
        ],
    }


def nats_server_user(node_id: str, password: str) -> dict:
    """A nats-server config ``authorization.users`` entry with exactly :func:`node_permissions`."""
    perms = node_permissions(node_id)
    return {"user": node_id, "password": password,
            "permissions": {"publish": {"allow": perms["publish"]}, "subscribe": {"allow": perms["subscribe"]},
                            "allow_responses": {"max": 1}}}


ENROLL_PERMISSIONS = {
    # The bootstrap identity: ask on gpuaas.enroll, hear the answer on an enrollment inbox.
    "publish": [subjects.ENROLL],
    "subscribe": [f"{subjects.ENROLL_INBOX_PREFIX}.*.>"],
}
