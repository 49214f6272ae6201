"""GPU health through NVML: recorded readings judged into the gpu_nvml check, the driver-absent path, and the
reader's NVML calls replayed from a reading (no GPU or driver exists on CI machines: docs/testing.md's one fake).

The replay implements only functions and error classes the real ``pynvml`` has (checked against the
installed binding), so a misspelt or removed NVML call fails here rather than on the first GPU host.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pynvml
import pytest

from gpuaas_agent.config import parse_config
from gpuaas_agent.operator.health import CheckThreads, HealthSettings, gpu_nvml_check, run_checks, summarise
from gpuaas_agent.operator.nvml import NvmlReading, NvmlSource, XidEvent, judge, load_reading
from tests.conftest import REPO
from tests.support.agent_process import AgentProcess, NotifyListener, agent_env, enrolled_setup
from tests.support.deadline import run_bounded

H200 = REPO / "fixtures/nvml/h200-vm-passthrough.json"
# Recorded by this module's own live path (`python -m gpuaas_agent.operator.nvml record`) on a lent H200, 2026-11-28.
H200_LIVE = REPO / "fixtures/nvml/h200-lent-2026-11-28.json"


def _reading(**gpu_changes) -> NvmlReading:
    base = load_reading(H200)
    events = gpu_changes.pop("xid_events", [])
    gpu = base.gpus[0].model_copy(update=gpu_changes)
    return base.model_copy(update={"gpus": [gpu], "xid_events": events})


def _xid(xid: int, ago: timedelta = timedelta(minutes=5)) -> XidEvent:
    return XidEvent(xid=xid, gpu_index=0, seen_at=load_reading(H200).recorded_at - ago)


def _write(tmp_path: Path, reading: NvmlReading) -> Path:
    path = tmp_path / "nvml.json"
    path.write_text(reading.model_dump_json())
    return path


def test_the_recorded_h200_reading_is_synthetic_and_healthy():
    reading = load_reading(H200)
    assert reading.provenance.startswith("synthetic:") and reading.gpus[0].name == "NVIDIA H200"
    status, detail = judge(reading, now=reading.recorded_at)
    assert status == "ok" and "1 GPU(s) via NVML (driver 580.159.04)" in detail


def test_a_reading_the_live_path_recorded_on_a_real_h200_is_healthy_without_page_retirement():
    # An H200 retires no pages (it remaps rows): NVML answers Not Supported, the reader keeps None, and the
    # judge must not read None as a fault. The remapper's counters are what this board reports.
    reading = load_reading(H200_LIVE)
    assert not reading.provenance.startswith("synthetic") and reading.driver_version == "580.159.04"
    gpu = reading.gpus[0]
    assert gpu.name == "NVIDIA H200" and gpu.ecc_mode_current is True
    assert (gpu.retired_pages_sbe, gpu.retired_pages_dbe, gpu.retired_pages_pending) == (None, None, None)
    assert (gpu.remapped_rows_uncorrectable, gpu.remapped_rows_failure) == (0, False)
    status, detail = judge(reading, now=reading.recorded_at)
    assert status == "ok" and "1 GPU(s) via NVML (driver 580.159.04)" in detail, detail


@pytest.mark.parametrize("changes,status,reason", [
    ({"ecc_volatile_uncorrected": 2}, "degraded", "volatile uncorrected ECC errors=2"),
    ({"remapped_rows_pending": True}, "degraded", "remapped rows pending a reset"),
    ({"retired_pages_pending": True}, "degraded", "retired pages pending a reset"),
    ({"remapped_rows_failure": True}, "failed", "row remapping failed"),
    ({"xid_events": [_xid(79)]}, "failed", "XID 79"),
    ({"xid_events": [_xid(95)]}, "failed", "uncontained ECC error"),
    ({"xid_events": [_xid(94)]}, "degraded", "contained ECC error"),
    ({"xid_events": [_xid(13)]}, "ok", "no fatal XID"),  # a guest program's fault is not the GPU's
    ({"xid_events": [_xid(79, ago=timedelta(days=2))]}, "ok", "no fatal XID"),  # outside the window
    ({"ecc_aggregate_uncorrected": 3}, "ok", "aggregate uncorrected ECC=3"),  # history, named, not judged
])
def test_a_reading_moves_the_gpu_check_with_its_reason(tmp_path, changes, status, reason):
    check = gpu_nvml_check(HealthSettings(host_root=Path("/"), nvml_fixture=_write(tmp_path, _reading(**changes))))
    assert check.name == "gpu_nvml" and check.status == status and reason in check.detail, check.detail


def test_a_failing_gpu_makes_the_host_failed_with_the_reason_in_a_full_round(tmp_path, host_copy):
    fixture = _write(tmp_path, _reading(xid_events=[_xid(79)]))
    config = parse_config({"state_dir": str(tmp_path / "state"), "host_root": str(host_copy("h200-vm-passthrough")),
                           "health_nvml_fixture": str(fixture), "slice": {"libvirt_uri": "test:///default"}})
    checks = asyncio.run(run_checks(HealthSettings.from_config(config), [], [], threads=CheckThreads()))
    state, reason = summarise(checks)
    assert state == "failed" and reason.startswith("gpu_nvml: gpu 0 00000000:00:06.0: XID 79"), reason


def test_a_fixture_with_an_unknown_field_is_unavailable_naming_it(tmp_path):
    data = json.loads(H200.read_text())
    data["gpus"][0]["temperature_c"] = 40
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    check = gpu_nvml_check(HealthSettings(host_root=Path("/"), nvml_fixture=path))
    assert check.status == "unavailable" and "nvml_fixture_invalid" in check.detail and "temperature_c" in check.detail


class ReplayNvml:
    """A recorded reading served through pynvml's own names, constants and error classes."""

    NVMLError = pynvml.NVMLError
    NVMLError_Timeout = pynvml.NVMLError_Timeout

    def __init__(self, reading: NvmlReading, xids: list[int], *, init_error: int | None = None) -> None:
        self.reading, self.pending_xids, self.init_error = reading, list(xids), init_error
        self.calls: list[str] = []
        self.registered: list[int] = []

    def __getattr__(self, name: str):
        value = getattr(pynvml, name)  # AttributeError for anything the real binding does not have
        if name.startswith(("NVML_", "nvmlEventType")):
            return value
        raise AttributeError(f"the replay does not implement {name}")

    def _gpu(self, handle):
        return self.reading.gpus[handle]

    def _log(self, name):
        assert hasattr(pynvml, name), f"pynvml has no {name}"
        self.calls.append(name)

    def nvmlInit(self):
        self._log("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self._log("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        self._log("nvmlDeviceGetCount")
        return len(self.reading.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._log("nvmlDeviceGetHandleByIndex")
        return i

    def nvmlDeviceGetIndex(self, handle):
        self._log("nvmlDeviceGetIndex")
        return handle if isinstance(handle, int) else 0  # an event's device pointer: the replay's one GPU

    def nvmlEventSetCreate(self):
        self._log("nvmlEventSetCreate")
        return "set"

    def nvmlEventSetFree(self, events):
        self._log("nvmlEventSetFree")

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        self._log("nvmlDeviceGetSupportedEventTypes")
        return pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError

    def nvmlDeviceRegisterEvents(self, handle, types, events):
        self._log("nvmlDeviceRegisterEvents")
        self.registered.append(handle)

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        self._log("nvmlEventSetWait_v2")
        assert timeout_ms == 0, "the health round must never block on the event set"
        if not self.pending_xids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        data = pynvml.c_nvmlEventData_t()
        data.eventType, data.eventData = pynvml.nvmlEventTypeXidCriticalError, self.pending_xids.pop(0)
        data.device = None
        return data

    def nvmlDeviceGetName(self, h):
        self._log("nvmlDeviceGetName")
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h):
        self._log("nvmlDeviceGetUUID")
        return self._gpu(h).uuid

    def nvmlDeviceGetPciInfo(self, h):
        self._log("nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = self._gpu(h).pci_bus_id.encode()
        return info

    def nvmlDeviceGetEccMode(self, h):
        self._log("nvmlDeviceGetEccMode")
        return [int(self._gpu(h).ecc_mode_current), int(self._gpu(h).ecc_mode_current)]

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter):
        self._log("nvmlDeviceGetTotalEccErrors")
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        gpu = self._gpu(h)
        return gpu.ecc_volatile_uncorrected if counter == pynvml.NVML_VOLATILE_ECC else gpu.ecc_aggregate_uncorrected

    def nvmlDeviceGetRetiredPages(self, h, cause):
        self._log("nvmlDeviceGetRetiredPages")
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # Hopper remaps rows instead of retiring pages

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        self._log("nvmlDeviceGetRetiredPagesPendingStatus")
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetRemappedRows(self, h):
        self._log("nvmlDeviceGetRemappedRows")
        g = self._gpu(h)
        return (g.remapped_rows_correctable, g.remapped_rows_uncorrectable, int(g.remapped_rows_pending),
                int(g.remapped_rows_failure))

    def nvmlSystemGetDriverVersion(self):
        self._log("nvmlSystemGetDriverVersion")
        return self.reading.driver_version

    def nvmlSystemGetNVMLVersion(self):
        self._log("nvmlSystemGetNVMLVersion")
        return self.reading.nvml_version


def test_the_live_reader_keeps_one_session_and_drains_xids_without_blocking():
    recorded = _reading(remapped_rows_uncorrectable=1)
    replay = ReplayNvml(recorded, xids=[94, 13])
    source = NvmlSource(nvml=replay)
    first = source.read()
    assert isinstance(first, NvmlReading), first
    gpu = first.gpus[0]
    assert gpu.pci_bus_id == "00000000:00:06.0" and gpu.ecc_mode_current is True
    assert gpu.remapped_rows_uncorrectable == 1 and gpu.retired_pages_pending is None  # not supported: None
    assert [e.xid for e in first.xid_events] == [94, 13] and replay.registered == [0]
    assert judge(first)[0] == "degraded" and "XID 94" in judge(first)[1]
    replay.pending_xids.append(79)
    second = source.read()
    assert [e.xid for e in second.xid_events] == [94, 13, 79] and judge(second)[0] == "failed"
    assert replay.calls.count("nvmlInit") == 1 and "nvmlShutdown" not in replay.calls
    source.close()
    assert replay.calls[-1] == "nvmlShutdown"


def test_without_the_driver_nvml_is_unavailable_and_not_retried_every_round():
    clock = [0.0]
    replay = ReplayNvml(load_reading(H200), xids=[], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    source = NvmlSource(nvml=replay, clock=lambda: clock[0])
    assert "nvmlInit failed: Driver Not Loaded" in source.read()
    clock[0] = 60.0
    assert "nvmlInit failed" in source.read() and source.init_calls == 1
    clock[0] = 601.0
    source.read()
    assert source.init_calls == 2
    # and the real binding on this machine, which has no NVIDIA driver
    live = NvmlSource().read()
    assert isinstance(live, str) and live.startswith("nvmlInit failed")


def test_record_without_nvml_is_one_line_and_exit_3(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpuaas_agent.operator.nvml", "record", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 3 and proc.stderr.startswith("gpuaas-agent: nvml_unavailable: nvmlInit failed")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.json").exists()


def test_a_daemon_whose_gpu_fell_off_the_bus_heartbeats_failed_and_status_says_broken(nats_server, tmp_path, short_dir,
                                                                                       agents):
    fixture = _write(tmp_path, _reading(xid_events=[_xid(79)]))

    async def body():
        plane, node_id, config = await enrolled_setup(nats_server, tmp_path, health_nvml_fixture=str(fixture))
        listener = NotifyListener(short_dir / "notify")
        try:
            agent = AgentProcess([sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)],
                                 agent_env(listener.path), tmp_path / "agent.log")
            agents.append(agent.start())
            beats = await plane.wait_for(lambda s: [h for h in s.heartbeats if h.health_state == "failed"], timeout=60)
            assert beats[-1].health_reason.startswith("gpu_nvml: gpu 0 00000000:00:06.0: XID 79"), beats[-1]
            status = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "gpuaas_agent", "status", "--config", str(config), "--no-checks"],
                capture_output=True, text=True, timeout=60, cwd=REPO)
            assert status.returncode == 3 and "XID 79" in status.stdout, status.stdout + status.stderr
        finally:
            listener.close()
            await plane.close()

    run_bounded(body())
