"""Boot recovery (issue 17 item 2): the first start after a host reboot re-validates and restores active slices.

The reboot is simulated the way the lab can: the slice was leased on the after-transition
host (its lease holds the disk's by-id path and identity); the "rebooted" host is the
recorded after-reboot tree (every NVMe kernel name moved: slot 0's disk went from nvme3n1
to nvme5n1) with slot 0's disk backed by a real loop device, a new kernel boot_id, and the
slice's domain shut off (libvirt's ``test:///default``). Real: the SQLite store, a private
ovsdb-server + ovs-vswitchd, the disk guard on a real block device, the guarded start.
One OVS switch and one loop host serve the whole module.

The vfio-pci re-bind runs on a copy of the after-transition host, whose GPUs and VFs are
back on ``nvidia`` / ``mlx5_core`` as after a boot; the kernel's part of a bind is played
on the copy (the fixture's files are not a kernel), as in tests/host/devices/test_vfio.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import libvirt
import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.domain import DomainSpec, OvmfFirmware
from gpuaas_agent.contract.isolation import GUARD_TABLE
from gpuaas_agent.contract.naming import domain_name
from gpuaas_agent.contract.runtime import OnHostBoot, get_profile
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import PowerState, SlotDetail, SlotLease, SlotRecord
from gpuaas_agent.contract.vfio import SysfsWrite
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.network.dnsmasq import make_reservation
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.boot_recovery import (
    BOOT_ID_KEY,
    BOOT_ID_PATH,
    SlotRecovery,
    boot_action,
    check_boot,
    rebind,
)
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.reconcile import reconcile
from lab.loophost import materialize
from tests.conftest import HOSTS, fixture_host
from tests.support.ovsdb_fixture import running_ovs
from tests.support.realdev import require_root

URI = "test:///default"
MiB = 1 << 20
FIRMWARE = OvmfFirmware(code_path="/usr/share/OVMF/OVMF_CODE_4M.fd",
                        vars_template_path="/usr/share/OVMF/OVMF_VARS_4M.fd")
BOOT_A = "0b5a6c1e-4c0d-4a4e-9d7e-1f2a3b4c5d6e"
BOOT_B = "7d3c2b1a-9e8f-4a6b-8c7d-6e5f4a3b2c1d"


@pytest.fixture(scope="module")
def test_driver():
    """test:///default forgets its domains when its last connection closes: hold one for the module."""
    conn = libvirt.open(URI)
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, test_driver):
    """The rebooted host (loop-backed slot 0) and one OVS switch, shared by the module."""
    require_root()
    work = tmp_path_factory.mktemp("boot")
    host = materialize(HOSTS / "h200-slice-after-reboot", work / "host", disk_bytes=16 * MiB, slots=1,
                       real_links=False)
    try:
        with running_ovs() as sw:
            yield host, sw, work
    finally:
        for family in ("inet", "arp"):  # the start's host-side guard, made in this (root) namespace
            subprocess.run(["nft", "delete", "table", family, GUARD_TABLE], check=False, capture_output=True,
                           timeout=30)
        assert host.close() == []


@dataclass
class Slice:
    sh: SliceDrivers
    store: StateStore
    lease: SlotLease
    root: Path

    @property
    def name(self) -> str:
        return domain_name(self.lease.allocation_id)

    def running(self, conn) -> bool:
        return bool(conn.lookupByName(self.name).isActive())

    def run(self, coro_fn):
        async def go():
            self.sh.libvirt = LibvirtLifecycle(URI)  # asyncio.run closes the loop its executor belongs to
            try:
                return await coro_fn()
            finally:
                await self.sh.libvirt.close()

        return asyncio.run(go())


def _set_boot_id(root: Path, value: str) -> None:
    path = root / BOOT_ID_PATH.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")


@pytest.fixture
def shut_off_slice(lab, tmp_path, test_driver):
    """Slot 0 as a host reboot leaves it: leased before the reboot, record active (running), domain shut off."""
    host, sw, _work = lab
    before = discover(HostRoot.open(fixture_host("h200-slice-after-transition")))
    slot = before.candidate_slots[0]
    identity = next(d.disk_identity for d in before.nvme_devices if d.by_id == slot.nvme_device)
    alloc = str(uuid.uuid4())
    lease = SlotLease(allocation_id=alloc, slot_index=0, gpu_pci_address=slot.gpu_pci_address,
                      nvme_device=slot.nvme_device, disk_identity=identity,
                      fabric_vf_pci_address=slot.fabric_vf_pci_address, task_id="t-provision", taken_at=time.time())
    spec = DomainSpec(allocation_id=alloc, slot_index=0, task_id="t-provision", profile=get_profile("lab_tcg_1c_512m"),
                      nvme_device=slot.nvme_device, mac=slot.mac, ovs_bridge=sw.bridge,
                      seed_iso_path=str(tmp_path / "seed.iso"), firmware=FIRMWARE, agent_version="0.1.0")
    sh = SliceDrivers(host_root=host.root,
                   slice=SliceConfig(allow_emulated_domains=True, ovsdb_remote=sw.remote,
                                     dnsmasq_hosts_file=tmp_path / "dnsmasq-hosts",
                                     dnsmasq_pid_file=tmp_path / "dnsmasq.pid",
                                     dnsmasq_lease_file=tmp_path / "dnsmasq.leases"),
                   images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle(URI))
    sh.reservations().add(make_reservation(alloc, 0, slot.mac, slot.private_ip, "slice-0"))
    store = StateStore.open(tmp_path / "state.db")
    store.take_lease(lease)
    store.set_slot_state(SlotRecord(slot_index=0, allocation_id=alloc, status=SlotStatus.active,
                                    health_state=HealthState.healthy,
                                    detail={"domain": spec.domain_name, "power_state": "running"},
                                    task_id="t-provision", updated_at=time.time()))
    store.set_meta(BOOT_ID_KEY, BOOT_A)  # the boot the slice was provisioned in
    _set_boot_id(host.root, BOOT_B)  # the host rebooted since
    s = Slice(sh=sh, store=store, lease=lease, root=host.root)
    s.run(lambda: sh.libvirt.define(spec))
    assert not s.running(test_driver)
    yield s
    dom = test_driver.lookupByName(spec.domain_name)
    if dom.isActive():
        dom.destroy()
    dom.undefine()
    store.close()


def _kinds(report) -> list[tuple[str, str]]:
    return sorted((f.kind.value, f.severity.value) for f in report.findings)


def test_after_a_reboot_an_active_slice_is_revalidated_and_restarted_once(shut_off_slice, test_driver):
    s = shut_off_slice
    # Before recovery, reconcile names the shut-off domain of the active slot, as an error.
    before = s.run(lambda: reconcile(s.sh, s.store, repair=False))
    assert ("domain_shutoff", "error") in _kinds(before)
    assert not [f for f in before.findings if f.kind.value.startswith("slot_device")]  # renamed NVMe: no finding

    report = s.run(lambda: check_boot(s.sh, s.store))
    assert report.trigger.value == "boot" and _kinds(report) == [("boot_restarted", "info")]
    assert "disk_guard_passed" in report.findings[0].detail["checks_passed"]
    assert s.running(test_driver)
    record = s.store.slot_state(0)
    assert record.status is SlotStatus.active and record.health_state is HealthState.healthy
    assert record.detail.power_state == "running"
    assert record.detail.boot_recovery.outcome == "restarted"
    assert record.detail.boot_recovery.boot_id == BOOT_B
    assert s.store.meta(BOOT_ID_KEY) == BOOT_B and s.store.leases() == [s.lease]

    # The same boot again (an agent restart): nothing runs.
    assert s.run(lambda: check_boot(s.sh, s.store)) is None


def test_a_slice_the_tenant_stopped_stays_stopped_after_a_reboot(shut_off_slice, test_driver):
    s = shut_off_slice
    record = s.store.slot_state(0)
    s.store.set_slot_state(record.model_copy(update={"detail": record.detail.updated(power_state="stopped")}))
    report = s.run(lambda: check_boot(s.sh, s.store))
    assert _kinds(report) == [("boot_restart_held", "info")]
    assert report.findings[0].detail["reason"] == "tenant_stopped"
    assert not s.running(test_driver)
    assert s.store.meta(BOOT_ID_KEY) == BOOT_B


def test_a_disk_whose_identity_changed_over_the_reboot_is_never_started(shut_off_slice, test_driver):
    """The lease's by-id path now resolves to another namespace: typed findings, the domain stays off."""
    s = shut_off_slice
    link = s.root / s.lease.nvme_device.lstrip("/")
    original = os.readlink(link)
    other = next(d for d in discover(HostRoot.open(s.root)).nvme_devices
                 if d.by_id and d.by_id != s.lease.nvme_device and d.disk_identity and not d.mountpoints
                 and d.kernel_name != os.path.basename(original))
    os.unlink(link)
    os.symlink(f"../../{other.kernel_name}", link)
    try:
        report = s.run(lambda: check_boot(s.sh, s.store))
    finally:
        os.unlink(link)
        os.symlink(original, link)
    assert _kinds(report) == [("boot_restart_refused", "error"), ("slot_device_moved", "error")]
    moved = next(f for f in report.findings if f.kind.value == "slot_device_moved")
    assert (moved.subject, moved.expected, moved.actual) == (s.lease.nvme_device, s.lease.disk_identity,
                                                             other.disk_identity)
    assert not s.running(test_driver)
    record = s.store.slot_state(0)
    assert record.health_state is HealthState.failed and record.detail.boot_recovery.outcome == "refused"
    assert s.store.leases() == [s.lease]  # nothing released: a release or an operator decides


def test_a_disk_gone_over_the_reboot_is_a_missing_device_and_nothing_starts(shut_off_slice, test_driver):
    s = shut_off_slice
    link = s.root / s.lease.nvme_device.lstrip("/")
    original = os.readlink(link)
    os.unlink(link)
    try:
        report = s.run(lambda: check_boot(s.sh, s.store))
    finally:
        os.symlink(original, link)
    assert _kinds(report) == [("boot_restart_refused", "error"), ("slot_device_missing", "error")]
    assert not s.running(test_driver)


def test_boot_policy_is_per_profile_and_the_tenant_stop_wins():
    record = SlotRecord(slot_index=0, allocation_id=str(uuid.uuid4()), status=SlotStatus.active,
                        health_state=HealthState.healthy, detail={"power_state": "running"}, task_id="t", updated_at=0)
    h200 = get_profile("h200_1g_24c_64g")
    assert h200.on_host_boot is OnHostBoot.restart and boot_action(h200, record) == "restart"
    held = h200.model_copy(update={"on_host_boot": OnHostBoot.leave_stopped})
    assert boot_action(held, record) == "policy"
    stopped = record.model_copy(update={"detail": SlotDetail(power_state=PowerState.stopped)})
    assert boot_action(h200, stopped) == "tenant_stopped"


# -- vfio-pci re-bind after the boot, through host/devices/vfio.py's guarded path ----------------------------------


class Kernel:
    """The kernel's part of a bind on a fixture copy, for any address: unbind drops ``driver``, probe links it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: list[SysfsWrite] = []

    def _dir(self, address: str) -> Path:
        return (self.root / "sys/bus/pci/devices" / address).resolve()

    def __call__(self, step: SysfsWrite) -> None:
        self.seen.append(step)
        if step.path.endswith("/unbind"):
            (self._dir(step.value) / "driver").unlink()
        elif step.path == "/sys/bus/pci/drivers_probe":
            device = self._dir(step.value)
            override = (device / "driver_override").read_text().strip()
            os.symlink(os.path.relpath(self.root / "sys/bus/pci/drivers" / override, device), device / "driver")


def _rebind_lease(root: Path) -> SlotLease:
    slot = discover(HostRoot.open(root)).candidate_slots[0]
    return SlotLease(allocation_id=str(uuid.uuid4()), slot_index=0, gpu_pci_address=slot.gpu_pci_address,
                     nvme_device=slot.nvme_device, disk_identity="nguid:00aa",
                     fabric_vf_pci_address=slot.fabric_vf_pci_address, task_id="t", taken_at=0)


def _sh(root: Path, tmp_path: Path) -> SliceDrivers:
    return SliceDrivers(host_root=root, slice=SliceConfig(), images=ImageCache(tmp_path / "cache"),
                     libvirt=LibvirtLifecycle(URI))


def test_the_gpu_and_vf_back_on_their_host_drivers_are_rebound_to_vfio(host_copy, tmp_path):
    root = host_copy("h200-slice-after-transition")
    lease = _rebind_lease(root)
    host = HostRoot.open(root)
    assert host.link_name(f"/sys/bus/pci/devices/{lease.gpu_pci_address}/driver") == "nvidia"
    assert host.link_name(f"/sys/bus/pci/devices/{lease.fabric_vf_pci_address}/driver") == "mlx5_core"
    rec, kernel = SlotRecovery(lease), Kernel(root)
    assert asyncio.run(rebind(_sh(root, tmp_path), lease, rec, kernel)) and rec.findings == []
    fresh = HostRoot.open(root)
    for address in (lease.gpu_pci_address, lease.fabric_vf_pci_address):
        assert fresh.link_name(f"/sys/bus/pci/devices/{address}/driver") == "vfio-pci"
        assert (root / f"sys/bus/pci/devices/{address}/driver_override").read_text() == "vfio-pci"
    assert [w.path for w in kernel.seen if w.value == lease.gpu_pci_address] == [
        "/sys/bus/pci/drivers/nvidia/unbind", "/sys/bus/pci/drivers_probe"]
    # Again (a second start in the same boot): nothing written.
    again = Kernel(root)
    assert asyncio.run(rebind(_sh(root, tmp_path), lease, SlotRecovery(lease), again)) and again.seen == []


def test_a_rebind_the_guard_or_the_host_refuses_is_a_typed_finding_with_nothing_bound(host_copy, tmp_path):
    root = host_copy("h200-slice-after-transition")
    lease = _rebind_lease(root)
    shutil.rmtree(root / "sys/bus/pci/drivers/vfio-pci")  # the module did not load at boot
    rec = SlotRecovery(lease)
    assert not asyncio.run(rebind(_sh(root, tmp_path), lease, rec, Kernel(root)))
    (finding,) = rec.findings
    assert (finding.kind.value, finding.subject, finding.detail["code"]) == (
        "slot_rebind_failed", lease.gpu_pci_address, "vfio_driver_missing")
    assert HostRoot.open(root).link_name(f"/sys/bus/pci/devices/{lease.gpu_pci_address}/driver") == "nvidia"



def test_a_gpu_whose_iommu_group_is_not_isolated_is_not_rebound(host_copy, tmp_path):
    """The guard runs first: the slot's NVMe controller joined the GPU's IOMMU group, so nothing is written."""
    root = host_copy("h200-slice-after-transition")
    lease = _rebind_lease(root)
    gpu = (root / "sys/bus/pci/devices" / lease.gpu_pci_address).resolve()
    group = Path(os.path.realpath(gpu / "iommu_group"))
    nvme = (root / "sys/bus/pci/devices/0000:1a:00.0").resolve()
    os.symlink(os.path.relpath(nvme, group / "devices"), group / "devices" / "0000:1a:00.0")
    (nvme / "iommu_group").unlink()
    os.symlink(os.path.relpath(group, nvme), nvme / "iommu_group")
    rec, kernel = SlotRecovery(lease), Kernel(root)
    assert not asyncio.run(rebind(_sh(root, tmp_path), lease, rec, kernel))
    (finding,) = rec.findings
    assert (finding.kind.value, finding.detail["code"]) == ("slot_rebind_failed", "iommu_group_not_isolated")
    assert kernel.seen == [] and (root / f"sys/bus/pci/devices/{lease.gpu_pci_address}/driver_override"
                                  ).read_text().strip() == "(null)"
