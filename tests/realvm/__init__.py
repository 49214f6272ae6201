"""The real-guest lane: a real libvirtd boots the lab guest image (needs root; never skipped)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAB_CACHE = Path(os.environ.get("GPUAAS_LAB_CACHE", "/var/cache/gpuaas-agent-lab"))


def load_builder():
    """``lab/build_guest_image.py`` (a standalone script, not part of the package)."""
    name = "build_guest_image"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "lab" / "build_guest_image.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
