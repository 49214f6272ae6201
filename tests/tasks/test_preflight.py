"""Parity checks: the seed's line format, fixtures, a real namespace and a real ovsdb-server; the task handlers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import pytest

from gpuaas_agent.contract.parity import (
    ParityCheck,
    ParityReport,
    ParityStatus,
    parse_line,
)
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.tasks import PreflightPayload, TopologyDiscoverPayload
from gpuaas_agent.discovery.netevidence import NetTarget
from gpuaas_agent.discovery.prereqs import SocketPaths, check_libvirt, check_openvswitch
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.tasks.preflight import build_parity_report, preflight_handler
from gpuaas_agent.tasks.topology import topology_discover_handler
from tests.conftest import fixture_host
from tests.support.slice_netns import (
    MASQ,
    ns_exec,
    set_ip_forward,
    slice_namespace,
)
from tests.support.tiers import starts

AFTER = fixture_host("h200-slice-after-transition")
NAT_MISSING = fixture_host("h200-slice-nat-missing")
EXPECTED_CHECKS = [
    "node_agent", "kvm", "iommu", "vfio", "sriov_vfs", "slot_candidates", "gpu_driver", "gpu_host_services",
    "sysfs_writable", "nvswitch_partition", "ovmf",
    "hugepages", "rdma_devices", "fabric_isolation", "libvirt", "qemu_access", "openvswitch",
    "ovs_bridge", "dnsmasq", "nat", "ip_forward", "ipoib_netplan", "ipoib_address", "fabric_route", "tmfifo",
    "historical_network_service", "reboot_required",
]
NETWORK_HARD = ("ovs_bridge", "nat", "ip_forward")


def _by_name(report: ParityReport) -> dict[str, ParityCheck]:
    return {c.check: c for c in report.checks}


# -- the seed's line format ------------------------------------------------------------------


def test_lines_are_the_seeds_own_examples():
    ok = ParityCheck(status=ParityStatus.PASS, check="node_agent", detail="active/running", hard=True)
    assert ok.as_line() == "GPUAAS_SLICE_PARITY status=PASS check=node_agent detail=active/running"
    bad = ParityCheck(status=ParityStatus.FAIL, check="ipoib_netplan", detail="command exited with 1",
                      remediation="render /etc/netplan/60-ipoib.yaml from site/profile bootstrap", hard=True)
    assert bad.as_line() == (
        "GPUAAS_SLICE_PARITY status=FAIL check=ipoib_netplan detail=command\\ exited\\ with\\ 1 "
        "remediation=render\\ /etc/netplan/60-ipoib.yaml\\ from\\ site/profile\\ bootstrap")


def test_escaping_round_trips_shell_specials_and_flattens_newlines():
    detail = "a b\\c;$(rm -rf /)'\"\nnext"
    line = ParityCheck(status=ParityStatus.WARN, check="x", detail=detail, hard=False).as_line()
    assert "\n" not in line
    assert parse_line(line)["detail"] == "a b\\c;$(rm -rf /)'\" next"
    assert parse_line(ParityCheck(status=ParityStatus.PASS, check="x", detail="", hard=True).as_line())["detail"] == ""


def test_a_soft_check_cannot_fail():
    with pytest.raises(ValueError):
        ParityCheck(status=ParityStatus.FAIL, check="tmfifo", detail="absent", hard=False)


# -- fixtures ---------------------------------------------------------------------------------


def test_healthy_fixture_has_every_check_in_order_and_no_failures():
    report = build_parity_report(HostRoot.open(AFTER), NetTarget(), SocketPaths())
    assert [c.check for c in report.checks] == EXPECTED_CHECKS
    checks = _by_name(report)
    assert report.failures == 0 and report.lines[-1].endswith("failures=0")
    for name in ("kvm", "iommu", "vfio", "sriov_vfs", "slot_candidates", "ovmf", "hugepages", *NETWORK_HARD,
                 "ipoib_netplan", "fabric_route"):
        assert checks[name].status is ParityStatus.PASS, checks[name]
    # Sockets and processes cannot be proven from a recording: WARN, never PASS (docs/safety.md §7). A dhcp-range in
    # the config does not prove a running dnsmasq reads the agent's reservations.
    for name in ("node_agent", "libvirt", "openvswitch", "dnsmasq", "gpu_host_services", "qemu_access"):
        assert checks[name].status is ParityStatus.WARN and checks[name].hard, checks[name]
    # The recorded config says which hosts file dnsmasq reads: not the agent's default, and the line names it.
    assert checks["dnsmasq"].detail.startswith("dnsmasq_config_reads_other_hosts")
    assert "/var/lib/gpuaas/dnsmasq-hosts" in checks["dnsmasq"].detail
    # The recording's GPUs are still on nvidia: provision rebinds them, so a warning with the evidence.
    assert checks["gpu_driver"].status is ParityStatus.WARN and "0000:18:00.0=nvidia" in checks["gpu_driver"].evidence
    service = checks["historical_network_service"]
    assert service.status is ParityStatus.WARN and "gpuaas-slice-host-net-baseline" in service.detail


def test_nat_missing_fixture_fails_on_nat_only():
    report = build_parity_report(HostRoot.open(NAT_MISSING), NetTarget(), SocketPaths())
    failed = [c for c in report.checks if c.status is ParityStatus.FAIL]
    assert [c.check for c in failed] == ["nat"] and failed[0].hard
    assert "iptables -t nat -A POSTROUTING -s 10.100.0.0/24 -j MASQUERADE" in failed[0].remediation
    assert report.status is ParityStatus.FAIL and report.lines[-1].endswith("failures=1")


def test_historical_service_names_are_both_only_warn(host_copy):
    root = host_copy("h200-slice-after-transition")
    os.rename(root / "etc/systemd/system/gpuaas-slice-host-net-baseline.service",
              root / "etc/systemd/system/gpuaas-slice-network-baseline.service")
    check = _by_name(build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths()))["historical_network_service"]
    assert check.status is ParityStatus.WARN and "gpuaas-slice-network-baseline.service" in check.detail


def test_missing_prerequisites_fail_hard(host_copy):
    root = host_copy("h200-slice-no-vfs")
    os.remove(root / "dev/kvm")
    os.remove(root / "etc/netplan/60-ipoib.yaml")
    (root / "run").mkdir(exist_ok=True)
    (root / "run/reboot-required").write_text("*** System restart required ***\n")
    report = build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths())
    checks = _by_name(report)
    assert {c.check for c in report.checks if c.status is ParityStatus.FAIL} == {
        "kvm", "sriov_vfs", "ipoib_netplan", "slot_candidates"}
    assert "sriov_numvfs" in checks["slot_candidates"].remediation
    assert checks["reboot_required"].status is ParityStatus.WARN


# -- live: a real namespace and a real ovsdb-server --------------------------------------------


@pytest.fixture
@starts("ovs")
def ovsdb(tmp_path):
    """ovsdb-server in the foreground on a private socket; stopped by PID."""
    db, sock = tmp_path / "conf.db", tmp_path / "db.sock"
    subprocess.run(["ovsdb-tool", "create", str(db), "/usr/share/openvswitch/vswitch.ovsschema"], check=True, timeout=30)
    proc = subprocess.Popen(["ovsdb-server", str(db), f"--remote=punix:{sock}", f"--unixctl={tmp_path / 'ctl'}",
                             "--no-chdir", f"--log-file={tmp_path / 'ovsdb.log'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert proc.poll() is None, "ovsdb-server exited"
            assert time.monotonic() < deadline, "ovsdb-server socket never appeared"
            time.sleep(0.05)  # polling the socket's appearance, with a deadline
        yield str(sock)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_live_namespace_passes_network_checks_and_fails_hard_without_nat_or_forwarding(ovsdb, tmp_path):
    sockets = SocketPaths(libvirt=(str(tmp_path / "no-libvirt-sock"),), ovsdb=ovsdb)
    live = HostRoot.open("/")
    with slice_namespace() as netns:
        checks = _by_name(build_parity_report(live, NetTarget(netns=netns), sockets))
        for name in NETWORK_HARD:
            assert checks[name].status is ParityStatus.PASS, checks[name]
        assert checks["nat"].detail.startswith("iptables -C")
        assert checks["openvswitch"].status is ParityStatus.PASS and "Open_vSwitch" in checks["openvswitch"].detail
        assert checks["libvirt"].status is ParityStatus.FAIL and "no-libvirt-sock" in checks["libvirt"].detail

        ns_exec(netns, "iptables", "-t", "nat", "-D", *MASQ)
        set_ip_forward(netns, 0)
        report = build_parity_report(live, NetTarget(netns=netns), sockets)
        checks = _by_name(report)
        assert checks["nat"].status is ParityStatus.FAIL and checks["nat"].hard
        assert "no MASQUERADE rule for 10.100.0.0/24" in checks["nat"].detail
        assert checks["ip_forward"].status is ParityStatus.FAIL and checks["ip_forward"].detail == "net.ipv4.ip_forward=0"
        assert checks["ovs_bridge"].status is ParityStatus.PASS
        assert report.failures >= 2


def test_stopped_ovsdb_fails_the_check(tmp_path):
    check = check_openvswitch(HostRoot.open("/"), SocketPaths(ovsdb=str(tmp_path / "db.sock")))
    assert check.status is ParityStatus.FAIL and "db.sock" in check.detail
    assert check_libvirt(HostRoot.open(AFTER), SocketPaths()).status is ParityStatus.WARN


# -- the task handlers ---------------------------------------------------------------------------


class _Ctx:
    """The part of the worker's TaskContext a handler uses: progress events."""

    def __init__(self, store=None) -> None:
        self.events: list[tuple[str, str]] = []
        self.store = store  # a real StateStore where the handler reads it (topology: the quarantined components)

    async def progress(self, step: str, status: str, **_: object) -> None:
        self.events.append((step, status))


def test_preflight_handler_returns_the_checks_lines_and_counts():
    ctx = _Ctx()
    output = asyncio.run(preflight_handler(NAT_MISSING, sockets=SocketPaths())(PreflightPayload(), ctx))
    assert output["failures"] == 1 and output["status"] == "FAIL" and output["mode"] == "private-nat"
    by_name = {c["check"]: c for c in output["checks"]}
    assert by_name["node_agent"]["status"] == "PASS"  # answering the task is the proof
    assert by_name["nat"]["status"] == "FAIL" and by_name["nat"]["hard"] is True
    assert output["lines"][-1].startswith("GPUAAS_SLICE_PARITY_SUMMARY") and output["lines"][-1].endswith("failures=1")
    assert ctx.events == [("preflight", "started"), ("preflight", "succeeded")]
    assert ParityReport.model_validate(output).failures == 1  # the output is the wire model, nothing beside it


def test_a_report_whose_counts_disagree_with_its_checks_is_refused():
    body = build_parity_report(HostRoot.open(NAT_MISSING), NetTarget(), SocketPaths()).model_dump(mode="json")
    with pytest.raises(ValueError):
        ParityReport.model_validate({**body, "failures": 0})


def test_topology_discover_adds_slice_network_beside_the_unchanged_report(tmp_path):
    from gpuaas_agent.discovery.report import discover
    from gpuaas_agent.state.store import StateStore

    store = StateStore.open(tmp_path / "state.db")
    output = asyncio.run(topology_discover_handler(NAT_MISSING)(TopologyDiscoverPayload(), _Ctx(store)))
    network = output.pop("slice_network")
    assert output == discover(HostRoot.open(NAT_MISSING)).model_dump(mode="json")
    assert [b["code"] for b in network["blockers"]] == ["nat_missing"]
    assert network["ovs_bridge"] == "ovsbr0" and network["nat"]["present"] is False


# -- what parity must not PASS (seed 004 parity target, docs/safety.md §7) ----------------------------


def test_every_line_of_the_agents_checks_carries_its_evidence():
    report = build_parity_report(HostRoot.open(AFTER), NetTarget(), SocketPaths())
    assert all(c.evidence for c in report.checks), [c.check for c in report.checks if not c.evidence]
    line = _by_name(report)["hugepages"].as_line()
    assert line.startswith("GPUAAS_SLICE_PARITY status=PASS check=hugepages detail=")
    assert parse_line(line)["evidence"].endswith("node0=256/256 node1=256/256")


def test_a_host_before_the_storage_transition_fails_with_the_transition_remediation():
    checks = _by_name(build_parity_report(HostRoot.open(fixture_host("h200-slice-before-transition")), NetTarget(), SocketPaths()))
    slots = checks["slot_candidates"]
    assert slots.status is ParityStatus.FAIL and slots.hard
    assert slots.detail.startswith("candidate_slots=8 ready_candidate_slots=0")
    assert "unmount /share*" in slots.remediation and "wipefs" in slots.remediation
    assert "nvme_mounted_child" in slots.evidence and "nvme_not_rawx8" in slots.evidence


def test_a_host_without_slot_devices_fails():
    checks = _by_name(build_parity_report(HostRoot.open(fixture_host("dev-box-no-gpu")), NetTarget(), SocketPaths()))
    assert checks["slot_candidates"].status is ParityStatus.FAIL
    assert "candidate_slots=0" in checks["slot_candidates"].detail and "no NVIDIA GPU" in checks["slot_candidates"].remediation


def test_hugepages_the_profile_needs_are_a_hard_failure(host_copy):
    root = host_copy("h200-slice-after-transition")
    (root / "sys/devices/system/node/node1/hugepages/hugepages-1048576kB/free_hugepages").write_text("8\n")
    hp = _by_name(build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths()))["hugepages"]
    assert hp.status is ParityStatus.FAIL and hp.hard
    assert "h200_1g_24c_64g needs 64 on node1, free=8" in hp.detail and "node1=8/256" in hp.evidence
    # A node that backs one slot but not all of its four only warns; a profile without hugepages passes.
    (root / "sys/devices/system/node/node1/hugepages/hugepages-1048576kB/free_hugepages").write_text("128\n")
    assert _by_name(build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths()))["hugepages"].status is ParityStatus.WARN
    lab = build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths(), profiles=[get_profile("lab_tcg_1c_512m")])
    assert _by_name(lab)["hugepages"].status is ParityStatus.PASS


def _recorded_process(root, pid: int, comm: str, argv: list[str]) -> None:
    """A process table entry in a copied recording (real files, as /proc shows them)."""
    (root / f"proc/{pid}").mkdir(parents=True)
    (root / f"proc/{pid}/comm").write_text(comm + "\n")
    (root / f"proc/{pid}/cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_gpu_host_services_holding_nvidia_gpus_fail_and_enabled_units_warn(host_copy):
    root = host_copy("h200-slice-after-transition")
    _recorded_process(root, 1, "systemd", ["/sbin/init"])
    services = _by_name(build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths()))["gpu_host_services"]
    assert services.status is ParityStatus.PASS and "none running" in services.evidence
    _recorded_process(root, 2417, "nvidia-persiste", ["/usr/bin/nvidia-persistenced", "--user", "nvidia-persistenced"])
    _recorded_process(root, 2418, "nv-fabricmanage", ["/usr/bin/nv-fabricmanager", "-c", "/usr/share/nvidia/nvswitch/fabricmanager.cfg"])
    services = _by_name(build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths()))["gpu_host_services"]
    assert services.status is ParityStatus.FAIL and services.hard
    assert "nvidia-persistenced(pid 2417)" in services.detail and "nvidia-fabricmanager(pid 2418)" in services.detail
    assert "disable --now" in services.remediation and "0000:18:00.0" in services.evidence

    # Enabled at boot but not running, on a recording without a process table: a warning naming the unit.
    root2 = host_copy("h200-slice-nat-missing")
    wants = root2 / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True)
    (wants / "nvidia-persistenced.service").symlink_to("/usr/lib/systemd/system/nvidia-persistenced.service")
    services = _by_name(build_parity_report(HostRoot.open(root2), NetTarget(), SocketPaths()))["gpu_host_services"]
    assert services.status is ParityStatus.WARN and "nvidia-persistenced.service" in services.detail


def test_libvirt_dirs_that_block_qemu_fail(host_copy):
    root = host_copy("h200-slice-after-transition")
    root.chmod(0o755)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\nlibvirt-qemu:x:64055:109::/var/lib/libvirt:/bin/false\n")
    seeds = root / "var/lib/libvirt/images/gpuaas-seeds"
    seeds.mkdir(parents=True)
    for d in (root / "var", root / "var/lib", root / "var/lib/libvirt/images", seeds):
        d.chmod(0o755)
    (root / "var/lib/libvirt").chmod(0o700)  # seed 004, j22u05
    access = _by_name(build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths()))["qemu_access"]
    assert access.status is ParityStatus.FAIL and "cannot traverse /var/lib/libvirt " in access.detail
    assert "/var/lib/libvirt:0o700:0:0:BLOCKED" in access.evidence and "libvirt-qemu" in access.evidence
    (root / "var/lib/libvirt").chmod(0o755)
    access = _by_name(build_parity_report(HostRoot.open(root), NetTarget(), SocketPaths()))["qemu_access"]
    assert access.status is ParityStatus.PASS, access
