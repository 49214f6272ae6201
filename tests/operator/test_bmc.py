"""GPU and NVSwitch health from an HGX baseboard BMC, read over HTTPS from a real Redfish server process.

The server is sushy-tools' ``sushy-static`` (the DMTF mockup layout) serving the HGX-shaped
mockup of ``lab/hgx_redfish_mockup.py``; it reads each file per request, so a test may break
a document while the server runs. It prints every request's headers, which proves what the
agent sent (basic auth) and what it did not send (anything, when the credentials file is refused).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from gpuaas_agent.config import ConfigError, parse_config
from gpuaas_agent.contract.bmc import GpuTelemetry, NvSwitchTelemetry
from gpuaas_agent.host.run import run
from gpuaas_agent.operator import bmc, health
from lab.hgx_redfish_mockup import ROOT, baseboard, set_field, write_mockup
from tests.support.deadline import run_bounded
from tests.support.redfish_server import PCI, started_server

SYSTEM = f"{ROOT}/Systems/HGX_Baseboard_0"
SWITCHES = f"{ROOT}/Fabrics/HGX_NVLinkFabric_0/Switches"


@pytest.fixture
def redfish(tmp_path):
    server = started_server(tmp_path)
    yield server
    server.stop()


def _by_id(reading):
    return {v.gpu_id: v for v in reading.gpus}, {v.switch_id: v for v in reading.nvswitches}


def test_healthy_baseboard_is_ok_per_gpu_with_its_pci_address_and_basic_auth(redfish):
    reading = bmc.read_bmc_verdicts(redfish.config())
    gpus, switches = _by_id(reading)
    assert reading.error is None
    assert sorted(gpus) == sorted(PCI) and all(v.status == "ok" for v in gpus.values())
    assert gpus["GPU_SXM_3"].pci_address == PCI["GPU_SXM_3"]
    assert gpus["GPU_SXM_3"].telemetry.temperature.reading_c == 34.0 and gpus["GPU_SXM_3"].telemetry.power_w == 71.5
    assert gpus["GPU_SXM_3"].telemetry.sxm_slot == "SXM3"
    assert gpus["GPU_SXM_3"].telemetry.row_remapping_failed is False
    assert sorted(switches) == [f"NVSwitch_{n}" for n in range(4)] and all(v.status == "ok" for v in switches.values())
    check = bmc.bmc_check(redfish.config())
    assert (check.name, check.status) == ("gpu_bmc", "ok")
    assert "8 GPU(s) and 4 NVSwitch(es) ok" in check.detail
    # Basic authentication with the file's account (base64 of agent-ro:s3cret-pw); the password is in no verdict.
    assert "Authorization: Basic YWdlbnQtcm86czNjcmV0LXB3" in redfish.requests_seen()
    assert "s3cret-pw" not in reading.model_dump_json()


def test_failed_and_degraded_components_are_named_with_their_evidence(redfish):
    def hostile(docs):
        set_field(docs, f"{SYSTEM}/Memory/GPU_SXM_3_DRAM_0", "Oem.Nvidia.RowRemappingFailed", True)
        set_field(docs, f"{SYSTEM}/Memory/GPU_SXM_5_DRAM_0", "Oem.Nvidia.RowRemappingPending", True)
        set_field(docs, f"{ROOT}/Chassis/HGX_GPU_SXM_2/Sensors/HGX_GPU_SXM_2_TEMP_0", "Reading", 88.0)
        set_field(docs, f"{SYSTEM}/Processors/GPU_SXM_6/ProcessorMetrics", "Oem.Nvidia.ThrottleReasons",
                  ["HWThermalSlowdown"])
        set_field(docs, f"{SYSTEM}/Processors/GPU_SXM_7/ProcessorMetrics", "PCIeErrors.FatalErrorCount", 1)
        set_field(docs, f"{SWITCHES}/NVSwitch_1", "Status.Health", "Critical")
    write_mockup(redfish.mockup, edit=hostile)
    reading = bmc.read_bmc_verdicts(redfish.config())
    gpus, switches = _by_id(reading)
    status = {k: v.status for k, v in gpus.items()}
    assert status == {"GPU_SXM_1": "ok", "GPU_SXM_2": "degraded", "GPU_SXM_3": "failed", "GPU_SXM_4": "ok",
                      "GPU_SXM_5": "degraded", "GPU_SXM_6": "degraded", "GPU_SXM_7": "failed", "GPU_SXM_8": "ok"}
    assert gpus["GPU_SXM_3"].reasons == ("row remapping failed (no spare HBM rows)",)
    assert gpus["GPU_SXM_2"].reasons == ("temperature 88 C >= caution 87 C (NVIDIA NVML_TEMPERATURE_THRESHOLD_GPU_MAX)",)
    assert gpus["GPU_SXM_6"].reasons == ("hardware slowdown HWThermalSlowdown",)
    assert switches["NVSwitch_1"].status == "failed"
    check = bmc.bmc_check(redfish.config())
    assert check.status == "failed"
    assert check.detail.startswith("failed GPU_SXM_3 (0000:38:00.0): row remapping failed")
    assert "NVSwitch_1: Redfish health Critical" in check.detail


def test_malformed_json_for_one_gpu_makes_that_gpu_unavailable_never_ok(redfish):
    (redfish.mockup / "Systems/HGX_Baseboard_0/Processors/GPU_SXM_4/ProcessorMetrics/index.json").write_text(
        '{"CacheMetricsTotal": {"LifeTime": ')
    gpus, _ = _by_id(bmc.read_bmc_verdicts(redfish.config()))
    assert gpus["GPU_SXM_4"].status == "unavailable"
    assert "ProcessorMetrics" in gpus["GPU_SXM_4"].reasons[0]
    assert gpus["GPU_SXM_4"].telemetry.row_remapping_failed is False  # what could be read is still evidence
    assert all(v.status == "ok" for k, v in gpus.items() if k != "GPU_SXM_4")
    assert bmc.bmc_check(redfish.config()).status == "unavailable"


def test_wrongly_typed_field_is_unread_not_guessed(redfish):
    write_mockup(redfish.mockup, edit=lambda docs: set_field(
        docs, f"{SYSTEM}/Memory/GPU_SXM_1_DRAM_0", "Oem.Nvidia.RowRemappingFailed", "false"))
    gpus, _ = _by_id(bmc.read_bmc_verdicts(redfish.config()))
    assert gpus["GPU_SXM_1"].status == "unavailable"
    assert "MalformedAttributeError" in gpus["GPU_SXM_1"].reasons[0]


def test_malformed_service_root_makes_every_gpu_unavailable(redfish):
    (redfish.mockup / "index.json").write_text("<html>BMC is starting</html>")
    reading = bmc.read_bmc_verdicts(redfish.config())
    assert reading.error is not None and "service root" in reading.error
    assert [v.status for v in reading.gpus] == ["unavailable"] * 8
    assert bmc.bmc_check(redfish.config()).status == "unavailable"


def test_hanging_bmc_is_unavailable_within_the_request_timeout(redfish):
    os.kill(redfish.proc.pid, signal.SIGSTOP)  # the kernel still accepts connections; nothing answers
    try:
        reading = bmc.read_bmc_verdicts(redfish.config(request_timeout_s=0.5))
    finally:
        os.kill(redfish.proc.pid, signal.SIGCONT)
    assert reading.error is not None and "did not answer its service root" in reading.error
    assert "timed out" in reading.error
    assert {v.status for v in reading.gpus} == {"unavailable"}


def test_hanging_bmc_in_the_health_round_answers_unavailable_by_its_deadline(redfish):
    async def one_round():
        return await asyncio.gather(*health.bmc_checks(redfish.config(request_timeout_s=30.0, check_timeout_s=1.0),
                                                     threads=health.CheckThreads()))

    os.kill(redfish.proc.pid, signal.SIGSTOP)
    try:
        checks = run_bounded(one_round(), 30)
    finally:
        os.kill(redfish.proc.pid, signal.SIGCONT)
    [[check]] = checks
    assert (check.name, check.status) == ("gpu_bmc", "unavailable")
    assert "did not answer within 1s" in check.detail


def test_bmc_that_does_not_answer_is_unavailable(redfish):
    redfish.stop()
    check = bmc.bmc_check(redfish.config())
    assert check.status == "unavailable"
    assert "did not answer its service root" in check.detail


def test_untrusted_certificate_is_not_read(redfish, tmp_path):
    other = tmp_path / "other-ca.pem"
    asyncio.run(run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                     "-nodes", "-keyout", str(tmp_path / "other.key"), "-out", str(other), "-days", "1",
                     "-subj", "/CN=127.0.0.1"], timeout=30))
    check = bmc.bmc_check(redfish.config(ca_file=other))
    assert check.status == "unavailable" and "SSL" in check.detail


def test_group_readable_credentials_are_refused_before_anything_is_sent(redfish):
    redfish.creds.chmod(0o640)
    before = redfish.requests_seen()
    check = bmc.bmc_check(redfish.config())
    assert check.status == "unavailable"
    assert check.detail.startswith("creds_insecure: BMC credentials")
    assert redfish.requests_seen() == before


def test_credentials_that_are_not_json_are_refused_without_echoing_them(redfish):
    redfish.creds.write_text("agent-ro:s3cret-pw\n")
    reading = bmc.read_bmc_verdicts(redfish.config())
    assert reading.error.startswith("bmc_credentials_invalid:")
    assert "s3cret" not in reading.model_dump_json()


def test_mapped_gpu_missing_from_the_bmc_is_failed(redfish):
    def drop(docs):
        coll = docs[f"{SYSTEM}/Processors"]
        coll["Members"] = [m for m in coll["Members"] if not m["@odata.id"].endswith("GPU_SXM_8")]
    write_mockup(redfish.mockup, edit=drop)
    gpus, _ = _by_id(bmc.read_bmc_verdicts(redfish.config()))
    assert gpus["GPU_SXM_8"].status == "failed" and gpus["GPU_SXM_8"].telemetry is None
    assert gpus["GPU_SXM_8"].pci_address == PCI["GPU_SXM_8"]


@pytest.mark.parametrize("where", ["another_host", "plain_http", "protocol_relative", "userinfo"])
def test_member_links_leaving_the_bmc_origin_are_refused_before_any_credential_is_sent(redfish, where):
    # A listener that would receive whatever the agent sent elsewhere: another port is another origin.
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen(8)
        thief.setblocking(False)
        port = thief.getsockname()[1]
        link = {"another_host": f"https://127.0.0.1:{port}{SYSTEM}/Processors/GPU_SXM_1",
                "plain_http": f"http://127.0.0.1:{redfish.port}{SYSTEM}/Processors/GPU_SXM_1".replace(
                    f":{redfish.port}", f":{port}"),
                "protocol_relative": f"//127.0.0.1:{port}{SYSTEM}/Processors/GPU_SXM_1",
                "userinfo": f"https://127.0.0.1:{redfish.port}@127.0.0.1:{port}{SYSTEM}/Processors/GPU_SXM_1"}[where]

        def lure(docs):
            docs[f"{SYSTEM}/Processors"]["Members"][0] = {"@odata.id": link}
        write_mockup(redfish.mockup, edit=lure)
        reading = bmc.read_bmc_verdicts(redfish.config())
        with pytest.raises(BlockingIOError):  # nothing ever connected to the listener: no TCP, no TLS, no header
            thief.accept()
    assert reading.error is not None and "leaves its origin" in reading.error
    assert all(v.status == "unavailable" for v in reading.gpus)
    # Only the two collections were read on the BMC itself; no GPU, no sensor.
    assert "GET /redfish/v1/Systems/HGX_Baseboard_0/Processors/GPU_SXM_2" not in redfish.requests_seen()


def test_a_same_origin_absolute_member_link_is_read_as_a_path(redfish):
    def absolute(docs):
        members = docs[f"{SYSTEM}/Processors"]["Members"]
        members[0] = {"@odata.id": f"https://127.0.0.1:{redfish.port}{members[0]['@odata.id']}"}
    write_mockup(redfish.mockup, edit=absolute)
    reading = bmc.read_bmc_verdicts(redfish.config())
    assert reading.error is None and all(v.status == "ok" for v in reading.gpus)


@pytest.mark.parametrize(("link", "path"), [
    ("/redfish/v1/Systems/S/Processors/GPU_1", "/redfish/v1/Systems/S/Processors/GPU_1"),
    ("https://BMC.example:443/redfish/v1/x?y=1", "/redfish/v1/x?y=1"),
    ("https://bmc.example/redfish/v1/x", "/redfish/v1/x"),
])
def test_own_path_keeps_links_on_the_bmc(link, path):
    from gpuaas_agent.operator.redfish import own_path
    assert own_path("https://bmc.example", link) == path


@pytest.mark.parametrize("link", [
    "https://evil.example/redfish/v1/x", "http://bmc.example/redfish/v1/x", "https://bmc.example:8443/redfish/v1/x",
    "//evil.example/redfish/v1/x", "https://bmc.example@evil.example/redfish/v1/x",
    "https://user@bmc.example/redfish/v1/x", "https://bmc.example:notaport/x", "Processors/GPU_1",
    "ftp://bmc.example/redfish/v1/x",
])
def test_own_path_refuses_links_that_leave_the_bmc(link):
    from gpuaas_agent.operator.redfish import ForeignLink, own_path
    with pytest.raises(ForeignLink):
        own_path("https://bmc.example", link)


# -- judging without a server -----------------------------------------------------------------


def test_lifetime_dram_ecc_and_remap_counts_are_evidence_not_a_verdict():
    t = GpuTelemetry(gpu_id="GPU_SXM_1", health="OK", state="Enabled", dram_ecc_uncorrectable=3,
                     row_remap_uncorrectable=3, row_remapping_failed=False, row_remapping_pending=False)
    assert bmc.judge_gpu(t) == ("ok", ())


def test_a_temperature_without_thresholds_is_judged_by_nvidias_limits_named_as_such():
    from gpuaas_agent.contract.bmc import TemperatureReading

    hot = GpuTelemetry(gpu_id="GPU_SXM_1", temperature=TemperatureReading(reading_c=96.0),
                       memory_temperature=TemperatureReading(reading_c=40.0))
    assert bmc.judge_gpu(hot) == (
        "failed", ("temperature 96 C >= critical 95 C (NVIDIA NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)",))
    warm_hbm = GpuTelemetry(gpu_id="GPU_SXM_1", memory_temperature=TemperatureReading(reading_c=95.5))
    assert bmc.judge_gpu(warm_hbm) == (
        "failed", ("memory temperature 95.5 C >= critical 95 C (NVIDIA NVML_TEMPERATURE_THRESHOLD_MEM_MAX)",))
    assert bmc.judge_gpu(GpuTelemetry(gpu_id="GPU_SXM_1", throttle_reasons=None)) == ("ok", ())


def test_failed_outranks_unread_and_unread_outranks_ok():
    t = GpuTelemetry(gpu_id="GPU_SXM_1", health="Critical", unread=("x: Timeout",))
    assert bmc.judge_gpu(t) == ("failed", ("Redfish health Critical",))
    assert bmc.judge_gpu(GpuTelemetry(gpu_id="GPU_SXM_1", unread=("x: Timeout",)))[0] == "unavailable"
    assert bmc.judge_nvswitch(NvSwitchTelemetry(switch_id="NVSwitch_0", ecc_uncorrectable=1))[0] == "degraded"


def test_the_mockup_matches_the_hgx_layout():
    docs = baseboard()
    assert f"{SYSTEM}/Processors/GPU_SXM_8/ProcessorMetrics" in docs
    assert f"{SWITCHES}/NVSwitch_3/SwitchMetrics" in docs
    assert len([u for u in docs if u.startswith(f"{SYSTEM}/Processors/") and u.count("/") == 6]) == 8


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(("bmc", "message"), [
    ({"url": "http://10.0.0.1", "credentials_file": "/x"}, "bmc.url"),
    ({"url": "https://10.0.0.1", "credentials_file": "/x", "gpu_pci_addresses": {"GPU_SXM_1": "18:00.0"}},
     "not a PCI address"),
    ({"url": "https://10.0.0.1", "credentials_file": "/x",
      "gpu_pci_addresses": {"GPU_SXM_1": "0000:18:00.0", "GPU_SXM_2": "0000:18:00.0"}}, "same PCI address"),
])
def test_bmc_config_refuses_plaintext_and_bad_mappings(bmc, message):
    with pytest.raises(ConfigError) as err:
        parse_config({"bmc": bmc})
    assert message in err.value.message


def test_a_configured_bmc_joins_the_health_round_and_an_unconfigured_one_does_not():
    config = parse_config({"bmc": {"url": "https://169.254.0.17", "credentials_file": "/var/lib/gpuaas-agent/bmc.json"}})
    assert health.HealthSettings.from_config(config).bmc == config.bmc
    assert health.bmc_checks(None, threads=health.CheckThreads()) == []
    assert health.HealthSettings.from_config(parse_config({})).bmc is None
