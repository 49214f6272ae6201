"""Kill -9 at every declared step of the GPU handover, before and after its side effect; recovery finishes or blocks.

The lab's crash matrix (test_crash_matrix.py) kills a real agent at every step of ``RELEASE_STEPS``,
but its lab profile passes no GPU through, so its ``gpu_handover`` step is a skip. Here the
handover runs for real against the synthetic 8xH200 host between tenants, with NVIDIA's tool
replayed from its answers (tests/support/gpu_handover.py). The kill points are read from
``RELEASE_GPU_HANDOVER_STEPS`` (the release's binding of ``GPU_HANDOVER_STEPS``, journaled
``gpu_handover.<step>``): a step added to the declaration is covered here without editing this file.

One harness for all points, cheap: one host, one OVS, one loop disk for the module. For each point
a child process runs the real release handler armed with ``GPUAAS_AGENT_CRASH_AT`` and dies by
SIGKILL inside ``tasks/crashpoint.py``, exactly where the agent would; then this process plays the
restarted agent on the same state store:

* ``before`` points are redelivered within their deadline: the release runs again and finishes,
  with the whole handover redone from its first query (a reset is never skipped because the
  killed run journaled it) and the slot ``available`` only with a verified wipe;
* ``after`` points are redelivered past their deadline: the worker's recovery runs no new side
  effect and leaves the slot ``cleanup_blocked`` naming the interrupted step, the lease kept, the
  tenant's data untouched; the next release of the slot then hands the GPU over and frees it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.handover import GpuHandoverPolicy, LeaseHandover
from gpuaas_agent.contract.nvmewipe import WipePolicy
from gpuaas_agent.contract.slots import ApprovedSlot, HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord, StepStatus
from gpuaas_agent.contract.tasks import TaskEnvelope, VmReleasePayload
from gpuaas_agent.guards.disk import read_disk_identity
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.crashpoint import ENV, WHEN
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.release import RELEASE_GPU_HANDOVER_STEPS, recover_release, release
from lab.loophost import materialize
from tests.conftest import fixture_host
from tests.support.gpu_handover import GPU, HOST, VF, ReplayTool, between_tenants
from tests.support.ovsdb_fixture import running_ovs
from tests.support.provision_inputs import TaskCtx, approved_slot_of_host

REPO = Path(__file__).resolve().parents[2]
RELEASE = "slice.vm_release"
POINTS = [(RELEASE, d.name, when) for d in RELEASE_GPU_HANDOVER_STEPS for when in WHEN]
MiB = 1 << 20
TENANT_DATA = b"tenant data" * 100
CHILD_DEADLINE_S = 120.0  # a failure bound for the killed run, never a timer

# The killed agent: the real release handler in its own process, on the harness's store, host and switch.
_CHILD = """
import asyncio, dataclasses, json, sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.tasks import TaskEnvelope, VmReleasePayload
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.release import release
from tests.support.gpu_handover import ReplayTool
from tests.support.provision_inputs import TaskCtx

args = json.loads(sys.argv[1])
sh = SliceDrivers(host_root=Path(args["root"]), slice=SliceConfig.model_validate(args["slice"]),
                  images=ImageCache(Path(args["cache"])), libvirt=LibvirtLifecycle("test:///default"))
sh = dataclasses.replace(sh, gpu_tool=ReplayTool("success").tool())
store = StateStore.open(args["db"])
envelope = TaskEnvelope(task_id=args["task_id"], type="slice.vm_release", node_id="node-1", attempt=1,
                        deadline=datetime.now(UTC) + timedelta(minutes=10), payload={})

async def go():
    try:
        await release(sh, VmReleasePayload.model_validate(args["payload"]), TaskCtx(store=store, envelope=envelope))
    finally:
        await sh.close()

asyncio.run(go())
sys.exit("the release finished: its crash point was never reached")
"""


@dataclasses.dataclass
class Bench:
    root: Path
    disk: str
    slot: ApprovedSlot
    slice: dict
    work: Path

    def drivers(self, tool: ReplayTool) -> SliceDrivers:
        sh = SliceDrivers(host_root=self.root, slice=SliceConfig.model_validate(self.slice),
                          images=ImageCache(self.work / "cache"), libvirt=LibvirtLifecycle("test:///default"))
        return dataclasses.replace(sh, gpu_tool=tool.tool())


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Iterator[Bench]:
    if os.geteuid() != 0:
        pytest.fail("the handover crash harness needs root (loop devices, OVS)", pytrace=False)
    work = tmp_path_factory.mktemp("handover-crash")
    host = materialize(fixture_host(HOST), work / "host", disk_bytes=16 * MiB, slots=1, real_links=False)
    try:
        between_tenants(host.root)
        (work / "seeds").mkdir()
        (work / "dnsmasq").mkdir()
        (work / "dnsmasq" / "hosts").touch()
        (work / "relay.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKq5Vd2K8mJ5yVtQ1N0d0m2dQ6Gq6x7o0c relay\n")
        with running_ovs() as sw:  # its own namespace: the release only talks to ovsdb and the bridge
            d = work / "dnsmasq"
            config = {"ovs_bridge": sw.bridge, "ovsdb_remote": sw.remote, "dnsmasq_hosts_file": str(d / "hosts"),
                      "dnsmasq_lease_file": str(d / "leases"), "dnsmasq_pid_file": str(d / "dnsmasq.pid"),
                      "seed_dir": str(work / "seeds"), "terminal_relay_key_file": str(work / "relay.pub"),
                      "allow_emulated_domains": True}
            yield Bench(root=host.root, disk=host.disks[0].loop, slot=approved_slot_of_host(host, 0, ovs_bridge=sw.bridge),
                        slice=config, work=work)
    finally:
        assert host.close() == []


def _ctx(store: StateStore, task_id: str, attempt: int, resumed: list[str]) -> TaskCtx:
    envelope = TaskEnvelope(task_id=task_id, type=RELEASE, node_id="node-1", attempt=attempt,
                            deadline=datetime.now(UTC) + timedelta(minutes=10), payload={})
    return TaskCtx(store=store, envelope=envelope, resumed_steps=resumed)


def _tenancy(b: Bench, store: StateStore, alloc: str) -> None:
    """An active slice of ``alloc`` on slot 0 whose lease fixed the default GPU handover; its data on the disk."""
    handover = LeaseHandover(profile="h200_1g_24c_64g", wipe=WipePolicy(), zeros_guaranteed=True,
                             gpu=GpuHandoverPolicy(), fixed_at=time.time())
    store.take_lease(SlotLease(allocation_id=alloc, slot_index=0, gpu_pci_address=b.slot.gpu_pci_address,
                               nvme_device=b.slot.nvme_device,
                               disk_identity=read_disk_identity(HostRoot.open(b.root), b.slot.nvme_device),
                               fabric_vf_pci_address=b.slot.fabric_vf_pci_address, task_id="t-provision",
                               taken_at=time.time(), handover=handover))
    store.set_slot_state(SlotRecord(slot_index=0, allocation_id=alloc, status=SlotStatus.active,
                                    health_state=HealthState.healthy, task_id="t-provision", updated_at=time.time()))
    with open(b.disk, "r+b") as fh:
        fh.write(TENANT_DATA)


def _disk_head(b: Bench) -> bytes:
    with open(b.disk, "rb") as fh:
        return fh.read(MiB)


def _rerun(b: Bench, handler, payload: VmReleasePayload, ctx: TaskCtx) -> tuple[dict, ReplayTool]:
    """The redelivered task: ``handler`` (the release, or its recovery) on fresh drivers whose tool succeeds."""
    replay = ReplayTool("success")
    sh = b.drivers(replay)

    async def go():
        try:
            return await handler(sh, payload, ctx)
        finally:
            await sh.close()

    return asyncio.run(go()), replay


def _finished(b: Bench, store: StateStore, out: dict, ctx: TaskCtx, replay: ReplayTool) -> list[str]:
    """What a release that finished must leave: the GPU handed over whole, a verified wipe, the slot free."""
    bad = []
    purposes = [run["purpose"] for run in out["cleanup_proof"]["gpu_handover"]["gpus"][0]["tool_runs"]]
    if purposes != ["query_before", "stage_settings", "reset_and_clear", "query_after"]:
        bad.append(f"the handover was not redone whole: tool runs {purposes}")
    if sum("--reset-with-sbr" in call for call in replay.calls) != 1:
        bad.append("the rerun did not reset the GPU itself, once")
    if out["cleanup_proof"]["wipe"].get("verified") is not True:
        bad.append(f"available without a verified wipe: {out['cleanup_proof']['wipe']}")
    if [(o.slot_index, o.status) for o in ctx.slot_outcomes] != [(0, SlotStatus.available)]:
        bad.append(f"slot outcomes {ctx.slot_outcomes}")
    if store.leases() != [] or store.slot_state(0) is not None:
        bad.append(f"lease or record left: {store.leases()} {store.slot_state(0)}")
    if _disk_head(b) != bytes(MiB):
        bad.append("the released disk does not read zero")
    journal = store.journal_of(ctx.envelope.task_id)
    after_kill = [e.step for e in journal if e.status is StepStatus.succeeded]
    missing = [d.name for d in RELEASE_GPU_HANDOVER_STEPS if d.name not in after_kill]
    if missing:
        bad.append(f"handover steps never journaled succeeded: {missing}")
    return bad


def _kill_and_recover(b: Bench, store_path: Path, point: tuple[str, str, str]) -> list[str]:
    _, step, when = point
    alloc, task_id = str(uuid.uuid4()), f"crash-gpu-{uuid.uuid4().hex[:8]}"
    payload = VmReleasePayload(allocation_id=alloc, slot=b.slot, graceful_timeout_s=1)
    store = StateStore.open(store_path)
    try:
        _tenancy(b, store, alloc)
        args = {"root": str(b.root), "slice": b.slice, "cache": str(b.work / "cache"), "db": str(store_path),
                "task_id": task_id, "payload": payload.model_dump(mode="json")}
        env = {**os.environ, ENV: ":".join([*point, task_id]), "PYTHONPATH": str(REPO)}
        child = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=CHILD_DEADLINE_S)
        if child.returncode != -signal.SIGKILL:
            return [f"the release exited {child.returncode}, not by SIGKILL at its crash point: {child.stderr[-2000:]}"]
        bad = []
        # Killed inside the handover: the journal says so, and nothing after the handover ran.
        unfinished = store.unfinished_steps(task_id)
        if unfinished != ["gpu_handover", step]:
            bad.append(f"unfinished steps {unfinished}, want ['gpu_handover', {step!r}]")
        if {"wipe", "lease_release"} & {e.step for e in store.journal_of(task_id)}:
            bad.append("a step after the handover ran")
        if _disk_head(b)[:len(TENANT_DATA)] != TENANT_DATA or [lease.allocation_id for lease in store.leases()] != [alloc]:
            bad.append("the disk or the lease changed before the handover finished")

        if when == "before":  # redelivered within its deadline: the release runs again and finishes
            ctx = _ctx(store, task_id, 2, unfinished)
            out, replay = _rerun(b, release, payload, ctx)
            return bad + _finished(b, store, out, ctx, replay)

        # Redelivered past its deadline: recovery only, no new side effect; the slot is blocked, not freed.
        ctx = _ctx(store, task_id, 2, unfinished)
        recovered, replay = _rerun(b, recover_release, payload, ctx)
        record = store.slot_state(0)
        if recovered.get("slot") != "cleanup_blocked" or record is None or record.status is not SlotStatus.cleanup_blocked:
            bad.append(f"recovery: {recovered} {record}")
        elif step not in (record.detail.unfinished_steps or []):
            bad.append(f"the blocked slot does not name the interrupted step: {record.detail}")
        if replay.calls or [(o.slot_index, o.status) for o in ctx.slot_outcomes] != [(0, SlotStatus.cleanup_blocked)]:
            bad.append(f"recovery ran the tool ({replay.calls}) or reported {ctx.slot_outcomes}")
        if _disk_head(b)[:len(TENANT_DATA)] != TENANT_DATA or [lease.allocation_id for lease in store.leases()] != [alloc]:
            bad.append("recovery touched the disk or gave the lease back")
        # The next release of the slot (a new task) hands the GPU over and frees it.
        ctx = _ctx(store, f"{task_id}-next", 1, [])
        out, replay = _rerun(b, release, payload, ctx)
        return bad + _finished(b, store, out, ctx, replay)
    finally:
        store.close()


def test_a_kill_at_every_gpu_handover_step_is_finished_by_the_rerun_or_left_cleanup_blocked(bench, tmp_path):
    assert POINTS and all(step.startswith("gpu_handover.") for _, step, _ in POINTS)
    assert (bench.slot.gpu_pci_address, bench.slot.fabric_vf_pci_address) == (GPU, VF)
    problems: dict[str, list[str]] = {}
    timings: dict[str, float] = {}
    for index, point in enumerate(POINTS):
        label = ":".join(point)
        t0 = time.monotonic()
        try:
            bad = _kill_and_recover(bench, tmp_path / f"state-{index}.db", point)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            bad = [f"harness: {exc}"]
        timings[label] = round(time.monotonic() - t0, 1)
        if bad:
            problems[label] = bad
    print(f"\ngpu handover crash points: {len(POINTS)}, per point: {timings}")
    assert not problems, "\n".join(f"{label}: {bad}" for label, bad in problems.items())
