"""`cloud-init render`'s slice inputs: every [slice] setting a provision needs, checked at render with one line per bad input."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys

import pytest
import yaml

from gpuaas_agent.compat import tomllib
from gpuaas_agent.config import parse_config
from gpuaas_agent.deploy.sliceinputs import IMAGE_CA_PATH
from gpuaas_agent.deploy.userdata import CONFIG_PATH, UserDataInputs, check_inputs, render_userdata, steps
from gpuaas_agent.errors import ContractError
from tests.conftest import REPO
from tests.support.image_server import issue_server_cert, make_ca

EXAMPLE_INPUTS = REPO / "cloud-init" / "inputs.example.json"
SLICE_HOST = ["gpuaas-profile-slice-vm"]


def _inputs(**changes) -> UserDataInputs:
    data = json.loads(EXAMPLE_INPUTS.read_text())
    data.update(changes)
    return UserDataInputs.from_wire(data)


def _problems(**changes) -> list[str]:
    return _inputs(**changes).problems()


def _written(doc: dict, suffix: str) -> dict:
    return next(f for f in doc["write_files"] if f["path"].endswith(suffix))


@pytest.fixture(scope="module")
def ca_pem(tmp_path_factory) -> str:
    return make_ca(tmp_path_factory.mktemp("ca"))[0].read_text()


def test_slice_settings_and_ca_reach_agent_toml_and_load_as_the_agent_loads_them(ca_pem, tmp_path):
    table = {"image_https_hosts": ["Images.Example.com:8443", "10.0.0.5"], "image_file_dir": "/srv/images",
             "image_max_bytes": 1 << 34, "ovs_bridge": "br-slice", "subnet": "10.200.0.0/24", "gateway": "10.200.0.1",
             "nameservers": ["10.200.0.1"], "terminal": {"max_sessions": 8},
             "readiness_egress_target": {"ip": "192.0.2.7", "port": 443},
             "wipe_policies": {"h200_1g_24c_64g": {"method": "nvme_format"}}}
    doc = yaml.safe_load(render_userdata(_inputs(slice=table, image_ca_pem=ca_pem)))
    raw = tomllib.loads(_written(doc, "agent.toml")["content"])
    assert raw["slice"]["image_ca_bundle"] == str(IMAGE_CA_PATH)
    ca_file = tmp_path / "image-ca.pem"  # where the step puts the staged file, here
    ca_file.write_text(_written(doc, "image-ca.pem")["content"])
    raw["slice"]["image_ca_bundle"] = str(ca_file)
    config = parse_config(raw)
    assert config.slice.image_https_hosts == ("images.example.com:8443", "10.0.0.5")
    assert str(config.slice.image_file_dir) == "/srv/images" and config.slice.image_max_bytes == 1 << 34
    assert config.slice.ovs_bridge == "br-slice" and str(config.slice.gateway) == "10.200.0.1"
    assert config.slice.terminal.max_sessions == 8 and config.slice.readiness_egress_target.port == 443
    assert config.slice.wipe_policies["h200_1g_24c_64g"].method.value == "nvme_format"
    # the CA is installed after the config and before prepare-host (which loads the config, CA included)
    names = [name for name, _ in steps(_inputs(slice=table, image_ca_pem=ca_pem))]
    assert names.index("install-config") < names.index("install-image-ca") < names.index("prepare-host")
    install = dict(steps(_inputs(slice=table, image_ca_pem=ca_pem)))["install-image-ca"]
    assert install[-1] == str(IMAGE_CA_PATH) and IMAGE_CA_PATH.parent == CONFIG_PATH.parent


def test_the_installed_ca_verifies_a_server_it_signed(ca_pem, tmp_path):
    """The PEM that passes the render is a trust anchor the agent's TLS context accepts, not just text."""
    ca_dir = tmp_path / "ca"
    ca = make_ca(ca_dir)
    cert, _key = issue_server_cert(ca, tmp_path / "server")
    assert _problems(slice={"image_https_hosts": ["127.0.0.1"]}, image_ca_pem=ca[0].read_text()) == []
    done = subprocess.run(["openssl", "verify", "-CAfile", str(ca[0]), str(cert)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    context = ssl.create_default_context(cadata=ca[0].read_text())
    assert [c["subject"] for c in context.get_ca_certs()]


def test_a_slice_host_without_an_image_source_is_refused_at_render():
    problems = _problems(slice={}, maas_tags=SLICE_HOST)
    assert len(problems) == 1 and "refuses every image" in problems[0]
    assert _problems(slice={}, maas_tags=["gpuaas-profile-baremetal"]) == []  # no slices: no image needed
    assert _problems(slice={"image_file_dir": "/srv/images"}, maas_tags=SLICE_HOST) == []


@pytest.mark.parametrize("table,named", [
    ({"image_https_hosts": ["https://images.example.com"]}, "slice.image_https_hosts"),
    ({"image_https_hosts": ["*.example.com"]}, "slice.image_https_hosts"),
    ({"image_https_hosts": ["images.example.com:99999"]}, "slice.image_https_hosts"),
    ({"image_https_hosts": "images.example.com"}, "slice.image_https_hosts"),
    ({"image_https_hosts": ["images.example.com/path"]}, "slice.image_https_hosts"),
    ({"image_https_hosts": ["a.example\nb.example"]}, "slice.image_https_hosts"),
    ({"image_file_dir": "relative/images"}, "slice.image_file_dir"),
    ({"image_file_dir": "/"}, "slice.image_file_dir"),
    ({"image_file_dir": "/dev/disk/by-id"}, "under /dev"),
    ({"image_file_dir": "/proc/self"}, "under /proc"),
    ({"image_file_dir": "/var/lib/gpuaas-agent/images"}, "under /var/lib/gpuaas-agent"),
    ({"image_file_dir": "/srv/../etc"}, "'..'"),
    ({"image_ca_bundle": "/etc/ssl/certs/ca.pem"}, "give the CA itself as image_ca_pem"),
    ({"image_max_bytes": 0}, "slice.image_max_bytes"),
    ({"image_max_bytes": "64G"}, "slice.image_max_bytes"),
    ({"ovs_bridge": "br0; rm -rf /"}, "slice.ovs_bridge"),
    ({"gateway": "10.9.9.1"}, "slice: gateway 10.9.9.1 is not a host address"),  # not in the default subnet
    ({"imag_https_hosts": ["x.example"]}, "unknown key 'slice.imag_https_hosts'"),
    ({"terminal": {"max_sesions": 3}}, "unknown key 'slice.terminal.max_sesions'"),
    ({"wipe_policies": {"no_such_profile": {"method": "nvme_format"}}}, "slice.wipe_policies"),
    ({"allow_loopback_http": True}, "slice.allow_loopback_http: a lab-only switch"),
    ({"allow_emulated_domains": True}, "slice.allow_emulated_domains: a lab-only switch"),
])
def test_each_bad_slice_input_is_named(table, named):
    problems = _problems(slice={"image_file_dir": "/srv/images", **table}
                         if "image_file_dir" not in table and "image_https_hosts" not in table else table)
    assert any(named in p for p in problems), problems


def test_every_bad_input_is_reported_at_once_one_line_each(tmp_path):
    data = json.loads(EXAMPLE_INPUTS.read_text())
    data["slice"] = {"image_https_hosts": ["https://x"], "image_file_dir": "/sys/x", "image_max_bytes": -1}
    data["image_ca_pem"] = "not a pem"
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(data))
    done = subprocess.run([sys.executable, "-m", "gpuaas_agent", "cloud-init", "render", str(path), "--out",
                           str(tmp_path / "user-data")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 1 and not (tmp_path / "user-data").exists()
    for named in ("slice.image_https_hosts", "slice.image_file_dir", "slice.image_max_bytes", "image_ca_pem"):
        assert named in done.stderr, done.stderr
    with pytest.raises(ContractError) as err:
        check_inputs(UserDataInputs.from_wire(data))
    assert err.value.code == "userdata_inputs_invalid" and len(err.value.evidence["problems"]) == 4


def test_hostile_ca_inputs_are_refused(ca_pem, tmp_path):
    key = (tmp_path / "k.pem")
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True, timeout=30)
    server = issue_server_cert(make_ca(tmp_path / "other"), tmp_path / "leaf")[0].read_text()
    hosts = {"image_https_hosts": ["images.example.com"]}
    cases = {
        "holds a private key": ca_pem + key.read_text(),
        "no PEM certificate": "hello",
        "not loadable": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        "more than": ca_pem * 2000,
        "a server certificate is not a CA": server,
    }
    for named, pem in cases.items():
        problems = _problems(slice=hosts, image_ca_pem=pem)
        assert len(problems) == 1 and named in problems[0], (named, problems)
    # a CA with nothing it may sign for is a mistake, said so
    assert any("image_https_hosts is empty" in p for p in _problems(slice={"image_file_dir": "/srv/i"},
                                                                   image_ca_pem=ca_pem))


def test_yaml_and_toml_special_characters_in_slice_values_stay_data():
    """A value that TOML or YAML would read as syntax is written as a string and read back the same."""
    hostile = {"image_file_dir": '/srv/im"ages] #[x]', "libvirt_uri": 'qemu:///system"\n[x]\nnats_url = "tls://evil"'}
    assert _problems(slice=hostile) == []
    raw = tomllib.loads(_written(yaml.safe_load(render_userdata(_inputs(slice=hostile))), "agent.toml")["content"])
    assert raw["slice"] == hostile and "x" not in raw
    assert raw["nats_url"] == json.loads(EXAMPLE_INPUTS.read_text())["nats_url"]
    newline = _problems(slice={"image_file_dir": "/srv/images\n/etc"})
    assert len(newline) == 1 and "control character" in newline[0]


def test_lab_switches_are_written_when_the_inputs_say_lab():
    doc = yaml.safe_load(render_userdata(_inputs(nats_url="nats://127.0.0.1:4222", insecure=True,
                                                 slice={"image_https_hosts": ["127.0.0.1:8443"],
                                                        "allow_emulated_domains": True})))
    config = parse_config(tomllib.loads(_written(doc, "agent.toml")["content"]))
    assert config.slice.allow_emulated_domains and config.insecure
