"""The gpuaas-agent command line, run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpuaas_agent.discovery.fixture_archive import unpack_tree
from tests.conftest import REPO, fixture_host

AFTER = str(fixture_host("h200-slice-after-transition"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_missing_root_is_one_line_and_exit_2(tmp_path):
    proc = _cli("discover", "--root", str(tmp_path / "absent"))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "root_missing" in proc.stderr and "Traceback" not in proc.stderr


def test_human_output_starts_with_the_seed_summary_line():
    proc = _cli("discover", "--root", AFTER)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "gpu_devices=8 fabric_devices=18 nvme_devices=9 mounted_nvme_devices=1 candidate_slots=8 ready_candidate_slots=8"
    assert lines[1].startswith("slot=0 gpu=0000:18:00.0 nvme=/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331 ")
    assert len(lines) == 9


def test_json_is_byte_identical_between_runs_and_parses():
    first, second = _cli("discover", "--json", "--root", AFTER), _cli("discover", "--json", "--root", AFTER)
    assert first.returncode == 0 and first.stdout == second.stdout
    assert json.loads(first.stdout)["summary"]["candidate_slots"] == 8


def test_subnet_option_moves_ip_suggestions_and_rejects_junk():
    proc = _cli("discover", "--json", "--root", AFTER, "--subnet", "172.31.5.0/24")
    assert json.loads(proc.stdout)["candidate_slots"][0]["private_ip"] == "172.31.5.10"
    bad = _cli("discover", "--root", AFTER, "--subnet", "10.100.0.1/24")
    assert bad.returncode == 2 and "not an IPv4 subnet" in bad.stderr


def test_record_fixture_then_discover_round_trips(tmp_path):
    out = tmp_path / "rec"
    rec = _cli("record-fixture", str(out), "--root", AFTER)
    assert rec.returncode == 0, rec.stderr
    assert _cli("discover", "--json", "--root", str(out)).stdout == _cli("discover", "--json", "--root", AFTER).stdout
    again = _cli("record-fixture", str(out), "--root", AFTER)
    assert again.returncode == 2 and "output_exists" in again.stderr


def test_record_fixture_archive_then_discover_round_trips(tmp_path):
    out = tmp_path / "host.tar.xz"
    rec = _cli("record-fixture", "--archive", str(out), "--root", AFTER)
    assert rec.returncode == 0, rec.stderr
    assert out.is_file() and sorted(os.listdir(tmp_path)) == ["host.tar.xz"]
    root = unpack_tree(out, tmp_path / "root")
    assert _cli("discover", "--json", "--root", str(root)).stdout == _cli("discover", "--json", "--root", AFTER).stdout


def test_version():
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("gpuaas-agent ")


def test_discover_exit_code_says_whether_the_host_is_usable():
    assert _cli("discover", "--root", AFTER).returncode == 0  # 8 ready candidate slots
    before = _cli("discover", "--root", str(fixture_host("h200-slice-before-transition")))
    assert before.returncode == 1 and "ready_candidate_slots=0" in before.stdout  # /share* still mounted
    assert _cli("discover", "--json", "--root", str(fixture_host("dev-box-no-gpu"))).returncode == 1
