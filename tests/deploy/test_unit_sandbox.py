"""The hardened units: exposure under the issue's bounds, and the agent's capability set is exactly what slice work uses.

``systemd-analyze security --offline=yes`` rates each unit file (no systemd as PID 1
needed). Systemd is not PID 1 on the CI machine (``systemd-run`` cannot start a transient
unit there), so the sandbox is reproduced with the kernel's own mechanisms: the unit's
``CapabilityBoundingSet=`` and ``NoNewPrivileges=`` read from the unit file and applied by
``setpriv`` to a real process, which performs the privileged operations of a provision and
a release on real objects (a loop block device, a process of another user, a network
namespace's nftables). Every capability in the set is then dropped one at a time: the
operation that capability is there for must fail with EPERM, so none of them is spare.
The unit's other properties (ProtectSystem=, DeviceAllow=, SystemCallFilter=, ...) are applied
by a real systemd manager in tests/deploy/test_unit_provision.py, which runs the lab's provision
and release under the installed unit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.deploy.units import AGENT_UNIT, BASELINE_UNIT, agent_capabilities, directive

EXPOSURE_RE = re.compile(r"Overall exposure level for \S+: (\d+\.\d+)")


def _exposure(unit: Path) -> float:
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=120)
    match = EXPOSURE_RE.search(done.stdout + done.stderr)
    assert match, done.stdout + done.stderr
    return float(match.group(1))


@pytest.mark.parametrize(("unit", "bound"), [(AGENT_UNIT, 4.0), (BASELINE_UNIT, 5.0)], ids=["agent", "baseline"])
def test_systemd_analyze_security_exposure_is_within_the_bound(unit, bound):
    assert _exposure(unit) <= bound


def test_every_capability_of_the_agent_is_documented_with_the_step_that_needs_it():
    readme = (REPO / "systemd" / "README.md").read_text()
    for cap in agent_capabilities():
        assert re.search(rf"^\| `{cap}` \| .+ \| .+ \|$", readme, re.MULTILINE), f"{cap} has no row in systemd/README.md"
    assert directive(AGENT_UNIT, "NoNewPrivileges") == ["yes"]


# What the sandboxed process does: one privileged operation per capability, each reported by name.
OPERATIONS = r"""
import fcntl, json, os, signal, subprocess, sys
loop, foreign, victim = sys.argv[1:4]
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = "ok"
    except PermissionError as exc:
        out[name] = f"EPERM {exc}"
    except subprocess.CalledProcessError as exc:
        out[name] = "EPERM " + (exc.stderr or b"").decode(errors="replace").strip()[-200:]
BLKRRPART = 0x125F
def reread():  # the partition table re-read after a clone (partx/sfdisk do the same ioctl)
    fd = os.open(loop, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, BLKRRPART)
    finally:
        os.close(fd)
attempt("reread_partitions", reread)
def nft():  # the slice guard table (host/nftguard.py); this process runs in the test's network namespace
    subprocess.run(["nft", "add", "table", "inet", "gpuaas_sandbox"], check=True, capture_output=True)
attempt("nft_guard", nft)
def open_foreign():  # a node libvirt chowned to the QEMU user, opened for the busy check
    os.close(os.open(foreign, os.O_RDONLY))
attempt("open_foreign_node", open_foreign)
attempt("sighup_dnsmasq", lambda: os.kill(int(victim), signal.SIGHUP))  # dnsmasq re-reads its hosts file
attempt("holder_scan", lambda: [os.readlink(f"/proc/{victim}/fd/{n}") for n in os.listdir(f"/proc/{victim}/fd")])
print(json.dumps(out))
"""


def _sandboxed(caps: list[str], netns: str, *args: str) -> dict:
    """OPERATIONS under the capability bounding set ``caps`` and no_new_privs, inside ``netns``."""
    bounding = "-all," + ",".join("+" + c.removeprefix("CAP_").lower() for c in caps)
    argv = ["ip", "netns", "exec", netns, "setpriv", f"--bounding-set={bounding}", "--inh-caps=-all",
            "--no-new-privs", sys.executable, "-c", OPERATIONS, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> Iterator[tuple[str, str, str, str]]:
    """A loop device (and a root-only node owned by another user), a process of another user, a netns."""
    if os.geteuid() != 0:
        pytest.fail("the sandbox test needs root (loop device, netns, setpriv)", pytrace=False)
    work = tmp_path_factory.mktemp("sandbox")
    backing = work / "disk.img"
    with open(backing, "wb") as fh:
        fh.truncate(8 << 20)
    loop = subprocess.run(["losetup", "--find", "--show", "--partscan", str(backing)], capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()
    foreign = work / "foreign-node"
    victim = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                               "sh", "-c", "trap '' HUP; read line"], stdin=subprocess.PIPE)
    netns = f"gpuaas-sbx-{os.getpid()}"
    try:
        st = os.stat(loop)
        os.mknod(foreign, 0o600 | 0o060000, st.st_rdev)  # the same block device, 0600 and owned by nobody
        os.chown(foreign, 65534, 65534)
        subprocess.run(["ip", "netns", "add", netns], check=True, timeout=30)
        yield netns, loop, str(foreign), str(victim.pid)
    finally:
        subprocess.run(["ip", "netns", "delete", netns], timeout=30)
        victim.kill()
        victim.wait(timeout=30)
        foreign.unlink(missing_ok=True)
        subprocess.run(["losetup", "-d", loop], timeout=30)


# Which capabilities each step needs. The holder scan (host/vfio.py) lists another user's
# /proc/<pid>/fd (a 0500 directory of that user: DAC) and reads each link (ptrace access).
REQUIRES = {
    "reread_partitions": {"CAP_SYS_ADMIN"},
    "nft_guard": {"CAP_NET_ADMIN"},
    "open_foreign_node": {"CAP_DAC_OVERRIDE"},
    "sighup_dnsmasq": {"CAP_KILL"},
    "holder_scan": {"CAP_DAC_OVERRIDE", "CAP_SYS_PTRACE"},
}


def test_the_agents_capability_set_performs_every_privileged_step_of_slice_work(objects):
    caps = agent_capabilities()
    assert set().union(*REQUIRES.values()) == set(caps)  # every capability is needed by some step
    done = _sandboxed(caps, *objects)
    assert done == {step: "ok" for step in REQUIRES}


@pytest.mark.parametrize("dropped", ["CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_DAC_OVERRIDE", "CAP_KILL", "CAP_SYS_PTRACE"])
def test_without_any_one_capability_exactly_its_steps_fail_so_none_is_spare(objects, dropped):
    caps = agent_capabilities()
    assert dropped in caps
    done = _sandboxed([c for c in caps if c != dropped], *objects)
    failed = {step for step, outcome in done.items() if outcome.startswith("EPERM")}
    assert failed == {step for step, needs in REQUIRES.items() if dropped in needs}, done
    assert all(done[step] == "ok" for step in REQUIRES if step not in failed), done
