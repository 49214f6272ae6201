"""The test tiers: every test is marked by what it needs (tests/conftest.py), and the fast tier leaves the heavy ones out.

The whole suite is collected for real in subprocesses (nothing runs), so what is checked is what
``scripts/test-fast.sh`` selects, not a model of it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import (
    DEPLOY_LANE,
    FAST_TIER,
    FAST_TIER_LEAVES_OUT,
    NEED_MARKERS,
    NEEDS_BY_DIRECTORY,
    PARALLEL_PASS,
    SERIAL_LANE,
    SERIAL_LANE_MARKERS,
    SERIAL_MARKERS,
    SERIAL_PASS,
    SLOW_TESTS,
)
from tests.support.tiers import DECLARED, DECLARED_FIXTURES, NEEDS_BY_MODULE, missing_markers, undeclared_spawners

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
        from tests.support.tiers import missing_markers

        self.record("selected", session.items)
        # What each selected test reaches through helpers in any module, and the markers of it that it lacks. The
        # fixtures' functions are pytest's (_fixtureinfo: pytest's private attribute, read here only).
        self.seen["missing"] = {}
        for item in session.items:
            functions = [item.function] + [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values() if defs]
            missing = missing_markers(functions, {m.name for m in item.iter_markers()})
            if missing:
                self.seen["missing"][item.nodeid] = missing
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
    return {kind: {test: set(names) & NEED_MARKERS for test, names in tests.items()}
            for kind, tests in seen.items() if kind != "missing"} | {"missing": seen["missing"]}


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


def test_the_whole_suite_runs_every_test_once_in_its_two_passes(markers):
    """scripts/test.sh without arguments: the parallel pass and the serial pass partition the collection."""
    script = (REPO / "scripts" / "test.sh").read_text()
    parallel = re.search(rf'-m "{re.escape(PARALLEL_PASS)}" -n "\$\{{GPUAAS_TEST_WORKERS:-2\}}" --dist loadfile', script)
    assert parallel, "the parallel pass runs the expression the markers define, on xdist workers by module"
    assert SERIAL_PASS == " or ".join(SERIAL_MARKERS)
    serial = set(SERIAL_MARKERS)
    in_parallel = {test for test, names in markers.items() if not names & serial}
    in_serial = {test for test, names in markers.items() if names & serial}
    assert in_parallel and in_serial and not in_parallel & in_serial
    assert in_parallel | in_serial == set(markers)
    assert not in_parallel & set(collected_under(markers, "tests/e2e/")), "no guest runs beside another"
    assert set(SERIAL_MARKERS) | {"slow"} == set(FAST_TIER_LEAVES_OUT), "the fast tier is the parallel pass less slow"
    # The serial pass in two lanes at once: the serial lane in one process, the deploy lane beside it.
    assert f'-m "{SERIAL_LANE}" ||' in script, "the serial lane runs in one process, in the foreground"
    assert re.search(rf'-m "{re.escape(DEPLOY_LANE)}" >"\$lane_log" 2>&1 &', script), "the deploy lane runs beside it"
    lane = set(SERIAL_LANE_MARKERS)
    in_serial_lane = {test for test, names in markers.items() if names & lane}
    in_deploy_lane = {test for test, names in markers.items() if "deploy" in names and not names & lane}
    assert in_serial_lane and in_deploy_lane and not in_serial_lane & in_deploy_lane
    assert in_serial_lane | in_deploy_lane == in_serial, "the two lanes are the serial pass, each test once"
    # Beside the lane nothing starts a guest, the lab, libvirtd, a namespace's dnsmasq or an agent.
    assert not in_deploy_lane & set(collected_under(markers, "tests/e2e/"))
    assert not in_deploy_lane & set(collected_under(markers, "tests/crash/"))
    assert in_serial_lane & set(collected_under(markers, "tests/deploy/test_fresh_host.py")), "the lab's deploy tests"


# -- declared where the need is made: a server-starting helper carries its tier, and the tier follows it ------


def test_every_function_that_starts_a_process_declares_what_it_starts():
    """A new helper that starts a server (Popen, create_subprocess_exec) and says nothing fails here, instead of
    landing in the fast tier silently: it declares ``@starts(<markers>)`` (or ``@starts()``: cheap, in the tier)."""
    undeclared = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        rel = path.relative_to(REPO / "tests").parts
        if len(rel) > 1 and rel[0] in NEEDS_BY_DIRECTORY:  # every test there is marked by its directory
            continue
        undeclared += undeclared_spawners(path.read_text(), str(path.relative_to(REPO)))
    for room in ("lab", "bench"):  # code outside tests/ is declared by module, in tests/support/tiers.py
        for path in sorted((REPO / room).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if module not in NEEDS_BY_MODULE:
                undeclared += undeclared_spawners(path.read_text(), str(path.relative_to(REPO)))
    assert undeclared == [], "declare what these start (tests/support/tiers.py):\n" + "\n".join(undeclared)


def test_no_fast_tier_test_reaches_a_server_starting_helper_without_its_marker(collection):
    """Followed through helpers in any module (conftest's marking reads the test's own module only): a fast-tier test
    that reaches a declared helper through an undeclared one in another module fails here."""
    missing = {test: needs for test, needs in collection["missing"].items() if test in collection["selected"]}
    assert missing == {}, "\n".join(f"{test}: lacks {needs}" for test, needs in sorted(missing.items()))


_NEW_HELPER = """
import subprocess

def start_new_server(tmp):
    return subprocess.Popen(["nats-server", "-p", "0"], cwd=tmp)
"""


def test_the_checks_fail_on_an_undeclared_server_and_on_a_helper_that_hides_one():
    # A new helper that starts a server and declares nothing.
    assert undeclared_spawners(_NEW_HELPER, "tests/support/new.py") == ["tests/support/new.py:5 in start_new_server"]
    declared = _NEW_HELPER.replace("def start_new_server", "@starts('nats')\ndef start_new_server")
    assert undeclared_spawners(declared, "tests/support/new.py") == []

    # A declared server helper, reached by a fast test only through a helper of another module that says nothing.
    server = _module("tests.support.synthetic_server", "from tests.support.tiers import starts\n\n"
                     "@starts('ovs')\ndef start_switch(tmp):\n    return 'br-' + str(tmp)\n")
    helpers = _module("tests.support.synthetic_helpers", "def switch_for(tmp):\n    return start_switch(tmp)\n",
                      start_switch=server.start_switch)
    test_module = _module("tests.test_synthetic", "def test_a_fast_one(tmp_path):\n    assert switch_for(tmp_path)\n",
                          switch_for=helpers.switch_for)
    try:
        assert missing_markers([test_module.test_a_fast_one], set()) == {
            "ovs": ["tests.support.synthetic_server.start_switch"]}
        assert missing_markers([test_module.test_a_fast_one], {"ovs"}) == {}
    finally:
        DECLARED.pop("tests.support.synthetic_server.start_switch")
        DECLARED_FIXTURES.pop("start_switch")


def _module(name: str, source: str, **names) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(names)
    exec(compile(source, f"<{name}>", "exec"), vars(module))
    return module
