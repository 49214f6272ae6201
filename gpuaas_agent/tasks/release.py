"""``slice.vm_release``: stop the VM, take its plumbing down, wipe and verify the disk, free the slot.

graceful shutdown (deadline) → destroy → undefine with NVRAM → GPU handover
(reset, memory clear, settings restored and read back; VF FLR) → unplug the OVS
port → remove the dnsmasq reservation → remove the seed ISO → wipe + verify →
release the lease. Every step looks first and acts only on what it finds, so a
release after an agent restart, after a half-finished provision, or of an
allocation that is already gone succeeds and says what it found.

The pipeline is the declared sequence :data:`RELEASE_STEPS` (like provision's
``PROVISION_STEPS``): each step a named function of the read-only
:class:`ReleaseRun` and the typed outputs it ``takes``, with its safety rule beside
it. Release steps have no compensation: each one *is* the undo of a provision
step and is idempotent, so a release interrupted anywhere is finished by running
it again (a restarted agent does exactly that on redelivery).

The disk is wiped only when this host holds the slot's lease (or its
``cleanup_blocked`` record) *for this allocation*: a release naming a slot
that another allocation holds is refused with nothing touched. A wipe whose
read-back does not prove the disk empty keeps the lease and leaves the slot
``cleanup_blocked`` with the proof.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from gpuaas_agent.contract.domain import ShutdownOutcome, UndefineOutcome
from gpuaas_agent.contract.fleet import ComponentKind, QuarantineReason
from gpuaas_agent.contract.gpuhandover import GpuHandoverResult, SlotGpuHandover, handover_meta_key
from gpuaas_agent.contract.handover import GpuHandoverPolicy, LeaseHandover
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.runtime import PROFILES
from gpuaas_agent.contract.slots import ApprovedSlot, HealthState, SlotOutcome, SlotStatus
from gpuaas_agent.contract.state import SlotDetail, SlotLease, SlotRecord
from gpuaas_agent.contract.storage import DiskLease, WipeProof
from gpuaas_agent.contract.tasks import VmReleasePayload
from gpuaas_agent.contract.vfio import VFIO_DRIVER
from gpuaas_agent.errors import AgentError
from gpuaas_agent.guards.disk import read_disk_identity
from gpuaas_agent.guards.gpureset import gpu_driver
from gpuaas_agent.host.devices.gpuhandover import GPU_HANDOVER_STEPS, GpuHandover, reset_fabric_vf
from gpuaas_agent.host.storage.wipepolicy import strictest_handover, wipe_slot_disk
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks import fabric_partitions
from gpuaas_agent.tasks.context import TaskContext
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.fabricvf import park_recorded
from gpuaas_agent.tasks.firmware_check import check_slot_firmware
from gpuaas_agent.tasks.pipeline import PipelineFailed, Step, StepDef, bind_steps, run_pipeline
from gpuaas_agent.tasks.quarantine import quarantine_component

log = logging.getLogger(__name__)


class ReleaseRefused(AgentError):
    default_code = "release_refused"


def _outcome(slot_index: int, status: SlotStatus, health: HealthState, detail: dict[str, Any]) -> SlotOutcome:
    return SlotOutcome(slot_index=slot_index, status=status, health_state=health, health_detail=detail)


@dataclass(frozen=True)
class ReleaseRun:
    """What every step of one release reads and none may change.

    ``holders`` (this allocation's lease of the slot) and ``record`` (the slot's record) are
    read once, under the slot lock, before the first step; ``owns_disk`` follows from them:
    the disk is this release's to wipe only when this host holds it for this allocation.
    """

    drivers: SliceDrivers
    payload: VmReleasePayload
    task_id: str
    ctx: TaskContext
    holders: tuple[SlotLease, ...]
    record: SlotRecord | None

    @property
    def store(self) -> StoreThread:
        """The store, awaited on its thread (never a blocking call on the loop: state/aio.py)."""
        return as_store_thread(self.ctx.store)

    @property
    def slot(self) -> ApprovedSlot:
        return self.payload.slot

    @property
    def alloc(self) -> str:
        return self.payload.allocation_id

    @property
    def name(self) -> str:
        return domain_name(self.alloc)

    @property
    def port(self) -> str:
        return vnic_name(self.alloc, self.slot.slot_index)

    @property
    def owns_disk(self) -> bool:
        return bool(self.holders) or (self.record is not None and self.record.allocation_id == self.alloc)

    @classmethod
    async def for_task(cls, drivers: SliceDrivers, payload: VmReleasePayload, ctx: TaskContext) -> ReleaseRun:
        """Read the slot's lease and record; refuse (nothing touched) a slot another allocation holds."""
        store, slot, alloc = as_store_thread(ctx.store), payload.slot, payload.allocation_id
        # The disk this release may wipe is the one its lease holds (by identity), whatever the
        # payload calls it: another alias, or another slot's disk, in the payload is never wiped.
        leases = await store.leases()
        holders = [lease for lease in leases if lease.allocation_id == alloc and lease.slot_index == slot.slot_index]
        foreign = [lease for lease in leases if lease.allocation_id != alloc
                   and (lease.slot_index == slot.slot_index or lease.nvme_device == slot.nvme_device)]
        if foreign:
            raise ReleaseRefused(
                f"slot {slot.slot_index} is leased by allocation {foreign[0].allocation_id}, not {alloc}: nothing touched",
                code="lease_conflict", evidence={"held": [lease.model_dump() for lease in foreign]})
        return cls(drivers=drivers, payload=payload, task_id=ctx.envelope.task_id, ctx=ctx, holders=tuple(holders),
                   record=await store.slot_state(slot.slot_index))


# -- the steps: each a named function of the run and the typed outputs it takes, its safety rule beside it ----


@dataclass(frozen=True)
class Found:
    """What the release found of the allocation before touching anything (the result's ``found``)."""

    domain: dict[str, Any] | None
    ports: list[str]
    reservations: list[dict[str, Any]]
    lease: list[dict[str, Any]]
    slot_record: dict[str, Any] | None

    def journal(self) -> dict[str, Any]:
        return {"domain": self.domain, "ports": self.ports, "reservations": self.reservations,
                "lease": self.lease, "slot_record": self.slot_record}

    @property
    def nothing(self) -> bool:
        return not any([self.domain, self.ports, self.reservations, self.lease, self.slot_record])


@dataclass(frozen=True)
class Skipped:
    reason: str

    def journal(self) -> dict[str, Any]:
        return {"skipped": self.reason}


async def find(run: ReleaseRun) -> Found:
    """Look at the domain, ports, reservations, lease and record; refuse a domain of that name not ours."""
    drivers, alloc = run.drivers, run.alloc
    info = await drivers.libvirt.lookup(run.name)
    async with drivers.ovs() as ovs:
        ports = await asyncio.to_thread(ovs.list_agent_ports)
    reservations = await asyncio.to_thread(drivers.reservations().reservations)
    found = Found(
        domain=info.model_dump(mode="json") if info else None,
        ports=[p.name for p in ports if p.allocation_id == alloc],
        reservations=[r.model_dump(mode="json") for r in reservations if r.allocation_id == alloc],
        lease=[lease.model_dump() for lease in run.holders],
        slot_record=run.record.model_dump(mode="json") if run.record else None)
    if info is not None and (info.metadata is None or info.metadata.allocation_id != alloc):
        raise ReleaseRefused(f"domain {run.name} exists but is not this agent's domain of {alloc}",
                             code="domain_not_ours", evidence={"domain": found.domain})
    return found


async def shutdown(run: ReleaseRun, found: Found) -> ShutdownOutcome | Skipped:
    """Graceful power-off up to the payload's deadline, then destroy; only the domain ``find`` proved ours."""
    # A browser terminal into the slice ends now, audited as allocation_inactive, not when the guest dies.
    closed = await run.drivers.close_slot_terminals(run.alloc, run.slot.slot_index)
    if closed:
        log_event(log, "release_closed_terminals", task_id=run.task_id, allocation_id=run.alloc,
                  slot_index=run.slot.slot_index, sessions=closed)
    if found.domain is None:
        return Skipped("no domain")
    return await run.drivers.libvirt.shutdown(run.name, deadline_s=run.payload.graceful_timeout_s)


async def undefine(run: ReleaseRun, found: Found) -> UndefineOutcome | Skipped:
    """Undefine with its NVRAM: the domain no longer names the disk, so the wipe's guard lets it go."""
    if found.domain is None:
        return Skipped("no domain")
    return await run.drivers.libvirt.undefine(run.name)


@dataclass(frozen=True)
class GpuHandedOver:
    """The slot's GPU (and fabric VF) reset, cleared and proven (host/devices/gpuhandover.py), or why not."""

    proof: SlotGpuHandover | None
    skipped: str | None = None

    def journal(self) -> dict[str, Any]:
        return {"skipped": self.skipped} if self.proof is None else self.proof.model_dump(mode="json")


# The GPU handover's own declared steps (host/devices/gpuhandover.py), run inside the release's ``gpu_handover``
# step by the same runner as this pipeline: each is journaled ``gpu_handover.<step>`` and has its crash points
# before and after its side effect (the crash harness enumerates these). None is compensated: the release runs
# again whole after an interruption, so a handover cut anywhere is redone from its first query.
GPU_HANDOVER_JOURNAL_PREFIX = "gpu_handover."
RELEASE_GPU_HANDOVER_STEPS: tuple[StepDef[GpuHandover], ...] = tuple(
    StepDef(GPU_HANDOVER_JOURNAL_PREFIX + step.name, step.run, no_compensation=step.no_compensation)
    for step in GPU_HANDOVER_STEPS)


async def hand_over_journaled(run: ReleaseRun, handover: GpuHandover) -> GpuHandoverResult:
    """:data:`RELEASE_GPU_HANDOVER_STEPS` through the pipeline runner on the release's journal; a failed step
    raises its own typed error (not a nested pipeline failure), so the release fails ``gpu_handover`` with
    the handover's code and evidence."""
    try:
        await run_pipeline(run.ctx, bind_steps(RELEASE_GPU_HANDOVER_STEPS, handover))
    except PipelineFailed as failed:
        raise failed.cause from failed.cause.__cause__
    return handover.result()


async def gpu_handover(run: ReleaseRun, found: Found) -> GpuHandedOver:
    """Reset, clear and restore the lease's GPU, FLR its fabric VF; refused while any defined domain names one.

    The policy is the lease's (fixed at validate). A lease from before handover policies gets the
    catalog's default, unless the domain it had says its profile passed no GPU through or the GPU is
    not on vfio-pci (never passed through). A failure raises: the release leaves the slot
    cleanup_blocked and the GPU is not offered again.
    """
    if not run.holders:
        return GpuHandedOver(None, "this host holds no lease of this allocation on the slot: its devices are not ours")
    lease = run.holders[0]
    source: Literal["lease", "catalog_default"] = "lease"
    if lease.handover is not None:
        policy = lease.handover.gpu
        if policy is None:
            return GpuHandedOver(None, f"profile {lease.handover.profile} passes no GPU through")
    else:
        metadata = (found.domain or {}).get("metadata") or {}
        profile = PROFILES.get(metadata.get("profile") or "")
        if profile is not None and not profile.hostdevs:
            return GpuHandedOver(None, f"lease from before handover policies; profile {profile.name} passes no GPU through")
        driver = gpu_driver(run.drivers.discovered_root(), lease.gpu_pci_address)
        if driver != VFIO_DRIVER:  # bind_vfio puts a passed-through GPU there and nothing takes it back
            return GpuHandedOver(None, f"lease from before handover policies; {lease.gpu_pci_address} is on "
                                       f"{driver or 'no driver'}, not vfio-pci: it was never passed through")
        policy, source = GpuHandoverPolicy(), "catalog_default"
    drivers, host = run.drivers, run.drivers.discovered_root()
    held = await drivers.libvirt.defined_domain_hostdevs()
    handover = await GpuHandover.begin(host, lease.gpu_pci_address, policy, held=held, tool=drivers.gpu_admin())
    gpu = await hand_over_journaled(run, handover)
    vf = await reset_fabric_vf(host, lease.fabric_vf_pci_address, held=held)
    done = SlotGpuHandover(policy_source=source, gpus=[gpu], fabric_vf=vf)
    # Remembered per device: slice.unquarantine's re-check of a GPU or VF reads that a handover passed since.
    for address in (lease.gpu_pci_address, lease.fabric_vf_pci_address):
        await run.store.run(lambda store, a=address: store.set_meta(handover_meta_key(a), json.dumps(
            {"task_id": run.task_id, "at": time.time(), "allocation_id": run.alloc})))
    return GpuHandedOver(done)



@dataclass(frozen=True)
class FirmwareChecked:
    """The slot's devices' firmware compared with what the lease recorded before the tenancy."""

    result: dict[str, Any]

    def journal(self) -> dict[str, Any]:
        return self.result


async def firmware_check(run: ReleaseRun) -> FirmwareChecked:
    """After the GPU handover: a device whose firmware changed during the tenancy fails the release
    (``firmware_changed``): the slot stays cleanup_blocked and is quarantined, never offered silently."""
    if not run.holders:
        return FirmwareChecked({"skipped": "this host holds no lease of this allocation on the slot"})
    return FirmwareChecked(await check_slot_firmware(run.drivers.discovered_root(), run.holders[0]))


@dataclass(frozen=True)
class Unplugged:
    """The allocation's port gone from the bridge, with its isolation teardown (flows by cookie, nft element)."""

    port: str
    removed: bool  # False: the port was already gone
    isolation: dict[str, Any]

    def journal(self) -> dict[str, Any]:
        return {"port": self.port, "removed": self.removed, **self.isolation}


@dataclass(frozen=True)
class Unreserved:
    """The slot's dnsmasq reservations removed; ``dnsmasq_pid``: the process signalled (None: file unchanged)."""

    removed: list[dict[str, Any]]
    dnsmasq_pid: int | None

    def journal(self) -> dict[str, Any]:
        return {"removed": self.removed, "dnsmasq_pid": self.dnsmasq_pid}


@dataclass(frozen=True)
class SeedRemoved:
    """Whether the slot's cloud-init seed image was there to remove."""

    removed: bool

    def journal(self) -> dict[str, Any]:
        return {"removed": self.removed}


async def ovs_unplug(run: ReleaseRun) -> Unplugged:
    """The allocation's port on the slot's bridge, its isolation flows and guard element (if there)."""
    done = await run.drivers.unplug(run.slot.ovs_bridge, run.port, run.alloc)
    return Unplugged(port=done["port"], removed=done["removed"],
                     isolation={k: v for k, v in done.items() if k not in ("port", "removed")})


async def reservation_remove(run: ReleaseRun) -> Unreserved:
    """The slot's reservation of this allocation (another allocation's entry is never matched)."""
    done = await run.drivers.unreserve(run.alloc, run.slot.slot_index)
    return Unreserved(removed=done["removed"], dnsmasq_pid=done["dnsmasq_pid"])


async def seed_remove(run: ReleaseRun) -> SeedRemoved:
    """The slot's seed ISO of this allocation (it holds the tenant's user-data)."""
    return SeedRemoved(removed=run.drivers.remove_seed(run.alloc, run.slot.slot_index)["removed"])


async def held_disk(run: ReleaseRun) -> DiskLease:
    """The lease's disk; without a lease (a cleanup_blocked record only), the payload's disk as it is
    now, provided no other lease holds that disk by identity."""
    slot, alloc = run.slot, run.alloc
    if run.holders:
        held = run.holders[0]
        return DiskLease(allocation_id=alloc, slot_index=slot.slot_index, nvme_device=held.nvme_device,
                         disk_identity=held.disk_identity)
    identity = await asyncio.to_thread(read_disk_identity, run.drivers.discovered_root(), slot.nvme_device)
    other = [lease for lease in await run.store.leases() if lease.disk_identity == identity]
    if other:
        raise ReleaseRefused(
            f"{slot.nvme_device} is the disk leased by allocation {other[0].allocation_id}: not wiped",
            code="lease_conflict", evidence={"field": "nvme_device", "held": other[0].model_dump()})
    return DiskLease(allocation_id=alloc, slot_index=slot.slot_index, nvme_device=slot.nvme_device,
                     disk_identity=identity)


@dataclass(frozen=True)
class Wiped:
    proof: WipeProof | None  # None: skipped (not this host's disk to wipe)
    skipped: str | None = None

    def journal(self) -> dict[str, Any]:
        if self.proof is None:
            return {"skipped": self.skipped}
        return {"verified": self.proof.verified, "method": self.proof.method.value, "bytes": self.proof.bytes,
                "guarantee": self.proof.guarantee.value}


async def lease_handover(run: ReleaseRun, disk_lease: DiskLease) -> LeaseHandover:
    """The handover the slot's validate fixed in its lease; without one (a lease from before handover
    policies, or a cleanup_blocked record whose lease is gone) the strictest erase the device supports.

    Never looked up from the domain or the profile catalog: a data slot of a set, whose domain the boot
    slot's release already undefined, and a retried release wipe exactly as the validate promised.
    """
    if run.holders and run.holders[0].handover is not None:
        return run.holders[0].handover
    handover, evidence = await strictest_handover(run.drivers.discovered_root(), disk_lease.nvme_device, lease=disk_lease)
    log_event(log, "release_handover_legacy", task_id=run.task_id, allocation_id=run.alloc,
              slot_index=run.slot.slot_index, method=handover.wipe.method.value,
              action=evidence.get("action", handover.wipe.method.value))
    return handover


async def wipe_leased_disk(run: ReleaseRun, found: Found, disk_lease: DiskLease) -> WipeProof:
    """The one call that wipes and proves the leased disk with the policy fixed in its lease
    (guards: the lease, the NVMe identity, no other domain's disk)."""
    drivers = run.drivers
    handover = await lease_handover(run, disk_lease)
    return await wipe_slot_disk(
        handover.wipe, drivers.discovered_root(), disk_lease.nvme_device, lease=disk_lease,
        zeros_guaranteed=handover.zeros_guaranteed,
        domain_disks=await drivers.libvirt.defined_domain_disks(exclude_allocation=run.alloc,
                                                                exclude_slot=run.slot.slot_index))


async def wipe(run: ReleaseRun, found: Found) -> Wiped:
    """Wipe + verify; every proof is kept with the slot, a failed one as the evidence of cleanup_blocked."""
    if not run.owns_disk:
        return Wiped(None, "this host holds no lease of this allocation on the slot: its disk is not ours to wipe")
    disk_lease = await held_disk(run)
    # Each proof names the disk it is of (the lease's identity, which the wipe's guards held it to): an
    # unquarantine re-check accepts only a proof of the quarantined disk (tasks/recheck.py).
    identity = {"disk_identity": disk_lease.disk_identity}
    try:
        proof = await wipe_leased_disk(run, found, disk_lease)
    except AgentError as exc:
        if exc.code == "wipe_unverified":
            await run.store.record_wipe_proof(run.slot.slot_index,
                                              WipeProof.from_wire(exc.evidence).model_copy(update=identity))
        raise
    proof = proof.model_copy(update=identity)
    await run.store.record_wipe_proof(run.slot.slot_index, proof)
    return Wiped(proof)


@dataclass(frozen=True)
class LeaseReleased:
    """The slot indexes whose lease this release gave back (at most this slot)."""

    released: list[int]

    def journal(self) -> dict[str, Any]:
        return {"released": self.released}


async def lease_release(run: ReleaseRun) -> LeaseReleased | Skipped:
    """Only after a verified wipe (the step before raised otherwise); only this slot's lease."""
    if not run.owns_disk:
        return Skipped("no lease")
    # Only this slot: the allocation's other slots keep their leases until their own disks are wiped.
    released = await run.store.release_slot_lease(run.alloc, run.slot.slot_index)
    await run.store.clear_slot_state(run.slot.slot_index)
    return LeaseReleased([released.slot_index] if released else [])


async def fabric_partition_release(run: ReleaseRun) -> dict[str, Any]:
    """After the domain is gone: deactivate the allocation's Fabric Manager partition and drop its record
    (NVSwitch hosts; nothing leased: nothing to do). Before the wipe: a GPU leaves its partition first."""
    return await fabric_partitions.deactivate_leased(run.drivers.fabric, run.store, run.alloc, release=True)


async def fabric_vf_park(run: ReleaseRun) -> dict[str, Any]:
    """After the domain is gone, before the GPU handover: park the slot's fabric VF (link disabled, parking VLAN,
    no MAC, parking GUID) and read it back (tasks/fabricvf.py); one that does not park leaves the slot
    cleanup_blocked and is quarantined. A VF no attachment reached (recorded by provision) is left as it is."""
    return await park_recorded(run.drivers, run.store, [run.slot], run.alloc, run.task_id)


_TEARDOWN = "a teardown step that looks first: running the release again finishes it"

# The release pipeline, in order (docs/operations.md names the same steps).
RELEASE_STEPS: tuple[StepDef[ReleaseRun], ...] = (
    StepDef("find", find, no_compensation="a read; refuses a domain of that name that is not ours"),
    StepDef("shutdown", shutdown, takes=("find",), no_compensation=_TEARDOWN),
    StepDef("undefine", undefine, takes=("find",), no_compensation=_TEARDOWN),
    # The NVLink partition is deactivated before its GPUs are reset: a reset under an active partition
    # would take a GPU out of a fabric Fabric Manager still believes in.
    StepDef("fabric_partition_release", fabric_partition_release, no_compensation=_TEARDOWN),
    StepDef("fabric_vf_park", fabric_vf_park,
            no_compensation="parking is what a release owes the next tenant: running the release again parks it"),
    StepDef("gpu_handover", gpu_handover, takes=("find",),
            no_compensation="a reset is not undone; a failed or interrupted one leaves the slot cleanup_blocked"),
    StepDef("firmware_check", firmware_check, no_compensation="a read; a change leaves the slot cleanup_blocked"),
    StepDef("ovs_unplug", ovs_unplug, no_compensation=_TEARDOWN),
    StepDef("reservation_remove", reservation_remove, no_compensation=_TEARDOWN),
    StepDef("seed_remove", seed_remove, no_compensation=_TEARDOWN),
    StepDef("wipe", wipe, takes=("find",), touches_disk=True,
            no_compensation="a wipe is not undone; an unverified or interrupted one leaves the slot cleanup_blocked"),
    StepDef("lease_release", lease_release,
            no_compensation="the last step, after a verified wipe: nothing after it can fail"),
)


def release_steps(run: ReleaseRun, outputs: dict[str, Any] | None = None) -> list[Step]:
    """:data:`RELEASE_STEPS` bound to one run, as the runner takes them (typed outputs into ``outputs``)."""
    return bind_steps(RELEASE_STEPS, run, outputs=outputs)


async def release(drivers: SliceDrivers, payload: VmReleasePayload, ctx: TaskContext) -> dict[str, Any]:
    store = as_store_thread(ctx.store)
    slot = payload.slot
    alloc = payload.allocation_id

    async with drivers.slot_lock(slot.slot_index):
        run = await ReleaseRun.for_task(drivers, payload, ctx)
        record = run.record
        if record is not None and record.allocation_id == alloc:
            await store.set_slot_state(record.model_copy(update={"status": SlotStatus.releasing, "task_id": run.task_id,
                                                           "updated_at": time.time()}))
        earlier_release = await store.run(released_before, run.task_id)  # this task's own earlier run, before this one journals
        typed: dict[str, Any] = {}
        try:
            outputs = await run_pipeline(ctx, release_steps(run, typed))
        except PipelineFailed as failure:
            # Past "find" the slot is half torn down and its disk not proven empty: blocked, never available.
            if run.owns_disk and failure.failed_step != "find":
                detail = {"failed_step": failure.failed_step, "code": failure.code, "evidence": failure.evidence}
                await store.set_slot_state(SlotRecord(
                    slot_index=slot.slot_index, allocation_id=alloc, status=SlotStatus.cleanup_blocked,
                    health_state=HealthState.failed, detail=SlotDetail.model_validate(detail), task_id=run.task_id,
                    updated_at=time.time()))
                ctx.slot_outcomes.append(_outcome(slot.slot_index, SlotStatus.cleanup_blocked, HealthState.failed, detail))
                await quarantine_failed_component(run, failure)
            raise
    found: Found = typed["find"]
    wiped: Wiped = typed["wipe"]
    proof = wiped.proof.model_dump(mode="json") if wiped.proof is not None else {}
    if run.owns_disk:
        ctx.slot_outcomes.append(_outcome(slot.slot_index, SlotStatus.available, HealthState.healthy,
                                          {"wipe_proof": proof}))
    elif earlier_release:
        # An earlier run of this very task wiped, verified and released the slot, then the agent died
        # before its result was stored: the answer is still "available", with that run's proof.
        earlier = await store.latest_wipe_proof(slot.slot_index)
        proof = earlier.model_dump(mode="json") if earlier is not None else {}
        ctx.slot_outcomes.append(_outcome(slot.slot_index, SlotStatus.available, HealthState.healthy,
                                          {"wipe_proof": proof, "released_by_earlier_run": True}))
    log_event(log, "slice_released", task_id=run.task_id, allocation_id=alloc, slot_index=slot.slot_index,
              wiped=bool(proof), already_gone=found.nothing)
    return {
        "vm": run.name,
        "already_gone": found.nothing,
        "found": found.journal(),
        "cleanup_proof": {
            "domain": {"shutdown": outputs["shutdown"], "undefine": outputs["undefine"]},
            "fabric_vf": outputs["fabric_vf_park"],
            "gpu_handover": outputs["gpu_handover"],
            "firmware": outputs["firmware_check"],
            "ovs_port": outputs["ovs_unplug"],
            "reservation": outputs["reservation_remove"],
            "seed": outputs["seed_remove"],
            "wipe": proof or outputs["wipe"],
            "lease": outputs["lease_release"],
        },
    }


# A handover failure that says the component itself is not fit: quarantined (not a refusal before anything was
# touched, nor a host problem such as a missing tool: those leave the slot cleanup_blocked and nothing more).
_QUARANTINE_ON = {
    ("wipe", "wipe_unverified"): (ComponentKind.nvme, QuarantineReason.wipe_unverified),
    ("gpu_handover", "gpu_reset_failed"): (ComponentKind.gpu, QuarantineReason.gpu_reset_failed),
    ("gpu_handover", "gpu_config_space_not_restored"): (ComponentKind.gpu, QuarantineReason.gpu_reset_failed),
    ("gpu_handover", "gpu_settings_not_restored"): (ComponentKind.gpu, QuarantineReason.gpu_reset_failed),
    ("gpu_handover", "gpu_memory_clear_unverified"): (ComponentKind.gpu, QuarantineReason.gpu_memory_clear_failed),
    ("firmware_check", "firmware_changed"): (ComponentKind.slot, QuarantineReason.firmware_changed),
    **{("fabric_vf_park", code): (ComponentKind.fabric_vf, QuarantineReason.fabric_vf_not_parked)
       for code in ("fabric_vf_mismatch", "fabric_vf_unsupported", "fabric_vf_missing", "fabric_vf_failed")},
}


async def quarantine_failed_component(run: ReleaseRun, failure: PipelineFailed) -> None:
    """A wipe that did not verify, or a GPU (or its fabric VF) whose reset, memory clear or settings failed, is
    quarantined with the failure's evidence: discovery and slice.plan stop offering it, the heartbeat names it,
    and only slice.unquarantine (after its re-check) returns it. The slot is cleanup_blocked besides."""
    wanted = _QUARANTINE_ON.get((failure.failed_step, failure.code))
    if wanted is None or not run.holders:
        return
    kind, reason = wanted
    lease = run.holders[0]
    identity = str(lease.slot_index) if kind is ComponentKind.slot else lease.disk_identity
    if kind is ComponentKind.fabric_vf:
        identity = lease.fabric_vf_pci_address
    if kind is ComponentKind.gpu:
        identity = lease.gpu_pci_address
        if (failure.evidence or {}).get("address") == lease.fabric_vf_pci_address:
            kind, identity = ComponentKind.fabric_vf, lease.fabric_vf_pci_address
    evidence = {"failed_step": failure.failed_step, "code": failure.code, "evidence": failure.evidence}
    await quarantine_component(run.store, kind, identity, reason, evidence, run.task_id,
                               slot_index=lease.slot_index)


def released_before(store: StateStore, task_id: str) -> bool:
    """Whether an earlier run of ``task_id`` reached ``lease_release`` (which runs only after a verified wipe)."""
    return any(e.step == "lease_release" for e in store.journal_of(task_id))


async def recover_release(drivers: SliceDrivers, payload: VmReleasePayload, ctx: TaskContext) -> dict[str, Any]:
    """The worker's recovery of an interrupted release it will not run again (deadline passed, or poison):
    no new side effect; a slot this allocation still holds is recorded ``cleanup_blocked`` (its disk is
    not proven empty), so reconcile names it and the next release finishes it."""
    store, slot, alloc = as_store_thread(ctx.store), payload.slot, payload.allocation_id
    async with drivers.slot_lock(slot.slot_index):
        holds = any(lease.allocation_id == alloc and lease.slot_index == slot.slot_index
                    for lease in await store.leases())
        record = await store.slot_state(slot.slot_index)
        if not holds and (record is None or record.allocation_id != alloc):
            return {"interrupted": True, "slot": "not held by this allocation"}
        detail = {"code": "release_interrupted", "unfinished_steps": ctx.resumed_steps}
        await store.set_slot_state(SlotRecord(slot_index=slot.slot_index, allocation_id=alloc,
                                              status=SlotStatus.cleanup_blocked, health_state=HealthState.failed,
                                              detail=SlotDetail.model_validate(detail), task_id=ctx.envelope.task_id,
                                              updated_at=time.time()))
        ctx.slot_outcomes.append(_outcome(slot.slot_index, SlotStatus.cleanup_blocked, HealthState.failed, detail))
        return {"interrupted": True, "slot": "cleanup_blocked"}
