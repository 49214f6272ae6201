"""GPU hardware health through NVML: XID events, ECC, retired pages, remapped rows, and their recorded form.

A GPU that fell off the bus (XID 79), took an uncontained ECC error (XID 95) or cannot
remap another row is not fit for a tenant, though discovery still sees it on the PCI bus.
NVML (``nvidia-ml-py``, the driver's ``libnvidia-ml.so``) is the only reader of these:

- XIDs are events, not counters: one NVML session stays open for the life of the daemon
  (:class:`NvmlSource`) with an event set registered for critical XIDs, drained without
  blocking (``nvmlEventSetWait_v2(set, 0)``) on every health round;
- counters: volatile and aggregate uncorrected ECC, pages retired (single-bit, double-bit,
  pending), remapped rows (correctable, uncorrectable, pending, failure).

What a reading looks like is :class:`NvmlReading` (extra=forbid), the same model for the
live host and for a recorded fixture (``fixtures/nvml/<host>.json``):
``python -m gpuaas_agent.operator.nvml record OUT.json`` writes one on a host with the driver.
:func:`judge` turns a reading into the ``gpu_nvml`` health check.

Tested: the driver-absent path (this project's CI has no NVIDIA driver), the judging of
recorded readings, and the reader's calls against a replay of a reading through the
real ``pynvml`` names. The live path ran once against a real driver and GPU (a lent H200,
2026-11-28): its recording is ``fixtures/nvml/h200-lent-2026-11-28.json`` and is judged in the tests.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.base import WireModel, first_error
from gpuaas_agent.contract.tasks import CheckStatus
from gpuaas_agent.errors import AgentError

FORMAT: Literal["gpuaas-nvml/1"] = "gpuaas-nvml/1"
# How long after an unusable NVML (no library, no driver) the next round tries again: a driver
# that loads later is seen within this, and a host without one does not dlopen every round.
NVML_RETRY_S = 600.0
MAX_EVENTS_PER_ROUND = 256
KEEP_EVENTS = 64
# An XID older than this no longer sets the verdict (the GPU was reset or the host rebooted since, or an
# operator looked): it stays in the reading until it falls off the KEEP_EVENTS list.
XID_WINDOW = timedelta(hours=24)
# XIDs that mean the GPU itself is broken (NVIDIA's XID catalogue): the host fails.
FATAL_XIDS = {48: "double-bit ECC error", 64: "ECC page retirement or row remapping failed",
              74: "NVLink error", 79: "GPU has fallen off the bus", 95: "uncontained ECC error",
              119: "GSP RPC timeout", 120: "GSP error"}
# XIDs that want a reset or a drain, not a replacement: the host is degraded.
DEGRADING_XIDS = {63: "ECC page retirement or row remapping recorded", 92: "high single-bit ECC error rate",
                  94: "contained ECC error"}
# Anything else (13, 31, 43, 45: a guest program's fault) is kept in the reading and does not judge the GPU.


class XidEvent(WireModel):
    xid: int = Field(ge=0)
    gpu_index: int | None = Field(default=None, ge=0)
    seen_at: datetime


class NvmlGpu(WireModel):
    """One GPU's counters; None where this board or driver does not answer (ECC off, no row remapper)."""

    index: int = Field(ge=0)
    name: str = Field(max_length=256)
    uuid: str | None = Field(default=None, max_length=128)
    pci_bus_id: str = Field(max_length=64)
    ecc_mode_current: bool | None = None
    ecc_volatile_uncorrected: int | None = Field(default=None, ge=0)
    ecc_aggregate_uncorrected: int | None = Field(default=None, ge=0)
    retired_pages_sbe: int | None = Field(default=None, ge=0)
    retired_pages_dbe: int | None = Field(default=None, ge=0)
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = Field(default=None, ge=0)
    remapped_rows_uncorrectable: int | None = Field(default=None, ge=0)
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None


class NvmlReading(WireModel):
    """What NVML said at one moment, live or recorded. ``provenance`` says which (and marks synthetic data)."""

    format: Literal["gpuaas-nvml/1"] = FORMAT
    provenance: str = Field(min_length=1, max_length=1000)
    host: str | None = Field(default=None, max_length=256)
    recorded_at: datetime
    driver_version: str | None = Field(default=None, max_length=64)
    nvml_version: str | None = Field(default=None, max_length=64)
    gpus: list[NvmlGpu]
    xid_events: list[XidEvent] = Field(default_factory=list, max_length=KEEP_EVENTS * 4)


class NvmlFixtureError(AgentError):
    default_code = "nvml_fixture_invalid"


def load_reading(path: Path) -> NvmlReading:
    """A recorded reading from disk; a file that is not one is a typed error naming the first bad field."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise NvmlFixtureError(f"cannot read NVML fixture {path}: {exc.strerror}", code="nvml_fixture_unreadable",
                               evidence={"path": str(path)}) from None
    try:
        return NvmlReading.model_validate_json(raw)
    except ValidationError as exc:
        field, reason = first_error(exc)
        raise NvmlFixtureError(f"{path}: {field}: {reason}", evidence={"path": str(path), "field": field}) from None


# -- the verdict -----------------------------------------------------------------------------


def judge(reading: NvmlReading, now: datetime | None = None) -> tuple[CheckStatus, str]:
    """``(status, detail)`` of the ``gpu_nvml`` check: ``failed``, ``degraded`` or ``ok``.

    failed: a row remap failed, or a fatal XID within :data:`XID_WINDOW`.
    degraded: uncorrected ECC errors since the driver loaded (volatile), rows or pages waiting
    for a reset to be remapped/retired, a degrading XID within the window.
    Aggregate (lifetime) uncorrected ECC and rows already remapped are history the GPU has
    absorbed: they are named in the detail and do not move the verdict by themselves.
    """
    now = now or datetime.now(UTC)
    failed: list[str] = []
    degraded: list[str] = []
    history: list[str] = []
    for gpu in reading.gpus:
        who = f"gpu {gpu.index} {gpu.pci_bus_id}"
        if gpu.remapped_rows_failure:
            failed.append(f"{who}: row remapping failed")
        if gpu.ecc_volatile_uncorrected:
            degraded.append(f"{who}: volatile uncorrected ECC errors={gpu.ecc_volatile_uncorrected}")
        if gpu.remapped_rows_pending:
            degraded.append(f"{who}: remapped rows pending a reset")
        if gpu.retired_pages_pending:
            degraded.append(f"{who}: retired pages pending a reset")
        if gpu.ecc_aggregate_uncorrected:
            history.append(f"{who}: aggregate uncorrected ECC={gpu.ecc_aggregate_uncorrected}")
        if gpu.remapped_rows_uncorrectable:
            history.append(f"{who}: rows remapped for uncorrectable errors={gpu.remapped_rows_uncorrectable}")
        if gpu.retired_pages_dbe:
            history.append(f"{who}: pages retired for double-bit errors={gpu.retired_pages_dbe}")
    by_index = {g.index: g.pci_bus_id for g in reading.gpus}
    for event in reading.xid_events:
        if now - event.seen_at > XID_WINDOW:
            continue
        who = "gpu ?" if event.gpu_index is None else f"gpu {event.gpu_index} {by_index.get(event.gpu_index, '')}".rstrip()
        line = f"{who}: XID {event.xid} at {event.seen_at.isoformat(timespec='seconds')}"
        if event.xid in FATAL_XIDS:
            failed.append(f"{line} ({FATAL_XIDS[event.xid]})")
        elif event.xid in DEGRADING_XIDS:
            degraded.append(f"{line} ({DEGRADING_XIDS[event.xid]})")
    if failed:
        return "failed", "; ".join(failed + degraded)
    if degraded:
        return "degraded", "; ".join(degraded + history)
    ecc_off = [str(g.index) for g in reading.gpus if g.ecc_mode_current is False]
    detail = (f"{len(reading.gpus)} GPU(s) via NVML (driver {reading.driver_version or 'unknown'}): "
              "no uncorrected ECC since load, nothing pending a reset, no fatal XID")
    if ecc_off:
        detail += f"; ECC off on gpu {', '.join(ecc_off)}"
    if history:
        detail += "; history: " + "; ".join(history)
    return "ok", detail


# -- the live reader -------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    """One NVML session for the daemon's life: its XID event set must outlive a health round.

    :meth:`read` is blocking (call it from the health round's thread) and never raises: it
    returns a reading, or a one-line reason NVML cannot answer. A failed init is retried at
    most every :data:`NVML_RETRY_S`. ``nvml``: the binding (``pynvml``) or a stand-in for it.
    """

    def __init__(self, nvml: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = nvml
        self._clock = clock
        self._lock = threading.Lock()
        self._ready = False
        self._failed_at: float | None = None
        self._reason = ""
        self._events = None
        self.init_calls = 0
        self.xids: list[XidEvent] = []

    def _binding(self) -> Any:  # pynvml is untyped
        if self._nvml is None:
            import pynvml  # nvidia-ml-py; imported on first use, not with the daemon

            self._nvml = pynvml
        return self._nvml

    def _open(self) -> str | None:
        if self._ready:
            return None
        if self._failed_at is not None and self._clock() - self._failed_at < NVML_RETRY_S:
            return self._reason
        try:
            nvml = self._binding()
        except ImportError:
            self._failed_at, self._reason = self._clock(), "pynvml (nvidia-ml-py) is not installed"
            return self._reason
        self.init_calls += 1
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError subclasses differ with the driver's state
            self._failed_at, self._reason = self._clock(), f"nvmlInit failed: {exc}"
            return self._reason
        self._ready, self._failed_at = True, None
        self._register_xids(nvml)
        return None

    def _register_xids(self, nvml: Any) -> None:
        try:
            self._events = nvml.nvmlEventSetCreate()
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    if nvml.nvmlDeviceGetSupportedEventTypes(handle) & nvml.nvmlEventTypeXidCriticalError:
                        nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
                except nvml.NVMLError:
                    continue  # this GPU cannot report XIDs (a vGPU, an old board): its counters still can
        except nvml.NVMLError:
            self._events = None

    def _drain_xids(self, nvml: Any) -> None:
        if self._events is None:
            return
        for _ in range(MAX_EVENTS_PER_ROUND):
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)  # 0 ms: never blocks the round
            except nvml.NVMLError_Timeout:
                break
            except nvml.NVMLError:
                break
            if data.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = nvml.nvmlDeviceGetIndex(data.device)
            except nvml.NVMLError:
                index = None
            self.xids.append(XidEvent(xid=int(data.eventData), gpu_index=index, seen_at=datetime.now(UTC)))
        del self.xids[:-KEEP_EVENTS]

    def _gpu(self, nvml: Any, index: int) -> NvmlGpu:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)

        def ask(fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return fn(handle, *args)
            except nvml.NVMLError:
                return None  # not supported here (ECC off, no row remapper, a passthrough limit)

        ecc_mode = ask(nvml.nvmlDeviceGetEccMode)
        rows = ask(nvml.nvmlDeviceGetRemappedRows)
        sbe = ask(nvml.nvmlDeviceGetRetiredPages, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = ask(nvml.nvmlDeviceGetRetiredPages, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = ask(nvml.nvmlDeviceGetRetiredPagesPendingStatus)
        uuid = ask(nvml.nvmlDeviceGetUUID)
        return NvmlGpu(
            index=index, name=_text(nvml.nvmlDeviceGetName(handle)), uuid=None if uuid is None else _text(uuid),
            pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
            ecc_mode_current=None if ecc_mode is None else bool(ecc_mode[0]),
            ecc_volatile_uncorrected=ask(nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                         nvml.NVML_VOLATILE_ECC),
            ecc_aggregate_uncorrected=ask(nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                          nvml.NVML_AGGREGATE_ECC),
            retired_pages_sbe=None if sbe is None else len(sbe), retired_pages_dbe=None if dbe is None else len(dbe),
            retired_pages_pending=None if pending is None else bool(pending),
            remapped_rows_correctable=None if rows is None else int(rows[0]),
            remapped_rows_uncorrectable=None if rows is None else int(rows[1]),
            remapped_rows_pending=None if rows is None else bool(rows[2]),
            remapped_rows_failure=None if rows is None else bool(rows[3]),
        )

    def read(self, provenance: str = "live") -> NvmlReading | str:
        with self._lock:
            reason = self._open()
            if reason is not None:
                return reason
            nvml = self._nvml
            try:
                self._drain_xids(nvml)
                gpus = [self._gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
                driver = _text(nvml.nvmlSystemGetDriverVersion())
                version = _text(nvml.nvmlSystemGetNVMLVersion())
            except Exception as exc:  # a GPU lost mid-read, the driver unloaded: start over next round
                self.close()
                self._failed_at, self._reason = None, ""
                return f"NVML query failed: {exc}"
            return NvmlReading(provenance=provenance, recorded_at=datetime.now(UTC), driver_version=driver,
                               nvml_version=version, gpus=gpus, xid_events=list(self.xids))

    def close(self) -> None:
        if not self._ready:
            return
        nvml, self._ready = self._nvml, False
        try:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
            nvml.nvmlShutdown()
        except Exception:
            pass
        self._events = None


SOURCE = NvmlSource()  # the daemon's one session


# -- recording --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuaas_agent.operator.nvml record OUT.json [--host NAME]``: exit 0, or 3 without NVML."""
    parser = argparse.ArgumentParser(prog="gpuaas_agent.operator.nvml", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="write this host's NVML reading as a fixture")
    rec.add_argument("out", type=Path)
    rec.add_argument("--host", default=None, help="the fixture host name this reading belongs to")
    args = parser.parse_args(argv)
    source = NvmlSource()
    try:
        reading = source.read(provenance=f"recorded by gpuaas_agent.operator.nvml on {args.host or 'this host'}")
    finally:
        source.close()
    if isinstance(reading, str):
        print(f"gpuaas-agent: nvml_unavailable: {reading}", file=sys.stderr)
        return 3
    reading = reading.model_copy(update={"host": args.host})
    args.out.write_text(reading.model_dump_json(indent=2) + "\n")
    print(f"recorded {len(reading.gpus)} GPU(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
