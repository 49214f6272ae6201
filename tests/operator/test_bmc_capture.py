"""The BMC check on a real HGX BMC: a Redfish-Mockup-Creator capture of a DGX H100 (fixtures/redfish/dgx-h100-viking).

Served over TLS by sushy-static exactly as captured (PROVENANCE.md there); one server for the module, each
test edits the documents it needs (the server reads each file per request) and puts them back. What the
real BMC carries decides the verdicts: no threshold on the GPU temperature (NVIDIA's limits stand in, named
as such), ``UpperCritical`` 95 on the memory temperature (the BMC's), ``FPGA_0`` among the processors,
``ThrottleReasons: ["NA"]``. The server answers ``$expand=.($levels=N)`` as DSP0266 says, from the documents
it holds (tests/support/redfish_expand.py): the real BMC advertises it, and NVLink is read through it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from gpuaas_agent.operator import bmc
from gpuaas_agent.operator.health_quarantine import failing_by_bmc
from gpuaas_agent.operator.redfish import MAX_DOCUMENT_BYTES, MAX_DOCUMENTS, MAX_PORT_MEMBERS
from tests.support.redfish_server import PCI, editable_documents, serving_capture

CAPTURE = Path(__file__).resolve().parents[2] / "fixtures/redfish/dgx-h100-viking/redfish/v1"
PROCESSORS = "Systems/HGX_Baseboard_0/Processors"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving_capture(tmp_path_factory.mktemp("capture"), CAPTURE) as srv:
        yield srv


@pytest.fixture
def capture(server):
    """The served capture; every document a test changes is restored afterwards."""
    with editable_documents(server) as served:
        yield served


def _gpus(reading):
    return {v.gpu_id: v for v in reading.gpus}


def _sensor(n: int, name: str) -> str:
    return f"Chassis/HGX_GPU_SXM_{n}/Sensors/HGX_GPU_SXM_{n}_{name}"


def test_the_real_capture_is_eight_gpus_and_four_nvswitches_ok_and_the_fpga_is_no_gpu(capture):
    before = len(re.findall(r'"GET ', capture.requests_seen()))
    reading = bmc.read_bmc_verdicts(capture.config())
    gpus = _gpus(reading)
    assert reading.error is None
    assert sorted(gpus) == sorted(PCI) and "FPGA_0" not in gpus
    assert {v.status for v in gpus.values()} == {"ok"}, {k: v.reasons for k, v in gpus.items()}
    assert [(v.switch_id, v.status) for v in reading.nvswitches] == [(f"NVSwitch_{k}", "ok") for k in range(4)]
    t = gpus["GPU_SXM_1"].telemetry
    assert (t.sxm_slot, t.serial_number, t.unread) == ("SXM1", "1652923003067", ())
    # The GPU temperature is TEMP_0 (26.75 C), not EnvironmentMetrics.TemperatureCelsius (60: TEMP_1, the margin).
    assert t.temperature.reading_c == 26.75 and t.temperature.sensor.endswith("/HGX_GPU_SXM_1_TEMP_0")
    assert (t.temperature.caution.reading_c, t.temperature.caution.source) == (87.0, "nvidia_limit")
    assert (t.temperature.critical.reading_c, t.temperature.critical.source) == (95.0, "nvidia_limit")
    assert t.memory_temperature.reading_c == 35.0 and t.memory_temperature.caution is None
    assert (t.memory_temperature.critical.reading_c, t.memory_temperature.critical.source,
            t.memory_temperature.critical.name) == (95.0, "bmc", "UpperCritical")
    assert (t.power_w, t.power_limit_w) == (71.586, 700.0)
    assert t.throttle_reasons is None  # ["NA"]: not available
    assert (t.pcie_fatal, t.sram_ecc_uncorrectable, t.dram_ecc_uncorrectable, t.row_remapping_failed) == (0, 0, 0, False)
    switch = reading.nvswitches[0].telemetry
    assert (switch.temperature.reading_c, switch.temperature.critical.reading_c,
            switch.temperature.critical.source) == (41.03125, 102.0, "bmc")
    # One pass: 2 collections, 9 documents per GPU, 5 per NVSwitch, the FPGA's own document, one expanded
    # Ports GET per GPU for NVLink; nothing left out.
    assert len(re.findall(r'"GET ', capture.requests_seen())) - before == 1 + 2 + 1 + 8 * 9 + 4 * 5 + 8
    assert bmc.check_of(reading).status == "ok"
    # What slice telemetry maps to a slot: the GPU's sensors under the host PCI address the config gives it.
    by_address = reading.sensors_by_pci_address()
    assert sorted(by_address) == sorted(PCI.values())
    assert by_address[PCI["GPU_SXM_5"]].sxm_slot == "SXM5" and by_address[PCI["GPU_SXM_5"]].power_w is not None


@pytest.mark.parametrize(("sensor", "value", "status", "reason"), [
    ("TEMP_0", 86.75, "ok", None),
    ("TEMP_0", 87.0, "degraded", "temperature 87 C >= caution 87 C (NVIDIA NVML_TEMPERATURE_THRESHOLD_GPU_MAX)"),
    ("TEMP_0", 90.0, "degraded", "temperature 90 C >= caution 87 C (NVIDIA NVML_TEMPERATURE_THRESHOLD_GPU_MAX)"),
    ("TEMP_0", 95.0, "failed", "temperature 95 C >= critical 95 C (NVIDIA NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)"),
    ("DRAM_0_Temp_0", 94.0, "ok", None),
    ("DRAM_0_Temp_0", 95.0, "failed", "memory temperature 95 C >= critical 95 C (BMC UpperCritical)"),
    ("TEMP_1", 99.0, "ok", None),  # the slowdown margin is not a temperature: never judged as one
])
def test_temperature_verdicts_follow_the_thresholds_the_real_bmc_carries(capture, sensor, value, status, reason):
    capture.edit(_sensor(4, sensor), lambda d: d.update(Reading=value))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    assert gpus["GPU_SXM_4"].status == status
    assert gpus["GPU_SXM_4"].reasons == (() if reason is None else (reason,))
    assert {v.status for k, v in gpus.items() if k != "GPU_SXM_4"} == {"ok"}


def test_a_threshold_the_bmc_gives_wins_over_nvidia_limits(capture):
    capture.edit(_sensor(2, "TEMP_0"), lambda d: d.update(Reading=81.0, Thresholds={
        "UpperCaution": {"Reading": 75.0}, "UpperCritical": {"Reading": 80.0}}))
    capture.edit(_sensor(3, "DRAM_0_Temp_0"), lambda d: d.update(Reading=91.0, Thresholds={
        "UpperCaution": {"Reading": 90.0}, "UpperCritical": {"Reading": 95.0}}))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    assert gpus["GPU_SXM_2"].reasons == ("temperature 81 C >= critical 80 C (BMC UpperCritical)",)
    assert gpus["GPU_SXM_3"].reasons == ("memory temperature 91 C >= caution 90 C (BMC UpperCaution)",)
    assert gpus["GPU_SXM_2"].telemetry.temperature.caution.source == "bmc"


def test_a_critical_fpga_is_not_a_gpu_and_quarantines_nothing(capture):
    capture.edit(f"{PROCESSORS}/FPGA_0", lambda d: d.update(Status={"Health": "Critical", "State": "Enabled"}))
    reading = bmc.read_bmc_verdicts(capture.config())
    assert len(reading.gpus) == 8 and {v.status for v in reading.gpus} == {"ok"}
    assert failing_by_bmc(reading) == []
    assert bmc.check_of(reading).status == "ok"


def test_throttle_reasons_na_is_not_available_and_a_hardware_slowdown_degrades(capture):
    capture.edit(f"{PROCESSORS}/GPU_SXM_6/ProcessorMetrics",
                 lambda d: d["Oem"]["Nvidia"].update(ThrottleReasons=["HWThermalSlowdown"]))
    capture.edit(f"{PROCESSORS}/GPU_SXM_7/ProcessorMetrics",
                 lambda d: d["Oem"]["Nvidia"].update(ThrottleReasons=["None"]))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    assert (gpus["GPU_SXM_6"].status, gpus["GPU_SXM_6"].reasons) == (
        "degraded", ("hardware slowdown HWThermalSlowdown",))
    assert (gpus["GPU_SXM_1"].status, gpus["GPU_SXM_1"].telemetry.throttle_reasons) == ("ok", None)
    assert (gpus["GPU_SXM_7"].status, gpus["GPU_SXM_7"].telemetry.throttle_reasons) == ("ok", ())


def test_links_are_followed_as_the_bmc_gives_them_not_built_from_names(capture):
    # GPU_SXM_5's memory moved to another URI: read there, since that is where its processor links.
    moved = "Systems/HGX_Baseboard_0/Memory/HBM_moved"
    shutil.copytree(capture.mockup / "Systems/HGX_Baseboard_0/Memory/GPU_SXM_5_DRAM_0", capture.mockup / moved)
    try:
        doc = json.loads((capture.mockup / moved / "index.json").read_text())
        doc["Oem"]["Nvidia"]["RowRemappingFailed"] = True
        (capture.mockup / moved / "index.json").write_text(json.dumps(doc))
        capture.edit(f"{PROCESSORS}/GPU_SXM_5",
                     lambda d: d["Links"].update(Memory=[{"@odata.id": f"/redfish/v1/{moved}"}]))
        gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    finally:
        shutil.rmtree(capture.mockup / moved)
    assert gpus["GPU_SXM_5"].reasons == ("row remapping failed (no spare HBM rows)",)
    assert gpus["GPU_SXM_5"].status == "failed"


def test_a_link_that_is_not_a_path_on_the_bmc_is_not_followed(capture):
    capture.edit(f"{PROCESSORS}/GPU_SXM_8", lambda d: d["Links"].update(
        Chassis={"@odata.id": "https://127.0.0.2:9/redfish/v1/Chassis/HGX_GPU_SXM_8"}))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    assert gpus["GPU_SXM_8"].status == "unavailable"
    assert "is not a path under" in gpus["GPU_SXM_8"].reasons[0]
    assert "127.0.0.2" not in capture.requests_seen()


def test_a_bmc_listing_endless_members_is_cut_off_at_the_document_budget(capture):
    gpu = {"@odata.id": "/redfish/v1/Systems/HGX_Baseboard_0/Processors/GPU_SXM_1"}
    capture.edit(PROCESSORS, lambda d: d.update(Members=[gpu] * 200))
    before = len(re.findall(r'"GET ', capture.requests_seen()))
    reading = bmc.read_bmc_verdicts(capture.config())
    assert len(re.findall(r'"GET ', capture.requests_seen())) - before <= MAX_DOCUMENTS + 1  # + the service root
    assert any("DocumentBudgetExceeded" in r for v in reading.gpus for r in v.reasons)
    assert bmc.check_of(reading).status != "ok"


def test_a_document_over_the_byte_bound_is_refused_not_parsed(capture):
    capture.edit(f"{PROCESSORS}/GPU_SXM_2/ProcessorMetrics", lambda d: d.update(Padding="x" * MAX_DOCUMENT_BYTES))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    assert gpus["GPU_SXM_2"].status == "unavailable"
    assert "DocumentTooLarge" in gpus["GPU_SXM_2"].reasons[0]
    assert gpus["GPU_SXM_2"].telemetry.memory_temperature.reading_c == 40.0  # the rest of the GPU is still read
    assert {v.status for k, v in gpus.items() if k != "GPU_SXM_2"} == {"ok"}


def _gets(server, since: int) -> list[str]:
    return re.findall(r'"GET (\S+) ', server.requests_seen())[since:]


def test_nvlink_is_one_expanded_get_per_gpu_with_the_counters_the_capture_holds(capture):
    before = len(_gets(capture, 0))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    nvlink_gets = [g for g in _gets(capture, before) if "/Ports" in g]
    assert nvlink_gets == [f"/redfish/v1/{PROCESSORS}/GPU_SXM_{n}/Ports?$expand=.($levels=2)" for n in range(1, 9)]
    for gpu_id, verdict in gpus.items():
        t = verdict.telemetry
        assert t.nvlink_unread is None, t.nvlink_unread
        assert t.nvlink.model_dump() == {
            "ports": 18, "ports_up": 18, "ports_down": (), "ports_disabled": 0, "metrics_read": 18,
            "data_crc_count": 0, "flit_crc_count": 0, "recovery_count": 0, "replay_count": 0,
            "runtime_error_ports": 0, "training_error_ports": 0, "read_by": "expand"}, gpu_id


def test_nvlink_counters_and_a_down_link_are_read_from_the_documents_as_evidence_only(capture):
    ports = f"{PROCESSORS}/GPU_SXM_3/Ports"
    capture.edit(f"{ports}/NVLink_4/Metrics", lambda d: d["Oem"]["Nvidia"]["NVLinkErrors"].update(
        ReplayCount=7, FlitCRCCount=3, RuntimeError=True))
    capture.edit(f"{ports}/NVLink_9/Metrics", lambda d: d["Oem"]["Nvidia"]["NVLinkErrors"].update(
        ReplayCount=5, RecoveryCount=2, DataCRCCount=1, TrainingError=True))
    capture.edit(f"{ports}/NVLink_9", lambda d: d.update(LinkStatus="LinkDown", LinkState="Disabled"))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    n = gpus["GPU_SXM_3"].telemetry.nvlink
    assert (n.ports, n.ports_up, n.ports_down, n.ports_disabled) == (18, 17, ("NVLink_9",), 1)
    assert (n.replay_count, n.flit_crc_count, n.recovery_count, n.data_crc_count) == (12, 3, 2, 1)
    assert (n.runtime_error_ports, n.training_error_ports) == (1, 1)
    assert gpus["GPU_SXM_2"].telemetry.nvlink.replay_count == 0
    # The documents give no threshold for NVLink counters: no verdict is drawn from them.
    assert {v.status for v in gpus.values()} == {"ok"}


@pytest.mark.parametrize("features", [
    lambda f: f.pop("ExpandQuery"),
    lambda f: f["ExpandQuery"].update(MaxLevels=1),  # one level would expand the ports, not their Metrics
], ids=["no_expand", "max_levels_1"])
def test_without_expand_advertised_ports_are_read_one_by_one_within_the_budget_else_not_read(capture, features):
    capture.edit("", lambda d: features(d["ProtocolFeaturesSupported"]))
    before = len(_gets(capture, 0))
    reading = bmc.read_bmc_verdicts(capture.config())
    gets = _gets(capture, before)
    assert not any("$expand" in g for g in gets)
    assert len(gets) <= MAX_DOCUMENTS + 1  # + the service root
    gpus = _gpus(reading)
    first = gpus["GPU_SXM_1"].telemetry.nvlink
    assert (first.read_by, first.ports, first.ports_up, first.metrics_read, first.replay_count) == (
        "per_port", 18, 18, 18, 0)
    # 95 documents of health leave 65: one GPU's 1 + 36; the others' ports would not fit and are not read.
    for n in range(2, 9):
        t = gpus[f"GPU_SXM_{n}"].telemetry
        assert t.nvlink is None and "DocumentBudgetExceeded" in t.nvlink_unread, t.nvlink_unread
    assert not any(f"GPU_SXM_{n}/Ports/" in g for g in gets for n in range(2, 9))
    assert {v.status for v in gpus.values()} == {"ok"} and bmc.check_of(reading).status == "ok"


def test_a_ports_collection_listing_ten_thousand_members_is_bounded_and_health_unaffected(capture):
    ports = f"/redfish/v1/{PROCESSORS}/GPU_SXM_1/Ports"
    capture.edit(f"{PROCESSORS}/GPU_SXM_1/Ports", lambda d: d.update(
        Members=[{"@odata.id": f"{ports}/NVLink_{k}"} for k in range(10_000)]))
    before = len(_gets(capture, 0))
    reading = bmc.read_bmc_verdicts(capture.config())
    assert len(_gets(capture, before)) == 1 + 2 + 1 + 8 * 9 + 4 * 5 + 8
    gpus = _gpus(reading)
    t = gpus["GPU_SXM_1"].telemetry
    assert t.nvlink is None and f"lists 10000 ports, more than {MAX_PORT_MEMBERS}" in t.nvlink_unread
    assert gpus["GPU_SXM_2"].telemetry.nvlink.ports == 18
    assert {v.status for v in gpus.values()} == {"ok"} and bmc.check_of(reading).status == "ok"


@pytest.mark.parametrize("where", ["member", "inline_id", "metrics", "ports_link"])
def test_a_foreign_link_in_an_expanded_answer_is_refused_like_any_member_link(capture, where):
    ports = f"{PROCESSORS}/GPU_SXM_2/Ports"
    foreign = "https://127.0.0.2:9/redfish/v1/" + ports
    if where == "member":  # the collection lists a port on another host: left a link, never requested
        capture.edit(ports, lambda d: d["Members"].__setitem__(0, {"@odata.id": f"{foreign}/NVLink_0"}))
    elif where == "inline_id":  # an expanded port names itself on another host
        capture.edit(f"{ports}/NVLink_5", lambda d: d.update({"@odata.id": f"{foreign}/NVLink_5"}))
    elif where == "metrics":  # a port's Metrics link to plain http on the BMC's own host and port
        capture.edit(f"{ports}/NVLink_3", lambda d: d.update(
            Metrics={"@odata.id": f"http://127.0.0.1:{capture.port}/redfish/v1/{ports}/NVLink_3/Metrics"}))
    else:  # the processor's own Ports link leaves the BMC: its NVLink unread, its health read as before
        capture.edit(f"{PROCESSORS}/GPU_SXM_2", lambda d: d.update(Ports={"@odata.id": foreign}))
    before = len(_gets(capture, 0))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    t = gpus["GPU_SXM_2"].telemetry
    assert t.nvlink is None and ": ForeignLink: " in t.nvlink_unread, t.nvlink_unread
    assert "127.0.0.2" not in capture.requests_seen()
    assert not any("/GPU_SXM_2/Ports/" in g for g in _gets(capture, before))  # nothing else requested for it
    assert gpus["GPU_SXM_3"].telemetry.nvlink.ports == 18
    assert {v.status for v in gpus.values()} == {"ok"}


def test_a_port_whose_metrics_cannot_be_read_leaves_nvlink_unread_never_zeros(capture):
    # A Metrics link the service cannot expand stays a link; the agent GETs it (404 here): NVLink unread, named.
    ports = f"{PROCESSORS}/GPU_SXM_4/Ports"
    capture.edit(f"{ports}/NVLink_7", lambda d: d.update(Metrics={"@odata.id": f"/redfish/v1/{ports}/NVLink_7/Gone"}))
    before = len(_gets(capture, 0))
    gpus = _gpus(bmc.read_bmc_verdicts(capture.config()))
    assert f"/redfish/v1/{ports}/NVLink_7/Gone" in _gets(capture, before)
    t = gpus["GPU_SXM_4"].telemetry
    assert t.nvlink is None and "NVLink_7/Gone" in t.nvlink_unread, t.nvlink_unread
    assert {v.status for v in gpus.values()} == {"ok"}
