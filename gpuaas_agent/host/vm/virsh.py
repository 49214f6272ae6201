"""Read-only libvirt questions answered by a short-lived ``virsh -r`` child, so an idle host never loads libvirt-python.

libvirt-python (``libvirtmod`` and the ~20 libraries ``libvirt.so.0`` links) is ~11 MiB of the daemon's RSS
(docs/performance.md, "Idle footprint"). A slice host with no slot leased and no domain asks libvirt only two
things: does libvirtd answer (the health round's ``libvirtd`` check) and does it hold any domain (the timer
reconcile's listing). Both are answered here by one ``virsh`` run each (~0.01 CPU-s; ``libvirt-clients`` is in
the package's ``Recommends``), with the same evidence: libvirt's own version number and error message. Once
a domain exists, the drivers' in-process connection answers (``libvirt_lifecycle.py``): that host uses libvirt.

``None`` from a reader means virsh could not answer (not installed, or it failed for a reason that is not
libvirt's answer): the caller then asks in-process, which gives the answer or the typed error it always gave.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuaas_agent.errors import HostError
from gpuaas_agent.host.run import Completed, run

VIRSH = "virsh"
# virsh's banner for a connection it could not open; the line after it is libvirt's own message.
_NO_CONNECTION = "failed to connect to the hypervisor"
_DAEMON_VERSION = re.compile(r"^Running against daemon:\s*(\d+)\.(\d+)\.(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class VersionAnswer:
    """What ``virsh -r -c URI version --daemon`` said: the version ``virConnectGetLibVersion`` gives
    (``major * 1,000,000 + minor * 1,000 + micro``), or why there is none."""

    lib_version: int | None = None
    connected: bool = True
    error: str | None = None  # libvirt's message (virsh's last ``error:`` line)


def _last_error(done: Completed) -> str:
    lines = [line.removeprefix("error:").strip() for line in done.stderr.decode("utf-8", "replace").splitlines()
             if line.startswith("error:")]
    return lines[-1] if lines else f"virsh exited with {done.returncode}"


def _refused_connection(done: Completed) -> bool:
    return _NO_CONNECTION in done.stderr.decode("utf-8", "replace")


def version_answer(done: Completed) -> VersionAnswer:
    """Parse a finished ``virsh version --daemon`` (pure)."""
    if done.returncode != 0:
        return VersionAnswer(connected=not _refused_connection(done), error=_last_error(done))
    found = _DAEMON_VERSION.search(done.stdout.decode("utf-8", "replace"))
    if found is None:
        return VersionAnswer(error="virsh version printed no daemon version")
    major, minor, micro = (int(part) for part in found.groups())
    return VersionAnswer(lib_version=major * 1_000_000 + minor * 1_000 + micro)


async def read_version(uri: str, *, timeout: float) -> VersionAnswer | None:
    """libvirtd's version over a read-only connection to ``uri``. On the loop, not in a check thread: a cancel (the
    daemon stopping mid-round) kills the child, which must not outlive the agent (a check thread is abandoned at
    exit, and its child with it). None: no virsh on this host. A run past ``timeout`` raises ``HostError``
    (``command_timeout``)."""
    try:
        done = await run([VIRSH, "-r", "-c", uri, "version", "--daemon"], timeout=timeout, check=False)
    except HostError as exc:
        if exc.code == "command_not_found":
            return None
        raise
    return version_answer(done)


async def domain_names(uri: str, *, timeout: float) -> list[str] | None:
    """The names of every domain libvirt at ``uri`` holds, running or not (``virsh -r list --all --name``).
    None: virsh could not answer (not installed, or it failed): ask in-process. A run past ``timeout`` raises
    ``HostError`` (``command_timeout``): libvirtd does not answer, whoever asks."""
    try:
        done = await run([VIRSH, "-r", "-c", uri, "list", "--all", "--name"], timeout=timeout, check=False)
    except HostError as exc:
        if exc.code == "command_not_found":
            return None
        raise
    if done.returncode != 0:
        return None
    return [name for name in (line.strip() for line in done.stdout.decode("utf-8", "replace").splitlines()) if name]
