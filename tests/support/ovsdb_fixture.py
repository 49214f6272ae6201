"""A real Open vSwitch for tests: ovsdb-server and ovs-vswitchd on private sockets, one netdev bridge.

Import the fixture into a test module (``from tests.support.ovsdb_fixture import ovs_switch``).

- ``ovsdb-tool create`` a fresh db from the packaged schema, ``ovsdb-server`` in the
  foreground on ``punix:<rundir>/db.sock`` (PID 1 reaps nothing here: no daemons that
  detach), ``ovs-vswitchd`` with ``OVS_RUNDIR=<rundir>``; so ``ovs-vsctl`` and libvirtd
  started with :attr:`OvsSwitch.env` reach this db and no other.
- The bridge has ``datapath_type=netdev`` (userspace datapath: no kernel module) and a
  random name that fits 15 bytes.
- ``ovs_switch`` runs vswitchd inside a private network namespace: the userspace
  datapath opens a tap called ``ovs-netdev``, and two vswitchds in one namespace fight
  over it (EBUSY, the second bridge never comes up). Veths for it go into
  :attr:`OvsSwitch.netns`. ``ovs_switch_root_netns`` runs it in the root namespace,
  where libvirt creates its taps; those instances take a host-wide lock so parallel
  tests queue instead of colliding.
- Teardown by PID: ``ovs-appctl exit --cleanup`` (vswitchd removes its taps), then
  SIGTERM/SIGKILL if needed, then the namespace and the files.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.daemons import host_lock, stop_pid, wait_for_daemons
from tests.support.tiers import starts

SCHEMA = Path("/usr/share/openvswitch/vswitch.ovsschema")
ROOT_NETNS_LOCK = Path("/tmp/gpuaas-test-ovs-root-netns.lock")
START_TIMEOUT_S = 20.0
CMD_TIMEOUT_S = 20.0


@dataclass
class OvsSwitch:
    """One private ovsdb-server + ovs-vswitchd and their netdev bridge."""

    rundir: Path
    bridge: str
    netns: str | None  # vswitchd's network namespace; None = the root namespace
    startup_s: float = 0.0
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _veths: list[str] = field(default_factory=list)
    _vswitchd_argv: list[str] = field(default_factory=list)

    @property
    def remote(self) -> str:
        return f"unix:{self.rundir}/db.sock"

    @property
    def env(self) -> dict[str, str]:
        """Environment that points ovs-vsctl / ovs-appctl / libvirtd at this instance."""
        d = str(self.rundir)
        return {**os.environ, "OVS_RUNDIR": d, "OVS_DBDIR": d, "OVS_LOGDIR": d, "OVS_SYSCONFDIR": d}

    def vsctl(self, *args: str, check: bool = True) -> str:
        """The real ``ovs-vsctl`` against this db (tests use it to act like libvirt or an operator)."""
        return _run(["ovs-vsctl", f"--db={self.remote}", "--timeout=10", *args], env=self.env, check=check)

    def ip(self, *args: str) -> str:
        """``ip`` inside vswitchd's namespace."""
        prefix = ["ip", "-n", self.netns] if self.netns else ["ip"]
        return _run([*prefix, *args])

    def veth(self, name: str, peer: str) -> None:
        """A veth pair in vswitchd's namespace, both ends up (removed with the namespace or by name)."""
        self.ip("link", "add", name, "type", "veth", "peer", "name", peer)
        self._veths.append(name)
        self.ip("link", "set", name, "up")
        self.ip("link", "set", peer, "up")

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for name in ("ovsdb-server", "ovs-vswitchd"):
            path = self.rundir / f"{name}.log"
            if path.exists():
                out.append(f"--- {name}.log\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def kill_ovsdb_server(self) -> None:
        """Stop ovsdb-server now (tests of an unreachable db); teardown copes with it being gone."""
        _stop(self._procs.get("ovsdb-server"), signal.SIGTERM)

    def restart_vswitchd(self) -> None:
        """SIGKILL ovs-vswitchd (a crash: no cleanup) and start it again on the same db; returns once it serves OpenFlow.

        The bridge, its ports and their ofports come back from ovsdb; OpenFlow rules are not kept there and are gone.
        """
        _stop(self._procs.get("ovs-vswitchd"), signal.SIGKILL)
        _daemon(self, "ovs-vswitchd", self._vswitchd_argv)

        def serving() -> bool:
            out = subprocess.run(["ovs-ofctl", "show", f"unix:{self.rundir}/{self.bridge}.mgmt"], env=self.env,
                                 capture_output=True, timeout=CMD_TIMEOUT_S)
            return out.returncode == 0

        _wait_for(serving, "the restarted ovs-vswitchd to serve OpenFlow", self)
        self.vsctl("--timeout=20", "wait-until", "Interface", self.bridge, "ofport=65534")

    def kill_vswitchd(self) -> None:
        """Stop ovs-vswitchd now (tests of a change nobody applies)."""
        _stop(self._procs.get("ovs-vswitchd"), signal.SIGTERM)


def _run(argv: list[str], *, env: dict[str, str] | None = None, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> str:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def _wait_for(predicate: Callable[[], bool], what: str, sw: OvsSwitch, timeout: float = START_TIMEOUT_S) -> None:
    wait_for_daemons(predicate, what, sw._procs, sw.log_tail, timeout, poll_s=0.01)


def _stop(proc: subprocess.Popen | None, sig: int) -> None:
    stop_pid(proc, 10, sig)


@starts("ovs")
def _daemon(sw: OvsSwitch, name: str, argv: list[str]) -> None:
    # Output to a file, not a pipe nobody reads (a full pipe would stall the daemon).
    out = open(sw.rundir / f"{name}.out", "wb")
    try:
        sw._procs[name] = subprocess.Popen(argv, env=sw.env, stdout=out, stderr=subprocess.STDOUT, cwd=sw.rundir)
    finally:
        out.close()


def root_netns_lock(timeout: float = 300.0):
    return host_lock(ROOT_NETNS_LOCK, timeout, poll_s=0.05)


@contextmanager
@starts("ovs")
def running_ovs(*, root_netns: bool = False) -> Iterator[OvsSwitch]:
    """Start the pair, yield it, and take everything down again even when the test failed."""
    if os.geteuid() != 0:
        pytest.fail("OVS tests need root (network namespaces, taps, veths); run them as root", pytrace=False)
    for tool in ("ovsdb-tool", "ovsdb-server", "ovs-vswitchd", "ovs-vsctl", "ovs-appctl", "ip"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: apt install openvswitch-switch iproute2", pytrace=False)
    tag = uuid.uuid4().hex[:8]
    # Short path under /tmp: unix socket paths are limited to 108 bytes.
    rundir = Path(tempfile.mkdtemp(prefix="ovs-", dir="/tmp"))
    netns = None if root_netns else f"gpuaas-ovs-{tag}"
    sw = OvsSwitch(rundir=rundir, bridge=f"tbr{tag}", netns=netns)
    lock = root_netns_lock() if root_netns else _nullcontext()
    with lock:
        started = time.monotonic()
        try:
            if netns:
                _run(["ip", "netns", "add", netns])
                _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            db = rundir / "conf.db"
            _run(["ovsdb-tool", "create", str(db), str(SCHEMA)])
            _daemon(sw, "ovsdb-server", [
                "ovsdb-server", str(db), f"--remote=punix:{rundir}/db.sock", "--no-chdir",
                f"--pidfile={rundir}/ovsdb-server.pid", f"--unixctl={rundir}/ovsdb-server.ctl",
                f"--log-file={rundir}/ovsdb-server.log",
            ])
            _wait_for(lambda: (rundir / "db.sock").exists(), "ovsdb-server's socket", sw)
            sw.vsctl("--no-wait", "init")
            vswitchd = [
                "ovs-vswitchd", sw.remote, "--no-chdir", f"--pidfile={rundir}/ovs-vswitchd.pid",
                f"--unixctl={rundir}/ovs-vswitchd.ctl", f"--log-file={rundir}/ovs-vswitchd.log",
            ]
            # `ip netns exec` execs the daemon: the Popen PID is vswitchd's own.
            sw._vswitchd_argv = (["ip", "netns", "exec", netns] if netns else []) + vswitchd
            _daemon(sw, "ovs-vswitchd", sw._vswitchd_argv)
            # Without --no-wait, ovs-vsctl returns once vswitchd has applied the change.
            sw.vsctl("add-br", sw.bridge, "--", "set", "Bridge", sw.bridge, "datapath_type=netdev")
            ofport = sw.vsctl("get", "Interface", sw.bridge, "ofport").strip()
            if ofport != "65534":  # OFPP_LOCAL: the bridge's datapath really opened
                raise RuntimeError(f"bridge {sw.bridge} did not come up (ofport {ofport})\n{sw.log_tail()}")
            sw.startup_s = time.monotonic() - started
            yield sw
        finally:
            _teardown(sw)


def _teardown(sw: OvsSwitch) -> None:
    errors = []
    vswitchd = sw._procs.get("ovs-vswitchd")
    if vswitchd is not None and vswitchd.poll() is None:
        # exit --cleanup deletes the bridge taps vswitchd made (netdev taps are persistent).
        _run(["ovs-appctl", "-t", str(sw.rundir / "ovs-vswitchd.ctl"), "exit", "--cleanup"], env=sw.env, check=False)
        try:
            vswitchd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _stop(vswitchd, signal.SIGTERM)
    _stop(sw._procs.get("ovsdb-server"), signal.SIGTERM)
    if sw.netns:
        out = subprocess.run(["ip", "netns", "del", sw.netns], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
        if out.returncode != 0 and "No such file" not in out.stderr:
            errors.append(f"ip netns del {sw.netns}: {out.stderr.strip()}")
    else:
        # The userspace datapath's own tap outlives vswitchd even with --cleanup; we hold the lock, it is ours.
        for tap in ("ovs-netdev", sw.bridge, *sw._veths):
            if Path(f"/sys/class/net/{tap}").exists():
                subprocess.run(["ip", "link", "del", tap], capture_output=True, timeout=CMD_TIMEOUT_S)
    shutil.rmtree(sw.rundir, ignore_errors=True)
    if errors:
        raise RuntimeError("OVS teardown left things behind: " + "; ".join(errors))


@contextmanager
def _nullcontext() -> Iterator[None]:
    yield


@pytest.fixture
@starts("ovs")
def ovs_switch() -> Iterator[OvsSwitch]:
    """ovsdb-server + ovs-vswitchd (in a private netns) with a netdev bridge; fails without root."""
    with running_ovs() as sw:
        yield sw


@pytest.fixture
@starts("ovs")
def ovs_switch_root_netns() -> Iterator[OvsSwitch]:
    """Same, with vswitchd in the root netns (where libvirt makes taps); serialised host-wide."""
    with running_ovs(root_netns=True) as sw:
        yield sw
