"""The re-check of each quarantine reason: what ``slice.unquarantine`` must see pass before a component returns.

One function per reason code in :data:`RECHECKS`. A reason with no function here is refused
``recheck_unavailable``: a component is never returned on an operator's word alone when a check
could have failed (the one exception is ``operator``: an operator took it out, an operator's reason
returns it). Each function reads only; none changes the component.

Wired here: ``gpu_aer_fatal`` (sysfs AER counters, ``discovery/aer.py``), ``smart_failing``
(``nvme smart-log``, ``host/smart.py``), ``wipe_unverified`` (the slot's latest wipe proof, written by
a release retried since, covers every byte and no lease holds the disk) and ``operator``. The reasons
whose check belongs to another pipeline are wired by it: ``gpu_reset_failed`` / ``gpu_memory_clear_failed`` / ``gpu_xid`` (the GPU handover) and
``firmware_changed`` (the firmware inventory) -- each adds ``RECHECKS[reason] = its_recheck`` with
the :data:`Recheck` signature.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuaas_agent.contract.fleet import ComponentKind, QuarantineReason, QuarantineRecord, RecheckVerdict
from gpuaas_agent.discovery.aer import aer_counts, function_present
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.run import run
from gpuaas_agent.host.smart import Runner, judge_smart, read_smart_log
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.aio import as_store_thread


@dataclass(frozen=True)
class RecheckContext:
    """What a re-check may read: the host root, the runner for a device command, and the slice drivers
    when the daemon built them (a wipe re-check needs the disk drivers; None on a box without them)."""

    host_root: Path
    runner: Runner = run
    drivers: Any = None  # SliceDrivers | None
    store: Any = None  # the agent's StateStore (or its StoreThread): the wipe proofs and leases
    extra: dict[str, Any] = field(default_factory=dict)


Recheck = Callable[[RecheckContext, QuarantineRecord], Awaitable[RecheckVerdict]]


async def recheck_operator(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """An operator's quarantine: nothing failed that a machine could re-run; the unquarantine reason stands."""
    return RecheckVerdict(check="operator", passed=True,
                          detail="taken out by an operator; returned by the operator's reason")


async def recheck_aer(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """The PCI function is on the bus, reports AER, and its fatal counter is zero (the kernel counts since boot:
    a host reboot or the device's remove-and-rescan is what clears it)."""
    if record.kind not in (ComponentKind.gpu, ComponentKind.fabric_vf):
        return RecheckVerdict(check="pcie_aer", passed=False,
                              detail=f"a {record.kind.value} has no PCI address to read AER counters of")
    host = HostRoot.open(ctx.host_root)
    address = record.identity
    present = await asyncio.to_thread(function_present, host, address)
    if not present:
        return RecheckVerdict(check="pcie_aer", passed=False, detail=f"{address} is not on the PCI bus")
    counts = await asyncio.to_thread(aer_counts, host, address)
    if "fatal" not in counts:
        return RecheckVerdict(check="pcie_aer", passed=False, evidence={"aer": counts},
                              detail=f"{address} exposes no aer_dev_fatal counter: the error cannot be shown gone")
    if counts["fatal"]:
        return RecheckVerdict(check="pcie_aer", passed=False, evidence={"aer": counts},
                              detail=f"{address} fatal={counts['fatal']} since boot: reboot the host (or remove and "
                                     "rescan the device) before returning it")
    return RecheckVerdict(check="pcie_aer", passed=True, evidence={"aer": counts},
                          detail=f"{address} fatal=0 nonfatal={counts.get('nonfatal', 0)}")


def _namespace_of(host: HostRoot, identity: str) -> str | None:
    """The kernel name of the namespace whose disk identity is ``identity`` now (kernel names move)."""
    for disk in discover(host).nvme_devices:
        if disk.disk_identity == identity:
            return disk.kernel_name
    return None


async def recheck_smart(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """The disk's SMART log now: critical warning clear, no media error since it was judged, wear under 100 %."""
    if record.kind is not ComponentKind.nvme:
        return RecheckVerdict(check="nvme_smart", passed=False, detail=f"a {record.kind.value} has no SMART log")
    host = HostRoot.open(ctx.host_root)
    if not host.is_live:
        return RecheckVerdict(check="nvme_smart", passed=False,
                              detail=f"recorded root {ctx.host_root}: SMART cannot be read, so it cannot pass")
    name = await asyncio.to_thread(_namespace_of, host, record.identity)
    if name is None:
        return RecheckVerdict(check="nvme_smart", passed=False, detail=f"no namespace is {record.identity} on this host")
    try:
        doc = await read_smart_log(f"/dev/{name}", runner=ctx.runner)
    except AgentError as exc:
        return RecheckVerdict(check="nvme_smart", passed=False, detail=f"{exc.code}: {exc.message}"[:4000])
    baseline = record.evidence.get("media_errors", 0)
    fit, detail, counters = judge_smart(doc, media_errors_baseline=baseline if isinstance(baseline, int) else 0)
    return RecheckVerdict(check="nvme_smart", passed=fit, detail=f"/dev/{name}: {detail}",
                          evidence={"kernel_name": name, **counters})


async def recheck_wipe(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """The slot's disk was wiped again since, by a release whose proof covers every byte and verified, and no
    lease holds it (a release frees the lease only after such a proof). Reads the store only."""
    if record.kind is not ComponentKind.nvme or record.slot_index is None:
        return RecheckVerdict(check="wipe_proof", passed=False,
                              detail=f"a {record.kind.value} without a slot index has no wipe proof to read")
    if ctx.store is None:
        return RecheckVerdict(check="wipe_proof", passed=False, detail="no store to read the slot's wipe proofs from")
    store = as_store_thread(ctx.store)
    held = [lease for lease in await store.leases() if lease.disk_identity == record.identity]
    if held:
        return RecheckVerdict(check="wipe_proof", passed=False, evidence={"lease": held[0].model_dump(mode="json")},
                              detail=f"allocation {held[0].allocation_id} still holds the disk: its release has not "
                                     "verified a wipe yet (send slice.vm_release again)")
    proof = await store.run(lambda s: s.latest_wipe_proof(record.slot_index))
    if proof is None or not proof.covers_every_byte:
        return RecheckVerdict(check="wipe_proof", passed=False,
                              evidence={"proof": proof.model_dump(mode="json") if proof else None},
                              detail="the slot's latest wipe proof does not verify every byte")
    return RecheckVerdict(check="wipe_proof", passed=True, evidence={"guarantee": proof.guarantee.value,
                                                                       "method": proof.method.value},
                          detail=f"the latest wipe verified every byte ({proof.guarantee.value}, {proof.method.value})")


RECHECKS: dict[QuarantineReason, Recheck] = {
    QuarantineReason.wipe_unverified: recheck_wipe,
    QuarantineReason.operator: recheck_operator,
    QuarantineReason.gpu_aer_fatal: recheck_aer,
    QuarantineReason.smart_failing: recheck_smart,
}
