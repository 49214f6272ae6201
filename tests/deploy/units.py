"""The packaged systemd units as test data: their paths and the directives tests read from them.

The sandbox tests (test_unit_sandbox.py, test_unit_provision.py) read the unit file itself,
so a change to the unit is what gets tested.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO

AGENT_UNIT = REPO / "systemd" / "gpuaas-agent.service"
BASELINE_UNIT = REPO / "systemd" / "gpuaas-slice-network-baseline.service"


def directive(unit: Path, key: str) -> list[str]:
    """Every value of ``key=`` in ``unit``, in file order."""
    return [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith(f"{key}=")]


def agent_capabilities() -> list[str]:
    """The agent unit's CapabilityBoundingSet, one name per entry."""
    (caps,) = directive(AGENT_UNIT, "CapabilityBoundingSet")
    return caps.split()
