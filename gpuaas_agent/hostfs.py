"""One view of a host's /sys, /dev, /proc, /run and /etc under a root directory.

The same discovery code reads a live host (root ``/``) or a fixture host
(recorded or generated, see ``lab/fixture_hosts.py``). Paths handed to :class:`HostRoot` are always
*host* paths (``/sys/bus/pci/devices``); symlinks met on the way are followed
inside the root, so an absolute link recorded as ``/sys/devices/...`` or a
relative link that climbs with ``..`` can never escape a fixture and read the
machine the tests happen to run on.
"""

from __future__ import annotations

import errno
import os
import posixpath
from collections.abc import Callable
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
    # (resolved directory, name) -> resolved path: each link is read once per HostRoot.
    _steps: dict[tuple[str, str], str] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> HostRoot:
        """Open a root directory, refusing one that does not exist."""
        path = Path(root)
        if not path.is_dir():
            raise HostRootError(
                f"host root {str(path)!r} does not exist or is not a directory",
                code="root_missing",
                evidence={"root": str(path)},
            )
        return cls(root=path.resolve())

    def fresh(self) -> HostRoot:
        """The same root with no cached links: for re-reading a host that changes under us.

        Link resolutions are cached per instance (one discovery reads a host
        that stands still); a guard or a verification right before a write must
        see the links as they are now.
        """
        return HostRoot(root=self.root)

    @property
    def is_live(self) -> bool:
        """True when this is the running host rather than a recording."""
        return str(self.root) == "/"

    # -- path mapping -------------------------------------------------------------

    @staticmethod
    def _check(host_path: str) -> None:
        if "\0" in host_path:
            # A path built from a junk sysfs value; the OS would raise ValueError, readers expect OSError.
            raise OSError(errno.EINVAL, "path contains a NUL byte", host_path.replace("\0", "\\0"))

    def _real_str(self, resolved: str) -> str:
        """On-disk path of an already normalised host path (string concat: this is the hot path)."""
        return resolved if self.is_live else f"{self.root}{resolved}"

    def real(self, host_path: str) -> Path:
        """The on-disk path of ``host_path`` without following any link."""
        self._check(host_path)
        return Path(self._real_str(posixpath.normpath("/" + host_path)))

    def resolve(self, host_path: str, *, on_link: Callable[[str, str], None] | None = None) -> str:
        """Follow every link in ``host_path`` inside the root; returns a host path.

        The final component need not exist (a ``/dev/disk/by-id`` link in a
        recording points at a ``/dev/nvme0n1`` that was never copied). ``..``
        applies to the already-resolved directory, as in the kernel, and stops
        at the root. Raises :class:`SymlinkLoopError` on a loop.

        ``on_link(link, target)`` is called for each link the first time this
        instance follows it (the recorder copies exactly those links).
        """
        self._check(host_path)
        return self._walk("/", host_path, [0], on_link)

    def _walk(self, directory: str, path: str, hops: list[int], on_link: Callable[[str, str], None] | None) -> str:
        current = "/" if path.startswith("/") else directory
        for name in path.split("/"):
            if name in ("", "."):
                continue
            if name == "..":
                current = posixpath.dirname(current)
                continue
            current = self._step(current, name, hops, on_link)
        return current

    def _step(self, directory: str, name: str, hops: list[int], on_link: Callable[[str, str], None] | None) -> str:
        key = (directory, name)
        cached = self._steps.get(key)
        if cached is not None:
            return cached
        candidate = f"{directory}/{name}" if directory != "/" else f"/{name}"
        try:
            target = os.readlink(self._real_str(candidate))
        except OSError:
            result = candidate  # not a link, or not there: a plain component
        else:
            if on_link is not None:
                on_link(candidate, target)
            hops[0] += 1
            if hops[0] > MAX_SYMLINK_HOPS:
                raise SymlinkLoopError(candidate)
            result = self._walk(directory, target, hops, on_link)
        self._steps[key] = result
        return result

    # -- reading ------------------------------------------------------------------

    def read_text(self, host_path: str) -> str:
        """Read a small text file through links; raises OSError when it cannot."""
        with open(self._real_str(self.resolve(host_path)), encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def read_attr(self, host_path: str) -> str:
        """A sysfs attribute: the file's text with surrounding whitespace removed."""
        return self.read_text(host_path).strip()

    def listdir(self, host_path: str) -> list[str]:
        """Sorted entry names of a directory (through links); raises OSError."""
        return sorted(os.listdir(self._real_str(self.resolve(host_path))))

    def readlink(self, host_path: str) -> str:
        """The raw target of one link (its parent directories are resolved first)."""
        parent, name = posixpath.split(posixpath.normpath("/" + host_path))
        return os.readlink(self._real_str(posixpath.join(self.resolve(parent), name)))

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
            return os.path.lexists(self._real_str(self.resolve(host_path)))
        except OSError:  # a loop, or a path no host could have
            return False

    def is_dir(self, host_path: str) -> bool:
        try:
            return os.path.isdir(self._real_str(self.resolve(host_path)))
        except OSError:  # a loop, or a path no host could have
            return False

    def is_link(self, host_path: str) -> bool:
        parent, name = posixpath.split(posixpath.normpath("/" + host_path))
        try:
            return os.path.islink(self._real_str(posixpath.join(self.resolve(parent), name)))
        except OSError:  # a loop, or a path no host could have
            return False
