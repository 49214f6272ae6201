"""A real libvirt daemon for tests: ``virtlogd`` and ``libvirtd`` started by hand, in the foreground.

Import the fixture into a test module (``from tests.support.libvirtd_fixture import libvirtd``), or use
:func:`running_libvirtd` directly to pass extra environment (``OVS_RUNDIR`` of a private
ovsdb, see ``tests/support/ovsdb_fixture.py``: libvirtd's ``ovs-vsctl`` calls reach that db only
through its environment).

Why by hand: CI machines have no systemd as PID 1 and apt's ``policy-rc.d`` keeps the
packaged services from starting; PID 1 reaps nothing, so both daemons run under
``Popen`` without ``-d`` and are stopped by their PID. ``qemu:///system`` has one socket
per machine (``/run/libvirt/libvirt-sock``): a libvirtd that this fixture did not start
(another test session, an engineer's) is never fought over; the test fails and says so.
Sessions that use this fixture queue on a host-wide lock instead.

While the daemons run, ``/dev/kvm`` gets the owner udev gives it on a normal host
(root:kvm 0660; CI has no udev, so it is root:root 0600) and gets its old mode back at
the end: otherwise libvirtd re-probes QEMU on every capabilities lookup (see
:func:`_kvm_like_udev`) and one ``define`` takes over a minute. (Each chmod changes the
node's ctime, which libvirt also checks: expect one ~4 s re-probe per daemon start.)
"""

from __future__ import annotations

import grp
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import libvirt
import pytest

from tests.support.daemons import host_lock, stop_pid, wait_for_daemons
from tests.support.tiers import starts

URI = "qemu:///system"
RUN_DIR = Path("/run/libvirt")
LIBVIRT_SOCK = RUN_DIR / "libvirt-sock"
VIRTLOGD_SOCK = RUN_DIR / "virtlogd-sock"
HOST_LOCK = Path("/tmp/gpuaas-test-libvirtd.lock")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
LOCK_TIMEOUT_S = 600.0
DAEMONS = ("libvirtd", "virtlogd", "virtqemud", "virtlockd")


class ForeignLibvirtdError(RuntimeError):
    """A libvirt daemon this fixture did not start is running: refuse rather than share or kill it."""


@dataclass
class LibvirtDaemon:
    """The running pair; ``env`` is what libvirtd (and the qemu/ovs-vsctl it spawns) sees."""

    workdir: Path
    env: dict[str, str]
    uri: str = URI
    startup_s: float = 0.0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.procs["libvirtd"].pid

    def connect(self) -> libvirt.virConnect:
        """A new connection; the caller closes it."""
        return libvirt.open(self.uri)

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for name in ("virtlogd", "libvirtd"):
            path = self.workdir / f"{name}.log"
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {name}.log\n" + "\n".join(text))
        return "\n".join(out)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())


def running_daemon_pids(names: tuple[str, ...] = DAEMONS) -> dict[int, str]:
    """PIDs of libvirt daemons on this machine (by ``/proc/<pid>/comm``), whoever started them."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        if comm in names:
            found[int(entry.name)] = comm
    return found


def _socket_answers(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _refuse_foreign() -> None:
    foreign = running_daemon_pids()
    if foreign or _socket_answers(LIBVIRT_SOCK):
        raise ForeignLibvirtdError(
            f"a libvirt daemon not started by this test is already running ({foreign or LIBVIRT_SOCK}); "
            "another test session or a service owns qemu:///system on this machine. Stop it (by its PID) "
            "and run again: this fixture will not share or kill it."
        )


def _wait_for(predicate: Callable[[], bool], what: str, daemon: LibvirtDaemon, timeout: float) -> None:
    wait_for_daemons(predicate, what, daemon.procs, daemon.log_tail, timeout, poll_s=0.02)


def _stop(proc: subprocess.Popen | None) -> None:
    stop_pid(proc, STOP_TIMEOUT_S)


def _host_lock(timeout: float = LOCK_TIMEOUT_S):
    """Sessions using this fixture queue here, so two of them never race for the one system socket."""
    return host_lock(HOST_LOCK, timeout)


@starts("libvirtd")
def _popen(daemon: LibvirtDaemon, name: str, argv: list[str]) -> None:
    # Output to a file, never a pipe nobody reads (a full pipe stalls the daemon).
    with open(daemon.workdir / f"{name}.out", "wb") as out:
        daemon.procs[name] = subprocess.Popen(
            argv, env=daemon.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=daemon.workdir
        )


def _kvm_like_udev() -> Callable[[], None]:
    """Give ``/dev/kvm`` the owner udev gives it on a normal host (root:kvm 0660); returns the undo.

    Without udev (CI) it is root:root 0600. libvirtd probes QEMU as root (KVM usable) but
    checks the cached probe as the qemu user (KVM not usable), so every lookup of the
    capabilities re-probes QEMU: ~4 s each, about 80 s for one define. The qemu user's
    group is ``kvm`` on Debian and Ubuntu.
    """
    kvm = Path("/dev/kvm")
    try:
        group = grp.getgrnam("kvm").gr_gid
        before = kvm.stat()
    except (KeyError, FileNotFoundError):
        return lambda: None  # no kvm group or no /dev/kvm: nothing for libvirt to disagree about
    if before.st_gid == group and before.st_mode & 0o060 == 0o060:
        return lambda: None
    os.chown(kvm, before.st_uid, group)
    os.chmod(kvm, (before.st_mode & 0o7777) | 0o060)

    def undo() -> None:
        os.chown(kvm, before.st_uid, before.st_gid)
        os.chmod(kvm, before.st_mode & 0o7777)

    return undo


def _libvirtd_answers() -> bool:
    if not LIBVIRT_SOCK.exists():
        return False
    try:
        conn = libvirt.open(URI)
    except libvirt.libvirtError:
        return False
    try:
        return conn.getLibVersion() > 0
    finally:
        conn.close()


@contextmanager
@starts("libvirtd")
def running_libvirtd(workdir: Path | None = None, *, extra_env: Mapping[str, str] | None = None) -> Iterator[LibvirtDaemon]:
    """Start virtlogd then libvirtd, yield once ``qemu:///system`` answers, stop both by PID afterwards.

    ``extra_env``: e.g. ``{"OVS_RUNDIR": ...}`` so the ``ovs-vsctl`` libvirtd runs for a
    ``<virtualport type='openvswitch'>`` reaches a private ovsdb.
    """
    if os.geteuid() != 0:
        pytest.fail("the real libvirt lane needs root (qemu:///system, /run/libvirt); run it as root", pytrace=False)
    for tool in ("libvirtd", "virtlogd", "qemu-system-x86_64"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: apt install libvirt-daemon-system qemu-system-x86 ovmf", pytrace=False)
    own_tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="libvirtd-", dir="/tmp")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(extra_env or {})}
    # Daemon logs into the test's dir (level 3 = warnings and errors) so a failure shows why.
    env.setdefault("LIBVIRT_LOG_OUTPUTS", f"3:file:{workdir}/libvirtd.log")
    daemon = LibvirtDaemon(workdir=workdir, env=env)
    with _host_lock():
        try:
            _refuse_foreign()
        except ForeignLibvirtdError as exc:
            pytest.fail(str(exc), pytrace=False)
        started = time.monotonic()
        undo_kvm = _kvm_like_udev()
        try:
            virtlogd_env = {**env, "LIBVIRT_LOG_OUTPUTS": f"3:file:{workdir}/virtlogd.log"}
            with open(workdir / "virtlogd.out", "wb") as out:
                daemon.procs["virtlogd"] = subprocess.Popen(
                    ["virtlogd"], env=virtlogd_env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    cwd=workdir,
                )
            _wait_for(lambda: _socket_answers(VIRTLOGD_SOCK), f"virtlogd's socket {VIRTLOGD_SOCK}", daemon, START_TIMEOUT_S)
            _popen(daemon, "libvirtd", ["libvirtd"])
            _wait_for(_libvirtd_answers, f"libvirtd answering on {URI}", daemon, START_TIMEOUT_S)
            daemon.startup_s = time.monotonic() - started
            yield daemon
        finally:
            _stop(daemon.procs.get("libvirtd"))
            _stop(daemon.procs.get("virtlogd"))
            undo_kvm()
            if own_tmp:
                shutil.rmtree(workdir, ignore_errors=True)


@starts("libvirtd")
def restart_libvirtd(daemon: LibvirtDaemon) -> None:
    """Stop libvirtd by PID and start it again (virtlogd stays); running domains survive it."""
    _stop(daemon.procs.get("libvirtd"))
    _popen(daemon, "libvirtd", ["libvirtd"])
    _wait_for(_libvirtd_answers, f"the restarted libvirtd answering on {URI}", daemon, START_TIMEOUT_S)


@pytest.fixture
@starts("libvirtd")
def libvirtd(tmp_path: Path) -> Iterator[LibvirtDaemon]:
    """virtlogd + libvirtd on ``qemu:///system``; fails without root or when a foreign libvirtd runs."""
    with running_libvirtd(tmp_path / "libvirtd") as daemon:
        yield daemon
