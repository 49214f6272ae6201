"""The alert rules and the dashboard that ship with the package: promtool checks and unit-tests the rules,
and every series they read is one the agent's registry exports.

promtool comes from Debian's ``prometheus`` package (scripts/apt-packages.txt): without it these tests
fail, they never skip (an alert nobody tested is an alert that does not page).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuaas_agent.contract.fleet import ComponentKind, DrainReport, QuarantinedComponent, QuarantineReason
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.operator.metrics import AgentMetrics, LiveState
from tests.conftest import REPO

MONITORING = REPO / "packaging" / "monitoring"
RULES = MONITORING / "gpuaas-agent-alerts.yml"
RULE_TESTS = MONITORING / "gpuaas-agent-alerts.test.yml"
DASHBOARD = MONITORING / "gpuaas-agent-dashboard.json"
# Series from other exporters that the rules read on purpose.
FOREIGN = {"up", "node_textfile_mtime_seconds"}
PAGED = {"GpuaasAgentDown", "GpuaasAgentAbsent", "GpuaasAgentNatsDisconnected", "GpuaasAgentHealthFailed",
         "GpuaasAgentSlotCleanupBlocked", "GpuaasAgentComponentQuarantined", "GpuaasAgentWipeFailing",
         "GpuaasAgentReleaseFailing", "GpuaasAgentMaintenanceLeftOn"}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: `apt-get install prometheus` (scripts/apt-packages.txt); "
                    "the alert rules are not tested without it")
    return path


def _promtool_run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_promtool(), *argv], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_checks_the_rules():
    done = _promtool_run("check", "rules", RULES.name, cwd=MONITORING)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_fire_and_stay_quiet_where_they_must():
    done = _promtool_run("test", "rules", RULE_TESTS.name, cwd=MONITORING)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_paging_condition_has_a_rule_and_a_unit_test_that_fires_it():
    rules = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert PAGED <= rules
    fired = {case["alertname"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert rules <= fired, f"rules without a test that fires them: {sorted(rules - fired)}"


def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The tests can fail: a NATS rule that fires on every host breaks the series that must stay quiet."""
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("gpuaas_agent_nats_connected == 0",
                                                                 "gpuaas_agent_nats_connected < 2"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = _promtool_run("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0 and "GpuaasAgentNatsDisconnected" in done.stdout + done.stderr


def _exported_names() -> set[str]:
    """Every sample name the agent's registry exports once each hook and live value has been seen."""
    live = LiveState(image_cache_bytes=1, image_cache_entries=1, slot_states={"active": 1}, nats_connected=True,
                     maintenance=DrainReport(maintenance=True, reason="r", since=datetime(2026, 1, 1, tzinfo=UTC)),
                     quarantined=[QuarantinedComponent(kind=ComponentKind.gpu, identity="0000:18:00.0",
                                                       reason=QuarantineReason.operator,
                                                       since=datetime(2026, 1, 1, tzinfo=UTC), task_id="t")])
    metrics = AgentMetrics(lambda: live)
    metrics.task_finished("slice.vm_release", "failed", 1.0)
    metrics.step_finished("slice.vm_provision", "clone", "succeeded", 1.0, {"virtual_size_bytes": 10})
    metrics.step_finished("slice.vm_release", "wipe", "succeeded", 1.0, {"bytes": 10})
    metrics.health("healthy", [HealthCheck(name="slice_nat", status="ok", detail="", checked_at=datetime.now(UTC))])
    return {sample.name for family in text_string_to_metric_families(metrics.render().decode())
            for sample in family.samples}


def _metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers not followed by ``(`` and not label names or keywords."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r'"[^"]*"', "", expr)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", expr))
    return {n for n in names if n not in {"and", "or", "unless", "bool", "offset"} and not n.isdigit()}


def test_every_series_the_rules_and_the_dashboard_read_is_exported_by_the_agent():
    exported = _exported_names()
    rules = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    panels = json.loads(DASHBOARD.read_text())["panels"]
    dashboard = [t["expr"].replace("$job", "gpuaas-agent").replace("$instance", ".*")
                 for p in panels for t in p.get("targets", [])]
    assert len(dashboard) >= 20
    read = set().union(*map(_metric_names, rules + dashboard))
    ours = {n for n in read if n.startswith("gpuaas_agent_")}
    assert read - ours <= FOREIGN | {"vector", "le", "time"}, read - ours
    assert ours <= exported, f"not exported by the agent: {sorted(ours - exported)}"
    # The dashboard covers the series an operator looks at first.
    for name in ("gpuaas_agent_quarantined", "gpuaas_agent_maintenance", "gpuaas_agent_slot_states",
                 "gpuaas_agent_health_state", "gpuaas_agent_nats_connected", "gpuaas_agent_tasks_total"):
        assert any(name in expr for expr in dashboard), name


def test_the_name_parser_sees_a_misspelt_series():
    assert "gpuaas_agent_nats_conected" in _metric_names('sum by (instance) (gpuaas_agent_nats_conected{job="x"})')
    assert _metric_names('histogram_quantile(0.9, sum by (le) (rate(a_bucket[5m])))') == {"a_bucket"}


def test_the_package_ships_every_monitoring_file():
    spec = importlib.util.spec_from_file_location("build_deb", REPO / "packaging" / "build_deb.py")
    build_deb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_deb)
    assert set(build_deb.MONITORING) == {p.name for p in MONITORING.iterdir()}
    assert build_deb.MONITORING_DIR == "/usr/share/gpuaas-agent/monitoring"
