"""Optional GPU enrichment through NVML (model, memory, UUID) on a live host with the driver.

Only a live host is enriched: a fixture describes another machine, and the
GPUs of the machine running the tests must never leak into it. Without the
``pynvml`` module or the driver the report says so and carries on.
"""

from __future__ import annotations

from gpuaas_agent.contract.topology import GpuDevice, GpuEnrichment


def normalise_bus_id(bus_id: str | bytes) -> str:
    """NVML prints ``00000000:18:00.0``; sysfs ``0000:18:00.0``."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    domain, rest = text.lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def enrich(gpus: list[GpuDevice], live: bool) -> tuple[list[GpuDevice], GpuEnrichment]:
    if not live:
        return gpus, GpuEnrichment(status="not_live_host", detail="fixture root: NVML not consulted")
    if not gpus:
        return gpus, GpuEnrichment(status="unavailable", detail="no GPUs found in sysfs")
    try:
        import pynvml
    except ImportError:
        return gpus, GpuEnrichment(status="unavailable", detail="pynvml (nvidia-ml-py) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses vary by driver state
        return gpus, GpuEnrichment(status="unavailable", detail=f"nvmlInit failed: {exc}")
    try:
        found = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            address = normalise_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            found[address] = dict(
                model=name.decode() if isinstance(name, bytes) else name,
                memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
            )
    except Exception as exc:
        return gpus, GpuEnrichment(status="unavailable", detail=f"NVML query failed: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    enriched = [g.model_copy(update=found[g.pci_address]) if g.pci_address in found else g for g in gpus]
    missing = [g.pci_address for g in gpus if g.pci_address not in found]
    detail = f"NVML did not report {', '.join(missing)} (bound to vfio-pci?)" if missing else None
    return enriched, GpuEnrichment(status="used", detail=detail)
