"""Health checks over fixture roots built from a copy of a recorded host (the kernel's own file formats)."""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import datetime
from pathlib import Path

import pytest

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.operator.health import (
    CheckThreads,
    HealthSettings,
    gpu_nvml_check,
    libvirtd_check,
    libvirtd_check_in_process,
    nvme_smart_check,
    pcie_aer_check,
    run_checks,
    slot_disk_check,
    summarise,
    vfio_check,
)

HOST = "h200-slice-after-transition"
GPU = "0000:18:00.0"
AER_CLEAN = "RxErr 0\nBadTLP 0\nBadDLLP 0\nTOTAL_ERR_COR 0\n"


def _aer(root: Path, address: str, *, fatal: int = 0, nonfatal: int = 0, correctable: int = 0) -> None:
    device = (root / "sys/bus/pci/devices" / address).resolve()
    (device / "aer_dev_correctable").write_text(f"RxErr {correctable}\nBadTLP 0\nTOTAL_ERR_COR {correctable}\n")
    (device / "aer_dev_fatal").write_text(f"Undefined 0\nDLP {fatal}\nTOTAL_ERR_FATAL {fatal}\n")
    (device / "aer_dev_nonfatal").write_text(f"Undefined 0\nPoisonTLP {nonfatal}\nTOTAL_ERR_NONFATAL {nonfatal}\n")


def _lease(slot: int = 0, nvme: str = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331") -> SlotLease:
    return SlotLease(allocation_id="0b7c1a9e-0000-4000-8000-000000000001", slot_index=slot, gpu_pci_address=GPU,
                     nvme_device=nvme, disk_identity=f"path:{nvme}", fabric_vf_pci_address="0000:19:00.1",
                     task_id="t-1", taken_at=time.time())


def test_aer_counters_of_a_slot_gpu_fail_or_degrade_the_host(host_copy):
    root = host_copy(HOST)
    settings = HealthSettings(host_root=root)
    assert pcie_aer_check(settings).status == "unavailable"  # the recording exposes no AER counters
    _aer(root, GPU, correctable=7)
    clean = pcie_aer_check(settings)
    assert clean.status == "ok" and "7 correctable" in clean.detail
    _aer(root, GPU, nonfatal=2)
    assert pcie_aer_check(settings).status == "degraded"
    _aer(root, GPU, fatal=1)
    failed = pcie_aer_check(settings)
    assert failed.status == "failed" and f"{GPU} fatal=1" in failed.detail


def test_a_leased_disk_that_vanished_fails_the_host(host_copy):
    root = host_copy(HOST)
    settings = HealthSettings(host_root=root)
    lease = _lease()
    assert slot_disk_check(settings, [lease]).status == "ok"
    link = root / lease.nvme_device.lstrip("/")
    target = (link.parent / link.readlink()).resolve()
    sysfs = root / "sys/class/block" / target.name
    sysfs.unlink()
    link.unlink()
    missing = slot_disk_check(settings, [lease])
    assert missing.status == "failed" and "slot 0" in missing.detail


def test_an_active_slot_gpu_not_on_vfio_degrades_the_host(host_copy):
    settings = HealthSettings(host_root=host_copy(HOST))
    record = SlotRecord(slot_index=0, allocation_id=_lease().allocation_id, status=SlotStatus.active,
                        health_state=HealthState.healthy, task_id="t-1", updated_at=time.time())
    check = vfio_check(settings, [_lease()], [record])
    assert check.status == "degraded" and f"gpu {GPU} on nvidia" in check.detail
    assert vfio_check(settings, [_lease()], []).status == "ok"  # leased but not active: nothing bound yet


def test_without_the_driver_or_on_a_recording_gpu_and_nvme_health_are_unavailable(host_copy):
    settings = HealthSettings(host_root=host_copy(HOST))
    assert gpu_nvml_check(settings).status == "unavailable"
    assert asyncio.run(nvme_smart_check(settings)).status == "unavailable"
    live = gpu_nvml_check(HealthSettings(host_root=Path("/")))  # this machine has no NVIDIA driver
    assert live.status == "unavailable" and "nvmlInit failed" in live.detail


def test_recorded_host_network_is_ok_and_the_nat_missing_recording_is_degraded(host_copy):
    healthy = asyncio.run(run_checks(HealthSettings(host_root=host_copy(HOST), libvirt_uri="test:///default"), [], [],
                                      threads=CheckThreads()))
    by_name = {c.name: c for c in healthy}
    assert {by_name[n].status for n in ("slice_gateway", "slice_nat", "slice_ip_forward", "libvirtd")} == {"ok"}
    assert summarise(healthy)[0] == "healthy"
    broken = asyncio.run(run_checks(HealthSettings(host_root=host_copy("h200-slice-nat-missing"),
                                                   libvirt_uri="test:///default"), [], [], threads=CheckThreads()))
    state, reason = summarise(broken)
    assert state == "degraded" and reason.startswith("slice_nat: nat_missing")


def test_summary_is_the_worst_verdict_and_unavailable_never_degrades():
    now = datetime.now(UTC)
    checks = [HealthCheck(name="a", status="unavailable", detail="no nvme-cli", checked_at=now),
              HealthCheck(name="b", status="ok", detail="fine", checked_at=now)]
    assert summarise(checks) == ("healthy", None)
    checks.append(HealthCheck(name="c", status="failed", detail="fatal AER", checked_at=now))
    assert summarise(checks) == ("failed", "c: fatal AER")


def test_port_isolation_is_degraded_by_a_missing_or_altered_flow_and_ok_without_isolation_findings():
    from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
    from gpuaas_agent.operator.health import isolation_check

    missing = DriftFinding(kind=DriftKind.flows_missing, subject="2f6a1c0e-0000-4000-8000-000000000001",
                           severity=DriftSeverity.error, actual="0 of 7 rules")
    other = DriftFinding(kind=DriftKind.reservation_orphan, subject="2f6a1c0e-0000-4000-8000-000000000002",
                         severity=DriftSeverity.warn)
    degraded = isolation_check([missing, other])
    assert (degraded.name, degraded.status) == ("port_isolation", "degraded")
    assert "flows_missing 2f6a1c0e-0000-4000-8000-000000000001 (0 of 7 rules)" in degraded.detail
    assert "reservation_orphan" not in degraded.detail  # only isolation findings count here
    assert isolation_check([other]).status == "ok"



def test_a_fabric_vf_that_drifted_degrades_isolation_so_the_watch_repairs_it():
    """The netlink wake-up of the slice-network watch reads the VFs too: a drifted VF opens port_isolation, whose
    newly failing verdict runs the repairing reconcile (operator/netwatch.py)."""
    from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
    from gpuaas_agent.operator.health import isolation_check

    drift = DriftFinding(kind=DriftKind.fabric_vf_drift, subject="0000:19:00.1", severity=DriftSeverity.error,
                         actual="vlan=200")
    degraded = isolation_check([drift])
    assert degraded.status == "degraded" and "fabric_vf_drift 0000:19:00.1 (vlan=200)" in degraded.detail


def test_a_live_host_without_nvme_cli_or_nvme_controllers_has_smart_unavailable_saying_which(monkeypatch, tmp_path):
    live = HealthSettings(host_root=Path("/"))
    if Path("/sys/class/nvme").is_dir() and any(Path("/sys/class/nvme").iterdir()):
        raise AssertionError("this test expects a machine without NVMe controllers (the CI machines have none)")
    assert asyncio.run(nvme_smart_check(live)).detail == "no NVMe controllers"
    monkeypatch.setenv("PATH", str(tmp_path))  # nvme-cli is nowhere on PATH
    without_cli = asyncio.run(nvme_smart_check(live))
    assert without_cli.status == "unavailable" and without_cli.detail == "nvme-cli is not installed"


def test_the_libvirtd_check_through_virsh_reports_what_the_binding_reports(tmp_path, monkeypatch):
    """The check runs a ``virsh -r`` child (an idle host loads no libvirt-python for it): its verdict and detail are
    the in-process check's, for a libvirt that answers and for a socket that is not there; without virsh on the
    PATH it is the in-process check."""
    for uri in ("test:///default", "qemu+unix:///system?socket=/nonexistent/libvirt-sock"):
        settings = HealthSettings(host_root=tmp_path, libvirt_uri=uri)
        child, binding = asyncio.run(libvirtd_check(settings, threads=CheckThreads())), libvirtd_check_in_process(settings)
        assert (child.name, child.status, child.detail) == (binding.name, binding.status, binding.detail), uri
    assert binding.status == "degraded" and "/nonexistent/libvirt-sock" in binding.detail
    monkeypatch.setenv("PATH", str(tmp_path))  # no virsh: the binding answers
    fallback = asyncio.run(libvirtd_check(HealthSettings(host_root=tmp_path, libvirt_uri="test:///default"),
                                          threads=CheckThreads()))
    assert fallback.status == "ok" and "answers (libvirt " in fallback.detail


def _processes_naming(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline:
                found.append(proc.name)
    return found


def test_a_round_stopped_while_virsh_waits_leaves_no_virsh_behind(tmp_path):
    """The daemon stopping mid-round cancels the libvirtd check: its ``virsh`` child (here a real virsh waiting on a
    libvirt socket that accepts and never answers) is killed, never left running after the agent (a deploy test
    found one in the stopped unit's cgroup when the check ran in an abandoned thread)."""
    sock_path = tmp_path / "silent-libvirt-sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_path))
    listener.listen(8)
    settings = HealthSettings(host_root=tmp_path, libvirt_uri=f"qemu+unix:///system?socket={sock_path}")

    async def stop_mid_check() -> list[str]:
        check = asyncio.create_task(libvirtd_check(settings, threads=CheckThreads()))
        deadline = time.monotonic() + 10
        while not _processes_naming(str(sock_path)):
            assert time.monotonic() < deadline and not check.done(), "virsh never started or did not wait"
            await asyncio.sleep(0.02)
        check.cancel()
        with pytest.raises(asyncio.CancelledError):
            await check
        return _processes_naming(str(sock_path))

    try:
        assert asyncio.run(stop_mid_check()) == []
    finally:
        listener.close()
