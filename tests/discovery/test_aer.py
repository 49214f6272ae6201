"""AER counters of one PCI function from sysfs (the recorded host, a copy with counters written in)."""

from __future__ import annotations

from gpuaas_agent.discovery.aer import aer_counts, aer_total, function_present
from gpuaas_agent.hostfs import HostRoot

GPU = "0000:18:00.0"


def test_the_total_line_wins_and_its_absence_sums_the_counters():
    assert aer_total("RxErr 2\nBadTLP 1\nTOTAL_ERR_COR 3\n") == 3
    assert aer_total("Undefined 0\nDLP 4\nSDES 1\n") == 5
    assert aer_total("garbage line\nDLP x\n") == 0


def test_counts_are_read_per_kind_and_a_function_without_aer_has_none(host_copy):
    root = host_copy("h200-slice-after-transition")
    host = HostRoot.open(root)
    assert function_present(host, GPU) and not function_present(host, "0000:ee:00.0")
    assert aer_counts(host, GPU) == {}  # the recording exposes no AER counters
    device = (root / "sys/bus/pci/devices" / GPU).resolve()
    (device / "aer_dev_fatal").write_text("Undefined 0\nDLP 1\nTOTAL_ERR_FATAL 1\n")
    (device / "aer_dev_nonfatal").write_text("PoisonTLP 2\nTOTAL_ERR_NONFATAL 2\n")
    assert aer_counts(host, GPU) == {"fatal": 1, "nonfatal": 2}
