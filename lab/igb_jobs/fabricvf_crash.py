"""Runs INSIDE the igb guest: the ``fabric_vf`` provision step and the release's ``fabric_vf_park`` step SIGKILLed
at their crash points on a real VF, then what the agent does next in a fresh process (the provision's recovery;
the next release), and what the kernel holds after each.

The crash matrix (``tests/crash/test_crash_matrix.py``) kills the agent at every step's ``before`` and ``after``
point through ``GPUAAS_AGENT_CRASH_AT`` (``tasks/crashpoint.py``); on the lab's TCG profiles the ``fabric_vf``
step has no VF to touch. Here the same points are armed the same way against the igb PF's VF 0:

* ``slice.vm_provision:fabric_vf:before:<task>``: the step journaled ``started``, nothing set;
* ``slice.vm_provision:fabric_vf:after:<task>``: the attachment set and read back, the journal still ``started``;
* ``slice.vm_provision:define:before:<task>``: ``fabric_vf`` journaled ``succeeded``, the next step started.

The killed process is a child (``provision``, forked after the imports: see :func:`child`) that runs the agent's own step runner
(``tasks/pipeline.run_pipeline``, which calls ``crash_point`` before and after each step's side effect and
journals in a real SQLite ``StateStore``) over two steps: ``fabric_vf`` with the provision's body
(``tasks/fabricvf.apply_fabric_vfs``: record, set, read back) and its undo, and ``define`` as a stand-in
(the guest has no libvirt; only its place in the order matters: its ``before`` is "after the journal write").

The recovery (``recover``, another child, the crash point no longer armed) is what the agent runs for a
provision it finds interrupted (``tasks/provision.close_interrupted`` -> ``compensate_interrupted``): the steps
the journal says were reached, the compensation of each in reverse (``fabric_vf``'s is ``park_fabric_vf`` ->
``park_recorded``: every slot VF the store records ``applied`` is parked through ``park_target``, read back,
recorded ``parked``), each journaled ``compensated``; then the repairing reconcile
(``tasks/fabricvf.reconcile_findings``) over every recorded VF, with the leases a crashed provision keeps (the
killed allocation's, its clone having run before ``fabric_vf``) and the other tenant's.

What differs from the agent (named, so it cannot pass for more): ``park_recorded`` locates the slot's VF
through discovery, which lists Mellanox functions only, so the job names the igb VF itself (as
``fabricvf_driver.two_tenants`` does) and calls the rest of ``park_recorded``'s body, ``park_target``; the
driver leaves the VF link state out of every set and comparison (igb has no ``ndo_set_vf_link_state``:
EOPNOTSUPP, docs/fabric-igb.md), as in ``fabricvf_driver.py``.

The release side, after the provision's points, same store, same boot: VF 0 is given the released allocation's
attachment (``apply_fabric_vfs``: VLAN 401, recorded ``applied``), then a child (``release``) runs the step runner
over ``fabric_vf_park`` with ``tasks/release.fabric_vf_park``'s body (``park_recorded`` over the slot: a VF
recorded ``applied`` is parked through ``park_target``; one recorded otherwise is left) and ``gpu_handover`` as a
stand-in (no GPU in the guest; its ``before`` is "after the park's journal write"), killed at

* ``slice.vm_release:fabric_vf_park:before:<task>``: journaled ``started``, the tenant's VLAN and MAC still on VF 0;
* ``slice.vm_release:fabric_vf_park:after:<task>``: parked on the kernel and recorded ``parked``, the journal
  still ``started``;
* ``slice.vm_release:gpu_handover:before:<task>``: ``fabric_vf_park`` journaled ``succeeded``.

Release steps have no compensation (tasks/release.py: a release interrupted anywhere is finished by running it
again, as a restarted agent does on redelivery), so what follows the kill is the next release: the same task
and steps again in a fresh child, nothing armed. As on the provision side the job names the slot's VF itself
(``park_recorded``'s relocation through discovery is the part replaced).

Before the points: VF 0 parked by its previous tenant's release, VF 1 holding another tenant's attachment
(VLAN 202), all in the same store. Prints one JSON document; the host-side test asserts.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from igb_jobs.guestsys import igb_pfs, sysfs
from pyroute2 import IPRoute

from gpuaas_agent.contract.fabricvf import (
    EthernetAttachment,
    FabricIsolation,
    derive_vf_identity,
    parking_guid,
)
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import TaskEnvelope
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.fabricvf import FabricVfNetlink
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.crashpoint import ENV
from gpuaas_agent.tasks.fabricvf import (
    FabricVfPlan,
    VfTarget,
    apply_fabric_vfs,
    park_target,
    reconcile_findings,
    recorded,
)
from gpuaas_agent.tasks.pipeline import StepDef, bind_steps, run_pipeline

HOST_KEY = "igb-lab-guest"
IP = "/usr/local/sbin/ip"  # iproute2's, copied in by lab/igb_guest.py
STORE = "/tmp/fabricvf-crash/state.db"
PROVISION = "slice.vm_provision"
RELEASE = "slice.vm_release"
# The kill points, by the names the crash matrix arms (PROVISION_STEPS order: fabric_vf, then define).
POINTS = (("fabric_vf", "before"), ("fabric_vf", "after"), ("define", "before"))
# The release's (RELEASE_STEPS order: fabric_vf_park, then gpu_handover).
RELEASE_POINTS = (("fabric_vf_park", "before"), ("fabric_vf_park", "after"), ("gpu_handover", "before"))
KILLED = ("alloc-killed", 0, EthernetAttachment(vlan=301, qos=1))  # allocation, slot / VF, attachment
RELEASED = ("alloc-released", 0, EthernetAttachment(vlan=401, qos=2))  # the allocation whose release is killed
OTHER = ("alloc-b", 1, EthernetAttachment(vlan=202))
CHILD_TIMEOUT_S = 120


def the_pf():
    pf = igb_pfs()[0]
    return pf, os.path.basename(os.path.realpath(f"/sys/class/net/{pf}/device"))


@dataclass(frozen=True)
class WithoutLinkState(FabricVfNetlink):
    """The agent's driver with the VF link state left out of every set and comparison: igb has none."""

    def apply(self, pf_netdev, wanted):
        return super().apply(pf_netdev, wanted.model_copy(update={"link_state": None}))


def target(slot):
    """The slot's VF on the igb PF (the job names it: discovery lists Mellanox functions only)."""
    pf, pci = the_pf()
    address = os.path.basename(os.path.realpath(f"/sys/class/net/{pf}/device/virtfn{slot}"))
    return VfTarget(slot_index=slot, vf_pci_address=address, pf_pci_address=pci, pf_netdev=pf, vf_index=slot,
                    kind="ethernet", identity=derive_vf_identity(HOST_KEY, slot),
                    parking_guid=parking_guid(HOST_KEY, slot))


def plan(attachment, slot):
    return FabricVfPlan(FabricIsolation.required, attachment, targets=(target(slot),))


# -- the killed process: the agent's step runner over fabric_vf (and the step after it) -----------------------


@dataclass(frozen=True)
class Run:
    """The provision run's part the two steps read (tasks/provision.ProvisionRun has more)."""

    store: object
    allocation_id: str
    task_id: str


@dataclass
class Ctx:
    """The worker's TaskContext as the pipeline reads it: the store, the envelope, progress events."""

    store: object
    envelope: TaskEnvelope

    async def progress(self, step, status, *, percent=None, detail=None):
        return None


async def fabric_vf(run):
    """tasks/provision.fabric_vf's body: apply the attachment to the slot's VF and read it back."""
    alloc, slot, attachment = KILLED
    return await apply_fabric_vfs(WithoutLinkState(), run.store, plan(attachment, slot), run.allocation_id,
                                  run.task_id)


async def park_recorded_here(store, allocation_id, task_id, slot=KILLED[1]):
    """tasks/fabricvf.park_recorded with the slot's VF named by the job instead of found by discovery: every
    slot VF the store records ``applied`` is parked (``park_target``: park, read back, record ``parked``)."""
    tgt = target(slot)
    rec = await recorded(store, tgt.vf_pci_address)
    if rec is None or rec.get("state") != "applied":
        return {"parked": [], "skipped": "no VF of these slots carries an applied attachment"}
    return {"parked": [await park_target(WithoutLinkState(), store, tgt, allocation_id, task_id)]}


async def park_fabric_vf(run, undo):
    """tasks/provision.park_fabric_vf: the step's undo."""
    return await park_recorded_here(run.store, run.allocation_id, run.task_id)


async def define(run):
    """Stand-in for the domain's define (no libvirt in the guest): its crash point is the one after the
    fabric_vf step's journal write."""
    return {"stand_in": True}


STEPS = (
    StepDef("fabric_vf", fabric_vf, park_fabric_vf),
    StepDef("define", define, no_compensation="stand-in for the domain's define: the guest has no libvirt"),
)


def provision_child(task_id):
    """Runs with GPUAAS_AGENT_CRASH_AT armed by the parent: SIGKILLed at the point it names."""
    store = StateStore.open(STORE)
    thread = as_store_thread(store)
    envelope = TaskEnvelope(task_id=task_id, type=PROVISION, node_id="igb-lab-guest", attempt=1,
                            deadline=datetime.now(timezone.utc) + timedelta(minutes=10), payload={})
    run = Run(store=thread, allocation_id=KILLED[0], task_id=task_id)
    outputs = asyncio.run(run_pipeline(Ctx(store=store, envelope=envelope), bind_steps(STEPS, run)))
    print(json.dumps({"completed": sorted(outputs)}))  # reached only when no point fired


# -- the release: the agent's step runner over fabric_vf_park (and the step after it) ----------------------------


async def fabric_vf_park(run):
    """tasks/release.fabric_vf_park's body (``park_recorded`` over the release's one slot), the VF named by the
    job: a VF recorded ``applied`` is parked and read back, recorded ``parked``; one recorded otherwise is left."""
    return await park_recorded_here(run.store, run.allocation_id, run.task_id, RELEASED[1])


async def gpu_handover(run):
    """Stand-in for the GPU handover (no GPU in the guest): its ``before`` is "after fabric_vf_park's journal
    write"."""
    return {"stand_in": True}


RELEASE_STEPS_HERE = (
    StepDef("fabric_vf_park", fabric_vf_park,
            no_compensation="parking is what a release owes the next tenant: running the release again parks it"),
    StepDef("gpu_handover", gpu_handover, no_compensation="stand-in for the GPU handover: the guest has no GPU"),
)


def release_child(task_id):
    """The release (killed when the parent armed a point; run again unarmed, it is the redelivered release a
    restarted agent runs: the same task, the same steps, tasks/release.py's "running it again finishes it")."""
    store = StateStore.open(STORE)
    thread = as_store_thread(store)
    envelope = TaskEnvelope(task_id=task_id, type=RELEASE, node_id="igb-lab-guest", attempt=1,
                            deadline=datetime.now(timezone.utc) + timedelta(minutes=10), payload={})
    run = Run(store=thread, allocation_id=RELEASED[0], task_id=task_id)
    outputs = asyncio.run(run_pipeline(Ctx(store=store, envelope=envelope), bind_steps(RELEASE_STEPS_HERE, run)))
    store.close()
    print(json.dumps({"completed": sorted(outputs), "outputs": outputs}, default=str))


# -- the recovery: a fresh process, as the restarted agent ------------------------------------------------------


async def recover_async(task_id):
    store = StateStore.open(STORE)
    thread = as_store_thread(store)
    started = {e.step for e in await thread.run(lambda s: s.journal_of(task_id)) if e.status is StepStatus.started}
    reached = [d.name for d in STEPS if d.name in started]  # tasks/provision.reached_steps
    compensations = []
    for d in reversed([d for d in STEPS if d.name in reached]):  # tasks/provision.compensate_interrupted
        if d.compensate is None:
            continue
        run = Run(store=thread, allocation_id=KILLED[0], task_id=task_id)
        try:
            detail = await d.compensate(run, None) or {}
        except AgentError as exc:
            compensations.append({"step": d.name, "ok": False, "code": exc.code, "message": exc.message})
            await thread.journal(task_id, d.name, StepStatus.failed, {"compensation": exc.code})
            continue
        compensations.append({"step": d.name, "ok": True, **detail})
        await thread.journal(task_id, d.name, StepStatus.compensated, detail)
    # The killed provision keeps its lease (its clone ran before fabric_vf); the other tenant holds VF 1.
    leased = {(KILLED[0], target(KILLED[1]).vf_pci_address), (OTHER[0], target(OTHER[1]).vf_pci_address)}
    findings = await reconcile_findings(WithoutLinkState(), thread, leased, repair=True)
    store.close()
    return {"reached": reached, "compensations": compensations,
            "reconcile": [f.model_dump(mode="json") for f in findings]}


def recover_child(task_id):
    print(json.dumps(asyncio.run(recover_async(task_id)), default=str))


# -- the parent: set the scene, kill at each point, recover, read the kernel -------------------------------------


def kernel_view():
    """Both VFs as the agent reads them (its driver's readback) and as an operator does (ip -d -j)."""
    pf, _ = the_pf()
    net = FabricVfNetlink()
    agent = {}
    for vf in (0, 1):
        try:
            agent[str(vf)] = net.read(pf, vf).model_dump(mode="json")
        except AgentError as exc:
            agent[str(vf)] = {"error": exc.code}
    done = subprocess.run([IP, "-d", "-j", "link", "show", "dev", pf], capture_output=True, text=True, timeout=30)
    ip = json.loads(done.stdout) if done.returncode == 0 else {"rc": done.returncode, "stderr": done.stderr[-2000:]}
    return {"agent": agent, "ip": ip}


def journal_and_record(task_id, slot=KILLED[1]):
    store = StateStore.open(STORE)
    try:
        entries = [{"step": e.step, "status": e.status.value, "detail": e.detail} for e in store.journal_of(task_id)]
        raw = store.meta(f"fabric_vf:{target(slot).vf_pci_address}")
        return entries, json.loads(raw) if raw else None
    finally:
        store.close()


CHILDREN = {"provision": provision_child, "recover": recover_child, "release": release_child}


def child(mode, task_id, point=None):
    """Run ``provision``, ``recover`` or ``release`` in a child process forked from this one after the imports (under TCG an
    exec'd Python pays ~10 s importing pydantic and the agent). This process holds no store, netlink socket or
    event loop when it forks: the child knows only what is on disk and in the kernel, as a restarted agent does.
    The crash point is armed in the child's environment only, as the crash matrix arms it."""
    out_path, err_path = f"/tmp/fabricvf-crash/{mode}-{task_id}.out", f"/tmp/fabricvf-crash/{mode}-{task_id}.err"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
            os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
            os.environ.pop(ENV, None)
            if point is not None:
                os.environ[ENV] = ":".join((*point, task_id))  # (task type, step, when)
            CHILDREN[mode](task_id)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)  # this child only, by its PID
            done, status = os.waitpid(pid, 0)
            break
        time.sleep(0.05)  # poll step of the deadline wait above

    def tail(path, n):
        with open(path, errors="replace") as fh:
            return fh.read()[-n:]

    return {"rc": os.waitstatus_to_exitcode(status), "stdout": tail(out_path, 8000), "stderr": tail(err_path, 4000)}


async def scene():
    """VF 0 parked by its previous tenant's release; VF 1 holding the other tenant's attachment."""
    store = StateStore.open(STORE)
    thread = as_store_thread(store)
    prev = await park_target(WithoutLinkState(), thread, target(KILLED[1]), "alloc-previous", "release-previous")
    other = await apply_fabric_vfs(WithoutLinkState(), thread, plan(OTHER[2], OTHER[1]), OTHER[0], "provision-b")
    store.close()
    return {"previous_release_park": prev, "other_tenant": other}


async def attach(task_id):
    """The released allocation's provision: its attachment applied to VF 0 and recorded ``applied``."""
    store = StateStore.open(STORE)
    thread = as_store_thread(store)
    try:
        return await apply_fabric_vfs(WithoutLinkState(), thread, plan(RELEASED[2], RELEASED[1]), RELEASED[0], task_id)
    finally:
        store.close()


def main():
    pf, pci = the_pf()
    numvfs = f"/sys/class/net/{pf}/device/sriov_numvfs"
    with open(numvfs) as fh:
        current = fh.read().strip()
    if current != "2":
        if current != "0":
            with open(numvfs, "w") as fh:
                fh.write("0")
        with open(numvfs, "w") as fh:
            fh.write("2")
    os.makedirs(os.path.dirname(STORE), exist_ok=True)
    with IPRoute() as ipr:  # the PF's link up: igb takes a rate cap (the park's 0 too) only with carrier
        ipr.link("set", index=ipr.link_lookup(ifname=pf)[0], state="up")
    deadline = time.monotonic() + 20
    while sysfs(f"/sys/class/net/{pf}/carrier") != "1" and time.monotonic() < deadline:
        time.sleep(0.2)  # carrier comes from the emulated PHY's autonegotiation timer
    report = {"pf": pf, "pf_pci": pci, "pf_carrier": sysfs(f"/sys/class/net/{pf}/carrier"), "vf0": target(0).vf_pci_address, "vf1": target(1).vf_pci_address,
              "killed": {"allocation_id": KILLED[0], "vf": KILLED[1], "vlan": KILLED[2].vlan,
                         "mac": derive_vf_identity(HOST_KEY, KILLED[1]).mac},
              "released": {"allocation_id": RELEASED[0], "vf": RELEASED[1], "vlan": RELEASED[2].vlan,
                           "mac": derive_vf_identity(HOST_KEY, RELEASED[1]).mac},
              "other": {"allocation_id": OTHER[0], "vf": OTHER[1], "vlan": OTHER[2].vlan,
                        "mac": derive_vf_identity(HOST_KEY, OTHER[1]).mac},
              "scene": asyncio.run(scene()), "at_start": kernel_view(), "points": {}}
    for step, when in POINTS:
        task_id = f"crash-{step}-{when}"
        out = {"spec": ":".join((PROVISION, step, when, task_id))}
        out["provision"] = child("provision", task_id, (PROVISION, step, when))
        out["killed_view"] = kernel_view()
        out["journal_after_kill"], out["record_after_kill"] = journal_and_record(task_id)
        out["recovery"] = child("recover", task_id)
        out["recovered_view"] = kernel_view()
        out["journal_after_recovery"], out["record_after_recovery"] = journal_and_record(task_id)
        report["points"][f"{step}:{when}"] = out
    report["release_points"] = {}
    for step, when in RELEASE_POINTS:
        task_id = f"release-{step}-{when}"
        out = {"spec": ":".join((RELEASE, step, when, task_id)),
               "attach": asyncio.run(attach(f"provision-for-{task_id}"))}
        out["attached_view"] = kernel_view()
        out["release"] = child("release", task_id, (RELEASE, step, when))
        out["killed_view"] = kernel_view()
        out["journal_after_kill"], out["record_after_kill"] = journal_and_record(task_id, RELEASED[1])
        out["next_release"] = child("release", task_id)  # the same release again, nothing armed
        out["released_view"] = kernel_view()
        out["journal_after_next_release"], out["record_after_next_release"] = journal_and_record(task_id, RELEASED[1])
        report["release_points"][f"{step}:{when}"] = out
    print(json.dumps(report, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
