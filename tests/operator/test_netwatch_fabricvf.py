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
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuaas_agent.contract.drift import DriftTrigger
from gpuaas_agent.contract.fabricvf import EswitchMode, FabricIsolation, InfinibandAttachment, VfSettings
from gpuaas_agent.contract.isolation import GUARD_TABLE
from gpuaas_agent.contract.naming import vnic_name
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotRecord
from gpuaas_agent.host.network.fabricvf import FabricVfError, FabricVfNetlink
from gpuaas_agent.operator.health import CheckThreads, HealthSettings, isolation_check
from gpuaas_agent.operator.netwatch import NetWatch
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.fabricvf import apply_fabric_vfs, check_fabric_vfs, reconcile_findings
from tests.support.netns_thread import run_in_netns, until
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


async def _until(condition, what: str) -> None:
    await until(condition, what, DEADLINE_S)


@pytest.fixture
def pf_netns():
    require_root()
    name = f"gpuaas-fnw-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True, timeout=30)


PF_NETDEV = "ibp25s0"  # slot 0's PF on the recorded host


def _recorded_vf(pf_netns: str, tmp_path: Path):
    """The PF in the namespace and a VF of it the agent recorded as applied: (store, its thread, the PF, the lease)."""
    report = topology_of()
    slot = approved_slot(report, 0)
    subprocess.run(["ip", "-n", pf_netns, "link", "add", PF_NETDEV, "type", "bridge"], check=True, timeout=30)
    store = StateStore.open(tmp_path / "state.db")
    thread = as_store_thread(store)
    alloc = str(uuid.uuid4())
    plan = check_fabric_vfs(FabricIsolation.required, get_profile("h200_1g_24c_64g"), InfinibandAttachment(pkey="0x0012"),
                            report, [slot], PlannedPf(eswitch=lambda pf: (EswitchMode.legacy, "recorded: legacy")))
    pf = ReadLog(netns=pf_netns)
    with pytest.raises(FabricVfError):  # the record is written before the kernel refuses: a VF the agent set
        asyncio.run(apply_fabric_vfs(pf, thread, plan, alloc, "t-p"))
    return store, thread, pf, {(alloc, slot.fabric_vf_pci_address)}


def test_an_rtm_newlink_of_the_pf_runs_the_fabric_vf_check_before_the_timer(pf_netns, tmp_path):
    pf_netdev = PF_NETDEV
    store, thread, pf, leased = _recorded_vf(pf_netns, tmp_path)

    async def fabric_vf_isolation():
        return [isolation_check(await reconcile_findings(pf, thread, leased, repair=False))]

    async def body():
        watch = TriggerLog(HealthSettings(host_root=Path(tmp_path), dnsmasq_pid_file=None), SimpleNamespace(checks=None),
                           interval_s=3600.0, isolation=fabric_vf_isolation, debounce_s=0.05, min_gap_s=0.1,
                           threads=CheckThreads(), store=thread)
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

    triggers, checked_at, changed_at = run_in_netns(pf_netns, body, DEADLINE_S * 3)
    assert triggers[1] is DriftTrigger.netlink, triggers
    assert checked_at > changed_at
    store.close()


def _ip(netns: str, *argv: str) -> None:
    subprocess.run(["ip", "-n", netns, *argv], check=True, timeout=30)


def _nft(netns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "nft", *argv], check=True, timeout=30)


def test_only_events_about_what_the_isolation_probe_reads_wake_a_round(pf_netns, tmp_path):
    """With the probe, a link wakes the watch when it is a recorded VF's PF, the bridge or a recorded slot's vNIC, and an
    nftables change when it is the guard's table; a link and a table of other work do not. Each "no round" is
    asserted after a control event that does wake one, read later from the same socket: a round the unrelated
    event had woken would have run first, or would name it in ``woken_by``."""
    store, thread, pf, leased = _recorded_vf(pf_netns, tmp_path)
    _ip(pf_netns, "link", "add", "other0", "type", "bridge")  # another service's link
    recorded = str(uuid.uuid4())  # a slot the store records (a provision under way, say): its vNIC is judged
    store.set_slot_state(SlotRecord(slot_index=3, allocation_id=recorded, status=SlotStatus.provisioning,
                                    health_state=HealthState.unknown, task_id="t-p3", updated_at=time.time()))
    vnic, stranger = vnic_name(recorded, 3), vnic_name(str(uuid.uuid4()), 3)  # stranger: another agent's name

    async def fabric_vf_isolation():
        return [isolation_check(await reconcile_findings(pf, thread, leased, repair=False))]

    async def changed(*argv: str, tool=_ip) -> None:
        await asyncio.to_thread(tool, pf_netns, *argv)

    async def body():
        watch = TriggerLog(HealthSettings(host_root=Path(tmp_path), dnsmasq_pid_file=None), SimpleNamespace(checks=None),
                           interval_s=3600.0, isolation=fabric_vf_isolation, debounce_s=0.05, min_gap_s=0.1,
                           threads=CheckThreads(), store=thread)
        watch.triggers = []
        task = asyncio.create_task(watch.run())
        seen: list[tuple[int, list[str]]] = []

        async def round_after(*steps) -> None:
            before = watch.rounds
            for argv, tool in steps:
                await changed(*argv, tool=tool)
            await _until(lambda: watch.rounds > before, f"a round after {steps[-1][0]}")
            seen.append((watch.rounds - before, sorted(set(watch.woken_by))))

        try:
            await _until(lambda: watch.rounds >= 1, "the first round")
            interest = watch.filter.interest
            assert interest.links == frozenset({"ovsbr0", PF_NETDEV, vnic}), interest
            assert interest.nft_tables == frozenset({GUARD_TABLE}) and watch.route_groups == (1,)  # links only
            ignored = watch.filter.ignored
            await round_after((("link", "set", "other0", "mtu", "1400"), _ip),
                              (("link", "set", PF_NETDEV, "mtu", "1400"), _ip))
            await round_after((("link", "add", stranger, "type", "bridge"), _ip),
                              (("link", "add", vnic, "type", "bridge"), _ip))
            await round_after((("add", "table", "inet", "other_service"), _nft),
                              (("add", "table", "inet", GUARD_TABLE), _nft))
            return seen, watch.filter.ignored - ignored, list(watch.triggers)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    seen, ignored, triggers = run_in_netns(pf_netns, body, DEADLINE_S * 3)
    assert seen == [(1, [f"link {PF_NETDEV}"]), (1, [f"link {vnic}"]), (1, [f"nft table {GUARD_TABLE}"])], seen
    assert triggers[1:] == [DriftTrigger.netlink] * 3, triggers
    assert ignored >= 3  # other0's mtu, the stranger's creation, the other service's table (one message each at least)
    store.close()
