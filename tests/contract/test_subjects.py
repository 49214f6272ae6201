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


def test_no_module_spells_a_subject_outside_contract_subjects():
    """One home for NATS subjects: a subject spelled elsewhere drifts from the permissions a node is granted."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "gpuaas_agent"
    offenders = []
    for path in package.rglob("*.py"):
        if path == package / "contract" / "subjects.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and any(mark in node.value for mark in ("gpuaas.node.", "gpuaas.enroll", "_INBOX."))):
                offenders.append(f"{path.relative_to(package)}:{node.lineno} {node.value[:60]!r}")
    assert offenders == []
