"""A hostile neighbour load on the lab-in-a-box, and a third tenant's lifecycle work beside it.

Used by tests/e2e/test_lab_hostile.py (which asserts completion and ordering) and
bench/bench_fairness_lab.py (which prints tenant C's claim latency, hostile vs idle). Everything is
real: the lab's agent, its guests, their SSH servers, NATS.

* Tenant A holds two slices. In the first guest it stops acpid (as root, with its own key: a guest
  that ignores the ACPI power button), then sends ``reboots`` reboots of that slice at once. It
  holds 8 terminal sessions (4 per slice, the per-slice limit) whose shells were replaced by a
  ``sleep`` that never reads its terminal, and types into them.
* Tenant B holds one slice with one such session and floods ``slice.terminal_data`` into it at
  ``flood_rate`` per second until told to stop.
* Tenant C provisions and releases a slice on the same node (:func:`timed`).

The load ends by A powering its guest off from inside (what a tenant can do; the reboot then
completes), B stopping, and A's and B's slices being released: every task sent then has a result.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

import asyncssh

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.tasks import TaskResult
from gpuaas_agent.operator.daemonstatus import DaemonStatus, read_status
from tests.support.terminal_gateway import Gateway

SESSIONS_PER_SLICE = 4  # [slice.terminal] max_sessions_per_slice's default
DEADLINE_S = 900.0  # a failure bound for every wait on the lab, never a timer
# What a neighbour's interactive task may be answered under the load: each is immediate or bounded.
BOUNDED = {"tenant_busy", "superseded", "terminal_input_full", "terminal_input_stalled", "session_closed",
           "session_not_found"}
# A line the guest's terminal buffers; lines (not one long line) so the canonical-mode tty fills and
# pushes back (a full line buffer without a newline drops input instead).
LINE = b"x" * 63 + b"\n"


@dataclass
class Slice:
    slot: object  # ApprovedSlot
    payload: dict

    @property
    def alloc(self) -> str:
        return self.payload["allocation_id"]


async def guest_root(lab, ip: str, command: str, *, timeout: float = 120) -> str:
    """Run ``command`` as root in a lab guest over SSH with the tenant's key (the seed gives root that key)."""
    async with asyncssh.connect(ip, username="root", client_keys=[str(lab.tenant_key_file)], known_hosts=None,
                                connect_timeout=60) as conn:
        done = await asyncio.wait_for(conn.run(command, check=False), timeout)
    return str(done.stdout or "")


async def timed(lab, task_type: str, payload: dict, *, timeout: float = DEADLINE_S) -> tuple[TaskResult, float]:
    """Run one task; its result and its claim latency: publish -> the agent's first progress event for it."""
    envelope = lab.cp.envelope(lab.node_id, task_type, payload, deadline_s=timeout)
    sent = time.time()
    await lab.cp.enqueue(envelope)
    result = await lab.cp.wait_result(envelope.task_id, timeout=timeout)
    starts = [p.at for p in lab.cp.seen.progress if p.task_id == envelope.task_id]
    if not starts:
        raise AssertionError(f"{task_type} {envelope.task_id} published no progress: {result}")
    return result, min(starts).timestamp() - sent


async def provision(lab, slot) -> Slice:
    payload = lab.provision_payload(slot)
    result = await lab.task("slice.vm_provision", payload, timeout=DEADLINE_S)
    assert result.status.value == "succeeded", result.error
    return Slice(slot, payload)


async def release(lab, s: Slice) -> TaskResult:
    return await lab.task("slice.vm_release", lab.release_payload(s.alloc, s.slot), timeout=DEADLINE_S)


async def daemon_status(lab, predicate, *, after: datetime | None = None, timeout: float = 120) -> DaemonStatus:
    """The first status file (written after ``after``) that ``predicate`` accepts; AssertionError with the last
    one at the deadline (a count that never comes down is a leak)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = None
    while loop.time() < deadline:
        last = await asyncio.to_thread(read_status, lab.state_dir)
        if last is not None and (after is None or last.written_at > after) and predicate(last):
            return last
        await asyncio.sleep(0.5)  # the daemon rewrites the file every heartbeat
    raise AssertionError(f"no daemon status within {timeout}s satisfied the condition; last: "
                         f"{last.model_dump_json() if last else None}")


def idle(status: DaemonStatus, subscriptions: int) -> bool:
    """Nothing registered: no task, session, opening or power turn; the subscriptions of an idle node."""
    r, a = status.registered, status.admission
    return (r is not None and a is not None and (r.tasks, r.terminal_sessions, r.terminal_opening, r.power_tasks)
            == (0, 0, 0, 0) and r.subscriptions == subscriptions and sum(a.in_flight.values()) == 0
            and a.tenants == 0)


@dataclass
class Session:
    owner: Slice
    sid: str
    gw: Gateway


@dataclass
class Hostile:
    lab: object
    a_slots: list  # two ApprovedSlots: A's guest that ignores ACPI first
    b_slot: object
    reboots: int = 20
    flood_rate: float = 10.0
    a_slices: list[Slice] = field(default_factory=list)
    b_slice: Slice | None = None
    sessions: list[Session] = field(default_factory=list)
    sent: dict[str, list[str]] = field(default_factory=lambda: {"A": [], "B": []})
    reboot_ids: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _flood: asyncio.Task | None = None

    # -- before the load ---------------------------------------------------------------------------

    async def setup(self) -> None:
        """A's two slices and B's one (provisioned together), A's guest stops hearing ACPI, the sessions."""
        *a, b = await asyncio.gather(*(provision(self.lab, s) for s in (*self.a_slots, self.b_slot)))
        self.a_slices, self.b_slice = list(a), b
        guest = self.a_slices[0].slot.private_ip
        # busybox acpid runs the power button's script: without it the button does nothing.
        left = await guest_root(self.lab, guest, "kill $(pidof acpid); sleep 1; pidof acpid || echo ACPID-GONE")
        assert "ACPID-GONE" in left, left
        for owner in self.a_slices:
            for _ in range(SESSIONS_PER_SLICE):
                self.sessions.append(await self._open(owner))
        self.sessions.append(await self._open(self.b_slice))

    async def _open(self, owner: Slice) -> Session:
        lab, sid = self.lab, str(uuid.uuid4())
        gw = await Gateway(lab.cp.nc, sid, node=lab.node_id).start()
        payload = {"allocation_id": owner.alloc, "slot_index": owner.slot.slot_index, "user": owner.payload["user"],
                   "requested_by": "hostile@lab", "capacity_shape": "gpu_slice",
                   "target_host": owner.slot.private_ip, "target_port": 22, "session_id": sid, "cols": 80, "rows": 24}
        opened = await lab.task("slice.terminal_open", payload, timeout=300)
        assert opened.status.value == "succeeded", opened.error
        # The shell becomes a sleep that never reads its terminal (the marker is computed: the echo lacks it).
        await gw.send(b"stty -echo; echo HOSTILE-$((6*7)); exec sleep 100000\n")
        await gw.wait_for_output(b"HOSTILE-42", timeout=300)
        return Session(owner, sid, gw)

    # -- the load ----------------------------------------------------------------------------------

    async def _send(self, tenant: str, task_type: str, payload: dict) -> str:
        task_id = await self.lab.submit(task_type, payload, deadline_s=DEADLINE_S)
        self.sent[tenant].append(task_id)
        return task_id

    def _data(self, s: Session, lines: int) -> dict:
        return {"session_id": s.sid, "allocation_id": s.owner.alloc,
                "data": base64.b64encode(LINE * lines).decode()}

    async def start(self) -> None:
        """A's reboots and its typing into 8 sessions that never read; B's flood, running until :meth:`stop`."""
        a1 = self.a_slices[0]
        for _ in range(self.reboots):
            self.reboot_ids.append(await self._send("A", "slice.vm_power", {
                "allocation_id": a1.alloc, "slot_index": a1.slot.slot_index, "operation": "reboot",
                "graceful_timeout_s": 3600}))
        for s in self.sessions:
            if s.owner is not self.b_slice:
                for _ in range(4):
                    await self._send("A", "slice.terminal_data", self._data(s, 192))  # 12 KiB each
        self._flood = asyncio.create_task(self._flood_b())

    async def _flood_b(self) -> None:
        s = next(s for s in self.sessions if s.owner is self.b_slice)
        while not self._stop.is_set():
            await self._send("B", "slice.terminal_data", self._data(s, 192))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 1 / self.flood_rate)  # the flood's pace

    async def reboot_running(self) -> str:
        """The one reboot of A that runs: its shutdown step started (the power button was pressed)."""
        ids = set(self.reboot_ids)
        event = await self.lab.cp.wait_for(
            lambda seen: next((p for p in seen.progress if p.task_id in ids and p.step == "shutdown"), None),
            timeout=DEADLINE_S)
        return event.task_id

    def result_of(self, task_id: str) -> TaskResult | None:
        return next((r for r in self.lab.cp.seen.results if r.task_id == task_id), None)

    def flooding(self) -> bool:
        return self._flood is not None and not self._flood.done() and not self._stop.is_set()

    async def b_answered_since(self, count: int) -> None:
        """Wait until ``count`` more of B's tasks have results than now (the node still answers B)."""
        sent = self.sent["B"]  # the live list: the flood goes on adding to it

        def answered(seen) -> int:
            ids = set(sent)
            return sum(1 for r in seen.results if r.task_id in ids)

        base = answered(self.lab.cp.seen)
        await self.lab.cp.wait_for(lambda seen: answered(seen) >= base + count, timeout=DEADLINE_S)

    # -- after the load ----------------------------------------------------------------------------

    async def stop(self, running_reboot: str) -> dict[str, Counter]:
        """B stops; A powers its guest off from inside, so the reboot completes; every task sent is answered.

        Returns, per tenant, the count of each outcome (``succeeded`` or the error code)."""
        self._stop.set()
        if self._flood is not None:
            await self._flood
        with contextlib.suppress(OSError, asyncssh.Error, TimeoutError):  # the connection dies with the guest
            await guest_root(self.lab, self.a_slices[0].slot.private_ip, "poweroff -f", timeout=30)
        done = await self.lab.cp.wait_result(running_reboot, timeout=DEADLINE_S)
        assert done.status.value == "succeeded", done.error
        everything = {t for ids in self.sent.values() for t in ids}
        await self.lab.cp.wait_for(lambda seen: everything <= {r.task_id for r in seen.results}, timeout=DEADLINE_S)
        return {tenant: Counter(self._outcome(self.result_of(t)) for t in ids) for tenant, ids in self.sent.items()}

    @staticmethod
    def _outcome(result: TaskResult | None) -> str:
        assert result is not None
        if result.status.value == "succeeded":
            return "succeeded"
        return result.error.code if result.error is not None else result.status.value

    async def release(self) -> list[TaskResult]:
        """A's and B's slices released (each release closes the slice's sessions); gateways unsubscribed."""
        slices = [*self.a_slices, *([self.b_slice] if self.b_slice else [])]
        results = await asyncio.gather(*(release(self.lab, s) for s in slices))
        for s in self.sessions:
            with contextlib.suppress(Exception):
                await s.gw.sub.unsubscribe()
        return list(results)


def now() -> datetime:
    return datetime.now(UTC)
