"""gpuaas-agent network-baseline converges a real namespace: OVS bridge + gateway, dnsmasq config, NAT, ip_forward.

The converge runs as the real CLI inside the network namespace of a real
ovs-vswitchd (tests/support/ovsdb_fixture.py), exactly as the unit runs it on a host.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuaas_agent.deploy.netbaseline import BaselineSpec, dnsmasq_config
from tests.conftest import REPO

TIMEOUT_S = 60


def _ns(sw, *argv: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", "netns", "exec", sw.netns, *argv], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=REPO)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}: {done.stderr}")
    return done


def _agent_config(directory: Path, remote: str) -> Path:
    """The agent's own config: the baseline takes bridge, subnet, ovsdb and the hosts file from [slice]."""
    config = directory / "agent.toml"
    config.write_text(f'[slice]\novsdb_remote = "{remote}"\ndnsmasq_hosts_file = "{directory}/dnsmasq-hosts/hosts"\n')
    return config


def _baseline(sw, conf: Path, *extra: str) -> dict:
    config = _agent_config(conf.parent, sw.remote)
    done = _ns(sw, sys.executable, "-m", "gpuaas_agent", "network-baseline", "--json", "--config", str(config),
               "--datapath-type", "netdev", "--dnsmasq-conf", str(conf), *extra)
    return {step["name"]: step["outcome"] for step in json.loads(done.stdout)["steps"]}


def _nat_rules(sw) -> list[str]:
    out = _ns(sw, "iptables", "-t", "nat", "-S", "POSTROUTING").stdout.splitlines()
    return [line for line in out if "MASQUERADE" in line]


def test_converge_builds_the_baseline_then_changes_nothing(ovs_switch, tmp_path):
    sw = ovs_switch
    conf = tmp_path / "dnsmasq.d" / "gpuaas-slice-network.conf"
    host_forward = Path("/proc/sys/net/ipv4/ip_forward").read_text()

    conf.parent.mkdir()
    # A new namespace may inherit the machine's ip_forward (a slice host's is 1): start it at 0, so the
    # converge is seen to set it, whatever the machine running the test forwards.
    _ns(sw, sys.executable, "-c", "open('/proc/sys/net/ipv4/ip_forward', 'w').write('0')")
    first = _baseline(sw, conf)
    assert first == {"bridge": "changed", "bridge_up": "changed", "gateway_address": "changed",
                     "dhcp_hostsfile": "changed", "dnsmasq_config": "changed", "ip_forward": "changed", "nat": "changed"}

    # What the seed's parity check looks at, read back with the real tools in the namespace.
    addrs = json.loads(_ns(sw, "ip", "-j", "-4", "addr", "show", "dev", "ovsbr0").stdout)
    assert [(a["local"], a["prefixlen"]) for a in addrs[0]["addr_info"]] == [("10.100.0.1", 24)]
    assert sw.vsctl("get", "Bridge", "ovsbr0", "datapath_type").strip() == "netdev"
    _ns(sw, "iptables", "-t", "nat", "-C", "POSTROUTING", "-s", "10.100.0.0/24", "-j", "MASQUERADE")
    assert _ns(sw, "cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "1"
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text() == host_forward  # the host's own is untouched
    hosts = conf.parent / "dnsmasq-hosts" / "hosts"
    assert conf.read_text() == dnsmasq_config(BaselineSpec(dhcp_hostsfile=hosts))
    assert f"dhcp-hostsfile={hosts}" in conf.read_text()  # dnsmasq serves the reservations the agent writes
    assert hosts.read_bytes() == b"" and oct(hosts.stat().st_mode & 0o777) == "0o644"
    assert oct(conf.stat().st_mode & 0o777) == "0o644"
    # dnsmasq itself accepts the file.
    check = subprocess.run(["dnsmasq", "--test", f"--conf-file={conf}"], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr

    second = _baseline(sw, conf)
    assert set(second.values()) == {"unchanged"}, second
    assert len(_nat_rules(sw)) == 1


def test_drift_is_repaired_and_only_drift(ovs_switch, tmp_path):
    """Seed 004: NAT went missing on live hosts while ovsbr0 and dnsmasq looked fine."""
    sw = ovs_switch
    conf = tmp_path / "gpuaas-slice-network.conf"
    _baseline(sw, conf)
    _ns(sw, "iptables", "-t", "nat", "-D", "POSTROUTING", "-s", "10.100.0.0/24", "-j", "MASQUERADE")
    _ns(sw, "ip", "addr", "del", "10.100.0.1/24", "dev", "ovsbr0")
    conf.write_text("interface=ovsbr0\n")

    after = _baseline(sw, conf)
    changed = sorted(name for name, outcome in after.items() if outcome == "changed")
    assert changed == ["dnsmasq_config", "gateway_address", "nat"]
    assert len(_nat_rules(sw)) == 1


def test_tmfifo_is_evidence_when_absent_and_converged_when_present(ovs_switch, tmp_path):
    sw = ovs_switch
    conf = tmp_path / "gpuaas-slice-network.conf"
    assert _baseline(sw, conf, "--tmfifo")["tmfifo"] == "absent"

    _ns(sw, "ip", "link", "add", "tmfifo_net0", "type", "veth", "peer", "name", "rshim_peer")  # no dummy module here
    steps = _baseline(sw, conf, "--tmfifo")
    assert steps["tmfifo"] == "changed" and steps["tmfifo_up"] == "changed"
    addrs = json.loads(_ns(sw, "ip", "-j", "-4", "addr", "show", "dev", "tmfifo_net0").stdout)
    assert [(a["local"], a["prefixlen"]) for a in addrs[0]["addr_info"]] == [("192.168.100.1", 30)]
    assert _baseline(sw, conf, "--tmfifo")["tmfifo"] == "unchanged"


def test_missing_tool_is_named_and_reported_through_status(tmp_path):
    """A host without iptables: exit 1, the message names it, STATUS= tells systemd (no silent failure)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "dnsmasq"):
        found = shutil.which(tool)
        assert found, f"{tool} must be installed for this test"
        (bin_dir / tool).symlink_to(found)
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(TIMEOUT_S)
    try:
        env = {**os.environ, "PATH": str(bin_dir), "NOTIFY_SOCKET": str(notify)}
        done = subprocess.run([sys.executable, "-m", "gpuaas_agent", "network-baseline",
                               "--config", str(_agent_config(tmp_path, "unix:/nonexistent.sock")),
                               "--dnsmasq-conf", str(tmp_path / "x.conf")],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=REPO)
        assert done.returncode == 1
        assert "iptables" in done.stderr and "baseline_tools_missing" in done.stderr
        status = sock.recv(4096).decode()
    finally:
        sock.close()
    assert status.startswith("STATUS=failed") and "iptables" in status
    assert not (tmp_path / "x.conf").exists()  # nothing was changed


def test_bad_gateway_flag_is_refused_before_anything_changes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gpuaas_agent", "network-baseline", "--gateway", "10.100.0.0/33",
                           "--config", str(_agent_config(tmp_path, "unix:/nonexistent.sock")),
                           "--dnsmasq-conf", str(tmp_path / "x.conf")],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert done.returncode == 2 and "gateway" in done.stderr
    assert not (tmp_path / "x.conf").exists()


def test_bad_agent_config_is_named_and_reported_through_status(tmp_path):
    config = tmp_path / "agent.toml"
    config.write_text('[slice]\novs_bridg = "ovsbr0"\n')
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(TIMEOUT_S)
    try:
        done = subprocess.run([sys.executable, "-m", "gpuaas_agent", "network-baseline", "--config", str(config),
                               "--dnsmasq-conf", str(tmp_path / "x.conf")],
                              capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO,
                              env={**os.environ, "NOTIFY_SOCKET": str(notify)})
        status = sock.recv(4096).decode()
    finally:
        sock.close()
    assert done.returncode == 2 and "unknown key 'slice.ovs_bridg'" in done.stderr  # usage/input error
    assert status.startswith("STATUS=failed") and "ovs_bridg" in status
    assert not (tmp_path / "x.conf").exists()


@pytest.mark.parametrize("fields", [
    {"dhcp_first_offset": 1},                      # .1 is the gateway's usual place
    {"dhcp_last_offset": 255},                     # the broadcast address
    {"gateway": "10.100.0.50/24"},                 # gateway inside the pool
])
def test_dhcp_range_must_fit_the_subnet_and_avoid_the_gateway(fields):
    with pytest.raises(ValueError):
        BaselineSpec(**fields)
