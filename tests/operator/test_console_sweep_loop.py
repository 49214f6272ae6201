"""The daemon's console-log sweep: at start it deletes an old log of a finished allocation, never a leased one's."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.daemon import console_log_loop
from gpuaas_agent.host.vm.consolelog import log_path
from gpuaas_agent.state.store import StateStore
from tests.support.deadline import wait_until


def test_the_sweep_runs_at_start_and_spares_leased_allocations(tmp_path):
    finished, leased = str(uuid.uuid4()), str(uuid.uuid4())
    settings = SliceConfig(console_log_dir=tmp_path / "console", console_log_max_age_s=3600)
    settings.console_log_dir.mkdir()
    old = time.time() - 2 * 86400
    for alloc in (finished, leased):
        path = log_path(settings.console_log_dir, alloc, 0)
        path.write_text("boot\n")
        os.utime(path, (old, old))
    store = StateStore.open(tmp_path / "state.db")
    store.take_lease(SlotLease(allocation_id=leased, slot_index=0, gpu_pci_address="0000:18:00.0",
                               nvme_device="/dev/disk/by-id/nvme-x", disk_identity="path:x",
                               fabric_vf_pci_address="0000:19:00.1", task_id="t", taken_at=time.time()))

    async def body() -> None:
        task = asyncio.create_task(console_log_loop(store, settings))
        try:
            await wait_until(lambda: not log_path(settings.console_log_dir, finished, 0).exists(), 20,
                             "the finished allocation's old log deleted")
        finally:
            task.cancel()
        assert log_path(settings.console_log_dir, leased, 0).exists()

    try:
        asyncio.run(body())
    finally:
        store.close()
