"""Atomic writes: the mode is exactly what was asked, and a failure leaves no temp file behind."""

import os

import pytest

from gpuaas_agent.atomicfile import write_atomic


def test_mode_is_exact_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "seed.iso", b"public", mode=0o644)
    finally:
        os.umask(old)
    os.umask(0o000)
    try:
        write_atomic(tmp_path / "creds.json", b"secret", mode=0o600)
    finally:
        os.umask(old)
    assert oct((tmp_path / "seed.iso").stat().st_mode & 0o777) == "0o644"
    assert oct((tmp_path / "creds.json").stat().st_mode & 0o777) == "0o600"
    assert (tmp_path / "creds.json").read_bytes() == b"secret"


def test_replace_failure_keeps_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "record"
    target.mkdir()  # os.replace of a file over a directory fails
    with pytest.raises(OSError):
        write_atomic(target, b"new", mode=0o600)
    assert target.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["record"]
