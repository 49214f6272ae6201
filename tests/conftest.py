"""Shared test fixtures: paths of the recorded hosts and throw-away copies of them."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HOSTS = REPO / "fixtures" / "hosts"
H200_FIXTURES = (
    "h200-slice-after-transition",
    "h200-slice-before-transition",
    "h200-slice-after-reboot",
    "h200-slice-no-vfs",
)
# Recorded on real machines (the others under H200_FIXTURES are synthesised by fixtures/tools/synth_host.py).
RECORDED_FIXTURES = ("dev-box-no-gpu", "h200-vm-passthrough")
ALL_FIXTURES = H200_FIXTURES + RECORDED_FIXTURES


def load_synth_host():
    """The fixture generator (a standalone script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("synth_host", REPO / "fixtures" / "tools" / "synth_host.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("synth_host", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def host_copy(tmp_path):
    """Copy a committed fixture (links kept as links) so a test can break it."""

    def _copy(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(HOSTS / name, dest, symlinks=True)
        return dest

    return _copy
