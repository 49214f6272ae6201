"""The sysfs files the agent writes on this host, as the unit drop-in that opens exactly them.

The unit keeps all of ``/sys`` read-only (``ProtectKernelTunables=yes``). ``ReadWritePaths=``
takes no wildcards and PCI paths differ per host, so ``prepare-host --sysfs-dropin`` (run by
the package's postinst and by the unit's ``ExecStartPre=+``, outside the sandbox) discovers
the host's candidate slots and writes a drop-in naming, and opening read-write, only these files
(each by its real ``/sys/devices/pci…/ADDR/<file>`` path; never a device directory, whose
``remove``, ``rescan``, ``enable``, ``sriov_*`` and ``driver/`` would come with it):

- a slot GPU's ``driver_override`` (host/devices/vfio.py), ``rom`` (host/devices/pcirom.py), and
  the ``config`` and BAR0 ``resource0`` that NVIDIA's gpu-admin-tools opens read-write
  (host/devices/gpuadmin.py; its FLR and SBR are config-space writes, it maps BAR0 only);
- a slot fabric VF's ``driver_override`` and ``reset`` (its FLR, host/devices/gpuhandover.py);
- the ``config`` file of every PCI bridge above a slot GPU up to its root port: gpu-admin-tools
  opens the config space of the whole parent chain ``O_RDWR`` and the secondary bus reset is a
  write to the upstream bridge's bridge-control register;
- ``/sys/bus/pci/drivers/<driver>/unbind`` of the drivers a slot function leaves when it is bound
  to vfio-pci (its driver now, and the usual one for its kind where loaded: nvidia/nouveau for
  a GPU, mlx5_core for a fabric VF); never the unbind of the boot disk's driver, and **never the
  unbind of a driver a host NIC is bound to** (:func:`host_nic_drivers`: an interface carrying a
  default route, IPv4 or IPv6, and every lower device under it: bond slaves, bridge ports, a VLAN's
  parent). An ``unbind`` file takes any PCI address, so opening ``mlx5_core/unbind`` on a host whose
  management NIC is a ConnectX would let the agent (or whoever runs as it) cut the host off the
  network. Such an unbind is left out with its evidence (:class:`RefusedPath`: the drop-in's
  comments, ``prepare-host --check``, and the preflight's ``sysfs_writable`` check, which fails for
  a slot function still bound to that driver: bind its VFs to vfio-pci at boot instead, e.g.
  ``sriov_drivers_autoprobe=0``);
- ``/sys/bus/pci/drivers_probe`` (the bind step after ``driver_override``).

Nothing else: no ``new_id``/``remove_id``, no ``sriov_numvfs`` (the agent reads it), no
``remove``/``rescan`` (the agent never passes gpu-admin-tools an option that uses them), and no
other PCI root's devices, ``/sys/kernel`` or ``/sys/devices/platform``.

A slot device that appears after the drop-in was loaded (hot-add, VFs created later) is not in
the sandbox's writable set; :func:`check_lines` (``prepare-host --check``, inside the sandbox)
and :func:`sysfs_writable_check` name such a path before a provision would fail on it.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuaas_agent.contract.fixture import FIXTURE_META_DIR
from gpuaas_agent.contract.parity import ParityCheck, ParityStatus
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.contract.types import PCI_ADDRESS_RE
from gpuaas_agent.discovery.netevidence import parse_ip_route
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot

DROPIN = Path("/etc/systemd/system/gpuaas-agent.service.d/50-sysfs-writes.conf")
PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"
VFIO_DRIVER = "vfio-pci"
# The driver a function of each kind usually sits on before its first bind (after every boot).
USUAL_DRIVERS = {"gpu": ("nvidia", "nouveau"), "fabric_vf": ("mlx5_core",)}
# The files of a slot function the agent writes (see the module doc for who writes each).
FUNCTION_FILES = {"gpu": ("driver_override", "rom", "config", "resource0"), "fabric_vf": ("driver_override", "reset")}
NET_CLASS = "/sys/class/net"
REMEDY = "systemctl daemon-reload && systemctl restart gpuaas-agent (prepare-host rewrote the drop-in at this start)"


@dataclass(frozen=True)
class WritablePath:
    item: str  # what the agent writes there, e.g. "slot0.gpu", "slot0.gpu.bridge", "driver.nvidia.unbind"
    path: str  # on-disk path (under the host root; the real /sys path on a live host)


@dataclass(frozen=True)
class RefusedPath:
    """A file the agent would write that stays read-only, and why (``host_nic_driver``), with the evidence."""

    item: str
    path: str
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def blocks(self) -> list[str]:
        """The slot functions bound to that driver now: they cannot be moved to vfio-pci from the sandbox."""
        return list(self.evidence.get("slot_functions_on_driver", []))


def _default_route_devices(host: HostRoot) -> tuple[list[str], str]:
    """Interfaces carrying a default route, and where that was read: ``/proc/net/route`` and ``ipv6_route``
    of a live host (the namespace prepare-host runs in, the host's), else a recording's ``ip -j route``."""
    devices: list[str] = []
    sources = []
    try:
        for line in host.read_text("/proc/net/route").splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 8 and cols[1] == "00000000" and cols[7] == "00000000":
                devices.append(cols[0])
        sources.append("/proc/net/route")
    except OSError:
        pass
    try:
        for line in host.read_text("/proc/net/ipv6_route").splitlines():
            cols = line.split()
            if len(cols) >= 10 and cols[0] == "0" * 32 and cols[1] == "00" and cols[9] != "lo":
                devices.append(cols[9])
        sources.append("/proc/net/ipv6_route")
    except OSError:
        pass
    if not sources:
        try:
            text = (host.root / FIXTURE_META_DIR / "commands" / "ip-route.out").read_text(encoding="utf-8")
            devices += [r.dev for r in parse_ip_route(text) if r.dst == "default" and r.dev]
            sources.append(f"{FIXTURE_META_DIR}/commands/ip-route.out")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return sorted(set(devices)), ", ".join(sources)


def _lower_devices(host: HostRoot, name: str) -> list[str]:
    """``name`` and every device under it: bond slaves and a VLAN's parent (``lower_*``), bridge ports (``brif``)."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen or not re.fullmatch(r"[^/\s]{1,15}", current):
            continue
        seen.append(current)
        try:
            entries = host.listdir(f"{NET_CLASS}/{current}")
        except OSError:
            continue
        todo += [e.removeprefix("lower_") for e in entries if e.startswith("lower_")]
        if "brif" in entries:
            try:
                todo += host.listdir(f"{NET_CLASS}/{current}/brif")
            except OSError:
                pass
    return seen


def _device_drivers(host: HostRoot, device_link: str) -> list[str]:
    """The drivers from a netdev's device up to its PCI function: ``mlx5_core``; ``virtio_net`` and ``virtio-pci``."""
    try:
        path = host.resolve(device_link)
    except OSError:
        return []
    found: list[str] = []
    while host.is_dir(path) and path.startswith("/sys/devices/"):
        driver = host.link_name(f"{path}/driver")
        if driver and driver not in found:
            found.append(driver)
        if PCI_ADDRESS_RE.fullmatch(posixpath.basename(path)):
            break
        path = posixpath.dirname(path)
    return found


def host_nic_drivers(host: HostRoot) -> dict[str, Any]:
    """The drivers of the host's management NICs: ``{"drivers": {driver: [interfaces]}, "default_route": [...],
    "source": ..., "known": bool}``. ``known`` is False when no default route could be read: then every
    driver a slot function may leave is treated as a host NIC's (nothing is known to be safe to unbind)."""
    routes, source = _default_route_devices(host)
    drivers: dict[str, list[str]] = {}
    for dev in routes:
        for name in _lower_devices(host, dev):
            for driver in _device_drivers(host, f"{NET_CLASS}/{name}/device"):
                drivers.setdefault(driver, []).append(name)
    return {"drivers": drivers, "default_route": routes, "source": source, "known": bool(source)}


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


def plan_writes(host: HostRoot, functions: Iterable[tuple[str, str, str]]) -> tuple[list[WritablePath],
                                                                                    list[RefusedPath]]:
    """Every file the agent writes for ``functions`` (deduplicated, stable order), and the unbinds refused."""
    found: dict[str, WritablePath] = {}

    def keep_path(item: str, host_path: str) -> None:
        found.setdefault(str(host.real(host_path)), WritablePath(item, str(host.real(host_path))))

    drivers: dict[str, list[str]] = {}
    for item, kind, address in functions:
        device = host.resolve(f"{PCI_DEVICES}/{address}")
        if not host.is_dir(device):
            continue  # not on this host (any more): nothing to open
        for name in FUNCTION_FILES.get(kind, ()):
            if host.exists(f"{device}/{name}"):  # a function without a ROM or FLR has no such file to open
                keep_path(f"{item}.{name}", f"{device}/{name}")
        if kind == "gpu":
            for bridge in _bridges(device):
                if host.exists(f"{bridge}/config"):  # always on a live host; a recording may lack it
                    keep_path(f"{item}.bridge", f"{bridge}/config")
        current = host.link_name(f"{device}/driver")
        for driver in dict.fromkeys((current, *USUAL_DRIVERS.get(kind, ()))):
            if driver and driver != VFIO_DRIVER and host.exists(f"{PCI_DRIVERS}/{driver}/unbind"):
                on_it = drivers.setdefault(driver, [])
                if driver == current:
                    on_it.append(f"{item} {address}")
    refused: list[RefusedPath] = []
    nics = host_nic_drivers(host) if drivers else {}
    for driver, on_it in drivers.items():
        unbind = f"{PCI_DRIVERS}/{driver}/unbind"
        if not nics["known"] or driver in nics["drivers"]:
            refused.append(RefusedPath(
                f"driver.{driver}.unbind", str(host.real(unbind)), "host_nic_driver",
                {"driver": driver, "host_nics": nics["drivers"].get(driver, []), "default_route": nics["default_route"],
                 "source": nics["source"] or "no default route could be read", "slot_functions_on_driver": on_it}))
            continue
        keep_path(f"driver.{driver}.unbind", unbind)
    if found:
        keep_path("drivers_probe", DRIVERS_PROBE)
    return list(found.values()), refused


def write_set(host: HostRoot, functions: Iterable[tuple[str, str, str]]) -> list[WritablePath]:
    """Every file the agent writes for ``functions``, deduplicated, in a stable order (see the module doc)."""
    return plan_writes(host, functions)[0]


def host_write_set(host: HostRoot) -> list[WritablePath]:
    """The write set of ``host`` from its discovery (what the daemon would offer as slots)."""
    return write_set(host, slot_functions(discover(host)))


def host_write_plan(host: HostRoot) -> tuple[list[WritablePath], list[RefusedPath]]:
    """The write set of ``host`` and the unbinds refused, from its discovery."""
    return plan_writes(host, slot_functions(discover(host)))


def _quote(path: str) -> str:
    """A path as one word of a unit file: specifiers escaped, quoted when it has blanks or quotes."""
    word = "-" + path.replace("%", "%%")
    if re.search(r"[\s\"'\\]", word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def render_dropin(paths: list[WritablePath], *, host_root: str, refused: Iterable[RefusedPath] = ()) -> str:
    """The drop-in text: one ``ReadWritePaths=`` line per path, each after a comment saying why; a refused
    path as a comment with its evidence (it stays read-only)."""
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
    for r in refused:
        lines.append(f"# refused {r.item} {r.path} ({r.reason}): {json.dumps(r.evidence, sort_keys=True)}")
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


def check_lines(paths: list[WritablePath], refused: Iterable[RefusedPath] = ()) -> list[str]:
    """``prepare-host --check``: one line per path, its outcome in this namespace (the unit's sandbox).

    Not fatal: a device added after the drop-in was loaded costs that slot, not the node; the line
    names the path and the fix, and :func:`sysfs_writable_check` refuses the slot in preflight.
    """
    lines = []
    for p in paths:
        outcome = writable_here(p.path)
        fix = f" fix={REMEDY!r}" if outcome != "ok" else ""
        lines.append(f"GPUAAS_PREPARE_HOST item=sysfs.{p.item} path={p.path} outcome={outcome}{fix}")
    for r in refused:
        lines.append(f"GPUAAS_PREPARE_HOST item=sysfs.{r.item} path={r.path} outcome=refused reason={r.reason} "
                     f"evidence={json.dumps(r.evidence, sort_keys=True, separators=(',', ':'))}")
    return lines


def sysfs_writable_check(paths: list[WritablePath], refused: Iterable[RefusedPath] = ()) -> ParityCheck:
    """Preflight: every sysfs path a provision or handover of a candidate slot writes is writable from here,
    and no slot function sits on a driver whose unbind was refused (a host NIC's: it cannot be moved)."""
    blocked = [(p, o) for p in paths if (o := writable_here(p.path)) != "ok"]
    stuck = [r for r in refused if r.blocks]
    if stuck:
        named = "; ".join(f"{', '.join(r.blocks)} on {r.evidence.get('driver')}, whose unbind is refused: the host "
                          f"NIC(s) {r.evidence.get('host_nics')} use it ({r.evidence.get('source')})" for r in stuck)
        return ParityCheck(status=ParityStatus.FAIL, check="sysfs_writable", hard=True,
                           remediation="bind the slot functions to vfio-pci at boot (e.g. sriov_drivers_autoprobe=0 "
                                       "before creating the VFs), so no unbind of the host NIC's driver is needed",
                           detail=f"slot function(s) cannot leave a host NIC's driver: {named}",
                           evidence="default route -> interface -> lower devices -> device/driver")
    if blocked:
        named = "; ".join(f"{p.item} {p.path} ({o})" for p, o in blocked)
        return ParityCheck(status=ParityStatus.FAIL, check="sysfs_writable", hard=True, remediation=REMEDY,
                           detail=f"{len(blocked)} sysfs path(s) a provision writes are not writable in the "
                                  f"agent's sandbox: {named}",
                           evidence="statvfs ST_RDONLY / ENOENT per path")
    return ParityCheck(status=ParityStatus.PASS, check="sysfs_writable", hard=True,
                       detail=f"all {len(paths)} sysfs paths the slots' provision and handover write are writable",
                       evidence="statvfs per path")
