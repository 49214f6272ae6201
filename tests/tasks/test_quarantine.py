"""quarantine_component, the call the release and handover make: typed input, bounded evidence, one row each;
the re-checks that cannot prove a component fit never pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.fleet import MAX_EVIDENCE_CHARS, ComponentKind, QuarantineReason
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.quarantine import quarantine_component

DISK = "eui:000000000000000100a075244a103331"


def test_quarantine_component_takes_the_store_or_its_thread_and_keeps_the_first_record(tmp_path):
    async def body():
        thread = StoreThread.open(tmp_path / "state.db")
        try:
            first = await quarantine_component(thread, "nvme", DISK, "wipe_unverified",
                                               {"proof": {"verified": False}, "path": Path("/dev/x")}, "t-rel",
                                               slot_index=3)
            again = await quarantine_component(thread, ComponentKind.nvme, DISK, QuarantineReason.smart_failing,
                                               {}, "t-health")
            return first, again
        finally:
            await thread.aclose()

    first, again = asyncio.run(body())
    assert again == first and first.evidence == {"proof": {"verified": False}, "path": "/dev/x"}
    store = StateStore.open(tmp_path / "state.db")
    assert [(r.identity, r.reason.value, r.slot_index) for r in store.quarantined()] == [(DISK, "wipe_unverified", 3)]
    store.close()


@pytest.mark.parametrize("kind, identity, reason", [
    ("nvme", "/dev/nvme0n1", "wipe_unverified"),
    ("gpu", DISK, "gpu_reset_failed"),
    ("disk", DISK, "wipe_unverified"),
    ("nvme", DISK, "it_felt_wrong"),
])
def test_a_call_with_a_wrong_kind_identity_or_reason_raises_and_writes_nothing(tmp_path, kind, identity, reason):
    store = StateStore.open(tmp_path / "state.db")
    with pytest.raises((ValueError, ValidationError)):
        asyncio.run(quarantine_component(store, kind, identity, reason, {}, "t-1"))
    assert store.quarantined() == []
    store.close()


def test_huge_evidence_is_cut_and_says_so(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    record = asyncio.run(quarantine_component(store, "gpu", "0000:18:00.0", "gpu_memory_clear_failed",
                                              {"dump": "x" * (4 * MAX_EVIDENCE_CHARS)}, "t-1"))
    assert record.evidence["truncated"] is True and len(record.evidence["head"]) < MAX_EVIDENCE_CHARS
    store.close()
