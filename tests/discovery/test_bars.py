"""BAR sizes from sysfs ``resource``: what sizes the guest's 64-bit MMIO window."""

from __future__ import annotations

from gpuaas_agent.discovery.bars import function_bars, mmio64_bytes, parse_resource, read_bars
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host

H200_HOST = "h200-slice-after-transition"


def test_every_h200_reports_its_256_gib_framebuffer_bar():
    report = discover(HostRoot.open(fixture_host(H200_HOST)))
    assert len(report.gpus) == 8
    for gpu in report.gpus:
        sizes = {b.index: (b.size_bytes, b.is_64bit, b.prefetchable) for b in gpu.bars}
        assert sizes == {0: (16 << 20, False, False), 1: (256 << 30, True, True), 3: (32 << 20, True, True)}
        # packed at the largest BAR's alignment: one H200 needs a 512 GiB window behind its root port
        assert mmio64_bytes(gpu.bars) == 512 << 30


def test_io_port_and_unused_bars_are_not_mmio():
    text = "\n".join([
        "0x0000000000001000 0x000000000000107f 0x0000000000040101",  # I/O port BAR
        "0x0000000000000000 0x0000000000000000 0x0000000000000000",  # unused
        "0x00000000fa000000 0x00000000fa003fff 0x0000000000040200",  # 16 KiB 32-bit
    ] + ["0x0000000000000000 0x0000000000000000 0x0000000000000000"] * 10)
    bars = parse_resource(text)
    assert [(b.index, b.size_bytes, b.is_64bit) for b in bars] == [(2, 16 << 10, False)]
    assert mmio64_bytes(bars) == 0


def test_sriov_bars_of_a_pf_are_not_counted_as_its_own():
    lines = ["0x0000000000000000 0x0000000000000000 0x0000000000000000"] * 13
    lines[7] = "0x0000300000000000 0x00003000001fffff 0x000000000014220c"  # IOV BAR 0
    assert parse_resource("\n".join(lines)) == []


def test_malformed_resource_is_a_warning_and_unknown_bars(host_copy):
    root = host_copy(H200_HOST)
    gpu = discover(HostRoot.open(root)).gpus[0].pci_address
    (root / f"sys/bus/pci/devices/{gpu}/resource").write_text("0x0 0x1\n")
    reader = SysReader(HostRoot.open(root))
    assert read_bars(reader, gpu) == []
    assert [f.code for f in reader.findings.items] == ["pci_resource_malformed"]


def test_a_recording_without_resource_files_has_unknown_bars_and_no_warning():
    host = HostRoot.open(fixture_host("h200-vm-passthrough"))
    report = discover(host)
    assert report.gpus and all(g.bars == [] for g in report.gpus)
    assert "pci_resource_malformed" not in {w.code for w in report.warnings}
    assert function_bars(host, None) == []
