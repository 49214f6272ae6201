"""HostRoot keeps every lookup inside the root, whatever the links say."""

import os

import pytest

from gpuaas_agent.errors import HostRootError
from gpuaas_agent.hostfs import HostRoot, SymlinkLoopError


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _link(root, rel, target):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)


def test_relative_pci_link_resolves_inside_root(tmp_path):
    _write(tmp_path, "sys/devices/pci0000:15/0000:15:01.0/0000:18:00.0/vendor", "0x10de\n")
    _link(tmp_path, "sys/bus/pci/devices/0000:18:00.0", "../../../devices/pci0000:15/0000:15:01.0/0000:18:00.0")
    host = HostRoot.open(tmp_path)
    assert host.resolve("/sys/bus/pci/devices/0000:18:00.0") == "/sys/devices/pci0000:15/0000:15:01.0/0000:18:00.0"
    assert host.read_attr("/sys/bus/pci/devices/0000:18:00.0/vendor") == "0x10de"


def test_absolute_link_is_rerooted_not_followed_to_the_real_host(tmp_path):
    _write(tmp_path, "etc/machine-id", "fixture-id\n")
    _link(tmp_path, "sys/bus/pci/devices/evil", "/etc")
    host = HostRoot.open(tmp_path)
    assert host.resolve("/sys/bus/pci/devices/evil/machine-id") == "/etc/machine-id"
    assert host.read_attr("/sys/bus/pci/devices/evil/machine-id") == "fixture-id"


def test_dotdot_cannot_climb_above_the_root(tmp_path):
    _write(tmp_path, "passwd", "inside\n")
    _link(tmp_path, "dev/disk/by-id/x", "../../../../../../../passwd")
    host = HostRoot.open(tmp_path)
    assert host.resolve("/dev/disk/by-id/x") == "/passwd"
    assert host.read_text("/dev/disk/by-id/x") == "inside\n"


def test_dangling_link_resolves_to_its_name_but_does_not_exist(tmp_path):
    _link(tmp_path, "dev/disk/by-id/nvme-eui.01", "../../nvme0n1")
    host = HostRoot.open(tmp_path)
    assert host.resolve("/dev/disk/by-id/nvme-eui.01") == "/dev/nvme0n1"
    assert not host.exists("/dev/disk/by-id/nvme-eui.01")
    with pytest.raises(FileNotFoundError):
        host.read_text("/dev/disk/by-id/nvme-eui.01")


def test_symlink_loop_is_a_typed_error(tmp_path):
    _link(tmp_path, "sys/a", "b")
    _link(tmp_path, "sys/b", "a")
    host = HostRoot.open(tmp_path)
    with pytest.raises(SymlinkLoopError):
        host.resolve("/sys/a/vendor")
    assert not host.exists("/sys/a")


def test_link_name_reads_the_relation_not_the_target(tmp_path):
    _link(tmp_path, "sys/devices/x/driver", "../../bus/pci/drivers/vfio-pci")
    host = HostRoot.open(tmp_path)
    assert host.link_name("/sys/devices/x/driver") == "vfio-pci"
    assert host.link_name("/sys/devices/x/nothing") is None


def test_missing_root_is_refused_with_code(tmp_path):
    with pytest.raises(HostRootError) as err:
        HostRoot.open(tmp_path / "nope")
    assert err.value.code == "root_missing"


def test_live_root_is_recognised(tmp_path):
    assert HostRoot.open("/").is_live
    assert not HostRoot.open(tmp_path).is_live


def test_nul_byte_in_a_path_is_an_oserror_not_a_crash(tmp_path):
    host = HostRoot.open(tmp_path)
    with pytest.raises(OSError):
        host.read_text("/run/udev/data/b259:\0junk")
    assert not host.exists("/sys/\0")


def test_fresh_view_sees_a_relinked_path_the_cached_view_does_not(tmp_path):
    _link(tmp_path, "dev/disk/by-id/nvme-eui.01", "../../nvme0n1")
    host = HostRoot.open(tmp_path)
    assert host.resolve("/dev/disk/by-id/nvme-eui.01") == "/dev/nvme0n1"
    link = tmp_path / "dev/disk/by-id/nvme-eui.01"
    link.unlink()
    os.symlink("../../nvme7n1", link)  # udev re-pointed it (a reboot renamed the disk)
    assert host.resolve("/dev/disk/by-id/nvme-eui.01") == "/dev/nvme0n1"  # one discovery, one snapshot
    assert host.fresh().resolve("/dev/disk/by-id/nvme-eui.01") == "/dev/nvme7n1"
