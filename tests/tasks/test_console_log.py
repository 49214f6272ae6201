"""``slice.console_log``: an allocation reads its own console, alive or dead, and never another's."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import PAYLOADS, RESULT_HEADROOM_BYTES, ConsoleLogPayload, ConsoleLogResult, TaskType
from gpuaas_agent.errors import AgentError, ContractError
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.consolelog import ensure_log_dir, log_path
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.tasks.console_log import console_log, tail_that_fits
from gpuaas_agent.tasks.drivers import SliceDrivers
from tests.support.pipeline_ctx import sync

A, B = str(uuid.uuid4()), str(uuid.uuid4())
MAX_PAYLOAD = 1 << 20  # nats-server's default


@pytest.fixture
def sh(tmp_path):
    return SliceDrivers(host_root=tmp_path, slice=SliceConfig(console_log_dir=tmp_path / "console"),
                        images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle("test:///default"))


def _hold(store, alloc: str, slot: int) -> None:
    store.take_lease(SlotLease(allocation_id=alloc, slot_index=slot, gpu_pci_address=f"0000:1{slot}:00.0",
                               nvme_device=f"/dev/disk/by-id/nvme-slot{slot}", disk_identity=f"path:slot{slot}",
                               fabric_vf_pci_address=f"0000:2{slot}:00.1", task_id="t", taken_at=time.time()))
    store.set_slot_state(SlotRecord(slot_index=slot, allocation_id=alloc, status=SlotStatus.active,
                                    health_state=HealthState.healthy, task_id="t", updated_at=time.time()))


def _log(sh, alloc: str, slot: int, text: str) -> None:
    ensure_log_dir(sh.slice.console_log_dir)  # prepare-host's job on a host
    path = sh.console_log_path(alloc, slot)
    path.write_text(text)


@sync
async def test_an_allocation_reads_the_tail_of_its_own_console(sh, journal_ctx):
    _hold(journal_ctx.store, A, 0)
    _log(sh, A, 0, "".join(f"[ {i}.000] boot line\n" for i in range(4000)) + "GPUAAS-READY\n")
    out = await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=0, tail_kib=1), journal_ctx, max_payload=MAX_PAYLOAD)
    assert out["returned_bytes"] == 1024 and out["truncated"] and out["text"].endswith("GPUAAS-READY\n")
    assert out["path"] == str(log_path(sh.slice.console_log_dir, A, 0))


@sync
async def test_after_release_the_log_is_still_the_allocations_even_when_the_slot_is_another_tenants(sh, journal_ctx):
    _log(sh, A, 0, "kernel panic - not syncing\n")  # A's VM died and was released
    _hold(journal_ctx.store, B, 0)  # B holds slot 0 now
    out = await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=0), journal_ctx, max_payload=MAX_PAYLOAD)
    assert out["text"] == "kernel panic - not syncing\n" and not out["truncated"]


@sync
async def test_a_task_naming_another_allocations_slot_is_refused(sh, journal_ctx):
    _hold(journal_ctx.store, B, 1)
    _log(sh, B, 1, "B's secret boot output\n")
    with pytest.raises(AgentError) as err:
        await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=1), journal_ctx, max_payload=MAX_PAYLOAD)
    assert err.value.code == "not_this_allocation" and "B's secret" not in str(err.value)
    assert "B's secret" not in str(err.value.evidence) and B not in str(err.value.evidence)


@sync
async def test_no_log_is_a_clear_refusal(sh, journal_ctx):
    with pytest.raises(AgentError) as err:
        await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=2), journal_ctx, max_payload=MAX_PAYLOAD)
    assert err.value.code == "console_log_missing"


@pytest.mark.parametrize("payload", [
    {"allocation_id": "../../etc/passwd", "slot_index": 0},
    {"allocation_id": A, "slot_index": 0, "tail_kib": 0},
    {"allocation_id": A, "slot_index": 0, "tail_kib": 1025},
    {"allocation_id": A, "slot_index": 256},
    {"allocation_id": A, "slot_index": "0"},
    {"allocation_id": A, "slot_index": 0, "path": "/var/log/gpuaas-agent/console/x.log"},
])
def test_hostile_payloads_are_refused_by_the_contract(payload):
    with pytest.raises((ContractError, ValueError)):
        PAYLOADS[TaskType.console_log].from_wire(payload)


def _log_bytes(sh, alloc: str, slot: int, data: bytes) -> None:
    ensure_log_dir(sh.slice.console_log_dir)
    sh.console_log_path(alloc, slot).write_bytes(data)


@sync
async def test_a_console_of_control_bytes_returns_the_latest_tail_that_fits_the_wire(sh, journal_ctx):
    # 1 MiB of bytes that JSON escapes six-fold (\u0001): 6 MiB of result asked for, 64 KiB allowed.
    _log_bytes(sh, A, 0, b"\x01" * (1 << 20) + b"LAST LINE\n")
    max_payload = 64 << 10
    out = await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=0, tail_kib=1024), journal_ctx,
                            max_payload=max_payload)
    result = ConsoleLogResult.model_validate_json(json.dumps(out))
    assert len(result.model_dump_json()) <= max_payload - RESULT_HEADROOM_BYTES
    assert result.cut_to_fit and result.truncated and result.text.endswith("\x01LAST LINE\n")
    assert result.returned_bytes == len(result.text.encode())
    # Not a token tail: most of the budget carries log (each \x01 is 6 bytes of JSON).
    assert result.returned_bytes * 6 > (max_payload - RESULT_HEADROOM_BYTES) * 0.9


@sync
async def test_a_tail_that_fits_is_returned_whole_and_not_marked_cut(sh, journal_ctx):
    _log_bytes(sh, A, 0, b"\x1b[0m\"quoted\" \xff\n" * 100)
    out = await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=0), journal_ctx, max_payload=MAX_PAYLOAD)
    assert not out["cut_to_fit"] and not out["truncated"] and out["returned_bytes"] == out["size_bytes"]


def test_the_tail_that_fits_never_starts_inside_a_utf8_sequence():
    data = "é".encode() * 1000  # two bytes each
    tail = tail_that_fits(data, lambda d: len(d) <= 101)
    assert tail.decode("utf-8") == "é" * 50  # 101 would cut a sequence: the orphan byte is left out


def test_a_budget_nothing_fits_gives_an_empty_tail():
    assert tail_that_fits(b"\x01" * 10, lambda d: not d) == b""
