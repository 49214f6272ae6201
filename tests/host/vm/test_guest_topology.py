"""The guest layout of multi-GPU domains on the recorded 8xH200 host (host/vm/guest_topology.py via domain_xml).

Goldens and libvirt's schema checks for the same specs are in test_domain_xml.py; these tests
assert the properties the goldens are meant to show, so a regenerated golden cannot quietly lose them.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from gpuaas_agent.contract.domain import DomainSpecError
from gpuaas_agent.discovery.bars import mmio64_bytes
from gpuaas_agent.host.vm.domain_config import QEMU_NS
from gpuaas_agent.host.vm.domain_xml import build_domain_xml
from gpuaas_agent.host.vm.guest_topology import mmio64_window_mib, plan_layout
from tests.support.domain_specs import guest_slot, multi_spec, production_spec

H200_BAR1 = 256 << 30


def _tree(spec) -> ET.Element:
    return ET.fromstring(build_domain_xml(spec))


def _controllers(root: ET.Element) -> dict[int, ET.Element]:
    return {int(c.get("index")): c for c in root.findall("devices/controller[@type='pci']")}


def _host_node_of_guest_bus(root: ET.Element, bus: int) -> int:
    """Follow a device's guest bus to its root port, then to the expander, then through memnode to the host node."""
    controllers = _controllers(root)
    port = controllers[bus]
    assert port.get("model") == "pcie-root-port"
    expander = controllers[int(port.find("address").get("bus"), 16)]
    assert expander.get("model") == "pcie-expander-bus"
    cell = expander.findtext("target/node")
    memnode = root.find(f"numatune/memnode[@cellid='{cell}']")
    return int(memnode.get("nodeset"))


@pytest.mark.parametrize("slots", [(0,), (0, 1), (2, 3, 4, 5), tuple(range(8))])
def test_every_gpu_vf_and_nvme_sits_behind_the_expander_of_its_host_numa_node(slots):
    spec = multi_spec(slots)
    root = _tree(spec)
    expected = {s.slot_index: s.numa_node for s in spec.guest_slots()}
    by_gpu = {s.gpu_pci_address: s for s in spec.guest_slots()}
    by_vf = {s.fabric_vf_pci_address: s for s in spec.guest_slots()}
    by_disk = {s.nvme_device: s for s in spec.guest_slots()}
    seen = 0
    for hostdev in root.findall("devices/hostdev"):
        a = hostdev.find("source/address").attrib
        host = f"{a['domain'][2:]}:{a['bus'][2:]}:{a['slot'][2:]}.{a['function'][2:]}"
        slot = by_gpu.get(host) or by_vf[host]
        assert _host_node_of_guest_bus(root, int(hostdev.find("address").get("bus"), 16)) == expected[slot.slot_index]
        seen += 1
    for disk in root.findall("devices/disk[@device='disk']"):
        slot = by_disk[disk.find("source").get("dev")]
        assert _host_node_of_guest_bus(root, int(disk.find("address").get("bus"), 16)) == expected[slot.slot_index]
        seen += 1
    assert seen == 3 * len(slots)
    expanders = [c for c in _controllers(root).values() if c.get("model") == "pcie-expander-bus"]
    assert len(expanders) == len(set(expected.values()))


def test_guest_numa_cells_match_the_host_nodes_in_size_and_pinning():
    spec = multi_spec((0, 1, 2, 4))  # three slots on node 0, one on node 1
    root = _tree(spec)
    cells = root.findall("cpu/numa/cell")
    assert [(c.get("cpus"), c.get("memory")) for c in cells] == [("0-71", str(3 * 65536)), ("72-95", "65536")]
    assert [(m.get("cellid"), m.get("nodeset"), m.get("mode")) for m in root.findall("numatune/memnode")] == [
        ("0", "0", "strict"), ("1", "1", "strict")]
    pins = {int(p.get("vcpu")): p.get("cpuset") for p in root.findall("cputune/vcpupin")}
    assert {pins[v] for v in range(72)} == {"0-55,112-167"}
    assert {pins[v] for v in range(72, 96)} == {"56-111,168-223"}
    # unequal cells: one socket, so the topology still multiplies to the vCPU count
    assert root.find("cpu/topology").attrib["sockets"] == "1" and root.findtext("vcpu") == "96"
    assert root.findtext("memory") == str(4 * 65536)
    # 1 GiB pages for every cell, memfd-backed, preallocated by threads before the vCPUs run
    assert root.find("memoryBacking/hugepages/page").attrib == {"size": "1048576", "unit": "KiB"}
    assert root.find("memoryBacking/source").get("type") == "memfd"
    assert root.find("memoryBacking/allocation").attrib == {"mode": "immediate", "threads": "16"}


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_mmio_window_holds_every_h200_bar_and_is_passed_to_ovmf(count):
    spec = multi_spec(tuple(range(count)))
    bars = sum(mmio64_bytes(s.gpu_bars) + mmio64_bytes(s.fabric_vf_bars) for s in spec.guest_slots())
    assert bars >= count * H200_BAR1  # the fixture's BARs were read, not assumed
    window_mib = plan_layout(spec).mmio64_mib
    assert window_mib * (1 << 20) > bars and window_mib & (window_mib - 1) == 0
    args = [a.get("value") for a in _tree(spec).findall(f"{{{QEMU_NS}}}commandline/{{{QEMU_NS}}}arg")]
    assert args == ["-fw_cfg", f"name=opt/ovmf/X-PciMmio64Mb,string={window_mib}"]
    # 8 x (256 GiB + 32 MiB) BARs do not fit 2 TiB at their alignment: 4 TiB of GPU windows, then the VFs
    assert {1: 1 << 20, 2: 2 << 20, 4: 4 << 20, 8: 8 << 20}[count] == window_mib


def test_memlock_limit_covers_all_guest_ram_for_vfio_pinning():
    root = _tree(multi_spec(tuple(range(8))))
    assert root.find("memoryBacking/locked") is not None
    hard_limit_kib = int(root.findtext("memtune/hard_limit"))
    assert root.find("memtune/hard_limit").get("unit") == "KiB"
    assert hard_limit_kib >= 8 * 65536 * 1024 + 1024 * 1024
    assert root.find("cpu/maxphysaddr").get("mode") == "passthrough"


def test_only_the_first_slot_disk_boots_the_others_are_data_disks():
    root = _tree(multi_spec((5, 4, 6)))
    disks = root.findall("devices/disk[@device='disk']")
    boots = {d.find("target").get("dev"): d.find("boot") is not None for d in disks}
    first = [d for d in disks if d.find("boot") is not None]
    assert sum(boots.values()) == 1
    assert first[0].find("source").get("dev") == production_spec(5).nvme_device
    assert sorted(boots) == ["vda", "vdb", "vdc"]


def test_two_slots_naming_one_gpu_are_refused():
    spec = production_spec(0, extra_slots=[guest_slot(1).model_copy(update={"gpu_pci_address": "0000:18:00.0"})])
    with pytest.raises(DomainSpecError) as err:
        build_domain_xml(spec)
    assert err.value.code == "duplicate_slot_device" and err.value.evidence["slots"] == [0, 1]


def test_the_same_slot_twice_is_refused():
    with pytest.raises(DomainSpecError) as err:
        build_domain_xml(multi_spec((3, 3)))
    assert err.value.code == "duplicate_slot_device"


def test_a_gpu_with_unknown_bars_is_refused():
    spec = multi_spec((0, 1))
    spec = spec.model_copy(update={"extra_slots": [spec.extra_slots[0].model_copy(update={"gpu_bars": []})]})
    with pytest.raises(DomainSpecError) as err:
        build_domain_xml(spec)
    assert err.value.code == "gpu_bars_unknown" and err.value.evidence["slot_index"] == 1


def test_an_extra_slot_whose_disk_is_on_another_node_is_refused():
    spec = production_spec(0, extra_slots=[guest_slot(1).model_copy(update={"nvme_numa_node": 1})])
    with pytest.raises(DomainSpecError) as err:
        build_domain_xml(spec)
    assert err.value.code == "disk_numa_mismatch" and err.value.evidence["slot_index"] == 1


def test_window_never_shrinks_below_ovmfs_default():
    assert mmio64_window_mib([]) == 32 * 1024
