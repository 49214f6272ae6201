#!/usr/bin/env python3
"""Build the lab guest: a UEFI-bootable raw GPT disk holding one unified kernel image.

Why it exists: the real-guest test lane (and the lab-in-a-box) needs a guest that
boots under TCG in seconds, takes a DHCP lease, answers SSH and powers off on the
ACPI power button. It is made here from Debian/Ubuntu packages (a kernel .deb
fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x``, never
installed; busybox-static and dropbear-bin from the host), never downloaded as a
prebuilt VM image.

Layout: GPT, one ESP (FAT, made with ``mkfs.vfat`` + ``mcopy``, nothing mounted)
with ``/EFI/BOOT/BOOTX64.EFI`` = systemd's ``linuxx64.efi.stub`` + kernel +
initramfs (cpio newc, gzip) + cmdline, glued with ``objcopy``.

The cache is content-addressed: the image's name is the digest of every input
(kernel .deb, stub, busybox, dropbear, the files under ``lab/guest``, this
script), so building twice with the same inputs does nothing.

Usage: ``.venv/bin/python lab/build_guest_image.py [--out PATH] [--cache DIR]``
(it uses the agent's package for its manifest model and errors); prints the image
path and its sha256. Importable: :func:`build_guest_image`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.types import SHA256_PATTERN
from gpuaas_agent.errors import HostError

HERE = Path(__file__).resolve().parent
GUEST_DIR = HERE / "guest"
DEFAULT_CACHE = Path("/var/cache/gpuaas-agent-lab")
STUB = Path("/usr/lib/systemd/boot/efi/linuxx64.efi.stub")
BUSYBOX = Path("/bin/busybox")
DROPBEAR = (Path("/usr/sbin/dropbear"), Path("/usr/bin/dropbearkey"))
CMDLINE = "console=ttyS0"
BOOT_MARKER = "GPUAAS-LAB-GUEST-BOOTED"
BUILD_FORMAT = "gpuaas-lab-guest/1"  # bump when the image layout changes without an input change
ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
MiB = 1 << 20

# Modules the guest loads (with their dependencies) when the kernel has them as modules:
# NIC and disk models libvirt may give it, the seed cdrom, and the ACPI power button.
GUEST_MODULES = (
    "virtio_net", "virtio_blk", "virtio_scsi", "e1000e", "e1000",
    "ahci", "sd_mod", "sr_mod", "isofs",
    "button", "evdev",
)  # fmt: skip

# Module parameters. virtio_net csum=0: the guest checksums its own packets. The lab's OVS bridge uses the
# userspace (netdev) datapath, which never completes a checksum left to "hardware": with offload on, the
# guest's TCP replies reach the host with bad checksums and SSH never connects (DHCP, on raw sockets, would).
MODULE_PARAMS = {"virtio_net": "csum=0"}

# lab/guest file -> (path in the initramfs, mode)
GUEST_FILES = {
    "init": ("init", 0o755),
    "inittab": ("etc/inittab", 0o644),
    "rc.sysinit": ("etc/rc.sysinit", 0o755),
    "rc.shutdown": ("etc/rc.shutdown", 0o755),
    "seed-apply": ("etc/seed-apply", 0o755),
    "udhcpc.script": ("etc/udhcpc.script", 0o755),
    "acpid.conf": ("etc/acpid.conf", 0o644),
    "power-button": ("etc/acpi/PWRF/00000080", 0o755),
    "passwd": ("etc/passwd", 0o644),
    "group": ("etc/group", 0o644),
    "shells": ("etc/shells", 0o644),
    "hostname": ("etc/hostname", 0o644),
    "os-release": ("etc/os-release", 0o644),
}
TIMEOUT = 600.0
KEEP_IMAGES = 3
SOURCE_DATE_EPOCH = 1577836800  # 2020-01-01: FAT cannot store dates before 1980


class LabImageError(HostError):
    """The lab guest image could not be built; ``evidence`` names what was seen."""

    default_code = "lab_image_failed"

    def __init__(self, message: str, **evidence: object) -> None:
        super().__init__(message, evidence=evidence)


class GuestImageManifest(WireModel):
    """Written next to each cached image: what it was built from and its digest (read back on a cache hit)."""

    input_digest: str = Field(pattern=SHA256_PATTERN)
    sha256: str = Field(pattern=SHA256_PATTERN)
    kernel: str
    cmdline: str
    debs: list[str]
    boot_marker: str


def _run(
    argv: Sequence[str],
    *,
    cwd: Path | None = None,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT,
) -> str:
    try:
        done = subprocess.run(
            list(argv), cwd=cwd, input=stdin, env=env, capture_output=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise LabImageError(f"{argv[0]} is not installed", argv=list(argv)) from exc
    except subprocess.TimeoutExpired as exc:
        raise LabImageError(f"{argv[0]} ran past {timeout}s", argv=list(argv)) from exc
    if done.returncode != 0:
        raise LabImageError(
            f"{argv[0]} failed", argv=list(argv), returncode=done.returncode, stderr=done.stderr.decode()[-4000:]
        )
    return done.stdout.decode()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Kernel: newest from apt, fetched as a .deb, unpacked into the cache
# ---------------------------------------------------------------------------


def _natural_key(text: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text)]


def newest_kernel_package(search_output: str | None = None) -> str:
    """Name of the newest generic amd64 kernel image apt knows (Debian ``-amd64``, Ubuntu ``-generic``).

    Cloud and realtime flavours are left out: the lab guest uses what a slice
    host would run, and the generic kernel has every NIC/disk module libvirt may pick.
    """
    if search_output is None:
        search_output = _run(["apt-cache", "search", "--names-only", r"^linux-image-[0-9].*-(amd64|generic)$"])
    names = []
    for line in search_output.splitlines():
        name = line.split(" - ", 1)[0].strip()
        if re.fullmatch(r"linux-image-\d[\w.+~-]*-(amd64|generic)", name) and not re.search(
            r"-(cloud|rt|dbg|unsigned)-amd64$", name
        ):
            names.append(name)
    if not names:
        raise LabImageError("apt knows no linux-image-*-amd64 / -generic package (run apt-get update?)")
    return max(names, key=_natural_key)


def _download(package: str, debs: Path) -> Path:
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        _run(["apt-get", "download", package], cwd=debs)
        found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise LabImageError("apt-get download left no .deb", package=package, dir=str(debs))
    return max(found, key=lambda p: _natural_key(p.name))


@dataclass(frozen=True)
class Kernel:
    version: str  # uname -r
    root: Path  # the unpacked package tree(s)
    debs: tuple[Path, ...]

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.version}"

    @property
    def modules(self) -> Path:
        for base in (self.root / "lib" / "modules", self.root / "usr" / "lib" / "modules"):
            if (base / self.version).is_dir():
                return base / self.version
        raise LabImageError("kernel tree has no modules directory", version=self.version, root=str(self.root))


def fetch_kernel(cache: Path, package: str | None = None) -> Kernel:
    """Download (once) and unpack (once) the kernel .deb; Ubuntu keeps modules in ``linux-modules-<ver>``."""
    package = package or newest_kernel_package()
    version = package.removeprefix("linux-image-")
    debs = [_download(package, cache / "debs")]
    root = cache / "kernels" / f"{version}-{_sha256_file(debs[0])[:16]}"
    done = root / ".unpacked"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        _run(["dpkg-deb", "-x", str(debs[0]), str(root)])
        if not any((b / version / "kernel").is_dir() for b in (root / "lib/modules", root / "usr/lib/modules")):
            # Ubuntu: image and modules are two packages
            debs.append(_download(f"linux-modules-{version}", cache / "debs"))
            _run(["dpkg-deb", "-x", str(debs[1]), str(root)])
        if not (root / "lib" / "modules").is_dir() and (root / "usr" / "lib" / "modules").is_dir():
            (root / "lib").symlink_to("usr/lib")
        # The packages leave modules.dep to their postinst: make it here, inside the cache only.
        _run(["depmod", "-b", str(root), version], timeout=120)
        done.write_text("\n".join(str(d) for d in debs) + "\n")
    else:
        debs = [Path(line) for line in done.read_text().split()]
    kernel = Kernel(version=version, root=root, debs=tuple(debs))
    if not kernel.vmlinuz.is_file():
        raise LabImageError("kernel package has no vmlinuz", expected=str(kernel.vmlinuz))
    return kernel


def module_load_order(modules_dir: Path, wanted: Iterable[str]) -> list[str]:
    """Relative module paths to insmod, dependencies first; built-in or absent modules are left out."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        name = re.sub(r"\.ko(\.(xz|zst|gz))?$", "", os.path.basename(path)).replace("-", "_")
        by_name[name] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        # modules.dep lists a module's dependencies with the deepest last: load those first.
        for dep in reversed(deps.get(path, [])):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name.replace("-", "_") in by_name:
            visit(by_name[name.replace("-", "_")])
    return order


def _decompress_module(path: Path) -> bytes:
    """busybox insmod takes plain .ko: decompress at build time (xz on Debian, zstd on Ubuntu)."""
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    if path.name.endswith(".zst"):
        return subprocess.run(["zstd", "-dc"], input=data, capture_output=True, check=True, timeout=60).stdout
    return data


# ---------------------------------------------------------------------------
# Initramfs: a deterministic cpio newc archive written here (no root, no mknod needed)
# ---------------------------------------------------------------------------


class Cpio:
    """Entries of a newc archive; ``render`` sorts them so equal inputs give equal bytes."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[int, bytes, int]] = {}  # path -> (mode, data, rdev)

    def dir(self, path: str, mode: int = 0o755) -> None:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            self.entries.setdefault("/".join(parts[:i]), (stat.S_IFDIR | mode, b"", 0))

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.dir(os.path.dirname(path)) if "/" in path else None
        self.entries[path] = (stat.S_IFREG | mode, data, 0)

    def symlink(self, path: str, target: str) -> None:
        self.dir(os.path.dirname(path)) if "/" in path else None
        self.entries[path] = (stat.S_IFLNK | 0o777, target.encode(), 0)

    def chardev(self, path: str, major: int, minor: int, mode: int = 0o600) -> None:
        self.dir(os.path.dirname(path))
        self.entries[path] = (stat.S_IFCHR | mode, b"", (major << 8) | minor)

    def render(self) -> bytes:
        out = io.BytesIO()

        def pad() -> None:
            out.write(b"\0" * (-out.tell() % 4))

        def entry(ino: int, name: str, mode: int, data: bytes, rdev: int) -> None:
            fields = (ino, mode, 0, 0, 2 if stat.S_ISDIR(mode) else 1, 0, len(data), 0, 0, rdev >> 8, rdev & 0xFF)
            out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + b"%08X%08X" % (len(name) + 1, 0))
            out.write(name.encode() + b"\0")
            pad()
            out.write(data)
            pad()

        for ino, name in enumerate(sorted(self.entries), start=1):
            entry(ino, name, *self.entries[name])
        entry(0, "TRAILER!!!", 0, b"", 0)
        return out.getvalue()


def _shared_libraries(binary: Path) -> list[Path]:
    """The ELF interpreter and libraries ``ldd`` reports for a dynamically linked binary."""
    libs = []
    for line in _run(["ldd", str(binary)], timeout=30).splitlines():
        match = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if match:
            libs.append(Path(match.group(1)))
    return libs


def build_initramfs(kernel: Kernel) -> bytes:
    """Everything the guest runs: busybox (static), dropbear and its libraries, modules, lab/guest files."""
    if not BUSYBOX.is_file():
        raise LabImageError("/bin/busybox is missing (apt install busybox-static)", path=str(BUSYBOX))
    probe = subprocess.run(["ldd", str(BUSYBOX)], capture_output=True, text=True, timeout=30, check=False)
    if "not a dynamic executable" not in probe.stdout + probe.stderr:
        raise LabImageError("/bin/busybox must be the static busybox (apt install busybox-static)", ldd=probe.stdout)
    cpio = Cpio()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "run", "tmp", "mnt", "root", "home",
              "var/run", "var/log", "etc/dropbear", "etc/acpi"):  # fmt: skip
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.chardev("dev/null", 1, 3, 0o666)
    cpio.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    for applet in _run([str(BUSYBOX), "--list"], timeout=30).split():
        if applet not in ("busybox",):
            cpio.symlink(f"bin/{applet}", "busybox")
    for binary in DROPBEAR:
        if not binary.is_file():
            raise LabImageError(f"{binary} is missing (apt install dropbear-bin)", path=str(binary))
        cpio.file(str(binary).lstrip("/"), binary.read_bytes(), 0o755)
        for lib in _shared_libraries(binary):
            cpio.file(str(lib).lstrip("/"), lib.resolve().read_bytes(), 0o755)
    order = module_load_order(kernel.modules, GUEST_MODULES)
    loaded = []
    for rel in order:
        plain = re.sub(r"\.(xz|zst|gz)$", "", rel)
        cpio.file(f"lib/modules/{kernel.version}/{plain}", _decompress_module(kernel.modules / rel))
        name = re.sub(r"\.ko$", "", os.path.basename(plain)).replace("-", "_")
        loaded.append(f"{plain} {MODULE_PARAMS[name]}" if name in MODULE_PARAMS else plain)
    cpio.file("etc/modules.load", "".join(f"{m}\n" for m in loaded).encode())
    for name, (dest, mode) in GUEST_FILES.items():
        cpio.file(dest, (GUEST_DIR / name).read_bytes(), mode)
    return gzip.compress(cpio.render(), compresslevel=6, mtime=0)


# ---------------------------------------------------------------------------
# UKI, ESP, disk
# ---------------------------------------------------------------------------


def build_uki(kernel: Kernel, initrd: Path, work: Path) -> Path:
    """stub + .osrel + .cmdline + .linux + .initrd, each section placed after the last one (aligned)."""
    if not STUB.is_file():
        raise LabImageError(f"{STUB} is missing (apt install systemd-boot-efi)", path=str(STUB))
    headers = _run(["objdump", "-h", str(STUB)], timeout=30)
    end = 0
    for line in headers.splitlines():
        cols = line.split()
        if len(cols) == 7 and cols[0].isdigit():
            end = max(end, int(cols[3], 16) + int(cols[2], 16))  # VMA + size
    align = int(re.search(r"SectionAlignment\s+([0-9a-fA-F]+)", _run(["objdump", "-p", str(STUB)], timeout=30)).group(1), 16)
    (work / "cmdline").write_text(CMDLINE + "\0")
    sections = [
        (".osrel", GUEST_DIR / "os-release"),
        (".cmdline", work / "cmdline"),
        (".linux", kernel.vmlinuz),
        (".initrd", initrd),
    ]
    argv = ["objcopy"]
    for name, path in sections:
        end += -end % align
        argv += ["--add-section", f"{name}={path}", "--change-section-vma", f"{name}={end:#x}"]
        end += path.stat().st_size
    uki = work / "BOOTX64.EFI"
    _run([*argv, str(STUB), str(uki)])
    _pin_pe_timestamp(uki, SOURCE_DATE_EPOCH)
    return uki


def _pin_pe_timestamp(path: Path, timestamp: int) -> None:
    """objcopy stamps the PE header with the build time: pin it (and redo the checksum) for reproducible bytes."""
    data = bytearray(path.read_bytes())
    pe = struct.unpack_from("<I", data, 0x3C)[0]
    if data[pe : pe + 4] != b"PE\0\0":
        raise LabImageError("objcopy output is not a PE image", path=str(path))
    struct.pack_into("<I", data, pe + 8, timestamp)  # COFF TimeDateStamp
    checksum_at = pe + 24 + 64  # optional header CheckSum (same offset in PE32 and PE32+)
    struct.pack_into("<I", data, checksum_at, 0)
    total = 0
    padded = bytes(data) + b"\0" * (len(data) % 2)
    for (word,) in struct.iter_unpack("<H", padded):
        total += word
        total = (total & 0xFFFF) + (total >> 16)
    struct.pack_into("<I", data, checksum_at, (total + len(data)) & 0xFFFFFFFF)
    path.write_bytes(bytes(data))


def build_esp(uki: Path, work: Path) -> Path:
    """A FAT filesystem image holding /EFI/BOOT/BOOTX64.EFI, made without mounting anything."""
    size_mib = (uki.stat().st_size + 4 * MiB) // MiB + 1
    esp = work / "esp.img"
    # Same inputs, same bytes: fixed volume id and FAT timestamps, so the image digest is reproducible.
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    os.utime(uki, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH))
    _run(["mkfs.vfat", "--invariant", "-C", "-n", "LABESP", str(esp), str(size_mib * 1024)], env=env)
    _run(["mmd", "-i", str(esp), "::/EFI", "::/EFI/BOOT"], env=env)
    _run(["mcopy", "-m", "-i", str(esp), str(uki), "::/EFI/BOOT/BOOTX64.EFI"], env=env)
    return esp


def build_disk(esp: Path, dest: Path) -> None:
    """GPT with the ESP as partition 1 (1 MiB aligned) and room for the backup header."""
    esp_size = esp.stat().st_size
    total = MiB + esp_size + MiB
    with open(dest, "wb") as fh:
        fh.truncate(total)
    script = (
        "label: gpt\n"
        "label-id: 6C616267-7565-7374-0000-000000000001\n"
        f"start=2048, size={esp_size // 512}, type={ESP_TYPE}, "
        'uuid=6C616267-7565-7374-0000-000000000002, name="ESP"\n'
    )
    _run(["sfdisk", "-q", "--no-reread", "--no-tell-kernel", str(dest)], stdin=script.encode(), timeout=60)
    with open(esp, "rb") as src, open(dest, "r+b") as dst:
        dst.seek(MiB)
        shutil.copyfileobj(src, dst, 4 * MiB)
        dst.flush()
        os.fsync(dst.fileno())


# ---------------------------------------------------------------------------
# Content-addressed build
# ---------------------------------------------------------------------------


def input_digest(kernel: Kernel) -> str:
    """Digest of every input of the image: the cache key."""
    digest = hashlib.sha256(BUILD_FORMAT.encode() + b"\0" + CMDLINE.encode() + b"\0")
    for path in (*kernel.debs, STUB, BUSYBOX, *DROPBEAR, Path(__file__).resolve()):
        digest.update(f"{path.name}\0{_sha256_file(path)}\0".encode())
    for name in sorted(GUEST_FILES):
        digest.update(f"guest/{name}\0{_sha256_file(GUEST_DIR / name)}\0".encode())
    digest.update(",".join(GUEST_MODULES).encode() + repr(sorted(MODULE_PARAMS.items())).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class GuestImage:
    path: Path
    sha256: str
    input_digest: str
    kernel_version: str
    built: bool  # False: the cache already had it


def ensure_guest_image(cache: Path = DEFAULT_CACHE, package: str | None = None) -> GuestImage:
    """The cached image for the current inputs, built when missing."""
    kernel = fetch_kernel(cache, package)
    key = input_digest(kernel)
    images = cache / "images"
    image = images / f"lab-guest-{key[:24]}.raw"
    manifest = image.with_suffix(".json")
    if image.is_file() and manifest.is_file():
        try:
            recorded = GuestImageManifest.model_validate_json(manifest.read_text())
        except ValueError:
            recorded = None  # torn or foreign manifest: build again
        if recorded is not None and recorded.input_digest == key:
            return GuestImage(image, recorded.sha256, key, kernel.version, built=False)
    images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=images, prefix=".build-") as tmp:
        work = Path(tmp)
        initrd = work / "initrd.gz"
        initrd.write_bytes(build_initramfs(kernel))
        uki = build_uki(kernel, initrd, work)
        esp = build_esp(uki, work)
        staged = work / "disk.raw"
        build_disk(esp, staged)
        sha = _sha256_file(staged)
        os.replace(staged, image)
    record = GuestImageManifest(input_digest=key, sha256=sha, kernel=kernel.version, cmdline=CMDLINE,
                                debs=[d.name for d in kernel.debs], boot_marker=BOOT_MARKER)  # fmt: skip
    write_atomic(manifest, (record.model_dump_json(indent=2) + "\n").encode(), mode=0o644)
    _prune(images, keep=KEEP_IMAGES)
    return GuestImage(image, sha, key, kernel.version, built=True)


def _prune(images: Path, keep: int) -> None:
    """Drop all but the ``keep`` newest images: every input change (a kernel update) leaves ~25 MiB behind."""
    built = sorted(images.glob("lab-guest-*.raw"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in built[keep:]:
        old.unlink(missing_ok=True)  # a reader that has it open keeps its data until it closes it
        old.with_suffix(".json").unlink(missing_ok=True)


def build_guest_image(out: Path, cache: Path = DEFAULT_CACHE, *, package: str | None = None) -> Path:
    """Make ``out`` the lab guest image for the current inputs (a no-op when it already is); returns its path.

    ``out``: the image file to write, or an existing directory to put it in under its cache name.
    """
    image = ensure_guest_image(cache, package)
    out = Path(out)
    if out.is_dir():
        out = out / image.path.name
    same = out.resolve() == image.path.resolve() or (
        out.is_file() and out.stat().st_size == image.path.stat().st_size and _sha256_file(out) == image.sha256
    )
    if not same:
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_name(f".{out.name}.tmp")
        shutil.copyfile(image.path, staged)
        os.replace(staged, out)
    return out


# Public names of the helpers the lab's other guest builders reuse (lab/qemu_backport.py, lab/igb_guest.py).
run_tool = _run
sha256_file = _sha256_file
natural_key = _natural_key
download_deb = _download
shared_libraries = _shared_libraries
decompress_module = _decompress_module


def print_built(build: Callable[[], str]) -> int:
    """A lab builder's command line: print the line ``build`` returns (exit 0), or its refusal with the evidence (1)."""
    try:
        line = build()
    except LabImageError as exc:
        print(f"{exc} {json.dumps(exc.evidence, default=str)}", file=sys.stderr)
        return 1
    print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cache directory [%(default)s]")
    parser.add_argument("--out", type=Path, help="also copy the image here")
    parser.add_argument("--kernel-package", help="kernel package to use instead of the newest one apt knows")
    args = parser.parse_args(argv)

    def build() -> str:
        image = ensure_guest_image(args.cache, args.kernel_package)
        path = build_guest_image(args.out, args.cache, package=args.kernel_package) if args.out else image.path
        return f"{path} sha256={image.sha256} kernel={image.kernel_version} built={str(image.built).lower()}"

    return print_built(build)


if __name__ == "__main__":
    sys.exit(main())
