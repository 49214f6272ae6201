"""PCI BARs from a function's sysfs ``resource`` file: how much guest MMIO space a passed-through device needs.

An H200 exposes a 256 GiB 64-bit prefetchable framebuffer BAR; OVMF's default
64-bit PCI window (32 GiB on most builds) cannot map it, the guest driver then
fails with "BAR1 is 0M @ 0x0" (a trap KubeVirt and Nova users hit). The
domain XML sizes the window from these sizes (``host/vm/guest_topology.py``), so
they are read here, from the kernel's own view, never assumed from a model name.

``resource`` is 13 lines on a non-bridge function (6 BARs, the ROM, 6 SR-IOV
BARs), each ``start end flags`` in hex; an unused BAR is all zeros.
"""

from __future__ import annotations

from gpuaas_agent.contract.topology import PciBar
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.hostfs import HostRoot

PCI_DEVICES = "/sys/bus/pci/devices"
# include/linux/ioport.h
IORESOURCE_MEM = 0x00000200
IORESOURCE_PREFETCH = 0x00002000
IORESOURCE_MEM_64 = 0x00100000
STANDARD_BARS = 6  # lines 0-5; line 6 is the expansion ROM, 7-12 the SR-IOV BARs (the VFs', not ours)


def parse_resource(text: str) -> list[PciBar]:
    """The memory BARs (index 0-5) with a size; raises ValueError on a line that is not three hex numbers."""
    bars = []
    for index, line in enumerate(text.splitlines()[:STANDARD_BARS]):
        fields = line.split()
        if len(fields) != 3:
            raise ValueError(f"resource line {index} has {len(fields)} fields, expected 3")
        start, end, flags = (int(f, 16) for f in fields)
        if not flags & IORESOURCE_MEM or end <= start:
            continue  # unused, or an I/O-port BAR (not MMIO)
        bars.append(PciBar(index=index, size_bytes=end - start + 1, is_64bit=bool(flags & IORESOURCE_MEM_64),
                           prefetchable=bool(flags & IORESOURCE_PREFETCH)))
    return bars


def read_bars(reader: SysReader, address: str) -> list[PciBar]:
    """BARs of one function; empty when unknown (a malformed file is also a warning).

    Absence is not warned: recordings made before the recorder copied ``resource`` lack it, and the
    domain builder refuses a passthrough GPU whose BARs are unknown, which is where it matters.
    """
    path = f"{PCI_DEVICES}/{address}/resource"
    if not reader.host.exists(path):
        return []
    text = reader.text(path)
    if text is None:
        return []
    try:
        return parse_resource(text)
    except ValueError as exc:
        reader.findings.warn("pci_resource_malformed", str(exc), path)
        return []


def mmio64_bytes(bars: list[PciBar]) -> int:
    """Bytes of 64-bit MMIO a device needs behind its own root port: its 64-bit BARs packed at their alignment.

    A bridge window is aligned to its largest BAR and each BAR to its own size (BARs are powers of two),
    so the span is the sum rounded up to the largest BAR: 256 GiB + 32 MiB -> 512 GiB for an H200.
    """
    sizes = [b.size_bytes for b in bars if b.is_64bit]
    if not sizes:
        return 0
    largest = max(sizes)
    return -(-sum(sizes) // largest) * largest


def function_bars(host: HostRoot, address: str | None) -> list[PciBar]:
    """BARs of one function on ``host`` (provision reads them when it builds the domain spec)."""
    if address is None:
        return []
    return read_bars(SysReader(host), address)
