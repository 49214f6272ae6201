"""``slice.console_log``: an allocation reads its own console, alive or dead, and never another's."""

from __future__ import annotations

import time
import uuid

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import PAYLOADS, ConsoleLogPayload, TaskType
from gpuaas_agent.errors import AgentError, ContractError
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.consolelog import ensure_log_dir, log_path
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.tasks.console_log import console_log
from gpuaas_agent.tasks.drivers import SliceDrivers
from tests.support.pipeline_ctx import sync

A, B = str(uuid.uuid4()), str(uuid.uuid4())


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
    out = await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=0, tail_kib=1), journal_ctx)
    assert out["returned_bytes"] == 1024 and out["truncated"] and out["text"].endswith("GPUAAS-READY\n")
    assert out["path"] == str(log_path(sh.slice.console_log_dir, A, 0))


@sync
async def test_after_release_the_log_is_still_the_allocations_even_when_the_slot_is_another_tenants(sh, journal_ctx):
    _log(sh, A, 0, "kernel panic - not syncing\n")  # A's VM died and was released
    _hold(journal_ctx.store, B, 0)  # B holds slot 0 now
    out = await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=0), journal_ctx)
    assert out["text"] == "kernel panic - not syncing\n" and not out["truncated"]


@sync
async def test_a_task_naming_another_allocations_slot_is_refused(sh, journal_ctx):
    _hold(journal_ctx.store, B, 1)
    _log(sh, B, 1, "B's secret boot output\n")
    with pytest.raises(AgentError) as err:
        await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=1), journal_ctx)
    assert err.value.code == "not_this_allocation" and "B's secret" not in str(err.value)
    assert "B's secret" not in str(err.value.evidence) and B not in str(err.value.evidence)


@sync
async def test_no_log_is_a_clear_refusal(sh, journal_ctx):
    with pytest.raises(AgentError) as err:
        await console_log(sh, ConsoleLogPayload(allocation_id=A, slot_index=2), journal_ctx)
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
