"""Slot planning rules on small hand-built topologies where the right answer is obvious."""

from __future__ import annotations

from gpuaas_agent.contract.topology import (
    FabricDevice,
    Finding,
    GpuDevice,
    Locality,
    NvmeDevice,
    StorageIdentityKind,
)
from gpuaas_agent.discovery.pci import PciFunction, PciIndex
from gpuaas_agent.discovery.slots import PlanConfig, plan_slots


def _fn(address, numa, path, cls=0x030200, vendor=0x10DE):
    return PciFunction(address=address, sysfs_path="/sys/devices/" + address, vendor=vendor, device=0x2335,
                       class_code=cls, numa_node=numa, pci_path=tuple(path), iommu_group=int(address[5:7], 16))


def _gpu(fn):
    return GpuDevice(pci_address=fn.address, vendor_id="0x10de", device_id="0x2335", class_code="0x030200",
                     numa_node=fn.numa_node, iommu_group=fn.iommu_group, iommu_group_members=[fn.address],
                     pci_path=list(fn.pci_path))


def _disk(fn, eui, *, reasons=()):
    return NvmeDevice(by_id=f"/dev/disk/by-id/nvme-eui.{eui}", storage_identity_kind=StorageIdentityKind.nvme_eui_by_id,
                      kernel_name=f"nvme{eui}n1", pci_address=fn.address, numa_node=fn.numa_node, mounted=False,
                      os_disk=False, slice_eligible=not reasons,
                      ineligible_reasons=[Finding(code=r, detail=r) for r in reasons])


def _vf(fn, pf):
    return FabricDevice(pci_address=fn.address, vendor_id="0x15b3", device_id="0x101e", class_code="0x020700",
                        kind="infiniband", is_vf=True, physfn=pf, numa_node=fn.numa_node, iommu_group=fn.iommu_group)


def _plan(functions, gpus, disks, vfs):
    index = PciIndex(reader=None, functions={f.address: f for f in functions})
    return plan_slots(gpus, disks, vfs, index, "host-key", PlanConfig())


def test_same_switch_beats_same_numa_beats_remote():
    g0 = _fn("0000:10:00.0", 0, ["0000:0f:01.0"])
    g1 = _fn("0000:90:00.0", 1, ["0000:8f:01.0"])
    d_numa0 = _fn("0000:20:00.0", 0, ["0000:1f:01.0"], cls=0x010802)
    d_switch1 = _fn("0000:91:00.0", 1, ["0000:8f:01.0"], cls=0x010802)
    v_switch0 = _fn("0000:11:00.1", 0, ["0000:0f:01.0"], cls=0x020700, vendor=0x15B3)
    v_numa1 = _fn("0000:a1:00.1", 1, ["0000:a0:01.0"], cls=0x020700, vendor=0x15B3)
    # Listing order puts the "wrong" candidates first, so index order cannot produce the answer.
    slots = _plan(
        [g0, g1, d_numa0, d_switch1, v_switch0, v_numa1],
        [_gpu(g0), _gpu(g1)],
        [_disk(d_switch1, "a1"), _disk(d_numa0, "b2")],
        [_vf(v_numa1, "0000:a1:00.0"), _vf(v_switch0, "0000:11:00.0")],
    )
    assert [(s.nvme_device[-2:], s.nvme_locality) for s in slots] == [("b2", Locality.same_numa), ("a1", Locality.same_switch)]
    assert [(s.fabric_vf_pci_address, s.fabric_locality) for s in slots] == [
        ("0000:11:00.1", Locality.same_switch),
        ("0000:a1:00.1", Locality.same_numa),
    ]


def test_complete_slots_are_maximised_before_locality():
    # One VF, close to GPU1; one clean disk, close to GPU0. Giving the disk to GPU0
    # would be "closer" but leave no complete slot; the planner must complete GPU1.
    g0 = _fn("0000:10:00.0", 0, ["0000:0f:01.0"])
    g1 = _fn("0000:90:00.0", 1, ["0000:8f:01.0"])
    d0 = _fn("0000:11:00.0", 0, ["0000:0f:01.0"], cls=0x010802)
    v1 = _fn("0000:91:00.1", 1, ["0000:8f:01.0"], cls=0x020700, vendor=0x15B3)
    slots = _plan([g0, g1, d0, v1], [_gpu(g0), _gpu(g1)], [_disk(d0, "c3")], [_vf(v1, "0000:91:00.0")])
    assert slots[1].nvme_device.endswith("c3") and slots[1].fabric_vf_pci_address == "0000:91:00.1"
    assert not slots[1].blockers and slots[1].warnings[0].code == "nvme_remote_numa"
    assert {b.code for b in slots[0].blockers} == {"no_nvme_device", "no_free_fabric_vf"}


def test_clean_disk_is_preferred_and_unsafe_disk_only_fills_a_gap_with_blockers():
    g0 = _fn("0000:10:00.0", 0, ["0000:0f:01.0"])
    g1 = _fn("0000:12:00.0", 0, ["0000:0f:02.0"])
    dirty = _fn("0000:11:00.0", 0, ["0000:0f:01.0"], cls=0x010802)  # same switch as g0, but mounted
    clean = _fn("0000:21:00.0", 0, ["0000:20:01.0"], cls=0x010802)
    os_disk = _fn("0000:01:00.0", 0, ["0000:00:1c.0"], cls=0x010802)
    vf0 = _fn("0000:13:00.1", 0, ["0000:0f:01.0"], cls=0x020700, vendor=0x15B3)
    vf1 = _fn("0000:14:00.1", 0, ["0000:0f:02.0"], cls=0x020700, vendor=0x15B3)
    slots = _plan(
        [g0, g1, dirty, clean, os_disk, vf0, vf1],
        [_gpu(g0), _gpu(g1)],
        [_disk(dirty, "d4", reasons=["mounted_child"]), _disk(clean, "e5"), _disk(os_disk, "f6", reasons=["os_disk", "not_raw"])],
        [_vf(vf0, "0000:13:00.0"), _vf(vf1, "0000:14:00.0")],
    )
    used = {s.nvme_device[-2:] for s in slots}
    assert "f6" not in used  # the OS disk is never proposed, not even with blockers
    assert [s.nvme_device[-2:] for s in slots].count("e5") == 1
    dirty_slot = next(s for s in slots if s.nvme_device.endswith("d4"))
    assert [b.code for b in dirty_slot.blockers] == ["nvme_mounted_child"]
