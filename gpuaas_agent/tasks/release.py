"""``slice.vm_release``: stop the VM, take its plumbing down, wipe and verify the disk, free the slot.

graceful shutdown (deadline) → destroy → undefine with NVRAM → unplug the OVS
port → remove the dnsmasq reservation → remove the seed ISO → wipe + verify →
release the lease. Every step looks first and acts only on what it finds, so a
release after an agent restart, after a half-finished provision, or of an
allocation that is already gone succeeds and says what it found.

The disk is wiped only when this host holds the slot's lease (or its
``cleanup_blocked`` record) *for this allocation*: a release naming a slot
that another allocation holds is refused with nothing touched. A wipe whose
read-back does not prove the disk empty keeps the lease and leaves the slot
``cleanup_blocked`` with the proof.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.slots import HealthState, SlotOutcome, SlotStatus
from gpuaas_agent.contract.state import SlotRecord
from gpuaas_agent.contract.storage import DiskLease, WipeProof
from gpuaas_agent.contract.tasks import VmReleasePayload
from gpuaas_agent.errors import AgentError
from gpuaas_agent.guards.disk import read_disk_identity
from gpuaas_agent.host.wipepolicy import release_wipe_policy, wipe_slot_disk
from gpuaas_agent.logs import log_event
from gpuaas_agent.tasks.pipeline import PipelineFailed, Step, run_pipeline
from gpuaas_agent.tasks.slicehost import SliceHost

log = logging.getLogger(__name__)


class ReleaseRefused(AgentError):
    default_code = "release_refused"


def _outcome(slot_index: int, status: SlotStatus, health: HealthState, detail: dict) -> SlotOutcome:
    return SlotOutcome(slot_index=slot_index, status=status, health_state=health, health_detail=detail)


async def release(sh: SliceHost, payload: VmReleasePayload, ctx) -> dict:
    store = ctx.store
    slot = payload.slot
    alloc = payload.allocation_id
    name = domain_name(alloc)
    port = vnic_name(alloc, slot.slot_index)
    found: dict = {}
    proof: dict = {}

    async with sh.slot_lock(slot.slot_index):
        # The disk this release may wipe is the one its lease holds (by identity), whatever the
        # payload calls it: another alias, or another slot's disk, in the payload is never wiped.
        leases = store.leases()
        holders = [lease for lease in leases if lease.allocation_id == alloc and lease.slot_index == slot.slot_index]
        foreign = [lease for lease in leases if lease.allocation_id != alloc
                   and (lease.slot_index == slot.slot_index or lease.nvme_device == slot.nvme_device)]
        if foreign:
            raise ReleaseRefused(
                f"slot {slot.slot_index} is leased by allocation {foreign[0].allocation_id}, not {alloc}: nothing touched",
                code="lease_conflict", evidence={"held": [lease.model_dump() for lease in foreign]})
        record = store.slot_state(slot.slot_index)
        owns_disk = bool(holders) or (record is not None and record.allocation_id == alloc)
        if record is not None and record.allocation_id == alloc:
            store.set_slot_state(record.model_copy(update={"status": SlotStatus.releasing, "task_id": ctx.envelope.task_id,
                                                           "updated_at": time.time()}))

        async def look() -> dict:
            info = await sh.libvirt.lookup(name)
            async with sh.ovs() as ovs:
                ports = await asyncio.to_thread(ovs.list_agent_ports)
            reservations = await asyncio.to_thread(sh.reservations().reservations)
            found.update({
                "domain": info.model_dump(mode="json") if info else None,
                "ports": [p.name for p in ports if p.allocation_id == alloc],
                "reservations": [r.model_dump(mode="json") for r in reservations if r.allocation_id == alloc],
                "lease": [lease.model_dump() for lease in holders],
                "slot_record": record.model_dump(mode="json") if record else None,
            })
            if info is not None and (info.metadata is None or info.metadata.allocation_id != alloc):
                raise ReleaseRefused(f"domain {name} exists but is not this agent's domain of {alloc}",
                                     code="domain_not_ours", evidence={"domain": found["domain"]})
            return found

        async def stop() -> dict:
            if found.get("domain") is None:
                return {"skipped": "no domain"}
            outcome = await sh.libvirt.shutdown(name, deadline_s=payload.graceful_timeout_s)
            return outcome.model_dump(mode="json")

        async def undefine() -> dict:
            if found.get("domain") is None:
                return {"skipped": "no domain"}
            return (await sh.libvirt.undefine(name)).model_dump(mode="json")

        async def unplug() -> dict:
            return await sh.unplug(slot.ovs_bridge, port, alloc)

        async def unreserve() -> dict:
            return await sh.unreserve(alloc, slot.slot_index)

        async def unseed() -> dict:
            return sh.remove_seed(alloc, slot.slot_index)

        async def held_disk() -> DiskLease:
            """The lease's disk; without a lease (a cleanup_blocked record only), the payload's disk as it is
            now, provided no other lease holds that disk by identity."""
            if holders:
                held = holders[0]
                return DiskLease(allocation_id=alloc, slot_index=slot.slot_index, nvme_device=held.nvme_device,
                                 disk_identity=held.disk_identity)
            identity = await asyncio.to_thread(read_disk_identity, sh.host(), slot.nvme_device)
            other = [lease for lease in store.leases() if lease.disk_identity == identity]
            if other:
                raise ReleaseRefused(
                    f"{slot.nvme_device} is the disk leased by allocation {other[0].allocation_id}: not wiped",
                    code="lease_conflict", evidence={"field": "nvme_device", "held": other[0].model_dump()})
            return DiskLease(allocation_id=alloc, slot_index=slot.slot_index, nvme_device=slot.nvme_device,
                             disk_identity=identity)

        async def wipe() -> dict:
            if not owns_disk:
                return {"skipped": "this host holds no lease of this allocation on the slot: its disk is not ours to wipe"}
            disk_lease = await held_disk()
            try:
                result = await wipe_slot_disk(
                    release_wipe_policy(sh.slice.wipe_policies, found.get("domain")),
                    sh.host(), disk_lease.nvme_device, lease=disk_lease,
                    domain_disks=await sh.libvirt.defined_domain_disks(exclude_allocation=alloc,
                                                                       exclude_slot=slot.slot_index))
            except AgentError as exc:
                if exc.code == "wipe_unverified":
                    store.record_wipe_proof(slot.slot_index, WipeProof.from_wire(exc.evidence))
                raise
            store.record_wipe_proof(slot.slot_index, result)
            proof.update(result.model_dump(mode="json"))
            return {"verified": result.verified, "method": result.method.value, "bytes": result.bytes}

        async def unlease() -> dict:
            if not owns_disk:
                return {"skipped": "no lease"}
            # Only this slot: the allocation's other slots keep their leases until their own disks are wiped.
            released = store.release_slot_lease(alloc, slot.slot_index)
            store.clear_slot_state(slot.slot_index)
            return {"released": [released.slot_index] if released else []}

        steps = [Step("find", look), Step("shutdown", stop), Step("undefine", undefine), Step("ovs_unplug", unplug),
                 Step("reservation_remove", unreserve), Step("seed_remove", unseed), Step("wipe", wipe),
                 Step("lease_release", unlease)]
        try:
            outputs = await run_pipeline(ctx, steps)
        except PipelineFailed as failure:
            # Past "find" the slot is half torn down and its disk not proven empty: blocked, never available.
            if owns_disk and failure.failed_step != "find":
                detail = {"failed_step": failure.failed_step, "code": failure.code, "evidence": failure.evidence}
                store.set_slot_state(SlotRecord(slot_index=slot.slot_index, allocation_id=alloc,
                                                status=SlotStatus.cleanup_blocked, health_state=HealthState.failed,
                                                detail=detail, task_id=ctx.envelope.task_id, updated_at=time.time()))
                ctx.slot_outcomes.append(_outcome(slot.slot_index, SlotStatus.cleanup_blocked, HealthState.failed, detail))
            raise
    nothing = not any([found.get("domain"), found.get("ports"), found.get("reservations"), found.get("lease"),
                       found.get("slot_record")])
    if owns_disk:
        ctx.slot_outcomes.append(_outcome(slot.slot_index, SlotStatus.available, HealthState.healthy,
                                          {"wipe_proof": proof}))
    log_event(log, "slice_released", task_id=ctx.envelope.task_id, allocation_id=alloc, slot_index=slot.slot_index,
              wiped=bool(proof), already_gone=nothing)
    return {
        "vm": name,
        "already_gone": nothing,
        "found": found,
        "cleanup_proof": {
            "domain": {"shutdown": outputs["shutdown"], "undefine": outputs["undefine"]},
            "ovs_port": outputs["ovs_unplug"],
            "reservation": outputs["reservation_remove"],
            "seed": outputs["seed_remove"],
            "wipe": proof or outputs["wipe"],
            "lease": outputs["lease_release"],
        },
    }


def release_handler(sh: SliceHost):
    async def handle(payload: VmReleasePayload, ctx) -> dict:
        return await release(sh, payload, ctx)

    return handle
