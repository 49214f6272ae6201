"""NVMe behind Intel VMD lives in PCI domain 10000: it is still a local PCIe disk, and a recording keeps it."""

import os
from pathlib import Path

from gpuaas_agent.discovery.fixture_archive import unpack_tree
from gpuaas_agent.discovery.record import record_fixture, record_fixture_archive
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot

VMD = "sys/devices/pci0000:00/0000:00:0e.0"
PORT = f"{VMD}/pci10000:e0/10000:e0:1d.0"
CTRL = f"{PORT}/10000:e1:00.0"


def _attrs(root: Path, rel: str, **values: str) -> None:
    (root / rel).mkdir(parents=True, exist_ok=True)
    for name, value in values.items():
        (root / rel / name).write_text(value + "\n")


def _link(root: Path, rel: str, target: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, root / rel)


def _vmd_host(root: Path) -> Path:
    """A host whose only NVMe sits behind a VMD controller (PCI domain 10000)."""
    _attrs(root, VMD, vendor="0x8086", device="0x28c0", **{"class": "0x010400"}, numa_node="0")
    _attrs(root, PORT, vendor="0x8086", device="0x352a", **{"class": "0x060400"}, numa_node="-1")
    _attrs(root, CTRL, vendor="0x144d", device="0xa80a", **{"class": "0x010802"}, numa_node="-1")
    _attrs(root, f"{CTRL}/nvme/nvme0", serial="S64FNE0R", model="SAMSUNG MZQL23T8HCLS")
    _attrs(root, f"{CTRL}/nvme/nvme0/nvme0n1", dev="259:0", size="7501476528", ro="0")
    for address, rel in (("0000:00:0e.0", VMD), ("10000:e0:1d.0", PORT), ("10000:e1:00.0", CTRL)):
        _link(root, f"sys/bus/pci/devices/{address}", "../../../" + rel.removeprefix("sys/"))
    _link(root, "sys/class/block/nvme0n1", f"../../{CTRL.removeprefix('sys/')}/nvme/nvme0/nvme0n1")
    _link(root, "dev/disk/by-id/nvme-eui.0025385b21404d2a", "../../nvme0n1")
    _attrs(root, "proc/self")
    (root / "proc/self/mountinfo").write_text("22 1 8:2 / / rw - ext4 /dev/sda2 rw\n")
    return root


def test_disk_behind_vmd_keeps_its_pci_identity(tmp_path):
    (disk,) = discover(HostRoot.open(_vmd_host(tmp_path))).nvme_devices
    assert disk.pci_address == "10000:e1:00.0"
    assert disk.pci_path == ["0000:00:0e.0", "10000:e0:1d.0"]
    assert disk.by_id == "/dev/disk/by-id/nvme-eui.0025385b21404d2a"
    assert disk.slice_eligible and disk.numa_node is None


def test_recording_a_vmd_host_keeps_its_nvme_and_gives_identical_discovery(tmp_path):
    """The recorder once took only 4-digit PCI domains and silently dropped every disk behind VMD."""
    src = _vmd_host(tmp_path / "src")
    record_fixture(HostRoot.open(src), tmp_path / "rec")
    record_fixture_archive(HostRoot.open(src), tmp_path / "rec.tar.xz")
    unpacked = unpack_tree(tmp_path / "rec.tar.xz", tmp_path / "unpacked")
    expected = discover(HostRoot.open(src)).model_dump_json()
    for recording in (tmp_path / "rec", unpacked):
        assert (recording / "sys/bus/pci/devices/10000:e1:00.0").is_symlink()
        assert (recording / CTRL / "class").read_text() == "0x010802\n"
        (disk,) = discover(HostRoot.open(recording)).nvme_devices
        assert disk.pci_address == "10000:e1:00.0" and disk.pci_path == ["0000:00:0e.0", "10000:e0:1d.0"]
        assert discover(HostRoot.open(recording)).model_dump_json() == expected
