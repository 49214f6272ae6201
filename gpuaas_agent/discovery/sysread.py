"""Tolerant reads of host files: a missing or broken entry becomes a warning, not a crash.

Real hosts have half-present sysfs trees (a driver that went away, a link left
dangling, ``numa_node`` = -1 on one-socket boards). Discovery must still answer
and say exactly which path it could not use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuaas_agent.contract.topology import Finding
from gpuaas_agent.hostfs import HostRoot


@dataclass
class Findings:
    """Ordered, de-duplicated warnings collected while reading one host."""

    items: list[Finding] = field(default_factory=list)
    _seen: set[tuple[str, str | None, str]] = field(default_factory=set, repr=False)

    def warn(self, code: str, detail: str, path: str | None = None) -> None:
        key = (code, path, detail)
        if key not in self._seen:
            self._seen.add(key)
            self.items.append(Finding(code=code, detail=detail, path=path))


@dataclass
class SysReader:
    """A :class:`HostRoot` plus the warnings its failed reads produce."""

    host: HostRoot
    findings: Findings = field(default_factory=Findings)

    def attr(self, path: str, *, required: bool = False) -> str | None:
        """A sysfs attribute without surrounding whitespace; ``None`` when absent."""
        text = self._read(path, required=required, missing="sysfs_missing", unreadable="sysfs_unreadable")
        return None if text is None else text.strip()

    def text(self, path: str, *, required: bool = False) -> str | None:
        """Whole file contents (for /proc tables); ``None`` when it cannot be read."""
        return self._read(path, required=required, missing="host_file_missing", unreadable="host_file_unreadable")

    def _read(self, path: str, *, required: bool, missing: str, unreadable: str) -> str | None:
        """Absence of a required file and any read failure become warnings naming the path."""
        try:
            return self.host.read_text(path)
        except FileNotFoundError:
            if required:
                self.findings.warn(missing, "expected file is missing", path)
        except OSError as exc:
            self.findings.warn(unreadable, f"cannot read: {exc.strerror or exc}", path)
        return None

    def int_attr(self, path: str, *, required: bool = False, base: int = 10) -> int | None:
        raw = self.attr(path, required=required)
        if raw is None:
            return None
        try:
            return int(raw, base)
        except ValueError:
            self.findings.warn("sysfs_not_numeric", f"expected a number, found {raw[:40]!r}", path)
            return None

    def numa_node(self, path: str) -> int | None:
        """A device's NUMA node; -1 (firmware gave none) or junk is ``None`` with a warning."""
        value = self.int_attr(path, required=True)
        if value is None:
            return None
        if value < 0:
            self.findings.warn("numa_node_unknown", f"numa_node is {value}: firmware reports no NUMA affinity", path)
            return None
        return value

    def listdir(self, path: str, *, required: bool = False) -> list[str]:
        """Sorted names in a directory; empty when it cannot be listed."""
        try:
            return self.host.listdir(path)
        except FileNotFoundError:
            if required:
                self.findings.warn("sysfs_missing", "expected directory is missing", path)
        except NotADirectoryError:
            self.findings.warn("sysfs_not_directory", "expected a directory", path)
        except OSError as exc:
            self.findings.warn("sysfs_unreadable", f"cannot list: {exc.strerror or exc}", path)
        return []

    def resolve(self, path: str) -> str | None:
        """Host path after links, or ``None`` (with a warning) on a link loop."""
        try:
            return self.host.resolve(path)
        except OSError as exc:
            self.findings.warn("symlink_loop", f"cannot resolve: {exc.strerror or exc}", path)
            return None

    def link_name(self, path: str) -> str | None:
        return self.host.link_name(path)
