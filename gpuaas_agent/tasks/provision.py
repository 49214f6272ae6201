"""``slice.vm_provision``: the journaled pipeline that turns an approved slot into a running, reachable VM.

validate + lease → bind vfio → fetch/verify image → guard + clone → seed ISO →
OVS port → dnsmasq reservation → fabric VF (attachment applied, read back) → define → start →
readiness (lease + SSH).

Outcomes (docs/contract.md, docs/safety.md):

* success: slot ``active``/``healthy`` with the readiness evidence;
* failure before the clone started: every step undone, the lease released,
  the slot reported ``reserved`` with ``lease_released`` (the agent never
  declares a slot ``available`` itself; the disk was not touched);
* failure or cancellation once the clone started: network and domain undone,
  the lease *kept*, the slot ``cleanup_blocked``/``failed`` with the evidence,
  until a release wipes and verifies the disk. No path reports a disk clean
  that was not verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuaas_agent import __version__
from gpuaas_agent.contract.cloudinit import SeedSpec
from gpuaas_agent.contract.dhcp import GuestReadiness, Reservation
from gpuaas_agent.contract.domain import DomainInfo, DomainSpec, GuestSlot
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.ovs import OvsPort
from gpuaas_agent.contract.placement import PlacementReport
from gpuaas_agent.contract.plan import PlannedSlot
from gpuaas_agent.contract.runtime import DomainType, RuntimeProfile, get_profile
from gpuaas_agent.contract.slots import ApprovedSlot, HealthState, SlotOutcome, SlotStatus
from gpuaas_agent.contract.state import SlotDetail, SlotLease, SlotRecord, StepStatus
from gpuaas_agent.contract.storage import CloneProgress, CloneResult, DiskLease
from gpuaas_agent.contract.tasks import PlanPayload, VmProvisionPayload
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.discovery.bars import function_bars
from gpuaas_agent.discovery.numa import node_cpulist
from gpuaas_agent.discovery.ovmf import find_ovmf
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import AgentError, HostError
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.guards.preconditions import (
    check_provision_preconditions,
    parse_ed25519,
)
from gpuaas_agent.host.devices.vfio import bind_to_vfio
from gpuaas_agent.host.images.cache import ImageCache, StreamedMiss
from gpuaas_agent.host.images.clone import clone_image
from gpuaas_agent.host.images.streamclone import stream_image
from gpuaas_agent.host.network.dnsmasq import make_reservation
from gpuaas_agent.host.network.egress_readiness import egress_target, wait_for_egress
from gpuaas_agent.host.network.readiness import stale_lease_expires, wait_for_guest
from gpuaas_agent.host.storage.wipepolicy import resolve_handover
from gpuaas_agent.host.vm.cloudinit import write_seed_iso
from gpuaas_agent.logs import log_event
from gpuaas_agent.state.aio import StoreThread, as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks import fabric_partitions
from gpuaas_agent.tasks.context import Handler, TaskContext
from gpuaas_agent.tasks.domain_start import SlicePort, guarded_start, put_port
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.fabricvf import FabricVfPlan, apply_fabric_vfs, check_fabric_vfs, park_recorded
from gpuaas_agent.tasks.firmware_check import slot_firmware
from gpuaas_agent.tasks.isolation import isolate_port
from gpuaas_agent.tasks.maintenance import check_not_in_maintenance
from gpuaas_agent.tasks.pipeline import (
    PipelineFailed,
    Step,
    StepDef,
    Undo,
    bind_steps,
    run_pipeline,
)
from gpuaas_agent.tasks.plan import plan_bundle
from gpuaas_agent.tasks.provision_admission import (
    build_seed_spec,
    check_guest_address,
    check_one_slot_per_allocation,
    check_reservation,
    slice_plan_config,
)
from gpuaas_agent.tasks.quarantine import check_not_quarantined
from gpuaas_agent.tasks.slotset import (
    check_allocation_holds_only,
    check_enough_free,
    check_slot_set,
    slot_set,
    touched_slots,
)

log = logging.getLogger(__name__)

# What a second provision of a slot meets in the host's own slot record.
BUSY = frozenset({SlotStatus.provisioning, SlotStatus.active, SlotStatus.releasing})


class ProvisionRefused(AgentError):
    """Refused before anything was changed on the host."""

    default_code = "provision_refused"


@dataclass(frozen=True)
class ProvisionRun:
    """What every step of one provision reads and none may change: the host's drivers, the task, its profile.

    ``ctx`` is the worker's TaskContext (``store``, ``progress``, ``slot_outcomes``). What a step
    produces is its typed output, handed to the steps that declare they take it.
    """

    drivers: SliceDrivers
    payload: VmProvisionPayload
    profile: RuntimeProfile
    task_id: str
    ctx: TaskContext
    # An earlier run of this very task started the clone (the agent was killed or stopped under it):
    # the disk is dirty whatever this run does, and the old wipe proof no longer says it is zero.
    disk_written_before: bool = False

    @classmethod
    def for_task(cls, drivers: SliceDrivers, payload: VmProvisionPayload, ctx: TaskContext) -> ProvisionRun:
        return cls(drivers=drivers, payload=payload, profile=get_profile(payload.runtime_profile),
                   task_id=ctx.envelope.task_id, ctx=ctx)

    @property
    def store(self) -> StoreThread:
        """The store, awaited on its thread (never a blocking call on the loop: state/aio.py)."""
        return as_store_thread(self.ctx.store)

    @property
    def slot(self) -> ApprovedSlot:
        """The boot slot (the only slot of a single-slot provision)."""
        return self.payload.slot

    @property
    def slots(self) -> list[ApprovedSlot]:
        """Every slot of the allocation, boot slot first (validate refuses a bad set)."""
        return slot_set(self.payload.slot, self.payload.slots)

    @property
    def data_slots(self) -> list[ApprovedSlot]:
        return self.slots[1:]

    @property
    def name(self) -> str:
        return domain_name(self.payload.allocation_id)

    @property
    def vnic(self) -> str:
        return vnic_name(self.payload.allocation_id, self.slot.slot_index)

    @property
    def port(self) -> SlicePort:
        slot = self.slot
        return SlicePort(slot.ovs_bridge, self.vnic, slot.mac, slot.private_ip, self.payload.allocation_id,
                         slot.slot_index, self.profile.ingress_policing, guest_telemetry=self.payload.guest_telemetry)

    def disk_lease(self, validated: Validated) -> DiskLease:
        """The only disk this run may write (the guard checks every write against it)."""
        return DiskLease(allocation_id=self.payload.allocation_id, slot_index=self.slot.slot_index,
                         nvme_device=self.slot.nvme_device, disk_identity=validated.lease.disk_identity)


def _outcome(run: ProvisionRun, status: SlotStatus, health: HealthState, detail: dict[str, Any],
             slot_index: int | None = None) -> SlotOutcome:
    index = run.slot.slot_index if slot_index is None else slot_index
    return SlotOutcome(slot_index=index, status=status, health_state=health, health_detail=detail)


def _record(run: ProvisionRun, status: SlotStatus, health: HealthState, detail: dict[str, Any],
            slot_index: int | None = None) -> SlotRecord:
    index = run.slot.slot_index if slot_index is None else slot_index
    if index != run.slot.slot_index:
        detail = {**detail, "boot_slot_index": run.slot.slot_index}  # a data slot: reconcile expects no vNIC
    return SlotRecord(slot_index=index, allocation_id=run.payload.allocation_id, status=status,
                      health_state=health, detail=SlotDetail.model_validate(detail), task_id=run.task_id,
                      updated_at=time.time())


async def check_admissible(run: ProvisionRun) -> None:
    """Refusals that need no host access: profile, slot state, a second provision of the allocation.

    A multi-slot provision asks them of every slot of its set (any cleanup_blocked slot refuses the set).
    """
    if run.profile.domain_type is DomainType.qemu and not run.drivers.slice.allow_emulated_domains:
        raise ProvisionRefused(
            f"runtime profile {run.profile.name} runs under emulation (TCG); this host only runs KVM slices",
            code="emulated_domain_not_allowed", evidence={"profile": run.profile.name})
    for slot in run.slots:
        _check_admissible_slot(run, slot, await run.store.slot_state(slot.slot_index))


def _check_admissible_slot(run: ProvisionRun, slot: ApprovedSlot, record: SlotRecord | None) -> None:
    if slot.status is SlotStatus.cleanup_blocked or (record and record.status is SlotStatus.cleanup_blocked):
        raise ProvisionRefused(
            f"slot {slot.slot_index} is cleanup_blocked: its disk must be wiped and verified by a release first",
            code="slot_cleanup_blocked",
            evidence={"slot_index": slot.slot_index, "control_plane_status": slot.status.value,
                      "host_record": record.model_dump(mode="json") if record else None})
    if record and record.status is SlotStatus.provisioning and record.task_id == run.task_id:
        # This very task was running when the agent stopped (redelivered after a crash or a kill), and
        # got only as far as the restartable steps (see resume_or_compensate): it runs again from the start.
        return
    if record and record.status in BUSY:
        same = record.allocation_id == run.payload.allocation_id
        raise ProvisionRefused(
            f"slot {slot.slot_index} is {record.status.value} for "
            f"{'this allocation (task ' + record.task_id + ')' if same else 'allocation ' + record.allocation_id}",
            code="already_provisioned" if same else "slot_busy",
            evidence={"slot_index": slot.slot_index, "host_record": record.model_dump(mode="json")})


def domain_not_ours(found: DomainInfo | None, allocation_id: str, slot_index: int, created_uuid: str | None) -> str | None:
    """Why a compensation must leave the domain ``found`` alone, or None when it is this run's to undo.

    Ours means: our metadata naming this allocation *and* this slot, and, once define
    answered, the very UUID it returned. A domain of the same name (the name is per
    allocation) on another slot, or re-created by someone else meanwhile, is never touched.
    """
    if found is None:
        return None
    meta = found.metadata
    if meta is None:
        return "no agent metadata"
    if meta.allocation_id != allocation_id or meta.slot_index != slot_index:
        return f"domain of allocation {meta.allocation_id} slot {meta.slot_index}"
    if created_uuid is not None and found.uuid != created_uuid:
        return f"uuid {found.uuid} is not the domain define answered ({created_uuid})"
    return None


def _relay_key(path: Path) -> str:
    """The node's terminal relay public key (seed 004), added to every slice's authorized keys.

    A key that is not one ed25519 line is the host's fault (``relay_key_invalid``), not the tenant's:
    it must not surface as the seed's ``invalid_payload``.
    """
    try:
        text: str = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise HostError(f"terminal relay key {path} cannot be read: {getattr(exc, 'strerror', None) or exc}",
                        code="relay_key_missing", evidence={"path": str(path)}) from None
    if parse_ed25519(text) is None:
        raise HostError(f"terminal relay key {path} is not one ssh-ed25519 public key line",
                        code="relay_key_invalid", evidence={"path": str(path), "lines": len(text.splitlines())})
    return text


# -- the steps: each a named function of the run and the typed outputs it takes, its undo beside it --------


@dataclass(frozen=True)
class Validated:
    """Everything that can refuse the task was asked; the lease is held and the slot is ``provisioning``."""

    planned: PlannedSlot
    lease: SlotLease
    lease_was_held: bool
    relay_key: str
    seed_spec: SeedSpec
    preconditions: dict[str, Any]
    # The other slots of a multi-slot allocation (data disks), in set order; empty for one slot.
    data_planned: tuple[PlannedSlot, ...] = ()
    data_leases: tuple[SlotLease, ...] = ()
    placement: PlacementReport | None = None  # of a multi-slot set
    fabric_vf: FabricVfPlan | None = None  # the slots' fabric VFs to apply (or why none: tasks/fabricvf.py)

    def journal(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kernel_name": self.planned.nvme_kernel_name, "numa_node": self.planned.gpu_numa_node,
               "disk_identity": self.planned.disk_identity,
               "lease": "held_before" if self.lease_was_held else "taken",
               "preconditions": self.preconditions}
        if self.data_planned:
            out["data_slots"] = [{"slot_index": p.slot_index, "numa_node": p.gpu_numa_node,
                                  "disk_identity": p.disk_identity} for p in self.data_planned]
        if self.placement is not None:
            out["placement"] = self.placement.model_dump(mode="json")
        if self.fabric_vf is not None:
            out["fabric_vf"] = self.fabric_vf.journal()
        return out


async def _preconditions(run: ProvisionRun, planned: PlannedSlot,
                         data_planned: tuple[PlannedSlot, ...] = ()) -> dict[str, Any]:
    """Every host precondition of bind, clone, seed, port, reservation, define and start (docs/safety.md §8).

    A multi-slot set is checked slot by slot (each GPU and VF), with the profile's memory scaled by the
    number of the set's slots on that slot's NUMA node: the 1 GiB pages a node must have free are its
    cells' total, not one slot's.
    """
    if not data_planned:
        return await _slot_preconditions(run, run.slot, planned, run.profile)
    everything = [planned, *data_planned]
    per_node: dict[int | None, int] = {}
    for p in everything:
        per_node[p.gpu_numa_node] = per_node.get(p.gpu_numa_node, 0) + 1
    out = {}
    for slot, p in zip(run.slots, everything):
        profile = run.profile.model_copy(update={"memory_mib": run.profile.memory_mib * per_node[p.gpu_numa_node]})
        out[str(slot.slot_index)] = await _slot_preconditions(run, slot, p, profile)
    return {"slots": out}


async def _slot_preconditions(run: ProvisionRun, slot: ApprovedSlot, planned: PlannedSlot,
                              profile: RuntimeProfile) -> dict[str, Any]:
    drivers, payload = run.drivers, run.payload
    async with drivers.ovs() as ovs:
        bridge_exists = await asyncio.to_thread(ovs.bridge_exists, slot.ovs_bridge)
    cached = drivers.images.lookup(payload.image.sha256)
    proven = await asyncio.to_thread(
        check_provision_preconditions, drivers.discovered_root(), drivers.local_root(),
        drivers.slice.model_copy(update={"ovs_bridge": slot.ovs_bridge}), profile,
        numa_node=planned.gpu_numa_node if profile.hostdevs else None,
        gpu_pci_address=slot.gpu_pci_address if profile.hostdevs else None,
        fabric_vf_pci_address=slot.fabric_vf_pci_address if profile.hostdevs else None,
        bridge_exists=bridge_exists, image_cache_dir=drivers.images.root,
        image_size_hint=0 if cached else payload.image.size_bytes)
    return proven.model_dump(mode="json")


def _enough_free(store: StateStore, report: TopologyReport, allocation_id: str,
                 slots: list[ApprovedSlot]) -> list[int]:
    """:func:`check_enough_free` with the store first, as ``StoreThread.run`` calls it (on the store thread)."""
    return check_enough_free(report, store, allocation_id, slots)


async def validate(run: ProvisionRun) -> Validated:
    # Everything that can refuse this task is asked now, before the lease (docs/safety.md §8):
    # inputs the later steps need, the tenant's seed, the address, the slot binding, the reservation.
    drivers, payload, slot, store = run.drivers, run.payload, run.slot, run.store
    await store.run(check_not_in_maintenance)  # host_in_maintenance: first, before anything is read or leased
    slots = check_slot_set(slot, payload.slots)  # boot_slot_not_in_set, duplicate_slot
    relay_key = await asyncio.to_thread(_relay_key, drivers.slice.terminal_relay_key_file)
    check_guest_address(slot.private_ip, drivers.slice)
    seed_spec = build_seed_spec(payload, relay_key, drivers.slice)
    if (egress := egress_target(run.profile, drivers.slice)) is not None:  # readiness proves egress beyond the NAT
        seed_spec = seed_spec.model_copy(update={"egress_probe": egress})
    if len(slots) == 1:
        await store.run(check_one_slot_per_allocation, payload.allocation_id, slot.slot_index)
    else:
        await store.run(check_allocation_holds_only, payload.allocation_id, {s.slot_index for s in slots})
    report = await asyncio.to_thread(lambda: discover(drivers.discovered_root(), slice_plan_config(drivers.slice)))
    free = await store.run(_enough_free, report, payload.allocation_id, slots) if len(slots) > 1 else []
    # Each approved record must be exactly the host's candidate slot of its index, as slice.plan checks
    # (a slot of another host has bindings this host lacks: not_approved); a set that crosses the profile's
    # placement constraint is placement_violated.
    # NVSwitch host, fabric_partitions profile: Fabric Manager answers and the set is still exactly a free,
    # healthy partition (fabric_manager_missing / fabric_partition_*), before any disk is touched.
    fabric = await fabric_partitions.fabric_for(run.profile, report, drivers.fabric)
    held_partition = await store.partition_of(payload.allocation_id)
    plan = plan_bundle(PlanPayload(allocation_id=payload.allocation_id, approved_slot_ids=[s.slot_id for s in slots],
                                   slots=[s.model_copy(update={"status": SlotStatus.reserved}) for s in slots],
                                   fabric_attachment=payload.fabric_attachment),
                       report, placement=run.profile.placement, free_slots=free, fabric=fabric,
                       held_partitions=[held_partition.partition_id] if held_partition else [])
    planned = plan.slots[0]
    # The fabric VFs (docs/fabric.md): under fabric_isolation = "required" a profile passing them through needs the
    # payload's attachment and PFs that can take it (read over netlink and devlink now, before any lease):
    # fabric_attachment_missing / fabric_attachment_kind_mismatch / fabric_pf_cannot_apply.
    fabric_vf = await asyncio.to_thread(check_fabric_vfs, drivers.slice.fabric_isolation, run.profile,
                                        payload.fabric_attachment, report, slots, drivers.fabric_vf)
    await store.run(check_not_quarantined, plan)  # component_quarantined: a slot with a quarantined part
    await asyncio.to_thread(check_reservation, drivers.reservations(), payload)
    preconditions = await _preconditions(run, planned, tuple(plan.slots[1:]))
    # The handover each slot's next tenant is owed is fixed now and kept with its lease: the wipe method
    # resolved from the device's own answers (an nvme_format/nvme_sanitize profile on a drive without that
    # capability, or whose erase would reach beyond the lease, is refused now, not found at release as
    # cleanup_blocked), whether it guarantees zeroes, and the GPU state to restore.
    handovers = [await resolve_handover(run.profile, drivers.slice.wipe_policies, drivers.discovered_root(), s.nvme_device,
                                        lease=DiskLease(allocation_id=payload.allocation_id, slot_index=s.slot_index,
                                                        nvme_device=s.nvme_device, disk_identity=p.disk_identity))
                 for s, p in zip(slots, plan.slots)]
    preconditions = {**preconditions, "wipe_policy": [evidence for _, evidence in handovers]}
    # What the tenant could reflash through passthrough, as it is now: the release compares it again.
    handovers = [(handover.model_copy(update={"firmware": slot_firmware(report, s)}), evidence)
                 for s, (handover, evidence) in zip(slots, handovers)]
    wanted = [SlotLease(allocation_id=payload.allocation_id, slot_index=s.slot_index,
                        gpu_pci_address=s.gpu_pci_address, nvme_device=s.nvme_device,
                        disk_identity=p.disk_identity,
                        fabric_vf_pci_address=s.fabric_vf_pci_address, task_id=run.task_id, taken_at=time.time(),
                        handover=handover, guest_telemetry=payload.guest_telemetry)
              for s, p, (handover, _) in zip(slots, plan.slots, handovers)]
    lease_was_held = any(held.slot_index == slot.slot_index for held in await store.leases_of(payload.allocation_id))
    # One transaction for the whole set: lease_conflict on any slot takes none (nor the partition it recorded).
    recorded = await fabric_partitions.record_planned(store, plan, run.task_id, held_partition)
    try:
        leases = await store.take_leases(wanted)
    except AgentError:
        if recorded:
            await store.release_partition(payload.allocation_id)
        raise
    for s in slots:
        await store.set_slot_state(_record(run, SlotStatus.provisioning, HealthState.unknown, {}, s.slot_index))
    return Validated(planned=planned, lease=leases[0], lease_was_held=lease_was_held, relay_key=relay_key,
                     seed_spec=seed_spec, preconditions=preconditions, data_planned=tuple(plan.slots[1:]),
                     data_leases=tuple(leases[1:]), placement=plan.placement, fabric_vf=fabric_vf)


async def unlease(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    store, alloc = run.store, run.payload.allocation_id
    touched = touched_slots(run.slot.slot_index, [s.slot_index for s in run.slots], undo.started,
                           undo.disk_touched or run.disk_written_before)
    released, kept = [], []
    for slot in run.slots:
        if slot.slot_index in touched:
            kept.append(slot.slot_index)
            continue
        await store.release_slot_lease(alloc, slot.slot_index)  # only this allocation's lease of the slot
        record = await store.slot_state(slot.slot_index)
        if record is not None and record.allocation_id == alloc:  # never another allocation's
            await store.clear_slot_state(slot.slot_index)
        released.append(slot.slot_index)
    if len(run.slots) == 1:
        if kept:
            return {"lease": "kept", "reason": "the disk was written; only a verified wipe frees the slot"}
        return {"lease": "released"}
    return {"lease": {"released": released, "kept": kept},
            **({"reason": "a written disk is freed only by a verified wipe"} if kept else {})}


@dataclass(frozen=True)
class VfioBound:
    results: tuple[Any, ...] = ()
    skipped: str | None = None

    def journal(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        return {"bound": [r.model_dump(mode="json") for r in self.results]}


async def bind_vfio(run: ProvisionRun) -> VfioBound:
    if not run.profile.hostdevs:
        return VfioBound(skipped=f"profile {run.profile.name} passes no PCI devices through")
    approved = [a for s in run.slots for a in (s.gpu_pci_address, s.fabric_vf_pci_address)]
    return VfioBound(results=tuple([await bind_to_vfio(run.drivers.discovered_root(), address, approved) for address in approved]))


@dataclass(frozen=True)
class DataDisks:
    """The data disks of a multi-slot allocation, each proven writable under its own slot's lease."""

    evidence: tuple[Any, ...] = ()

    def journal(self) -> dict[str, Any]:
        return {"data_disks": [e.model_dump(mode="json") for e in self.evidence]}


async def guard_data_disks(run: ProvisionRun, validated: Validated) -> DataDisks:
    """Each data disk gets the boot disk's guard (lease by identity, not mounted, no other domain's), unwritten.

    Nothing is written here: the disk reaches the guest raw; a release wipes and verifies it like a boot disk.
    """
    if not validated.data_leases:
        return DataDisks()
    others = await run.drivers.libvirt.defined_domain_disks(exclude_allocation=run.payload.allocation_id,
                                                            exclude_slot=run.slot.slot_index)
    evidence = []
    for lease in validated.data_leases:
        disk_lease = DiskLease(allocation_id=lease.allocation_id, slot_index=lease.slot_index,
                               nvme_device=lease.nvme_device, disk_identity=lease.disk_identity)
        evidence.append(await asyncio.to_thread(check_disk_writable, run.drivers.discovered_root(), lease.nvme_device,
                                                lease=disk_lease, domain_disks=others))
    return DataDisks(evidence=tuple(evidence))


class ImagePin:
    """This run's pin of an image in the shared cache: released once, by the clone or by the image's undo.

    A streamed image holds no pin (it is not in the cache yet) but its open download: released the
    same way, so a failure between the image and clone steps frees the digest for other provisions.
    """

    def __init__(self, images: ImageCache, sha256: str, *, held: bool = True, stream: StreamedMiss | None = None) -> None:
        self._images, self._sha256, self._held, self._stream = images, sha256, held, stream

    def release(self) -> bool:
        """Drop the pin (and abandon an unwritten stream) if this run still holds it; True when it did."""
        abandoned = self._stream.abandon() if self._stream is not None else False
        if not self._held:
            return abandoned
        self._held = False
        self._images.unpin(self._sha256)
        return True


# Why an image went the way it did, for the journal (the operator reads why a first boot took two passes).
DELIVERY_WHY = {
    "cache_hit": "cached and verified before; this provision's source answered for its bytes",
    "stream": "raw and not cached: written onto the disk and into the cache in one pass, hashed as it arrived",
    "cache_then_clone": "not raw (qcow2 needs random access): downloaded into the cache, then converted by qemu-img",
}


@dataclass(frozen=True)
class FetchedImage:
    path: str | None  # None while a streamed image is not in the cache yet
    sha256: str
    size_bytes: int | None
    format: str
    pin: ImagePin
    delivery: str = "cache_hit"  # a key of DELIVERY_WHY
    source_proof: str | None = None
    stream: StreamedMiss | None = None

    def journal(self) -> dict[str, Any]:
        out = {"sha256": self.sha256, "size_bytes": self.size_bytes, "format": self.format,
               "delivery": self.delivery, "why": DELIVERY_WHY[self.delivery]}
        if self.source_proof is not None:
            out["source_proof"] = self.source_proof
        return out


async def fetch_image(run: ProvisionRun) -> FetchedImage:
    # The config bounds the size; the task's declared size (if any) lowers the bound and must match.
    # Pinned until the clone has read it: the cache's LRU eviction never takes an image a provision holds.
    # A raw image not yet cached is only opened here (its status, redirects and format are known before
    # the disk is touched); the clone step streams it onto the disk and into the cache.
    image, images = run.payload.image, run.drivers.images
    got = await images.fetch_or_open(image.url, image.sha256, size_bytes=image.size_bytes, pin=True)
    if isinstance(got, StreamedMiss):
        return FetchedImage(path=None, sha256=got.sha256, size_bytes=got.length, format=got.format.value,
                            pin=ImagePin(images, got.sha256, held=False, stream=got), delivery="stream", stream=got)
    return FetchedImage(path=got.path, sha256=got.sha256, size_bytes=got.size_bytes, format=got.format.value,
                        pin=ImagePin(images, image.sha256), source_proof=got.source_proof,
                        delivery="cache_hit" if got.source_proof is not None else "cache_then_clone")


async def unpin_image(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    fetched: FetchedImage | None = undo.output("image")
    if fetched is not None and fetched.pin.release():
        return {"image": "abandoned" if fetched.stream is not None else "unpinned"}
    return {"image": "not pinned"}


async def clone(run: ProvisionRun, validated: Validated, image: FetchedImage) -> CloneResult:
    # touches_disk: from its start, nothing but a verified wipe makes this disk clean.
    drivers, slot = run.drivers, run.slot
    try:
        # Disks of every defined domain, running or shut off, except this allocation+slot's own.
        others = await drivers.libvirt.defined_domain_disks(exclude_allocation=run.payload.allocation_id,
                                                            exclude_slot=slot.slot_index)

        async def on_progress(p: CloneProgress) -> None:
            await run.ctx.progress("clone", "progress", percent=p.percent)

        wipe_proof = None if run.disk_written_before else await run.store.latest_wipe_proof(slot.slot_index)
        if image.stream is not None:
            result, _cached = await stream_image(
                drivers.discovered_root(), image.stream, slot.nvme_device, lease=run.disk_lease(validated),
                domain_disks=others, wipe_proof=wipe_proof, on_progress=on_progress,
                timeout=drivers.slice.clone_timeout_s)
            return result
        assert image.path is not None
        return await clone_image(
            drivers.discovered_root(), image.path, slot.nvme_device,
            lease=run.disk_lease(validated), domain_disks=others, wipe_proof=wipe_proof,
            on_progress=on_progress, timeout=drivers.slice.clone_timeout_s)
    finally:
        image.pin.release()


@dataclass(frozen=True)
class Seeded:
    path: str
    sha256: str

    def journal(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256}


async def seed(run: ProvisionRun, validated: Validated) -> Seeded:
    iso = await write_seed_iso(validated.seed_spec, run.drivers.seed_path(run.payload.allocation_id, run.slot.slot_index))
    return Seeded(path=iso.path, sha256=iso.sha256)


async def unseed(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    return run.drivers.remove_seed(run.payload.allocation_id, run.slot.slot_index)


@dataclass(frozen=True)
class Plugged:
    port: OvsPort
    isolation: dict[str, Any]

    def journal(self) -> dict[str, Any]:
        return {**self.port.model_dump(mode="json"), "isolation": self.isolation}


async def ovs_port(run: ProvisionRun) -> Plugged:
    slot = run.slot
    async with run.drivers.ovs() as ovs:
        await asyncio.to_thread(ovs.ensure_bridge, slot.ovs_bridge)  # never created here: missing is a blocker
        port = await put_port(ovs, run.port, run.payload.allocation_id)
    # Closed from the moment it exists: the MAC is the slot's only (docs/safety.md §9); the tap and its
    # ofport appear at start, when the full per-port rules go in.
    isolation = await isolate_port(run.drivers, port, mac=slot.mac, ip=slot.private_ip,
                                   guest_telemetry=run.payload.guest_telemetry)
    return Plugged(port=port, isolation=isolation)


async def unplug(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    return await run.drivers.unplug(run.slot.ovs_bridge, run.vnic, run.payload.allocation_id)


@dataclass(frozen=True)
class Reserved:
    reservation: Reservation
    changed: bool
    dnsmasq_pid: int | None

    def journal(self) -> dict[str, Any]:
        return {"reservation": self.reservation.model_dump(mode="json"), "changed": self.changed,
                "dnsmasq_pid": self.dnsmasq_pid}


async def reservation(run: ProvisionRun) -> Reserved:
    payload, slot = run.payload, run.slot
    reservations = run.drivers.reservations()
    res = make_reservation(payload.allocation_id, slot.slot_index, slot.mac, slot.private_ip, payload.hostname)
    changed = await asyncio.to_thread(reservations.add, res)
    pid = await asyncio.to_thread(reservations.reload)
    return Reserved(reservation=res, changed=changed, dnsmasq_pid=pid)


async def unreserve(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    return await run.drivers.unreserve(run.payload.allocation_id, run.slot.slot_index)


@dataclass(frozen=True)
class Defined:
    spec: DomainSpec
    domain: str
    uuid: str  # what undo may touch: this domain, no other of that name
    action: str

    def journal(self) -> dict[str, Any]:
        return {"domain": self.domain, "uuid": self.uuid, "action": self.action}


async def define(run: ProvisionRun, validated: Validated) -> Defined:
    drivers, payload, slot, profile = run.drivers, run.payload, run.slot, run.profile
    firmware = await asyncio.to_thread(find_ovmf, drivers.local_root())
    numa = validated.planned.gpu_numa_node if profile.hostdevs else None
    cpulist = await asyncio.to_thread(node_cpulist, drivers.discovered_root(), numa) if numa is not None else None
    spec = DomainSpec(
        allocation_id=payload.allocation_id, slot_index=slot.slot_index, task_id=run.task_id,
        profile=profile,
        gpu_pci_address=slot.gpu_pci_address if profile.hostdevs else None,
        fabric_vf_pci_address=slot.fabric_vf_pci_address if profile.hostdevs else None,
        nvme_device=slot.nvme_device, mac=slot.mac, ovs_bridge=slot.ovs_bridge,
        seed_iso_path=str(drivers.seed_path(payload.allocation_id, slot.slot_index)),
        serial_log_path=str(drivers.console_log_path(payload.allocation_id, slot.slot_index)),
        numa_node=numa, numa_cpulist=cpulist, firmware=firmware, agent_version=__version__,
        **(await asyncio.to_thread(_passthrough_bars, drivers.discovered_root(), slot) if profile.hostdevs else {}),
        extra_slots=[await _guest_slot(run, s, p) for s, p in zip(run.data_slots, validated.data_planned)])
    outcome = await drivers.libvirt.define(spec)
    return Defined(spec=spec, domain=outcome.domain.name, uuid=outcome.domain.uuid, action=outcome.action)


async def _guest_slot(run: ProvisionRun, slot: ApprovedSlot, planned: PlannedSlot) -> GuestSlot:
    """A data slot of the domain: its devices, NUMA node and BARs, resolved on this host now."""
    hostdevs = run.profile.hostdevs
    numa = planned.gpu_numa_node if hostdevs else None
    cpulist = await asyncio.to_thread(node_cpulist, run.drivers.discovered_root(), numa) if numa is not None else None
    bars = await asyncio.to_thread(_passthrough_bars, run.drivers.discovered_root(), slot) if hostdevs else {}
    return GuestSlot(slot_index=slot.slot_index, gpu_pci_address=slot.gpu_pci_address if hostdevs else None,
                     fabric_vf_pci_address=slot.fabric_vf_pci_address if hostdevs else None,
                     nvme_device=slot.nvme_device, numa_node=numa, numa_cpulist=cpulist, **bars)


def _passthrough_bars(host: Any, slot: Any) -> dict[str, Any]:
    """The GPU's and VF's BAR sizes from sysfs: they size the guest's 64-bit MMIO window (host/vm/guest_topology.py)."""
    return {"gpu_bars": function_bars(host, slot.gpu_pci_address),
            "fabric_vf_bars": function_bars(host, slot.fabric_vf_pci_address)}


async def _ours(run: ProvisionRun, undo: Undo) -> tuple[Any, str | None]:
    """The slot's own domain, or why the one of that name is left alone (undo never goes by name alone)."""
    found = await run.drivers.libvirt.lookup(run.name)
    defined: Defined | None = undo.output("define")
    return found, domain_not_ours(found, run.payload.allocation_id, run.slot.slot_index,
                                  defined.uuid if defined is not None else None)


async def undefine(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    found, foreign = await _ours(run, undo)
    if found is None:
        return {"domain": run.name, "found": False}
    if foreign:
        return {"domain": run.name, "found": True, "left": foreign}
    stopped = await run.drivers.libvirt.shutdown(run.name, deadline_s=0)  # compensation: no grace, destroy now
    gone = await run.drivers.libvirt.undefine(run.name)
    return {"domain": run.name, "destroyed": stopped.destroyed, "nvram_removed": gone.nvram_removed}


@dataclass(frozen=True)
class Started:
    evidence: dict[str, Any]  # the guards' evidence, the start, the port ids and the isolation rules

    def journal(self) -> dict[str, Any]:
        return dict(self.evidence)


async def start(run: ProvisionRun, validated: Validated, defined: Defined) -> Started:
    # The slot's DHCP lease before the guest exists (the last tenant's, until it expires): readiness waits for a
    # newer one. Then the guards, the start, our port ids back, and the full isolation rules for the tap's ofport.
    stale = stale_lease_expires(run.drivers.slice.dnsmasq_lease_file, run.slot.mac, run.slot.private_ip)
    evidence = await guarded_start(run.drivers, defined.spec.start_target(), disk_lease=run.disk_lease(validated),
                                   port=run.port, data_slots=validated.data_leases)
    return Started({**evidence, "lease_before_start": {"expires": stale}})


async def stop(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    found, foreign = await _ours(run, undo)
    if found is None or foreign:
        return {"domain": run.name, "found": found is not None, **({"left": foreign} if foreign else {})}
    stopped = await run.drivers.libvirt.shutdown(run.name, deadline_s=0)
    return stopped.model_dump(mode="json")


async def readiness(run: ProvisionRun, started: Started) -> GuestReadiness:
    loop = asyncio.get_running_loop()

    async def progress(event: str, fields: dict[str, Any]) -> None:
        await run.ctx.progress("readiness", "progress", detail={"event": event, **fields})

    slot = run.slot
    timeout = run.payload.readiness_timeout_s or run.drivers.slice.readiness_timeout_s
    deadline = loop.time() + timeout
    stale = started.evidence.get("lease_before_start", {}).get("expires")
    ready = await wait_for_guest(run.drivers.slice.dnsmasq_lease_file, slot.mac, slot.private_ip,
                                 deadline=deadline, progress=progress, stale_expires=stale)
    if (target := egress_target(run.profile, run.drivers.slice)) is None:
        return ready
    await progress("egress_wait", {"target": target.model_dump(mode="json")})
    proof = await wait_for_egress(slot.private_ip, target,
                                  deadline=min(deadline, loop.time() + run.drivers.slice.readiness_egress_timeout_s))
    return ready.model_copy(update={"egress": proof})


# -- the slots' fabric VFs: the allocation's attachment applied and read back before the domain exists -------


async def fabric_vf(run: ProvisionRun, validated: Validated) -> dict[str, Any]:
    """Apply the attachment validate checked to every slot's VF and read it back (tasks/fabricvf.py)."""
    if validated.fabric_vf is None:
        return {"skipped": "validate planned no fabric VF"}
    return await apply_fabric_vfs(run.drivers.fabric_vf, run.store, validated.fabric_vf, run.payload.allocation_id,
                                  run.task_id)


async def park_fabric_vf(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    """Park every VF this allocation's attachment reached (recorded before the first set), read back."""
    return await park_recorded(run.drivers, run.store, run.slots, run.payload.allocation_id, run.task_id)


# -- NVSwitch hosts: the Fabric Manager partition slice.plan leased (tasks/fabric_partitions.py) ---------------


async def activate_fabric_partition(run: ProvisionRun) -> dict[str, Any]:
    """Activate the allocation's partition before the domain starts (nothing leased: nothing to do)."""
    return await fabric_partitions.activate_leased(run.drivers.fabric, run.store, run.payload.allocation_id)


async def deactivate_fabric_partition(run: ProvisionRun, undo: Undo) -> dict[str, Any]:
    return await fabric_partitions.deactivate_leased(run.drivers.fabric, run.store, run.payload.allocation_id,
                                                     release=False)


async def check_fabric_partition(run: ProvisionRun) -> dict[str, Any]:
    """After start: FM still lists the partition active (an FM restart in between is restored or fails)."""
    return await fabric_partitions.confirm_active(run.drivers.fabric, run.store, run.payload.allocation_id)


# The provision pipeline, in order (docs/operations.md names the same steps).
PROVISION_STEPS: tuple[StepDef[ProvisionRun], ...] = (
    StepDef("validate", validate, unlease),
    StepDef("bind_vfio", bind_vfio,
            no_compensation="a GPU left on vfio-pci is the slice host's steady state: nothing to undo"),
    StepDef("image", fetch_image, unpin_image),  # the shared cache keeps the image; only this run's pin goes
    StepDef("data_disks", guard_data_disks, takes=("validate",),
            no_compensation="a check of the other slots' disks: nothing written"),
    StepDef("clone", clone, takes=("validate", "image"), touches_disk=True,
            no_compensation="a written disk cannot be un-written: only a verified wipe by release makes it clean"),
    StepDef("seed", seed, unseed, takes=("validate",)),
    StepDef("ovs_port", ovs_port, unplug),
    StepDef("reservation", reservation, unreserve),
    StepDef("fabric_vf", fabric_vf, park_fabric_vf, takes=("validate",)),
    StepDef("define", define, undefine, takes=("validate",)),
    StepDef("fabric_partition", activate_fabric_partition, deactivate_fabric_partition),
    StepDef("start", start, stop, takes=("validate", "define")),
    StepDef("fabric_partition_check", check_fabric_partition,
            no_compensation="a read of Fabric Manager (and a restore of the leased list): nothing to undo"),
    StepDef("readiness", readiness, takes=("start",), no_compensation="a read of the lease file and an SSH banner: nothing to undo"),
)


def provision_steps(run: ProvisionRun) -> list[Step]:
    """:data:`PROVISION_STEPS` bound to one run, as the runner takes them."""
    return bind_steps(PROVISION_STEPS, run)


# -- a provision the agent was killed or stopped under --------------------------------------------------

# Steps an interrupted run may simply run again from the start: checks, the lease (taken again is a
# no-op), vfio, the image, and the clone itself (the disk is this allocation's; it is written whole
# again, without --target-is-zero). A run that got further has a seed, port, reservation or domain
# out there: those are compensated, as an in-process failure compensates them.
RESTARTABLE = ("validate", "bind_vfio", "image", "data_disks", "clone")


def reached_steps(store: StateStore, task_id: str) -> list[str]:
    """The pipeline steps an earlier run of ``task_id`` started, in declaration order."""
    started = {e.step for e in store.journal_of(task_id) if e.status is StepStatus.started}
    return [d.name for d in PROVISION_STEPS if d.name in started]


async def interrupted_run(run: ProvisionRun) -> list[str] | None:
    """The steps an earlier run of this very task reached, when it was interrupted (the slot's record is
    still this task's ``provisioning``); None when this is not a redelivery of an interrupted run."""
    record = await run.store.slot_state(run.slot.slot_index)
    if record is None or record.status is not SlotStatus.provisioning or record.task_id != run.task_id:
        return None
    return await run.store.run(reached_steps, run.task_id)


async def compensate_interrupted(run: ProvisionRun, reached: list[str]) -> tuple[bool, list[dict[str, Any]]]:
    """Undo what the steps of an interrupted run may have left, in reverse: the same compensations an
    in-process failure runs (each looks first, so a step that never acted costs a lookup).

    Returns (disk_touched, the compensation records). The lease is kept when the clone had started.
    """
    defs = [d for d in PROVISION_STEPS if d.name in reached]
    disk_touched = run.disk_written_before or any(d.touches_disk for d in defs)
    undo = Undo(outputs={}, disk_touched=disk_touched, started=frozenset(reached))
    records: list[dict[str, Any]] = []
    for d in reversed(defs):
        if d.compensate is None:
            continue
        try:
            detail = await d.compensate(run, undo) or {}
        except AgentError as exc:
            records.append({"step": d.name, "ok": False, "code": exc.code, "message": exc.message})
            await run.store.journal(run.task_id, d.name, StepStatus.failed, {"compensation": exc.code})
            continue
        records.append({"step": d.name, "ok": True, **detail})
        await run.store.journal(run.task_id, d.name, StepStatus.compensated, detail)
    return disk_touched, records


async def close_interrupted(run: ProvisionRun, reached: list[str], *, why: str) -> dict[str, Any]:
    """Compensate an interrupted run and record the slot as an in-process failure would leave it:
    ``cleanup_blocked`` with the lease kept once the disk was written, else lease released and free."""
    disk_touched, compensations = await compensate_interrupted(run, reached)
    detail = {"code": why, "steps_reached": reached, "disk_touched": disk_touched, "compensations": compensations}
    # A slot set: the boot disk is touched from clone on, the data disks from start on (tasks/slotset.py).
    touched = touched_slots(run.slot.slot_index, [s.slot_index for s in run.slots], reached, disk_touched)
    for slot in run.slots:
        if slot.slot_index in touched:
            await run.store.set_slot_state(_record(run, SlotStatus.cleanup_blocked, HealthState.failed, detail,
                                                   slot.slot_index))
            run.ctx.slot_outcomes.append(_outcome(run, SlotStatus.cleanup_blocked, HealthState.failed, detail,
                                                  slot.slot_index))
        else:
            run.ctx.slot_outcomes.append(_outcome(run, SlotStatus.reserved, HealthState.unknown,
                                                  {**detail, "lease_released": True}, slot.slot_index))
    log_event(log, "provision_interrupted_closed", logging.WARNING, task_id=run.task_id,
              slot_index=run.slot.slot_index, steps_reached=reached, disk_touched=disk_touched)
    return detail


async def recover_provision(drivers: SliceDrivers, payload: VmProvisionPayload, ctx: TaskContext) -> dict[str, Any]:
    """The worker's recovery of an interrupted provision it will not run again (its deadline passed, or it
    is poison): compensation only, no new side effect. Returns the evidence for the result."""
    run = ProvisionRun.for_task(drivers, payload, ctx)
    async with contextlib.AsyncExitStack() as locks:
        for index in sorted({s.slot_index for s in run.slots}):
            await locks.enter_async_context(drivers.slot_lock(index))
        reached = await interrupted_run(run)
        if reached is None:
            return {"interrupted": False}
        return await close_interrupted(run, reached, why="provision_interrupted")


async def provision(drivers: SliceDrivers, payload: VmProvisionPayload, ctx: TaskContext) -> dict[str, Any]:
    run = ProvisionRun.for_task(drivers, payload, ctx)
    async with contextlib.AsyncExitStack() as locks:
        # Every slot of the set, in index order (two sets sharing slots never wait on each other in a cycle).
        for index in sorted({s.slot_index for s in run.slots}):
            await locks.enter_async_context(drivers.slot_lock(index))
        reached = await interrupted_run(run)
        if reached:
            if any(step not in RESTARTABLE for step in reached):
                detail = await close_interrupted(run, reached, why="provision_interrupted")
                raise ProvisionRefused(
                    f"provision {run.task_id} of slot {run.slot.slot_index} was interrupted at step {reached[-1]}; "
                    f"what it set up was undone{'; the slot is cleanup_blocked until a release wipes it' if detail['disk_touched'] else ''}",
                    code="provision_interrupted", evidence={"slot_index": run.slot.slot_index, **detail})
            run = dataclasses.replace(run, disk_written_before="clone" in reached)
            log_event(log, "provision_restarted", logging.WARNING, task_id=run.task_id, steps_reached=reached,
                      disk_written_before=run.disk_written_before)
        try:
            await check_admissible(run)
        except ProvisionRefused as refused:
            if refused.code in ("slot_cleanup_blocked", "provision_interrupted"):  # the slot is (now) blocked
                ctx.slot_outcomes.append(_outcome(run, SlotStatus.cleanup_blocked, HealthState.failed,
                                                  {"code": refused.code, **refused.evidence},
                                                  refused.evidence.get("slot_index")))
            raise
        try:
            outputs = await run_pipeline(ctx, provision_steps(run))
        except PipelineFailed as failure:
            await _report_failure(run, ctx, failure)
            raise
    lease = outputs["readiness"]["lease"]
    detail = {"readiness": outputs["readiness"], "domain": run.name}
    for slot in run.slots:
        await run.store.set_slot_state(_record(run, SlotStatus.active, HealthState.healthy, detail, slot.slot_index))
        ctx.slot_outcomes.append(_outcome(run, SlotStatus.active, HealthState.healthy, detail, slot.slot_index))
    log_event(log, "slice_provisioned", task_id=run.task_id, allocation_id=payload.allocation_id,
              slot_index=payload.slot.slot_index, slots=len(run.slots), domain=run.name, ip=lease["actual_ip"])
    result = {
        "vm": run.name,
        "mac": payload.slot.mac,
        "expected_ip": lease["expected_ip"],
        "actual_ip": lease["actual_ip"],
        "lease_state": lease["lease_state"],
        "ssh_ready": outputs["readiness"]["ssh_banner"].startswith("SSH-2.0-"),
        "ssh_banner": outputs["readiness"]["ssh_banner"],
        "egress": outputs["readiness"].get("egress"),  # None unless the profile asks readiness to prove it
        "steps": {name: out.get("duration_s") for name, out in outputs.items()},
        "clone": outputs["clone"],
        "image": outputs["image"],
    }
    if len(run.slots) > 1:
        result["slots"] = [s.slot_index for s in run.slots]
    return result


async def _report_failure(run: ProvisionRun, ctx: TaskContext, failure: PipelineFailed) -> None:
    """Every slot of the set: cleanup_blocked if its disk may hold data (its own evidence), else released."""
    detail = {"failed_step": failure.failed_step, "code": failure.code, "message": failure.message,
              "evidence": failure.evidence, "cancelled": failure.cancelled}
    started = [*failure.evidence.get("steps_done", []), failure.failed_step]
    touched = touched_slots(run.slot.slot_index, [s.slot_index for s in run.slots], started, failure.disk_touched or run.disk_written_before)
    for slot in run.slots:
        if slot.slot_index in touched:
            own = {**detail, "nvme_device": slot.nvme_device,
                   "disk_role": "boot" if slot is run.slots[0] else "data"} if len(run.slots) > 1 else detail
            await run.store.set_slot_state(_record(run, SlotStatus.cleanup_blocked, HealthState.failed, own,
                                                   slot.slot_index))
            ctx.slot_outcomes.append(_outcome(run, SlotStatus.cleanup_blocked, HealthState.failed, own,
                                              slot.slot_index))
            log_event(log, "slot_cleanup_blocked", logging.WARNING, task_id=run.task_id,
                      slot_index=slot.slot_index, failed_step=failure.failed_step, code=failure.code)
        else:
            # The validate step's compensation released the lease and cleared the record; the disk is as it was.
            ctx.slot_outcomes.append(_outcome(run, SlotStatus.reserved, HealthState.unknown,
                                              {**detail, "lease_released": True, "disk_touched": False},
                                              slot.slot_index))


def provision_handler(drivers: SliceDrivers) -> Handler:
    async def handle(payload: VmProvisionPayload, ctx: TaskContext) -> dict[str, Any]:
        return await provision(drivers, payload, ctx)

    return handle


def provision_recovery(drivers: SliceDrivers) -> Handler:
    """The recovery its registry row declares (``TaskSpec.make_recovery``): :func:`recover_provision`."""

    async def recover(payload: VmProvisionPayload, ctx: TaskContext) -> dict[str, Any]:
        return await recover_provision(drivers, payload, ctx)

    return recover
