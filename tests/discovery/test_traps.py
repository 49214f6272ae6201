"""Discovery on hosts that are messier than the fixture hosts.

Each test breaks a copy of a fixture the way real hosts break (seed 004 and
docs/testing.md) and checks discovery still answers, says what it saw, and never
offers an unsafe disk or a shared fabric function.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuaas_agent.contract.topology import StorageIdentityKind
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import REPO, fixture_host, load_synth_host

AFTER = "h200-slice-after-transition"
GPU0 = "0000:18:00.0"


def _discover(root: Path):
    return discover(HostRoot.open(root))


def _slot_disk_kernel_name(root: Path, slot_index: int) -> str:
    return _discover(root).candidate_slots[slot_index].nvme_kernel_name


def _warning_codes(report) -> set[tuple[str, str | None]]:
    return {(w.code, w.path) for w in report.warnings}


def test_classic_nvme_layout_gives_the_same_disks_and_slots(tmp_path):
    synth = load_synth_host()
    synth.build(tmp_path / "classic", "after-transition", multipath=False)
    classic = _discover(tmp_path / "classic")
    multipath = _discover(fixture_host(AFTER))
    keep = {"by_id", "kernel_name", "pci_address", "numa_node", "size_bytes", "serial", "model", "mounted", "os_disk"}
    assert [d.model_dump(include=keep) for d in classic.nvme_devices] == [
        d.model_dump(include=keep) for d in multipath.nvme_devices
    ]
    assert classic.candidate_slots == multipath.candidate_slots


def test_absolute_links_are_followed_inside_the_fixture(tmp_path):
    synth = load_synth_host()
    synth.build(tmp_path / "absolute", "after-transition", absolute_links=True)
    some_link = tmp_path / "absolute" / "sys/bus/pci/devices" / GPU0
    assert os.readlink(some_link).startswith("/sys/devices/")
    assert _discover(tmp_path / "absolute").model_dump_json() == _discover(fixture_host(AFTER)).model_dump_json()


def test_disk_known_only_by_kernel_name_is_never_a_slot_disk(host_copy):
    root = host_copy(AFTER)
    name = _slot_disk_kernel_name(root, 0)
    by_id = root / "dev/disk/by-id"
    for link in list(by_id.iterdir()):
        if os.path.basename(os.readlink(link)) == name:
            link.unlink()
    report = _discover(root)
    (disk,) = [d for d in report.nvme_devices if d.kernel_name == name]
    assert disk.by_id is None and disk.storage_identity_kind == StorageIdentityKind.kernel_name_only
    assert [r.code for r in disk.ineligible_reasons] == ["no_stable_by_id"]
    slot0 = report.candidate_slots[0]
    assert slot0.nvme_device is None and [b.code for b in slot0.blockers] == ["no_nvme_device"]
    assert report.summary.ready_candidate_slots == 7


def test_btrfs_mount_is_matched_by_source_and_that_disk_only_fills_a_slot_with_a_blocker(host_copy):
    root = host_copy(AFTER)
    name = _slot_disk_kernel_name(root, 3)
    mountinfo = root / "proc/self/mountinfo"
    # btrfs reports an anonymous 0:NN device: only the source names the disk.
    mountinfo.write_text(mountinfo.read_text() + f"300 1 0:77 / /scratch rw,relatime shared:90 - btrfs /dev/{name} rw\n")
    report = _discover(root)
    (disk,) = [d for d in report.nvme_devices if d.kernel_name == name]
    assert disk.mounted and disk.mountpoints == ["/scratch"] and not disk.slice_eligible
    slots = {s.nvme_kernel_name: s for s in report.candidate_slots}
    assert [b.code for b in slots[name].blockers] == ["nvme_mounted"]
    assert report.summary.ready_candidate_slots == 7
    assert report.summary.mounted_nvme_devices == 2


def test_swap_on_a_partition_marks_the_disk(host_copy):
    root = host_copy("h200-slice-before-transition")
    swaps = root / "proc/swaps"
    swaps.write_text(swaps.read_text() + "/dev/nvme1n1p1                          partition\t8388604\t0\t-2\n")
    report = _discover(root)
    (disk,) = [d for d in report.nvme_devices if d.kernel_name == "nvme1n1"]
    assert disk.swap and "swap" in {r.code for r in disk.ineligible_reasons}


def test_numa_node_minus_one_is_a_warning_naming_the_path(host_copy):
    root = host_copy(AFTER)
    (root / f"sys/bus/pci/devices/{GPU0}/numa_node").write_text("-1\n")
    report = _discover(root)
    assert ("numa_node_unknown", f"/sys/bus/pci/devices/{GPU0}/numa_node") in _warning_codes(report)
    slot0 = report.candidate_slots[0]
    assert report.gpus[0].numa_node is None and slot0.numa_node is None
    assert [w.code for w in slot0.warnings] == ["gpu_numa_unknown"]
    assert slot0.nvme_device == _discover(fixture_host(AFTER)).candidate_slots[0].nvme_device  # switch still pairs it


def test_unreadable_and_junk_attributes_are_warnings(host_copy):
    root = host_copy(AFTER)
    nic = root / "sys/bus/pci/devices/0000:19:00.0"
    (nic / "sriov_numvfs").unlink()
    (nic / "sriov_numvfs").mkdir()  # reading it fails like an unreadable attribute
    (root / f"sys/bus/pci/devices/{GPU0}/numa_node").write_text("zero\n")
    report = _discover(root)
    codes = _warning_codes(report)
    assert ("sysfs_unreadable", "/sys/bus/pci/devices/0000:19:00.0/sriov_numvfs") in codes
    assert ("sysfs_not_numeric", f"/sys/bus/pci/devices/{GPU0}/numa_node") in codes
    assert report.summary.gpu_devices == 8


def test_dangling_links_and_loops_are_warnings(host_copy):
    root = host_copy(AFTER)
    devices = root / "sys/bus/pci/devices"
    os.symlink("../../../devices/pci0000:ff/0000:ff:00.0", devices / "0000:ff:00.0")
    os.symlink("0000:fe:00.0", devices / "0000:fe:00.0")
    os.symlink("../../nvme99n1", root / "dev/disk/by-id/nvme-eui.deadbeef")
    report = _discover(root)
    codes = _warning_codes(report)
    assert ("pci_entry_dangling", "/sys/bus/pci/devices/0000:ff:00.0") in codes
    assert ("symlink_loop", "/sys/bus/pci/devices/0000:fe:00.0") in codes
    assert ("by_id_dangling", "/dev/disk/by-id/nvme-eui.deadbeef") in codes
    assert report.summary.ready_candidate_slots == 8


def test_gpu_sharing_its_iommu_group_is_blocked(host_copy):
    root = host_copy(AFTER)
    group = os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{GPU0}/iommu_group"))
    target = os.readlink(root / "sys/bus/pci/devices/0000:1a:00.0")  # the island's NVMe controller
    os.symlink("../../../../bus/pci/devices/0000:1a:00.0", root / f"sys/kernel/iommu_groups/{group}/devices/0000:1a:00.0")
    assert target  # the stranger really exists in the fixture
    slot0 = _discover(root).candidate_slots[0]
    assert "gpu_iommu_group_shared" in {b.code for b in slot0.blockers}
    assert "0000:1a:00.0" in next(b.detail for b in slot0.blockers if b.code == "gpu_iommu_group_shared")


def test_iommu_off_blocks_host_and_every_slot(host_copy):
    root = host_copy(AFTER)
    shutil.rmtree(root / "sys/kernel/iommu_groups")
    for entry in (root / "sys/bus/pci/devices").iterdir():
        link = entry / "iommu_group"
        if os.path.lexists(link):
            link.unlink()
    report = _discover(root)
    assert "iommu_disabled" in {b.code for b in report.blockers}
    assert all("gpu_no_iommu_group" in {b.code for b in s.blockers} for s in report.candidate_slots)


MUTATIONS = ("delete", "junk", "dir", "dangling", "loop")


def _corrupt(root: Path, rng: random.Random, count: int) -> None:
    entries = sorted(p for p in root.rglob("*") if p.is_symlink() or p.is_file())
    for path in rng.sample(entries, count):
        if not os.path.lexists(path):
            continue
        kind = rng.choice(MUTATIONS)
        if path.is_dir() and not path.is_symlink():
            continue
        path.unlink()
        if kind == "junk":
            path.write_bytes(rng.choice([b"", b"\x00\xff junk", b"-1\n", b"0xZZZZ\n", b"9" * 80 + b"\n"]))
        elif kind == "dir":
            path.mkdir()
        elif kind == "dangling":
            os.symlink("../../nowhere/at/all", path)
        elif kind == "loop":
            os.symlink(path.name, path)


@pytest.mark.parametrize("seed", range(12))
def test_randomly_corrupted_host_still_gets_an_answer(host_copy, seed):
    root = host_copy(AFTER if seed % 2 == 0 else "h200-slice-before-transition")
    _corrupt(root, random.Random(seed), count=40)
    report = _discover(root)
    assert report.summary.candidate_slots == report.summary.gpu_devices
    ready = [s for s in report.candidate_slots if not s.blockers]
    disks = {d.by_id: d for d in report.nvme_devices if d.by_id}
    assert all(disks[s.nvme_device].slice_eligible for s in ready)


def test_cli_answers_on_a_corrupted_host_without_traceback(host_copy):
    root = host_copy(AFTER)
    _corrupt(root, random.Random(99), count=80)
    proc = subprocess.run(
        [sys.executable, "-m", "gpuaas_agent", "discover", "--json", "--root", str(root)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_read_only_disk_is_not_offered_as_clean(host_copy):
    root = host_copy(AFTER)
    name = _slot_disk_kernel_name(root, 5)
    ro = HostRoot.open(root).resolve(f"/sys/class/block/{name}/ro")
    (root / ro.lstrip("/")).write_text("1\n")
    report = _discover(root)
    (disk,) = [d for d in report.nvme_devices if d.kernel_name == name]
    assert [r.code for r in disk.ineligible_reasons] == ["read_only"]
    assert "nvme_read_only" in {b.code for b in report.candidate_slots[5].blockers}
