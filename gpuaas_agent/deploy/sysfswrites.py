"""The sysfs files the agent writes on this host, as the unit drop-in that opens exactly them.

The unit keeps all of ``/sys`` read-only (``ProtectKernelTunables=yes``). ``ReadWritePaths=``
takes no wildcards and PCI paths differ per host, so ``prepare-host --sysfs-dropin`` (run by
the package's postinst and by the unit's ``ExecStartPre=+``, outside the sandbox) discovers
the host's candidate slots and writes a drop-in naming, and opening read-write, only:

- each slot GPU's and fabric VF's own device directory (its real ``/sys/devices/pci…/ADDR``):
  ``driver_override`` (host/devices/vfio.py), ``reset`` (FLR of the VF, host/devices/gpuhandover.py), ``rom``
  (host/devices/pcirom.py), and the GPU's ``config`` and BAR ``resourceN`` that NVIDIA's gpu-admin-tools
  opens read-write (host/devices/gpuadmin.py);
- the ``config`` file of every PCI bridge above a slot GPU up to its root port: gpu-admin-tools
  opens the config space of the whole parent chain ``O_RDWR`` and the secondary bus reset is a
  write to the upstream bridge's bridge-control register;
- ``/sys/bus/pci/drivers/<driver>/unbind`` of the drivers a slot function leaves when it is bound
  to vfio-pci (its driver now, and the usual one for its kind where loaded: nvidia/nouveau for
  a GPU, mlx5_core for a fabric VF); never the unbind of the boot disk's or the host NIC's driver;
- ``/sys/bus/pci/drivers_probe`` (the bind step after ``driver_override``).

Nothing else: no ``new_id``/``remove_id``, no ``sriov_numvfs`` (the agent reads it), no
``remove``/``rescan`` (the agent never passes gpu-admin-tools an option that uses them), and no
other PCI root's devices, ``/sys/kernel`` or ``/sys/devices/platform``.

A slot device that appears after the drop-in was loaded (hot-add, VFs created later) is not in
the sandbox's writable set; :func:`check_lines` (``prepare-host --check``, inside the sandbox)
and :func:`sysfs_writable_check` name such a path before a provision would fail on it.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuaas_agent.contract.parity import ParityCheck, ParityStatus
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.contract.types import PCI_ADDRESS_RE
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot

DROPIN = Path("/etc/systemd/system/gpuaas-agent.service.d/50-sysfs-writes.conf")
PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"
VFIO_DRIVER = "vfio-pci"
# The driver a function of each kind usually sits on before its first bind (after every boot).
USUAL_DRIVERS = {"gpu": ("nvidia", "nouveau"), "fabric_vf": ("mlx5_core",)}
REMEDY = "systemctl daemon-reload && systemctl restart gpuaas-agent (prepare-host rewrote the drop-in at this start)"


@dataclass(frozen=True)
class WritablePath:
    item: str  # what the agent writes there, e.g. "slot0.gpu", "slot0.gpu.bridge", "driver.nvidia.unbind"
    path: str  # on-disk path (under the host root; the real /sys path on a live host)


def slot_functions(report: TopologyReport) -> list[tuple[str, str, str]]:
    """(item, kind, PCI address) of every function a provision or a handover may write: GPUs and fabric VFs."""
    functions = []
    for slot in report.candidate_slots:
        functions.append((f"slot{slot.slot_index}.gpu", "gpu", str(slot.gpu_pci_address)))
        if slot.fabric_vf_pci_address is not None:
            functions.append((f"slot{slot.slot_index}.fabric_vf", "fabric_vf", str(slot.fabric_vf_pci_address)))
    return functions


def _bridges(device: str) -> list[str]:
    """Host paths of the PCI bridges above ``device`` (a resolved ``/sys/devices/pci…/ADDR``), nearest first."""
    out = []
    parent = posixpath.dirname(device)
    while PCI_ADDRESS_RE.fullmatch(posixpath.basename(parent)):
        out.append(parent)
        parent = posixpath.dirname(parent)
    return out


def write_set(host: HostRoot, functions: Iterable[tuple[str, str, str]]) -> list[WritablePath]:
    """Every path the agent writes for ``functions``, deduplicated, in a stable order (see the module doc)."""
    found: dict[str, WritablePath] = {}

    def keep_path(item: str, host_path: str) -> None:
        found.setdefault(str(host.real(host_path)), WritablePath(item, str(host.real(host_path))))

    drivers: dict[str, None] = {}
    for item, kind, address in functions:
        device = host.resolve(f"{PCI_DEVICES}/{address}")
        if not host.is_dir(device):
            continue  # not on this host (any more): nothing to open
        keep_path(item, device)
        if kind == "gpu":
            for bridge in _bridges(device):
                if host.exists(f"{bridge}/config"):  # always on a live host; a recording may lack it
                    keep_path(f"{item}.bridge", f"{bridge}/config")
        current = host.link_name(f"{device}/driver")
        for driver in (current, *USUAL_DRIVERS.get(kind, ())):
            if driver and driver != VFIO_DRIVER and host.exists(f"{PCI_DRIVERS}/{driver}/unbind"):
                drivers.setdefault(driver)
    for driver in drivers:
        keep_path(f"driver.{driver}.unbind", f"{PCI_DRIVERS}/{driver}/unbind")
    if found:
        keep_path("drivers_probe", DRIVERS_PROBE)
    return list(found.values())


def host_write_set(host: HostRoot) -> list[WritablePath]:
    """The write set of ``host`` from its discovery (what the daemon would offer as slots)."""
    return write_set(host, slot_functions(discover(host)))


def _quote(path: str) -> str:
    """A path as one word of a unit file: specifiers escaped, quoted when it has blanks or quotes."""
    word = "-" + path.replace("%", "%%")
    if re.search(r"[\s\"'\\]", word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def render_dropin(paths: list[WritablePath], *, host_root: str) -> str:
    """The drop-in text: one ``ReadWritePaths=`` line per path, each after a comment saying why."""
    lines = [
        "# Generated by `gpuaas-agent prepare-host --sysfs-dropin` from the discovery of this host:",
        f"# host_root {host_root}",
        "# Rewritten at every start of gpuaas-agent.service, applied at the next `systemctl daemon-reload`.",
        "# Do not edit: the unit keeps /sys read-only (ProtectKernelTunables=yes) and this opens only",
        "# the sysfs files the agent writes (gpuaas_agent/deploy/sysfswrites.py).",
        "# '-': a device gone since (removed, renumbered) is skipped instead of failing the start.",
        "[Service]",
    ]
    if not paths:
        lines.append("# No slot device found: nothing under /sys is writable.")
    for p in paths:
        lines.append(f"# {p.item}")
        lines.append(f"ReadWritePaths={_quote(p.path)}")
    return "\n".join(lines) + "\n"


def write_dropin(path: Path, text: str) -> str:
    """Write ``text`` to ``path`` unless it is there already; ``changed`` or ``unchanged``."""
    try:
        if path.read_text() == text:
            return "unchanged"
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)
    return "changed"


def writable_here(path: str) -> str:
    """``ok``, ``read_only`` (the mount holding it is read-only in this namespace) or ``missing``."""
    try:
        flags = os.statvfs(path).f_flag
    except FileNotFoundError:
        return "missing"
    return "read_only" if flags & os.ST_RDONLY else "ok"


def check_lines(paths: list[WritablePath]) -> list[str]:
    """``prepare-host --check``: one line per path, its outcome in this namespace (the unit's sandbox).

    Not fatal: a device added after the drop-in was loaded costs that slot, not the node; the line
    names the path and the fix, and :func:`sysfs_writable_check` refuses the slot in preflight.
    """
    lines = []
    for p in paths:
        outcome = writable_here(p.path)
        fix = f" fix={REMEDY!r}" if outcome != "ok" else ""
        lines.append(f"GPUAAS_PREPARE_HOST item=sysfs.{p.item} path={p.path} outcome={outcome}{fix}")
    return lines


def sysfs_writable_check(paths: list[WritablePath]) -> ParityCheck:
    """Preflight: every sysfs path a provision or handover of a candidate slot writes is writable from here."""
    blocked = [(p, o) for p in paths if (o := writable_here(p.path)) != "ok"]
    if blocked:
        named = "; ".join(f"{p.item} {p.path} ({o})" for p, o in blocked)
        return ParityCheck(status=ParityStatus.FAIL, check="sysfs_writable", hard=True, remediation=REMEDY,
                           detail=f"{len(blocked)} sysfs path(s) a provision writes are not writable in the "
                                  f"agent's sandbox: {named}",
                           evidence="statvfs ST_RDONLY / ENOENT per path")
    return ParityCheck(status=ParityStatus.PASS, check="sysfs_writable", hard=True,
                       detail=f"all {len(paths)} sysfs paths the slots' provision and handover write are writable",
                       evidence="statvfs per path")
