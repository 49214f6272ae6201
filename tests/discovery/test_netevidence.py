"""Slice network evidence from recordings and from a real network namespace the test builds."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from gpuaas_agent.contract.parity import ParityStatus
from gpuaas_agent.discovery.netevidence import (
    NetEvidenceError,
    NetTarget,
    dnsmasq_ranges_in,
    judge_dnsmasq,
    masquerade_in_iptables_save,
    masquerade_in_nft,
    read_dnsmasq_evidence,
    read_network_evidence,
)
from gpuaas_agent.discovery.prereqs import check_dnsmasq
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host
from tests.support.slice_netns import MASQ, ns_exec, run_argv, set_ip_forward, slice_namespace

SUBNET = ipaddress.IPv4Network("10.100.0.0/24")


def _codes(findings) -> list[str]:
    return [f.code for f in findings]


# -- the namespace the live tests read -------------------------------------------------------


@pytest.fixture
def netns():
    with slice_namespace() as name:
        yield name


# -- recordings -------------------------------------------------------------------------------


def test_healthy_recording_has_no_blockers_and_proves_nat_through_iptables():
    ev = read_network_evidence(HostRoot.open(fixture_host("h200-slice-after-transition")))
    assert ev.source == "fixture" and ev.blockers == [] and ev.warnings == [] and ev.unreadable == []
    assert ev.addresses_of("ovsbr0") == ["10.100.0.1/24"]
    assert ev.nat.present is True and ev.nat.method == "recorded iptables-save"
    assert ev.ip_forward is True
    assert ev.dnsmasq_subnet_files == ["/etc/dnsmasq.d/gpuaas-slice.conf"]
    assert ev.ipoib_netplan == "/etc/netplan/60-ipoib.yaml"
    assert ev.addresses_of("tmfifo_net0") == ["192.168.100.1/30"]
    assert any(r.dst == "default" and r.dev == "eno8303" for r in ev.routes)


def test_nat_missing_recording_is_a_hard_blocker_naming_the_rule():
    """Seed 004, 2026-04-24: bridge and dnsmasq fine, MASQUERADE rule gone."""
    ev = read_network_evidence(HostRoot.open(fixture_host("h200-slice-nat-missing")))
    assert _codes(ev.blockers) == ["nat_missing"]
    assert "-A POSTROUTING -s 10.100.0.0/24 -j MASQUERADE" in ev.blockers[0].detail
    assert ev.nat.present is False


def test_ip_forward_0_in_a_recording_blocks(host_copy):
    root = host_copy("h200-slice-after-transition")
    (root / "proc/sys/net/ipv4/ip_forward").write_text("0\n")
    ev = read_network_evidence(HostRoot.open(root))
    assert _codes(ev.blockers) == ["ip_forward_disabled"]
    assert ev.blockers[0].path == "/proc/sys/net/ipv4/ip_forward"


def test_unrecorded_commands_are_unproven_never_passed(host_copy):
    root = host_copy("h200-slice-after-transition")
    shutil.rmtree(root / ".gpuaas-fixture")
    (root / "proc/sys/net/ipv4/ip_forward").unlink()
    ev = read_network_evidence(HostRoot.open(root))
    assert ev.nat.present is None and ev.ip_forward is None
    assert {"nat_unproven", "ip_forward_unproven", "ovs_bridge_unproven"} <= set(_codes(ev.warnings))
    assert "command_not_recorded" in _codes(ev.unreadable)
    assert ev.blockers == []  # dnsmasq config is still there


def test_a_failed_recorded_command_is_not_read_as_an_empty_ruleset(host_copy):
    root = host_copy("h200-slice-nat-missing")
    (root / ".gpuaas-fixture/manifest.json").write_text(json.dumps({"commands": [
        {"name": "iptables-save-nat", "argv": ["iptables-save", "-t", "nat"], "exit_code": 4, "error": "Permission denied"},
        {"name": "nft-ruleset", "argv": ["nft"], "exit_code": None, "error": "nft is not installed"},
    ]}))
    ev = read_network_evidence(HostRoot.open(root))
    assert ev.nat.present is None and "nat_unproven" in _codes(ev.warnings)
    assert [u.code for u in ev.unreadable] == ["command_failed", "command_failed"]


def test_missing_bridge_and_dnsmasq_block(host_copy):
    root = host_copy("h200-slice-after-transition")
    os.remove(root / "etc/dnsmasq.d/gpuaas-slice.conf")
    path = root / ".gpuaas-fixture/commands/ip-addr.out"
    rows = [r for r in json.loads(path.read_text()) if r["ifname"] != "ovsbr0"]
    path.write_text(json.dumps(rows))
    (root / ".gpuaas-fixture/commands/ip-link.out").unlink()
    ev = read_network_evidence(HostRoot.open(root))
    assert _codes(ev.blockers) == ["ovs_bridge_missing", "dnsmasq_subnet_missing"]


def test_netns_on_a_recording_is_refused():
    with pytest.raises(NetEvidenceError) as exc:
        read_network_evidence(HostRoot.open(fixture_host("h200-slice-after-transition")), NetTarget(netns="x"))
    assert exc.value.code == "netns_on_fixture"


# -- parsers ------------------------------------------------------------------------------------


def test_iptables_save_accepts_an_output_interface_but_not_a_negated_source():
    text = "*nat\n-A POSTROUTING -s 10.100.0.0/24 -o eno8303 -j MASQUERADE\nCOMMIT\n"
    assert masquerade_in_iptables_save(text, SUBNET)
    assert not masquerade_in_iptables_save("*nat\n-A POSTROUTING ! -s 10.100.0.0/24 -j MASQUERADE\n", SUBNET)
    assert not masquerade_in_iptables_save("*nat\n-A POSTROUTING -s 10.100.1.0/24 -j MASQUERADE\n", SUBNET)
    assert not masquerade_in_iptables_save("*nat\n-A POSTROUTING -s 10.100.0.0/24 -j SNAT --to 1.2.3.4\n", SUBNET)
    assert not masquerade_in_iptables_save("*filter\n-A POSTROUTING -s 10.100.0.0/24 -j MASQUERADE\n", SUBNET)


def test_nft_native_masquerade_counts_and_opaque_xt_does_not():
    def ruleset(last):
        return json.dumps({"nftables": [
            {"chain": {"family": "inet", "table": "gpuaas", "name": "post", "hook": "postrouting", "type": "nat"}},
            {"rule": {"family": "inet", "table": "gpuaas", "chain": "post", "handle": 4, "expr": [
                {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                           "right": {"prefix": {"addr": "10.100.0.0", "len": 24}}}}, last]}}]})

    assert masquerade_in_nft(ruleset({"masquerade": None}), SUBNET) == "nft inet gpuaas post handle 4"
    assert masquerade_in_nft(ruleset({"xt": None}), SUBNET) is None


def test_dnsmasq_range_must_start_inside_the_subnet():
    assert dnsmasq_ranges_in("dhcp-range=set:slice,10.100.0.10,10.100.0.250,12h\n", SUBNET)
    assert dnsmasq_ranges_in("dhcp-range=ovsbr0,10.100.0.10,10.100.0.20\n", SUBNET)
    assert not dnsmasq_ranges_in("#dhcp-range=10.100.0.10,10.100.0.250\n", SUBNET)
    assert not dnsmasq_ranges_in("dhcp-range=192.168.1.10,192.168.1.20\n", SUBNET)


# -- the live reader in a real namespace -----------------------------------------------------


def test_live_namespace_with_rule_and_forwarding_has_no_network_blockers(netns):
    ev = read_network_evidence(HostRoot.open("/"), NetTarget(netns=netns))
    assert ev.source == "live" and ev.netns == netns
    assert "ovsbr0" in ev.links and ev.addresses_of("ovsbr0") == ["10.100.0.1/24"]
    assert ev.nat.present is True and ev.nat.method == "iptables -C"
    assert ev.ip_forward is True
    assert {r.dst for r in ev.routes if r.dev == "ovsbr0"} == {"10.100.0.0/24"}
    assert not {"ovs_bridge_missing", "gateway_address_missing", "nat_missing", "ip_forward_disabled"} & set(_codes(ev.blockers))


def test_live_namespace_without_the_rule_or_forwarding_blocks(netns):
    ns_exec(netns, "iptables", "-t", "nat", "-D", *MASQ)
    ev = read_network_evidence(HostRoot.open("/"), NetTarget(netns=netns))
    assert ev.nat.present is False and "nat_missing" in _codes(ev.blockers)
    assert "ip_forward_disabled" not in _codes(ev.blockers)

    set_ip_forward(netns, 0)
    ev = read_network_evidence(HostRoot.open("/"), NetTarget(netns=netns))
    assert {"nat_missing", "ip_forward_disabled"} <= set(_codes(ev.blockers))


def test_live_rule_with_output_interface_is_found_through_iptables_save(netns):
    ns_exec(netns, "iptables", "-t", "nat", "-D", *MASQ)
    ns_exec(netns, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", "10.100.0.0/24", "-o", "ovsbr0", "-j", "MASQUERADE")
    ev = read_network_evidence(HostRoot.open("/"), NetTarget(netns=netns))
    assert ev.nat.present is True and ev.nat.method == "iptables-save"


def test_gateway_on_the_wrong_bridge_blocks(netns):
    run_argv("ip", "-n", netns, "addr", "del", "10.100.0.1/24", "dev", "ovsbr0")
    run_argv("ip", "-n", netns, "addr", "add", "10.100.0.2/24", "dev", "ovsbr0")
    ev = read_network_evidence(HostRoot.open("/"), NetTarget(netns=netns))
    assert "gateway_address_missing" in _codes(ev.blockers)


def test_a_namespace_that_does_not_exist_is_refused_not_created():
    name = f"gpuaas-absent-{uuid.uuid4().hex[:8]}"
    with pytest.raises(NetEvidenceError) as exc:
        read_network_evidence(HostRoot.open("/"), NetTarget(netns=name))
    assert exc.value.code == "netns_missing" and not os.path.exists(f"/run/netns/{name}")


def test_the_live_root_namespace_is_read_without_a_netns():
    """The machine's own network: whatever it holds, links come from netlink and nothing unproven passes."""
    ev = read_network_evidence(HostRoot.open("/"))
    assert ev.source == "live" and ev.netns is None and "lo" in ev.links
    assert "127.0.0.1/8" in ev.addresses_of("lo")
    assert ev.ip_forward is (Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "1")
    if ev.nat.present is None:
        assert "nat_unproven" in _codes(ev.warnings)


# -- dnsmasq: the running process and what it reads ---------------------------------------------



def _dnsmasq_proc(root: Path, pid: int, argv: list[str]) -> None:
    (root / f"proc/{pid}").mkdir(parents=True)
    (root / f"proc/{pid}/comm").write_text("dnsmasq\n")
    (root / f"proc/{pid}/cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_debian_packaged_dnsmasq_reads_conf_dir_with_its_suffix_filters(tmp_path):
    """Debian's unit runs ``dnsmasq -x PID -u dnsmasq -7 /etc/dnsmasq.d,.dpkg-dist,...``; conf files nest."""
    (tmp_path / "etc/dnsmasq.d").mkdir(parents=True)
    (tmp_path / "etc/dnsmasq.conf").write_text("# defaults\n#dhcp-hostsfile=/commented/out\n")
    (tmp_path / "etc/dnsmasq.d/gpuaas-slice-network.conf").write_text(
        'dhcp-range=10.100.0.10,10.100.0.250,12h\nconf-file=/etc/gpuaas/extra.conf  # nested\n')
    (tmp_path / "etc/dnsmasq.d/old.conf.dpkg-old").write_text("dhcp-hostsfile=/var/lib/gpuaas-dnsmasq/hosts\n")
    (tmp_path / "etc/gpuaas").mkdir()
    (tmp_path / "etc/gpuaas/extra.conf").write_text('dhcp-hostsfile="/var/lib/gpuaas-dnsmasq/hosts"\n')
    (tmp_path / "run/dnsmasq").mkdir(parents=True)
    (tmp_path / "run/dnsmasq/dnsmasq.pid").write_text("812\n")
    _dnsmasq_proc(tmp_path, 812, ["/usr/sbin/dnsmasq", "-x", "/run/dnsmasq/dnsmasq.pid", "-u", "dnsmasq",
                                  "-7", "/etc/dnsmasq.d,.dpkg-dist,.dpkg-old,.dpkg-new", "--local-service"])
    root = HostRoot.open(tmp_path)
    ev = read_dnsmasq_evidence(root, "/var/lib/gpuaas-dnsmasq/hosts", "/run/dnsmasq/dnsmasq.pid")
    (proc,) = ev.processes
    assert proc.conf_files == ["/etc/dnsmasq.conf", "/etc/dnsmasq.d/gpuaas-slice-network.conf", "/etc/gpuaas/extra.conf"]
    assert ev.readers == [812] and judge_dnsmasq(ev) is None
    assert ev.via == "pid 812: dhcp-hostsfile=/var/lib/gpuaas-dnsmasq/hosts (/etc/gpuaas/extra.conf)"

    # Only the .dpkg-old file names it: dnsmasq skips that file, so nothing reads the agent's hosts file.
    (tmp_path / "etc/gpuaas/extra.conf").write_text("dhcp-hostsdir=/var/lib/gpuaas/dnsmasq-hosts\n")
    ev = read_dnsmasq_evidence(root, "/var/lib/gpuaas-dnsmasq/hosts", "/run/dnsmasq/dnsmasq.pid")
    finding = judge_dnsmasq(ev)
    assert finding.code == "dnsmasq_not_reading_hosts" and "/var/lib/gpuaas/dnsmasq-hosts" in finding.detail
    # ... while a hosts dir holding it counts (the recorded hosts of seed 004 used one).
    assert judge_dnsmasq(read_dnsmasq_evidence(root, "/var/lib/gpuaas/dnsmasq-hosts/slots")) is None


def test_a_recording_without_a_process_table_proves_no_running_dnsmasq():
    ev = read_dnsmasq_evidence(HostRoot.open(fixture_host("h200-slice-after-transition")), "/var/lib/gpuaas-dnsmasq/hosts")
    assert ev.process_table is False and judge_dnsmasq(ev).code == "dnsmasq_unproven"


def test_a_real_dnsmasq_reading_the_agents_file_passes_and_another_file_fails(dhcp_lab):
    live = HostRoot.open("/")
    dns = dhcp_lab.dnsmasq
    net = read_network_evidence(HostRoot.open(fixture_host("h200-slice-after-transition")))  # a dhcp-range is configured
    ev = read_dnsmasq_evidence(live, dns.hosts_file, dns.pid_file)
    assert dns.proc.pid in ev.readers and ev.pid_file_pid == dns.proc.pid
    check = check_dnsmasq(net, ev)
    assert check.status is ParityStatus.PASS and f"pid {dns.proc.pid}" in check.detail
    assert f"hosts={dns.hosts_file}" in check.evidence

    other = read_dnsmasq_evidence(live, dns.workdir / "elsewhere", dns.pid_file)
    check = check_dnsmasq(net, other)
    assert check.status is ParityStatus.FAIL and check.detail.startswith("dnsmasq_not_reading_hosts")
    assert str(dns.hosts_file) in check.detail  # what the running one reads instead

    dns.stop()
    gone = read_dnsmasq_evidence(live, dns.hosts_file, dns.pid_file)
    assert dns.proc.pid not in [p.pid for p in gone.processes]
    assert judge_dnsmasq(gone).code in ("dnsmasq_not_running", "dnsmasq_not_reading_hosts")
