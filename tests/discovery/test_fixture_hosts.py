"""Full discovery results of every fixture host (recorded or generated, see lab/fixture_hosts.py).

Each fixture is compared with its golden report (``tests/golden/discovery``),
and the facts that matter to the control plane are asserted explicitly so a
golden file re-blessed by mistake still cannot hide a regression.
Regenerate goldens with ``UPDATE_GOLDEN=1 pytest tests/discovery``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuaas_agent.contract.topology import Locality, TopologyReport
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import ALL_FIXTURES, fixture_host

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "discovery"

# Seed 004, "Final topology discovery result after the by-id patch": slot -> disk.
SEED_SLOT_DISKS = [
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331",
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10dcab",
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103489",
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10dc41",
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10dc98",
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10e101",
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10e115",
    "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103483",
]
NVSWITCHES = ["0000:ca:00.0", "0000:cb:00.0", "0000:cc:00.0", "0000:cd:00.0"]
BMC_VGA = "0000:03:00.0"
BF3_DMA = "0000:e8:00.2"


def _report(name: str) -> TopologyReport:
    return discover(HostRoot.open(fixture_host(name)))


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_report_matches_golden(name):
    text = _report(name).model_dump_json(indent=2) + "\n"
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_same_input_gives_byte_identical_json(name):
    assert _report(name).model_dump_json() == _report(name).model_dump_json()


def test_after_transition_is_the_seed_final_result():
    report = _report("h200-slice-after-transition")
    assert report.summary.as_line() == (
        "gpu_devices=8 fabric_devices=18 nvme_devices=9 mounted_nvme_devices=1 candidate_slots=8 ready_candidate_slots=8"
    )
    assert [s.nvme_device for s in report.candidate_slots] == SEED_SLOT_DISKS
    assert all(not s.blockers for s in report.candidate_slots)
    assert report.blockers == [] and report.warnings == []


def test_after_transition_pairs_each_gpu_within_its_pcie_switch():
    report = _report("h200-slice-after-transition")
    disks = {d.by_id: d for d in report.nvme_devices}
    fabric = {f.pci_address: f for f in report.fabric_devices}
    gpus = {g.pci_address: g for g in report.gpus}
    for slot in report.candidate_slots:
        gpu_switch = set(gpus[slot.gpu_pci_address].pci_path)
        assert slot.nvme_locality == Locality.same_switch
        assert slot.fabric_locality == Locality.same_switch
        assert gpu_switch & set(disks[slot.nvme_device].pci_path)
        assert gpu_switch & set(fabric[slot.fabric_vf_pci_address].pci_path)
        assert fabric[slot.fabric_vf_pci_address].is_vf
        assert slot.fabric_pf_pci_address == fabric[slot.fabric_vf_pci_address].physfn
        assert slot.numa_node == gpus[slot.gpu_pci_address].numa_node


def test_slot_resources_are_never_shared_and_suggestions_are_valid():
    report = _report("h200-slice-after-transition")
    slots = report.candidate_slots
    for field in ("nvme_device", "fabric_vf_pci_address", "mac", "private_ip"):
        values = [getattr(s, field) for s in slots]
        assert len(set(values)) == len(values), field
    for slot in slots:
        assert int(slot.mac.split(":")[0], 16) & 0b11 == 0b10  # locally administered unicast
        assert slot.private_ip.startswith("10.100.0.") and slot.private_ip not in ("10.100.0.0", "10.100.0.1", "10.100.0.255")
        assert slot.ovs_bridge == "ovsbr0" and slot.fabric_claim_mode.value == "per_slot_vf"


def test_os_disk_is_found_through_lvm_and_never_offered():
    report = _report("h200-slice-after-transition")
    (os_disk,) = [d for d in report.nvme_devices if d.os_disk]
    assert os_disk.model == "Dell BOSS-N1" and os_disk.kernel_name == "nvme4n1"
    assert {(c.partition, c.mountpoint, c.via_holder) for c in os_disk.mounted_children} == {
        ("nvme4n1p1", "/boot/efi", None),
        ("nvme4n1p2", "/boot", None),
        ("nvme4n1p3", "/", "dm-0"),
    }
    assert os_disk.holders == ["dm-0"] and os_disk.mounted and not os_disk.slice_eligible
    assert os_disk.by_id not in {s.nvme_device for s in report.candidate_slots}


def test_nvswitch_bmc_vga_and_bf3_dma_are_not_reported():
    report = _report("h200-slice-after-transition")
    functions = fixture_host("h200-slice-after-transition") / "sys/bus/pci/devices"
    # The traps are really in the fixture: NVIDIA bridges, a VGA, a Mellanox DMA function.
    assert all((functions / a / "vendor").read_text() == "0x10de\n" for a in NVSWITCHES)
    assert (functions / BMC_VGA / "class").read_text() == "0x030000\n"
    assert (functions / BF3_DMA / "vendor").read_text() == "0x15b3\n"
    gpu_addresses = {g.pci_address for g in report.gpus}
    fabric_addresses = {f.pci_address for f in report.fabric_devices}
    assert not gpu_addresses & set(NVSWITCHES + [BMC_VGA])
    assert BF3_DMA not in fabric_addresses
    assert {"0000:e8:00.0", "0000:e8:00.1"} <= fabric_addresses
    assert all(g.device_id == "0x2335" and g.name == "H200 SXM 141GB" for g in report.gpus)


def test_multipath_path_nodes_are_not_disks():
    report = _report("h200-slice-after-transition")
    names = [d.kernel_name for d in report.nvme_devices]
    assert all("c" not in n.removeprefix("nvme") for n in names), names
    assert len(names) == 9
    assert all(d.pci_address is not None for d in report.nvme_devices)


def test_before_transition_blocks_every_slot_with_the_mount_evidence():
    report = _report("h200-slice-before-transition")
    assert report.summary.mounted_nvme_devices == 8
    assert report.summary.ready_candidate_slots == 0
    disks = {d.by_id: d for d in report.nvme_devices}
    shares = set()
    for slot in report.candidate_slots:
        codes = {b.code for b in slot.blockers}
        disk = disks[slot.nvme_device]
        assert not disk.os_disk
        assert "nvme_not_raw" in codes
        if disk.mounted_children:
            assert "nvme_mounted_child" in codes
            (child,) = disk.mounted_children
            assert child.mountpoint.startswith("/share") and child.partition == f"{disk.kernel_name}p1"
            shares.add(child.mountpoint)
        else:  # old nvme1n1: partition present but not mounted
            assert disk.kernel_name == "nvme1n1" and "nvme_mounted_child" not in codes
    assert shares == {f"/share{i}" for i in range(2, 9)}


def test_after_reboot_keeps_slot_disks_although_kernel_names_moved():
    before = _report("h200-slice-after-transition")
    after = _report("h200-slice-after-reboot")
    assert [s.model_dump(exclude={"nvme_kernel_name"}) for s in after.candidate_slots] == [
        s.model_dump(exclude={"nvme_kernel_name"}) for s in before.candidate_slots
    ]
    assert [s.nvme_kernel_name for s in after.candidate_slots] != [s.nvme_kernel_name for s in before.candidate_slots]
    (os_disk,) = [d for d in after.nvme_devices if d.os_disk]
    assert os_disk.kernel_name == "nvme7n1"
    assert {g.driver for g in after.gpus} == {"vfio-pci"}


def test_no_vfs_host_blocks_every_slot_and_never_hands_out_a_pf():
    report = _report("h200-slice-no-vfs")
    pfs = {f.pci_address for f in report.fabric_devices}
    assert not any(f.is_vf for f in report.fabric_devices)
    for slot in report.candidate_slots:
        assert slot.fabric_vf_pci_address is None
        assert [b.code for b in slot.blockers] == ["no_free_fabric_vf"]
        assert "sriov_numvfs=0 of 16" in slot.blockers[0].detail
    assert {b.code for b in report.blockers} == {"no_fabric_vfs"}
    assert not {s.fabric_pf_pci_address for s in report.candidate_slots} & pfs


def test_dev_box_without_gpu_answers_with_blockers():
    report = _report("dev-box-no-gpu")
    assert report.summary.gpu_devices == 0 and report.candidate_slots == []
    assert {b.code for b in report.blockers} == {"no_gpus", "iommu_disabled"}
    assert report.host.identity_source == "machine_id"


def test_golden_files_are_valid_reports():
    for name in ALL_FIXTURES:
        TopologyReport.model_validate(json.loads((GOLDEN / f"{name}.json").read_text()))


def test_recorded_h200_in_a_vm_is_one_blocked_gpu_with_its_real_ids():
    """The one real H200 recording (GPU passed through into a VM): what the hardware really reports."""
    report = _report("h200-vm-passthrough")
    assert report.summary.as_line() == (
        "gpu_devices=1 fabric_devices=0 nvme_devices=0 mounted_nvme_devices=0 candidate_slots=1 ready_candidate_slots=0"
    )
    (gpu,) = report.gpus
    assert (gpu.pci_address, gpu.vendor_id, gpu.device_id, gpu.class_code) == ("0000:00:06.0", "0x10de", "0x2335", "0x030200")
    assert (gpu.subsystem_vendor_id, gpu.subsystem_device_id, gpu.driver) == ("0x10de", "0x18bf", "nvidia")
    assert gpu.numa_node is None and gpu.iommu_group is None and gpu.local_cpulist == "0-15"
    (slot,) = report.candidate_slots
    assert [b.code for b in slot.blockers] == ["gpu_no_iommu_group", "no_nvme_device", "no_free_fabric_vf"]
    assert sorted(b.code for b in report.blockers) == ["iommu_disabled", "no_fabric_vfs"]
    assert [w.code for w in report.warnings] == ["numa_node_unknown"]
