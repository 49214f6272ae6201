"""topology_drift over the recorded hosts and broken copies of them: findings keyed by stable identity.

The discovery code runs for real over each fixture; only the comparison is under test.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from datetime import datetime
from pathlib import Path

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.drift import DriftKind, DriftReport, DriftSeverity, DriftTrigger
from gpuaas_agent.discovery.drift import nvme_identity, topology_drift
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host

AFTER = "h200-slice-after-transition"
BEFORE = "h200-slice-before-transition"
REBOOT = "h200-slice-after-reboot"
NO_VFS = "h200-slice-no-vfs"
GPU0 = "0000:18:00.0"
SLOT0_DISK = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331"  # nvme3n1 after transition
VANISHED_OR_APPEARED = {k for k in DriftKind if k.value.endswith(("_vanished", "_appeared"))}


def _discover(root: Path):
    return discover(HostRoot.open(root))


def _kinds(findings) -> Counter:
    return Counter(f.kind for f in findings)


def test_same_host_twice_has_no_drift():
    report = _discover(fixture_host(AFTER))
    assert topology_drift(report, report) == []
    assert topology_drift(report, _discover(fixture_host(AFTER))) == []


def test_reboot_renames_disks_but_vanishes_and_adds_nothing():
    before, after = _discover(fixture_host(AFTER)), _discover(fixture_host(REBOOT))
    findings = topology_drift(before, after)
    assert not VANISHED_OR_APPEARED & set(_kinds(findings))
    disk_findings = [f for f in findings if f.kind.value.startswith("nvme_")]
    # Every disk's kernel name moved (the OS disk nvme4n1 -> nvme7n1 too); each is still the same by-id disk.
    assert {f.kind for f in disk_findings} == {DriftKind.nvme_renamed}
    assert all(f.severity == DriftSeverity.info and f.detail["advisory"] for f in disk_findings)
    assert {f.subject for f in disk_findings} == {nvme_identity(d) for d in before.nvme_devices}
    assert all(f.subject.startswith("/dev/disk/by-id/") for f in disk_findings)
    slot0 = next(f for f in disk_findings if f.subject == SLOT0_DISK)
    assert (slot0.expected, slot0.actual) == ("nvme3n1", "nvme5n1")
    # The OS disk's partitions were renamed as well (nvme4n1p3 -> nvme7n1p3): still not "in use changed".
    assert DriftKind.nvme_in_use_changed not in _kinds(findings)
    # The recorded reboot also came up with GPUs and VFs on vfio-pci: that is real drift, reported by PCI address.
    assert _kinds(findings) == Counter({DriftKind.nvme_renamed: 9, DriftKind.gpu_driver_changed: 8,
                                        DriftKind.fabric_vf_driver_changed: 8})
    gpu0 = next(f for f in findings if f.subject == GPU0)
    assert (gpu0.kind, gpu0.expected, gpu0.actual) == (DriftKind.gpu_driver_changed, "nvidia", "vfio-pci")
    vf = next(f for f in findings if f.subject == "0000:19:00.1")
    assert vf.detail == {"netdevs_before": ["ibp25s0v0"], "netdevs_after": []}  # links go with the driver


def test_storage_transition_changes_how_every_slot_disk_is_used():
    after, before = _discover(fixture_host(AFTER)), _discover(fixture_host(BEFORE))
    findings = topology_drift(after, before)  # raw slot disks -> disks with (mounted) /share partitions
    assert set(_kinds(findings)) == {DriftKind.nvme_in_use_changed}
    slot_disks = {nvme_identity(d) for d in after.nvme_devices if not d.os_disk}
    assert {f.subject for f in findings} == slot_disks and len(slot_disks) == 8
    slot0 = next(f for f in findings if f.subject == SLOT0_DISK)
    assert (slot0.expected, slot0.actual) == ("unused", "partitions mounted at /share4; partitions=1")
    assert slot0.detail["slice_eligible_before"] is True and slot0.detail["slice_eligible_after"] is False
    # nvme1n1 kept its partition but /share1 is not mounted: still a change (the disk is no longer raw).
    unmounted = next(f for f in findings if f.detail["kernel_name"] == "nvme1n1")
    assert unmounted.actual == "partitions=1"
    # The reverse direction reports the same disks, with expected and actual swapped.
    back = {f.subject: (f.expected, f.actual) for f in topology_drift(before, after)}
    assert back == {f.subject: (f.actual, f.expected) for f in findings}


def test_vfs_gone_are_fabric_vf_vanished_errors():
    findings = topology_drift(_discover(fixture_host(AFTER)), _discover(fixture_host(NO_VFS)))
    assert _kinds(findings) == Counter({DriftKind.fabric_vf_vanished: 8})
    assert all(f.severity == DriftSeverity.error and f.detail["is_vf"] for f in findings)
    assert "0000:19:00.1" in {f.subject for f in findings}


def test_removed_gpu_is_vanished_by_pci_address(host_copy):
    root = host_copy(AFTER)
    before = _discover(root)
    link = root / "sys/bus/pci/devices" / GPU0
    shutil.rmtree(link.resolve())  # the kernel removes the device directory and its bus link
    link.unlink()
    findings = topology_drift(before, _discover(root))
    gpu = [f for f in findings if f.kind == DriftKind.gpu_vanished]
    assert [(f.subject, f.severity, f.detail["driver"]) for f in gpu] == [(GPU0, DriftSeverity.error, "nvidia")]


def test_unbound_gpu_is_a_driver_change(host_copy):
    root = host_copy(AFTER)
    before = _discover(root)
    (root / "sys/bus/pci/devices" / GPU0 / "driver").unlink()
    (finding,) = topology_drift(before, _discover(root))
    assert (finding.kind, finding.subject, finding.expected, finding.actual) == (
        DriftKind.gpu_driver_changed, GPU0, "nvidia", "unbound")


def test_disk_mounted_behind_the_agents_back_is_in_use_changed(host_copy):
    root = host_copy(AFTER)
    before = _discover(root)
    name = next(d.kernel_name for d in before.nvme_devices if d.by_id == SLOT0_DISK)
    mountinfo = root / "proc/self/mountinfo"
    mountinfo.write_text(mountinfo.read_text() + f"300 1 0:77 / /scratch rw,relatime shared:90 - btrfs /dev/{name} rw\n")
    (finding,) = topology_drift(before, _discover(root))
    assert (finding.kind, finding.subject, finding.expected, finding.actual) == (
        DriftKind.nvme_in_use_changed, SLOT0_DISK, "unused", "mounted at /scratch")
    assert finding.detail["kernel_name"] == name  # advisory, for the operator


def test_disk_whose_by_id_link_is_gone_is_vanished_under_that_link(host_copy):
    """The slot names the disk by its by-id path: if that no longer resolves, the slot's disk is gone."""
    root = host_copy(AFTER)
    before = _discover(root)
    disk = next(d for d in before.nvme_devices if d.by_id == SLOT0_DISK)
    by_id = root / "dev/disk/by-id"
    for link in list(by_id.iterdir()):
        if os.path.basename(os.readlink(link)) == disk.kernel_name:
            link.unlink()
    findings = topology_drift(before, _discover(root))
    assert {(f.kind, f.subject) for f in findings} == {
        (DriftKind.nvme_vanished, SLOT0_DISK),
        (DriftKind.nvme_appeared, f"wwid:{disk.wwid}"),  # the same namespace, now known only by its WWID
    }


def test_link_that_vanished_under_an_unchanged_driver_is_link_vanished(host_copy):
    root = host_copy(AFTER)
    before = _discover(root)
    shutil.rmtree(root / "sys/bus/pci/devices/0000:19:00.0/net/ibp25s0")
    findings = topology_drift(before, _discover(root))
    assert [(f.kind, f.subject, f.detail) for f in findings] == [
        (DriftKind.link_vanished, "ibp25s0", {"pci_address": "0000:19:00.0"})]


def test_findings_travel_in_a_drift_report():
    findings = topology_drift(_discover(fixture_host(AFTER)), _discover(fixture_host(REBOOT)))
    report = DriftReport(node_id="node-1", trigger=DriftTrigger.timer, findings=findings, at=datetime.now(UTC))
    assert DriftReport.model_validate_json(report.model_dump_json()) == report
