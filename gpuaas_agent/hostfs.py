"""One view of a host's /sys, /dev, /proc, /run and /etc under a root directory.

The same discovery code reads a live host (root ``/``) or a recorded fixture
(root ``fixtures/hosts/NAME``). Paths handed to :class:`HostRoot` are always
*host* paths (``/sys/bus/pci/devices``); symlinks met on the way are followed
inside the root, so an absolute link recorded as ``/sys/devices/...`` or a
relative link that climbs with ``..`` can never escape a fixture and read the
machine the tests happen to run on.
"""

from __future__ import annotations

import errno
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from gpuaas_agent.errors import HostRootError

# The kernel's own limit on symlinks followed in one lookup (MAXSYMLINKS).
MAX_SYMLINK_HOPS = 40


class SymlinkLoopError(OSError):
    """A chain of links that never reaches a real entry."""

    def __init__(self, host_path: str) -> None:
        super().__init__(errno.ELOOP, "too many levels of symbolic links", host_path)
        self.host_path = host_path


@dataclass
class HostRoot:
    """Maps host paths under ``root``; ``root == "/"`` is the live host."""

    root: Path
    _resolved: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> "HostRoot":
        """Open a root directory, refusing one that does not exist."""
        path = Path(root)
        if not path.is_dir():
            raise HostRootError(
                f"host root {str(path)!r} does not exist or is not a directory",
                code="root_missing",
                evidence={"root": str(path)},
            )
        return cls(root=path.resolve())

    @property
    def is_live(self) -> bool:
        """True when this is the running host rather than a recording."""
        return str(self.root) == "/"

    # -- path mapping -------------------------------------------------------------

    def real(self, host_path: str) -> Path:
        """The on-disk path of ``host_path`` without following any link."""
        if "\0" in host_path:
            # A path built from a junk sysfs value; the OS would raise ValueError, readers expect OSError.
            raise OSError(errno.EINVAL, "path contains a NUL byte", host_path.replace("\0", "\\0"))
        rel = posixpath.normpath("/" + host_path).lstrip("/")
        return self.root / rel if rel else self.root

    def resolve(self, host_path: str) -> str:
        """Follow every link in ``host_path`` inside the root; returns a host path.

        The final component need not exist (a ``/dev/disk/by-id`` link in a
        recording points at a ``/dev/nvme0n1`` that was never copied). Raises
        :class:`SymlinkLoopError` on a loop.
        """
        if "\0" in host_path:
            raise OSError(errno.EINVAL, "path contains a NUL byte", host_path.replace("\0", "\\0"))
        norm = posixpath.normpath("/" + host_path)
        cached = self._resolved.get(norm)
        if cached is not None:
            return cached
        parts = [p for p in norm.split("/") if p]
        done: list[str] = []
        hops = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if done:
                    done.pop()
                continue
            candidate = "/" + "/".join([*done, name])
            try:
                target = os.readlink(self.real(candidate))
            except OSError:
                # Not a link, or not there: keep it as a plain component.
                done.append(name)
                continue
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise SymlinkLoopError(norm)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
        resolved = "/" + "/".join(done)
        self._resolved[norm] = resolved
        return resolved

    # -- reading ------------------------------------------------------------------

    def read_text(self, host_path: str) -> str:
        """Read a small text file through links; raises OSError when it cannot."""
        with open(self.real(self.resolve(host_path)), encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def read_attr(self, host_path: str) -> str:
        """A sysfs attribute: the file's text with surrounding whitespace removed."""
        return self.read_text(host_path).strip()

    def listdir(self, host_path: str) -> list[str]:
        """Sorted entry names of a directory (through links); raises OSError."""
        return sorted(os.listdir(self.real(self.resolve(host_path))))

    def readlink(self, host_path: str) -> str:
        """The raw target of one link (its parent directories are resolved first)."""
        parent, name = posixpath.split(posixpath.normpath("/" + host_path))
        return os.readlink(self.real(posixpath.join(self.resolve(parent), name)))

    def link_name(self, host_path: str) -> str | None:
        """Basename of what a link points at, or None when it is not a link.

        sysfs expresses relations as links (``driver``, ``iommu_group``,
        ``physfn``); their meaning is the name at the end.
        """
        try:
            return posixpath.basename(self.readlink(host_path).rstrip("/"))
        except OSError:
            return None

    def exists(self, host_path: str) -> bool:
        """Whether the entry exists (links followed inside the root)."""
        try:
            return os.path.lexists(self.real(self.resolve(host_path)))
        except OSError:  # a loop, or a path no host could have
            return False

    def is_dir(self, host_path: str) -> bool:
        try:
            return self.real(self.resolve(host_path)).is_dir()
        except OSError:  # a loop, or a path no host could have
            return False

    def is_link(self, host_path: str) -> bool:
        parent, name = posixpath.split(posixpath.normpath("/" + host_path))
        try:
            return os.path.islink(self.real(posixpath.join(self.resolve(parent), name)))
        except OSError:  # a loop, or a path no host could have
            return False
