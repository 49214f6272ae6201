"""Firmware inventory over recorded hosts, the baseline's judgement, the recorder, and before/after a tenancy."""

from __future__ import annotations

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.firmware import FirmwareBaselineRule
from gpuaas_agent.contract.parity import ParityStatus
from gpuaas_agent.discovery.firmware import (
    check_firmware_baseline,
    firmware_changes,
    judge_firmware,
    read_firmware,
    slot_firmware_devices,
)
from gpuaas_agent.discovery.record import record_fixture
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host

AFTER = "h200-slice-after-transition"
VBIOS_INFO = "Model: \t\t NVIDIA H200\nIRQ:   \t\t 180\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\n"


def _inv(root):
    return read_firmware(HostRoot.open(root))


def _by_key(inv):
    return {c.key: c for c in inv.components}


def test_the_recorded_h200_host_reports_nic_nvme_and_bios_firmware():
    comps = _by_key(_inv(fixture_host(AFTER)))
    assert comps["nic_fw:0000:19:00.0"].version == "28.43.1014" and comps["nic_fw:0000:19:00.0"].model == "DEL0000000047"
    assert comps["nic_fw:0000:19:00.1"].physfn == "0000:19:00.0"  # a VF runs its PF's firmware
    assert comps["nvme_fw:0000:1a:00.0"].version == "E2MU200" and comps["nvme_fw:0000:1a:00.0"].model.startswith("Micron_7450")
    assert comps["nvme_fw:0000:01:00.0"].model == "Dell BOSS-N1"
    assert comps["bios:dmi"].version == "2.7.5" and comps["bios:dmi"].model == "Dell Inc. PowerEdge XE9680"
    # The GPUs' VBIOS was not recorded (the synthetic host has no nvidia proc files): said, not invented.
    gpus = [c for c in comps.values() if c.kind == "gpu_vbios"]
    assert len(gpus) == 8 and all(c.version is None and "absent" in c.source for c in gpus)
    assert len([c for c in comps.values() if c.kind == "nvswitch_fw"]) == 4


def test_the_real_h200_recording_has_one_gpu_and_no_dmi():
    comps = _inv(fixture_host("h200-vm-passthrough")).components
    assert [(c.kind, c.id, c.model) for c in comps] == [("gpu_vbios", "0000:00:06.0", "10de:2335")]
    assert _inv(fixture_host("dev-box-no-gpu")).components == []


def test_vbios_from_the_nvidia_driver_and_the_recorder_keeps_every_firmware_field(host_copy, tmp_path):
    src = host_copy(AFTER)
    info = src / "proc/driver/nvidia/gpus/0000:18:00.0/information"
    info.parent.mkdir(parents=True)
    info.write_text(VBIOS_INFO)
    assert _by_key(_inv(src))["gpu_vbios:0000:18:00.0"].version == "96.00.99.00.01"
    out = tmp_path / "recorded"
    record_fixture(HostRoot.open(src), out)
    assert [c.model_dump(exclude={"source"}) for c in _inv(out).components] == \
        [c.model_dump(exclude={"source"}) for c in _inv(src).components]


RULES = (FirmwareBaselineRule(kind="nic_fw", versions=["28.43.1014"]),
         FirmwareBaselineRule(kind="nvme_fw", model="Micron_7450_MTFDKCC3T8TFS", versions=["E2MU200"]),
         FirmwareBaselineRule(kind="bios", versions=["2.7.5", "2.8.0"]))


def test_a_host_at_its_baseline_passes():
    check = check_firmware_baseline(_inv(fixture_host(AFTER)), RULES)
    assert check.status is ParityStatus.PASS and "nvme_fw:0000:01:00.0" not in check.evidence  # BOSS: no rule


def test_drift_is_a_typed_finding_and_a_parity_fail(host_copy):
    src = host_copy(AFTER)
    (src / "sys/class/infiniband/mlx5_0/fw_ver").write_text("28.39.1002\n")  # a tenant-reachable PF, downgraded
    inv = _inv(src)
    findings = judge_firmware(inv, RULES)
    assert [f.code for f in findings] == ["firmware_drift"]
    assert "runs 28.39.1002; baseline allows 28.43.1014" in findings[0].detail
    check = check_firmware_baseline(inv, RULES)
    assert check.status is ParityStatus.FAIL and check.hard and check.detail.startswith("firmware_drift:")


def test_an_unreadable_judged_version_warns_never_passes():
    rules = (FirmwareBaselineRule(kind="gpu_vbios", versions=["96.00.99.00.01"]),)
    check = check_firmware_baseline(_inv(fixture_host(AFTER)), rules)
    assert check.status is ParityStatus.WARN and check.detail.startswith("firmware_unreadable:")


def test_the_baseline_comes_from_the_config_and_reaches_parity(host_copy):
    from gpuaas_agent.tasks.preflight import build_parity_report

    src = host_copy(AFTER)
    (src / "sys/class/dmi/id/bios_version").write_text("2.6.0\n")
    site = SliceConfig.model_validate({"firmware_baseline": [r.model_dump() for r in RULES]})
    report = build_parity_report(HostRoot.open(src), slice_config=site)
    firmware = next(c for c in report.checks if c.check == "firmware_baseline")
    assert firmware.status is ParityStatus.FAIL and "bios dmi (Dell Inc. PowerEdge XE9680) runs 2.6.0" in firmware.detail
    without = build_parity_report(HostRoot.open(src), slice_config=SliceConfig())
    assert "firmware_baseline" not in [c.check for c in without.checks]  # nothing judged without a baseline


@pytest.mark.parametrize("rules", [
    [{"kind": "nic_fw", "versions": ["1"]}, {"kind": "nic_fw", "versions": ["2"]}],
    [{"kind": "nic_fw", "versions": []}],
    [{"kind": "cpld", "versions": ["1"]}],
    [{"kind": "nic_fw", "versions": ["1"], "psid": "x"}],
])
def test_bad_baselines_are_refused(rules):
    with pytest.raises(ValueError):
        SliceConfig.model_validate({"firmware_baseline": rules})


def test_changes_during_a_tenancy_name_the_slots_devices_and_the_vfs_pf(host_copy):
    before = _inv(fixture_host(AFTER))
    src = host_copy(AFTER)
    (src / "sys/class/infiniband/mlx5_0/fw_ver").write_text("28.99.0001\n")  # PF of slot 0's VF 0000:19:00.1
    (src / "sys/class/nvme/nvme6/firmware_rev").write_text("HACKED01\n")  # another slot's disk (0000:3c:00.0)
    after = _inv(src)
    report = discover(HostRoot.open(fixture_host(AFTER)))
    slot = next(s for s in report.candidate_slots if s.gpu_pci_address == "0000:18:00.0")
    slot0 = slot_firmware_devices(report, slot.gpu_pci_address, slot.fabric_vf_pci_address, slot.nvme_device)
    assert slot0 == ["0000:18:00.0", "0000:19:00.1", "0000:1a:00.0"]  # GPU, fabric VF, NVMe controller
    changes = firmware_changes(before, after, slot0)
    assert [(c.kind, c.id, c.before, c.after, c.change) for c in changes] == [
        ("nic_fw", "0000:19:00.0", "28.43.1014", "28.99.0001", "changed")]
    everything = {(c.id, c.change) for c in firmware_changes(before, after)}
    assert everything == {("0000:19:00.0", "changed"), ("0000:3c:00.0", "changed")}
    assert firmware_changes(before, before, slot0) == []


def test_a_device_gone_or_unreadable_after_a_tenancy_is_a_change(host_copy):
    before = _inv(fixture_host(AFTER))
    src = host_copy(AFTER)
    (src / "sys/class/nvme/nvme3/firmware_rev").unlink()
    changes = firmware_changes(before, _inv(src), ["0000:1a:00.0"])
    assert [(c.id, c.change, c.after) for c in changes] == [("0000:1a:00.0", "unreadable", None)]
