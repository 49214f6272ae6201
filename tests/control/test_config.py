"""AgentConfig files: TOML and JSON, unknown keys and wrong types named in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuaas_agent.config import AgentConfig, ConfigError, load_config
from gpuaas_agent.contract.tasks import TaskType


def test_defaults_are_production_paths():
    config = AgentConfig()
    assert config.state_dir == Path("/var/lib/gpuaas-agent")
    assert config.state_db == Path("/var/lib/gpuaas-agent/state.db")
    assert config.concurrency[TaskType.vm_provision] == 8


def test_toml_config_loads(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(
        'state_dir = "/tmp/agent"\nnats_url = "nats://10.0.0.1:4222"\nheartbeat_interval_s = 5\n'
        '[concurrency]\n"slice.vm_provision" = 2\n'
    )
    config = load_config(path)
    assert config.state_dir == Path("/tmp/agent") and config.heartbeat_interval_s == 5
    assert config.concurrency == {TaskType.vm_provision: 2}


def test_json_config_loads(tmp_path):
    path = tmp_path / "agent.json"
    path.write_text('{"host_root": "/srv/fixture", "reconcile_interval_s": 60}')
    assert load_config(path).host_root == Path("/srv/fixture")


def test_unknown_key_and_wrong_type_are_named(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('heartbeat_interval = 5\nack_wait_s = "soon"\n[concurrency]\n"slice.dance" = 1\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert err.value.code == "config_invalid"
    assert "unknown key 'heartbeat_interval'" in message
    assert "ack_wait_s" in message and "concurrency.slice.dance" in message
    assert str(path) in message


def test_keepalive_must_fit_in_ack_wait():
    with pytest.raises(ValueError, match="keepalive_interval_s"):
        AgentConfig(keepalive_interval_s=40, ack_wait_s=60)


@pytest.mark.parametrize("name,text,code", [
    ("agent.toml", "state_dir = [", "config_invalid"),
    ("agent.yaml", "a: 1", "config_invalid"),
    ("absent.toml", None, "config_unreadable"),
])
def test_unreadable_or_malformed_files_are_config_errors(tmp_path, name, text, code):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.code == code


def test_enroll_timeouts_must_fit_inside_the_unit_start_timeout():
    from gpuaas_agent.config import parse_config

    with pytest.raises(ConfigError) as err:
        parse_config({"connect_timeout_s": 45, "request_timeout_s": 30})
    assert "connect_timeout_s + request_timeout_s" in err.value.message
    with pytest.raises(ConfigError):
        parse_config({"reconnect_backoff_initial_s": 10, "reconnect_backoff_max_s": 1})
    config = parse_config({"connect_timeout_s": 30, "request_timeout_s": 30})
    assert (config.max_task_deadline_s, config.max_task_starts) == (86400.0, 3)
