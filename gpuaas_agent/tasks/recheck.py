"""The re-check of each quarantine reason: what ``slice.unquarantine`` must see pass before a component returns.

One function per reason code in :data:`RECHECKS`. A reason with no function here is refused
``recheck_unavailable``: a component is never returned on an operator's word alone when a check
could have failed (the one exception is ``operator``: an operator took it out, an operator's reason
returns it). Each function reads only; none changes the component.

Wired here: ``gpu_aer_fatal`` (sysfs AER counters, ``discovery/aer.py``), ``smart_failing``
(``nvme smart-log``, ``host/storage/smart.py``), ``wipe_unverified`` (the slot's latest wipe proof was recorded after
the quarantine by a release retried since, is of the quarantined disk itself (its ``disk_identity``), covers every
byte, and no lease holds the disk), ``gpu_reset_failed`` /
``gpu_memory_clear_failed`` (a release's GPU handover of that device passed since),
``firmware_changed`` (the changed components read their recorded or a baseline version again) and
``operator``. ``bmc_failed`` and ``gpu_xid`` read the BMC and NVML, in the room above
(``operator/health_quarantine.py`` ``OPERATOR_RECHECKS``): the daemon passes the merged table in
``TaskDeps.rechecks`` to the ``slice.unquarantine`` row of ``tasks/registry.py``; importing that room changes
nothing here. A handler built without it answers those reasons ``recheck_unavailable``. A new reason adds ``RECHECKS[reason] =
its_recheck`` (or, read above tasks/, an entry of ``OPERATOR_RECHECKS``) with the :data:`Recheck` signature.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuaas_agent.contract.firmware import FirmwareChange
from gpuaas_agent.contract.fleet import ComponentKind, QuarantineReason, QuarantineRecord, RecheckVerdict
from gpuaas_agent.contract.gpuhandover import handover_meta_key
from gpuaas_agent.discovery.aer import aer_counts, function_present
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.run import run
from gpuaas_agent.host.storage.smart import Runner, judge_smart, read_smart_log
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.fabricvf import recheck_parked


@dataclass(frozen=True)
class RecheckContext:
    """What a re-check may read: the host root, the runner for a device command, and the slice drivers
    when the daemon built them (a wipe re-check needs the disk drivers; None on a box without them)."""

    host_root: Path
    runner: Runner = run
    drivers: SliceDrivers | None = None
    store: StateStore | StoreThread | None = None  # the agent's store: the wipe proofs and leases
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
    """The quarantined disk was wiped again after the quarantine, by a release whose proof is of that very disk
    (``WipeProof.disk_identity``), covers every byte and verified, and no lease holds it (a release frees the
    lease only after such a proof). The slot's latest proof decides: one from before the quarantine, of another
    disk, or not over every byte is refused. Reads the store only."""
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
    slot_index = record.slot_index
    latest = await store.run(lambda s: s.latest_wipe_proof_at(slot_index))
    since = record.quarantined_at.timestamp()
    if latest is None or latest[0] <= since:
        # A proof from before the quarantine is what the quarantine overruled, not evidence against it.
        return RecheckVerdict(check="wipe_proof", passed=False,
                              evidence={"quarantined_at": record.quarantined_at.isoformat(),
                                        "latest_proof_at": None if latest is None else latest[0]},
                              detail=f"no wipe proof over every byte of slot {slot_index}'s disk was recorded since it was "
                                     f"quarantined at {record.quarantined_at.isoformat()}: send slice.vm_release again")
    proof = latest[1]
    evidence = {"proof": proof.model_dump(mode="json"), "latest_proof_at": latest[0]}
    if proof.disk_identity != record.identity:
        # Another disk in the slot now (a swap), or a proof from before proofs named their disk: the quarantined
        # disk itself was not shown empty.
        return RecheckVerdict(check="wipe_proof", passed=False, evidence=evidence,
                              detail=f"the slot's latest wipe proof is of disk {proof.disk_identity or 'unnamed'}, "
                                     f"not of the quarantined disk {record.identity}")
    if not proof.covers_every_byte:
        return RecheckVerdict(check="wipe_proof", passed=False, evidence=evidence,
                              detail="the slot's latest wipe proof does not verify every byte")
    return RecheckVerdict(check="wipe_proof", passed=True, evidence={"guarantee": proof.guarantee.value,
                                                                       "method": proof.method.value},
                          detail=f"the latest wipe verified every byte ({proof.guarantee.value}, {proof.method.value})")


async def recheck_gpu_handover(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """A GPU (or fabric VF) whose reset, memory clear or settings failed: a release's ``gpu_handover`` of that very
    device has passed since it was quarantined (reset, memory clear verified, settings read back), and no lease
    holds it. Reads the store only: the handover itself is the release's to run again."""
    if record.kind not in (ComponentKind.gpu, ComponentKind.fabric_vf):
        return RecheckVerdict(check="gpu_handover", passed=False, detail=f"a {record.kind.value} has no GPU handover")
    if ctx.store is None:
        return RecheckVerdict(check="gpu_handover", passed=False, detail="no store to read the handovers from")
    store = as_store_thread(ctx.store)
    held = [lease for lease in await store.leases()
            if record.identity in (lease.gpu_pci_address, lease.fabric_vf_pci_address)]
    if held:
        return RecheckVerdict(check="gpu_handover", passed=False, evidence={"lease": held[0].model_dump(mode="json")},
                              detail=f"allocation {held[0].allocation_id} still holds {record.identity}: send its "
                                     "slice.vm_release again, whose gpu_handover must pass first")
    raw = await store.run(lambda s: s.meta(handover_meta_key(record.identity)))
    passed = json.loads(raw) if raw else None
    if not passed or float(passed.get("at", 0)) <= record.quarantined_at.timestamp():
        return RecheckVerdict(check="gpu_handover", passed=False, evidence={"last_passed": passed},
                              detail=f"no GPU handover of {record.identity} has passed since it was quarantined")
    return RecheckVerdict(check="gpu_handover", passed=True, evidence={"last_passed": passed},
                          detail=f"{record.identity} was reset, cleared and restored by task {passed.get('task_id')}")


async def recheck_firmware(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """A slot whose devices' firmware changed during a tenancy: each changed component reads its version from
    before the tenancy again, or one the site's baseline allows. Reads sysfs only."""
    changes = [FirmwareChange.model_validate(c) for c in (record.evidence.get("evidence") or {}).get("changes", [])]
    if not changes:
        return RecheckVerdict(check="firmware", passed=False, detail="the quarantine names no firmware change to re-read")
    # The firmware re-read: only a quarantined component's re-check runs it, so an idle daemon does not import it
    # with the table (docs/performance.md, idle footprint).
    from gpuaas_agent.tasks.firmware_check import firmware_restored

    baseline = tuple(ctx.drivers.slice.firmware_baseline) if ctx.drivers is not None else ()
    passed, detail = await asyncio.to_thread(firmware_restored, HostRoot.open(ctx.host_root), changes, baseline)
    return RecheckVerdict(check="firmware", passed=passed, detail=detail,
                          evidence={"changes": [c.model_dump(mode="json") for c in changes]})


async def recheck_fabric_vf(ctx: RecheckContext, record: QuarantineRecord) -> RecheckVerdict:
    """A fabric VF that did not park at release: its PF reports it parked now (a release retried since parked it)."""
    if ctx.drivers is None:
        return RecheckVerdict(check="fabric_vf_parked", passed=False,
                              detail="no slice drivers on this box: the VF's PF cannot be read")
    return await recheck_parked(ctx.drivers, record)


RECHECKS: dict[QuarantineReason, Recheck] = {
    QuarantineReason.firmware_changed: recheck_firmware,
    QuarantineReason.wipe_unverified: recheck_wipe,
    QuarantineReason.gpu_reset_failed: recheck_gpu_handover,
    QuarantineReason.gpu_memory_clear_failed: recheck_gpu_handover,
    QuarantineReason.operator: recheck_operator,
    QuarantineReason.gpu_aer_fatal: recheck_aer,
    QuarantineReason.smart_failing: recheck_smart,
    QuarantineReason.fabric_vf_not_parked: recheck_fabric_vf,
}
