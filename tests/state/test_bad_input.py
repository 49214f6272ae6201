"""The state store given bad input (issue 17): an older version's journal, a truncated file, a file another
process holds locked. Each is a typed error naming what was seen, and nothing is written."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import time

import pytest

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.exitcodes import EXIT_ENVIRONMENT, exit_code_for
from gpuaas_agent.state.store import StateError, StateStore
from tests.support.tiers import starts


def _raw(path, sql: str, *params) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(sql, params)
    finally:
        conn.close()


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_journal_row_with_a_status_an_older_version_wrote_is_journal_unreadable(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    store.journal("t-old", "validate", StepStatus.succeeded)
    _raw(store.path, "INSERT INTO task_journal VALUES ('t-old', 2, 'clone', 'running', '{}', 1.0)")
    for read in (store.journal_of, store.unfinished_steps):
        with pytest.raises(StateError) as err:
            read("t-old")
        assert err.value.code == "journal_unreadable"
        assert err.value.evidence["seq"] == 2 and err.value.evidence["status"] == "running"
        assert err.value.evidence["step"] == "clone" and "started" in err.value.evidence["known_statuses"]
    # Other tasks' journals are unaffected.
    store.journal("t-new", "validate", StepStatus.started)
    assert store.unfinished_steps("t-new") == ["validate"]
    store.close()


def test_a_journal_row_with_unparseable_detail_is_journal_unreadable(tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    _raw(store.path, "INSERT INTO task_journal VALUES ('t-old', 1, 'clone', 'started', 'not json', 1.0)")
    with pytest.raises(StateError) as err:
        store.journal_of("t-old")
    assert err.value.code == "journal_unreadable" and err.value.evidence["seq"] == 1
    store.close()


def test_step_names_an_older_version_used_are_handed_on_as_written(tmp_path):
    """The store does not know the pipelines' steps: it reports exactly what was journaled; the handler decides."""
    store = StateStore.open(tmp_path / "state.db")
    _raw(store.path, "INSERT INTO task_journal VALUES ('t-old', 1, 'write_image_v0', 'started', '{}', 1.0)")
    assert store.unfinished_steps("t-old") == ["write_image_v0"]
    store.close()


def _filled(tmp_path):
    path = tmp_path / "state.db"
    store = StateStore.open(path)
    for n in range(400):  # enough pages that half the file loses some
        store.journal(f"t-{n}", "clone", StepStatus.succeeded, {"pad": "x" * 200})
    store.close()
    return path


def test_a_truncated_state_file_is_state_unreadable_and_left_as_it_was(tmp_path):
    path = _filled(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    before = _digest(path)
    with pytest.raises(StateError) as err:
        StateStore.open(path)
    assert err.value.code == "state_unreadable" and exit_code_for(err.value.code) == EXIT_ENVIRONMENT
    assert err.value.evidence["path"] == str(path) and err.value.evidence["size_bytes"] == len(data) // 2
    assert _digest(path) == before  # nothing written, nothing "repaired"


def test_a_file_that_is_not_a_database_is_state_unreadable(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not an SQLite database, it was overwritten by something else\n" * 100)
    before = _digest(path)
    with pytest.raises(StateError) as err:
        StateStore.open(path)
    assert err.value.code == "state_unreadable" and "not a database" in err.value.evidence["sqlite_error"]
    assert _digest(path) == before


HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
if sys.argv[2] == "exclusive":
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("BEGIN EXCLUSIVE")
else:
    conn.execute("BEGIN IMMEDIATE")
conn.execute("INSERT INTO task_journal VALUES ('holder', 1, 'hold', 'started', '{}', 0)")
print("held", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


@starts()  # a Python process holding a lock: cheap and private
class OtherProcess:
    """A separate Python process holding the state file's lock until :meth:`release`."""

    def __init__(self, path, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(30)


def test_a_write_while_another_process_holds_the_lock_is_state_locked_and_writes_nothing(tmp_path):
    store = StateStore.open(tmp_path / "state.db", timeout_s=0.5)
    other = OtherProcess(store.path, "immediate")
    try:
        started = time.monotonic()
        with pytest.raises(StateError) as err:
            store.journal("t-1", "clone", StepStatus.started)
        assert time.monotonic() - started >= 0.4  # it waited the busy timeout, then said so
        assert err.value.code == "state_locked" and err.value.retryable is True
        assert err.value.evidence["timeout_s"] == 0.5
        assert store.journal_of("t-1") == []  # reads go on (WAL), and nothing was written
    finally:
        other.release()
    store.journal("t-1", "clone", StepStatus.started)  # free again: the same write goes through
    assert store.unfinished_steps("t-1") == ["clone"]
    store.close()


def test_opening_a_file_another_process_holds_exclusively_is_state_locked(tmp_path):
    StateStore.open(tmp_path / "state.db").close()
    other = OtherProcess(tmp_path / "state.db", "exclusive")
    try:
        with pytest.raises(StateError) as err:
            StateStore.open(tmp_path / "state.db", timeout_s=0.3)
        assert err.value.code == "state_locked" and exit_code_for(err.value.code) == EXIT_ENVIRONMENT
    finally:
        other.release()
    StateStore.open(tmp_path / "state.db").close()
