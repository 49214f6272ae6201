"""The re-checks of tasks/recheck.py: a check that cannot read the device never passes; the AER one on a host copy."""

from __future__ import annotations

import asyncio

from gpuaas_agent.contract.fleet import QuarantineReason
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.quarantine import quarantine_component
from gpuaas_agent.tasks.recheck import RECHECKS, RecheckContext, recheck_aer, recheck_operator, recheck_smart
from tests.conftest import fixture_host

DISK = "eui:000000000000000100a075244a103331"
GPU = "0000:18:00.0"


def test_rechecks_that_cannot_read_the_device_never_pass(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    disk = asyncio.run(quarantine_component(store, "nvme", DISK, "smart_failing", {"media_errors": 0}, "t-1"))
    slot = asyncio.run(quarantine_component(store, "slot", "2", "gpu_aer_fatal", {}, "t-2"))
    store.close()
    recorded = RecheckContext(host_root=fixture_host("h200-slice-after-transition"))
    smart = asyncio.run(recheck_smart(recorded, disk))
    assert not smart.passed and "recorded root" in smart.detail
    assert not asyncio.run(recheck_aer(recorded, slot)).passed  # a slot has no AER counters of its own


def test_the_rechecks_this_module_owns_are_wired():
    """The wipe, GPU handover and firmware pipelines add theirs (tasks/recheck.py); until then those stay out."""
    assert {QuarantineReason.operator, QuarantineReason.gpu_aer_fatal, QuarantineReason.smart_failing} <= set(RECHECKS)


def test_the_aer_recheck_reads_the_functions_fatal_counter(tmp_path, host_copy):
    root = host_copy("h200-slice-after-transition")
    store = StateStore.open(tmp_path / "state.db")
    record = asyncio.run(quarantine_component(store, "gpu", GPU, "gpu_aer_fatal", {}, "t-1"))
    gone = asyncio.run(quarantine_component(store, "gpu", "0000:ee:00.0", "gpu_aer_fatal", {}, "t-2"))
    store.close()
    ctx = RecheckContext(host_root=root)
    device = (root / "sys/bus/pci/devices" / GPU).resolve()
    (device / "aer_dev_fatal").write_text("Undefined 0\nDLP 2\nTOTAL_ERR_FATAL 2\n")
    failing = asyncio.run(recheck_aer(ctx, record))
    assert not failing.passed and failing.evidence["aer"]["fatal"] == 2
    (device / "aer_dev_fatal").write_text("Undefined 0\nDLP 0\nTOTAL_ERR_FATAL 0\n")
    assert asyncio.run(recheck_aer(ctx, record)).passed
    missing = asyncio.run(recheck_aer(ctx, gone))
    assert not missing.passed and "not on the PCI bus" in missing.detail
    assert asyncio.run(recheck_operator(ctx, record)).passed
