"""QEMU from bookworm-backports, unpacked beside the system one (never installed), for the igb SR-IOV guest.

Why it exists: the fabric VF code must run against a real kernel's VF netlink, and no
machine here has an SR-IOV NIC or netdevsim. QEMU >= 8 emulates one, ``igb`` (Intel 82576, up to 8
VFs); the system QEMU of Debian 12 is 7.2 and has no ``igb``. Debian's bookworm-backports carries
QEMU 10, built for bookworm's libraries.

How: a private apt configuration (``Dir::Etc::SourceList`` = a one-line backports list,
``Dir::Etc::SourceParts=/dev/null``, ``Dir::State::Lists`` in the cache) so the host's apt state is
never touched; ``apt-get download`` the packages of :data:`PACKAGES`; ``dpkg-deb -x`` them into a
directory named by the digest of the .debs (the content-addressed cache, as ``build_guest_image``
does for the guest kernel). The binary's shared libraries must all resolve from the host (``ldd``);
one that does not is a :class:`QemuBackportError` naming it.

Two quirks: Debian's QEMU looks for its loadable modules in the compiled-in
``/usr/lib/x86_64-linux-gnu/qemu`` (the system 7.2's, which the 10.0 binary refuses), so nothing here
may ask for a modular device or a ``-device help`` listing (the guest uses only built-in devices);
firmware comes from the unpacked ``qemu-system-data`` and ``seabios`` through ``-L``.

Usage: ``.venv/bin/python lab/qemu_backport.py [--cache DIR]`` prints the binary and its version.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the agent package and lab/ are importable
    sys.path.insert(0, str(HERE.parent))

from lab import build_guest_image  # noqa: E402
from lab.build_guest_image import DEFAULT_CACHE, LabImageError, natural_key, run_tool, sha256_file  # noqa: E402

SUITE = "bookworm-backports"
MIRROR = "http://deb.debian.org/debian"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
# qemu-system-x86: the binary (igb, q35, TCG built in); qemu-system-data: option ROMs and
# linuxboot_dma.bin for -kernel; seabios: the BIOS the 10.0 package asks for (>> bookworm's 1.16.2).
PACKAGES = ("qemu-system-x86", "qemu-system-data", "seabios")
MIN_MAJOR = 8  # igb appeared in QEMU 8.0
APT_TIMEOUT = 300.0


class QemuBackportError(LabImageError):
    """The backported QEMU could not be fetched, unpacked or run here; ``evidence`` says what was seen."""

    default_code = "lab_qemu_backport_failed"


@dataclass(frozen=True)
class BackportQemu:
    root: Path  # the unpacked packages
    version: str  # "10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)"
    debs: tuple[Path, ...]

    @property
    def binary(self) -> Path:
        return self.root / "usr" / "bin" / "qemu-system-x86_64"

    @property
    def firmware_dirs(self) -> tuple[Path, ...]:
        return (self.root / "usr" / "share" / "qemu", self.root / "usr" / "share" / "seabios")

    def argv_prefix(self) -> list[str]:
        argv = [str(self.binary)]
        for directory in self.firmware_dirs:
            argv += ["-L", str(directory)]
        return argv


def _apt_options(apt_dir: Path) -> list[str]:
    return [
        "-o", f"Dir::Etc::SourceList={apt_dir / 'sources.list'}",
        "-o", "Dir::Etc::SourceParts=/dev/null",
        "-o", f"Dir::State::Lists={apt_dir / 'lists'}",
        "-o", "Debug::NoLocking=1",  # the lists are ours alone; never wait on the host's dpkg lock
    ]  # fmt: skip


def _apt_update(apt_dir: Path) -> None:
    if not KEYRING.is_file():
        raise QemuBackportError(f"{KEYRING} is missing (apt install debian-archive-keyring)", path=str(KEYRING))
    (apt_dir / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (apt_dir / "sources.list").write_text(f"deb [signed-by={KEYRING}] {MIRROR} {SUITE} main\n")
    try:
        run_tool(["apt-get", "-q", *_apt_options(apt_dir), "update"], timeout=APT_TIMEOUT)
    except LabImageError as exc:
        raise QemuBackportError(
            f"apt-get update of {SUITE} failed (is {MIRROR} reachable?)", cause=str(exc), **exc.evidence
        ) from exc
    if not any((apt_dir / "lists").glob(f"*{SUITE}*Packages*")):
        raise QemuBackportError(f"apt-get update left no {SUITE} package list", dir=str(apt_dir / "lists"))


def _download(package: str, debs: Path, apt_dir: Path) -> Path:
    """The cached .deb of ``package`` from backports (downloaded once; the newest cached one wins)."""
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        if not any((apt_dir / "lists").glob(f"*{SUITE}*Packages*")):
            _apt_update(apt_dir)
        try:
            # package/suite: the backports version even where another list would offer one
            run_tool(["apt-get", "-q", *_apt_options(apt_dir), "download", f"{package}/{SUITE}"], cwd=debs,
                 timeout=APT_TIMEOUT)  # fmt: skip
        except LabImageError as exc:
            raise QemuBackportError(f"apt-get download {package}/{SUITE} failed", **exc.evidence) from exc
        found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise QemuBackportError("apt-get download left no .deb", package=package, dir=str(debs))
    return max(found, key=lambda p: natural_key(p.name))


def missing_libraries(binary: Path) -> list[str]:
    """Shared libraries ``ldd`` cannot resolve for ``binary`` on this host (empty when it can run)."""
    out = run_tool(["ldd", str(binary)], timeout=30)
    return sorted({line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line})


def fetch_backport_qemu(cache: Path = DEFAULT_CACHE) -> BackportQemu:
    """Download (once) and unpack (once) QEMU from bookworm-backports; check it runs and has ``igb``."""
    apt_dir = cache / "apt-backports"
    debs = tuple(_download(pkg, cache / "debs-backports", apt_dir) for pkg in PACKAGES)
    digest = hashlib.sha256()
    for deb in debs:
        digest.update(f"{deb.name}\0{sha256_file(deb)}\0".encode())
    root = cache / "qemu-backport" / digest.hexdigest()[:24]
    done = root / ".unpacked"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        for deb in debs:
            run_tool(["dpkg-deb", "-x", str(deb), str(root)])
        done.write_text("".join(f"{d}\n" for d in debs))
    qemu_binary = root / "usr" / "bin" / "qemu-system-x86_64"
    if not qemu_binary.is_file():
        raise QemuBackportError("the qemu-system-x86 package has no qemu-system-x86_64", root=str(root))
    missing = missing_libraries(qemu_binary)
    if missing:
        raise QemuBackportError(
            "the backported qemu-system-x86_64 needs libraries this host lacks", missing=missing,
            debs=[d.name for d in debs],
        )  # fmt: skip
    first = run_tool([str(qemu_binary), "--version"], timeout=30).splitlines()[0]
    match = re.search(r"version (\d+)\.(\d+)\.(\d+)(.*)", first)
    if not match or int(match.group(1)) < MIN_MAJOR:
        raise QemuBackportError(f"backported QEMU is older than {MIN_MAJOR}.0 (no igb)", version=first)
    # 'igb,help' lists one built-in device's properties without loading the (incompatible) system modules.
    props = run_tool([str(qemu_binary), "-device", "igb,help"], timeout=30)
    if "netdev" not in props:
        raise QemuBackportError("the backported QEMU has no igb device", output=props[-2000:])
    version = f"{match.group(1)}.{match.group(2)}.{match.group(3)}{match.group(4)}".strip()
    return BackportQemu(root=root, version=version, debs=debs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cache directory [%(default)s]")
    args = parser.parse_args(argv)

    def build() -> str:
        qemu = fetch_backport_qemu(args.cache)
        return f"{qemu.binary} version={qemu.version}"

    return build_guest_image.print_built(build)


if __name__ == "__main__":
    sys.exit(main())
