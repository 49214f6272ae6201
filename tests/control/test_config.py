"""AgentConfig files: TOML and JSON, unknown keys and wrong types named in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuaas_agent.config import AgentConfig, ConfigError, load_config
from gpuaas_agent.contract.tasks import TaskType
from gpuaas_agent.control.accounts import NODE_JS_API_PREFIX
from gpuaas_agent.daemon import worker_settings
from gpuaas_agent.tasks.registry import concurrency_for


def test_defaults_are_production_paths():
    config = AgentConfig()
    assert config.state_dir == Path("/var/lib/gpuaas-agent")
    assert config.state_db == Path("/var/lib/gpuaas-agent/state.db")
    assert concurrency_for(config)[TaskType.vm_provision] == 8  # the registry's defaults


def test_toml_config_loads(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(
        'state_dir = "/tmp/agent"\nnats_url = "nats://10.0.0.1:4222"\nheartbeat_interval_s = 5\n'
        '[concurrency]\n"slice.vm_provision" = 2\n'
    )
    config = load_config(path)
    assert config.state_dir == Path("/tmp/agent") and config.heartbeat_interval_s == 5
    assert config.concurrency == {TaskType.vm_provision: 2}
    assert concurrency_for(config) == {TaskType.vm_provision: 2}  # the table replaces the defaults whole


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
# -- where images may come from ([slice] image_*) ----------------------------------------------


def test_image_sources_are_closed_by_default():
    from gpuaas_agent.config import SliceConfig

    config = SliceConfig()
    assert (config.image_https_hosts, config.image_file_dir) == ((), None)
    assert config.image_max_bytes == 64 << 30 and config.image_stall_timeout_s == 60.0
    assert config.allow_loopback_http is False


def test_image_policy_loads_from_toml(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('[slice]\nimage_https_hosts = ["Images.Example.com", "mirror.example.com:8443"]\n'
                    'image_file_dir = "/srv/images"\nimage_max_bytes = 1073741824\nimage_stall_timeout_s = 30\n')
    config = load_config(path).slice
    assert config.image_https_hosts == ("images.example.com", "mirror.example.com:8443")
    assert config.image_file_dir == Path("/srv/images")
    assert (config.image_max_bytes, config.image_stall_timeout_s) == (1 << 30, 30.0)


@pytest.mark.parametrize("line,key", [
    ('image_https_hosts = ["https://images.example.com"]', "slice.image_https_hosts"),
    ('image_https_hosts = ["*.example.com"]', "slice.image_https_hosts"),
    ('image_https_hosts = ["images.example.com/path"]', "slice.image_https_hosts"),
    ('image_https_hosts = ["images.example.com:99999"]', "slice.image_https_hosts"),
    ('image_file_dir = "images"', "slice.image_file_dir"),
    ('image_file_dir = "/"', "slice.image_file_dir"),
    ("image_max_bytes = 0", "slice.image_max_bytes"),
    ("image_stall_timeout_s = 0", "slice.image_stall_timeout_s"),
    ('image_hosts = ["images.example.com"]', "unknown key 'slice.image_hosts'"),
])
def test_bad_image_policy_is_refused_with_the_key_named(tmp_path, line, key):
    path = tmp_path / "agent.toml"
    path.write_text(f"[slice]\n{line}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert key in str(err.value)


def test_slice_host_wires_the_image_policy_and_forbids_the_state_dir(tmp_path):
    import asyncio
    import hashlib

    from gpuaas_agent.config import SliceConfig
    from gpuaas_agent.host.images.cache import ImageCacheError
    from gpuaas_agent.tasks.drivers import SliceDrivers

    state = tmp_path / "state"
    state.mkdir()
    (state / "enrollment.json").write_bytes(b"credentials")
    image = tmp_path / "image.raw"
    image.write_bytes(b"\0" * 65536)
    config = AgentConfig(state_dir=state, slice=SliceConfig(
        image_file_dir=tmp_path, image_https_hosts=("images.example.com",), image_max_bytes=1 << 20,
        image_stall_timeout_s=5, libvirt_uri="test:///default"))
    sh = SliceDrivers.from_config(config)
    assert sh.images.policy.https_hosts == ("images.example.com",) and sh.images.policy.file_dir == tmp_path
    assert (sh.images.max_bytes, sh.images.stall_timeout_s, sh.images.root) == (1 << 20, 5, state / "images")

    async def fetch(path, data):
        return await sh.images.fetch(path.as_uri(), hashlib.sha256(data).hexdigest())

    assert asyncio.run(fetch(image, b"\0" * 65536)).size_bytes == 65536
    with pytest.raises(ImageCacheError) as err:
        asyncio.run(fetch(state / "enrollment.json", b"credentials"))
    assert (err.value.code, err.value.evidence["rule"]) == ("image_url_refused", "forbidden_path")
    asyncio.run(sh.close())


def test_pull_heartbeat_is_off_by_default_and_bounded(tmp_path):
    """Off unless set (docs/performance.md "Pull heartbeat"); a zero, negative or past-a-minute value is refused by name."""
    assert AgentConfig().pull_heartbeat_s is None
    path = tmp_path / "agent.toml"
    path.write_text("pull_heartbeat_s = 5\ntask_consumer_replicas = 1\ntask_consumer_memory = true\n")
    assert load_config(path).pull_heartbeat_s == 5.0
    for bad in ("0", "-1", "61"):
        path.write_text(f"pull_heartbeat_s = {bad}\n")
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert "pull_heartbeat_s" in str(err.value)


def test_js_api_prefix_defaults_to_jetstreams_own_and_reaches_the_worker(tmp_path):
    """The account-per-node layout imports JetStream's API under another prefix (docs/security-auth.md)."""
    assert AgentConfig().js_api_prefix == "$JS.API" and worker_settings(AgentConfig()).js_api_prefix == "$JS.API"
    path = tmp_path / "agent.toml"
    path.write_text(f'js_api_prefix = "{NODE_JS_API_PREFIX}"\n')
    assert worker_settings(load_config(path)).js_api_prefix == NODE_JS_API_PREFIX
    for bad in ("", "a b", "gpuaas.js.>", "gpuaas.*.API", "gpuaas..API", "gpuaas.js.API."):
        path.write_text(f'js_api_prefix = "{bad}"\n')
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert "js_api_prefix" in str(err.value)


def test_fabric_isolation_is_required_unless_the_operator_says_otherwise(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('[slice]\nfabric_isolation = "single_tenant"\n')
    assert load_config(path).slice.fabric_isolation.value == "single_tenant"
    path.write_text("")
    assert load_config(path).slice.fabric_isolation.value == "required"
    path.write_text('[slice]\nfabric_isolation = "off"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "fabric_isolation" in info.value.message
