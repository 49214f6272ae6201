"""``gpuaas-agent parity`` / ``preflight`` run as real processes: lines, summary, JSON, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuaas_agent.contract.parity import LINE_PREFIX, SUMMARY_PREFIX, parse_line
from tests.conftest import REPO, fixture_host
from tests.support.slice_netns import MASQ, ns_exec, slice_namespace

AFTER = str(fixture_host("h200-slice-after-transition"))
NAT_MISSING = str(fixture_host("h200-slice-nat-missing"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", *args], check=False, capture_output=True, text=True, timeout=60, cwd=REPO)


def _checks(stdout: str) -> dict[str, dict[str, str]]:
    return {p["check"]: p for p in map(parse_line, stdout.splitlines()[:-1])}


@pytest.mark.parametrize("command", ["parity", "preflight"])
def test_healthy_fixture_exits_0_with_one_line_per_check_and_a_summary(command):
    proc = _cli(command, "--root", AFTER)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(line.startswith(f"{LINE_PREFIX} status=") for line in lines[:-1])
    assert all(parse_line(line)["status"] in ("PASS", "WARN") for line in lines[:-1])
    summary = parse_line(lines[-1])
    assert summary["_prefix"] == SUMMARY_PREFIX and summary["failures"] == "0"
    assert int(summary["checks"]) == len(lines) - 1 == 27  # 24 + nvswitch_partition (issue 20) + sysfs_writable + fabric_isolation
    assert _checks(proc.stdout)["nat"]["status"] == "PASS"


def test_missing_nat_exits_1_and_names_the_rule():
    proc = _cli("parity", "--root", NAT_MISSING)
    assert proc.returncode == 1, proc.stderr
    nat = _checks(proc.stdout)["nat"]
    assert nat["status"] == "FAIL" and "MASQUERADE" in nat["remediation"]
    assert parse_line(proc.stdout.splitlines()[-1])["failures"] == "1"


def test_json_is_stable_and_carries_the_counts():
    first, second = _cli("parity", "--json", "--root", NAT_MISSING), _cli("parity", "--json", "--root", NAT_MISSING)
    assert first.returncode == 1 and first.stdout == second.stdout
    body = json.loads(first.stdout)
    assert body["failures"] == 1 and body["status"] == "FAIL" and body["source"] == "fixture"
    assert [c["check"] for c in body["checks"] if c["status"] == "FAIL"] == ["nat"]


def test_subnet_and_bridge_options_change_what_is_required():
    proc = _cli("parity", "--root", AFTER, "--subnet", "10.200.0.0/24", "--ovs-bridge", "br-slice")
    assert proc.returncode == 1
    checks = _checks(proc.stdout)
    assert {n for n, c in checks.items() if c["status"] == "FAIL"} == {"ovs_bridge", "dnsmasq", "nat"}
    assert checks["ovs_bridge"]["detail"] == "br-slice missing"


def test_usage_errors_exit_2(tmp_path):
    missing = _cli("parity", "--root", str(tmp_path / "absent"))
    assert missing.returncode == 2 and "root_missing" in missing.stderr and missing.stdout == ""
    netns = _cli("parity", "--root", AFTER, "--netns", "whatever")
    assert netns.returncode == 2 and "netns_on_fixture" in netns.stderr
    bad = _cli("preflight", "--subnet", "10.100.0.1/24")
    assert bad.returncode == 2 and "not an IPv4 subnet" in bad.stderr


def test_live_namespace_through_the_cli(tmp_path):
    with slice_namespace() as netns:
        proc = _cli("parity", "--netns", netns, "--ovsdb-socket", str(tmp_path / "none.sock"),
                    "--libvirt-socket", str(tmp_path / "none-libvirt.sock"))
        checks = _checks(proc.stdout)
        assert checks["nat"]["status"] == "PASS" and checks["ip_forward"]["status"] == "PASS"
        assert checks["ovs_bridge"]["detail"] == "ovsbr0 owns 10.100.0.1/24"
        assert proc.returncode == 1  # the private sockets answer nothing: hard failures
        assert checks["openvswitch"]["status"] == "FAIL"

        ns_exec(netns, "iptables", "-t", "nat", "-D", *MASQ)
        after = _checks(_cli("parity", "--netns", netns).stdout)
        assert after["nat"]["status"] == "FAIL"


def test_a_host_before_the_storage_transition_exits_1_naming_the_transition():
    proc = _cli("parity", "--root", str(fixture_host("h200-slice-before-transition")))
    assert proc.returncode == 1, proc.stderr
    slots = _checks(proc.stdout)["slot_candidates"]
    assert slots["status"] == "FAIL" and "unmount /share*" in slots["remediation"]
    assert "ready_candidate_slots=0" in slots["evidence"]


def test_evidence_is_the_last_word_of_a_line_and_round_trips():
    proc = _cli("parity", "--root", AFTER)
    for line in proc.stdout.splitlines()[:-1]:
        words = line.split(" ")
        assert words[0] == LINE_PREFIX and words[1].startswith("status=") and words[2].startswith("check=")
        assert "evidence=" in line and parse_line(line)["evidence"]


def test_profile_and_config_options(tmp_path):
    bad = _cli("parity", "--root", AFTER, "--runtime-profile", "no_such_profile")
    assert bad.returncode == 2 and "unknown_profile" in bad.stderr
    lab = _checks(_cli("parity", "--root", AFTER, "--runtime-profile", "lab_tcg_1c_512m").stdout)
    assert lab["hugepages"]["detail"].startswith("no runtime profile asks for 1 GiB hugepages")
    missing = _cli("parity", "--root", AFTER, "--config", str(tmp_path / "absent.toml"))
    assert missing.returncode == 2 and "config_unreadable" in missing.stderr
    hosts = _checks(_cli("parity", "--root", AFTER, "--dnsmasq-hosts-file", "/srv/reservations").stdout)
    assert "/srv/reservations" in hosts["dnsmasq"]["detail"]
