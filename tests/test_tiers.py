"""The test tiers: every test is marked by what it needs (tests/conftest.py), and the fast tier leaves the heavy ones out.

Collected for real in a subprocess (``pytest --collect-only -m ...`` over this repository), so what is
checked is what ``scripts/test-fast.sh`` selects, not a model of it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import FAST_TIER, HEAVY_MARKERS

REPO = Path(__file__).resolve().parent.parent

LAB_BY_DIRECTORY = "tests/e2e/test_lab_power.py"
LAB_BY_CALL = "tests/host/test_nvme_guest.py"  # boots a TCG guest through lab.nvme_guest, outside tests/e2e
OWN_FIXTURE_NAMED_LAB = "tests/control/test_permissions.py"  # its `lab` fixture is a NATS server set, no guest
FLEET_BY_FIXTURE = "tests/control/test_worker_pull_heartbeat.py"  # a 3-server cluster
DEPLOY = "tests/deploy/test_units.py"
PURE = "tests/contract/test_slots.py"
OVS_BY_FIXTURE = "tests/host/test_ovs.py"
MODULES = (LAB_BY_DIRECTORY, LAB_BY_CALL, OWN_FIXTURE_NAMED_LAB, FLEET_BY_FIXTURE, DEPLOY, PURE, OVS_BY_FIXTURE)


def collected(expression: str | None) -> dict[str, int]:
    """Test count per module that ``-m expression`` selects from MODULES (None: every test)."""
    select = ["-m", expression] if expression else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *select, *MODULES],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
    counts: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        if "::" in line:
            module = line.split("::", 1)[0]
            counts[module] = counts.get(module, 0) + 1
    return counts


def test_lab_tests_are_marked_lab_by_directory_and_by_what_they_call_and_pure_tests_are_not():
    lab = collected("lab")
    assert lab.get(LAB_BY_DIRECTORY, 0) > 0
    assert lab.get(LAB_BY_CALL, 0) > 0
    assert OWN_FIXTURE_NAMED_LAB not in lab, "a module's own fixture named `lab` is read for what it does, not its name"
    assert PURE not in lab and OVS_BY_FIXTURE not in lab


def test_the_fast_tier_keeps_pure_and_single_server_tests_and_leaves_out_lab_deploy_and_fleet():
    every = collected(None)
    fast = collected(FAST_TIER)
    assert {PURE, OVS_BY_FIXTURE, OWN_FIXTURE_NAMED_LAB} <= set(fast), fast
    assert fast[PURE] == every[PURE] and fast[OVS_BY_FIXTURE] == every[OVS_BY_FIXTURE]
    assert not {LAB_BY_DIRECTORY, LAB_BY_CALL, DEPLOY} & set(fast), fast
    fleet = collected("fleet")
    # the cluster's tests leave the tier; the module's test that needs no cluster stays in it
    assert fleet.get(FLEET_BY_FIXTURE, 0) > 0
    assert fleet[FLEET_BY_FIXTURE] + fast.get(FLEET_BY_FIXTURE, 0) == every[FLEET_BY_FIXTURE]
    assert collected("ovs").get(OVS_BY_FIXTURE, 0) > 0, "a test using the ovs_switch fixture carries `ovs`"
    assert collected("deploy").get(DEPLOY, 0) == every[DEPLOY]


def test_the_fast_tier_command_is_the_expression_the_markers_define():
    script = (REPO / "scripts" / "test-fast.sh").read_text()
    assert f'-m "{FAST_TIER}"' in script
    assert "bash scripts/test.sh" in script, "the fast tier sets itself up like the whole suite"
    assert FAST_TIER in (REPO / "README.md").read_text()
    registered = (REPO / "pyproject.toml").read_text()
    for marker in HEAVY_MARKERS:
        assert re.search(rf'^\s*"{marker}: ', registered, re.MULTILINE), f"{marker} is not registered"
