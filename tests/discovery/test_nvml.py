"""NVML enrichment is skipped cleanly: on fixtures always, and on a live host without the driver."""

from gpuaas_agent.discovery.nvml import enrich, normalise_bus_id
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host


def _gpus():
    return discover(HostRoot.open(fixture_host("h200-slice-after-transition"))).gpus


def test_fixture_root_never_consults_nvml():
    gpus = _gpus()
    enriched, status = enrich(gpus, live=False)
    assert enriched == gpus and status.status == "not_live_host"


def test_live_host_without_driver_reports_unavailable_and_keeps_sysfs_data():
    # Real pynvml (nvidia-ml-py is a test dependency); CI machines have no NVIDIA driver.
    gpus = _gpus()
    enriched, status = enrich(gpus, live=True)
    assert status.status == "unavailable" and "nvmlInit failed" in status.detail
    assert enriched == gpus


def test_bus_id_forms_are_normalised():
    assert normalise_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalise_bus_id(b"00000000:DB:00.0") == "0000:db:00.0"
