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


def _device(root: Path, path: str, driver: str | None) -> None:
    (root / path).mkdir(parents=True, exist_ok=True)
    for name in ("config", "driver_override", "reset", "rom", "resource0"):
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
    (tmp_path / "sys/bus/pci/drivers/vfio-pci").mkdir()
    (tmp_path / "sys/bus/pci/drivers_probe").write_text("")
    return HostRoot.open(tmp_path)


def test_the_write_set_is_the_slot_devices_their_bridges_config_and_the_leaving_drivers_unbind(host):
    paths = sysfswrites.write_set(host, [("slot0.gpu", "gpu", "0000:03:00.0"),
                                         ("slot0.fabric_vf", "fabric_vf", "0000:04:00.1")])
    r = str(host.root)
    assert [(p.item, p.path) for p in paths] == [
        ("slot0.gpu", f"{r}/{GPU}"),
        ("slot0.gpu.bridge", f"{r}/{SWITCH}/config"),
        ("slot0.gpu.bridge", f"{r}/{ROOT_PORT}/0000:01:00.0/config"),
        ("slot0.gpu.bridge", f"{r}/{ROOT_PORT}/config"),
        ("slot0.fabric_vf", f"{r}/{VF}"),
        ("driver.nvidia.unbind", f"{r}/sys/bus/pci/drivers/nvidia/unbind"),
        ("driver.mlx5_core.unbind", f"{r}/sys/bus/pci/drivers/mlx5_core/unbind"),
        ("drivers_probe", f"{r}/sys/bus/pci/drivers_probe"),
    ]
    # Never the boot disk's device or its driver, the bridges' own directories, vfio-pci's unbind, or the VF's
    # bridges (only gpu-admin-tools, run on GPUs, opens the parent chain's config).
    joined = " ".join(p.path for p in paths)
    assert "0000:81:00.0" not in joined and "/nvme/" not in joined and "vfio-pci" not in joined
    assert "0000:02:01.0/config" not in joined


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
    # Every candidate slot of the recording: its GPU and its fabric VF, each by its real device path.
    assert len([p for p in expected if p.item.endswith(".gpu")]) == 8
    assert len([p for p in expected if p.item.endswith(".fabric_vf")]) == 8
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
