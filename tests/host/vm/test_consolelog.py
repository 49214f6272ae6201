"""Console logs on disk: the bounded tail, links refused, and the sweep's size and age caps."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from gpuaas_agent.host.vm.consolelog import (
    TAIL_MAX_BYTES,
    ConsoleLogError,
    ensure_log_dir,
    log_path,
    read_tail,
    sweep,
)

A, B = str(uuid.uuid4()), str(uuid.uuid4())


def _write(directory, alloc, slot, data: bytes, *, age_s: float = 0.0, suffix: str = ""):
    path = log_path(directory, alloc, slot).with_name(log_path(directory, alloc, slot).name + suffix)
    path.write_bytes(data)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_the_tail_is_the_last_bytes_and_says_it_is_truncated(tmp_path):
    data = b"".join(b"line %05d\n" % i for i in range(5000))
    _write(tmp_path, A, 3, data)
    tail = read_tail(tmp_path, A, 3, 1000)
    assert tail.data == data[-1000:] and tail.size_bytes == len(data) and tail.truncated
    whole = read_tail(tmp_path, A, 3, 1 << 20)
    assert whole.data == data and not whole.truncated


def test_the_tail_reaches_into_virtlogds_rollover(tmp_path):
    _write(tmp_path, A, 0, b"older boot\n", suffix=".0")
    _write(tmp_path, A, 0, b"this boot\n")
    tail = read_tail(tmp_path, A, 0, 4096)
    assert tail.data == b"older boot\nthis boot\n" and tail.size_bytes == 21


def test_what_one_read_returns_is_bounded(tmp_path):
    _write(tmp_path, A, 0, b"x" * (TAIL_MAX_BYTES + 5000))
    assert len(read_tail(tmp_path, A, 0, 10 * TAIL_MAX_BYTES).data) == TAIL_MAX_BYTES


def test_a_missing_log_and_a_link_are_refused(tmp_path):
    with pytest.raises(ConsoleLogError) as err:
        read_tail(tmp_path, A, 0, 1024)
    assert err.value.code == "console_log_missing"
    secret = tmp_path / "secret"
    secret.write_text("another allocation's console")
    log_path(tmp_path, A, 1).symlink_to(secret)
    with pytest.raises(ConsoleLogError) as err:
        read_tail(tmp_path, A, 1, 1024)
    assert err.value.code == "console_log_unsafe"
    os.mkfifo(log_path(tmp_path, A, 2))
    with pytest.raises(ConsoleLogError) as err:
        read_tail(tmp_path, A, 2, 1024)
    assert err.value.code == "console_log_unsafe"


def test_sweep_deletes_old_logs_of_finished_allocations_only(tmp_path):
    day = 86400.0
    old_a = _write(tmp_path, A, 0, b"a\n", age_s=3 * day)
    old_a_roll = _write(tmp_path, A, 0, b"a0\n", age_s=4 * day, suffix=".0")
    old_b = _write(tmp_path, B, 1, b"b\n", age_s=3 * day)  # B still holds a lease: idle console, not finished
    fresh = _write(tmp_path, str(uuid.uuid4()), 2, b"c\n", age_s=day / 2)
    other = tmp_path / "notes.txt"
    other.write_text("not a console log")
    os.utime(other, (0, 0))
    report = sweep(tmp_path, max_bytes=1 << 20, max_age_s=day, leased={B})
    assert sorted(report.deleted) == sorted([old_a.name, old_a_roll.name])
    assert not old_a.exists() and not old_a_roll.exists()
    assert old_b.exists() and fresh.exists() and other.exists()


def test_sweep_trims_to_the_size_cap_keeping_the_newest_lines(tmp_path):
    data = b"".join(b"boot line %06d\n" % i for i in range(20000))  # ~340 KiB
    path = _write(tmp_path, A, 0, data)
    roll = _write(tmp_path, A, 0, b"y" * 1000, suffix=".0")
    report = sweep(tmp_path, max_bytes=64 << 10, max_age_s=86400, leased=set())
    kept = path.read_bytes()
    assert len(kept) <= 64 << 10 and data.endswith(kept) and kept.startswith(b"boot line ")
    assert report.trimmed == [path.name] and report.deleted == [roll.name] and not roll.exists()
    assert sweep(tmp_path, max_bytes=64 << 10, max_age_s=86400, leased=set()).trimmed == []  # idempotent


def test_the_log_dir_is_made_private(tmp_path):
    directory = tmp_path / "var/log/gpuaas-agent/console"
    ensure_log_dir(directory)
    assert directory.stat().st_mode & 0o777 == 0o700
