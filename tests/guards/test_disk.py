"""The disk guard on real loop devices: every refusal of docs/safety.md §1, and the seed 004 case."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from gpuaas_agent.contract.storage import DiskLease
from gpuaas_agent.guards.disk import DiskGuardError, check_disk_writable, check_exclusive, read_disk_identity
from gpuaas_agent.host.run import run
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host
from tests.support.realdev import MiB, read_bytes

LIVE = HostRoot.open("/")
ALLOC = str(uuid.uuid4())


def refused(by_id: str, lease: DiskLease, **kw) -> DiskGuardError:
    with pytest.raises(DiskGuardError) as err:
        check_disk_writable(LIVE, by_id, lease=lease, **kw)
    return err.value


def test_passes_on_a_clean_loop_disk(realdev):
    disk = realdev.disk(32)
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    assert evidence.kernel_name == disk.name
    assert evidence.size_bytes == 32 * MiB
    assert evidence.partitions == []
    assert "exclusive_open" in evidence.checks_passed and "no_mounted_children" in evidence.checks_passed
    assert evidence.dev == open(f"/sys/class/block/{disk.name}/dev").read().strip()


def test_refuses_the_parent_of_a_mounted_partition_which_qemu_img_would_overwrite(realdev, tmp_path):
    """Seed 004: the parent is not mounted, its child is; qemu-img -n writes it anyway."""
    disk = realdev.disk(64, partitions_mib=[32])
    realdev.mkfs_ext4(disk.partitions[0])
    mountpoint = realdev.mount(disk.partitions[0])
    (mountpoint / "tenant-data").write_text("precious")
    err = refused(disk.by_id, disk.lease())
    assert err.code == "mounted_child"
    assert err.evidence["mounted_children"] == [{"node": disk.name + "p1", "mountpoint": str(mountpoint)}]
    assert err.evidence["kernel_name"] == disk.name
    # The exclusive open alone would also catch it...
    with pytest.raises(DiskGuardError) as busy:
        check_exclusive(LIVE, disk.name)
    assert busy.value.code == "busy"
    # ...but the writer itself does not refuse: prove the guard is the only protection,
    # using a scratch copy of the same disk so nothing of the test disk is written.
    scratch = realdev.disk(64, partitions_mib=[32], link=False)
    realdev.mkfs_ext4(scratch.partitions[0])
    realdev.mount(scratch.partitions[0])
    payload = tmp_path / "payload.raw"
    payload.write_bytes(b"\xa5" * MiB)
    asyncio.run(run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", str(payload), scratch.dev], timeout=60))
    assert read_bytes(scratch.dev, 0, MiB) == b"\xa5" * MiB, "qemu-img -n did overwrite a disk with a mounted child"
    # and the guarded disk still has its GPT and filesystem
    assert read_bytes(disk.dev, 512, 8) == b"EFI PART"
    assert (mountpoint / "tenant-data").read_text() == "precious"


def test_refuses_a_mounted_whole_disk(realdev):
    disk = realdev.disk(32)
    realdev.mkfs_ext4(disk.dev)
    realdev.mount(disk.dev)
    assert refused(disk.by_id, disk.lease()).code == "mounted"


def test_refuses_a_partition_by_id(realdev):
    disk = realdev.disk(64, partitions_mib=[16])
    link = realdev.by_id_link(f"../../{disk.name}p1")
    lease = DiskLease(allocation_id=ALLOC, slot_index=0, nvme_device=link, disk_identity=disk.identity)
    err = refused(link, lease)
    assert err.code == "not_whole_disk" and err.evidence["kernel_name"] == disk.name + "p1"


def test_refuses_dangling_and_looping_links_and_non_by_id_paths(realdev):
    dangling = realdev.by_id_link("../../gpuaas-no-such-disk")
    assert refused(dangling, DiskLease(allocation_id=ALLOC, slot_index=0, nvme_device=dangling, disk_identity="dev:1:1")).code == "missing"
    loop_a = realdev.by_id_link("placeholder")
    loop_b = realdev.by_id_link(os.path.basename(loop_a))
    os.unlink(loop_a)
    os.symlink(os.path.basename(loop_b), loop_a)
    err = refused(loop_a, DiskLease(allocation_id=ALLOC, slot_index=0, nvme_device=loop_a, disk_identity="dev:1:1"))
    assert err.code == "missing" and err.evidence["reason"] == "symlink_loop"
    absent = "/dev/disk/by-id/gpuaas-test-absent"
    assert refused(absent, DiskLease(allocation_id=ALLOC, slot_index=0, nvme_device=absent, disk_identity="dev:1:1")).code == "missing"
    disk = realdev.disk(16)
    assert refused(disk.dev, disk.lease()).code == "not_by_id"
    assert refused("/dev/disk/by-id/../../" + disk.name, disk.lease()).code == "not_by_id"


def test_refuses_swap(realdev):
    disk = realdev.disk(64, partitions_mib=[16])
    realdev.swapon(disk.partitions[0])
    err = refused(disk.by_id, disk.lease())
    assert err.code == "swap" and err.evidence["swap"] == [disk.name + "p1"]


def test_refuses_a_disk_of_another_slot(realdev):
    mine, other = realdev.disk(16), realdev.disk(16)
    err = refused(other.by_id, mine.lease())
    assert err.code == "not_in_lease" and err.evidence["lease"]["nvme_device"] == mine.by_id


def test_refuses_a_disk_used_by_another_domain(realdev):
    disk = realdev.disk(16)
    for used_as in (disk.by_id, disk.dev, disk.name):
        err = refused(disk.by_id, disk.lease(), domain_disks=["/var/lib/libvirt/images/x.qcow2", used_as])
        assert err.code == "in_use_by_domain" and err.evidence["domain_disk"] == used_as
    other = realdev.disk(16)
    check_disk_writable(LIVE, disk.by_id, lease=disk.lease(), domain_disks=[other.by_id])


def test_follows_the_link_each_time(realdev):
    """A link re-pointed between two calls is re-read (kernel names are advisory): it now names another
    disk, and a lease holds a disk by what it is, so the same link is refused for the old lease."""
    first, second = realdev.disk(16), realdev.disk(32)
    host = HostRoot.open("/")
    lease = first.lease()
    assert check_disk_writable(host, first.by_id, lease=lease).kernel_name == first.name
    os.unlink(first.by_id)
    os.symlink(f"../../{second.name}", first.by_id)
    err = refused(first.by_id, lease)
    assert err.code == "not_in_lease" and err.evidence["kernel_name"] == second.name
    # A lease of the disk the link names now is honoured: the walk reads the new target.
    evidence = check_disk_writable(host, first.by_id, lease=lease.model_copy(update={"disk_identity": second.identity}))
    assert evidence.kernel_name == second.name and evidence.size_bytes == 32 * MiB


def test_an_alias_of_the_leased_disk_passes_and_a_link_to_another_disk_is_not_in_lease(realdev):
    """Every by-id name of the leased disk is that disk; a name of another disk never is, whatever it is called."""
    disk, other = realdev.disk(16), realdev.disk(16)
    alias = realdev.by_id_link(f"../../{disk.name}")
    lease = disk.lease()
    evidence = check_disk_writable(LIVE, alias, lease=lease)
    assert evidence.kernel_name == disk.name and evidence.disk_identity == lease.disk_identity
    # The lease's own name re-pointed at another disk (a hostile alias) is refused.
    other_identity = other.identity
    assert other_identity != lease.disk_identity
    os.unlink(disk.by_id)
    os.symlink(f"../../{other.name}", disk.by_id)
    err = refused(disk.by_id, lease)
    assert err.code == "not_in_lease"
    assert err.evidence["disk_identity"] == other_identity and err.evidence["lease"]["disk_identity"] == lease.disk_identity


def test_a_domain_naming_the_disk_by_another_alias_or_a_partition_is_in_use_by_domain(realdev):
    """Compared by major:minor, not by path string: any name of the disk or of its partition counts."""
    disk = realdev.disk(64, partitions_mib=[16])
    alias = realdev.by_id_link(f"../../{disk.name}")
    for used_as in (alias, disk.partitions[0]):
        err = refused(disk.by_id, disk.lease(), domain_disks=[used_as])
        assert err.code == "in_use_by_domain" and err.evidence["domain_disk"] == used_as


def test_os_disk_is_refused_on_this_host():
    """Whatever holds / here is refused (through a temporary by-id link to it)."""
    import tempfile

    from tests.support.realdev import RealDevices, require_root

    require_root()
    root_dev = os.stat("/").st_dev
    names = [n for n in os.listdir("/sys/class/block")
             if open(f"/sys/class/block/{n}/dev").read().strip() == f"{os.major(root_dev)}:{os.minor(root_dev)}"]
    if not names:
        pytest.fail("/ is not on a block device here (overlay/anonymous): this test needs a disk-backed root")
    name = names[0]
    if os.path.exists(f"/sys/class/block/{name}/partition"):
        name = os.path.basename(os.path.dirname(os.path.realpath(f"/sys/class/block/{name}")))
    with tempfile.TemporaryDirectory() as tmp:
        devices = RealDevices(Path(tmp))
        try:
            link = devices.by_id_link(f"../../{name}")
            err = refused(link, DiskLease(allocation_id=ALLOC, slot_index=0, nvme_device=link,
                                          disk_identity=read_disk_identity(LIVE, link)))
        finally:
            devices.close()
    assert err.code == "os_disk"


# -- recorded hosts (docs/testing.md): the same guard over the 8×H200 fixtures --------------------------------

def _lease(by_id: str, host: str = "h200-slice-after-transition") -> DiskLease:
    return DiskLease(allocation_id=ALLOC, slot_index=0, nvme_device=by_id,
                     disk_identity=read_disk_identity(HostRoot.open(fixture_host(host)), by_id))


def test_recorded_host_share_disk_is_mounted_child():
    """Seed 004's host before the storage transition: nvme2n1 itself unmounted, its p1 at /share3."""
    host = HostRoot.open(fixture_host("h200-slice-before-transition"))
    by_id = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10e115"
    with pytest.raises(DiskGuardError) as err:
        check_disk_writable(host, by_id, lease=_lease(by_id, "h200-slice-before-transition"))
    assert err.value.code == "mounted_child"
    assert err.value.evidence["mounted_children"] == [{"node": "nvme2n1p1", "mountpoint": "/share3"}]


def test_recorded_host_os_disk_and_lvm_holder(host_copy):
    by_id = "/dev/disk/by-id/nvme-Dell_BOSS-N1_a3c7e1f2b4d60918"
    with pytest.raises(DiskGuardError) as err:
        check_disk_writable(HostRoot.open(fixture_host("h200-slice-after-transition")), by_id, lease=_lease(by_id))
    assert err.value.code == "os_disk" and err.value.evidence["os_mountpoints"] == ["/", "/boot", "/boot/efi"]
    # The same disk with nothing mounted: the LVM PV on p3 (dm-0) still holds it.
    root = host_copy("h200-slice-after-transition")
    mountinfo = root / "proc/self/mountinfo"
    mountinfo.write_text("".join(l for l in mountinfo.read_text().splitlines(True) if " 252:" not in l and " 259:" not in l))
    with pytest.raises(DiskGuardError) as err:
        check_disk_writable(HostRoot.open(root), by_id, lease=_lease(by_id))
    assert err.value.code == "holders" and err.value.evidence["holders"] == ["dm-0"]


def test_recorded_host_raw_slice_disk_passes_policy_but_has_no_device_node():
    """After the transition a slot disk passes every policy check; a recording has no /dev node to open."""
    host = HostRoot.open(fixture_host("h200-slice-after-transition"))
    by_id = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10e115"
    with pytest.raises(DiskGuardError) as err:
        check_disk_writable(host, by_id, lease=_lease(by_id))
    assert err.value.code == "missing" and err.value.evidence["kernel_name"] == "nvme2n1"


def test_the_state_stores_slot_lease_is_accepted(realdev):
    from gpuaas_agent.contract.state import SlotLease

    disk, other = realdev.disk(16), realdev.disk(16)
    lease = SlotLease(
        allocation_id=ALLOC, slot_index=3, gpu_pci_address="0000:1b:00.0", nvme_device=disk.by_id,
        disk_identity=disk.identity, fabric_vf_pci_address="0000:1a:00.2", task_id="t-1", taken_at=0.0,
    )
    assert check_disk_writable(LIVE, disk.by_id, lease=lease).kernel_name == disk.name
    err = refused(other.by_id, lease)
    assert err.code == "not_in_lease" and err.evidence["lease"]["slot_index"] == 3


def test_an_unreadable_mount_table_proves_nothing(host_copy):
    root = host_copy("h200-slice-after-transition")
    (root / "proc/self/mountinfo").unlink()
    by_id = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10e115"
    with pytest.raises(DiskGuardError) as err:
        check_disk_writable(HostRoot.open(root), by_id, lease=_lease(by_id))
    assert err.value.code == "unproven"
    assert err.value.evidence["findings"][0]["path"] == "/proc/self/mountinfo"
