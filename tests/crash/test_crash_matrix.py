"""Kill -9 at every journal step of provision and release, restart the services under the node, check the host.

Issue 17 item 1. The kill points are read from ``PROVISION_STEPS`` and ``RELEASE_STEPS``
(a step added there is covered here without editing this file): for every step,
``before`` (journaled ``started``, nothing done) and ``after`` (its side effect done, the
journal not yet told), through ``GPUAAS_AGENT_CRASH_AT`` (``gpuaas_agent/tasks/crashpoint.py``).

One lab, one slot, one real agent process at a time, chained to keep each point cheap:
the agent killed at point *n* is restarted already armed for point *n+1* (a crash point
names its task id, so the recovery of *n* never trips it). Each provision point is
followed by a release of the same allocation, which is the next release point.
While the agent is down after each kill, one service under it is restarted, in turn:
nats-server (same port and JetStream store), ovs-vswitchd (SIGKILL: its OpenFlow rules go),
dnsmasq, libvirtd. Each service so sees about a quarter of the points; ovsdb-server is not
restarted (the bridge and ports live in its db; a db restart is an OVS upgrade, not a crash).

For every point the harness asserts:

* the task has exactly one result in the result stream, and it is the expected one: a
  provision interrupted up to its clone runs again and succeeds; one interrupted later is
  compensated and answered ``provision_interrupted`` with the slot ``cleanup_blocked``;
  every release succeeds and reports the slot ``available``;
* no lease without its slot record (active or cleanup_blocked) of the same allocation;
* ``available`` is reported only with a verified wipe proof, and the disk reads zero then;
* no domain, OVS port, dnsmasq reservation, seed ISO or OpenFlow rule of the slot exists
  unless the slot is ``active`` for that allocation (what reconcile names: an active slice);
* a new allocation's provision starts only on a zero disk (no slot disk is written for two
  allocations without a verified wipe in between).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.tasks.crashpoint import ENV, WHEN
from gpuaas_agent.tasks.provision import PROVISION_STEPS, RESTARTABLE
from gpuaas_agent.tasks.release import RELEASE_STEPS

PROVISION = "slice.vm_provision"
RELEASE = "slice.vm_release"
PROVISION_POINTS = [(PROVISION, d.name, when) for d in PROVISION_STEPS for when in WHEN]
RELEASE_POINTS = [(RELEASE, d.name, when) for d in RELEASE_STEPS for when in WHEN]
OUTAGES = ("nats", "vswitchd", "dnsmasq", "libvirtd")
ZERO_MIB = bytes(1 << 20)
DEADLINE_S = 300.0  # a failure bound for every wait below, never a timer


@dataclass
class Harness:
    lab: object
    runner: object
    problems: dict[str, list[str]] = field(default_factory=dict)
    outages: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    outage_s: dict[str, float] = field(default_factory=dict)  # seconds spent restarting each service

    @property
    def slot(self):
        return next(s for s in self.lab.approved if s.slot_index == 0)

    # -- the agent ------------------------------------------------------------------------

    def start(self, point: tuple[str, str, str] | None = None, task_id: str | None = None) -> None:
        env = {ENV: ":".join([*point, task_id])} if point else {ENV: ""}
        self.lab.start_agent(extra_env=env)

    def wait_killed(self, what: str) -> None:
        proc = self.lab.procs.pop("agent")
        try:
            rc = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            raise AssertionError(f"{what}: the agent never reached its crash point") from None
        assert rc == -9, f"{what}: the agent exited {rc}, not by SIGKILL at its crash point"

    def outage(self) -> str:
        name = OUTAGES[self.outages % len(OUTAGES)]
        self.outages += 1
        t0 = time.monotonic()
        getattr(self.lab, f"restart_{name}")()
        self.outage_s[name] = round(self.outage_s.get(name, 0.0) + time.monotonic() - t0, 1)
        return name

    # -- tasks ----------------------------------------------------------------------------

    def submit(self, task_type: str, payload: dict, task_id: str, deadline_s: float = 900) -> None:
        cp = self.lab.cp
        envelope = cp.envelope(self.lab.node_id, task_type, payload, deadline_s=deadline_s, task_id=task_id)
        self.runner.run(cp.enqueue(envelope), timeout=60)

    def results_of(self, task_id: str) -> list:
        async def stored():
            return [r for r in await self.lab.cp.stored_results() if r.task_id == task_id]

        return self.runner.run(stored(), timeout=60)

    def wait_result(self, task_id: str):
        """The task's result in the result stream (the live subscription may miss it across a NATS restart)."""
        deadline = time.monotonic() + DEADLINE_S
        while not (found := self.results_of(task_id)):
            assert self.lab.procs["agent"].poll() is None, f"the agent exited {self.lab.procs['agent'].returncode}"
            assert time.monotonic() < deadline, f"no result for {task_id} within {DEADLINE_S}s"
            time.sleep(0.2)  # poll step of the deadline wait above
        return found[0]

    # -- what is on the host ----------------------------------------------------------------

    def state(self) -> tuple[list[tuple], list[tuple]]:
        db = sqlite3.connect(f"file:{self.lab.state_dir / 'state.db'}?mode=ro", uri=True, timeout=30)
        try:
            leases = db.execute("SELECT slot_index, allocation_id FROM slot_lease").fetchall()
            records = db.execute("SELECT slot_index, allocation_id, status, task_id FROM slot_state").fetchall()
            return leases, records
        finally:
            db.close()

    def disk_head(self) -> bytes:
        with open(self.lab.host.disks[0].loop, "rb") as fh:
            return fh.read(1 << 20)

    def host_objects(self) -> dict[str, list[str]]:
        """Every agent domain, port, reservation, seed ISO and OpenFlow rule of the slot on this host."""
        with OvsDriver(self.lab.ovs_remote) as ovs:
            ports = [f"{p.name}:{p.allocation_id}" for p in ovs.list_agent_ports()]
        hosts = (self.lab.work / "dnsmasq" / "hosts").read_text()
        mac = self.slot.mac
        flows = subprocess.run(["ovs-ofctl", "dump-flows", f"unix:{self.lab.switch.rundir}/{self.lab.bridge}.mgmt"],
                               env=self.lab.ovs_env, capture_output=True, text=True, timeout=30, check=True).stdout
        return {
            "domains": sorted(self.lab.domains()),
            "ports": ports,
            "reservations": [line for line in hosts.splitlines() if line.strip() and not line.startswith("#")],
            "seeds": sorted(p.name for p in (self.lab.work / "seeds").iterdir()),
            "flows": [line.strip() for line in flows.splitlines() if mac in line],
        }

    # -- the invariants -----------------------------------------------------------------------

    def check(self, point: str, alloc: str, *, active: bool, blocked: bool) -> list[str]:
        """Host and state as they must be once the point's task has its answer."""
        bad: list[str] = []
        leases, records = self.state()
        recorded = {(r[0], r[1]) for r in records if r[2] in ("active", "cleanup_blocked")}
        for lease in leases:
            if lease not in recorded:
                bad.append(f"lease {lease} held by nothing (records {records})")
        statuses = [r[2] for r in records if r[1] == alloc]
        want = ["active"] if active else ["cleanup_blocked"] if blocked else []
        if statuses != want:
            bad.append(f"slot records of {alloc}: {statuses}, want {want}")
        objects = self.host_objects()
        name, port = domain_name(alloc), vnic_name(alloc, 0)
        expected = {
            "domains": [name] if active else [],
            "ports": [f"{port}:{alloc}"] if active else [],
            "seeds": [f"{alloc}-slot0.iso"] if active else [],
        }
        for kind, want_objs in expected.items():
            if objects[kind] != want_objs:
                bad.append(f"{kind} left: {objects[kind]} (want {want_objs})")
        reservations = objects["reservations"]
        if (len(reservations) != 1 or alloc not in reservations[0]) if active else reservations:
            bad.append(f"reservations: {reservations} (active: {active})")
        if not active and objects["flows"]:
            bad.append(f"OpenFlow rules of the slot's MAC left: {objects['flows']}")
        return bad


def _provision_payload(h: Harness, alloc: str, readiness_timeout_s: int = 180) -> dict:
    return {**h.lab.provision_payload(h.slot, allocation_id=alloc), "readiness_timeout_s": readiness_timeout_s}


def boots(point) -> bool:
    """Whether the resumed provision of ``point`` is let boot its guest to readiness (~15 s under TCG).

    A provision interrupted up to its clone runs again; for the ``before`` points it boots and ends
    ``active`` (so the release points that act on a found domain meet a live one); for the ``after``
    points dnsmasq is frozen while it runs again, so it goes forward through ``start`` and stops at
    ``readiness`` (``lease_timeout``, or ``ssh_timeout`` when an earlier guest's lease of the slot's MAC
    is still in the lease file; 5 s) — resumed forward all the same, at a third of the cost.
    """
    return point is not None and point[1] in RESTARTABLE and point[2] == "before"


def domain_release_points() -> list[tuple[str, str, str]]:
    """Release points whose step acts on what ``find`` found (it ``takes`` it): they get a live slice."""
    acting = {d.name for d in RELEASE_STEPS if "find" in d.takes}
    return [p for p in RELEASE_POINTS if p[1] in acting]


def _release_payload(h: Harness, alloc: str) -> dict:
    return h.lab.release_payload(alloc, h.slot, graceful_timeout_s=1)


def _one_result(h: Harness, task_id: str, what: str) -> tuple[object, list[str]]:
    result = h.wait_result(task_id)
    results = h.results_of(task_id)
    bad = [] if len(results) == 1 else [f"{len(results)} results in the result stream for {what}"]
    return result, bad


def _provision_point(h: Harness, point, alloc: str, task_id: str, next_arm) -> list[str]:
    """Kill the provision at ``point``, restart (armed for the next point), check what the restart did."""
    label = ":".join(point)
    bad = [] if h.disk_head() == ZERO_MIB else ["a new allocation's provision starts on a disk that is not zero"]
    restartable = point[1] in RESTARTABLE
    frozen = restartable and not boots(point)
    h.submit(PROVISION, _provision_payload(h, alloc, 5 if frozen else 180), task_id)
    h.wait_killed(label)
    h.outage()
    dnsmasq = h.lab.procs["dnsmasq"]
    if frozen:
        os.kill(dnsmasq.pid, signal.SIGSTOP)  # the resumed run's guest gets no lease: it stops at readiness
    try:
        h.start(*next_arm)
        result, more = _one_result(h, task_id, label)
    finally:
        if frozen:
            os.kill(dnsmasq.pid, signal.SIGCONT)
    bad += more
    outcomes = [(o.status.value, o.health_state.value) for o in result.slot_outcomes]
    evidence = result.error.evidence if result.error else {}
    if restartable and boots(point):
        if result.status.value != "succeeded" or outcomes != [("active", "healthy")]:
            bad.append(f"resumed provision: {result.status.value} {result.error} {outcomes}")
    elif restartable:  # resumed forward through start; readiness got no (new) lease, so no SSH either
        code = result.error.code if result.error else None
        if result.status.value != "failed" or code not in ("lease_timeout", "ssh_timeout") \
                or evidence.get("failed_step") != "readiness" or outcomes != [("cleanup_blocked", "failed")]:
            bad.append(f"resumed provision (dnsmasq frozen): {result.status.value} {result.error} {outcomes}")
    else:
        code = result.error.code if result.error else None
        if result.status.value != "failed" or code != "provision_interrupted" \
                or outcomes != [("cleanup_blocked", "failed")]:
            bad.append(f"interrupted provision: {result.status.value} {code} {outcomes}")
    succeeded = result.status.value == "succeeded"
    bad += h.check(label, alloc, active=succeeded, blocked=not succeeded)
    return bad


def _release_point(h: Harness, point, alloc: str, task_id: str, next_arm) -> list[str]:
    label = ":".join(point) if point else "release (no kill)"
    h.submit(RELEASE, _release_payload(h, alloc), task_id)
    if point:
        h.wait_killed(label)
        h.outage()
        h.start(*next_arm)
    result, bad = _one_result(h, task_id, label)
    outcomes = [(o.status.value, o.health_state.value) for o in result.slot_outcomes]
    if result.status.value != "succeeded" or outcomes != [("available", "healthy")]:
        bad.append(f"release: {result.status.value} {result.error} {outcomes}")
    else:
        proof = result.slot_outcomes[0].health_detail.get("wipe_proof") or {}
        if proof.get("verified") is not True:
            bad.append(f"available without a verified wipe proof: {proof}")
    if h.disk_head() != ZERO_MIB:
        bad.append("the released disk does not read zero")
    bad += h.check(label, alloc, active=False, blocked=False)
    return bad


def test_kill_minus_nine_at_every_step_of_provision_and_release_leaves_a_consistent_host(crash_lab):
    lab, runner = crash_lab
    h = Harness(lab, runner)
    started = time.monotonic()
    # The sequence of (point, task id): each provision point, then the release of its allocation; the
    # release points that act on a found domain follow the provisions that end with a live slice.
    live = domain_release_points()
    rest = [p for p in RELEASE_POINTS if p not in live]
    releases = [live.pop(0) if boots(p) and live else rest.pop(0) if rest else None for p in PROVISION_POINTS]
    releases += live + rest
    assert sorted(filter(None, releases)) == sorted(RELEASE_POINTS)
    plan: list[tuple[str, tuple | None, str, str]] = []
    for i in range(max(len(PROVISION_POINTS), len(releases))):
        alloc = str(uuid.uuid4())
        p = PROVISION_POINTS[i] if i < len(PROVISION_POINTS) else None
        r = releases[i] if i < len(releases) else None
        plan.append(("provision", p, alloc, f"crash-p{i}-{uuid.uuid4().hex[:8]}"))
        plan.append(("release", r, alloc, f"crash-r{i}-{uuid.uuid4().hex[:8]}"))
    armed = [(point, task_id) for _, point, _, task_id in plan if point is not None]

    def arm_after(index: int) -> tuple:
        """The next killed point after plan[index] (what the restarted agent is armed for)."""
        later = [(point, task_id) for _, point, _, task_id in plan[index + 1:] if point is not None]
        return later[0] if later else (None, None)

    h.start(*armed[0])
    for index, (kind, point, alloc, task_id) in enumerate(plan):
        label = ":".join(point) if point else f"{kind} (no kill)"
        t0 = time.monotonic()
        try:
            if kind == "provision":
                if point is None:  # more release points than provision points: a plain provision first
                    h.submit(PROVISION, _provision_payload(h, alloc), task_id)
                    h.wait_result(task_id)
                    bad = []
                else:
                    bad = _provision_point(h, point, alloc, task_id, arm_after(index))
            else:
                bad = _release_point(h, point, alloc, task_id, arm_after(index))
        except AssertionError as exc:
            bad = [f"harness: {exc}"]
        h.timings[label] = round(time.monotonic() - t0, 1)
        if bad:
            h.problems[label] = bad
        if "agent" not in lab.procs or lab.procs["agent"].poll() is not None:  # keep the chain going
            lab.procs.pop("agent", None)
            h.start(*arm_after(index))
    lab.stop_agent()
    total = round(time.monotonic() - started, 1)
    points = len(PROVISION_POINTS) + len(RELEASE_POINTS)
    print(f"\ncrash matrix: {points} kill points, {h.outages} service restarts ({h.outage_s}), {total}s; "
          f"per point: {h.timings}")
    assert not h.problems, "\n".join(f"{label}: {bad}" for label, bad in h.problems.items())


def test_a_provision_killed_whose_deadline_passed_is_compensated_not_just_expired(crash_lab):
    """Bug (a) of issue 17: a redelivery past its deadline used to answer `expired` and leave everything."""
    lab, runner = crash_lab
    h = Harness(lab, runner)
    alloc, task_id = str(uuid.uuid4()), f"crash-expired-{uuid.uuid4().hex[:8]}"
    point = (PROVISION, "reservation", "after")
    h.start(point, task_id)
    deadline_s = 15.0
    submitted = time.monotonic()
    h.submit(PROVISION, _provision_payload(h, alloc), task_id, deadline_s=deadline_s)
    h.wait_killed(":".join(point))
    # The condition is the deadline itself: the restarted agent must meet a task whose deadline has passed.
    while time.monotonic() < submitted + deadline_s + 1:
        time.sleep(0.2)  # poll step: wait until the task's deadline has passed
    h.start()
    result, bad = _one_result(h, task_id, "expired")
    assert result.status.value == "failed" and result.error.code == "expired", result
    recovery = result.error.evidence["recovery"]
    assert recovery["disk_touched"] is True and "reservation" in recovery["steps_reached"]
    assert {c["step"] for c in recovery["compensations"] if c["ok"]} >= {"reservation", "ovs_port", "seed"}
    assert [(o.status.value, o.health_state.value) for o in result.slot_outcomes] == [("cleanup_blocked", "failed")]
    bad += h.check("expired", alloc, active=False, blocked=True)
    assert not bad, bad
    # The slot is not busy for good: a release wipes it and the next allocation gets it.
    release_id = f"crash-expired-r-{uuid.uuid4().hex[:8]}"
    bad = _release_point(h, None, alloc, release_id, (None, None))
    assert not bad, bad
    lab.stop_agent()


def _throttle(lab, pid: int, bps: int):
    """Put ``pid`` (and what it spawns: qemu-img) in a blkio cgroup writing the slot disk at ``bps``."""
    cg = Path("/sys/fs/cgroup/blkio") / f"gpuaas-crash-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    dev = Path(f"/sys/class/block/{Path(lab.host.disks[0].loop).name}/dev").read_text().strip()
    (cg / "blkio.throttle.write_bps_device").write_text(f"{dev} {bps}\n")
    (cg / "cgroup.procs").write_text(f"{pid}\n")
    return cg


def test_sigterm_during_a_clone_leaves_it_journaled_and_the_next_agent_redoes_it(crash_lab):
    """Issue 17 item 5: an upgrade (SIGTERM, 1 s drain) during a long clone never makes the slot cleanup_blocked."""
    lab, runner = crash_lab
    h = Harness(lab, runner)
    alloc, task_id = str(uuid.uuid4()), f"crash-term-{uuid.uuid4().hex[:8]}"
    h.start()
    agent = lab.procs["agent"]
    cg = _throttle(lab, agent.pid, 1 << 20)  # 1 MiB/s: the lab image's clone takes many seconds
    try:
        h.submit(PROVISION, _provision_payload(h, alloc), task_id)

        async def clone_running():
            return await lab.cp.wait_for(lambda seen: [e for e in seen.progress if e.task_id == task_id
                                                       and e.step == "clone" and e.status == "progress"
                                                       and (e.percent or 0) < 100], timeout=DEADLINE_S)

        runner.run(clone_running(), timeout=DEADLINE_S + 10)
        rc = lab.stop_agent(timeout=60)  # SIGTERM, as systemd does for an upgrade
    finally:
        for pid in (cg / "cgroup.procs").read_text().split():  # back to the root group (normally none left)
            with contextlib.suppress(OSError):
                (cg.parent / "cgroup.procs").write_text(f"{pid}\n")
        cg.rmdir()
    assert rc == 0
    assert h.results_of(task_id) == []  # no answer: the task stays journaled for the next agent
    db = sqlite3.connect(f"file:{lab.state_dir / 'state.db'}?mode=ro", uri=True)
    journal = db.execute("SELECT step, status FROM task_journal WHERE task_id = ? ORDER BY seq", (task_id,)).fetchall()
    db.close()
    # The clone stays started (journaled, nothing undone); the stop's hand-back is journaled after it, so this
    # start does not count toward the poison bound.
    assert journal[-2:] == [("clone", "started"), ("task.handed_back", "succeeded")], journal
    assert ("clone", "compensated") not in journal, journal
    h.start()
    result, bad = _one_result(h, task_id, "after SIGTERM")
    assert result.status.value == "succeeded", result.error
    assert result.output["clone"]["target_is_zero"] is False  # the half-written disk is rewritten whole
    bad += h.check("sigterm", alloc, active=True, blocked=False)
    assert not bad, bad
    bad = _release_point(h, None, alloc, f"crash-term-r-{uuid.uuid4().hex[:8]}", (None, None))
    assert not bad, bad
    lab.stop_agent()


@pytest.fixture(autouse=True)
def _no_agent_left(crash_lab):
    yield
    crash_lab[0].stop_agent()


def test_a_task_that_kills_the_agent_every_time_is_poison_after_the_bound_and_compensated(crash_lab):
    """Issue 17 item 4 with a real process crash: the same task SIGKILLs the agent on every start; after
    ``max_task_starts`` (3) starts the next agent answers ``poison_task`` without running it, undoes what the
    runs left (the lease: the clone never started) and serves the next task; the daemon never crash-loops."""
    lab, runner = crash_lab
    h = Harness(lab, runner)
    alloc, task_id = str(uuid.uuid4()), f"crash-poison-{uuid.uuid4().hex[:8]}"
    point = (PROVISION, "image", "after")
    h.start(point, task_id)
    h.submit(PROVISION, _provision_payload(h, alloc), task_id)
    for start in (1, 2, 3):
        h.wait_killed(f"start {start}")
        h.start(point, task_id)  # still armed: a fourth run would die too
    result, bad = _one_result(h, task_id, "poison")
    assert result.status.value == "failed" and result.error.code == "poison_task", result
    assert result.error.evidence["starts"] == 3
    recovery = result.error.evidence["recovery"]
    assert recovery["disk_touched"] is False and recovery["steps_reached"] == ["validate", "bind_vfio", "image"]
    assert [(o.status.value, o.slot_index) for o in result.slot_outcomes] == [("reserved", 0)]
    bad += h.check("poison", alloc, active=False, blocked=False)
    assert not bad, bad
    assert lab.procs["agent"].poll() is None  # the agent that answered is alive
    assert h.state()[0] == []  # the lease went with the compensation
