"""The node's own streams (gpuaas_agent/control/streams.py): one task and one result stream per node, nothing shared.

What the layout buys against a hostile node is proved on real servers in tests/natsauth/test_node_isolation.py;
here, the shapes a control plane must create.
"""

from __future__ import annotations

import pytest
from nats.js.api import RetentionPolicy

from gpuaas_agent.contract import subjects
from gpuaas_agent.control import streams


def test_each_node_has_a_task_stream_holding_only_its_own_tasks():
    config = streams.node_task_stream_config("node-a1")
    assert config.name == streams.task_stream_name("node-a1") == "GPUAAS_NODE_TASKS_node-a1"
    assert config.subjects == [subjects.tasks("node-a1")]
    assert config.retention == RetentionPolicy.WORK_QUEUE


def test_each_node_has_a_result_stream_deduplicating_only_its_own_results():
    config = streams.node_result_stream_config("node-a1")
    assert config.name == streams.result_stream_name("node-a1") == "GPUAAS_NODE_RESULTS_node-a1"
    assert config.subjects == [subjects.result("node-a1")]
    assert config.retention == RetentionPolicy.LIMITS
    assert config.duplicate_window == streams.RESULT_DUPLICATE_WINDOW_S > 0


def test_two_nodes_never_share_a_stream_name():
    names = {streams.task_stream_name(n) for n in ("node-a", "node-b")} | \
        {streams.result_stream_name(n) for n in ("node-a", "node-b")}
    assert len(names) == 4


@pytest.mark.parametrize("node_id", ["", "a.b", "a*", "a>", "a b", "a/b", "a\\b", "a\x00"])
def test_a_node_id_that_cannot_name_a_stream_is_refused(node_id):
    with pytest.raises(ValueError):
        streams.task_stream_name(node_id)
    with pytest.raises(ValueError):
        streams.result_stream_name(node_id)
