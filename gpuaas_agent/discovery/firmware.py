"""Firmware inventory: GPU VBIOS, NVSwitch, NIC/DPU, NVMe and system BIOS versions, read from sysfs/procfs.

Pure reader over a host root (live or recorded), one source per kind:

- ``gpu_vbios``: ``/proc/driver/nvidia/gpus/<addr>/information`` (``Video BIOS:``) while the GPU is on
  the nvidia driver; a GPU on ``vfio-pci`` has no such file, and its ROM can only be read by enabling
  it (a write: host/devices/pcirom.py does that, outside discovery), so here it is ``version=None`` naming why.
- ``nvswitch_fw``: ``/proc/driver/nvidia-nvswitch/devices/<addr>/information`` (a ``...BIOS...:`` or
  ``...Firmware...:`` line) where the nvswitch driver shows it.
- ``nic_fw``: ``/sys/class/infiniband/<dev>/fw_ver`` (mlx5: ConnectX and BlueField functions, VFs
  included; a VF runs its PF's firmware, named in ``physfn``), model = ``board_id`` (the PSID).
- ``nvme_fw``: ``/sys/class/nvme/<ctrl>/firmware_rev``, model = ``model``, per controller's PCI address.
- ``bios``: ``/sys/class/dmi/id/bios_version`` (+ vendor and date in ``source``), model =
  ``sys_vendor product_name``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Sequence
from typing import Literal

from gpuaas_agent.contract.firmware import (
    FirmwareBaselineRule,
    FirmwareChange,
    FirmwareComponent,
    FirmwareInventory,
    FirmwareKind,
)
from gpuaas_agent.contract.parity import ParityCheck, ParityStatus
from gpuaas_agent.contract.topology import Finding, TopologyReport
from gpuaas_agent.contract.types import PCI_ADDRESS_RE
from gpuaas_agent.hostfs import HostRoot

PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA = 0x10DE
NVIDIA_GPU_INFO = "/proc/driver/nvidia/gpus/{addr}/information"
NVSWITCH_INFO = "/proc/driver/nvidia-nvswitch/devices/{addr}/information"
_VBIOS_LINE = re.compile(r"^\s*Video BIOS:\s*(\S+)\s*$", re.M)
_NVSWITCH_FW_LINE = re.compile(r"^\s*[^:\n]*(?:BIOS|Firmware)[^:\n]*:\s*(\S+)\s*$", re.M | re.I)


def _attr(host: HostRoot, path: str) -> str | None:
    try:
        value = host.read_attr(path).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value or None


def _hex(host: HostRoot, path: str) -> int | None:
    value = _attr(host, path)
    try:
        return int(value, 16) if value else None
    except ValueError:
        return None


def _pci_of(host: HostRoot, device_link: str) -> str | None:
    """The PCI address a class device's ``device`` link leads to (its last path component)."""
    try:
        target = host.resolve(device_link)
    except OSError:
        return None
    name = posixpath.basename(target)
    return name if PCI_ADDRESS_RE.match(name) else None


def _listdir(host: HostRoot, path: str) -> list[str]:
    try:
        return sorted(host.listdir(path))
    except OSError:
        return []


def _nvidia_functions(host: HostRoot) -> list[tuple[str, int]]:
    out = []
    for addr in _listdir(host, PCI_DEVICES):
        if _hex(host, f"{PCI_DEVICES}/{addr}/vendor") == NVIDIA:
            cls = _hex(host, f"{PCI_DEVICES}/{addr}/class")
            if cls is not None:
                out.append((addr, cls >> 8))
    return out


def _gpu_and_switches(host: HostRoot) -> list[FirmwareComponent]:
    out = []
    kind: FirmwareKind
    for addr, cls in _nvidia_functions(host):
        if cls >> 8 == 0x03:  # display controller: VGA 0x0300 or 3D 0x0302
            kind, info, pattern = "gpu_vbios", NVIDIA_GPU_INFO.format(addr=addr), _VBIOS_LINE
        elif cls == 0x0680:
            kind, info, pattern = "nvswitch_fw", NVSWITCH_INFO.format(addr=addr), _NVSWITCH_FW_LINE
        else:
            continue
        version, source = None, f"{info} (absent: not on the nvidia driver, or not recorded)"
        try:
            match = pattern.search(host.read_text(info))
        except (OSError, UnicodeDecodeError):
            match = None
        else:
            source = info if match else f"{info} (no version line)"
        if match:
            version = match.group(1)
        model = f"10de:{_hex(host, f'{PCI_DEVICES}/{addr}/device') or 0:04x}"
        out.append(FirmwareComponent(kind=kind, id=addr, version=version, model=model, source=source))
    return out


def _per_function(host: HostRoot, base: str, kind: FirmwareKind, version: str, model: str, *,
                  physfn: bool = False) -> list[FirmwareComponent]:
    """One component per PCI function behind the devices of the sysfs class ``base`` (its first device names it),
    by address: the ``version`` and ``model`` attributes of that device, and its PF when ``physfn``."""
    out: dict[str, FirmwareComponent] = {}
    for dev in _listdir(host, base):
        addr = _pci_of(host, f"{base}/{dev}/device")
        if addr is None or addr in out:
            continue
        out[addr] = FirmwareComponent(kind=kind, id=addr, version=_attr(host, f"{base}/{dev}/{version}"),
                                      model=_attr(host, f"{base}/{dev}/{model}"), source=f"{base}/{dev}/{version}",
                                      physfn=_pci_of(host, f"{PCI_DEVICES}/{addr}/physfn") if physfn else None)
    return [out[a] for a in sorted(out)]


def _nics(host: HostRoot) -> list[FirmwareComponent]:
    return _per_function(host, "/sys/class/infiniband", "nic_fw", "fw_ver", "board_id", physfn=True)


def _nvme(host: HostRoot) -> list[FirmwareComponent]:
    return _per_function(host, "/sys/class/nvme", "nvme_fw", "firmware_rev", "model")


def _bios(host: HostRoot) -> list[FirmwareComponent]:
    dmi = "/sys/class/dmi/id"
    if not host.is_dir(dmi):
        return []
    version = _attr(host, f"{dmi}/bios_version")
    vendor, date = _attr(host, f"{dmi}/bios_vendor"), _attr(host, f"{dmi}/bios_date")
    model = " ".join(v for v in (_attr(host, f"{dmi}/sys_vendor"), _attr(host, f"{dmi}/product_name")) if v) or None
    return [FirmwareComponent(kind="bios", id="dmi", version=version, model=model,
                              source=f"{dmi}/bios_version (vendor {vendor or '-'}, date {date or '-'})")]


def read_firmware(host: HostRoot) -> FirmwareInventory:
    """Every firmware version the root shows (blocking: sysfs/procfs reads)."""
    components = [*_gpu_and_switches(host), *_nics(host), *_nvme(host), *_bios(host)]
    return FirmwareInventory(source="live" if host.is_live else "fixture", components=components)


# -- judgement: a baseline, and two readings compared ------------------------------------------


def _rule_for(component: FirmwareComponent, rules: Sequence[FirmwareBaselineRule]) -> FirmwareBaselineRule | None:
    """The rule of the component's kind and model; else the kind's rule without a model; else none."""
    same_kind = [r for r in rules if r.kind == component.kind]
    return (next((r for r in same_kind if r.model is not None and r.model == component.model), None)
            or next((r for r in same_kind if r.model is None), None))


def judge_firmware(inventory: FirmwareInventory, rules: Sequence[FirmwareBaselineRule]) -> list[Finding]:
    """``firmware_drift`` for each component outside its baseline; ``firmware_unreadable`` where a rule applies
    but the version could not be read (not a PASS: docs/safety.md §7)."""
    findings = []
    for component in inventory.components:
        rule = _rule_for(component, rules)
        if rule is None:
            continue
        what = f"{component.kind} {component.id}" + (f" ({component.model})" if component.model else "")
        if component.version is None:
            findings.append(Finding(code="firmware_unreadable", path=component.source,
                                    detail=f"{what}: version not readable ({component.source}); baseline allows "
                                           f"{', '.join(rule.versions)}"))
        elif component.version not in rule.versions:
            findings.append(Finding(code="firmware_drift", path=component.source,
                                    detail=f"{what} runs {component.version}; baseline allows {', '.join(rule.versions)}"))
    return findings


def check_firmware_baseline(inventory: FirmwareInventory, rules: Sequence[FirmwareBaselineRule]) -> ParityCheck:
    """FAIL on drift, WARN when a judged version is unreadable, PASS when every judged component matches."""
    findings = judge_firmware(inventory, rules)
    judged = [c for c in inventory.components if _rule_for(c, rules) is not None]
    evidence = "; ".join(f"{c.key}={c.version or '?'}" for c in judged) or "no component matches a rule"
    drift = [f for f in findings if f.code == "firmware_drift"]
    fix = "update (or roll back) the firmware to a baseline version, or widen [slice] firmware_baseline"
    if drift:
        return ParityCheck(status=ParityStatus.FAIL, check="firmware_baseline", hard=True, remediation=fix,
                           detail="firmware_drift: " + "; ".join(f.detail for f in drift), evidence=evidence)
    if findings:
        return ParityCheck(status=ParityStatus.WARN, check="firmware_baseline", hard=True, remediation=fix,
                           detail="firmware_unreadable: " + "; ".join(f.detail for f in findings), evidence=evidence)
    return ParityCheck(status=ParityStatus.PASS, check="firmware_baseline", hard=True, evidence=evidence,
                       detail=f"{len(judged)} component(s) at a baseline version")


def firmware_changes(before: FirmwareInventory, after: FirmwareInventory,
                     devices: Iterable[str] | None = None) -> list[FirmwareChange]:
    """What differs between two readings, for ``devices`` (PCI addresses; None: every component).

    A VF named in ``devices`` brings its PF (``physfn``): the firmware a tenant could reflash
    through a VF is the PF's. A version that became unreadable is a change too (a device that
    stopped answering after a tenancy is not proven unchanged).
    """
    old, new = before.by_key(), after.by_key()
    wanted: set[str] | None = None
    component: FirmwareComponent | None
    kind: Literal["changed", "appeared", "disappeared", "unreadable"]
    if devices is not None:
        wanted = set(devices)
        for component in (*before.components, *after.components):
            if component.id in wanted and component.physfn:
                wanted.add(component.physfn)
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        component = b or a
        assert component is not None
        if wanted is not None and component.id not in wanted:
            continue
        va, vb = a.version if a else None, b.version if b else None
        if a is None:
            kind = "appeared"
        elif b is None:
            kind = "disappeared"
        elif va == vb:
            continue
        elif vb is None:
            kind = "unreadable"
        else:
            kind = "changed"
        changes.append(FirmwareChange(kind=component.kind, id=component.id, before=va, after=vb, change=kind))
    return changes


def slot_firmware_devices(report: TopologyReport, gpu_pci_address: str, fabric_vf_pci_address: str | None,
                          nvme_device: str) -> list[str]:
    """The PCI functions whose firmware a slot's tenant could reach: its GPU, its VF (whose PF
    :func:`firmware_changes` adds) and its disk's controller(s), found by the disk's by-id path."""
    devices = [gpu_pci_address, *([fabric_vf_pci_address] if fabric_vf_pci_address else [])]
    for disk in report.nvme_devices:
        if nvme_device == disk.by_id or nvme_device in disk.by_id_links:
            devices += disk.controller_pci_addresses or ([disk.pci_address] if disk.pci_address else [])
    return sorted(set(devices))
