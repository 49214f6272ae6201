"""ruff over the whole tree and ``mypy --strict`` over the strict rooms (configured in pyproject.toml), and no
private name imported from one module of the package into another (STYLE.md rule 15).

The contract is what crosses the wire and the guards are what every write trusts: a type error
there is a refusal that never fires. Rooms join :data:`STRICT_ROOMS` once they check clean, so
the list only grows. Both tools come with the ``test`` extra; a missing one
fails here loudly instead of skipping.
"""

import ast
import shutil
import subprocess
import sys

from tests.conftest import REPO

VENV_BIN = REPO / ".venv" / "bin"

# mypy --strict holds over the whole package (every room and top-level module); python_version 3.10 in pyproject.
STRICT_ROOMS = ("gpuaas_agent",)


def _tool(name: str) -> str:
    path = VENV_BIN / name if (VENV_BIN / name).exists() else shutil.which(name)
    assert path, f"{name} is not installed (pip install -e '.[test]')"
    return str(path)


def test_ruff_finds_nothing():
    done = subprocess.run([_tool("ruff"), "check", "gpuaas_agent", "tests", "lab", "bench"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_strict_on_strict_rooms():
    done = subprocess.run([sys.executable, "-m", "mypy", *STRICT_ROOMS], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every private name (``_x``, not a dunder) one of our modules imports from another of ours.

    Absolute (``gpuaas_agent...``) and relative imports, one line or many, a private module on the
    path (``gpuaas_agent.x._y``) as well as a private name out of a public one. What is shared
    across modules gets a public name; ``_x`` stays the business of the module that defines it.
    """
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "gpuaas_agent"):
            module = "." * node.level + (node.module or "")
            names = [alias.name for alias in node.names]
            if any(_private(part) for part in (node.module or "").split(".")):
                names = names or ["*"]
            else:
                names = [n for n in names if _private(n)]
            found += [f"{filename}:{node.lineno}: from {module} import {n}" for n in names]
        elif isinstance(node, ast.Import):
            found += [f"{filename}:{node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] == "gpuaas_agent" and any(map(_private, alias.name.split(".")))]
    return found


def test_no_module_imports_a_private_name_of_another():
    found = [hit for path in sorted((REPO / "gpuaas_agent").rglob("*.py"))
             for hit in private_imports(path.read_text(), str(path.relative_to(REPO)))]
    assert not found, "private names imported across modules (give them a public name):\n" + "\n".join(found)


def test_private_import_scan_catches_every_spelling():
    source = """
from gpuaas_agent.host.storage.blockwipe import (
    DEFAULT_SAMPLES,
    _step,
)
from .clone import _still_there
from gpuaas_agent.host._private import anything
import gpuaas_agent.host._private.mod
from gpuaas_agent import __version__
from os import _exit
def later():
    from gpuaas_agent.host.images.clone import (_still_there as there)
"""
    found = private_imports(source)
    assert found == [
        "<source>:2: from gpuaas_agent.host.storage.blockwipe import _step",
        "<source>:6: from .clone import _still_there",
        "<source>:7: from gpuaas_agent.host._private import anything",
        "<source>:8: import gpuaas_agent.host._private.mod",
        "<source>:12: from gpuaas_agent.host.images.clone import _still_there",
    ], found
