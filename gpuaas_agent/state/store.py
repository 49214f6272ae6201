"""The agent's SQLite store: a slot can be leased once, every pipeline step is journaled,
and a finished task's result is kept so a redelivered task returns it instead of running again.

One file under /var/lib/gpuaas-agent, WAL mode so the reconcile reader never
blocks the pipeline writer; schema changes are numbered migrations tracked in
``PRAGMA user_version``. Uniqueness is enforced by the database, not by Python
checks that two tasks could race past.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.fabric import PartitionLease
from gpuaas_agent.contract.fleet import ComponentRef, QuarantineRecord, RecheckVerdict
from gpuaas_agent.contract.handover import LeaseHandover
from gpuaas_agent.contract.state import JournalEntry, SlotDetail, SlotLease, SlotRecord, StepStatus
from gpuaas_agent.contract.storage import WipeProof
from gpuaas_agent.contract.terminal import HostKeyPin, TerminalAudit
from gpuaas_agent.errors import AgentError

log = logging.getLogger(__name__)

# Each entry moves the schema from version i to i+1; never edit one that shipped.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE slot_lease (
        slot_index INTEGER PRIMARY KEY,
        allocation_id TEXT NOT NULL,
        gpu_pci_address TEXT NOT NULL UNIQUE,
        nvme_device TEXT NOT NULL UNIQUE,
        fabric_vf_pci_address TEXT NOT NULL UNIQUE,
        task_id TEXT NOT NULL,
        taken_at REAL NOT NULL
    );
    CREATE TABLE task_journal (
        task_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        step TEXT NOT NULL,
        status TEXT NOT NULL,
        detail TEXT NOT NULL,
        at REAL NOT NULL,
        PRIMARY KEY (task_id, seq)
    );
    CREATE INDEX slot_lease_allocation ON slot_lease (allocation_id);
    CREATE TABLE task_result (
        task_id TEXT PRIMARY KEY,
        result TEXT NOT NULL,
        stored_at REAL NOT NULL
    );
    """,
    # 1 -> 2: the wipe proofs of each slot's disk, newest last (the proof is stored with the slot).
    """
    CREATE TABLE slot_wipe_proof (
        slot_index INTEGER NOT NULL,
        recorded_at REAL NOT NULL,
        verified INTEGER NOT NULL,
        proof TEXT NOT NULL
    );
    CREATE INDEX slot_wipe_proof_slot ON slot_wipe_proof (slot_index, recorded_at);
    """,
    # 2 -> 3: the host's own view of each slot it touched (a provision that failed after
    # the disk was written leaves the slot cleanup_blocked until a release wipes and verifies it).
    """
    CREATE TABLE slot_state (
        slot_index INTEGER PRIMARY KEY,
        allocation_id TEXT NOT NULL,
        status TEXT NOT NULL,
        health_state TEXT NOT NULL,
        detail TEXT NOT NULL,
        task_id TEXT NOT NULL,
        updated_at REAL NOT NULL
    );
    """,
    # 3 -> 4: a lease holds a disk by what it is, not by one of its names (an NVMe namespace has
    # several by-id aliases: two leases held one disk through two of them and the second wiped the
    # first's data). Rows leased before identities existed get ``path:<their by-id>``: the guard
    # then accepts exactly that link (the old rule) until the lease is released; new leases carry
    # the namespace identity read from sysfs. SQLite cannot add a UNIQUE column: a unique index does it.
    """
    ALTER TABLE slot_lease ADD COLUMN disk_identity TEXT;
    UPDATE slot_lease SET disk_identity = 'path:' || nvme_device WHERE disk_identity IS NULL;
    CREATE UNIQUE INDEX slot_lease_disk_identity ON slot_lease (disk_identity);
    """,
    # 4 -> 5: the terminal relay: every session audited (who, allocation, when, bytes, why it
    # ended), and each allocation's guest SSH host key as first seen (pinned: a changed key is refused).
    """
    CREATE TABLE terminal_session (
        session_id TEXT PRIMARY KEY,
        allocation_id TEXT NOT NULL,
        slot_index INTEGER NOT NULL,
        requested_by TEXT NOT NULL,
        login_user TEXT NOT NULL,
        target_host TEXT NOT NULL,
        target_port INTEGER NOT NULL,
        host_key_fingerprint TEXT NOT NULL,
        open_task_id TEXT NOT NULL,
        opened_at REAL NOT NULL,
        closed_at REAL,
        close_reason TEXT,
        close_detail TEXT NOT NULL DEFAULT '',
        bytes_in INTEGER NOT NULL DEFAULT 0,
        bytes_out INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX terminal_session_allocation ON terminal_session (allocation_id, opened_at);
    CREATE TABLE terminal_host_key (
        allocation_id TEXT PRIMARY KEY,
        slot_index INTEGER NOT NULL,
        target_host TEXT NOT NULL,
        public_key TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        pinned_at REAL NOT NULL
    );
    """,
    # 5 -> 6: small facts about the host the agent must remember across its restarts; first the kernel's
    # boot_id, so the first start after a host reboot re-validates and restores the active slices.
    """
    CREATE TABLE agent_meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL,
        updated_at REAL NOT NULL
    );
    """,
    # 6 -> 7: the handover a slot's next tenant is owed (wipe method, its zero guarantee, the GPU state) is
    # fixed at validate and kept with the lease, so no release looks it up from a domain that may be gone.
    # NULL: a lease from before (or slice.plan's, until validate): release uses the strictest method.
    """
    ALTER TABLE slot_lease ADD COLUMN handover TEXT;
    """,
    # 7 -> 8: quarantined components (a GPU, a disk, a VF or a slot whose handover or health failed): no slot
    # using one is offered until slice.unquarantine re-runs the failed check; each return is kept as history.
    # Maintenance needs no table: it is one agent_meta row (key "maintenance").
    """
    CREATE TABLE quarantine (
        kind TEXT NOT NULL,
        identity TEXT NOT NULL,
        reason TEXT NOT NULL,
        evidence TEXT NOT NULL,
        quarantined_at REAL NOT NULL,
        task_id TEXT NOT NULL,
        slot_index INTEGER,
        PRIMARY KEY (kind, identity)
    );
    CREATE TABLE quarantine_released (
        kind TEXT NOT NULL,
        identity TEXT NOT NULL,
        record TEXT NOT NULL,
        released_at REAL NOT NULL,
        released_by TEXT NOT NULL,
        release_reason TEXT NOT NULL,
        recheck TEXT NOT NULL,
        task_id TEXT NOT NULL
    );
    CREATE INDEX quarantine_released_component ON quarantine_released (kind, identity, released_at);
    """,
    # 8 -> 9: the NVIDIA Fabric Manager partition an allocation holds (NVSwitch hosts; contract/fabric.py):
    # recorded with the slot leases, activated before start, released after the domain is gone; after an
    # FM restart these rows are the partitions to set active again. One partition, one holder.
    """
    CREATE TABLE fabric_partition_lease (
        allocation_id TEXT PRIMARY KEY,
        partition_id INTEGER NOT NULL UNIQUE,
        gpu_pci_addresses TEXT NOT NULL,
        state TEXT NOT NULL,
        task_id TEXT NOT NULL,
        recorded_at REAL NOT NULL
    );
    """,
    # 9 -> 10: the allocation asked for guest telemetry; 0 for every lease taken before.
    """
    ALTER TABLE slot_lease ADD COLUMN guest_telemetry INTEGER NOT NULL DEFAULT 0;
    """,
)


LEASE_FIELDS = ("allocation_id", "slot_index", "gpu_pci_address", "nvme_device", "disk_identity",
                "fabric_vf_pci_address", "task_id", "taken_at", "handover", "guest_telemetry")
LEASE_COLUMNS = ", ".join(LEASE_FIELDS)


class StateError(AgentError):
    default_code = "state_error"
    retryable = False  # state_locked sets it: nothing was written, the caller may try again


class LeaseConflict(StateError):
    """The slot or one of its devices is leased by another lease already."""

    default_code = "lease_conflict"


def state_db_error(exc: sqlite3.Error, path: Path, *, timeout_s: float | None = None) -> StateError:
    """A typed error for what SQLite said about the state file (a bad file is refused, never guessed at).

    ``state_locked``: another process holds the lock longer than the busy timeout (retryable: nothing
    was written); ``state_unreadable``: the file is not a database, truncated or malformed.
    """
    text = str(exc)
    size = path.stat().st_size if path.exists() else None
    evidence = {"path": str(path), "sqlite_error": text, "size_bytes": size}
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text):
        err = StateError(f"state file {path} is locked by another process (waited {timeout_s}s); nothing was written",
                         code="state_locked", evidence={**evidence, "timeout_s": timeout_s})
        err.retryable = True
        return err
    return StateError(f"state file {path} cannot be used: {text}", code="state_unreadable", evidence=evidence)


class StateStore:
    """Open with :meth:`open`; one connection per store, used from one thread at a time."""

    def __init__(self, conn: sqlite3.Connection, path: Path, clock: Callable[[], float],
                 timeout_s: float = 10.0) -> None:
        self._conn = conn
        self.path = path
        self._clock = clock
        self.timeout_s = timeout_s
        self._close_hooks: list[Callable[[], None]] = []

    @classmethod
    def open(cls, path: str | Path, *, clock: Callable[[], float] = time.time,
             timeout_s: float = 10.0) -> StateStore:
        """Open (create, migrate) the state file; a file that is no usable database or stays locked longer
        than ``timeout_s`` is a :class:`StateError` (``state_unreadable`` / ``state_locked``), never a traceback."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # a lease or result must survive power loss
            conn.execute("PRAGMA foreign_keys=ON")
            store = cls(conn, path, clock, timeout_s)
            store._migrate()
            # A truncated file can still have a valid header: prove every page is there before trusting it.
            problems = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise StateError(f"state file {path} is damaged: {problems[0]}", code="state_unreadable",
                                 evidence={"path": str(path), "quick_check": problems[:10],
                                           "size_bytes": path.stat().st_size})
        except sqlite3.Error as exc:
            conn.close()
            raise state_db_error(exc, path, timeout_s=timeout_s) from exc
        except BaseException:
            conn.close()
            raise
        path.chmod(0o600)
        return store

    def close(self) -> None:
        """Close the connection; first the hooks (:meth:`before_close`): closing under a statement that a
        store thread (state/aio.py) is still running would crash the process, not raise."""
        for hook in self._close_hooks:
            hook()
        self._conn.close()

    def before_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at :meth:`close`, before the connection goes (a store thread's drain)."""
        self._close_hooks.append(hook)

    @property
    def schema_version(self) -> int:
        return cast(int, self._conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        current = self.schema_version
        if current > len(MIGRATIONS):
            raise StateError(
                f"state file {self.path} has schema {current}, newer than this agent knows ({len(MIGRATIONS)})",
                code="state_schema_newer",
                evidence={"path": str(self.path), "schema": current},
            )
        for version in range(current, len(MIGRATIONS)):
            with self._transaction():
                for statement in filter(str.strip, MIGRATIONS[version].split(";")):
                    self._conn.execute(statement)
                self._conn.execute(f"PRAGMA user_version = {version + 1}")

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT: take the write lock up front so racing writers queue, not fail late.

        A lock another process holds past the busy timeout is ``state_locked`` (nothing written).
        """
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise state_db_error(exc, self.path, timeout_s=self.timeout_s) from exc
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # -- leases -------------------------------------------------------------------

    def take_leases(self, leases: list[SlotLease]) -> list[SlotLease]:
        """Lease every slot of one allocation, all or nothing (a multi-GPU slice fits on one node).

        Taking a lease the allocation already holds is a no-op. Raises
        :class:`LeaseConflict` naming the holder when a slot, its GPU, disk (by
        any of its names: ``disk_identity``) or VF is held by another lease; then
        nothing is taken.
        """
        allocations = {lease.allocation_id for lease in leases}
        if len(allocations) != 1:
            raise StateError("one call leases the slots of exactly one allocation", code="lease_request_invalid",
                             evidence={"allocations": sorted(allocations)})
        with self._transaction():
            return [self._take_one(lease) for lease in leases]

    def take_lease(self, lease: SlotLease) -> SlotLease:
        return self.take_leases([lease])[0]

    def _take_one(self, lease: SlotLease) -> SlotLease:
        unbound = {"task_id", "taken_at", "handover", "guest_telemetry"}
        bound = lease.model_dump(exclude=unbound)
        for column in ("slot_index", "gpu_pci_address", "nvme_device", "disk_identity", "fabric_vf_pci_address"):
            holder = self._lease_row(f"{column} = ?", getattr(lease, column))
            if holder is None:
                continue
            if holder.model_dump(exclude=unbound) == bound:
                # This very lease, taken before (a redelivered plan or validate). Its handover, once fixed,
                # is never changed by a later take; a lease slice.plan took gets the validate's now.
                if holder.guest_telemetry != lease.guest_telemetry:  # the provision's opt-in decides, not the plan's
                    self._conn.execute("UPDATE slot_lease SET guest_telemetry = ? WHERE slot_index = ?",
                                       (int(lease.guest_telemetry), holder.slot_index))
                    holder = holder.model_copy(update={"guest_telemetry": lease.guest_telemetry})
                if holder.handover is None and lease.handover is not None:
                    self._conn.execute("UPDATE slot_lease SET handover = ? WHERE slot_index = ?",
                                       (lease.handover.model_dump_json(), holder.slot_index))
                    return holder.model_copy(update={"handover": lease.handover})
                return holder
            raise LeaseConflict(
                f"{column}={getattr(lease, column)} is leased by allocation {holder.allocation_id} (slot {holder.slot_index})",
                evidence={"field": column, "held": holder.model_dump(), "requested": lease.model_dump()},
            )
        self._conn.execute(
            "INSERT INTO slot_lease (slot_index, allocation_id, gpu_pci_address, nvme_device, disk_identity,"
            " fabric_vf_pci_address, task_id, taken_at, handover, guest_telemetry) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (lease.slot_index, lease.allocation_id, lease.gpu_pci_address, lease.nvme_device, lease.disk_identity,
             lease.fabric_vf_pci_address, lease.task_id, lease.taken_at,
             lease.handover.model_dump_json() if lease.handover is not None else None, int(lease.guest_telemetry)),
        )
        return lease

    def release_leases(self, allocation_id: str) -> list[SlotLease]:
        """Drop every lease of an allocation; returns what was released (empty if none)."""
        with self._transaction():
            held = self.leases_of(allocation_id)
            self._conn.execute("DELETE FROM slot_lease WHERE allocation_id = ?", (allocation_id,))
        return held

    def release_slot_lease(self, allocation_id: str, slot_index: int) -> SlotLease | None:
        """Drop one slot's lease of an allocation (its other slots keep theirs); returns it, or None."""
        with self._transaction():
            held = self._lease_row("slot_index = ? AND allocation_id = ?", (slot_index, allocation_id))
            self._conn.execute("DELETE FROM slot_lease WHERE slot_index = ? AND allocation_id = ?",
                               (slot_index, allocation_id))
        return held

    def leases_of(self, allocation_id: str) -> list[SlotLease]:
        rows = self._conn.execute(
            f"SELECT {LEASE_COLUMNS} FROM slot_lease WHERE allocation_id = ? ORDER BY slot_index", (allocation_id,)
        ).fetchall()
        return [self._lease(r) for r in rows]

    def leases(self) -> list[SlotLease]:
        rows = self._conn.execute(f"SELECT {LEASE_COLUMNS} FROM slot_lease ORDER BY slot_index").fetchall()
        return [self._lease(r) for r in rows]

    def _lease_row(self, where: str, value: object) -> SlotLease | None:
        params = value if isinstance(value, tuple) else (value,)
        row = self._conn.execute(f"SELECT {LEASE_COLUMNS} FROM slot_lease WHERE {where}", params).fetchone()
        return None if row is None else self._lease(row)

    @staticmethod
    def _lease(row: tuple[Any, ...]) -> SlotLease:
        fields = dict(zip(LEASE_FIELDS, row))
        stored = fields.pop("handover")
        handover = None
        if stored is not None:
            try:
                handover = LeaseHandover.model_validate_json(stored)
            except ValueError:
                # Unreadable (a newer agent's shape, or damage): treated as a lease from before handover
                # policies, whose release takes the strictest method the device supports. Never weaker.
                log.warning("event=lease_handover_unreadable slot_index=%s: the strictest wipe applies",
                            fields.get("slot_index"))
        fields["guest_telemetry"] = bool(fields["guest_telemetry"])
        return SlotLease(**fields, handover=handover)

    # -- journal ------------------------------------------------------------------

    def journal(self, task_id: str, step: str, status: StepStatus, detail: dict[str, Any] | None = None) -> JournalEntry:
        """Append one step event; sequence numbers are per task and gap-free."""
        with self._transaction():
            (seq,) = self._conn.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM task_journal WHERE task_id = ?", (task_id,)
            ).fetchone()
            entry = JournalEntry(task_id=task_id, seq=seq, step=step, status=status, detail=detail or {}, at=self._clock())
            self._conn.execute(
                "INSERT INTO task_journal VALUES (?, ?, ?, ?, ?, ?)",
                (entry.task_id, entry.seq, entry.step, entry.status.value, json.dumps(entry.detail, sort_keys=True), entry.at),
            )
        return entry

    def journal_of(self, task_id: str) -> list[JournalEntry]:
        rows = self._conn.execute(
            "SELECT task_id, seq, step, status, detail, at FROM task_journal WHERE task_id = ? ORDER BY seq", (task_id,)
        ).fetchall()
        entries = []
        for r in rows:
            try:
                entries.append(JournalEntry(task_id=r[0], seq=r[1], step=r[2], status=StepStatus(r[3]),
                                            detail=json.loads(r[4]), at=r[5]))
            except (ValueError, TypeError) as exc:  # a row an older/other version wrote: say which, never guess
                raise StateError(
                    f"journal row {r[1]} of task {task_id} is not one this agent can read: {exc}",
                    code="journal_unreadable",
                    evidence={"task_id": task_id, "seq": r[1], "step": r[2], "status": r[3],
                              "known_statuses": [s.value for s in StepStatus]}) from exc
        return entries

    def unfinished_steps(self, task_id: str) -> list[str]:
        """Steps whose last event is ``started``: what a restart must resume or compensate."""
        last: dict[str, StepStatus] = {}
        for entry in self.journal_of(task_id):
            last[entry.step] = entry.status
        return [step for step, status in last.items() if status == StepStatus.started]

    # -- idempotency --------------------------------------------------------------

    def store_result(self, task_id: str, result: dict[str, Any]) -> dict[str, Any]:
        """Keep a task's final result; a second store of a different result is refused."""
        payload = json.dumps(result, sort_keys=True)
        with self._transaction():
            row = self._conn.execute("SELECT result FROM task_result WHERE task_id = ?", (task_id,)).fetchone()
            if row is not None:
                if row[0] != payload:
                    raise StateError(
                        f"task {task_id} already has a different stored result",
                        code="result_conflict",
                        evidence={"stored": json.loads(row[0]), "new": result},
                    )
                return cast("dict[str, Any]", json.loads(row[0]))
            self._conn.execute("INSERT INTO task_result VALUES (?, ?, ?)", (task_id, payload, self._clock()))
        return result

    def prune_finished(self, before: float) -> tuple[int, int]:
        """Forget results stored before ``before`` (epoch s) and the journal rows of those tasks.

        Only finished tasks: a task without a stored result keeps its journal (a restart resumes
        it from there). Returns (results, journal rows) deleted. Retention, not correctness: a
        task redelivered after its result was pruned would run again, so keep this well beyond
        any task deadline (``max_task_deadline_s``).
        """
        with self._transaction():
            rows = self._conn.execute(
                "DELETE FROM task_journal WHERE task_id IN (SELECT task_id FROM task_result WHERE stored_at < ?)",
                (before,)).rowcount
            results = self._conn.execute("DELETE FROM task_result WHERE stored_at < ?", (before,)).rowcount
        return results, rows

    def result_of(self, task_id: str) -> dict[str, Any] | None:
        row = self._conn.execute("SELECT result FROM task_result WHERE task_id = ?", (task_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    # -- wipe proofs --------------------------------------------------------------

    def record_wipe_proof(self, slot_index: int, proof: WipeProof) -> None:
        """Keep a wipe's proof with its slot, verified or not: a failed one is the evidence of cleanup_blocked."""
        with self._transaction():
            self._conn.execute(
                "INSERT INTO slot_wipe_proof VALUES (?, ?, ?, ?)",
                (slot_index, self._clock(), int(proof.verified), proof.model_dump_json()),
            )

    def latest_wipe_proof(self, slot_index: int) -> WipeProof | None:
        """The newest proof of a slot's disk, or None when it was never wiped by this agent."""
        row = self._conn.execute(
            "SELECT proof FROM slot_wipe_proof WHERE slot_index = ? ORDER BY recorded_at DESC, rowid DESC LIMIT 1",
            (slot_index,),
        ).fetchone()
        return None if row is None else WipeProof.model_validate_json(row[0])

    def latest_wipe_proof_at(self, slot_index: int) -> tuple[float, WipeProof] | None:
        """The newest proof of a slot's disk with when it was recorded (this store's clock), or None."""
        row = self._conn.execute(
            "SELECT recorded_at, proof FROM slot_wipe_proof WHERE slot_index = ?"
            " ORDER BY recorded_at DESC, rowid DESC LIMIT 1",
            (slot_index,),
        ).fetchone()
        return None if row is None else (float(row[0]), WipeProof.model_validate_json(row[1]))

    # -- host facts ----------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        """A remembered host fact (``boot_id``...), or None when never stored."""
        row = self._conn.execute("SELECT value FROM agent_meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        with self._transaction():
            self._conn.execute("INSERT OR REPLACE INTO agent_meta VALUES (?, ?, ?)", (key, value, self._clock()))

    # -- quarantine ----------------------------------------------------------------

    _QUARANTINE_COLUMNS = "kind, identity, reason, evidence, quarantined_at, task_id, slot_index"

    def quarantine(self, record: QuarantineRecord) -> tuple[QuarantineRecord, bool]:
        """Quarantine a component; (the record that holds, True) when new. A component quarantined already
        keeps its first record (its first failure is the one to explain): (that record, False)."""
        with self._transaction():
            held = self.quarantine_of(record.ref)
            if held is not None:
                return held, False
            self._conn.execute(
                f"INSERT INTO quarantine ({self._QUARANTINE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (record.kind.value, record.identity, record.reason.value, json.dumps(record.evidence, sort_keys=True),
                 record.quarantined_at.timestamp(), record.task_id, record.slot_index))
        return record, True

    def quarantine_of(self, ref: ComponentRef) -> QuarantineRecord | None:
        row = self._conn.execute(f"SELECT {self._QUARANTINE_COLUMNS} FROM quarantine WHERE kind = ? AND identity = ?",
                                 (ref.kind.value, ref.identity)).fetchone()
        return None if row is None else self._quarantine_record(row)

    def quarantined(self) -> list[QuarantineRecord]:
        rows = self._conn.execute(f"SELECT {self._QUARANTINE_COLUMNS} FROM quarantine"
                                  " ORDER BY quarantined_at, rowid").fetchall()
        return [self._quarantine_record(r) for r in rows]

    def release_quarantine(self, ref: ComponentRef, *, released_by: str, reason: str, recheck: RecheckVerdict,
                           task_id: str) -> QuarantineRecord | None:
        """Return a component to service, keeping the record, who, why and the passing re-check as history;
        None when it was not quarantined (nothing changes)."""
        with self._transaction():
            held = self.quarantine_of(ref)
            if held is None:
                return None
            self._conn.execute("DELETE FROM quarantine WHERE kind = ? AND identity = ?", (ref.kind.value, ref.identity))
            self._conn.execute(
                "INSERT INTO quarantine_released VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (ref.kind.value, ref.identity, held.model_dump_json(), self._clock(), released_by, reason,
                 recheck.model_dump_json(), task_id))
        return held

    def quarantine_history(self, ref: ComponentRef) -> list[dict[str, Any]]:
        """Every return of a component to service, oldest first: its record, who, why, the re-check."""
        rows = self._conn.execute(
            "SELECT record, released_at, released_by, release_reason, recheck, task_id FROM quarantine_released"
            " WHERE kind = ? AND identity = ? ORDER BY released_at, rowid", (ref.kind.value, ref.identity)).fetchall()
        return [{"record": json.loads(r[0]), "released_at": r[1], "released_by": r[2], "reason": r[3],
                 "recheck": json.loads(r[4]), "task_id": r[5]} for r in rows]

    @staticmethod
    def _quarantine_record(row: tuple[Any, ...]) -> QuarantineRecord:
        return QuarantineRecord.from_wire({
            "kind": row[0], "identity": row[1], "reason": row[2], "evidence": json.loads(row[3]),
            "quarantined_at": datetime.fromtimestamp(row[4], UTC).isoformat(), "task_id": row[5],
            "slot_index": row[6]})

    # -- slot states ---------------------------------------------------------------

    def set_slot_state(self, record: SlotRecord) -> SlotRecord:
        """Record what the last task did to a slot (replaces the previous record of that slot)."""
        with self._transaction():
            self._conn.execute(
                "INSERT OR REPLACE INTO slot_state VALUES (?, ?, ?, ?, ?, ?, ?)",
                (record.slot_index, record.allocation_id, record.status.value, record.health_state.value,
                 json.dumps(record.detail.to_stored(), sort_keys=True), record.task_id, record.updated_at),
            )
        return record

    def slot_state(self, slot_index: int) -> SlotRecord | None:
        row = self._conn.execute(
            "SELECT slot_index, allocation_id, status, health_state, detail, task_id, updated_at"
            " FROM slot_state WHERE slot_index = ?", (slot_index,)).fetchone()
        return None if row is None else self._slot_record(row)

    def slot_states(self) -> list[SlotRecord]:
        rows = self._conn.execute(
            "SELECT slot_index, allocation_id, status, health_state, detail, task_id, updated_at"
            " FROM slot_state ORDER BY slot_index").fetchall()
        return [self._slot_record(r) for r in rows]

    def clear_slot_state(self, slot_index: int) -> None:
        """Forget a slot's record: only after its disk was wiped and verified (release)."""
        with self._transaction():
            self._conn.execute("DELETE FROM slot_state WHERE slot_index = ?", (slot_index,))

    @staticmethod
    def _slot_record(row: tuple[Any, ...]) -> SlotRecord:
        # The detail leniently: a row an older (or newer) release wrote still loads (contract/state.SlotDetail).
        return SlotRecord(slot_index=row[0], allocation_id=row[1], status=row[2], health_state=row[3],
                          detail=SlotDetail.from_stored(json.loads(row[4])), task_id=row[5], updated_at=row[6])

    # -- terminal sessions -------------------------------------------------------------

    _TERMINAL_COLUMNS = ("session_id, allocation_id, slot_index, requested_by, login_user, target_host, target_port,"
                         " host_key_fingerprint, open_task_id, opened_at, closed_at, close_reason, close_detail,"
                         " bytes_in, bytes_out")

    def record_terminal_open(self, audit: TerminalAudit) -> TerminalAudit:
        """Audit a session as it opens; a session id already used (open or closed) is ``session_exists``."""
        with self._transaction():
            if self._conn.execute("SELECT 1 FROM terminal_session WHERE session_id = ?",
                                  (audit.session_id,)).fetchone():
                raise StateError(f"terminal session {audit.session_id} was already used on this host",
                                 code="session_exists", evidence={"session_id": audit.session_id})
            self._conn.execute(
                f"INSERT INTO terminal_session ({self._TERMINAL_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (audit.session_id, audit.allocation_id, audit.slot_index, audit.requested_by, audit.user,
                 audit.target_host, audit.target_port, audit.host_key_fingerprint, audit.open_task_id,
                 audit.opened_at, audit.closed_at, audit.close_reason.value if audit.close_reason else None,
                 audit.close_detail, audit.bytes_in, audit.bytes_out))
        return audit

    def record_terminal_bytes(self, session_id: str, bytes_in: int, bytes_out: int) -> None:
        """A live session's counters so far (a crash keeps what was moved until the last update)."""
        with self._transaction():
            self._conn.execute("UPDATE terminal_session SET bytes_in = ?, bytes_out = ? WHERE session_id = ?"
                               " AND closed_at IS NULL", (bytes_in, bytes_out, session_id))

    def record_terminal_close(self, session_id: str, *, reason: str, detail: str, bytes_in: int,
                              bytes_out: int) -> TerminalAudit | None:
        """Close a session's audit row once (a second close leaves the first); returns the row."""
        with self._transaction():
            self._conn.execute(
                "UPDATE terminal_session SET closed_at = ?, close_reason = ?, close_detail = ?, bytes_in = ?,"
                " bytes_out = ? WHERE session_id = ? AND closed_at IS NULL",
                (self._clock(), reason, detail[:500], bytes_in, bytes_out, session_id))
        return self.terminal_session(session_id)

    def close_stale_terminal_sessions(self, live: set[str], *, reason: str) -> list[str]:
        """Rows still open that no live session owns (the agent died under them): closed with ``reason``."""
        with self._transaction():
            stale = [r[0] for r in self._conn.execute(
                "SELECT session_id FROM terminal_session WHERE closed_at IS NULL").fetchall() if r[0] not in live]
            for session_id in stale:
                self._conn.execute("UPDATE terminal_session SET closed_at = ?, close_reason = ? WHERE session_id = ?",
                                   (self._clock(), reason, session_id))
        return stale

    def terminal_session(self, session_id: str) -> TerminalAudit | None:
        row = self._conn.execute(f"SELECT {self._TERMINAL_COLUMNS} FROM terminal_session WHERE session_id = ?",
                                 (session_id,)).fetchone()
        return None if row is None else self._terminal(row)

    def terminal_sessions(self, allocation_id: str | None = None) -> list[TerminalAudit]:
        where, params = ("WHERE allocation_id = ?", (allocation_id,)) if allocation_id else ("", ())
        rows = self._conn.execute(f"SELECT {self._TERMINAL_COLUMNS} FROM terminal_session {where}"
                                  " ORDER BY opened_at, session_id", params).fetchall()
        return [self._terminal(r) for r in rows]

    @staticmethod
    def _terminal(row: tuple[Any, ...]) -> TerminalAudit:
        keys = ("session_id", "allocation_id", "slot_index", "requested_by", "user", "target_host", "target_port",
                "host_key_fingerprint", "open_task_id", "opened_at", "closed_at", "close_reason", "close_detail",
                "bytes_in", "bytes_out")
        return TerminalAudit.from_wire(dict(zip(keys, row)))

    def pin_host_key(self, pin: HostKeyPin) -> HostKeyPin:
        """Pin an allocation's guest host key unless one is pinned already; returns the pin that holds."""
        with self._transaction():
            self._conn.execute(
                "INSERT OR IGNORE INTO terminal_host_key VALUES (?, ?, ?, ?, ?, ?)",
                (pin.allocation_id, pin.slot_index, pin.target_host, pin.public_key, pin.fingerprint, pin.pinned_at))
        held = self.host_key_pin(pin.allocation_id)
        assert held is not None
        return held

    def host_key_pin(self, allocation_id: str) -> HostKeyPin | None:
        row = self._conn.execute(
            "SELECT allocation_id, slot_index, target_host, public_key, fingerprint, pinned_at FROM terminal_host_key"
            " WHERE allocation_id = ?", (allocation_id,)).fetchone()
        if row is None:
            return None
        return HostKeyPin(allocation_id=row[0], slot_index=row[1], target_host=row[2], public_key=row[3],
                          fingerprint=row[4], pinned_at=row[5])

    # -- fabric partitions (NVSwitch hosts) --------------------------------------------

    def record_partition(self, lease: PartitionLease) -> PartitionLease:
        """Record (or update the state of) an allocation's partition; ``partition_leased`` if another holds it."""
        with self._transaction():
            other = self._conn.execute("SELECT allocation_id FROM fabric_partition_lease WHERE partition_id = ?"
                                       " AND allocation_id != ?", (lease.partition_id, lease.allocation_id)).fetchone()
            if other is not None:
                raise StateError(f"fabric partition {lease.partition_id} is held by allocation {other[0]}",
                                 code="partition_leased",
                                 evidence={"partition_id": lease.partition_id, "held_by": other[0]})
            self._conn.execute(
                "INSERT OR REPLACE INTO fabric_partition_lease VALUES (?, ?, ?, ?, ?, ?)",
                (lease.allocation_id, lease.partition_id, ",".join(lease.gpu_pci_addresses), lease.state.value,
                 lease.task_id, lease.recorded_at))
        return lease

    def partition_of(self, allocation_id: str) -> PartitionLease | None:
        rows = self._partition_rows("WHERE allocation_id = ?", (allocation_id,))
        return rows[0] if rows else None

    def partition_leases(self) -> list[PartitionLease]:
        return self._partition_rows("", ())

    def release_partition(self, allocation_id: str) -> PartitionLease | None:
        with self._transaction():
            held = self.partition_of(allocation_id)
            self._conn.execute("DELETE FROM fabric_partition_lease WHERE allocation_id = ?", (allocation_id,))
        return held

    def _partition_rows(self, where: str, params: tuple[Any, ...]) -> list[PartitionLease]:
        rows = self._conn.execute(
            "SELECT allocation_id, partition_id, gpu_pci_addresses, state, task_id, recorded_at"
            f" FROM fabric_partition_lease {where} ORDER BY partition_id", params).fetchall()
        return [PartitionLease.from_wire({"allocation_id": r[0], "partition_id": r[1],
                                          "gpu_pci_addresses": [a for a in r[2].split(",") if a], "state": r[3],
                                          "task_id": r[4], "recorded_at": r[5]}) for r in rows]
