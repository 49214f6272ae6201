"""A real, throwaway systemd manager on a machine whose PID 1 is not systemd (the CI machine).

Why: the agent unit's sandbox (ProtectSystem=strict, DevicePolicy=closed + DeviceAllow=,
CapabilityBoundingSet=, SystemCallFilter=, PrivateTmp=, NoNewPrivileges=...) must never break a
provision, and only systemd applies it exactly as a host will. ``systemd-run`` needs a running
manager, and this machine's PID 1 is not one; so this module boots one:

* systemd 252 (the distro's ``/lib/systemd/systemd``) as PID 1 of its own PID, mount and cgroup
  namespaces, on a copy-on-write **overlay of the host root** (upper layer on a tmpfs): what it
  and its units write outside the bind mounts below (dpkg, /etc, /var/lib/gpuaas-agent, its
  journal) vanishes with it, so the machine ends as it began;
* it starts one empty target (``--unit=gpuaas-lab.target``, no default dependencies), so no
  sysinit job of the host (tmpfiles --remove, sysctl, sysusers) ever runs;
* the network namespace is the host's (NATS on 127.0.0.1, the lab's OVS bridge and nft tables),
  ``/dev`` is the host's (loop devices appear live), ``/sys`` a fresh sysfs of the same kernel,
  cgroups the host's v1/v2 hierarchies seen through a cgroup namespace rooted in child cgroups of
  this process (so systemd's slices nest under ours and are removed afterwards);
* ``/run`` is a fresh tmpfs, as on a booted host (systemd would mount one over the host's
  anyway, hiding anything bound below it);
* ``binds``: host paths shared read-write at the same path (the lab's work dir, /run/libvirt,
  the lab's OVS run dir), so libvirtd, dnsmasq and the test see what the agent writes.

The PID namespace is the one visible difference from a host: a unit's process sees only the
manager's processes in /proc. So a daemon the agent signals by PID (dnsmasq) runs as a unit of
this manager, as it does on a host; QEMU (a child of the lab's libvirtd) is not visible to the
agent's holder scan here (tests/deploy/test_unit_sandbox.py proves that scan's capabilities).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TARGET = "gpuaas-lab.target"
# The cgroup hierarchies systemd writes (hybrid v1 + v2 on the CI machine, or v2 only).
HIERARCHIES = ("name=systemd", "", "devices", "pids", "memory")
START_TIMEOUT_S = 60.0

# Runs under `unshare --mount --propagation private`: $1 = scratch dir, $2 = cgroup dirs to enter
# (space separated), then the bind paths. Only mount/chroot/unshare; no host file is written.
BOOT = r"""
set -eu
base=$1; cgroups=$2; shift 2
mount -t tmpfs -o mode=0755 gpuaas-lab-overlay "$base"
mkdir -p "$base/upper" "$base/work" "$base/root"
mount -t overlay gpuaas-lab-root -o "lowerdir=/,upperdir=$base/upper,workdir=$base/work" "$base/root"
root=$base/root
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=0755,nosuid,nodev gpuaas-lab-run "$root/run"
for path in "$@"; do
    mkdir -p "$root$path"
    mount --bind "$path" "$root$path"
done
mkdir -p "$root/etc/systemd/system"
printf '[Unit]\nDescription=gpuaas lab manager target\nDefaultDependencies=no\n' > "$root/etc/systemd/system/%TARGET%"
for dir in $cgroups; do echo $$ > "$dir/cgroup.procs"; done
exec unshare --cgroup --pid --fork --kill-child chroot "$root" /bin/sh -c \
    'mount -t proc proc /proc && mount -t sysfs sysfs /sys && exec env container=gpuaas-lab /lib/systemd/systemd --unit=%TARGET% --log-target=null'
""".replace("%TARGET%", TARGET)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _own_cgroups() -> dict[str, Path]:
    """This process's cgroup directory in each hierarchy of HIERARCHIES that is mounted."""
    mounts = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("", Path(fields[4]))
        elif fstype == "cgroup":
            for opt in opts:
                mounts.setdefault(opt, Path(fields[4]))
    dirs = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            if name in HIERARCHIES and name in mounts:
                dirs[name] = mounts[name] / path.lstrip("/")
    return dirs


@dataclass
class SystemdManager:
    """Boot with :meth:`start`, drive with :meth:`systemctl`/:meth:`run`, end with :meth:`close`."""

    scratch: Path
    binds: list[Path]
    pid: int = 0  # systemd's PID in this (the host's) PID namespace
    _proc: subprocess.Popen | None = None
    _cgroups: list[Path] = field(default_factory=list)

    def start(self) -> SystemdManager:
        self.scratch.mkdir(parents=True, exist_ok=True)
        name = f"gpuaas-lab-manager-{os.getpid()}-{time.monotonic_ns()}"
        for parent in _own_cgroups().values():
            child = parent / name
            child.mkdir()
            self._cgroups.append(child)
        self._proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", BOOT, "boot", str(self.scratch),
             " ".join(map(str, self._cgroups)), *map(str, self.binds)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"the systemd manager exited {self._proc.returncode}: "
                                       f"{self._proc.stdout.read().decode(errors='replace')[-2000:]}")
                if not self.pid:  # unshare --fork's child is chroot -> sh -> systemd (one exec chain)
                    kids = _children(self._proc.pid)
                    if kids and Path(f"/proc/{kids[0]}/exe").resolve(strict=False).name == "systemd":
                        self.pid = kids[0]
                if self.pid:
                    state = self.systemctl("is-system-running", check=False).stdout.strip()
                    if state in ("running", "degraded"):
                        return self
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the systemd manager did not come up in {START_TIMEOUT_S}s")
                time.sleep(0.1)  # poll step of the deadline wait above
        except BaseException:
            self.close()
            raise

    @property
    def root(self) -> Path:
        """The manager's root (the overlay) as this process sees it."""
        return Path(f"/proc/{self.pid}/root")

    def run(self, *argv: str, timeout: float = 120, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``argv`` inside the manager's namespaces and root (its PID namespace: its /proc, its PIDs)."""
        prefix = ["nsenter", "-t", str(self.pid), "-m", "-p", "-C", "-r", "-w"]
        if env is not None:
            prefix += ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
        done = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
        return done

    def systemctl(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("systemctl", "--no-pager", *args, timeout=timeout, check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, predicate, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.1)  # poll step of a deadline wait

    def close(self) -> list[str]:
        """SIGKILL to PID 1 of the namespace ends every unit in it; the mounts go with the namespace."""
        problems = []
        if self.pid:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=30)
        for top in self._cgroups:  # systemd's slices nest under ours: remove the leaves first
            deadline = time.monotonic() + 30
            while top.exists():
                try:
                    for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                        os.rmdir(dirpath)
                except OSError as exc:
                    if time.monotonic() > deadline:
                        problems.append(f"cgroup {top}: {exc}")
                        break
                    time.sleep(0.1)  # poll step: the killed processes leave their cgroups asynchronously
        self.pid, self._proc, self._cgroups = 0, None, []
        return problems
