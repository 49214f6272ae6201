"""What a GPU handover did and proved: the record that goes into a release's cleanup proof.

Between two tenants every passed-through function of a slot is reset by the
agent (docs/safety.md §12). For the GPU the record names the reset chosen and why
(:class:`GpuResetChoice`), what the last tenant left (``before``), the memory
clear and the register value that proves it, the settings read back after the
reset (``after``) against the lease's :class:`GpuHandoverPolicy`, the config
space compared with the kernel's BAR assignment, the driver it is on, and
every command the tool ran with what it answered. The fabric VF gets a
function-level reset through the kernel (:class:`VfResetResult`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.handover import GpuHandoverPolicy
from gpuaas_agent.contract.types import PciAddress


class GpuResetMethod(WireEnum):
    """The reset the agent chose (``nvidia_gpu_tools --reset-with-sbr`` / ``--reset-with-flr``)."""

    sbr = "sbr"  # secondary bus reset from the upstream bridge: a full reset, then the firmware scrubs memory
    flr = "flr"  # function-level reset: only where the bridge holds other functions too


class GpuResetChoice(WireModel):
    """Which reset, and the sysfs facts it was chosen from."""

    address: PciAddress
    method: GpuResetMethod
    bridge: PciAddress | None = Field(description="the upstream bridge (None: on a root bus)")
    bridge_functions: list[PciAddress] = Field(description="every other function below that bridge")
    reset_methods: list[str] = Field(description="the kernel's sysfs reset_method of the device ([] if absent)")
    reason: str


class GpuHandoverReadiness(WireModel):
    """Proven at a provision's validate: the release will be able to hand this slot's devices over."""

    tool: str = Field(description="the nvidia_gpu_tools.py the release will run")
    gpu_reset: GpuResetChoice
    fabric_vf_reset_methods: list[str] | None = None


class GpuSettings(WireModel):
    """A GPU's tenant-changeable settings as the tool reads them; None: not readable (see ``unreadable``)."""

    ecc_enabled: bool | None = None
    mig_enabled: bool | None = None
    cc_mode: str | None = None
    ppcie_mode: str | None = None  # "unsupported": the device has no PPCIe mode (the tool says so)
    unreadable: dict[str, str] = Field(default_factory=dict, description="setting -> why it was not read")


class ToolRun(WireModel):
    """One run of the GPU admin tool: argv, exit status, and the tail of what it printed."""

    purpose: Literal["query_before", "stage_settings", "reset_and_clear", "query_after"]
    argv: list[str]
    returncode: int
    stdout_tail: str
    stderr_tail: str
    errors: list[str] = Field(default_factory=list, description="the tool's ERROR/CRITICAL lines and traceback")


class ConfigSpaceCheck(WireModel):
    """The device's config space after the reset, compared with the kernel's resource assignment."""

    vendor_device: str = Field(description="read from the live config space, e.g. 10de:2335")
    bars: dict[str, str] = Field(description="BAR index -> base address read from config space")
    restored: bool


class GpuHandoverResult(WireModel):
    """One GPU handed over: reset, memory cleared and verified, settings restored and read back."""

    address: PciAddress
    policy: GpuHandoverPolicy
    reset: GpuResetChoice
    before: GpuSettings | None = Field(description="what the last tenant left (None: the query failed)")
    memory_cleared: bool
    memory_clear_flag: str | None = Field(description="the memory-clear-finished register read after the reset")
    after: GpuSettings
    config_space: ConfigSpaceCheck
    driver: str
    vfio_rebound: bool = Field(description="the device had left vfio-pci and was bound back")
    tool_runs: list[ToolRun]
    warnings: list[str] = Field(default_factory=list)
    duration_s: float = Field(ge=0)


class VfResetResult(WireModel):
    """The slot's fabric VF: a function-level reset through the kernel, back on vfio-pci."""

    address: PciAddress
    method: Literal["flr"] = "flr"
    reset_methods: list[str]
    driver: str
    vfio_rebound: bool


class SlotGpuHandover(WireModel):
    """The ``gpu_handover`` part of a release's cleanup proof."""

    policy_source: Literal["lease", "catalog_default"]
    gpus: list[GpuHandoverResult]
    fabric_vf: VfResetResult | None = None
