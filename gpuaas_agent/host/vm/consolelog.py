"""Each slice's serial console log: its path, its bounded tail, and the sweep that caps its size and age.

libvirt writes the log (the domain's ``<serial><log file=... append='on'/>``, through virtlogd),
so it outlives the VM: after a guest panicked or the domain was destroyed, the last thing it
printed is still there. One file per allocation and primary slot,
``<console_log_dir>/<allocation_id>-slot<N>.log`` (virtlogd rolls it over to ``.log.0``,
``.log.1``... at its own ``max_size``). The name is built from a validated UUID and an int,
never from a path on the wire, and every open is ``O_NOFOLLOW`` of a regular file: a task can
read only the log its own allocation's name leads to.

The sweep bounds the directory: a log (with its rollovers) larger than ``max_bytes`` keeps its
last ``max_bytes``; a log not written for ``max_age_s`` is deleted, unless its allocation still
holds a lease here (an idle console is not a finished allocation).
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuaas_agent.contract.types import UUID
from gpuaas_agent.errors import AgentError

LOG_NAME_RE = re.compile(rf"^(?P<alloc>{UUID})-slot(?P<slot>[0-9]{{1,3}})\.log(?:\.(?P<roll>[0-9]{{1,3}}))?$")
TAIL_MAX_BYTES = 1 << 20  # what one task may return: the wire carries results, not archives


class ConsoleLogError(AgentError):
    """A console log that cannot be read for this allocation.

    Codes: ``console_log_missing`` (none for this allocation and slot), ``console_log_unsafe``
    (not a regular file, a link), ``console_log_unreadable``.
    """

    default_code = "console_log_unreadable"


def ensure_log_dir(directory: Path) -> None:
    """The log directory, made 0700 root when missing (tenants' consoles may print secrets); virtlogd writes as root."""
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)


def log_name(allocation_id: str, slot_index: int) -> str:
    return f"{allocation_id.lower()}-slot{slot_index}.log"


def log_path(directory: Path, allocation_id: str, slot_index: int) -> Path:
    return Path(directory) / log_name(allocation_id, slot_index)


@dataclass(frozen=True)
class ConsoleTail:
    path: Path
    size_bytes: int  # of the current file and its rollovers together
    data: bytes  # the last bytes, at most what was asked
    modified: float  # the last write (epoch seconds)

    @property
    def truncated(self) -> bool:
        return len(self.data) < self.size_bytes


def _open_regular(path: Path) -> int | None:
    """A read descriptor of ``path`` when it is a regular file (links refused); None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        code = "console_log_unsafe" if exc.errno == getattr(os, "ELOOP", 40) else "console_log_unreadable"
        raise ConsoleLogError(f"console log {path}: {exc.strerror}", code=code, evidence={"path": str(path)}) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConsoleLogError(f"console log {path} is not a regular file", code="console_log_unsafe",
                              evidence={"path": str(path)})
    return fd


def _tail_of(fd: int, want: int) -> tuple[bytes, int, float]:
    st = os.fstat(fd)
    start = max(0, st.st_size - want)
    chunks, pos = [], start
    while pos < st.st_size:
        chunk = os.pread(fd, min(1 << 16, st.st_size - pos), pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks), st.st_size, st.st_mtime


def read_tail(directory: Path, allocation_id: str, slot_index: int, max_bytes: int) -> ConsoleTail:
    """The last ``max_bytes`` (at most :data:`TAIL_MAX_BYTES`) of the slot's console, rollover ``.0`` included."""
    want = max(0, min(max_bytes, TAIL_MAX_BYTES))
    path = log_path(directory, allocation_id, slot_index)
    fd = _open_regular(path)
    if fd is None:
        raise ConsoleLogError(f"no console log for allocation {allocation_id} slot {slot_index} on this host",
                              code="console_log_missing", evidence={"path": str(path)})
    try:
        data, size, modified = _tail_of(fd, want)
    finally:
        os.close(fd)
    older = Path(f"{path}.0")
    fd0 = _open_regular(older)
    if fd0 is not None:
        try:
            before, size0, _ = _tail_of(fd0, want - len(data))
        finally:
            os.close(fd0)
        data, size = before + data, size + size0
    return ConsoleTail(path=path, size_bytes=size, data=data, modified=modified)


@dataclass
class SweepReport:
    deleted: list[str] = field(default_factory=list)
    trimmed: list[str] = field(default_factory=list)
    kept: int = 0


def _trim(path: Path, keep_bytes: int) -> None:
    """Keep the last ``keep_bytes`` of ``path``, from a line start where one is near (in place, same inode)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        data, _, _ = _tail_of(fd, keep_bytes)
        cut = data.find(b"\n")
        if 0 <= cut < len(data) - 1 and cut < 4096:
            data = data[cut + 1:]
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def sweep(directory: Path, *, max_bytes: int, max_age_s: float, leased: set[str],
          now: float | None = None) -> SweepReport:
    """Apply the caps to every console log in ``directory`` (blocking: run it off the event loop).

    ``leased``: allocation ids holding a lease on this host now; their logs are never deleted for
    age (only trimmed). Files whose names are not console logs are left alone.
    """
    now = time.time() if now is None else now
    report = SweepReport()
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return report
    groups: dict[tuple[str, str], list[tuple[int, Path, os.stat_result]]] = {}
    for name in names:
        match = LOG_NAME_RE.match(name)
        path = Path(directory) / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if match is None or not stat.S_ISREG(st.st_mode):
            continue
        roll = -1 if match["roll"] is None else int(match["roll"])
        groups.setdefault((match["alloc"], match["slot"]), []).append((roll, path, st))
    for (alloc, _slot), files in groups.items():
        files.sort(key=lambda f: f[0])  # current first, then .0, .1 (older)
        newest = max(st.st_mtime for _, _, st in files)
        if alloc not in leased and now - newest > max_age_s:
            for _, path, _ in files:
                path.unlink(missing_ok=True)
                report.deleted.append(path.name)
            continue
        budget = max_bytes
        for _roll, path, st in files:
            if budget <= 0:
                path.unlink(missing_ok=True)
                report.deleted.append(path.name)
            elif st.st_size > budget:
                _trim(path, budget)
                report.trimmed.append(path.name)
                budget = 0
            else:
                budget -= st.st_size
                report.kept += 1
    return report
