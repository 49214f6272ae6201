"""Find every error code the package can emit, by reading its source (ast, no import).

Why a scanner: codes are string literals spread over ~80 modules, and helpers add
new ones on their branches. The ErrorCode enum is the one home of their meaning;
this scan proves nothing escapes it (a test) and lists what a merge brought in
(``python -m gpuaas_agent.contract.errorcodes --missing``).

What counts as "emitting" a code (every shape the package uses today):
  * a keyword argument ``code="..."`` (AgentError subclasses, findings, blockers);
  * a class attribute ``default_code = "..."`` or ``code = "..."``;
  * a dict literal ``{"code": "..."}`` (results, journal details);
  * a positional str constant passed where a function of the package declares a
    parameter named ``code`` (``_refuse("disk_busy", ...)``, ``warn(...)``);
  * a comparison ``x.code == "..."`` / ``x.code in (...)`` (a code the caller acts on);
  * a module constant ``*_CODES = frozenset({...})`` (exit classes, cancel codes);
  * ``code = "..."`` (or a conditional expression of constants) assigned to a name.
Each of these may be a conditional expression; both branches are read. An f-string
is reported as a template with ``{}`` for each hole (``nvme_{}``); errorcodes.TEMPLATES
says which members each template can produce.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CODE_SHAPE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")
TEMPLATE_HOLE = "{}"


@dataclass(frozen=True)
class CodeSite:
    """One place a code string appears, for the --missing report."""

    code: str
    path: str
    line: int


def _constants(node: ast.expr | None) -> Iterator[tuple[str, int]]:
    """The str constants an expression can evaluate to (constants, conditionals, tuples/sets/lists)."""
    if node is None:
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value, node.lineno
    elif isinstance(node, ast.JoinedStr):  # f"nvme_{r.code}" -> the template "nvme_{}"
        yield "".join(str(v.value) if isinstance(v, ast.Constant) else TEMPLATE_HOLE for v in node.values), node.lineno
    elif isinstance(node, ast.IfExp):
        yield from _constants(node.body)
        yield from _constants(node.orelse)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _constants(value)
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for elt in node.elts:
            yield from _constants(elt)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple"):
        for arg in node.args:
            yield from _constants(arg)


def _code_params(trees: dict[Path, ast.Module]) -> dict[str, int]:
    """Function name -> positional index of its ``code`` parameter (self/cls not counted)."""
    found: dict[str, int] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
                if params and params[0] in ("self", "cls"):
                    params = params[1:]
                if "code" in params and node.name != "__init__":
                    found[node.name] = params.index("code")
    return found


def _is_code_attr(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "code") or (isinstance(node, ast.Name) and node.id == "code")


def _sites(tree: ast.Module, code_params: dict[str, int]) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "code":
                    yield from _constants(kw.value)
            name = node.func.id if isinstance(node.func, ast.Name) else (
                node.func.attr if isinstance(node.func, ast.Attribute) else None)
            if name in code_params and len(node.args) > code_params[name]:
                yield from _constants(node.args[code_params[name]])
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                value: ast.expr | None
                if isinstance(stmt, ast.Assign):
                    targets, value = stmt.targets, stmt.value
                elif isinstance(stmt, ast.AnnAssign):
                    targets, value = [stmt.target], stmt.value
                else:
                    continue
                if any(isinstance(t, ast.Name) and t.id in ("code", "default_code") for t in targets):
                    yield from _constants(value)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "code":
                    yield from _constants(value)
        elif isinstance(node, ast.Compare) and _is_code_attr(node.left):
            for comparator in node.comparators:
                yield from _constants(comparator)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and (target.id == "code" or target.id.endswith("_CODES")):
                    yield from _constants(node.value)


def scan(root: Path = PACKAGE_ROOT) -> list[CodeSite]:
    """Every code site in the package under ``root``, sorted by code then place."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
             for path in sorted(root.rglob("*.py"))}
    code_params = _code_params(trees)
    sites = {CodeSite(code, str(path.relative_to(root.parent)), line)
             for path, tree in trees.items() for code, line in _sites(tree, code_params)}
    return sorted(sites, key=lambda s: (s.code, s.path, s.line))
