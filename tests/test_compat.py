"""Nothing in the agent or its packaging scripts needs Python 3.11 or newer, except through gpuaas_agent/compat.py.

Ubuntu 22.04's python3 is 3.10 and the one .deb installs there (packaging/README.md). CI runs
on 3.11, so a 3.11-only API would pass every other test and fail only on a 22.04 host, often
not at import but when the code path runs (``asyncio.timeout`` in a task handler). This scan
reads every module's syntax tree:

- it must parse with the 3.10 grammar (``except*``, PEP 646 star-index, 3.12's ``type``
  statements and nested f-string quotes are refused);
- it must not import or touch a name the standard library only has from 3.11
  (``tomllib``, ``datetime.UTC``, ``enum.StrEnum``, ``typing.Self``, ``asyncio.timeout``,
  ``asyncio.TaskGroup``, ``ExceptionGroup``, ``hashlib.file_digest``, ``contextlib.chdir``,
  ``Task.uncancel`` ...). gpuaas_agent/compat.py is the one place that may, behind a version check.

tests/deploy/test_deb_portable.py installs the package in an Ubuntu 22.04 root and imports every
module with its 3.10 venv; this test keeps the runtime-only APIs out that an import cannot see.
"""

from __future__ import annotations

import ast

from tests.conftest import REPO

COMPAT = REPO / "gpuaas_agent" / "compat.py"
SCANNED = [*sorted((REPO / "gpuaas_agent").rglob("*.py")), *sorted((REPO / "packaging").glob("*.py"))]

NEW_MODULES = {"tomllib": "3.11", "wsgiref.types": "3.11"}
# module -> {name: the Python that added it}
NEW_NAMES: dict[str, dict[str, str]] = {
    "datetime": {"UTC": "3.11"},
    "enum": {n: "3.11" for n in ("StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member",
                                 "nonmember", "global_enum", "show_flag_values")},
    "typing": {**{n: "3.11" for n in ("Self", "Never", "assert_never", "LiteralString", "reveal_type", "assert_type",
                                      "dataclass_transform", "Required", "NotRequired", "Unpack", "TypeVarTuple",
                                      "get_overloads", "clear_overloads")},
               "override": "3.12", "TypeAliasType": "3.12"},
    "asyncio": {n: "3.11" for n in ("timeout", "timeout_at", "Timeout", "TaskGroup", "Runner", "Barrier",
                                    "BrokenBarrierError")},
    "hashlib": {"file_digest": "3.11"},
    "contextlib": {"chdir": "3.11"},
    "operator": {"call": "3.11"},
    "sys": {"exception": "3.11"},
    "logging": {"getLevelNamesMapping": "3.11", "getHandlerByName": "3.12"},
    "math": {"cbrt": "3.11", "exp2": "3.11"},
    "itertools": {"batched": "3.12"},
}
NEW_BUILTINS = {"ExceptionGroup": "3.11", "BaseExceptionGroup": "3.11"}
# Methods added in 3.11 whose names nothing else in the agent uses.
NEW_METHODS = {"add_note": "BaseException.add_note (3.11)", "uncancel": "Task.uncancel (3.11)",
               "cancelling": "Task.cancelling (3.11)"}


def findings(source: str, name: str = "<snippet>") -> list[str]:
    """``file:line what`` for every 3.11+ construct in ``source``."""
    found: list[str] = []
    try:
        ast.parse(source, filename=name, feature_version=(3, 10))
    except SyntaxError as exc:
        found.append(f"{name}:{exc.lineno} syntax newer than Python 3.10: {exc.msg}")
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError:  # this interpreter's grammar is 3.10 too
        return found
    aliases: dict[str, str] = {}  # local name -> module, from `import x` / `import x as y`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in NEW_MODULES:
                    found.append(f"{name}:{node.lineno} import {alias.name} (Python {NEW_MODULES[alias.name]})")
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in NEW_MODULES:
                found.append(f"{name}:{node.lineno} from {node.module} import (Python {NEW_MODULES[node.module]})")
            for alias in node.names:
                added = NEW_NAMES.get(node.module, {}).get(alias.name)
                if added:
                    found.append(f"{name}:{node.lineno} from {node.module} import {alias.name} (Python {added})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                module = aliases[node.value.id]
                added = NEW_NAMES.get(module, {}).get(node.attr)
                if added:
                    found.append(f"{name}:{node.lineno} {module}.{node.attr} (Python {added})")
            if node.attr in NEW_METHODS:
                found.append(f"{name}:{node.lineno} .{node.attr}() is {NEW_METHODS[node.attr]}")
        elif isinstance(node, ast.Name) and node.id in NEW_BUILTINS:
            found.append(f"{name}:{node.lineno} {node.id} (Python {NEW_BUILTINS[node.id]})")
        elif type(node).__name__ == "TryStar":
            found.append(f"{name}:{node.lineno} except* (Python 3.11)")
    return found


def test_no_module_of_the_agent_or_its_packaging_uses_a_python_3_11_api_outside_compat():
    assert len(SCANNED) > 100  # the whole package, not an empty glob
    found = []
    for path in SCANNED:
        if path == COMPAT:
            continue
        found += findings(path.read_text(), str(path.relative_to(REPO)))
    assert found == [], "use gpuaas_agent/compat.py instead:\n" + "\n".join(found)


def test_the_scan_names_each_kind_of_3_11_construct_it_refuses():
    snippet = """
import asyncio, tomllib
import datetime as dt
from enum import StrEnum
from typing import Self
from hashlib import file_digest

async def f(task):
    async with asyncio.timeout(1):
        pass
    async with asyncio.TaskGroup() as tg:
        pass
    when = dt.UTC
    task.uncancel()
    raise ExceptionGroup("x", [])
"""
    found = findings(snippet)
    for expected in ("import tomllib", "from enum import StrEnum", "from typing import Self",
                     "from hashlib import file_digest", "asyncio.timeout", "asyncio.TaskGroup", "datetime.UTC",
                     ".uncancel()", "ExceptionGroup"):
        assert any(expected in line for line in found), (expected, found)
    star = findings("try:\n    pass\nexcept* ValueError:\n    pass\n")
    assert any("syntax newer than Python 3.10" in line for line in star), star
    assert findings("import asyncio\nfrom datetime import datetime, timezone\nx = datetime.now(timezone.utc)\n") == []


def test_compat_gives_the_3_11_names_their_3_11_behaviour():
    import asyncio

    from gpuaas_agent.compat import UTC, StrEnum, timeout, tomllib

    class Colour(StrEnum):
        RED = "red"

    assert str(Colour.RED) == "red" and f"{Colour.RED:>4}" == " red" and Colour.RED == "red"
    assert UTC.utcoffset(None).total_seconds() == 0
    assert tomllib.loads('a = 1\n') == {"a": 1}
    assert asyncio.TimeoutError is TimeoutError  # what every `except TimeoutError` around wait_for relies on

    async def expires() -> str:
        try:
            async with timeout(0.01):
                await asyncio.Event().wait()
        except TimeoutError:
            return "timed out"
        return "not timed out"

    assert asyncio.run(expires()) == "timed out"
