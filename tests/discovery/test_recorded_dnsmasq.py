"""Parity's dnsmasq line on a recording: the recorded config says which hosts file dnsmasq reads.

A recording has no process table, so the running dnsmasq is never proven there; but a config
that reads another file, none, or only a commented-out one must read differently from the
correctly wired host. Variants of the recorded config of h200-slice-after-transition, each in
a root of its own (no /proc: a recording).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuaas_agent.contract.parity import ParityStatus
from gpuaas_agent.discovery.netevidence import (
    judge_dnsmasq,
    judge_recorded_dnsmasq,
    read_dnsmasq_evidence,
    read_network_evidence,
)
from gpuaas_agent.discovery.prereqs import check_dnsmasq
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host

FIXTURE = fixture_host("h200-slice-after-transition")
RECORDED = (FIXTURE / "etc/dnsmasq.d/gpuaas-slice.conf").read_text()
RECORDED_DIR = "/var/lib/gpuaas/dnsmasq-hosts"
AGENT_FILE = "/var/lib/gpuaas-dnsmasq/hosts"  # SliceConfig's default dnsmasq_hosts_file
HOSTSDIR_LINE = f"dhcp-hostsdir={RECORDED_DIR}"


def _root(tmp_path: Path, files: dict[str, str]) -> HostRoot:
    for rel, text in files.items():
        path = tmp_path / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return HostRoot.open(tmp_path)


def _line(tmp_path: Path, files: dict[str, str], hosts_file: str):
    net = read_network_evidence(HostRoot.open(FIXTURE))  # the recorded bridge, NAT and dhcp-range
    ev = read_dnsmasq_evidence(_root(tmp_path, files), hosts_file)
    assert ev.process_table is False and judge_dnsmasq(ev).code == "dnsmasq_unproven"  # no process is ever proven
    return ev, check_dnsmasq(net, ev)


def test_the_recorded_host_wired_to_the_agents_file_warns_unproven_naming_how_it_reads_it(tmp_path):
    ev, check = _line(tmp_path, {"/etc/dnsmasq.d/gpuaas-slice.conf": RECORDED}, f"{RECORDED_DIR}/slots")
    assert check.status is ParityStatus.WARN and check.detail.startswith("not provable from a recording")
    assert f"the recorded config reads {RECORDED_DIR}/slots ({HOSTSDIR_LINE} (/etc/dnsmasq.d/gpuaas-slice.conf))" \
        in check.detail
    assert ev.recorded_via and judge_recorded_dnsmasq(ev).code == "dnsmasq_unproven"


def test_the_recorded_config_reading_another_file_warns_naming_that_file(tmp_path):
    """The recorded fixture against the agent's default file: seed 004's miswiring, said by name."""
    ev, check = _line(tmp_path, {"/etc/dnsmasq.d/gpuaas-slice.conf": RECORDED}, AGENT_FILE)
    assert check.status is ParityStatus.WARN
    assert check.detail.startswith("dnsmasq_config_reads_other_hosts:")
    assert RECORDED_DIR in check.detail and f"not the agent's {AGENT_FILE}" in check.detail
    assert "recorded config reads /var/lib/gpuaas/dnsmasq-hosts" in check.evidence


def test_a_recorded_config_with_no_hosts_option_fails(tmp_path):
    text = RECORDED.replace(HOSTSDIR_LINE + "\n", "")
    _, check = _line(tmp_path, {"/etc/dnsmasq.d/gpuaas-slice.conf": text}, AGENT_FILE)
    assert check.status is ParityStatus.FAIL and check.detail.startswith("dnsmasq_config_reads_no_hosts:")
    assert "/etc/dnsmasq.d/gpuaas-slice.conf" in check.detail and "commented out" not in check.detail


def test_a_commented_hosts_option_fails_and_is_named_with_its_line(tmp_path):
    text = RECORDED.replace(HOSTSDIR_LINE, f"# {HOSTSDIR_LINE.replace(RECORDED_DIR, '/var/lib/gpuaas-dnsmasq')}")
    _, check = _line(tmp_path, {"/etc/dnsmasq.d/gpuaas-slice.conf": text}, AGENT_FILE)
    assert check.status is ParityStatus.FAIL and check.detail.startswith("dnsmasq_config_reads_no_hosts:")
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.startswith("# dhcp-hostsdir"))
    assert f"commented out: /etc/dnsmasq.d/gpuaas-slice.conf:{line}: # dhcp-hostsdir=/var/lib/gpuaas-dnsmasq" \
        in check.detail


@pytest.mark.parametrize("files", [
    # the agent's file named in dnsmasq.conf, the conf-dir file without a hosts option
    {"/etc/dnsmasq.conf": f"dhcp-hostsfile={AGENT_FILE}\n",
     "/etc/dnsmasq.d/gpuaas-slice.conf": RECORDED.replace(HOSTSDIR_LINE + "\n", "")},
    # a directory holding the agent's file, named from a file dnsmasq.conf includes
    {"/etc/dnsmasq.conf": "conf-file=/etc/gpuaas/extra.conf\n",
     "/etc/gpuaas/extra.conf": "dhcp-hostsdir=/var/lib/gpuaas-dnsmasq/\n",
     "/etc/dnsmasq.d/gpuaas-slice.conf": RECORDED.replace(HOSTSDIR_LINE + "\n", "")},
])
def test_other_correct_wirings_read_as_the_correct_one(tmp_path, files):
    _, check = _line(tmp_path, files, AGENT_FILE)
    assert check.status is ParityStatus.WARN and check.detail.startswith("not provable from a recording")
    assert f"the recorded config reads {AGENT_FILE}" in check.detail


def test_a_hosts_option_only_in_a_dpkg_leftover_is_not_read(tmp_path):
    """dnsmasq's service skips .dpkg-old files in /etc/dnsmasq.d: naming the agent's file there wires nothing."""
    files = {"/etc/dnsmasq.d/gpuaas-slice.conf": RECORDED.replace(HOSTSDIR_LINE + "\n", ""),
             "/etc/dnsmasq.d/gpuaas-slice.conf.dpkg-old": f"dhcp-hostsfile={AGENT_FILE}\n"}
    _, check = _line(tmp_path, files, AGENT_FILE)
    assert check.status is ParityStatus.FAIL and check.detail.startswith("dnsmasq_config_reads_no_hosts:")


def test_the_three_readings_differ(tmp_path):
    details = set()
    for i, (text, hosts_file) in enumerate([(RECORDED, f"{RECORDED_DIR}/slots"), (RECORDED, AGENT_FILE),
                                            (RECORDED.replace(HOSTSDIR_LINE, "#" + HOSTSDIR_LINE), AGENT_FILE)]):
        _, check = _line(tmp_path / str(i), {"/etc/dnsmasq.d/gpuaas-slice.conf": text}, hosts_file)
        details.add((check.status, check.detail.split(":")[0]))
    assert len(details) == 3
