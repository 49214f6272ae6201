"""ErrorCode is the one home of the wire's error codes: the package emits no code outside it,
the generated doc is current, no member is dead, and the scanner sees every shape of emission."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from gpuaas_agent.contract import errorcodes
from gpuaas_agent.contract.codescan import CODE_SHAPE, scan
from gpuaas_agent.contract.enrollment import EnrollReply
from gpuaas_agent.contract.errorcodes import (
    NVME_REASONS,
    ROOMS,
    TEMPLATES,
    ErrorCode,
    missing_lines,
    render,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sites():
    return scan()


def test_every_code_the_package_emits_is_a_member(sites):
    known = {m.value for m in ErrorCode} | set(TEMPLATES)
    unknown = sorted({f"{s.code} ({s.path}:{s.line})" for s in sites if s.code not in known})
    assert not unknown, "add to ErrorCode (python -m gpuaas_agent.contract.errorcodes --missing):\n" + "\n".join(unknown)
    assert missing_lines() == []


def test_the_scan_finds_the_codes_of_known_call_sites(sites):
    """Guards the scanner itself: one code per shape it must read, from real package sources."""
    found = {s.code for s in sites}
    for code in ("guard_refused",           # class default_code (errors.py)
                 "ovs_port_not_owned",      # code="..." keyword (host/network/ovs.py)
                 "holders",                 # positional to a function with a `code` parameter (_refuse)
                 "provision_interrupted",   # {"code": "..."} dict
                 "wipe_cancelled",          # *_CODES frozenset
                 "usage",                   # exit-class set
                 "busy",                    # code = "..." if ... else "..."
                 "nvme_{}", "{}_remote_numa"):  # f-strings, as templates
        assert code in found, code


def test_templates_expand_to_members_and_nvme_blockers_follow_every_ineligibility_reason():
    members = {m.value for m in ErrorCode}
    for template, codes in TEMPLATES.items():
        assert codes and all(c in members for c in codes), template
    # slots.py makes f"nvme_{r.code}" from each reason discovery/nvme.py's ineligible_reasons() can add
    tree = ast.parse((REPO / "gpuaas_agent" / "discovery" / "nvme.py").read_text(encoding="utf-8"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "ineligible_reasons")
    added = {c.args[0].value for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
             and c.func.id == "add" and c.args and isinstance(c.args[0], ast.Constant)}
    assert added == set(NVME_REASONS)


def test_no_member_is_dead_unless_the_control_plane_sends_it(sites):
    emitted = {s.code for s in sites} | {c for codes in TEMPLATES.values() for c in codes}
    dead = [m.value for m in ErrorCode if m.value not in emitted and not m.control_plane]
    assert not dead, f"members nothing emits (remove them or mark CONTROL_PLANE): {dead}"
    relayed = {m.value for m in ErrorCode if m.control_plane}
    enroll_errors = set(typing.get_args(typing.get_args(EnrollReply.model_fields["error"].annotation)[0]))
    assert relayed == enroll_errors
    assert not relayed & emitted, "a CONTROL_PLANE member is also raised by agent code: drop the mark"


def test_members_are_snake_case_one_line_meanings_in_a_known_room():
    for m in ErrorCode:
        assert CODE_SHAPE.match(m.value) and m.name == m.value.upper(), m
        assert m.room in ROOMS and m.room != "unsorted", m
        assert m.meaning.strip() and "\n" not in m.meaning and "TODO" not in m.meaning, m
    assert len({m.value for m in ErrorCode}) == len(ErrorCode)


def test_error_codes_doc_is_generated_from_the_enum_and_current():
    doc = (REPO / "docs" / "error-codes.md").read_text(encoding="utf-8")
    assert doc == render(), "docs/error-codes.md is stale: run python -m gpuaas_agent.contract.errorcodes"
    assert all(f"| `{m.value}` |" in doc for m in ErrorCode)
    contract = (REPO / "docs" / "contract.md").read_text(encoding="utf-8")
    assert "(error-codes.md)" in contract


def test_check_exits_1_on_a_stale_doc_and_0_once_regenerated(tmp_path, monkeypatch):
    doc = tmp_path / "error-codes.md"
    doc.write_text("# Error codes\n\nstale\n", encoding="utf-8")
    monkeypatch.setattr(errorcodes, "DOC", doc)
    assert errorcodes.main(["--check"]) == 1
    assert errorcodes.main([]) == 0
    assert errorcodes.main(["--check"]) == 0
    assert doc.read_text(encoding="utf-8") == render()


def test_missing_prints_paste_ready_lines_for_codes_a_merge_brought_in(tmp_path):
    """A branch adds codes in every shape; --missing lists each once with where it is emitted."""
    pkg = tmp_path / "gpuaas_agent"
    (pkg / "host").mkdir(parents=True)
    (pkg / "host" / "new.py").write_text('''
from gpuaas_agent.errors import AgentError, HostError
class NewError(AgentError):
    default_code = "new_default"
def _refuse(code, message, **evidence):
    return NewError(message, code=code, evidence=evidence)
def f(flag, exc):
    if exc.code in ("new_compared", "ovs_error"):
        raise _refuse("new_positional", "m")
    detail = {"code": "new_in_dict"}
    raise HostError("m", code="new_keyword" if flag else "new_other_branch")
RETRY_CODES = frozenset({"new_in_set"})
def g(kind):
    raise HostError("m", code=f"{kind}_new_template")
''', encoding="utf-8")
    lines = missing_lines(tmp_path / "gpuaas_agent")
    templates = [line for line in lines if line.startswith("    # TODO template")]
    assert len(templates) == 1 and templates[0].startswith("    # TODO template '{}_new_template': add it to TEMPLATES")
    lines = [line for line in lines if line not in templates]
    codes = [re.match(r' {4}([A-Z_]+) = "([a-z_]+)", "unsorted", "TODO', line).group(2) for line in lines]
    assert codes == sorted(["new_default", "new_compared", "new_positional", "new_in_dict", "new_keyword",
                            "new_other_branch", "new_in_set"])
    assert all("gpuaas_agent/host/new.py:" in line for line in lines)
    body = ast.parse("class E:\n" + "\n".join(lines)).body[0].body  # the lines paste into the enum as they are
    assert [stmt.value.elts[0].value for stmt in body] == codes


def test_the_module_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "gpuaas_agent.contract.errorcodes", "--missing"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "every emitted code is a member" in done.stdout
