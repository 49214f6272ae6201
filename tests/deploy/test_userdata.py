"""`gpuaas-agent cloud-init render`: typed inputs to #cloud-config that cloud-init's own schema accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuaas_agent.compat import tomllib
from gpuaas_agent.config import parse_config
from gpuaas_agent.control.transport import creds_text
from gpuaas_agent.deploy.userdata import (
    SLICE_PROFILE_TAG,
    STEP_PATH,
    STEP_SCRIPT,
    UserDataInputs,
    load_inputs,
    render_userdata,
)
from gpuaas_agent.errors import ContractError
from tests.conftest import REPO
from tests.deploy.machine import cloud_init_runcmd_script

EXAMPLE_INPUTS = REPO / "cloud-init" / "inputs.example.json"
TEMPLATE = REPO / "cloud-init" / "user-data.example.yaml"
BASELINE_ENABLE = ["systemctl", "enable", "--now", "gpuaas-slice-network-baseline.service"]


def _inputs(**changes) -> UserDataInputs:
    data = json.loads(EXAMPLE_INPUTS.read_text())
    data.update(changes)
    return UserDataInputs.model_validate(data)


def _schema_check(path: Path) -> subprocess.CompletedProcess:
    tool = shutil.which("cloud-init")
    if tool is None:
        pytest.fail("cloud-init is not installed (scripts/apt-packages.txt lists it)")
    return subprocess.run([tool, "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120)


def _render_cli(inputs: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", "cloud-init", "render", str(inputs), "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_rendered_user_data_passes_cloud_init_schema(tmp_path):
    out = tmp_path / "user-data"
    done = _render_cli(EXAMPLE_INPUTS, out)
    assert done.returncode == 0, done.stderr
    assert oct(out.stat().st_mode & 0o777) == "0o600"  # it carries the bootstrap token
    check = _schema_check(out)
    assert check.returncode == 0 and "Valid" in check.stdout, check.stdout + check.stderr


def test_cloud_init_schema_rejects_a_broken_document(tmp_path):
    """The schema check above can fail: a wrong type for write_files is refused."""
    broken = tmp_path / "user-data"
    broken.write_text("#cloud-config\nwrite_files: 7\nruncmd: {a: 1}\n")
    assert _schema_check(broken).returncode != 0


def test_committed_template_is_the_render_of_the_example_inputs():
    assert TEMPLATE.read_text() == render_userdata(load_inputs(EXAMPLE_INPUTS))


def test_order_token_config_install_baseline_enroll_enable_on_slice_hosts():
    doc = yaml.safe_load(render_userdata(_inputs(maas_tags=[SLICE_PROFILE_TAG, "h200"])))
    token = next(f for f in doc["write_files"] if f["path"].endswith("bootstrap-token"))
    assert token["permissions"] == "0600" and token["content"].strip() == json.loads(EXAMPLE_INPUTS.read_text())["bootstrap_token"]
    assert all(isinstance(c, list) and c[:2] == ["sh", str(STEP_PATH)] for c in doc["runcmd"])
    cmds = [c[3:] for c in doc["runcmd"]]  # each step's own argv, behind the fail-closed step wrapper
    names = [" ".join(c) for c in cmds]
    install = next(i for i, c in enumerate(names) if "apt-get install" in c)
    verify = next(i for i, c in enumerate(names) if c.startswith("sha256sum --check"))
    token_in = next(i for i, c in enumerate(cmds) if c[-1] == "/var/lib/gpuaas-agent/bootstrap-token")
    baseline = cmds.index(BASELINE_ENABLE)
    config_in = next(i for i, c in enumerate(cmds) if c[-1] == "/etc/gpuaas-agent/agent.toml")
    prepare = cmds.index(["/usr/bin/gpuaas-agent", "prepare-host", "--config", "/etc/gpuaas-agent/agent.toml"])
    enroll = next(i for i, c in enumerate(cmds) if c[1:2] == ["enroll"])
    enable = cmds.index(["systemctl", "enable", "--now", "gpuaas-agent.service"])
    assert verify < install < config_in < token_in < prepare < baseline < enroll < enable
    # The config it installs is one the agent accepts.
    config = next(f for f in doc["write_files"] if f["path"].endswith("agent.toml"))
    assert parse_config(tomllib.loads(config["content"])).nats_url == json.loads(EXAMPLE_INPUTS.read_text())["nats_url"]


def test_a_lab_plaintext_url_with_insecure_writes_insecure_into_the_agent_config():
    doc = yaml.safe_load(render_userdata(_inputs(nats_url="nats://127.0.0.1:4222", insecure=True)))
    config = parse_config(tomllib.loads(next(f for f in doc["write_files"] if f["path"].endswith("agent.toml"))["content"]))
    assert config.insecure and config.nats_url == "nats://127.0.0.1:4222"
    assert not parse_config(tomllib.loads(next(f for f in yaml.safe_load(render_userdata(_inputs()))["write_files"]
                                               if f["path"].endswith("agent.toml"))["content"])).insecure


def test_baremetal_profile_gets_no_network_baseline():
    """Seed 004: j22u05, tagged gpuaas-profile-baremetal, correctly lacked slice services."""
    doc = yaml.safe_load(render_userdata(_inputs(maas_tags=["gpuaas-profile-baremetal"], baseline_args=["--tmfifo"])))
    cmds = [c[3:] for c in doc["runcmd"]]
    assert BASELINE_ENABLE not in cmds
    assert not any("network-baseline" in f["path"] for f in doc["write_files"])
    assert ["systemctl", "enable", "--now", "gpuaas-agent.service"] in cmds


def test_yaml_special_characters_in_the_token_stay_data():
    token = "abc: def\n- x #{{ '\"} &anchor *alias"
    doc = yaml.safe_load(render_userdata(_inputs(bootstrap_token=token)))
    written = next(f for f in doc["write_files"] if f["path"].endswith("bootstrap-token"))
    assert written["content"] == token + "\n"


@pytest.mark.parametrize("change,named", [
    ({"nats_urll": "nats://x:4222"}, "unknown key 'nats_urll'"),
    ({"package_sha256": "abc"}, "package_sha256"),
    ({"nats_url": "http://x"}, "nats_url"),
    ({"nats_url": "nats://10.177.36.10:4222"}, "insecure: true"),  # plaintext is a lab, said so explicitly
    ({"maas_tags": "gpuaas-profile-slice-vm"}, "maas_tags"),
])
def test_bad_inputs_are_refused_naming_the_key(tmp_path, change, named):
    data = json.loads(EXAMPLE_INPUTS.read_text())
    data.update(change)
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ContractError) as err:
        load_inputs(path)
    assert named in str(err.value)
    done = _render_cli(path, tmp_path / "user-data")
    assert done.returncode == 1 and named in done.stderr and not (tmp_path / "user-data").exists()


def test_missing_inputs_file_is_named(tmp_path):
    done = _render_cli(tmp_path / "nope.json", tmp_path / "user-data")
    assert done.returncode == 1 and "nope.json" in done.stderr


def test_every_step_goes_through_the_wrapper_which_is_constant_and_valid_sh():
    doc = yaml.safe_load(render_userdata(_inputs()))
    step = next(f for f in doc["write_files"] if f["path"] == str(STEP_PATH))
    assert step["permissions"] == "0700" and step["content"] == STEP_SCRIPT
    other = yaml.safe_load(render_userdata(_inputs(bootstrap_token="another-token-0123456789abcdef")))
    assert next(f for f in other["write_files"] if f["path"] == str(STEP_PATH))["content"] == STEP_SCRIPT
    names = [c[2] for c in doc["runcmd"]]
    assert len(names) == len(set(names)) and all(c[:2] == ["sh", str(STEP_PATH)] for c in doc["runcmd"])
    assert subprocess.run(["sh", "-n"], input=STEP_SCRIPT, text=True, timeout=10).returncode == 0
    # cloud-init's own shellify keeps each entry one quoted command line (no shell re-parsing of our argv).
    script = cloud_init_runcmd_script(doc["runcmd"])
    assert script.startswith("#!/bin/sh\n") and len(script.splitlines()) == 1 + len(doc["runcmd"])


def test_the_first_failed_step_stops_every_later_one_in_cloud_inits_runcmd_script(tmp_path):
    """cloud-init's runcmd script has no `set -e`: the wrapper alone must stop the chain (here in a tmp dir)."""
    boot = tmp_path / "boot"
    boot.mkdir()
    step = boot / "step"
    step.write_text(STEP_SCRIPT.replace(str(STEP_PATH.parent), str(boot)))
    marker = tmp_path / "later-step-ran"
    runcmd = [["sh", str(step), "first", "true"],
              ["sh", str(step), "verify-package", "sh", "-c", "echo 'pkg.deb: FAILED' >&2; exit 3"],
              ["sh", str(step), "install-package", "touch", str(marker)]]
    script = tmp_path / "runcmd"
    script.write_text(cloud_init_runcmd_script(runcmd))
    script.chmod(0o700)
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and not marker.exists()
    assert (boot / "failed").read_text() == "step verify-package failed (exit 3): pkg.deb: FAILED \n"
    assert "gpuaas-bootstrap: step install-package not run: an earlier step failed" in done.stderr


def test_the_bootstrap_login_is_written_0600_named_in_the_config_and_never_in_a_command():
    """An operator-mode server (an account per node) has no anonymous users: enroll needs the shared login."""
    creds = creds_text("eyJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.c2ln", "SUAEXAMPLESEEDNOTAREALONE")
    doc = yaml.safe_load(render_userdata(_inputs(bootstrap_creds=creds)))
    staged = next(f for f in doc["write_files"] if f["path"].endswith("bootstrap.creds"))
    assert staged["permissions"] == "0600" and staged["content"] == creds.rstrip("\n") + "\n"
    cmds = [c[3:] for c in doc["runcmd"]]
    installed = cmds.index(["install", "-m", "0600", "-o", "root", "-g", "root", staged["path"],
                            "/var/lib/gpuaas-agent/bootstrap.creds"])
    enroll = next(i for i, c in enumerate(cmds) if c[1:2] == ["enroll"])
    assert installed < enroll and ["rm", "-f", staged["path"]] in cmds
    assert not any("SUAEXAMPLE" in " ".join(c) for c in cmds)  # the seed is a file's content, never argv
    config = parse_config(tomllib.loads(next(f for f in doc["write_files"] if f["path"].endswith("agent.toml"))["content"]))
    assert str(config.nats_enroll_creds_file) == "/var/lib/gpuaas-agent/bootstrap.creds"
    # Without the input nothing of it is written (a server that lets enrollment in without a login).
    plain = yaml.safe_load(render_userdata(_inputs()))
    assert not any(f["path"].endswith("bootstrap.creds") for f in plain["write_files"])
    with pytest.raises(ValueError, match="not a NATS .creds file"):
        _inputs(bootstrap_creds="just a password")
