"""The health loop quarantines a slot part whose own hardware says it is failing, and only that part.

Real pieces: a copy of the recorded 8xH200 host (its sysfs AER counters are files the test sets), the
agent's discovery, the SQLite store; SMART is never read from a recorded root (nvme-cli needs a live
controller), which the pass must not mistake for a verdict.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from gpuaas_agent.contract.bmc import BmcReading, GpuBmcVerdict
from gpuaas_agent.contract.fleet import QuarantineReason
from gpuaas_agent.discovery.quarantine import mark_quarantined
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.operator.health_quarantine import all_rechecks, pci_address_of, quarantine_failing_devices
from gpuaas_agent.operator.nvml import NvmlGpu, NvmlReading, XidEvent
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.recheck import RECHECKS, RecheckContext

HOST = "h200-slice-after-transition"


def test_a_slot_gpu_with_a_fatal_aer_error_is_quarantined_alone_and_once(tmp_path, host_copy):
    root = host_copy(HOST)
    report = discover(HostRoot.open(root))
    slot = report.candidate_slots[4]
    device = (root / "sys/bus/pci/devices" / slot.gpu_pci_address).resolve()
    store = StateStore.open(tmp_path / "state.db")
    try:
        state = as_store_thread(store)
        assert asyncio.run(quarantine_failing_devices(root, state)) == []  # a healthy recording: nothing
        (device / "aer_dev_fatal").write_text("Undefined 0\nDLP 1\nTOTAL_ERR_FATAL 1\n")
        [record] = asyncio.run(quarantine_failing_devices(root, state))
        assert (record.kind.value, record.identity, record.reason.value, record.slot_index) == (
            "gpu", slot.gpu_pci_address, "gpu_aer_fatal", 4)
        assert record.evidence["aer"]["fatal"] == 1 and record.task_id == "health-loop"
        # The next pass finds it already out: no second record, no second log line.
        assert asyncio.run(quarantine_failing_devices(root, state)) == []
        assert [r.identity for r in store.quarantined()] == [slot.gpu_pci_address]
        # Discovery now blocks that slot only; the other slots stay ready.
        marked = mark_quarantined(discover(HostRoot.open(root)), store.quarantined())
        blocked = [s.slot_index for s in marked.candidate_slots
                   if any(b.code == "component_quarantined" for b in s.blockers)]
        assert blocked == [4]
    finally:
        store.close()


def test_a_gpu_the_bmc_judges_failed_is_quarantined_and_its_recheck_needs_the_bmc(tmp_path, host_copy):
    root = host_copy(HOST)
    report = discover(HostRoot.open(root))
    gpu = report.candidate_slots[2].gpu_pci_address
    reading = BmcReading(bmc_url="https://bmc.example", read_at=datetime.now(UTC), gpus=(
        GpuBmcVerdict(gpu_id="GPU_SXM_3", pci_address=gpu, status="failed", reasons=("row remap failure",)),
        GpuBmcVerdict(gpu_id="GPU_SXM_4", pci_address=report.candidate_slots[3].gpu_pci_address, status="degraded",
                      reasons=("temperature 87 C",)),
        GpuBmcVerdict(gpu_id="GPU_SXM_9", status="failed", reasons=("no host function mapped",))))
    store = StateStore.open(tmp_path / "state.db")
    try:
        [record] = asyncio.run(quarantine_failing_devices(root, as_store_thread(store), bmc_reading=reading))
        assert (record.kind.value, record.identity, record.reason.value, record.slot_index) == (
            "gpu", gpu, "bmc_failed", 2)
        assert record.evidence["reasons"] == ["row remap failure"]  # degraded is not failed; unmapped is skipped
        verdict = asyncio.run(all_rechecks()[QuarantineReason.bmc_failed](RecheckContext(host_root=root), record))
        assert not verdict.passed and "no [bmc]" in verdict.detail
    finally:
        store.close()


def test_a_gpu_with_a_recent_fatal_xid_is_quarantined_and_an_old_or_benign_one_is_not(tmp_path, host_copy):
    root = host_copy(HOST)
    report = discover(HostRoot.open(root))
    now = datetime.now(UTC)
    gpus = [NvmlGpu(index=i, name="NVIDIA H200", pci_bus_id=f"0000{s.gpu_pci_address.upper()}")
            for i, s in enumerate(report.candidate_slots[:3])]
    reading = NvmlReading(provenance="test: constructed", recorded_at=now, gpus=gpus, xid_events=[
        XidEvent(xid=79, gpu_index=1, seen_at=now - timedelta(minutes=5)),  # fell off the bus: fatal, recent
        XidEvent(xid=79, gpu_index=0, seen_at=now - timedelta(days=2)),  # fatal, but before the window
        XidEvent(xid=13, gpu_index=2, seen_at=now),  # a guest program's fault: judges nothing
    ])
    assert pci_address_of(gpus[1].pci_bus_id) == report.candidate_slots[1].gpu_pci_address
    store = StateStore.open(tmp_path / "state.db")
    try:
        [record] = asyncio.run(quarantine_failing_devices(root, as_store_thread(store), nvml_reading=reading))
        assert (record.identity, record.reason.value, record.slot_index) == (
            report.candidate_slots[1].gpu_pci_address, "gpu_xid", 1)
        assert [x["xid"] for x in record.evidence["xids"]] == [79]
        assert QuarantineReason.gpu_xid in all_rechecks()  # the daemon's slice.unquarantine can re-check it
    finally:
        store.close()


def test_importing_the_operator_room_registers_no_recheck_and_the_daemon_injects_them():
    """tasks/recheck.RECHECKS is what tasks/ defines, whatever was imported; the daemon's handler gets the rest."""
    import subprocess
    import sys

    probe = (
        "from gpuaas_agent.tasks.recheck import RECHECKS\n"
        "before = sorted(r.value for r in RECHECKS)\n"
        "import gpuaas_agent.operator.health_quarantine, gpuaas_agent.daemon\n"
        "assert sorted(r.value for r in RECHECKS) == before, (before, sorted(RECHECKS))\n"
        "print(' '.join(before))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gpu_xid" not in done.stdout.split() and "bmc_failed" not in done.stdout.split()
    assert {QuarantineReason.gpu_xid, QuarantineReason.bmc_failed} <= set(all_rechecks())
    assert {QuarantineReason.gpu_xid, QuarantineReason.bmc_failed}.isdisjoint(RECHECKS)


# -- one reading per round: the pass judges what the checks read ------------------------------------


def _reporter(tmp_path, root, store, **health):
    from gpuaas_agent.operator.health import CheckThreads, HealthSettings
    from gpuaas_agent.operator.reporter import Reporter, ReporterSettings

    return Reporter(ReporterSettings(node_id="node-1", state_dir=tmp_path, heartbeat_interval_s=5,
                                     health_interval_s=60, request_timeout_s=5),
                    store, HealthSettings(host_root=root, libvirt_uri="test:///default", **health), None,
                    lambda **_: True, threads=CheckThreads())


def _counting(monkeypatch, module, name):
    """Wrap the real ``module.name`` to count its calls (it still does the real work)."""
    real, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_round_reads_aer_once_and_discovers_only_when_a_part_fails(tmp_path, host_copy, monkeypatch):
    from gpuaas_agent.operator import health_quarantine

    root = host_copy(HOST)
    slot = discover(HostRoot.open(root)).candidate_slots[4]
    discovered = _counting(monkeypatch, health_quarantine, "discover")
    pass_aer_reads = _counting(monkeypatch, health_quarantine, "aer_counts")
    store = StateStore.open(tmp_path / "state.db")
    try:
        reporter = _reporter(tmp_path, root, as_store_thread(store))
        asyncio.run(reporter.check_health())  # a healthy round: the pass judges the check's reading, nothing more
        # (the recording exposes no AER counter file until the test writes one)
        assert [c.status for c in reporter.checks if c.name == "pcie_aer"] == ["unavailable"]
        assert discovered == [] and pass_aer_reads == [] and store.quarantined() == []
        device = (root / "sys/bus/pci/devices" / slot.gpu_pci_address).resolve()
        (device / "aer_dev_fatal").write_text("Undefined 0\nDLP 1\nTOTAL_ERR_FATAL 1\n")
        asyncio.run(reporter.check_health())  # the check's fatal counter names the part: one discovery maps it
        assert [c.status for c in reporter.checks if c.name == "pcie_aer"] == ["failed"]
        assert len(discovered) == 1 and pass_aer_reads == []
        [record] = store.quarantined()
        assert (record.identity, record.reason.value, record.evidence["aer"]["fatal"]) == (
            slot.gpu_pci_address, "gpu_aer_fatal", 1)
    finally:
        store.close()


def test_a_failed_nvml_check_quarantines_from_its_own_reading(tmp_path, host_copy, monkeypatch):
    from gpuaas_agent.operator import nvml

    root = host_copy(HOST)
    slot = discover(HostRoot.open(root)).candidate_slots[1]
    now = datetime.now(UTC)
    fixture = tmp_path / "nvml.json"
    fixture.write_text(NvmlReading(provenance="test: constructed", recorded_at=now, gpus=[
        NvmlGpu(index=0, name="NVIDIA H200", pci_bus_id=f"0000{slot.gpu_pci_address.upper()}")], xid_events=[
        XidEvent(xid=79, gpu_index=0, seen_at=now - timedelta(minutes=1))]).model_dump_json())
    loads = _counting(monkeypatch, nvml, "load_reading")
    store = StateStore.open(tmp_path / "state.db")
    try:
        reporter = _reporter(tmp_path, root, as_store_thread(store), nvml_fixture=fixture)
        asyncio.run(reporter.check_health())
        assert [c.status for c in reporter.checks if c.name == "gpu_nvml"] == ["failed"]
        assert len(loads) == 1  # the check's reading, judged again by the pass; not loaded twice
        [record] = store.quarantined()
        assert (record.identity, record.reason.value) == (slot.gpu_pci_address, "gpu_xid")
    finally:
        store.close()


def test_a_failed_bmc_check_quarantines_from_its_own_reading_without_a_second_read(tmp_path, host_copy,
                                                                                    monkeypatch):
    from gpuaas_agent.operator import bmc
    from lab.hgx_redfish_mockup import ROOT, set_field, write_mockup
    from tests.support.redfish_server import started_server

    root = host_copy(HOST)
    slots = discover(HostRoot.open(root)).candidate_slots
    server = started_server(tmp_path)
    write_mockup(server.mockup, edit=lambda docs: set_field(
        docs, f"{ROOT}/Systems/HGX_Baseboard_0/Memory/GPU_SXM_3_DRAM_0", "Oem.Nvidia.RowRemappingFailed", True))
    reads = _counting(monkeypatch, bmc, "read_bmc_verdicts")
    store = StateStore.open(tmp_path / "state.db")
    try:
        config = server.config(gpu_pci_addresses={f"GPU_SXM_{n + 1}": s.gpu_pci_address for n, s in enumerate(slots)})
        reporter = _reporter(tmp_path, root, as_store_thread(store), bmc=config)
        asyncio.run(reporter.check_health())
        assert [c.status for c in reporter.checks if c.name == "gpu_bmc"] == ["failed"]
        assert len(reads) == 1  # one BMC read per round: the pass judges the check's reading
        assert server.requests_seen().count("GET /redfish/v1/Systems/HGX_Baseboard_0/Memory/GPU_SXM_3_DRAM_0 ") == 1
        [record] = store.quarantined()
        assert (record.identity, record.reason.value) == (slots[2].gpu_pci_address, "bmc_failed")
    finally:
        store.close()
        server.stop()
