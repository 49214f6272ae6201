"""Both units the package ships pass `systemd-analyze verify`; the baseline unit follows seed 004's service model."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import REPO

UNITS = ("gpuaas-agent.service", "gpuaas-slice-network-baseline.service")
AGENT_BIN = "/opt/gpuaas-agent/bin/gpuaas-agent"


def _section(unit: str, name: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    section = None
    for line in (REPO / "systemd" / unit).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif section == name:
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def _verify(unit_text: str, name: str, tmp_path) -> subprocess.CompletedProcess:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed (package systemd)")
    path = tmp_path / name
    # verify checks that Exec* binaries exist: point the agent's at a real executable, keep every other line.
    path.write_text(unit_text.replace(AGENT_BIN, shutil.which("true")))
    return subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify_accepts_the_unit(unit, tmp_path):
    done = _verify((REPO / "systemd" / unit).read_text(), unit, tmp_path)
    problems = [line for line in done.stderr.splitlines() if unit in line]
    assert done.returncode == 0 and not problems, done.stderr


@pytest.mark.parametrize("old,new", [
    ("Type=oneshot", "Type=sometimes"),                                  # reported as a parse problem
    ("ExecStartPost=+/bin/systemctl", "ExecStartPost=+/nonexistent/systemctl"),  # verify exits non-zero
])
def test_systemd_analyze_verify_can_fail(old, new, tmp_path):
    """The check above is not vacuous: a broken baseline unit is reported."""
    text = (REPO / "systemd" / UNITS[1]).read_text()
    assert old in text
    done = _verify(text.replace(old, new), UNITS[1], tmp_path)
    problems = [line for line in done.stderr.splitlines() if UNITS[1] in line]
    assert done.returncode != 0 or problems


def test_baseline_is_a_oneshot_that_restarts_dnsmasq_from_exec_start_post():
    service = _section(UNITS[1], "Service")
    assert service["Type"] == ["oneshot"] and service["RemainAfterExit"] == ["yes"]
    assert service["ExecStart"][0].startswith(f"{AGENT_BIN} network-baseline")
    # '+': outside the sandbox, which hides PID 1's private socket from the converge.
    assert service["ExecStartPost"] == ["+/bin/systemctl --no-block restart dnsmasq.service"]
    assert service["NotifyAccess"] == ["main"]  # STATUS= from the converge reaches `systemctl status`
    # Seed 004: never enable dnsmasq from inside the baseline service.
    text = (REPO / "systemd" / UNITS[1]).read_text()
    assert "enable" not in " ".join(v for vals in service.values() for v in vals)
    assert "Requires=openvswitch-switch.service" in text


def test_every_baseline_directive_has_a_reason():
    lines = (REPO / "systemd" / UNITS[1]).read_text().splitlines()
    for section in ("[Unit]", "[Service]"):
        start = lines.index(section) + 1
        end = next(i for i in range(start, len(lines)) if lines[i].startswith("["))
        body = lines[start:end]
        unexplained = [line for prev, line in zip(body, body[1:])
                       if line and not line.startswith("#") and not prev.startswith("#")
                       and prev.split("=", 1)[0] != line.split("=", 1)[0]]
        assert unexplained == [], section


def test_agent_is_notify_with_a_watchdog_and_no_start_timeout_that_nats_could_trip():
    """READY=1 comes once state is loaded (tests/operator: NATS down at boot), so the default start timeout holds."""
    service = _section(UNITS[0], "Service")
    assert service["Type"] == ["notify"] and service["WatchdogSec"] == ["60s"]
    assert service["NotifyAccess"] == ["exec"] and "TimeoutStartSec" not in service
    assert "READY=1" in (REPO / "gpuaas_agent" / "daemon.py").read_text()
