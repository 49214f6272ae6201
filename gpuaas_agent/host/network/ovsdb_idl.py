"""A thin adapter over the ``ovs`` Python IDL for the Open_vSwitch db: connect, sync, transact.

This is all the transaction plumbing the agent has; host/network/ovs.py holds only policy
(which rows, which checks, which refusals). What the adapter guarantees, and why
each piece is here rather than in a library (measured with
bench/bench_ovsdb.py against ovsdbapp 3.0 on a real ovsdb-server + vswitchd):

* one deadline per operation, connect included: the schema is fetched with a
  deadline (ovsdbapp's ``idlutils.fetch_schema_json`` blocks forever on a server
  that accepts and never answers — measured: still blocked after 8 s);
* ``transact(build)``: ``build`` reads the replica, refuses by raising, and writes;
  a ``TRY_AGAIN`` re-runs it on fresh data at most :data:`COMMIT_ATTEMPTS` times,
  then ``ovs_commit_retries_exhausted`` (ovsdbapp retries until its timeout and
  raises an untyped ``RuntimeError``);
* a change waits until ovs-vswitchd applied it (``cur_cfg`` >= our ``next_cfg``,
  as ``ovs-vsctl`` does) and says ``ovs_vswitchd_timeout`` when it did not
  (ovsdbapp's ``OvsVsctlTransaction`` logs that and reports success);
* ``sync()``: a read-only round trip before every decision, so a port libvirt
  re-created a moment ago is seen (the IDL does not send a transaction without
  writes, so ``verify`` alone cannot catch a stale "nothing to change"; ovsdbapp
  decides on its replica as it is);
* no thread, no shared state: every driver owns its connection (ovsdbapp keeps a
  backend's connection in a class attribute, so a second driver for another
  remote silently talks to the first one's server — measured in the bench — and
  runs one more thread per connection).

Footprint and speed were not the reason, they are close (bench, 2026-11-24, 2
shared cores): ovsdbapp adds ~0.4 MiB RSS, 23 modules, 8-18 ms of import and one
thread per connection; its own add_port+db_set / del_port took 1.14-1.29x / 1.08-1.18x the
time of OvsDriver's add_vm_port / remove_vm_port (medians of 100, waiting for
vswitchd both; three runs), and our sync round trip costs well under a millisecond.
Blocking, not thread-safe: the caller serialises (OvsDriver holds a lock).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import ovs.db.idl
import ovs.jsonrpc
import ovs.poller
import ovs.stream

from gpuaas_agent.errors import HostError
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)

DB_NAME = "Open_vSwitch"
# A TRY_AGAIN means someone else changed what we read; a few rounds settle any real race,
# an endless stream of them means something is fighting us and must be reported.
COMMIT_ATTEMPTS = 8
Txn: TypeAlias = ovs.db.idl.Transaction  # the ovs library is untyped: Any to mypy


class OvsError(HostError):
    """ovsdb or vswitchd did not do what was asked.

    Codes: ``ovsdb_unreachable`` (evidence names the remote), ``ovsdb_not_initialized``,
    ``ovs_commit_failed``, ``ovs_commit_retries_exhausted``, ``ovs_commit_timeout``
    (the outcome is unknown), ``ovs_vswitchd_timeout`` (committed, not yet applied:
    vswitchd is down or stuck).
    """

    default_code = "ovs_error"


class IdlSession:
    """One monitored connection to the Open_vSwitch db, replicating ``columns`` only."""

    def __init__(self, remote: str, columns: dict[str, list[str]], *, timeout_s: float) -> None:
        self.remote = remote
        self.timeout_s = timeout_s
        deadline = self.deadline()
        helper = ovs.db.idl.SchemaHelper(schema_json=fetch_schema(remote, deadline))
        for table, cols in columns.items():
            helper.register_columns(table, cols)
        self.idl = ovs.db.idl.Idl(remote, helper, leader_only=False)
        try:
            self.sync(deadline)
        except BaseException:
            self.idl.close()
            raise

    def close(self) -> None:
        self.idl.close()

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    # -- the replica -------------------------------------------------------------------

    def rows(self, table: str) -> list[Any]:
        return list(self.idl.tables[table].rows.values())

    def root(self) -> Any:
        rows = self.rows("Open_vSwitch")
        if not rows:
            raise OvsError(
                f"ovsdb at {self.remote} has no Open_vSwitch row (never initialised)",
                code="ovsdb_not_initialized",
                evidence={"remote": self.remote},
            )
        return rows[0]

    def insert(self, txn: Txn, table: str) -> Any:
        return txn.insert(self.idl.tables[table])

    # -- the loop ----------------------------------------------------------------------

    def _connected(self) -> bool:
        # The IDL keeps no public "connected" flag; the session's is the one its own run() checks.
        return bool(self.idl.state == self.idl.IDL_S_MONITORING and self.idl._session.is_connected())

    def _pump(self, until: Callable[[], bool], deadline: float) -> bool:
        """Run the IDL until ``until()`` holds (True) or the deadline passes (False)."""
        while True:
            self.idl.run()
            if until():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller = ovs.poller.Poller()
            self.idl.wait(poller)
            poller.timer_wait(max(1, int(left * 1000)))
            poller.block()

    def sync(self, deadline: float) -> None:
        """Make the replica at least as new as the server is now, or raise ``ovsdb_unreachable``.

        The IDL applies updates only when it runs, and a dead server is noticed only
        when a read fails: a read-only transaction (one ``select``) is a round trip
        whose reply comes after every update committed before it.
        """
        while True:
            if not self._pump(self._connected, deadline):
                raise unreachable(self.remote, self.timeout_s, "no monitored connection to ovsdb")
            txn = Txn(self.idl)
            self.root().fetch("cur_cfg")
            status = self._commit(txn, deadline, "sync with ovsdb")
            if status == Txn.SUCCESS:
                return
            if status != Txn.TRY_AGAIN:
                raise OvsError(
                    f"ovsdb at {self.remote} refused a read: {txn.get_error() or status}",
                    code="ovs_commit_failed",
                    evidence={"remote": self.remote, "status": status, "error": txn.get_error()},
                )

    def transact(self, build: Callable[[Txn], bool], *, what: str, deadline: float,
                 before_commit: Callable[[int], None] | None = None) -> bool:
        """Build and commit until it sticks; returns False when ``build`` found nothing to change.

        ``build`` runs again from scratch after every TRY_AGAIN, so its checks always
        see the data the commit was verified against. ``before_commit(attempt)`` is a
        test seam (called after the build, before the commit).
        """
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            self.sync(deadline)  # also the resync after a TRY_AGAIN
            txn = Txn(self.idl)
            try:
                if not build(txn):
                    txn.abort()
                    return False
                self.root().increment("next_cfg")
                if before_commit is not None:
                    before_commit(attempt)
            except BaseException:
                txn.abort()
                raise
            status = self._commit(txn, deadline, what)
            if status == Txn.SUCCESS:
                self._wait_applied(txn.get_increment_new_value(), deadline, what)
                return True
            if status == Txn.UNCHANGED:
                return False
            if status != Txn.TRY_AGAIN:
                raise OvsError(
                    f"ovsdb refused the transaction to {what}: {txn.get_error() or status}",
                    code="ovs_commit_failed",
                    evidence={"remote": self.remote, "status": status, "error": txn.get_error(), "what": what},
                )
            log_event(log, "ovs_commit_try_again", what=what, attempt=attempt)
        raise OvsError(
            f"gave up on {what} after {COMMIT_ATTEMPTS} TRY_AGAIN commits: something keeps changing it",
            code="ovs_commit_retries_exhausted",
            evidence={"remote": self.remote, "attempts": COMMIT_ATTEMPTS, "what": what},
        )

    def _commit(self, txn: Txn, deadline: float, what: str) -> str:
        """``commit_block()`` with a deadline."""
        while True:
            status: str = txn.commit()
            if status != Txn.INCOMPLETE:
                return status
            self.idl.run()
            left = deadline - time.monotonic()
            if left <= 0:
                txn.abort()
                if not self._connected():
                    raise unreachable(self.remote, self.timeout_s, f"connection lost while trying to {what}")
                raise OvsError(
                    f"no answer from ovsdb within {self.timeout_s}s to {what}; the change may or may not have landed",
                    code="ovs_commit_timeout",
                    evidence={"remote": self.remote, "timeout_s": self.timeout_s, "what": what},
                )
            poller = ovs.poller.Poller()
            self.idl.wait(poller)
            txn.wait(poller)
            poller.timer_wait(max(1, int(left * 1000)))
            poller.block()

    def _wait_applied(self, next_cfg: int, deadline: float, what: str) -> None:
        def applied() -> bool:
            rows = self.rows("Open_vSwitch")
            return bool(rows) and rows[0].cur_cfg >= next_cfg

        if not self._pump(applied, deadline):
            raise OvsError(
                f"committed {what} but ovs-vswitchd did not apply it within {self.timeout_s}s (is it running?)",
                code="ovs_vswitchd_timeout",
                evidence={"remote": self.remote, "next_cfg": next_cfg, "what": what},
            )


def unreachable(remote: str, timeout_s: float, why: str) -> OvsError:
    return OvsError(
        f"ovsdb at {remote} unreachable: {why}",
        code="ovsdb_unreachable",
        evidence={"remote": remote, "timeout_s": timeout_s, "why": why},
    )


def fetch_schema(remote: str, deadline: float) -> dict[str, Any]:
    """The server's own ``Open_vSwitch`` schema (``get_schema``), so we never read a file that may not match it."""
    left_ms = max(1, int((deadline - time.monotonic()) * 1000))
    error, stream = ovs.stream.Stream.open_block(ovs.stream.Stream.open(remote), left_ms)
    if error:
        raise unreachable(remote, left_ms / 1000, f"connect: {os.strerror(error)}")
    conn = ovs.jsonrpc.Connection(stream)
    try:
        request = ovs.jsonrpc.Message.create_request("get_schema", [DB_NAME])
        error = conn.send(request)
        while not error:
            conn.run()
            error, msg = conn.recv()
            if error == errno.EAGAIN:
                error = 0
            elif msg is not None and msg.id == request.id:
                if msg.type == ovs.jsonrpc.Message.T_ERROR:
                    raise OvsError(
                        f"ovsdb at {remote} has no {DB_NAME} database: {msg.error}",
                        code="ovsdb_not_initialized",
                        evidence={"remote": remote, "error": msg.error},
                    )
                result: dict[str, Any] = msg.result
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise unreachable(remote, left_ms / 1000, "no answer to get_schema")
            poller = ovs.poller.Poller()
            conn.wait(poller)
            conn.recv_wait(poller)
            poller.timer_wait(max(1, int(left * 1000)))
            poller.block()
        raise unreachable(remote, left_ms / 1000, f"get_schema: {os.strerror(error) if error > 0 else 'EOF'}")
    finally:
        conn.close()
