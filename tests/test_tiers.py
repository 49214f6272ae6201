"""The test tiers: every test is marked by what it needs (tests/conftest.py), and the fast tier leaves the heavy ones out.

The whole suite is collected for real in subprocesses (nothing runs), so what is checked is what
``scripts/test-fast.sh`` selects, not a model of it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_TIER, FAST_TIER_LEAVES_OUT, NEED_MARKERS, SLOW_TESTS

REPO = Path(__file__).resolve().parent.parent

LAB_BY_CALL = "tests/host/storage/test_nvme_guest.py"  # boots a TCG guest through lab.nvme_guest, outside tests/e2e
OWN_FIXTURE_NAMED_LAB = "tests/control/test_permissions.py"  # its `lab` fixture is a set of NATS servers
CLUSTER = "tests/control/test_worker_pull_heartbeat.py::test_losing_the_member_that_leads_the_consumer"
OVS_BY_FIXTURE = "tests/host/network/test_ovs.py"  # the ovs_switch fixture
PREPARED_HOST = "tests/tasks/test_provision_preconditions.py"  # prepared_host: OVS + dnsmasq in the root namespace
PURE = "tests/contract/test_slots.py"

# Collects the suite with the fast tier's -m in a child interpreter, and writes to the file named by argv[1]
# {"selected"|"deselected": {test id: [marker names]}}.
_DUMP_MARKERS = """
import json, sys
import pytest

class Dump:
    def __init__(self):
        self.seen = {"selected": {}, "deselected": {}}

    def record(self, kind, items):
        self.seen[kind].update({item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in items})

    def pytest_deselected(self, items):
        self.record("deselected", items)

    def pytest_collection_finish(self, session):
        self.record("selected", session.items)
        with open(sys.argv[1], "w") as out:
            json.dump(self.seen, out)

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", sys.argv[2]], plugins=[Dump()]))
"""


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    """The whole suite's tests with the need markers they carry, split by whether the fast tier selects them."""
    out = tmp_path_factory.mktemp("tiers") / "markers.json"
    proc = subprocess.run([sys.executable, "-c", _DUMP_MARKERS, str(out), FAST_TIER], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    return {kind: {test: set(names) & NEED_MARKERS for test, names in tests.items()} for kind, tests in seen.items()}


@pytest.fixture(scope="module")
def markers(collection) -> dict[str, set[str]]:
    return {**collection["selected"], **collection["deselected"]}


@pytest.fixture(scope="module")
def fast_tier(collection) -> set[str]:
    return set(collection["selected"])


def collected_under(markers: dict[str, set[str]], prefix: str) -> dict[str, set[str]]:
    found = {test: names for test, names in markers.items() if test.startswith(prefix)}
    assert found, f"no test collected under {prefix}"
    return found


def test_every_lab_deploy_and_crash_test_is_marked_by_its_directory(markers):
    assert all("lab" in names for names in collected_under(markers, "tests/e2e/").values())
    assert all({"lab", "libvirtd"} <= names for names in collected_under(markers, "tests/realvm/").values())
    assert all({"crash", "lab"} <= names for names in collected_under(markers, "tests/crash/").values())
    assert all("deploy" in names for names in collected_under(markers, "tests/deploy/").values())


def test_needs_are_read_from_fixtures_and_calls_not_from_names(markers):
    assert all("lab" in names for names in collected_under(markers, LAB_BY_CALL).values())
    assert not any("lab" in names for names in collected_under(markers, OWN_FIXTURE_NAMED_LAB).values()), \
        "a module's own fixture named `lab` is read for what it calls, not matched by its name"
    assert all("fleet" in names for names in collected_under(markers, CLUSTER).values())
    assert any("ovs" in names for names in collected_under(markers, OVS_BY_FIXTURE).values())
    assert any({"ovs", "netns"} <= names for names in collected_under(markers, PREPARED_HOST).values())
    assert not any(names for names in collected_under(markers, PURE).values()), "a pure test needs nothing"


def test_the_fast_tier_is_everything_the_expression_keeps_and_nothing_else(markers, fast_tier):
    leaves_out = set(FAST_TIER_LEAVES_OUT)
    assert fast_tier == {test for test, names in markers.items() if not names & leaves_out}
    assert set(collected_under(markers, PURE)) <= fast_tier
    assert fast_tier & set(collected_under(markers, OVS_BY_FIXTURE)), "one OVS is fast enough for the tier"
    assert not fast_tier & set(collected_under(markers, "tests/e2e/"))
    slow = {test for test in markers if test.split("[")[0] in SLOW_TESTS}
    assert slow and all("slow" in markers[test] for test in slow)


def test_the_fast_tier_command_is_the_expression_the_markers_define():
    script = (REPO / "scripts" / "test-fast.sh").read_text()
    assert f'-m "{FAST_TIER}"' in script
    assert "bash scripts/test.sh" in script, "the fast tier sets itself up like the whole suite"
    assert FAST_TIER in (REPO / "README.md").read_text()
    # The README shows what the script runs: the same expression on the same pytest-xdist workers.
    workers = re.search(r'-m "[^"]*" (-n "\$\{GPUAAS_TEST_WORKERS:-(\d+)\}" --dist \w+)', script)
    assert workers, "the fast tier runs on pytest-xdist workers"
    shown = workers.group(1).replace(f'"${{GPUAAS_TEST_WORKERS:-{workers.group(2)}}}"', workers.group(2))
    assert f'-m "{FAST_TIER}" {shown}' in (REPO / "README.md").read_text()
    registered = (REPO / "pyproject.toml").read_text()
    for marker in FAST_TIER_LEAVES_OUT:
        assert re.search(rf'^\s*"{marker}: ', registered, re.MULTILINE), f"{marker} is not registered"
