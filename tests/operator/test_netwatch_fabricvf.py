"""The fabric VF check rides the slice-network watch: an RTM_NEWLINK of the PF runs it, not only the timer.

A VF setting changed through the PF's rtnetlink is announced as an RTM_NEWLINK of the PF (the kernel's
``netdev_state_change`` after ``do_setvfinfo``). This machine has no SR-IOV PF, so a netdev of this kernel
stands as the PF in a network namespace the test creates (a bridge named like the recorded host's IB PF:
this kernel has no dummy driver), and the watch runs in a thread that entered that namespace, so its
netlink sockets hear that namespace's links as the daemon's hear its own. The watch's timer is an hour:
a round after the change can only be the event's. The check is the fabric VF part of ``port_isolation``
(``tasks/fabricvf.reconcile_findings`` read-only, judged by ``operator/health.isolation_check``) over a
VF the agent recorded as applied on that PF.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuaas_agent.contract.drift import DriftTrigger
from gpuaas_agent.contract.fabricvf import EswitchMode, FabricIsolation, InfinibandAttachment, VfSettings
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.host.network.fabricvf import FabricVfError, FabricVfNetlink
from gpuaas_agent.operator.health import CheckThreads, HealthSettings, isolation_check
from gpuaas_agent.operator.netwatch import NetWatch
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.fabricvf import apply_fabric_vfs, check_fabric_vfs, reconcile_findings
from tests.support.provision_inputs import approved_slot, topology_of
from tests.support.realdev import require_root

DEADLINE_S = 30.0


@dataclass(frozen=True)
class PlannedPf(FabricVfNetlink):
    """Validate's view of a legacy PF reporting the VF (where this machine has none): only to plan the apply."""

    def read(self, pf_netdev: str, vf: int) -> VfSettings:
        return VfSettings(vf=vf)


@dataclass(frozen=True)
class ReadLog(FabricVfNetlink):
    """The real PF in the namespace, each read's time noted: the fabric VF check ran, and when."""

    reads: list[float] = field(default_factory=list)

    def read(self, pf_netdev: str, vf: int) -> VfSettings:
        self.reads.append(time.time())
        return super().read(pf_netdev, vf)


class TriggerLog(NetWatch):
    """The watch, each round's trigger noted (what woke it)."""

    triggers: list[DriftTrigger]

    async def round(self, trigger: DriftTrigger):  # type: ignore[override]
        self.triggers.append(trigger)
        return await super().round(trigger)


def _in_netns(name: str, body) -> object:
    """Run ``asyncio.run(body())`` in a thread that entered netns ``name`` (sockets it opens are that namespace's)."""
    out: dict[str, object] = {}

    def target() -> None:
        from pyroute2.netns import setns

        try:
            setns(name, flags=0)  # this thread only; flags=0: never create it
            out["value"] = asyncio.run(asyncio.wait_for(body(), DEADLINE_S * 3))
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=target, name="netns-watch", daemon=True)
    thread.start()
    thread.join(DEADLINE_S * 4)
    assert not thread.is_alive(), "the watch did not stop within its deadline"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


async def _until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:.0f} s: {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
def pf_netns():
    require_root()
    name = f"gpuaas-fnw-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True, timeout=30)


def test_an_rtm_newlink_of_the_pf_runs_the_fabric_vf_check_before_the_timer(pf_netns, tmp_path):
    report = topology_of()
    slot = approved_slot(report, 0)
    pf_netdev = "ibp25s0"  # slot 0's PF on the recorded host
    subprocess.run(["ip", "-n", pf_netns, "link", "add", pf_netdev, "type", "bridge"], check=True, timeout=30)
    store = StateStore.open(tmp_path / "state.db")
    thread = as_store_thread(store)
    alloc = str(uuid.uuid4())
    plan = check_fabric_vfs(FabricIsolation.required, get_profile("h200_1g_24c_64g"), InfinibandAttachment(pkey="0x0012"),
                            report, [slot], PlannedPf(eswitch=lambda pf: (EswitchMode.legacy, "recorded: legacy")))
    pf = ReadLog(netns=pf_netns)
    with pytest.raises(FabricVfError):  # the record is written before the kernel refuses: a VF the agent set
        asyncio.run(apply_fabric_vfs(pf, thread, plan, alloc, "t-p"))
    leased = {(alloc, slot.fabric_vf_pci_address)}

    async def fabric_vf_isolation():
        return [isolation_check(await reconcile_findings(pf, thread, leased, repair=False))]

    async def body():
        watch = TriggerLog(HealthSettings(host_root=Path(tmp_path), dnsmasq_pid_file=None), SimpleNamespace(checks=None),
                           interval_s=3600.0, isolation=fabric_vf_isolation, debounce_s=0.05, min_gap_s=0.1,
                           threads=CheckThreads())
        watch.triggers = []
        task = asyncio.create_task(watch.run())
        try:
            await _until(lambda: watch.rounds >= 1, "the first round")
            assert watch.triggers == [DriftTrigger.timer]
            assert "port_isolation" in watch.failing  # the PF reports no VF 0: fabric_vf_unreadable
            assert "fabric_vf_unreadable" in watch.failing["port_isolation"].detail
            changed_at = time.time()
            await asyncio.to_thread(subprocess.run, ["ip", "-n", pf_netns, "link", "set", pf_netdev, "mtu", "1400"],
                                    check=True, timeout=30)
            await _until(lambda: watch.rounds >= 2 and any(t > changed_at for t in pf.reads),
                         "a fabric VF read after the PF's RTM_NEWLINK")
            return list(watch.triggers), watch.failing["port_isolation"].checked_at.timestamp(), changed_at
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    triggers, checked_at, changed_at = _in_netns(pf_netns, body)
    assert triggers[1] is DriftTrigger.netlink, triggers
    assert checked_at > changed_at
    store.close()
