"""An NVMe SMART log's verdict, and nvme-cli run for real on a device that has none."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from gpuaas_agent.errors import HostError
from gpuaas_agent.host.storage.smart import judge_smart, read_smart_log
from tests.support.realdev import require_root

# nvme-cli 2.x prints critical_warning as an object; 1.x as an int (both seen in the field).
HEALTHY_2X = {"critical_warning": {"value": 0}, "media_errors": 3, "percent_used": 7}
HEALTHY_1X = {"critical_warning": 0, "media_errors": 0, "percentage_used": 99}


def test_a_clear_log_is_fit_and_a_stable_media_error_count_passes_against_its_baseline():
    assert judge_smart(HEALTHY_1X)[0] is True
    assert judge_smart(HEALTHY_2X)[0] is False  # 3 media errors nobody has judged yet
    fit, detail, counters = judge_smart(HEALTHY_2X, media_errors_baseline=3)
    assert fit and counters["media_errors"] == 3 and "percentage_used=7" in detail


@pytest.mark.parametrize("doc, problem", [
    ({"critical_warning": 4, "media_errors": 0, "percent_used": 1}, "critical_warning=0x4"),
    ({"critical_warning": 0, "media_errors": 9, "percent_used": 1}, "media_errors=9"),
    ({"critical_warning": 0, "media_errors": 0, "percent_used": 100}, "percentage_used=100"),
    ({"media_errors": 0}, "no critical_warning"),  # a log that proves nothing never passes
    ({"critical_warning": True}, "no critical_warning"),  # a bool is not a counter
])
def test_a_failing_or_incomplete_log_is_unfit(doc, problem):
    fit, detail, _ = judge_smart(doc)
    assert not fit and problem in detail


def test_nvme_cli_on_a_device_without_a_smart_log_is_smart_log_unreadable(tmp_path):
    require_root()
    backing = tmp_path / "disk.img"
    backing.write_bytes(b"\0" * (1 << 20))
    loop = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True, capture_output=True, text=True,
                          timeout=30).stdout.strip()
    try:
        with pytest.raises(HostError) as refused:
            asyncio.run(read_smart_log(loop))
        assert refused.value.code == "smart_log_unreadable" and loop in refused.value.message
    finally:
        subprocess.run(["losetup", "-d", loop], check=True, timeout=30)
