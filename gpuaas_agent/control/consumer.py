"""The node's task consumer as the control plane creates it: durable, pull, filtered to the node's tasks.

Why here and not in the worker: whoever writes a consumer's body decides where the server
publishes (a push ``deliver_subject``, ...), so a node must not write it (docs/security-auth.md).
The control plane creates it at enrollment and again when its cluster member is lost; the node
only looks it up (``CONSUMER.INFO``), pulls (``MSG.NEXT``) and acks. This function is the shape a
control plane must create (the Go control plane mirrors it; docs/contract.md "The node's consumer").

Settings that are the agent's to know (``ack_wait``, how many tasks it may hold) come from
:class:`~gpuaas_agent.control.worker.WorkerSettings`, so the test control plane creates exactly
what an agent configured that way expects.
"""

from __future__ import annotations

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpuaas_agent.contract import subjects
from gpuaas_agent.control.permissions import consumer_name


def node_consumer_config(node_id: str, *, ack_wait_s: float = 60.0, max_ack_pending: int = 64,
                         replicas: int | None = None, memory: bool = False,
                         inactive_threshold_s: float | None = None) -> ConsumerConfig:
    """A durable pull consumer on ``gpuaas.node.<node>.task.>``; no deliver subject, ever.

    ``max_deliver`` stays -1: the agent's journal bounds a task's starts (``poison_task``) and its
    deadline ends it; JetStream's own bound would drop a task silently. ``inactive_threshold_s``
    None: the consumer lives until the control plane deletes it (a node away for a day must find
    it again, since it cannot create it).
    """
    name = consumer_name(node_id)
    return ConsumerConfig(name=name, durable_name=name, filter_subject=subjects.tasks(node_id),
                          ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=ack_wait_s,
                          max_deliver=-1, max_ack_pending=max_ack_pending, num_replicas=replicas,
                          mem_storage=memory or None, inactive_threshold=inactive_threshold_s)
