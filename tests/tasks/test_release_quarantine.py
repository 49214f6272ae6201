"""A release whose wipe does not verify quarantines the disk; its re-check passes only on a later every-byte proof.

Real pieces: the SQLite store (quarantine table, wipe proofs, leases) and the release's own quarantine
rule; the failure is the typed ``wipe_unverified`` error the wipe raises (tests/host/storage/test_wipe_lying_device.py
shows a real disk producing it).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from gpuaas_agent.contract.nvmewipe import WipeMethod
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.storage import ProofGuarantee, WipeProof
from gpuaas_agent.host.storage.blockwipe import WipeError
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.recheck import RecheckContext, recheck_wipe
from gpuaas_agent.tasks.release import ReleaseRun, quarantine_failed_component
from tests.support.provision_inputs import task_ctx

DISK = "nguid:000000000000000100a075244a103331"
BY_ID = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331"


def _lease(alloc: str) -> SlotLease:
    return SlotLease(allocation_id=alloc, slot_index=3, gpu_pci_address="0000:18:00.0", nvme_device=BY_ID,
                     disk_identity=DISK, fabric_vf_pci_address="0000:40:00.2", task_id="t-p", taken_at=time.time())


def _proof(verified: bool, guarantee: ProofGuarantee, disk: str | None = DISK) -> WipeProof:
    return WipeProof(by_id=BY_ID, kernel_name="nvme3n1", dev="259:3", method=WipeMethod.zeroout, bytes=1 << 30,
                     seed=1, samples=[], signatures_found=[], partitions_left=[], duration_s=1.0, verified=verified,
                     guarantee=guarantee, disk_identity=disk)


class Clock:
    """The store's clock, set by the test: a proof is recorded before or after the quarantine by construction."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _failed(code: str, step: str = "wipe") -> PipelineFailed:
    return PipelineFailed(WipeError("not provably empty", code=code, evidence={"verified": False}), failed_step=step,
                          disk_touched=True, cancelled=False, compensations=[], steps_done=["find"])


def _quarantine_an_unverified_wipe(store: StateStore) -> str:
    """Slot 3 leased to a new allocation, whose release failed wipe_unverified: the disk is quarantined."""
    alloc = str(uuid.uuid4())
    lease = store.take_lease(_lease(alloc))
    run = ReleaseRun(drivers=None, payload=None, task_id="t-release", ctx=task_ctx(store, "t-release"),
                     holders=(lease,), record=None)
    asyncio.run(quarantine_failed_component(run, _failed("wipe_unverified")))
    return alloc


def test_an_unverified_wipe_quarantines_the_disk_until_a_later_proof_covers_every_byte(tmp_path):
    clock = Clock()
    store = StateStore.open(tmp_path / "state.db", clock=clock)
    try:
        alloc = _quarantine_an_unverified_wipe(store)
        [record] = store.quarantined()
        clock.now = record.quarantined_at.timestamp() + 60  # every proof below is recorded after the quarantine
        assert (record.kind.value, record.identity, record.reason.value, record.slot_index) == (
            "nvme", DISK, "wipe_unverified", 3)
        assert record.evidence["code"] == "wipe_unverified" and record.task_id == "t-release"
        check = RecheckContext(host_root=tmp_path, store=store)
        assert "still holds" in asyncio.run(recheck_wipe(check, record)).detail  # lease kept: not yet
        store.record_wipe_proof(3, _proof(False, ProofGuarantee.whole_device_read))
        store.release_slot_lease(alloc, 3)
        assert not asyncio.run(recheck_wipe(check, record)).passed  # the latest proof did not verify
        store.record_wipe_proof(3, _proof(True, ProofGuarantee.sampled))
        assert not asyncio.run(recheck_wipe(check, record)).passed  # a sample is no proof over every byte
        store.record_wipe_proof(3, _proof(True, ProofGuarantee.write_zeroes))
        verdict = asyncio.run(recheck_wipe(check, record))
        assert verdict.passed and verdict.evidence["guarantee"] == "write_zeroes"
    finally:
        store.close()


def test_only_a_proof_of_the_quarantined_disk_made_after_the_quarantine_returns_it(tmp_path):
    clock = Clock()
    store = StateStore.open(tmp_path / "state.db", clock=clock)
    try:
        alloc = _quarantine_an_unverified_wipe(store)
        store.release_slot_lease(alloc, 3)
        [record] = store.quarantined()
        check = RecheckContext(host_root=tmp_path, store=store)
        at = record.quarantined_at.timestamp()
        # A perfect proof of this very disk, but from before the quarantine (an earlier tenancy's release,
        # or one recorded in the same instant): what the quarantine overruled, not a new proof.
        for recorded_at in (at - 3600, at):
            clock.now = recorded_at
            store.record_wipe_proof(3, _proof(True, ProofGuarantee.write_zeroes))
            stale = asyncio.run(recheck_wipe(check, record))
            assert not stale.passed and "since it was quarantined" in stale.detail
        clock.now = at + 60
        # After it, but of another disk in the same slot (a swapped disk), or of a disk the proof does not name.
        for other in ("nguid:00000000000000020000000000000002", None):
            store.record_wipe_proof(3, _proof(True, ProofGuarantee.write_zeroes, disk=other))
            swapped = asyncio.run(recheck_wipe(check, record))
            assert not swapped.passed and f"not of the quarantined disk {DISK}" in swapped.detail
        # The quarantined disk's own every-byte proof, made after: returned.
        clock.now = at + 120
        store.record_wipe_proof(3, _proof(True, ProofGuarantee.write_zeroes))
        assert asyncio.run(recheck_wipe(check, record)).passed
        # And a later failed proof of it takes that back: the latest proof decides.
        clock.now = at + 180
        store.record_wipe_proof(3, _proof(False, ProofGuarantee.whole_device_read))
        assert not asyncio.run(recheck_wipe(check, record)).passed
    finally:
        store.close()


def test_a_failure_that_is_no_verdict_on_the_device_quarantines_nothing(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    try:
        lease = store.take_lease(_lease(str(uuid.uuid4())))
        run = ReleaseRun(drivers=None, payload=None, task_id="t", ctx=task_ctx(store, "t"), holders=(lease,), record=None)
        for code, step in (("wipe_failed", "wipe"), ("busy", "wipe"), ("gpu_handover_tool_missing", "gpu_handover"),
                           ("gpu_held_by_domain", "gpu_handover"), ("domain_not_ours", "find")):
            asyncio.run(quarantine_failed_component(run, _failed(code, step)))
        assert store.quarantined() == []
    finally:
        store.close()
