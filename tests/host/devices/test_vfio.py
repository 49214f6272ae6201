"""VFIO guard and binding on copies of the recorded H200 hosts.

The sysfs attribute files of a fixture copy are regular files, so every write
lands there and the test reads back exactly what was written where. The kernel's
part (dropping the ``driver`` link on unbind, linking vfio-pci on probe) is
played by ``KernelStandIn`` through the driver's ``after_write`` hook; without it
the bind is reported as not verified, never as done.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gpuaas_agent.contract.vfio import SysfsWrite
from gpuaas_agent.guards.vfio import VfioGuardError, check_vfio_bindable
from gpuaas_agent.host.devices.vfio import VfioBindError, bind_to_vfio, find_device_holders
from gpuaas_agent.hostfs import HostRoot

GPU0 = "0000:18:00.0"
VF0 = "0000:19:00.1"
NVME0 = "0000:1a:00.0"
SWITCH_PORT0 = "0000:17:00.0"
GPU1 = "0000:3a:00.0"
SLOT0 = (GPU0, VF0)
GPU0_GROUP = 16


def _device_dir(root: Path, address: str) -> Path:
    return (root / "sys/bus/pci/devices" / address).resolve()


def _add_to_group(root: Path, address: str, group: int) -> None:
    """Put ``address`` into IOMMU group ``group`` of a fixture copy, as the kernel lays it out."""
    device = _device_dir(root, address)
    group_devices = root / f"sys/kernel/iommu_groups/{group}/devices"
    os.symlink(os.path.relpath(device, group_devices), group_devices / address)
    (device / "iommu_group").unlink()
    os.symlink(os.path.relpath(root / f"sys/kernel/iommu_groups/{group}", device), device / "iommu_group")


def _text(root: Path, host_path: str) -> str:
    return (root / host_path.lstrip("/")).read_text()


def _files(root: Path) -> dict[str, bytes]:
    """Every regular file under sys/ (links not followed): proves a path wrote nothing."""
    out = {}
    for dirpath, _dirs, names in os.walk(root / "sys"):
        for name in names:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                out[str(path.relative_to(root))] = path.read_bytes()
    return out


class KernelStandIn:
    """Does what the kernel does after each write, on the fixture copy; records the order."""

    def __init__(self, root: Path, address: str) -> None:
        self.device = _device_dir(root, address)
        self.address = address
        self.seen: list[SysfsWrite] = []
        self.link_prefix = os.readlink(self.device / "driver").rsplit("/", 1)[0]

    def __call__(self, step: SysfsWrite) -> None:
        self.seen.append(step)
        if step.path.endswith("/unbind") and step.value == self.address:
            (self.device / "driver").unlink()
        elif step.path == "/sys/bus/pci/drivers_probe" and step.value == self.address:
            override = (self.device / "driver_override").read_text().strip()
            os.symlink(f"{self.link_prefix}/{override}", self.device / "driver")


def _bind(root: Path, address: str, approved=SLOT0, **kw):
    return asyncio.run(bind_to_vfio(HostRoot.open(root), address, approved, **kw))


def _fake_process(root: Path, pid: int, comm: str, fds: dict[int, str]) -> None:
    proc = root / "proc" / str(pid)
    (proc / "fd").mkdir(parents=True)
    (proc / "comm").write_text(comm + "\n")
    for fd, target in fds.items():
        os.symlink(target, proc / "fd" / str(fd))


# -- guard ----------------------------------------------------------------------------------


def test_device_not_in_the_approved_slot_is_refused_and_nothing_written(host_copy):
    root = host_copy("h200-slice-after-transition")
    before = _files(root)
    with pytest.raises(VfioGuardError) as err:
        _bind(root, GPU1, approved=SLOT0)
    assert err.value.code == "not_approved"
    assert err.value.evidence["approved"] == sorted(SLOT0)
    assert _files(root) == before


def test_own_group_of_one_passes_with_evidence(host_copy):
    evidence = check_vfio_bindable(HostRoot.open(host_copy("h200-slice-after-transition")), GPU0, SLOT0)
    assert evidence.iommu_group == GPU0_GROUP
    assert [(m.address, m.driver, m.approved) for m in evidence.members] == [(GPU0, "nvidia", True)]


def test_group_with_a_non_bridge_stranger_is_refused(host_copy):
    root = host_copy("h200-slice-after-transition")
    _add_to_group(root, NVME0, GPU0_GROUP)
    before = _files(root)
    with pytest.raises(VfioGuardError) as err:
        _bind(root, GPU0)
    assert err.value.code == "iommu_group_not_isolated"
    assert err.value.evidence["iommu_group"] == GPU0_GROUP
    assert err.value.evidence["offending"] == [
        {"address": NVME0, "driver": "nvme", "is_bridge": False, "approved": False}
    ]
    assert _files(root) == before


def test_bridge_in_the_group_is_allowed(host_copy):
    root = host_copy("h200-slice-after-transition")
    _add_to_group(root, SWITCH_PORT0, GPU0_GROUP)
    evidence = check_vfio_bindable(HostRoot.open(root), GPU0, SLOT0)
    assert {m.address: (m.driver, m.is_bridge) for m in evidence.members} == {
        SWITCH_PORT0: ("pcieport", True),
        GPU0: ("nvidia", False),
    }


def test_approved_sibling_and_stranger_already_on_vfio_are_allowed(host_copy):
    root = host_copy("h200-slice-after-reboot")  # every GPU and VF is on vfio-pci here
    _add_to_group(root, VF0, GPU0_GROUP)
    _add_to_group(root, GPU1, GPU0_GROUP)
    evidence = check_vfio_bindable(HostRoot.open(root), GPU0, SLOT0)
    assert {m.address: (m.driver, m.approved) for m in evidence.members} == {
        GPU0: ("vfio-pci", True),
        VF0: ("vfio-pci", True),
        GPU1: ("vfio-pci", False),
    }


def test_device_without_iommu_group_is_refused(host_copy):
    root = host_copy("h200-slice-after-transition")
    (_device_dir(root, GPU0) / "iommu_group").unlink()
    with pytest.raises(VfioGuardError) as err:
        _bind(root, GPU0)
    assert (err.value.code, err.value.evidence["driver"]) == ("no_iommu_group", "nvidia")


# -- binding --------------------------------------------------------------------------------


def test_already_on_vfio_writes_nothing(host_copy):
    root = host_copy("h200-slice-after-reboot")
    before = _files(root)
    result = _bind(root, GPU0)
    assert (result.changed, result.previous_driver, result.driver, result.writes) == (False, "vfio-pci", "vfio-pci", [])
    assert _files(root) == before


@pytest.mark.parametrize(("address", "driver"), [(GPU0, "nvidia"), (VF0, "mlx5_core")])
def test_bind_writes_override_unbind_probe_in_order(host_copy, address, driver):
    root = host_copy("h200-slice-after-transition")
    kernel = KernelStandIn(root, address)
    result = _bind(root, address, after_write=kernel)
    expected = [
        SysfsWrite(path=f"/sys/bus/pci/devices/{address}/driver_override", value="vfio-pci"),
        SysfsWrite(path=f"/sys/bus/pci/drivers/{driver}/unbind", value=address),
        SysfsWrite(path="/sys/bus/pci/drivers_probe", value=address),
    ]
    assert result.writes == expected == kernel.seen
    assert (result.changed, result.previous_driver, result.driver) == (True, driver, "vfio-pci")
    for step in expected:  # the files hold exactly what was written
        assert _text(root, step.path) == step.value
    assert _text(root, "/sys/bus/pci/drivers/vfio-pci/unbind") == ""  # nothing else touched
    assert os.readlink(_device_dir(root, address) / "driver").endswith("/vfio-pci")


def test_bind_is_idempotent_on_a_second_call(host_copy):
    root = host_copy("h200-slice-after-transition")
    _bind(root, GPU0, after_write=KernelStandIn(root, GPU0))
    before = _files(root)
    again = _bind(root, GPU0)
    assert (again.changed, again.writes) == (False, [])
    assert _files(root) == before


def test_driver_link_that_never_changes_is_not_verified(host_copy):
    root = host_copy("h200-slice-after-transition")  # no kernel: the link stays on nvidia
    with pytest.raises(VfioBindError) as err:
        _bind(root, GPU0, verify_timeout_s=0.2)
    assert (err.value.code, err.value.evidence["driver"]) == ("bind_not_verified", "nvidia")
    assert [w["path"] for w in err.value.evidence["writes"]] == [
        f"/sys/bus/pci/devices/{GPU0}/driver_override",
        "/sys/bus/pci/drivers/nvidia/unbind",
        "/sys/bus/pci/drivers_probe",
    ]


def test_missing_vfio_driver_is_refused_before_any_write(host_copy):
    root = host_copy("h200-slice-after-transition")
    vfio_dir = root / "sys/bus/pci/drivers/vfio-pci"
    for entry in vfio_dir.iterdir():
        entry.unlink()
    vfio_dir.rmdir()
    before = _files(root)
    with pytest.raises(VfioBindError) as err:
        _bind(root, GPU0)
    assert err.value.code == "vfio_driver_missing"
    assert _files(root) == before


# -- unbind that fails or hangs: name the holders ----------------------------------------------


def _holders_fixture(root: Path) -> None:
    _fake_process(root, 1234, "nvidia-persistenc", {3: "/dev/nvidia0", 4: "/dev/nvidiactl"})
    _fake_process(root, 2345, "nv-fabricmanager", {7: "/dev/nvidia-nvswitchctl"})
    _fake_process(root, 3456, "bash", {0: "/dev/pts/0", 1: "/dev/null"})


def test_holder_scan_names_processes_with_nvidia_nodes_open(host_copy):
    root = host_copy("h200-slice-after-transition")
    _holders_fixture(root)
    holders = find_device_holders(HostRoot.open(root), ("/dev/nvidia",))
    assert [(h.pid, h.comm, h.devices) for h in holders] == [
        (1234, "nvidia-persistenc", ["/dev/nvidia0", "/dev/nvidiactl"]),
        (2345, "nv-fabricmanager", ["/dev/nvidia-nvswitchctl"]),
    ]


def test_a_known_holder_whose_fds_are_readable_is_named_only_when_it_holds_the_device(host_copy):
    # A process's comm names it only when the kernel refused its fd links (the agent has no
    # CAP_SYS_PTRACE; tests/deploy/test_unit_sandbox.py runs that case under the unit's capabilities).
    root = host_copy("h200-slice-after-transition")
    _fake_process(root, 4567, "nv-hostengine", {0: "/dev/null"})
    _fake_process(root, 5678, "qemu-system-x86", {9: "/dev/vfio/12"})
    assert find_device_holders(HostRoot.open(root), ("/dev/nvidia",)) == []
    assert [(h.pid, h.devices) for h in find_device_holders(HostRoot.open(root), ("/dev/vfio/",))] == [
        (5678, ["/dev/vfio/12"])]


def test_failed_unbind_reports_holders_and_clears_the_override(host_copy):
    root = host_copy("h200-slice-after-transition")
    _holders_fixture(root)
    unbind = root / "sys/bus/pci/drivers/nvidia/unbind"
    unbind.unlink()
    unbind.mkdir()  # open(O_WRONLY) fails with EISDIR: a write the "kernel" rejects
    with pytest.raises(VfioBindError) as err:
        _bind(root, GPU0, after_write=KernelStandIn(root, GPU0))
    assert err.value.code == "unbind_failed"
    assert [h["comm"] for h in err.value.evidence["holders"]] == ["nvidia-persistenc", "nv-fabricmanager"]
    assert "nvidia-persistenc (pid 1234)" in err.value.message
    assert _text(root, f"/sys/bus/pci/devices/{GPU0}/driver_override") == "\n"  # compensation
    assert _text(root, "/sys/bus/pci/drivers_probe") == ""  # never probed
    assert os.readlink(_device_dir(root, GPU0) / "driver").endswith("/nvidia")


def test_hanging_unbind_times_out_and_reports_holders(host_copy):
    root = host_copy("h200-slice-after-transition")
    _holders_fixture(root)
    unbind = root / "sys/bus/pci/drivers/nvidia/unbind"
    unbind.unlink()
    os.mkfifo(unbind)  # open(O_WRONLY) blocks until a reader comes: an unbind stuck in the kernel
    try:
        with pytest.raises(VfioBindError) as err:
            _bind(root, GPU0, write_timeout_s=0.3)
        assert err.value.code == "unbind_timeout"
        assert err.value.evidence["timeout_s"] == 0.3
        assert {h["pid"] for h in err.value.evidence["holders"]} == {1234, 2345}
        assert _text(root, "/sys/bus/pci/drivers_probe") == ""
    finally:
        reader = os.open(unbind, os.O_RDONLY | os.O_NONBLOCK)  # lets the stuck writer thread finish
        os.close(reader)
