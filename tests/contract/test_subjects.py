"""The node's subjects are built in one place; a terminal session id cannot reach another subject."""

import pytest

from gpuaas_agent.contract import subjects

SID = "0b7e4a1c-2d3f-4a5b-8c6d-7e8f9a0b1c2d"


def test_terminal_subjects_are_the_sessions_own_under_the_node():
    assert subjects.terminal_in("node-1", SID) == f"gpuaas.node.node-1.terminal.{SID}.in"
    assert subjects.terminal_out("node-1", SID) == f"gpuaas.node.node-1.terminal.{SID}.out"
    assert subjects.tasks("node-1") == "gpuaas.node.node-1.task.>"


@pytest.mark.parametrize("session_id", ["*", ">", "a.b", SID + ".in", SID.upper(), ""])
def test_a_session_id_that_is_not_a_uuid_is_refused(session_id):
    with pytest.raises(ValueError):
        subjects.terminal_out("node-1", session_id)


@pytest.mark.parametrize("node_id", ["", "a.b", "*", ">", "a b"])
def test_a_node_id_that_is_not_one_token_is_refused(node_id):
    with pytest.raises(ValueError):
        subjects.result(node_id)
