"""Parsers for /proc tables discovery needs: mountinfo and swaps (pure functions over text)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\040`` style octal."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    dev: str  # major:minor as the kernel reports it
    root: str
    mountpoint: str
    fstype: str
    source: str


def parse_mountinfo(text: str) -> tuple[list[MountEntry], list[int]]:
    """Entries and the 1-based numbers of lines that could not be parsed.

    Format (proc(5)): ``36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw``;
    the optional fields end at the lone ``-``.
    """
    entries: list[MountEntry] = []
    bad: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            sep = fields.index("-", 6)
            entries.append(
                MountEntry(
                    mount_id=int(fields[0]),
                    dev=fields[2],
                    root=unescape(fields[3]),
                    mountpoint=unescape(fields[4]),
                    fstype=fields[sep + 1],
                    source=unescape(fields[sep + 2]) if len(fields) > sep + 2 else "",
                )
            )
        except (ValueError, IndexError):
            bad.append(number)
    return entries, bad


def parse_swaps(text: str) -> list[str]:
    """Swap device or file paths from /proc/swaps (first line is the header)."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if fields:
            out.append(unescape(fields[0]))
    return out


def parse_udev_data(text: str) -> tuple[dict[str, str], list[str]]:
    """A udev database record (``/run/udev/data/b259:0``): ``E:`` properties and ``S:`` links."""
    props: dict[str, str] = {}
    links: list[str] = []
    for line in text.splitlines():
        if line.startswith("E:") and "=" in line:
            key, _, value = line[2:].partition("=")
            props[key] = value
        elif line.startswith("S:"):
            links.append(line[2:])
    return props, links
