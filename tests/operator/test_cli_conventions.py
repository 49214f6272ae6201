"""Every subcommand: --help, one-line errors with their code, documented exit codes, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gpuaas_agent.state.store import StateStore
from tests.conftest import HOSTS, REPO

SUBCOMMANDS = ("discover", "run", "enroll", "preflight", "parity", "status", "record-fixture", "cloud-init",
               "network-baseline")


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command):
    proc = _cli(command, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: gpuaas-agent") and proc.stderr == ""


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_an_unknown_flag_is_one_line_and_exit_2(command):
    proc = _cli(command, "--no-such-flag")
    assert proc.returncode == 2 and "usage" in _one_line(proc)


@pytest.mark.parametrize("argv,code,exit_code", [
    (("status", "--config", "{missing}"), "config_unreadable", 2),
    (("run", "--config", "{missing}"), "config_unreadable", 2),
    (("enroll", "--config", "{missing}"), "config_unreadable", 2),
    (("parity", "--config", "{missing}", "--root", str(HOSTS / "h200-slice-after-transition")),
     "config_unreadable", 2),
    (("network-baseline", "--config", "{missing}"), "config_unreadable", 2),
    (("discover", "--root", "{missing}"), "root_missing", 2),
    (("preflight", "--root", "{missing}"), "root_missing", 2),
    (("record-fixture", "{tmp}/out", "--root", "{missing}"), "root_missing", 2),
    (("cloud-init", "render", "{missing}"), None, None),
])
def test_bad_input_is_one_stderr_line_with_its_code(tmp_path, argv, code, exit_code):
    argv = [a.format(missing=tmp_path / "absent.toml", tmp=tmp_path) for a in argv]
    proc = _cli(*argv)
    line = _one_line(proc)
    if code is None:  # cloud-init's own input error: whatever its code, it is one line and not 0
        assert proc.returncode in (1, 2, 3) and line.startswith("gpuaas-agent: ")
        return
    assert proc.returncode == exit_code and code in line, line


def _config(tmp_path, **extra) -> str:
    path = tmp_path / "agent.json"
    path.write_text(json.dumps({"state_dir": str(tmp_path / "state"), "host_root": str(HOSTS / "h200-slice-after-transition"),
                                "metrics_listen": "", "slice": {"libvirt_uri": "test:///default"}, **extra}))
    return str(path)


def _enrolled(tmp_path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    (state / "enrollment.json").write_text(json.dumps({
        "node_id": "node-test", "credentials": {"servers": ["nats://127.0.0.1:1"], "user": "u", "password": "p"},
        "enrolled_at": "2025-01-01T00:00:00Z"}))


def test_status_with_a_directory_where_the_state_db_should_be_is_broken_exit_3(tmp_path):
    (tmp_path / "state" / "state.db").mkdir(parents=True)  # root ignores modes: a directory is unreadable as a DB
    proc = _cli("status", "--config", _config(tmp_path), "--no-checks")
    assert proc.returncode == 3 and "state DB" in proc.stdout and "Traceback" not in proc.stderr


def test_status_with_a_corrupt_state_db_is_broken_exit_3_and_json_says_why(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.db").write_bytes(b"this is not sqlite" * 100)
    proc = _cli("status", "--config", _config(tmp_path), "--json", "--no-checks")
    report = json.loads(proc.stdout)
    assert proc.returncode == 3 and report["verdict"] == "broken"
    assert any("state DB" in r for r in report["reasons"]) and "Traceback" not in proc.stderr


def test_run_with_a_corrupt_state_db_is_one_line_and_exit_3(tmp_path):
    proc = _cli("run", "--config", _config(tmp_path))
    assert proc.returncode == 3  # not enrolled: environment
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "state" / "state.db").write_bytes(b"junk" * 1000)
    proc = _cli("run", "--config", _config(tmp_path))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_status_reads_leases_records_and_failures_read_only(tmp_path):
    from gpuaas_agent.contract.slots import HealthState, SlotStatus
    from gpuaas_agent.contract.state import SlotLease, SlotRecord

    store = StateStore.open(tmp_path / "state" / "state.db")
    allocation = "0b7c1a9e-0000-4000-8000-000000000001"
    store.take_lease(SlotLease(allocation_id=allocation, slot_index=2, gpu_pci_address="0000:18:00.0",
                               nvme_device="/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331",
                               disk_identity="nguid:000000000000000100a075244a103331",
                               fabric_vf_pci_address="0000:19:00.1", task_id="t-plan", taken_at=time.time()))
    store.set_slot_state(SlotRecord(slot_index=2, allocation_id=allocation, status=SlotStatus.cleanup_blocked,
                                    health_state=HealthState.failed, task_id="t-prov", updated_at=time.time()))
    store.store_result("t-prov", {"task_id": "t-prov", "type": "slice.vm_provision", "status": "failed",
                                  "error": {"code": "readiness_timeout", "message": "no lease in 900s"}})
    store.close()
    before = (tmp_path / "state" / "state.db").read_bytes()
    proc = _cli("status", "--config", _config(tmp_path), "--json", "--no-checks")
    report = json.loads(proc.stdout)
    assert proc.returncode == 3  # not enrolled
    slot = report["slots"][0]
    assert (slot["slot_index"], slot["status"], slot["allocation_id"]) == (2, "cleanup_blocked", allocation)
    assert slot["vm_state"] == "absent" and report["libvirt"].startswith("reachable")
    assert report["recent_failures"][0]["code"] == "readiness_timeout"
    # mode=ro: the DB is not migrated or written (SQLite may create the WAL's -shm/-wal side files to read it)
    assert (tmp_path / "state" / "state.db").read_bytes() == before
    _enrolled(tmp_path)
    human = _cli("status", "--config", _config(tmp_path), "--no-checks")
    assert human.returncode == 1 and "cleanup_blocked" in human.stdout and "readiness_timeout" in human.stdout
    assert "daemon: no status file" in human.stdout


def test_keyboard_interrupt_is_one_line_and_exit_130():
    code = ("import signal, sys, os\n"
            "from gpuaas_agent import cli\n"
            "cli.COMMANDS['discover'] = lambda args: (_ for _ in ()).throw(KeyboardInterrupt())\n"
            "sys.exit(cli.main(['discover']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 130 and _one_line(proc) == "gpuaas-agent: interrupted"


def test_debug_shows_the_traceback(tmp_path):
    proc = _cli("--debug", "status", "--config", str(tmp_path / "absent.toml"))
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "config_unreadable" in proc.stderr


def test_an_enrolled_run_with_a_corrupt_state_db_says_state_unreadable_in_one_line_and_exit_3(tmp_path):
    # Enrolled, so the refusal is the DB's (the test above stops at "not enrolled" first).
    _enrolled(tmp_path)
    (tmp_path / "state" / "state.db").write_bytes(b"junk" * 1000)
    proc = _cli("run", "--config", _config(tmp_path))
    line = _one_line(proc)
    assert proc.returncode == 3 and "state_unreadable" in line, line
