"""Quarantine from the health loop: a slot device whose own hardware says it is failing is taken out of service.

The health checks judge the host (``pcie_aer``, ``nvme_smart``); this pass turns the same readings
into per-component quarantines, so one failing part costs its own slot and not the host's others:

* a slot GPU or fabric VF whose fatal AER counter is above zero: ``gpu_aer_fatal``;
* a slot disk whose SMART log has a critical warning, media errors or 100 % wear: ``smart_failing``;
* a GPU with a fatal XID (NVML, where the host still drives it) within the XID window: ``gpu_xid``;
* a GPU the HGX baseboard's BMC judges ``failed``: ``bmc_failed``.

One reading per round: the pass judges what the checks read (``operator/health.RoundReadings``: the
AER counters, the NVML and BMC readings of a failed ``gpu_nvml`` / ``gpu_bmc``), never reads the BMC
or NVML again, reads SMART only when ``nvme_smart`` found a failing controller, and discovers the
slots only when something names a failing part.

A component already quarantined keeps its first record; a quarantined part under a running tenant
stays in service for that tenant (nothing is torn down) and is not offered again after its release.
``slice.unquarantine`` re-runs the same check (``tasks/recheck.py``; the BMC and XID ones are here,
:data:`OPERATOR_RECHECKS`, which the daemon passes to the handler). A recorded host root is read for
AER (its counters are files) but never for SMART (nvme-cli talks to a live controller).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.bmc import BmcReading
from gpuaas_agent.contract.fleet import ComponentKind, QuarantineReason, QuarantineRecord, RecheckVerdict
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.discovery.aer import aer_counts
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.run import run
from gpuaas_agent.host.storage.smart import Runner, judge_smart, read_smart_log
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.logs import log_event
from gpuaas_agent.operator import nvml
from gpuaas_agent.operator.bmc import read_bmc_verdicts
from gpuaas_agent.operator.nvml import FATAL_XIDS, XID_WINDOW, NvmlReading
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.tasks.quarantine import quarantine_component
from gpuaas_agent.tasks.recheck import RECHECKS, Recheck, RecheckContext

log = logging.getLogger(__name__)
TASK_ID = "health-loop"


def failing_by_aer(host: HostRoot, report: TopologyReport, read: dict[str, dict[str, int]] | None = None,
                   ) -> list[tuple[ComponentKind, str, int, dict[str, Any]]]:
    """(kind, PCI address, slot index, AER counters) of every slot GPU or VF with a fatal error since boot.

    ``read``: the counters the round's ``pcie_aer`` check read (by PCI address); None: read them here.
    """
    out = []
    for slot in report.candidate_slots:
        for kind, address in ((ComponentKind.gpu, slot.gpu_pci_address),
                              (ComponentKind.fabric_vf, slot.fabric_vf_pci_address)):
            if not address:
                continue
            counts = aer_counts(host, address) if read is None else read.get(address, {})
            if counts.get("fatal"):
                out.append((kind, address, slot.slot_index, counts))
    return out


async def failing_by_smart(host: HostRoot, report: TopologyReport, *,
                           runner: Runner = run) -> list[tuple[str, int, dict[str, Any]]]:
    """(disk identity, slot index, SMART evidence) of every slot disk whose SMART log says it is failing."""
    if not host.is_live:
        return []
    out = []
    for slot in report.candidate_slots:
        disk = next((d for d in report.nvme_devices if slot.nvme_device in (d.by_id, *d.by_id_links)), None)
        if disk is None or not disk.disk_identity or not disk.kernel_name:
            continue
        try:
            doc = await read_smart_log(f"/dev/{disk.kernel_name}", runner=runner)
        except AgentError:
            continue  # unreadable is the nvme_smart health check's to report, not a verdict on the disk
        fit, detail, counters = judge_smart(doc)
        if not fit:
            out.append((disk.disk_identity, slot.slot_index, {"kernel_name": disk.kernel_name, "detail": detail,
                                                              **counters}))
    return out


def failing_by_bmc(reading: BmcReading) -> list[tuple[str, dict[str, Any]]]:
    """(PCI address, evidence) of every GPU the BMC judged failed and the config maps to a host function."""
    return [(v.pci_address, {"gpu_id": v.gpu_id, "reasons": list(v.reasons), "bmc_url": reading.bmc_url,
                             "telemetry": v.telemetry.model_dump(mode="json") if v.telemetry else None})
            for v in reading.gpus if v.status == "failed" and v.pci_address]


def pci_address_of(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` as the host's ``0000:18:00.0`` (lower case, 4-digit domain)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest else bus_id.lower()


def failing_by_xid(reading: NvmlReading, now: datetime | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(PCI address, evidence) of every GPU with a fatal XID within the window (NVIDIA's catalogue)."""
    now = now or datetime.now(UTC)
    by_index = {g.index: pci_address_of(g.pci_bus_id) for g in reading.gpus}
    out: dict[str, dict[str, Any]] = {}
    for event in reading.xid_events:
        if event.xid not in FATAL_XIDS or event.gpu_index not in by_index or now - event.seen_at > XID_WINDOW:
            continue
        address = by_index[event.gpu_index]
        out.setdefault(address, {"xids": []})["xids"].append(
            {"xid": event.xid, "meaning": FATAL_XIDS[event.xid], "seen_at": event.seen_at.isoformat()})
    return sorted(out.items())


async def quarantine_failing_devices(host_root: Path, store: StoreThread, *, runner: Runner = run,
                                     bmc_reading: BmcReading | None = None,
                                     nvml_reading: NvmlReading | None = None,
                                     aer: dict[str, dict[str, int]] | None = None,
                                     read_smart: bool = True) -> list[QuarantineRecord]:
    """One pass: judge what the health round read, quarantine each failing part; returns the new records.

    The round's readings are judged, not read again: ``aer`` (the ``pcie_aer`` check's counters; None:
    read here), ``nvml_reading`` / ``bmc_reading`` (what ``gpu_nvml`` / ``gpu_bmc`` judged; None: not
    failed). SMART is read per slot disk only with ``read_smart`` (the ``nvme_smart`` check found a
    failing controller). The slots are discovered only when one of these names a failing part: a healthy
    round costs no discovery.
    """
    host = HostRoot.open(host_root)
    suspect = (aer is None or any(c.get("fatal") for c in aer.values()) or (read_smart and host.is_live)
               or (nvml_reading is not None and bool(failing_by_xid(nvml_reading)))
               or (bmc_reading is not None and bool(failing_by_bmc(bmc_reading))))
    if not suspect:
        return []
    report = await asyncio.to_thread(discover, host)
    already = {(r.kind, r.identity) for r in await store.quarantined()}
    new: list[QuarantineRecord] = []
    for kind, address, slot_index, counts in await asyncio.to_thread(failing_by_aer, host, report, aer):
        if (kind, address) not in already:
            new.append(await quarantine_component(store, kind, address, QuarantineReason.gpu_aer_fatal,
                                                  {"aer": counts}, TASK_ID, slot_index=slot_index))
    for identity, slot_index, evidence in (await failing_by_smart(host, report, runner=runner) if read_smart else []):
        if (ComponentKind.nvme, identity) not in already:
            new.append(await quarantine_component(store, ComponentKind.nvme, identity, QuarantineReason.smart_failing,
                                                  evidence, TASK_ID, slot_index=slot_index))
    slots = {s.gpu_pci_address: s.slot_index for s in report.candidate_slots}
    if nvml_reading is not None:
        for address, evidence in failing_by_xid(nvml_reading):
            if (ComponentKind.gpu, address) not in already:
                new.append(await quarantine_component(store, ComponentKind.gpu, address, QuarantineReason.gpu_xid,
                                                      evidence, TASK_ID, slot_index=slots.get(address)))
    if bmc_reading is not None:
        for address, evidence in failing_by_bmc(bmc_reading):
            if (ComponentKind.gpu, address) not in already:
                new.append(await quarantine_component(store, ComponentKind.gpu, address, QuarantineReason.bmc_failed,
                                                      evidence, TASK_ID, slot_index=slots.get(address)))
    if new:
        log_event(log, "health_quarantined", logging.ERROR, components=[f"{r.kind.value}:{r.identity}" for r in new])
    return new


async def recheck_bmc(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """A GPU the BMC judged failed: the BMC, read now, judges it ``ok`` (unreadable or degraded is not a pass)."""
    config = ctx.extra.get("bmc")
    if config is None:
        return RecheckVerdict(check="gpu_bmc", passed=False, detail="no [bmc] is configured to read the GPU from")
    reading = await asyncio.to_thread(read_bmc_verdicts, config)
    verdict = next((v for v in reading.gpus if v.pci_address == record.identity), None)
    if verdict is None:
        return RecheckVerdict(check="gpu_bmc", passed=False,
                              detail=reading.error or f"the BMC reported nothing for {record.identity}")
    return RecheckVerdict(check="gpu_bmc", passed=verdict.status == "ok", evidence={"reasons": list(verdict.reasons)},
                          detail=f"{verdict.gpu_id}: {verdict.status}"
                                 + (f" ({'; '.join(verdict.reasons)})" if verdict.reasons else ""))


async def recheck_xid(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """A GPU with a fatal XID: NVML reads it now, and no fatal XID of it was seen after it was quarantined
    (an XID is an event: the GPU must have been reset or the host rebooted, and stayed quiet since)."""
    reading = await asyncio.to_thread(nvml.SOURCE.read)
    if isinstance(reading, str):
        return RecheckVerdict(check="gpu_xid", passed=False, detail=f"NVML unavailable: {reading}")
    if record.identity not in {pci_address_of(g.pci_bus_id) for g in reading.gpus}:
        return RecheckVerdict(check="gpu_xid", passed=False, detail=f"NVML does not see {record.identity}")
    later = [x for address, e in failing_by_xid(reading) if address == record.identity for x in e["xids"]
             if datetime.fromisoformat(x["seen_at"]) > record.quarantined_at]
    if later:
        return RecheckVerdict(check="gpu_xid", passed=False, evidence={"xids": later},
                              detail=f"{record.identity}: fatal XID {later[-1]['xid']} since it was quarantined")
    return RecheckVerdict(check="gpu_xid", passed=True, detail=f"{record.identity}: no fatal XID since it was quarantined")


# The BMC and NVML are read in this room (operator/), above the tasks that hold the re-check table. Nothing is
# registered by importing this module: the daemon hands slice.unquarantine the whole table (all_rechecks()).
OPERATOR_RECHECKS: dict[QuarantineReason, Recheck] = {
    QuarantineReason.bmc_failed: recheck_bmc,
    QuarantineReason.gpu_xid: recheck_xid,
}


def all_rechecks() -> dict[QuarantineReason, Recheck]:
    """tasks/recheck.py's table with this room's re-checks: what the daemon's ``slice.unquarantine`` runs."""
    return {**RECHECKS, **OPERATOR_RECHECKS}
