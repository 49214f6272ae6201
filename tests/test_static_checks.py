"""ruff over the whole tree and ``mypy --strict`` over the strict rooms (configured in pyproject.toml).

The contract is what crosses the wire and the guards are what every write trusts: a type error
there is a refusal that never fires. Rooms join :data:`STRICT_ROOMS` once they check clean, so
the list only grows. Both tools come with the ``test`` extra; a missing one
fails here loudly instead of skipping.
"""

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
