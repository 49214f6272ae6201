"""Record exactly what discovery reads from a host into a fixture directory (docs/testing.md).

A fixture is a plain directory tree holding the same host paths as the
machine (``OUT/sys/bus/pci/devices/...``), so the real discovery code runs
over it through :class:`HostRoot`. The recorder walks a whitelist of names,
never the whole of ``/sys``: sysfs is huge, and some attributes block or have
side effects when read. Links are recreated with their very target string, so
a recording keeps the shape of the host (``/sys/bus/pci/devices`` entries
pointing into ``/sys/devices/pci*``) and recording a fixture gives the same
fixture back. Nothing is ever written outside OUT, and no device node is ever
opened.

:func:`record_fixture_archive` writes the same recording as one deterministic
``.tar.xz`` (:mod:`gpuaas_agent.discovery.fixture_archive`), the form ``fixtures/hosts/``
keeps: it records into a staging directory beside OUT, packs it and removes it.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuaas_agent import __version__
from gpuaas_agent.contract.fixture import (
    FIXTURE_META_DIR,
    MANIFEST_NAME,
    FixtureManifest,
    RecordedCommand,
    SkippedPath,
)
from gpuaas_agent.contract.types import MAJOR_MINOR_RE, PCI_ADDRESS_RE
from gpuaas_agent.discovery.fixture_archive import ARCHIVE_SUFFIX, pack_tree
from gpuaas_agent.errors import FixtureError, HostError
from gpuaas_agent.host.run import run_sync
from gpuaas_agent.hostfs import HostRoot, SymlinkLoopError

# sysfs files report a size of 4096 whatever they hold: read, never copy by size.
ATTR_CAP = 64 * 1024
# /proc tables can outgrow 64 KiB on hosts with many mounts; a truncated
# mountinfo would hide mounts from the disk guards, so these get more room and
# are skipped (never truncated) when even that is exceeded.
TABLE_CAP = 4 * 1024 * 1024
READ_CHUNK = 64 * 1024
COMMAND_TIMEOUT_S = 10

# The one PCI address shape (contract/types.py): 4 to 8 domain digits, so Intel VMD's 10000:e1:00.0 is recorded.
BDF_RE = PCI_ADDRESS_RE
VIRTFN_RE = re.compile(r"^virtfn\d+\Z")
NVME_CTRL_RE = re.compile(r"^nvme\d+\Z")
NVME_NS_RE = re.compile(r"^nvme\d+(c\d+)?n\d+\Z")
NODE_RE = re.compile(r"^node\d+\Z")

PCI_ATTRS = (
    "vendor", "device", "class", "subsystem_vendor", "subsystem_device", "revision",
    "numa_node", "local_cpulist", "enable", "driver_override",
    "sriov_totalvfs", "sriov_numvfs", "sriov_offset", "sriov_stride", "sriov_vf_device",
    "current_link_speed", "current_link_width", "max_link_speed", "max_link_width",
    "resource",  # BAR sizes: the guest's 64-bit MMIO window is computed from them (discovery/bars.py)
)
PCI_LINKS = ("driver", "iommu_group", "physfn", "subsystem")
NET_ATTRS = ("address", "operstate", "type", "mtu", "ifindex", "phys_port_name", "phys_switch_id")
IB_PORT_ATTRS = ("state", "phys_state", "link_layer", "rate", "lid")
# The firmware inventory (discovery/firmware.py): what the device runs and which image (PSID) it is.
IB_DEVICE_ATTRS = ("node_guid", "fw_ver", "board_id", "hca_type")
NVME_CTRL_ATTRS = (
    "serial", "model", "firmware_rev", "address", "transport", "cntlid", "state", "subsysnqn", "numa_node",
)
NVME_SUBSYS_ATTRS = ("model", "serial", "firmware_rev", "subsysnqn", "iopolicy")
BLOCK_ATTRS = (
    "dev", "size", "ro", "removable", "hidden", "wwid", "nguid", "eui", "uuid", "nsid", "partition", "start",
    "queue/logical_block_size", "dm/name", "dm/uuid",
)
DRIVER_CONTROL_FILES = ("bind", "unbind", "new_id", "remove_id")
DMI_ATTRS = (
    "sys_vendor", "product_name", "product_serial", "product_uuid", "board_serial", "bios_version", "bios_vendor",
    "bios_date", "bios_release",
)
# The nvidia and nvswitch drivers' per-device information (VBIOS / firmware versions: discovery/firmware.py).
NVIDIA_INFO_DIRS = ("/proc/driver/nvidia/gpus", "/proc/driver/nvidia-nvswitch/devices")
MODULES = (
    "vfio", "vfio_pci", "vfio_iommu_type1", "kvm", "kvm_intel", "kvm_amd", "nvidia", "mlx5_core", "openvswitch",
)
DEV_LINK_DIRS = ("/dev/disk/by-id", "/dev/disk/by-uuid", "/dev/mapper")
# Copied as regular files at their literal path: /proc/self is a link to a pid
# and /etc/os-release usually one to ../usr/lib/os-release; neither shape matters.
PROC_TABLES = (
    "/proc/self/mountinfo", "/proc/swaps", "/proc/cmdline", "/proc/meminfo",
    "/proc/sys/net/ipv4/ip_forward", "/proc/sys/kernel/hostname",
)
ETC_FILES = ("/etc/machine-id", "/etc/hostname", "/etc/os-release")
# What the slice parity checks read besides sysfs: dnsmasq and netplan config, the historical
# network-baseline units, the reboot flag; firmware images only as presence markers.
SLICE_CONFIG_FILES = (
    "/etc/dnsmasq.conf", "/run/reboot-required",
    *(f"{d}/{name}.service" for name in ("gpuaas-slice-host-net-baseline", "gpuaas-slice-network-baseline")
      for d in ("/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")),
)
SLICE_CONFIG_DIRS = ("/etc/dnsmasq.d", "/etc/netplan")
FIRMWARE_MARKERS = ("/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd")
COMMANDS = (
    ("ip-addr", ("ip", "-j", "addr")),
    ("ip-route", ("ip", "-j", "route")),
    ("ip-link", ("ip", "-j", "link")),
    ("iptables-save-nat", ("iptables-save", "-t", "nat")),
    ("nft-ruleset", ("nft", "-j", "list", "ruleset")),
)


def record_fixture(source: HostRoot, out: Path, *, run_commands: bool | None = None) -> FixtureManifest:
    """Snapshot what discovery reads from ``source`` into the new directory ``out``.

    ``run_commands`` defaults to ``source.is_live``: command outputs describe
    the machine running them, so they are never taken while recording a fixture.
    """
    out_dir = _prepare_output(source, Path(out))
    rec = _Recording(source=source, out=out_dir)
    for section in SECTIONS:
        section(rec)
    commands = _run_commands(rec) if (source.is_live if run_commands is None else run_commands) else []
    manifest = FixtureManifest(
        agent_version=__version__,
        source_root=str(source.root),
        live=source.is_live,
        hostname=_hostname(source),
        files=rec.files,
        links=rec.links,
        skipped=rec.skipped,
        commands=commands,
    )
    rec.write_meta(MANIFEST_NAME, (manifest.model_dump_json(indent=2) + "\n").encode())
    return manifest


def record_fixture_archive(source: HostRoot, out: Path, *, run_commands: bool | None = None) -> FixtureManifest:
    """Record ``source`` as the one new archive file ``out`` (``NAME.tar.xz``).

    The tree is recorded into a staging directory next to ``out`` (same
    checks as :func:`record_fixture`), packed, and removed again, also on failure.
    """
    out = Path(out)
    if not out.name.endswith(ARCHIVE_SUFFIX) or out.name == ARCHIVE_SUFFIX:
        raise FixtureError(
            f"archive output {str(out)!r} must be named NAME{ARCHIVE_SUFFIX}",
            code="archive_name",
            evidence={"out": str(out)},
        )
    if out.exists() or out.is_symlink():
        raise FixtureError(f"output {str(out)!r} already exists", code="output_exists", evidence={"out": str(out)})
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.recording-", dir=out.parent))
    try:
        manifest = record_fixture(source, staging, run_commands=run_commands)
        pack_tree(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _prepare_output(source: HostRoot, out: Path) -> Path:
    """Refuse a non-empty OUT (a recording never merges into another) or one inside the recorded paths."""
    if out.exists() or out.is_symlink():
        if not out.is_dir() or any(out.iterdir()):
            raise FixtureError(
                f"output {str(out)!r} exists and is not an empty directory",
                code="output_exists",
                evidence={"out": str(out)},
            )
    resolved = out.resolve()
    for top in ("sys", "dev", "proc", "run", "etc"):
        if resolved == source.root / top or (source.root / top) in resolved.parents:
            raise FixtureError(
                f"output {str(out)!r} lies inside the recorded source tree",
                code="output_inside_source",
                evidence={"out": str(resolved), "source_root": str(source.root)},
            )
    resolved.mkdir(parents=True, exist_ok=True)
    return resolved


def _hostname(source: HostRoot) -> str | None:
    """The recorded host's name, for people reading the manifest."""
    for path in ("/etc/hostname", "/proc/sys/kernel/hostname"):
        try:
            name = source.read_attr(path)
        except OSError:
            continue
        if name:
            return name
    return None


@dataclass
class _Recording:
    """Writes into OUT only, counting what it wrote and noting what it could not read."""

    source: HostRoot
    out: Path
    files: int = 0
    links: int = 0
    skipped: list[SkippedPath] = field(default_factory=list)
    _dirs: set[str] = field(default_factory=set)
    _visited: set[str] = field(default_factory=set)

    # -- destinations -----------------------------------------------------------

    def dest(self, host_path: str) -> Path:
        """OUT/<host path>, with parent directories made; refuses any path that could leave OUT.

        The path is normalised first (no ``..`` survives), and every parent
        inside OUT must be a real directory: writing through a link recorded
        earlier (``x -> /etc``) would land on the machine itself.
        """
        rel = posixpath.normpath("/" + host_path).lstrip("/")
        parts = rel.split("/") if rel else []
        if not parts or ".." in parts:
            raise FixtureError(f"refusing destination {host_path!r}", code="unsafe_destination")
        current = self.out
        for depth, name in enumerate(parts[:-1], start=1):
            current = current / name
            key = "/".join(parts[:depth])
            if key in self._dirs:
                continue
            self._ensure_real_dir(current, host_path)
            self._dirs.add(key)
        target = current / parts[-1]
        if os.path.commonpath([self.out, target]) != str(self.out):
            raise FixtureError(f"destination {str(target)!r} is outside OUT", code="unsafe_destination")
        return target

    def _ensure_real_dir(self, path: Path, host_path: str) -> None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            path.mkdir()
            return
        if not stat.S_ISDIR(mode):
            raise FixtureError(
                f"cannot record {host_path!r}: {str(path)!r} in OUT is not a directory",
                code="unsafe_destination",
                evidence={"host_path": host_path, "blocking": str(path)},
            )

    # -- writers ----------------------------------------------------------------

    def make_dir(self, host_path: str) -> None:
        path = self.dest(host_path)
        self._ensure_real_dir(path, host_path)
        self._dirs.add(posixpath.normpath("/" + host_path).lstrip("/"))

    def write_file(self, host_path: str, data: bytes) -> None:
        """Create a regular file; O_EXCL|O_NOFOLLOW so an existing link is never written through."""
        path = self.dest(host_path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            if stat.S_ISREG(os.lstat(path).st_mode):
                return  # reached twice (two routes to one directory): already recorded
            raise FixtureError(f"cannot record {host_path!r}: a non-file is already there", code="unsafe_destination") from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        self.files += 1

    def write_link(self, host_path: str, target: str) -> None:
        """Recreate a link with the very same target string (relative or absolute)."""
        path = self.dest(host_path)
        try:
            os.symlink(target, path)
        except FileExistsError:
            if os.path.islink(path) and os.readlink(path) == target:
                return
            raise FixtureError(
                f"cannot record link {host_path!r}: something else is already there", code="unsafe_destination"
            ) from None
        self.links += 1

    def write_meta(self, name: str, data: bytes) -> None:
        """The recorder's own files live under OUT/.gpuaas-fixture and are not host paths."""
        path = self.dest(f"/{FIXTURE_META_DIR}/{name}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)

    def skip(self, host_path: str, reason: str) -> None:
        self.skipped.append(SkippedPath(path=host_path, reason=reason))

    # -- traversal --------------------------------------------------------------

    def enter(self, host_path: str) -> str | None:
        """Resolve ``host_path`` inside the source, recording every link met on the way.

        The walk is :meth:`HostRoot.resolve` itself, so OUT resolves the path to
        the same place the source does; a fresh view each time, because a cached
        step would not report its links again. ``None`` (noted as skipped) on a link loop.
        """
        try:
            return self.source.fresh().resolve(host_path, on_link=self.write_link)
        except SymlinkLoopError:
            self.skip(host_path, "symlink loop")
            return None

    def begin_dir(self, resolved: str) -> bool:
        """Record a directory reached for the first time; False when seen already or not a directory."""
        if not self.first_visit(resolved) or not self.source.real(resolved).is_dir():
            return False
        self.make_dir(resolved)
        return True

    def first_visit(self, resolved: str) -> bool:
        """True once per resolved directory: hosts reach one device by several routes."""
        if resolved in self._visited:
            return False
        self._visited.add(resolved)
        return True

    def listdir(self, host_path: str) -> tuple[str | None, list[str]]:
        """Enter a directory, record it (even empty) and return its sorted names; absent -> no names."""
        resolved = self.enter(host_path)
        if resolved is None or not self.source.real(resolved).is_dir():
            return resolved, []
        try:
            names = sorted(os.listdir(self.source.real(resolved)))
        except OSError as exc:
            self.skip(resolved, f"cannot list: {exc.strerror or exc}")
            return resolved, []
        self.make_dir(resolved)
        return resolved, names

    def is_link(self, resolved_parent: str, name: str) -> bool:
        return os.path.islink(self.source.real(f"{resolved_parent}/{name}"))

    # -- copying ----------------------------------------------------------------

    def copy_link(self, host_path: str) -> str | None:
        """Record one link entry verbatim; returns where it leads, or None when it is no link."""
        parent, name = posixpath.split(posixpath.normpath("/" + host_path))
        resolved_parent = self.enter(parent)
        if resolved_parent is None or not self.is_link(resolved_parent, name):
            return None
        return self.enter(f"{resolved_parent}/{name}")

    def copy_attr(self, host_path: str, cap: int = ATTR_CAP) -> bool:
        """Copy one small text file through links; absent is silent, unreadable is noted."""
        resolved = self.enter(host_path)
        if resolved is None:
            return False
        data = self._read(resolved, cap)
        if data is None:
            return False
        self.write_file(resolved, data)
        return True

    def copy_flat(self, host_path: str, cap: int = TABLE_CAP) -> None:
        """Copy a file's text to its literal path, not recording links on the way (see PROC_TABLES)."""
        try:
            resolved = self.source.resolve(host_path)
        except SymlinkLoopError:
            self.skip(host_path, "symlink loop")
            return
        if not os.path.lexists(self.source.real(resolved)):
            self.skip(host_path, "absent on source")
            return
        data = self._read(resolved, cap, note_as=host_path)
        if data is not None:
            self.write_file(host_path, data)

    def copy_attrs(self, directory: str, names: tuple[str, ...]) -> None:
        for name in names:
            self.copy_attr(f"{directory}/{name}")

    def marker(self, host_path: str) -> None:
        """An empty regular file standing for a device node or a write-only control file.

        A recording cannot hold device nodes, and ``bind``/``unbind`` must
        never be opened: only their existence is recorded.
        """
        self.write_file(host_path, b"")

    def _read(self, resolved: str, cap: int, note_as: str | None = None) -> bytes | None:
        """Bytes of a regular text file, or None (noted) when it is binary, too big or unreadable."""
        where = note_as or resolved
        real = self.source.real(resolved)
        try:
            mode = os.lstat(real).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self.skip(where, f"cannot stat: {exc.strerror or exc}")
            return None
        if not stat.S_ISREG(mode):  # never open a device node, fifo or socket
            self.skip(where, "not a regular file")
            return None
        try:
            data = _read_capped(real, cap)
        except OSError as exc:
            self.skip(where, f"unreadable: {exc.strerror or exc}")
            return None
        if data is None:
            self.skip(where, f"larger than {cap // 1024} KiB")
            return None
        if b"\0" in data:
            self.skip(where, "binary content")
            return None
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            self.skip(where, "not UTF-8 text")
            return None
        return data


def _read_capped(real: Path, cap: int) -> bytes | None:
    """Read at most ``cap`` bytes; None when the file holds more."""
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file")
        chunks: list[bytes] = []
        total = 0
        while total <= cap:
            # Small reads: /proc/sys handlers allocate the whole request and
            # answer ENOMEM to a 4 MiB one.
            chunk = os.read(fd, min(READ_CHUNK, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    return None if total > cap else b"".join(chunks)


# -- sections: one per kind of thing discovery reads ------------------------------


Visitor = Callable[["_Recording", str], None]


def _bdf_ancestors(resolved: str) -> list[str]:
    """Device directories of the bridges above a PCI function (root port first)."""
    parts = resolved.split("/")
    return ["/".join(parts[: i + 1]) for i, name in enumerate(parts[:-1]) if BDF_RE.match(name)]


def _pci_device(rec: _Recording, directory: str) -> None:
    """One PCI function: attributes, relation links, netdevs, IB ports, NVMe controllers, bridges above."""
    if not rec.begin_dir(directory):
        return
    for ancestor in _bdf_ancestors(directory):
        _pci_device(rec, ancestor)
    rec.copy_attrs(directory, PCI_ATTRS)
    names = rec.source.listdir(directory)
    for name in names:
        if name in PCI_LINKS or VIRTFN_RE.match(name):
            target = rec.copy_link(f"{directory}/{name}")
            if target is not None and (name == "physfn" or VIRTFN_RE.match(name)):
                _pci_device(rec, target)  # PF and VFs are PCI functions of their own
    _children(rec, directory, names, "net", _netdev)
    _children(rec, directory, names, "infiniband", _ib_device)
    _children(rec, directory, names, "nvme", _nvme_controller)


def _children(rec: _Recording, directory: str, names: list[str], sub: str, visit: Visitor) -> None:
    """Visit each entry of a class subdirectory (``net/``, ``infiniband/``, ``nvme/``) of a device."""
    if sub not in names:
        return
    base, children = rec.listdir(f"{directory}/{sub}")
    for child in children:
        resolved = rec.enter(f"{base}/{child}")
        if resolved is not None:
            visit(rec, resolved)


def _netdev(rec: _Recording, directory: str) -> None:
    if rec.begin_dir(directory):
        rec.copy_attrs(directory, NET_ATTRS)


def _ib_device(rec: _Recording, directory: str) -> None:
    if not rec.begin_dir(directory):
        return
    rec.copy_attrs(directory, IB_DEVICE_ATTRS)
    rec.copy_link(f"{directory}/device")  # which PCI function runs that firmware
    ports, names = rec.listdir(f"{directory}/ports")
    for port in names:
        rec.copy_attrs(f"{ports}/{port}", IB_PORT_ATTRS)


def _nvme_controller(rec: _Recording, directory: str) -> None:
    """A controller and the namespace (or per-path ``nvmeXcYnZ``) block nodes under it."""
    if not rec.begin_dir(directory):
        return
    rec.copy_attrs(directory, NVME_CTRL_ATTRS)
    rec.copy_link(f"{directory}/device")
    for name in rec.source.listdir(directory):
        if NVME_NS_RE.match(name):
            resolved = rec.enter(f"{directory}/{name}")
            if resolved is not None:
                _block_node(rec, resolved)


def _nvme_subsystem(rec: _Recording, directory: str) -> None:
    """Native multipath: the subsystem holds the namespace heads and links to each controller."""
    if not rec.begin_dir(directory):
        return
    rec.copy_attrs(directory, NVME_SUBSYS_ATTRS)
    for name in rec.source.listdir(directory):
        if NVME_CTRL_RE.match(name) or NVME_NS_RE.match(name):
            resolved = rec.enter(f"{directory}/{name}")
            if resolved is None:
                continue
            if NVME_CTRL_RE.match(name):
                _nvme_controller(rec, resolved)
            else:
                _block_node(rec, resolved)


def _block_node(rec: _Recording, directory: str) -> None:
    """A disk or partition: attributes, ``device``/holder/slave links, its partitions and udev record."""
    if not rec.begin_dir(directory):
        return
    rec.copy_attrs(directory, BLOCK_ATTRS)
    rec.copy_link(f"{directory}/device")
    for sub in ("holders", "slaves"):
        base, names = rec.listdir(f"{directory}/{sub}")
        for name in names:
            target = rec.copy_link(f"{base}/{name}")
            if target is not None:
                _block_node(rec, target)
    own = posixpath.basename(directory)
    for name in rec.source.listdir(directory):  # partitions are subdirectories of their disk
        if name.startswith(own) and not rec.is_link(directory, name) and rec.source.exists(f"{directory}/{name}/partition"):
            _block_node(rec, f"{directory}/{name}")
    dev = _recorded_text(rec, f"{directory}/dev")
    if dev and MAJOR_MINOR_RE.fullmatch(dev):
        rec.copy_attr(f"/run/udev/data/b{dev}")


def _recorded_text(rec: _Recording, host_path: str) -> str | None:
    """An attribute as recorded in OUT (so nothing is read twice from the host)."""
    try:
        return rec.dest(host_path).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _class_links(rec: _Recording, class_dir: str, visit: Visitor) -> None:
    """Each link of a ``/sys/class/*`` (or ``/sys/block``) directory and the device it leads to."""
    base, names = rec.listdir(class_dir)
    for name in names:
        resolved = rec.enter(f"{base}/{name}")
        if resolved is not None:
            visit(rec, resolved)


def _note_absent(rec: _Recording, host_path: str) -> bool:
    """Whole whitelisted subtrees missing on the source are worth one line in the manifest."""
    if rec.source.exists(host_path):
        return False
    rec.skip(host_path, "absent on source")
    return True


def record_pci(rec: _Recording) -> None:
    if _note_absent(rec, "/sys/bus/pci/devices"):
        return
    base, names = rec.listdir("/sys/bus/pci/devices")
    for name in names:
        resolved = rec.enter(f"{base}/{name}")
        if resolved is not None and BDF_RE.match(name):
            _pci_device(rec, resolved)


def record_iommu_groups(rec: _Recording) -> None:
    if _note_absent(rec, "/sys/kernel/iommu_groups"):
        return
    base, groups = rec.listdir("/sys/kernel/iommu_groups")
    for group in groups:
        group_dir = rec.enter(f"{base}/{group}")
        if group_dir is None:
            continue
        rec.copy_attr(f"{group_dir}/type")
        devices, names = rec.listdir(f"{group_dir}/devices")
        for name in names:
            rec.copy_link(f"{devices}/{name}")


def record_pci_drivers(rec: _Recording) -> None:
    """Driver directories with their control files as empty markers: never read or write them."""
    base, drivers = rec.listdir("/sys/bus/pci/drivers")
    for driver in drivers:
        directory = rec.enter(f"{base}/{driver}")
        if directory is None or not rec.source.real(directory).is_dir():
            continue
        rec.make_dir(directory)
        for name in rec.source.listdir(directory):
            if name in DRIVER_CONTROL_FILES:
                rec.marker(f"{directory}/{name}")
            elif BDF_RE.match(name):
                rec.copy_link(f"{directory}/{name}")
    probe = rec.enter("/sys/bus/pci/drivers_probe")
    if probe is not None and os.path.lexists(rec.source.real(probe)):
        rec.marker(probe)


def record_block(rec: _Recording) -> None:
    for class_dir in ("/sys/class/block", "/sys/block"):
        _class_links(rec, class_dir, _block_node)
    base, names = rec.listdir("/sys/dev/block")
    for name in names:
        target = rec.copy_link(f"{base}/{name}")
        if target is not None:
            _block_node(rec, target)


def record_nvme(rec: _Recording) -> None:
    _class_links(rec, "/sys/class/nvme", _nvme_controller)
    _class_links(rec, "/sys/class/nvme-subsystem", _nvme_subsystem)


def record_net(rec: _Recording) -> None:
    _class_links(rec, "/sys/class/infiniband", _ib_device)
    _class_links(rec, "/sys/class/net", _netdev)


def record_numa(rec: _Recording) -> None:
    base = "/sys/devices/system/node"
    rec.copy_attrs(base, ("online", "possible"))
    _, nodes = rec.listdir(base)
    for node in (n for n in nodes if NODE_RE.match(n)):
        rec.copy_attrs(f"{base}/{node}", ("cpulist", "meminfo"))
        pages, sizes = rec.listdir(f"{base}/{node}/hugepages")
        for size in sizes:
            rec.copy_attrs(f"{pages}/{size}", ("nr_hugepages", "free_hugepages"))


def record_dmi(rec: _Recording) -> None:
    """Some DMI files (serials, uuid) are root-only: unreadable ones are noted, not fatal."""
    if not _note_absent(rec, "/sys/class/dmi/id"):
        rec.copy_attrs("/sys/class/dmi/id", DMI_ATTRS)


def record_firmware(rec: _Recording) -> None:
    """The drivers' ``information`` file per GPU / NVSwitch (``Video BIOS:``), copied flat; absent ones are silent."""
    for base in NVIDIA_INFO_DIRS:
        if not rec.source.is_dir(base):
            continue
        for name in sorted(rec.source.listdir(base)):
            rec.copy_flat(f"{base}/{name}/information", ATTR_CAP)


def record_modules(rec: _Recording) -> None:
    """Loaded modules as directories: presence is all discovery asks.

    ``initstate`` ("live", loadable modules only) is copied too because git
    keeps no empty directory: without it a committed recording would lose
    the module. A built-in module has no such file and stays an empty directory.
    """
    for module in MODULES:
        path = f"/sys/module/{module}"
        if rec.source.is_dir(path):
            resolved = rec.enter(path)
            if resolved is not None:
                rec.make_dir(resolved)
                rec.copy_attr(f"{resolved}/initstate")


def record_dev(rec: _Recording) -> None:
    """Stable-name links verbatim; device nodes (/dev/kvm, /dev/vfio/*, /dev/nvidia*) as empty markers."""
    _note_absent(rec, "/dev/disk/by-id")
    for directory in DEV_LINK_DIRS:
        base, names = rec.listdir(directory)
        for name in names:
            _dev_entry(rec, f"{base}/{name}")
    _dev_entry(rec, "/dev/kvm")
    _dev_entry(rec, "/dev/vfio", depth=2)
    base, names = rec.listdir("/dev")
    for name in names:
        if name.startswith("nvidia"):
            _dev_entry(rec, f"{base}/{name}", depth=1)


def _dev_entry(rec: _Recording, host_path: str, depth: int = 0) -> None:
    """A link is copied verbatim; a directory is made (and its entries visited to ``depth``); anything else is a marker."""
    parent, name = posixpath.split(host_path)
    resolved_parent = rec.enter(parent)
    if resolved_parent is None:
        return
    entry = f"{resolved_parent}/{name}"
    real = rec.source.real(entry)
    if os.path.islink(real):
        rec.write_link(entry, os.readlink(real))
    elif real.is_dir():
        rec.make_dir(entry)
        if depth > 0:
            for child in sorted(os.listdir(real)):
                _dev_entry(rec, f"{entry}/{child}", depth - 1)
    elif os.path.lexists(real):
        rec.marker(entry)


def record_proc_and_etc(rec: _Recording) -> None:
    for path in PROC_TABLES:
        rec.copy_flat(path)
    for path in ETC_FILES:
        rec.copy_flat(path, ATTR_CAP)


def record_slice_config(rec: _Recording) -> None:
    """Config files copied flat (absent ones are not noted: most hosts lack some); firmware as markers."""
    for path in SLICE_CONFIG_FILES:
        if os.path.lexists(rec.source.real(path)):
            rec.copy_flat(path, ATTR_CAP)
    for directory in SLICE_CONFIG_DIRS:
        if not rec.source.is_dir(directory):
            continue
        for name in rec.source.listdir(directory):
            path = f"{directory}/{name}"
            if not rec.source.is_dir(path):
                rec.copy_flat(path, ATTR_CAP)
    for path in FIRMWARE_MARKERS:
        if rec.source.exists(path):
            rec.marker(path)


SECTIONS = (
    record_pci,
    record_iommu_groups,
    record_pci_drivers,
    record_block,
    record_nvme,
    record_net,
    record_numa,
    record_dmi,
    record_firmware,
    record_modules,
    record_dev,
    record_proc_and_etc,
    record_slice_config,
)


# -- commands (live host only) ------------------------------------------------------


def _run_commands(rec: _Recording) -> list[RecordedCommand]:
    return [_run_one(rec, name, list(argv)) for name, argv in COMMANDS]


def _run_one(rec: _Recording, name: str, argv: list[str]) -> RecordedCommand:
    """Run one read-only command; a missing tool or a failure is recorded, not raised."""
    try:
        done = run_sync(argv, timeout=COMMAND_TIMEOUT_S, check=False)
    except HostError as exc:
        error: str | None = {"command_not_found": f"{argv[0]} is not installed",
                 "command_timeout": f"timed out after {COMMAND_TIMEOUT_S} s"}.get(exc.code, exc.message)
        return RecordedCommand(name=name, argv=argv, error=error)
    except OSError as exc:
        return RecordedCommand(name=name, argv=argv, error=f"cannot run: {exc.strerror or exc}")
    output_file = f"commands/{name}.out"
    rec.write_meta(output_file, done.stdout)
    error = None
    if done.returncode != 0:
        error = done.stderr.decode("utf-8", errors="replace").strip()[:500] or f"exit code {done.returncode}"
    return RecordedCommand(name=name, argv=argv, exit_code=done.returncode, output_file=output_file, error=error)
