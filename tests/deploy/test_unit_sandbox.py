"""The hardened units: exposure under the issue's bounds, and the agent's capability set is exactly what slice work uses.

``systemd-analyze security --offline=yes`` rates each unit file (no systemd as PID 1
needed). Systemd is not PID 1 on the CI machine (``systemd-run`` cannot start a transient
unit there), so the sandbox is reproduced with the kernel's own mechanisms: the unit's
``CapabilityBoundingSet=`` and ``NoNewPrivileges=`` read from the unit file and applied by
``setpriv`` to a real process, which performs the privileged operations of a provision and
a release on real objects (a loop block device, a process of another user, a network
namespace's nftables). Every capability in the set is then dropped one at a time: the
operation that capability is there for must fail with EPERM, so none of them is spare. What the
set must not allow is refused under it: another process's memory (``/proc/<pid>/mem`` of another
user's process, as QEMU is, and of a root process with more capabilities, as libvirtd is) and its
fd links; the holder scan still names a known holder by its ``comm``.
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

from gpuaas_agent.deploy.sysfswrites import DROPIN
from tests.conftest import REPO
from tests.deploy.units import AGENT_UNIT, BASELINE_UNIT, agent_capabilities, directive

EXPOSURE_RE = re.compile(r"Overall exposure level for \S+: (\d+\.\d+)")


def _exposure(unit: Path) -> float:
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=120)
    match = EXPOSURE_RE.search(done.stdout + done.stderr)
    assert match, done.stdout + done.stderr
    return float(match.group(1))


# The exposure each unit had before /proc/sys, /sys and PID 1's socket were closed (3.0 and 2.3 since):
# a change to either unit may lower it, never raise it.
@pytest.mark.parametrize(("unit", "bound"), [(AGENT_UNIT, 3.4), (BASELINE_UNIT, 2.5)], ids=["agent", "baseline"])
def test_systemd_analyze_security_exposure_is_within_the_bound(unit, bound):
    assert _exposure(unit) <= bound


def test_every_capability_of_the_agent_is_documented_with_the_step_that_needs_it():
    readme = (REPO / "systemd" / "README.md").read_text()
    for cap in agent_capabilities():
        assert re.search(rf"^\| `{cap}` \| .+ \| .+ \|$", readme, re.MULTILINE), f"{cap} has no row in systemd/README.md"
    assert directive(AGENT_UNIT, "NoNewPrivileges") == ["yes"]


@pytest.mark.parametrize("unit", [AGENT_UNIT, BASELINE_UNIT], ids=["agent", "baseline"])
def test_kernel_tunables_and_the_managers_sockets_are_closed_by_the_unit(unit):
    # /proc/sys and /sys read-only: kernel.core_pattern (a program run as root outside the sandbox).
    assert directive(unit, "ProtectKernelTunables") == ["yes"]
    hidden = " ".join(directive(unit, "InaccessiblePaths")).split()
    assert {"-/run/systemd/private", "-/run/dbus"} <= set(hidden)
    # Whatever talks to systemd runs outside the sandbox ('+'), as a fixed command line.
    for key in ("ExecStartPre", "ExecStart", "ExecStartPost"):
        assert all("systemctl" not in v or v.startswith("+") for v in directive(unit, key)), key


def test_the_unit_opens_no_sysfs_tree_itself_and_both_prepare_host_lines_name_the_generated_dropin():
    # All of /sys read-only; only the drop-in prepare-host generates from the host's discovery opens files.
    writable = " ".join(directive(AGENT_UNIT, "ReadWritePaths")).split()
    assert [p for p in writable if "/sys" in p] == []
    assert directive(AGENT_UNIT, "ReadOnlyPaths") == []
    prepare = [v for v in directive(AGENT_UNIT, "ExecStartPre") if " prepare-host " in v]
    assert len(prepare) == 2 and prepare[0].startswith("+") and not prepare[1].startswith("+")
    assert all(v.split().count("--sysfs-dropin") == 1 and v.split()[-1] == str(DROPIN) for v in prepare), prepare
    postinst = (REPO / "packaging" / "debian" / "postinst").read_text()
    assert f"--sysfs-dropin {DROPIN}; then" in postinst
    assert f"rm -f {DROPIN}" in (REPO / "packaging" / "debian" / "postrm").read_text()
    assert "CAP_SYS_PTRACE" not in agent_capabilities()  # it would open every guest's memory


# What the sandboxed process does: one privileged operation per capability, each reported by name.
OPERATIONS = r"""
import fcntl, json, os, signal, subprocess, sys
loop, foreign, victim, root_pid = sys.argv[1:5]
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
def nft():  # the slice guard table (host/network/nftguard.py); this process runs in the test's network namespace
    subprocess.run(["nft", "add", "table", "inet", "gpuaas_sandbox"], check=True, capture_output=True)
attempt("nft_guard", nft)
def open_foreign():  # a node libvirt chowned to the QEMU user, opened for the busy check
    os.close(os.open(foreign, os.O_RDONLY))
attempt("open_foreign_node", open_foreign)
attempt("sighup_dnsmasq", lambda: os.kill(int(victim), signal.SIGHUP))  # dnsmasq re-reads its hosts file
# Refused under the unit's set: the memory of another user's process (QEMU runs as libvirt-qemu), of a
# root process with capabilities the agent lacks (libvirtd), and another user's fd links.
attempt("proc_mem", lambda: os.close(os.open(f"/proc/{victim}/mem", os.O_RDONLY)))
attempt("proc_mem_root", lambda: os.close(os.open(f"/proc/{root_pid}/mem", os.O_RDONLY)))
attempt("fd_links", lambda: [os.readlink(f"/proc/{victim}/fd/{n}") for n in os.listdir(f"/proc/{victim}/fd")])
def holder_by_comm():  # the scan of a failed unbind still names the usual holder, by its comm
    from gpuaas_agent.host.devices.vfio import find_device_holders
    from gpuaas_agent.hostfs import HostRoot
    seen = [(h.pid, h.comm, h.devices) for h in find_device_holders(HostRoot.open("/"), ("/dev/nvidia",))]
    if (int(victim), "nv-hostengine", []) not in seen:
        raise PermissionError(f"holder scan saw {seen}")
attempt("holder_by_comm", holder_by_comm)
print(json.dumps(out))
"""


def _sandboxed(caps: list[str], netns: str, *args: str) -> dict:
    """OPERATIONS under the capability bounding set ``caps`` and no_new_privs, inside ``netns``."""
    bounding = "-all," + ",".join("+" + c.removeprefix("CAP_").lower() for c in caps)
    argv = ["ip", "netns", "exec", netns, "setpriv", f"--bounding-set={bounding}", "--inh-caps=-all",
            "--no-new-privs", sys.executable, "-c", OPERATIONS, *args, str(os.getpid())]
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
    # Named like DCGM's daemon (its comm), which the holder scan knows as a holder of /dev/nvidia*.
    victim = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                               "sh", "-c", "echo nv-hostengine > /proc/self/comm; trap '' HUP; read line"],
                              stdin=subprocess.PIPE)
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


# Which capabilities each step needs; the holder scan by comm needs none.
REQUIRES = {
    "reread_partitions": {"CAP_SYS_ADMIN"},
    "nft_guard": {"CAP_NET_ADMIN"},
    "open_foreign_node": {"CAP_DAC_OVERRIDE"},
    "sighup_dnsmasq": {"CAP_KILL"},
    "holder_by_comm": set(),
}
# What the set must refuse: no capability in it opens another process's memory or its fd links.
REFUSED = ("proc_mem", "proc_mem_root", "fd_links")


def test_the_agents_capability_set_performs_every_privileged_step_of_slice_work(objects):
    caps = agent_capabilities()
    assert set().union(*REQUIRES.values()) == set(caps)  # every capability is needed by some step
    done = _sandboxed(caps, *objects)
    assert {step: done.pop(step) for step in REQUIRES} == {step: "ok" for step in REQUIRES}
    assert sorted(done) == sorted(REFUSED) and all(v.startswith("EPERM") for v in done.values()), done


def test_the_refusals_are_the_capability_sets_not_the_test_objects(objects):
    """Control: with CAP_SYS_PTRACE (and CAP_DAC_OVERRIDE) the same opens succeed on the same processes."""
    done = _sandboxed(["CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE"], *objects)
    assert {step: done[step] for step in REFUSED} == {step: "ok" for step in REFUSED}, done


@pytest.mark.parametrize("dropped", ["CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_DAC_OVERRIDE", "CAP_KILL"])
def test_without_any_one_capability_exactly_its_steps_fail_so_none_is_spare(objects, dropped):
    caps = agent_capabilities()
    assert dropped in caps
    done = _sandboxed([c for c in caps if c != dropped], *objects)
    failed = {step for step, outcome in done.items() if outcome.startswith("EPERM")}
    assert failed == {step for step, needs in REQUIRES.items() if dropped in needs} | set(REFUSED), done
    assert all(done[step] == "ok" for step in REQUIRES if step not in failed), done
