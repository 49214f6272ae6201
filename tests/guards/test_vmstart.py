"""Start preconditions over the recorded 8xH200 host (copied, then bent) and the live machine.

The recording has the GPUs on ``nvidia`` (the state before slice mode binds
them): a small root with its NUMA tree and the slot's GPU and VF re-pointed to
``vfio-pci`` is the host right after binding. The disk evidence comes from the real disk guard on a
loop disk where the test runs on the live host.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpuaas_agent.contract.storage import DiskEvidence
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.guards.vmstart import REQUIRED_DISK_CHECKS, VmStartRefused, check_kvm, check_vm_start
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host
from tests.support.domain_specs import lab_spec, production_spec

LIVE = HostRoot.open("/")
H200_ROOT = fixture_host("h200-slice-after-transition")
SLOT0 = production_spec(0)


def _fixture_disk_evidence(by_id: str = SLOT0.nvme_device, checks=REQUIRED_DISK_CHECKS) -> DiskEvidence:
    """What the disk guard reports for slot 0's disk on the recorded host (it cannot open a recording's disk)."""
    return DiskEvidence(by_id=by_id, kernel_name="nvme3n1", dev="259:3", size_bytes=3840755982336,
                        partitions=[], checks_passed=list(checks))


def _slot_host(tmp_path: Path, *, bound: tuple[str, ...]) -> Path:
    """A small root holding what this guard reads, taken from the recorded host.

    The recorded NUMA tree and /dev/kvm placeholder are copied as they are; each of
    slot 0's PCI functions gets a ``driver`` link: ``vfio-pci`` when listed in
    ``bound``, otherwise the driver the recording has (``nvidia`` / ``mlx5_core``).
    """
    root = tmp_path / "host"
    shutil.copytree(H200_ROOT / "sys/devices/system/node", root / "sys/devices/system/node", symlinks=True)
    (root / "dev").mkdir()
    shutil.copy2(H200_ROOT / "dev/kvm", root / "dev/kvm")
    recorded = HostRoot.open(H200_ROOT)
    for address in (SLOT0.gpu_pci_address, SLOT0.fabric_vf_pci_address):
        driver = "vfio-pci" if address in bound else recorded.link_name(f"/sys/bus/pci/devices/{address}/driver")
        entry = root / "sys/bus/pci/devices" / address
        entry.mkdir(parents=True)
        (root / "sys/bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../drivers/{driver}", entry / "driver")
    return root


@pytest.fixture
def bound_host(tmp_path):
    """The recorded host after slot 0's GPU and VF went to vfio-pci."""
    return _slot_host(tmp_path, bound=(SLOT0.gpu_pci_address, SLOT0.fabric_vf_pci_address))


def _refusal(root: Path, spec=SLOT0, **kw) -> VmStartRefused:
    kw.setdefault("bridge_exists", True)
    kw.setdefault("disk", _fixture_disk_evidence(spec.nvme_device))
    with pytest.raises(VmStartRefused) as err:
        check_vm_start(HostRoot.open(root), spec, **kw)
    return err.value


def test_production_slot_passes_on_a_bound_host(bound_host):
    asked = []
    evidence = check_vm_start(
        HostRoot.open(bound_host), SLOT0, bridge_exists=lambda b: asked.append(b) or True,
        disk=_fixture_disk_evidence(),
    )
    assert asked == ["ovsbr0"]
    assert evidence.kvm == "usable" and evidence.vfio_bound == ["0000:18:00.0", "0000:19:00.1"]
    assert (evidence.hugepages_1g_needed, evidence.hugepages_1g_free, evidence.numa_node) == (64, 256, 0)
    assert evidence.checks_passed == [
        "kvm_usable", "ovs_bridge_exists", "hugepages_free", "hostdevs_on_vfio", "disk_guard_passed"
    ]


def test_gpu_still_on_nvidia_is_refused(tmp_path):
    """Seed 004: host GPU services held the device and libvirt could not detach it."""
    err = _refusal(_slot_host(tmp_path, bound=()))
    assert err.code == "not_bound_to_vfio"
    assert err.evidence["address"] == "0000:18:00.0" and err.evidence["driver"] == "nvidia"


def test_vf_not_on_vfio_is_refused(tmp_path):
    err = _refusal(_slot_host(tmp_path, bound=(SLOT0.gpu_pci_address,)))
    assert err.code == "not_bound_to_vfio" and err.evidence["address"] == "0000:19:00.1"
    assert err.evidence["driver"] == "mlx5_core"


def test_missing_kvm_is_refused(bound_host):
    (bound_host / "dev" / "kvm").unlink()
    err = _refusal(bound_host)
    assert err.code == "kvm_missing" and err.evidence["path"] == "/dev/kvm"


def test_kvm_that_is_not_a_device_is_refused(bound_host):
    (bound_host / "dev" / "kvm").unlink()
    (bound_host / "dev" / "kvm").mkdir()
    assert _refusal(bound_host).code == "kvm_unusable"


def test_live_kvm_is_usable_for_root():
    assert os.geteuid() == 0, "these tests run as root (docs/testing.md)"
    assert check_kvm(LIVE) == "usable"


def test_missing_bridge_is_refused_whether_given_as_bool_or_check(bound_host):
    assert _refusal(bound_host, bridge_exists=False).code == "ovs_bridge_missing"
    err = _refusal(bound_host, bridge_exists=lambda name: name == "br-other")
    assert err.code == "ovs_bridge_missing" and err.evidence["ovs_bridge"] == "ovsbr0"


def test_too_few_free_hugepages_on_the_gpus_node_is_refused(bound_host):
    node0 = bound_host / "sys/devices/system/node/node0/hugepages/hugepages-1048576kB/free_hugepages"
    node0.write_text("63\n")  # node 1 still has 256: they do not count for a VM pinned to node 0
    err = _refusal(bound_host)
    assert err.code == "hugepages_insufficient"
    assert (err.evidence["free"], err.evidence["needed"], err.evidence["numa_node"]) == (63, 64, 0)


def test_node_without_a_1g_pool_is_refused(bound_host):
    pool = bound_host / "sys/devices/system/node/node0/hugepages/hugepages-1048576kB"
    for entry in pool.iterdir():
        entry.unlink()
    pool.rmdir()
    assert _refusal(bound_host).code == "hugepages_unknown"


def test_disk_evidence_for_another_disk_is_refused(bound_host):
    other = production_spec(5).nvme_device
    err = _refusal(bound_host, disk=_fixture_disk_evidence(other))
    assert err.code == "disk_guard_mismatch" and err.evidence["nvme_device"] == SLOT0.nvme_device


def test_disk_evidence_missing_a_check_is_refused(bound_host):
    partial = [c for c in REQUIRED_DISK_CHECKS if c != "no_mounted_children"]
    err = _refusal(bound_host, disk=_fixture_disk_evidence(checks=partial))
    assert err.code == "disk_guard_mismatch" and err.evidence["missing_checks"] == ["no_mounted_children"]


def test_lab_profile_on_this_machine_with_a_real_disk_guard(realdev):
    disk = realdev.disk(16)
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    spec = lab_spec(nvme_device=disk.by_id)
    result = check_vm_start(LIVE, spec, bridge_exists=True, disk=evidence)
    assert result.kvm == "not_required" and result.vfio_bound == [] and result.hugepages_1g_needed == 0
    assert result.disk == evidence
    assert result.checks_passed == ["ovs_bridge_exists", "disk_guard_passed"]
