"""Provision preconditions, broken one at a time on real roots, a real dnsmasq and a real network namespace.

The host side (``/dev/kvm``, hugepages, IOMMU groups) is the recorded 8xH200 host; the
machine side is a temp root holding real directories with real modes and owners (passwd,
qemu.conf, OVMF, seed dir, relay key pair, image cache); the dnsmasq is a real process (the
DHCP lab) read through the live ``/proc``; the bridge's gateway address lives in a real
namespace. Each case breaks exactly one thing and shows the typed refusal and its evidence.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.guards.preconditions import (
    PreconditionRefused,
    check_provision_preconditions,
    qemu_user,
)
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import HOSTS
from tests.support.dnsmasq_fixture import DhcpLab
from tests.support.gpu_handover import between_tenants
from tests.support.slice_netns import slice_namespace

PROFILE = get_profile("h200_1g_24c_64g")
GPU, VF, NODE = "0000:18:00.0", "0000:19:00.1", 0
H200 = HOSTS / "h200-slice-after-transition"
QEMU_UID, KVM_GID = 64055, 109
SEED_DIR = "/var/lib/libvirt/images/gpuaas-seeds"
RELAY = "/var/lib/gpuaas/terminal/id_ed25519.pub"
CACHE = "/var/lib/gpuaas-agent/images"


def _machine_root() -> Path:
    """A machine root every directory of which QEMU's user may traverse (pytest's own tmp is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="gpuaas-pre-", dir="/var/tmp"))
    root.chmod(0o755)
    (root / "etc/libvirt").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                                     f"libvirt-qemu:x:{QEMU_UID}:{KVM_GID}:Libvirt Qemu:/var/lib/libvirt:/usr/sbin/nologin\n")
    (root / "etc/group").write_text(f"root:x:0:\nkvm:x:{KVM_GID}:\nlibvirt-qemu:x:{QEMU_UID}:libvirt-qemu\n")
    (root / "etc/libvirt/qemu.conf").write_text('#user = "libvirt-qemu"\n#dynamic_ownership = 1\n')
    (root / "usr/share/OVMF").mkdir(parents=True)
    for name in ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"):
        (root / "usr/share/OVMF" / name).write_bytes(b"\0" * 4096)
    seed = root / SEED_DIR.lstrip("/")
    seed.mkdir(parents=True)
    for path in [seed, *seed.parents]:
        if path == root or root not in path.parents:
            break
        path.chmod(0o755)
    relay = root / RELAY.lstrip("/")
    relay.parent.mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuaas-terminal-relay", "-f",
                    str(relay.with_suffix(""))], check=True, timeout=30)
    (root / CACHE.lstrip("/")).mkdir(parents=True)
    return root


@dataclass
class World:
    """Everything a provision of slot 0 needs, all passing; a case breaks one piece."""

    host: Path
    machine: Path
    netns: str
    lab: DhcpLab
    proc: Path | None = None  # None: the live /proc
    bridge_exists: bool = True
    image_size_hint: int | None = 1 << 20
    slice_overrides: dict = field(default_factory=dict)

    def slice_config(self) -> SliceConfig:
        return SliceConfig(**{"seed_dir": Path(SEED_DIR), "terminal_relay_key_file": Path(RELAY),
                              "dnsmasq_hosts_file": self.lab.dnsmasq.hosts_file,
                              "dnsmasq_pid_file": self.lab.dnsmasq.pid_file, **self.slice_overrides})

    def check(self):
        return check_provision_preconditions(
            HostRoot.open(self.host), HostRoot.open(self.machine), self.slice_config(), PROFILE,
            numa_node=NODE, gpu_pci_address=GPU, fabric_vf_pci_address=VF, bridge_exists=self.bridge_exists,
            image_cache_dir=CACHE, image_size_hint=self.image_size_hint,
            proc=HostRoot.open(self.proc or "/"), net=HostRoot.open("/"), netns=self.netns)


@pytest.fixture
def world(dhcp_lab, host_copy) -> Iterator[World]:
    machine = _machine_root()
    try:
        with slice_namespace() as netns:
            # with the kernel's reset_method, which a release's GPU handover needs (guards/gpureset.py)
            yield World(host=between_tenants(host_copy(H200.name)), machine=machine, netns=netns, lab=dhcp_lab)
    finally:
        subprocess.run(["umount", str(machine / SEED_DIR.lstrip("/"))], capture_output=True, timeout=30)
        shutil.rmtree(machine)


def test_every_precondition_holds_on_a_prepared_host(world):
    result = world.check()
    assert result.checks_passed == ["kvm_usable", "hugepages_free", "vfio_groups_viable", "gpu_handover_ready",
                                    "cache_space", "seed_dir", "relay_key", "ovmf", "bridge_owns_gateway",
                                    "dnsmasq_reads_hosts"]
    assert result.gpu_handover is not None and result.gpu_handover.gpu_reset.method.value == "sbr"
    assert result.gpu_handover.fabric_vf_reset_methods == ["flr"]
    assert result.hugepages_1g_needed == 64 and result.hugepages_1g_free == 256
    assert [v.address for v in result.vfio] == [GPU, VF]
    assert result.seed_dir.qemu_user.name == "libvirt-qemu" and all(c.ok for c in result.seed_dir.components)
    assert [c.path for c in result.seed_dir.components][:2] == ["/", "/var"]
    assert result.relay_key.key_type == "ssh-ed25519" and result.relay_key.private_mode == "0o600"
    assert result.ovmf.code_path == "/usr/share/OVMF/OVMF_CODE_4M.fd"
    assert result.gateway == "10.100.0.1/24"
    dnsmasq_pid = world.lab.dnsmasq.proc.pid
    assert result.dnsmasq.readers == [dnsmasq_pid] and result.dnsmasq.pid_file_pid == dnsmasq_pid
    assert f"dhcp-hostsfile={world.lab.dnsmasq.hosts_file} (command line)" in result.dnsmasq.via
    # The journal stores it: it is a wire model and survives a round trip.
    assert type(result).model_validate_json(result.model_dump_json()) == result


def _rm(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _kvm_dir(w: World) -> None:
    (w.host / "dev/kvm").unlink()
    (w.host / "dev/kvm").mkdir()


def _read_only_seed_dir(w: World) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,mode=0755", "tmpfs", str(w.machine / SEED_DIR.lstrip("/"))],
                   check=True, timeout=30)


def _hostsfile_elsewhere(w: World) -> None:
    w.slice_overrides["dnsmasq_hosts_file"] = w.lab.dnsmasq.hosts_file.with_name("other-hosts")


def _pid_file_elsewhere(w: World) -> None:
    pid_file = w.lab.dnsmasq.pid_file.with_name("stale.pid")
    pid_file.write_text("1\n")
    w.slice_overrides["dnsmasq_pid_file"] = pid_file


def _no_dnsmasq_in_process_table(w: World) -> None:
    """A process table (a real directory tree) with one process, which is not dnsmasq."""
    w.proc = w.machine / "proc-root"
    (w.proc / "proc/1").mkdir(parents=True)
    (w.proc / "proc/1/comm").write_text("systemd\n")
    (w.proc / "proc/1/cmdline").write_bytes(b"/sbin/init\0")


def _gpu_sharing_its_bridge(w: World) -> None:
    """A second function below the GPU's switch port: only an FLR, after which no memory clear is proven."""
    gpu = w.host / "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0"
    (gpu.parent / "0000:18:00.1").mkdir()


def _gateway_gone(w: World) -> None:
    subprocess.run(["ip", "-n", w.netns, "addr", "del", "10.100.0.1/24", "dev", "ovsbr0"], check=True, timeout=20)


CASES: dict[str, tuple[Callable[[World], None], str, str]] = {
    # name: (break it, code, a piece of evidence that names what was read)
    "kvm_missing": (lambda w: (w.host / "dev/kvm").unlink(), "kvm_missing", "/dev/kvm"),
    "kvm_not_a_device": (_kvm_dir, "kvm_unusable", "mode"),
    "hugepages_short": (lambda w: (w.host / "sys/devices/system/node/node0/hugepages/hugepages-1048576kB/free_hugepages")
                        .write_text("10\n"), "hugepages_insufficient", "free_hugepages"),
    "hugepages_no_pool": (lambda w: shutil.rmtree(w.host / "sys/devices/system/node/node0/hugepages/hugepages-1048576kB"),
                          "hugepages_unknown", "free_hugepages"),
    "gpu_without_iommu_group": (lambda w: (w.host / "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/"
                                           "0000:18:00.0/iommu_group").unlink(), "no_iommu_group", GPU),
    "gpu_admin_tool_missing": (lambda w: w.slice_overrides.update(gpu_admin_tool=Path("/nonexistent/nvidia_gpu_tools.py")),
                               "gpu_handover_tool_missing", "nvidia_gpu_tools.py"),
    "gpu_without_reset_method": (lambda w: (w.host / f"sys/bus/pci/devices/{GPU}/reset_method").unlink(),
                                 "gpu_reset_path_missing", GPU),
    "gpu_sharing_its_bridge": (_gpu_sharing_its_bridge, "gpu_memory_clear_unprovable", "0000:18:00.1"),
    "vf_without_flr": (lambda w: (w.host / f"sys/bus/pci/devices/{VF}/reset_method").write_text("bus\n"),
                       "gpu_reset_path_missing", VF),
    "cache_too_small": (lambda w: setattr(w, "image_size_hint", 1 << 62), "cache_space_insufficient", "free_bytes"),
    "seed_dir_missing": (lambda w: _rm(w.machine / SEED_DIR.lstrip("/")), "seed_dir_missing", SEED_DIR),
    "var_lib_libvirt_0700": (lambda w: (w.machine / "var/lib/libvirt").chmod(0o700), "seed_dir_unreadable_by_qemu",
                             "/var/lib/libvirt"),
    "seed_dir_0700": (lambda w: (w.machine / SEED_DIR.lstrip("/")).chmod(0o700), "seed_dir_unreadable_by_qemu",
                      SEED_DIR),
    "seed_dir_read_only": (_read_only_seed_dir, "seed_dir_not_writable", SEED_DIR),
    "relay_pub_missing": (lambda w: (w.machine / RELAY.lstrip("/")).unlink(), "relay_key_missing", RELAY),
    "relay_pub_not_ed25519": (lambda w: (w.machine / RELAY.lstrip("/")).write_text("ssh-rsa AAAAB3NzaC1yc2E= x\n"),
                              "relay_key_invalid", RELAY),
    "relay_pub_truncated": (lambda w: (w.machine / RELAY.lstrip("/")).write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5\n"),
                            "relay_key_invalid", RELAY),
    "relay_private_missing": (lambda w: (w.machine / RELAY.lstrip("/")).with_suffix("").unlink(), "relay_key_missing",
                              "id_ed25519"),
    "relay_private_0644": (lambda w: (w.machine / RELAY.lstrip("/")).with_suffix("").chmod(0o644),
                           "relay_key_permissions", "0o644"),
    "relay_private_not_root": (lambda w: os.chown((w.machine / RELAY.lstrip("/")).with_suffix(""), 65534, 65534),
                               "relay_key_permissions", "65534"),
    "ovmf_missing": (lambda w: shutil.rmtree(w.machine / "usr/share/OVMF"), "ovmf_missing", "passed_over"),
    "bridge_missing": (lambda w: setattr(w, "bridge_exists", False), "ovs_bridge_missing", "ovsbr0"),
    "gateway_missing": (_gateway_gone, "bridge_gateway_missing", "10.100.0.1/24"),
    "dnsmasq_not_running": (_no_dnsmasq_in_process_table, "dnsmasq_not_running", "processes"),
    "dnsmasq_reads_another_file": (_hostsfile_elsewhere, "dnsmasq_not_reading_hosts", "other-hosts"),
    "dnsmasq_pid_file_stale": (_pid_file_elsewhere, "dnsmasq_pid_file_mismatch", "stale.pid"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_broken_precondition_is_a_typed_refusal_with_evidence(world, case):
    breaker, code, seen = CASES[case]
    breaker(world)
    with pytest.raises(PreconditionRefused) as err:
        world.check()
    assert err.value.code == code, (err.value.code, err.value.message)
    assert seen in repr(err.value.evidence) or seen in err.value.message, err.value.evidence


def test_an_emulated_lab_profile_needs_neither_kvm_nor_hugepages_nor_vfio(world):
    (world.host / "dev/kvm").unlink()
    lab = get_profile("lab_tcg_1c_512m")
    result = check_provision_preconditions(
        HostRoot.open(world.host), HostRoot.open(world.machine), world.slice_config(), lab, numa_node=None,
        gpu_pci_address=None, fabric_vf_pci_address=None, bridge_exists=True, image_cache_dir=CACHE,
        proc=HostRoot.open("/"), net=HostRoot.open("/"), netns=world.netns)
    assert result.kvm == "not_required" and result.hugepages_1g_needed == 0 and result.vfio == []
    assert "cache_space_unknown_size" in result.checks_passed


def test_qemu_conf_user_wins_over_the_distribution_default(tmp_path):
    (tmp_path / "etc/libvirt").mkdir(parents=True)
    (tmp_path / "etc/passwd").write_text("qemu:x:107:107::/:/sbin/nologin\nlibvirt-qemu:x:64055:109::/:/bin/false\n")
    (tmp_path / "etc/group").write_text("kvm:x:36:qemu\n")
    root = HostRoot.open(tmp_path)
    assert qemu_user(root).name == "libvirt-qemu"  # first of the defaults that exists
    (tmp_path / "etc/libvirt/qemu.conf").write_text('user = "qemu"  # site choice\ngroup = "kvm"\n')
    user = qemu_user(root)
    assert (user.name, user.uid, user.gid, user.groups) == ("qemu", 107, 36, [36])
    assert user.source == "/etc/libvirt/qemu.conf user=qemu"
    (tmp_path / "etc/libvirt/qemu.conf").write_text('user = "nobody"\n')
    with pytest.raises(PreconditionRefused) as err:
        qemu_user(root)
    assert err.value.code == "qemu_user_unknown"
