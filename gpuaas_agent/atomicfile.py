"""Atomic file writes: a reader sees the old file or the new one, never half of one, even after power loss.

Used for every record the agent keeps on disk (credentials, cache markers,
seed ISOs). A dependency-free leaf: every room may import it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int, durable: bool = True) -> None:
    """Temp file beside ``path`` (created 0600), chmod ``mode``, fsync, rename over, fsync the directory.

    ``mode`` is set with fchmod, so the umask cannot loosen or tighten it; the
    temp file is removed on any failure. ``durable=False`` skips both fsyncs: still atomic for
    readers, not across a power loss; for files rewritten every few seconds whose loss costs
    nothing (the daemon status file, the metrics textfile), where two fsyncs a write were most
    of the idle daemon's CPU and a journal commit each.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
