"""The node's own task and result streams, as the control plane creates them: one of each per node.

Why per node and not one stream for the fleet: a JetStream ack subject names a *stream* sequence
(``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>``), and
nats-server before 2.14 acts on a sequence its consumer never delivered. In one work-queue stream
for every node, node A publishing ``+ACK``/``+TERM`` on its own consumer's ack subject with
node B's stream sequence removed B's task (measured on Debian's 2.9.10: B's pending 3 → 2 → 1);
``-NAK`` and ``+WPI`` reach the same message. With a stream per node, A's ack subject can only
name sequences of A's own stream (its account imports ``$JS.ACK.<A's stream>.<A's consumer>.>``,
its permissions the same under its consumer's name): whatever the server does with a forged
sequence, it does it to A's own tasks. Nothing here depends on the server refusing the ack.

Results the same way: ``Nats-Msg-Id`` de-duplication is per stream, and a node chooses its own
headers. In one result stream for the fleet, A publishing first with ``Nats-Msg-Id: <B's
task_id>-1`` made B's real result a duplicate, dropped. In a stream per node the key is bound to
the subject the node may publish on (``gpuaas.node.<node>.result``), which the server checks: A's
message ids live in A's stream only. A stream's limits (size, count) likewise fill with that
node's results only.

With an account per node the agent binds its task stream by the name :func:`task_stream_name` gives (its
account imports no ``STREAM.NAMES``: a listing would name every node of the fleet, and finding a stream
by subject scans all 2 N of them at every bind); in one shared account it finds it by subject. It
publishes its results without an expected stream (the PubAck says which stored it). These names are what a
control plane creates (docs/contract.md "The node's streams"); a node's account imports its own
task stream's consumer API and acks by name (``control/accounts.py`` ``node_imports``).
"""

from __future__ import annotations

from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from gpuaas_agent.contract import subjects

TASK_STREAM_PREFIX = "GPUAAS_NODE_TASKS_"
RESULT_STREAM_PREFIX = "GPUAAS_NODE_RESULTS_"
# How long a result's Nats-Msg-Id is remembered in its node's stream: a republish within it (a lost PubAck, a
# redelivered task answered from the stored result) is stored once.
RESULT_DUPLICATE_WINDOW_S = 120.0


def _stream_token(node_id: str) -> str:
    subjects.tasks(node_id)  # a node id is a subject token (raises ValueError otherwise)
    if any(c in node_id for c in "/\\") or not node_id.isprintable():
        raise ValueError(f"node id {node_id!r} cannot be part of a stream name")
    return node_id


def task_stream_name(node_id: str) -> str:
    """``GPUAAS_NODE_TASKS_<node>``: the work-queue stream holding ``gpuaas.node.<node>.task.>`` and nothing else."""
    return TASK_STREAM_PREFIX + _stream_token(node_id)


def result_stream_name(node_id: str) -> str:
    """``GPUAAS_NODE_RESULTS_<node>``: the stream holding ``gpuaas.node.<node>.result`` and nothing else."""
    return RESULT_STREAM_PREFIX + _stream_token(node_id)


def node_task_stream_config(node_id: str, *, storage: StorageType = StorageType.FILE,
                            replicas: int = 1) -> StreamConfig:
    """The node's task stream: work-queue retention (an ack removes the task), the node's task subjects only."""
    return StreamConfig(name=task_stream_name(node_id), subjects=[subjects.tasks(node_id)],
                        retention=RetentionPolicy.WORK_QUEUE, storage=storage, num_replicas=replicas)


def node_result_stream_config(node_id: str, *, storage: StorageType = StorageType.FILE,
                              replicas: int = 1) -> StreamConfig:
    """The node's result stream: limits retention, de-duplicated by ``Nats-Msg-Id`` within this node's results."""
    return StreamConfig(name=result_stream_name(node_id), subjects=[subjects.result(node_id)],
                        retention=RetentionPolicy.LIMITS, storage=storage, num_replicas=replicas,
                        duplicate_window=RESULT_DUPLICATE_WINDOW_S)
