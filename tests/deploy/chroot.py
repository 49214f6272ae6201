"""Clean distribution roots for the package tests: cached debootstrap tarballs, unpacked and mounted.

One place for what tests/deploy/test_deb.py (Debian 12), test_deb_portable.py
(Ubuntu 22.04 and 24.04) and test_fresh_host.py share, so a fix to the mount
handling (never ``rm -rf`` through a bind mount that is still there) is made once.

- :func:`bookworm_tarball` / :func:`ubuntu_tarball`: a pristine ``debootstrap
  --variant=minbase`` root as a tarball in /var/cache/gpuaas-agent-ci, built on the
  first run and reused after (about a minute each to build, seconds to unpack).
- :func:`distro_root`: that tarball unpacked in a fresh directory with
  ``policy-rc.d`` (nothing a package installs may start), the host's resolv.conf,
  /proc and apt's archive cache (shared across runs) mounted, ``apt-get update``
  done; unmounted and deleted on exit, also when the test failed, and it asserts
  nothing is left mounted.
- :class:`Chroot`: run a command inside, ``apt-get install`` a ``.deb``, map a path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CACHE = Path("/var/cache/gpuaas-agent-ci")
DEBOOTSTRAP_TIMEOUT_S = 1200
APT_TIMEOUT_S = 1800
CMD_TIMEOUT_S = 300
UBUNTU_MIRROR = os.environ.get("GPUAAS_UBUNTU_MIRROR", "http://archive.ubuntu.com/ubuntu")
# The Ubuntu archive key, from ubuntu-keyring 2023.11.28.1 (bookworm's debootstrap host has no Ubuntu keyring).
UBUNTU_KEYRING = Path(__file__).parent / "keys" / "ubuntu-archive-keyring.gpg"
CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run_checked(argv: list[str], *, timeout: float = CMD_TIMEOUT_S, env: dict | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    """Run a host command (text output captured); a non-zero exit fails the test with both streams' tails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}")
    return done


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root`` (from /proc/self/mountinfo)."""
    prefix = str(root.resolve())
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            mounts.append(point)
    return mounts


@dataclass
class Chroot:
    """A distribution root to run commands in (``chroot``, a clean environment, no tty)."""

    root: Path

    def run(self, *argv: str, timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
        env = {"PATH": CHROOT_PATH, "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
        return run_checked(["chroot", str(self.root), *argv], timeout=timeout, env=env, check=check)

    def apt_install(self, deb: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        inside = Path("/tmp") / deb.name
        shutil.copy2(deb, self.root / inside.relative_to("/"))
        return self.run("apt-get", "install", "-y", "--no-install-recommends", *extra, str(inside),
                        timeout=APT_TIMEOUT_S, check=check)

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")


def host_mirror() -> str:
    """The Debian mirror this host's apt uses for bookworm (deb822 sources first, then sources.list)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for para in sources.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in para.splitlines() if ":" in line and not line.startswith("#"))
            fields = {k.strip(): v.split() for k, v in fields.items()}
            if "deb" in fields.get("Types", []) and "bookworm" in fields.get("Suites", []) and fields.get("URIs"):
                return fields["URIs"][0]
    listed = Path("/etc/apt/sources.list")
    if listed.exists():
        for line in listed.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
                return parts[1]
    pytest.fail("no bookworm mirror in the host's apt sources: cannot debootstrap a clean Debian 12 root")


def _cached_tarball(name: str, debootstrap: Callable[[Path], list[str]]) -> Path:
    """``CACHE/<name>-minbase.tar``; on a miss, ``debootstrap(work_dir)`` builds it (renamed in atomically)."""
    tarball = CACHE / f"{name}-minbase.tar"
    if tarball.exists():
        return tarball
    if shutil.which("debootstrap") is None:
        pytest.fail("debootstrap is not installed (scripts/apt-packages.txt lists it)")
    CACHE.mkdir(parents=True, exist_ok=True)
    work = CACHE / f"debootstrap-{name}-{os.getpid()}"
    try:
        run_checked(debootstrap(work), timeout=DEBOOTSTRAP_TIMEOUT_S)
        tmp = tarball.with_suffix(".tmp")
        run_checked(["tar", "-C", str(work), "--numeric-owner", "-cf", str(tmp), "."], timeout=CMD_TIMEOUT_S)
        tmp.rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def bookworm_tarball() -> Path:
    """A pristine minbase Debian 12 root, from the mirror this host's apt uses."""
    return _cached_tarball("bookworm", lambda work: ["debootstrap", "--variant=minbase", "bookworm", str(work),
                                                     host_mirror()])


def ubuntu_tarball(codename: str) -> Path:
    """A pristine minbase Ubuntu root (main + universe: python3-openvswitch is in main, nvme-cli in universe).

    bookworm's debootstrap has no script named after recent Ubuntu releases, so the ``gutsy``
    script every Ubuntu release uses is named explicitly.
    """
    script = Path("/usr/share/debootstrap/scripts/gutsy")
    if not script.exists():
        pytest.fail("debootstrap has no Ubuntu script (gutsy): cannot build an Ubuntu root")
    return _cached_tarball(codename, lambda work: ["debootstrap", "--variant=minbase", "--components=main,universe",
                                                   f"--keyring={UBUNTU_KEYRING}", codename, str(work), UBUNTU_MIRROR,
                                                   str(script)])


@contextlib.contextmanager
def distro_root(tarball: Path, archives: Path) -> Iterator[Chroot]:
    """``tarball`` unpacked in a fresh directory, /proc and ``archives`` (apt's cache) mounted, apt updated.

    Torn down even when the body fails; it never deletes through a mount that is still there.
    """
    parent = Path(tempfile.mkdtemp(prefix=f"gpuaas-{tarball.name.split('-')[0]}-"))
    root = parent / "root"
    root.mkdir()
    mounted: list[Path] = []
    try:
        run_checked(["tar", "-C", str(root), "--numeric-owner", "-xf", str(tarball)], timeout=CMD_TIMEOUT_S)
        # Nothing a package installs may start here (no systemd, and not the host's services).
        policy = root / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf")
        (archives / "partial").mkdir(parents=True, exist_ok=True)
        run_checked(["mount", "-t", "proc", "proc", str(root / "proc")])
        mounted.append(root / "proc")
        run_checked(["mount", "--bind", str(archives), str(root / "var/cache/apt/archives")])
        mounted.append(root / "var/cache/apt/archives")
        box = Chroot(root)
        box.run("apt-get", "update", timeout=APT_TIMEOUT_S)
        yield box
    finally:
        for point in reversed(mounted):
            if run_checked(["umount", str(point)], check=False).returncode != 0:
                run_checked(["umount", "-l", str(point)], check=False)
        left = mounts_under(root)
        # Never rm -rf through a mount that is still there (the apt cache is a bind mount).
        assert not left, f"mounts left under the chroot: {left}"
        shutil.rmtree(parent, ignore_errors=True)
