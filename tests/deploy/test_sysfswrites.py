"""The sysfs write set and its unit drop-in: exactly the slot devices' files, nothing else of /sys.

The layout test builds a small sysfs tree the way the kernel lays it out (device directories
nested under their bridges, ``/sys/bus/pci/devices`` and ``driver`` as relative links); the
prepare-host tests run the real CLI against the recorded 8x H200 host; writability is judged
against a real read-only bind mount, as the unit's sandbox makes one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuaas_agent.contract.parity import ParityStatus
from gpuaas_agent.deploy import sysfswrites
from gpuaas_agent.deploy.sysfswrites import WritablePath
from gpuaas_agent.hostfs import HostRoot
from lab.fixture_hosts import H200, fixture_host
from tests.conftest import REPO

ROOT_PORT = "sys/devices/pci0000:00/0000:00:01.0"
SWITCH = f"{ROOT_PORT}/0000:01:00.0/0000:02:00.0"
GPU = f"{SWITCH}/0000:03:00.0"
VF = f"{ROOT_PORT}/0000:01:00.0/0000:02:01.0/0000:04:00.1"
BOOT_DISK = "sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"
MGMT_NIC = "sys/devices/pci0000:80/0000:80:02.0/0000:82:00.0"  # the host's management NIC (tg3 here)
CX_PF = "sys/devices/pci0000:80/0000:80:03.0/0000:83:00.0"  # a ConnectX PF the host may run its management on


def _device(root: Path, path: str, driver: str | None) -> None:
    (root / path).mkdir(parents=True, exist_ok=True)
    for name in ("config", "driver_override", "reset", "rom", "resource0", "resource2", "remove", "rescan", "enable"):
        (root / path / name).write_text("")
    address = Path(path).name
    (root / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
    (root / "sys/bus/pci/devices" / address).symlink_to(os.path.relpath(root / path, root / "sys/bus/pci/devices"))
    if driver is not None:
        (root / "sys/bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
        (root / "sys/bus/pci/drivers" / driver / "unbind").write_text("")
        (root / path / "driver").symlink_to(os.path.relpath(root / "sys/bus/pci/drivers" / driver, root / path))


@pytest.fixture
def host(tmp_path) -> HostRoot:
    for bridge in (ROOT_PORT, f"{ROOT_PORT}/0000:01:00.0", SWITCH, f"{ROOT_PORT}/0000:01:00.0/0000:02:01.0"):
        _device(tmp_path, bridge, "pcieport")
    _device(tmp_path, GPU, "nvidia")
    _device(tmp_path, VF, "mlx5_core")
    _device(tmp_path, BOOT_DISK, "nvme")
    _device(tmp_path, MGMT_NIC, "tg3")
    _device(tmp_path, CX_PF, "mlx5_core")
    _netdev(tmp_path, "eno1", MGMT_NIC)
    _netdev(tmp_path, "ens3f0np0", CX_PF)
    _default_route(tmp_path, "eno1")
    (tmp_path / "sys/bus/pci/drivers/vfio-pci").mkdir()
    (tmp_path / "sys/bus/pci/drivers_probe").write_text("")
    return HostRoot.open(tmp_path)


def _netdev(root: Path, name: str, device: str | None) -> None:
    """``/sys/class/net/<name>`` as the kernel links it: a directory under its PCI device (or virtual)."""
    where = root / (f"{device}/net/{name}" if device else f"sys/devices/virtual/net/{name}")
    where.mkdir(parents=True)
    if device:
        (where / "device").symlink_to(os.path.relpath(root / device, where))
    (root / "sys/class/net").mkdir(parents=True, exist_ok=True)
    (root / "sys/class/net" / name).symlink_to(os.path.relpath(where, root / "sys/class/net"))


def _default_route(root: Path, dev: str) -> None:
    """``/proc/net/route`` with one default route (destination and mask 0) through ``dev``."""
    (root / "proc/net").mkdir(parents=True, exist_ok=True)
    (root / "proc/net/route").write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        f"{dev}\t00000000\t0124B10A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        f"{dev}\t0024B10A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")


def test_the_write_set_is_the_slot_devices_their_bridges_config_and_the_leaving_drivers_unbind(host):
    paths = sysfswrites.write_set(host, [("slot0.gpu", "gpu", "0000:03:00.0"),
                                         ("slot0.fabric_vf", "fabric_vf", "0000:04:00.1")])
    r = str(host.root)
    assert [(p.item, p.path) for p in paths] == [
        ("slot0.gpu.driver_override", f"{r}/{GPU}/driver_override"),
        ("slot0.gpu.rom", f"{r}/{GPU}/rom"),
        ("slot0.gpu.config", f"{r}/{GPU}/config"),
        ("slot0.gpu.resource0", f"{r}/{GPU}/resource0"),
        ("slot0.gpu.bridge", f"{r}/{SWITCH}/config"),
        ("slot0.gpu.bridge", f"{r}/{ROOT_PORT}/0000:01:00.0/config"),
        ("slot0.gpu.bridge", f"{r}/{ROOT_PORT}/config"),
        ("slot0.fabric_vf.driver_override", f"{r}/{VF}/driver_override"),
        ("slot0.fabric_vf.reset", f"{r}/{VF}/reset"),
        ("driver.nvidia.unbind", f"{r}/sys/bus/pci/drivers/nvidia/unbind"),
        ("driver.mlx5_core.unbind", f"{r}/sys/bus/pci/drivers/mlx5_core/unbind"),
        ("drivers_probe", f"{r}/sys/bus/pci/drivers_probe"),
    ]
    # Never the boot disk's device or its driver, the bridges' own directories, vfio-pci's unbind, or the VF's
    # bridges (only gpu-admin-tools, run on GPUs, opens the parent chain's config).
    joined = " ".join(p.path for p in paths)
    assert "0000:81:00.0" not in joined and "/nvme/" not in joined and "vfio-pci" not in joined
    assert "0000:02:01.0/config" not in joined
    # Exact files only: never a device directory (its remove, rescan, enable, other BARs would come with it).
    assert not any(os.path.isdir(p.path) for p in paths)
    assert not any(p.path.endswith(("/remove", "/rescan", "/enable", "/resource2")) for p in paths)


def test_a_gpu_already_on_vfio_pci_still_opens_its_usual_drivers_unbind_and_a_missing_device_nothing(host):
    gpu = host.real(f"/{GPU}")
    (gpu / "driver").unlink()
    (gpu / "driver").symlink_to(os.path.relpath(host.real("/sys/bus/pci/drivers/vfio-pci"), gpu))
    paths = sysfswrites.write_set(host.fresh(), [("slot0.gpu", "gpu", "0000:03:00.0"), ("slot1.gpu", "gpu", "0000:09:00.0")])
    items = [p.item for p in paths]
    # After a reboot the GPU is on nvidia again; the unbind it will need is opened now (nvidia is loaded).
    assert "driver.nvidia.unbind" in items and "driver.vfio-pci.unbind" not in items
    assert not any(i.startswith("slot1") for i in items)
    assert sysfswrites.write_set(host, []) == []  # no slot device: not even drivers_probe


def test_a_host_nic_on_mlx5_core_behind_a_bond_keeps_mlx5_core_unbind_closed_with_evidence(host):
    root = host.root
    # Management moves to a bond over the ConnectX PF: the default route is on bond0, whose slave is that PF.
    _netdev(root, "bond0", None)
    (root / "sys/devices/virtual/net/bond0/lower_ens3f0np0").symlink_to("../../../" + CX_PF + "/net/ens3f0np0")
    _default_route(root, "bond0")
    functions = [("slot0.gpu", "gpu", "0000:03:00.0"), ("slot0.fabric_vf", "fabric_vf", "0000:04:00.1")]
    paths, refused = sysfswrites.plan_writes(host.fresh(), functions)
    items = [p.item for p in paths]
    assert "driver.mlx5_core.unbind" not in items and "driver.nvidia.unbind" in items
    assert not any("/drivers/mlx5_core/" in p.path for p in paths)
    [mlx5] = refused
    assert (mlx5.item, mlx5.reason) == ("driver.mlx5_core.unbind", "host_nic_driver")
    assert mlx5.evidence["host_nics"] == ["ens3f0np0"] and mlx5.evidence["default_route"] == ["bond0"]
    assert mlx5.evidence["source"] == "/proc/net/route"
    assert mlx5.blocks == ["slot0.fabric_vf 0000:04:00.1"]  # the VF sits on mlx5_core now: it cannot move
    # Said in the drop-in (a comment, never a ReadWritePaths line), by prepare-host --check, and by preflight.
    text = sysfswrites.render_dropin(paths, host_root=str(root), refused=refused)
    assert "# refused driver.mlx5_core.unbind" in text and "ens3f0np0" in text
    assert not [line for line in text.splitlines() if line.startswith("ReadWritePaths=") and "/drivers/mlx5_core/" in line]
    assert "outcome=refused reason=host_nic_driver" in sysfswrites.check_lines(paths, refused)[-1]
    check = sysfswrites.sysfs_writable_check(paths, refused)
    assert check.status == ParityStatus.FAIL and "slot0.fabric_vf" in check.detail and "ens3f0np0" in check.detail


def test_a_host_nic_on_another_driver_leaves_mlx5_core_unbind_open_and_an_unknown_route_opens_no_unbind(host):
    functions = [("slot0.fabric_vf", "fabric_vf", "0000:04:00.1")]
    paths, refused = sysfswrites.plan_writes(host, functions)  # default route on eno1 (tg3)
    assert "driver.mlx5_core.unbind" in [p.item for p in paths] and refused == []
    (host.root / "proc/net/route").unlink()  # nothing says which NIC is the host's: no unbind is known safe
    paths, refused = sysfswrites.plan_writes(host.fresh(), functions)
    assert not any(p.item.startswith("driver.") for p in paths)
    assert [r.item for r in refused] == ["driver.mlx5_core.unbind"]
    assert refused[0].evidence["source"] == "no default route could be read"


def test_a_virtio_nic_names_its_pci_functions_driver_too(host):
    # eth0 -> virtio0 (virtio_net) under a PCI function bound to virtio-pci: unbinding virtio-pci cuts it off too.
    virtio = f"{CX_PF.rsplit('/', 1)[0]}/0000:84:00.0"
    _device(host.root, virtio, "virtio-pci")
    _device(host.root, f"{virtio}/virtio0", "virtio_net")
    (host.root / "sys/bus/pci/devices/virtio0").unlink()  # not a PCI function: _device linked it there
    _netdev(host.root, "eth0", f"{virtio}/virtio0")
    _default_route(host.root, "eth0")
    assert sysfswrites.host_nic_drivers(host.fresh())["drivers"] == {"virtio_net": ["eth0"], "virtio-pci": ["eth0"]}


def test_the_recorded_h200_host_reads_its_management_nic_from_the_recording():
    nics = sysfswrites.host_nic_drivers(HostRoot.open(fixture_host(H200)))
    assert nics["default_route"] == ["eno8303"] and nics["drivers"] == {"tg3": ["eno8303"]}
    assert nics["source"].endswith("commands/ip-route.out")


def test_the_dropin_names_each_path_once_optional_and_escaped():
    text = sysfswrites.render_dropin([WritablePath("slot0.gpu", "/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0"),
                                      WritablePath("odd", "/var/lib/a b/100%")], host_root="/")
    lines = text.splitlines()
    assert lines[lines.index("[Service]") + 1:] == [
        "# slot0.gpu", "ReadWritePaths=-/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0",
        "# odd", 'ReadWritePaths="-/var/lib/a b/100%%"']
    assert "nothing under /sys is writable" in sysfswrites.render_dropin([], host_root="/")


def test_writability_is_read_from_the_mount_holding_the_path(tmp_path):
    attr = tmp_path / "driver_override"
    attr.write_text("")
    assert sysfswrites.writable_here(str(attr)) == "ok"
    assert sysfswrites.writable_here(str(tmp_path / "gone")) == "missing"
    subprocess.run(["mount", "--bind", str(attr), str(attr)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(attr)], check=True)
        assert sysfswrites.writable_here(str(attr)) == "read_only"
        check = sysfswrites.sysfs_writable_check([WritablePath("slot3.gpu", str(attr))])
        assert check.status is ParityStatus.FAIL and check.hard
        assert f"slot3.gpu {attr} (read_only)" in check.detail and "daemon-reload" in check.remediation
        line, = sysfswrites.check_lines([WritablePath("slot3.gpu", str(attr))])
        assert f"item=sysfs.slot3.gpu path={attr} outcome=read_only" in line and "daemon-reload" in line
    finally:
        subprocess.run(["umount", str(attr)], check=True)
    assert sysfswrites.sysfs_writable_check([WritablePath("slot3.gpu", str(attr))]).status is ParityStatus.PASS


@pytest.fixture
def site() -> Iterator[Path]:
    """A config whose host is the recorded 8x H200 host, its directories under a throwaway root."""
    tmp = Path(tempfile.mkdtemp(prefix="gpuaas-sysfs-", dir="/var/tmp"))
    tmp.chmod(0o755)
    root = tmp / "host"
    config = {"state_dir": str(root / "state"), "host_root": str(fixture_host(H200)),
              "slice": {"seed_dir": str(root / "seeds"), "dnsmasq_hosts_file": str(root / "dnsmasq/hosts"),
                        "terminal_relay_key_file": str(root / "terminal/id_ed25519.pub"),
                        "console_log_dir": str(root / "console")}}
    (tmp / "agent.json").write_text(json.dumps(config))
    try:
        yield tmp
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=True, timeout=60)


def _cli(site: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", "prepare-host", "--config", str(site / "agent.json"),
                           *extra], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_prepare_host_writes_the_dropin_once_and_check_reports_each_path(site):
    dropin = site / "unit.d" / "50-sysfs-writes.conf"
    first = _cli(site, "--sysfs-dropin", str(dropin))
    assert first.returncode == 0, first.stderr
    assert f"item=sysfs_dropin path={dropin} outcome=changed paths=" in first.stdout
    text = dropin.read_text()
    host = HostRoot.open(fixture_host(H200))
    expected = sysfswrites.host_write_set(host)
    # Every candidate slot of the recording: its GPU's and its fabric VF's files, each by its real device path
    # (the recording holds driver_override and the VFs' reset; config, rom and BARs are not recorded).
    assert len([p for p in expected if p.item.endswith(".gpu.driver_override")]) == 8
    assert len([p for p in expected if p.item.endswith(".fabric_vf.driver_override")]) == 8
    assert len([p for p in expected if p.item.endswith(".fabric_vf.reset")]) == 8
    assert "driver.mlx5_core.unbind" in [p.item for p in expected]  # the host NIC is tg3 (eno8303): allowed
    assert [line.removeprefix("ReadWritePaths=-") for line in text.splitlines() if line.startswith("ReadWritePaths=")] \
        == [p.path for p in expected]
    assert all("/sys/devices/pci" in p.path for p in expected if p.item.startswith("slot"))
    again = _cli(site, "--sysfs-dropin", str(dropin))
    assert f"outcome=unchanged paths={len(expected)}" in again.stdout and dropin.read_text() == text
    check = _cli(site, "--check", "--sysfs-dropin", str(dropin))
    assert check.returncode == 0, check.stderr
    said = [line for line in check.stdout.splitlines() if "item=sysfs." in line]
    assert len(said) == len(expected) and all(line.endswith("outcome=ok") for line in said), said
    # Without the flag nothing about sysfs is written or said (the lab and older units).
    plain = _cli(site)
    assert plain.returncode == 0 and "item=sysfs" not in plain.stdout
