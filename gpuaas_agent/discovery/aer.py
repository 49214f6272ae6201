"""PCIe AER counters of one PCI function, from sysfs ``aer_dev_{fatal,nonfatal,correctable}``.

The kernel counts since boot (or since the function appeared): a fatal count goes back to zero only
when the host reboots or the device is removed and rescanned. Shared by the host health check and
the quarantine re-check of a GPU that reported a fatal error.
"""

from __future__ import annotations

from gpuaas_agent.hostfs import HostRoot

PCI_DEVICES = "/sys/bus/pci/devices"
AER_KINDS = ("fatal", "nonfatal", "correctable")


def aer_total(text: str) -> int:
    """``aer_dev_*`` files list one counter a line and end with ``TOTAL_ERR_*``; sum them when that is absent."""
    total, summed = None, 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            continue
        if parts[0].startswith("TOTAL_ERR"):
            total = int(parts[1])
        else:
            summed += int(parts[1])
    return summed if total is None else total


def aer_counts(host: HostRoot, address: str) -> dict[str, int]:
    """The function's counters by kind; only the kinds it exposes (empty: no AER reporting here)."""
    counts = {}
    for kind in AER_KINDS:
        try:
            counts[kind] = aer_total(host.read_text(f"{PCI_DEVICES}/{address}/aer_dev_{kind}"))
        except OSError:
            pass
    return counts


def function_present(host: HostRoot, address: str) -> bool:
    """The function is on the bus (its vendor id reads)."""
    try:
        host.read_attr(f"{PCI_DEVICES}/{address}/vendor")
    except OSError:
        return False
    return True
