"""What a slot must go through before its next tenant: the handover policy a lease carries.

A slot passes from one tenant to the next many times a day; what the next one
inherits is decided at the previous tenant's *validate*, not looked up at
release. :class:`LeaseHandover` is fixed then and stored with each slot's lease:
every later wipe of that slot (boot or data slot of a set, a retried release, a
release finished after a crash) uses it, so a missing domain or a profile
renamed since cannot downgrade the erase.

:class:`GpuHandoverPolicy` is the state a GPU is restored to and checked
against after the agent's reset and memory clear (ECC on, MIG off, CC/PPCIe
mode as the profile says): the settings a tenant can change through
passthrough and that survive a plain function-level reset on Hopper.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.firmware import FirmwareComponent
from gpuaas_agent.contract.nvmewipe import WipePolicy

ProfileName = Annotated[str, Field(pattern=r"^[a-z0-9_]{1,64}$")]


class CcMode(WireEnum):
    """Hopper confidential-computing mode (``nvidia_gpu_tools --query-cc-mode``)."""

    off = "off"
    on = "on"
    devtools = "devtools"


class PpcieMode(WireEnum):
    """Protected PCIe mode (multi-GPU confidential computing on HGX)."""

    off = "off"
    on = "on"


class GpuHandoverPolicy(WireModel):
    """The GPU state every tenant starts from: restored after the reset, read back and compared."""

    ecc_enabled: bool = True
    mig_enabled: bool = False
    cc_mode: CcMode = CcMode.off
    ppcie_mode: PpcieMode = PpcieMode.off
    clear_memory: bool = True
    # Reset + memory clear + settings + read-back of one GPU; the tool's own deadline comes on top.
    timeout_s: float = Field(default=900.0, gt=0, le=86400)


class HandoverOrigin(WireEnum):
    """Where a lease's handover policy came from."""

    validate = "validate"  # fixed by the provision's validate from the slot's profile and the device's answers
    legacy = "legacy"  # a lease taken before handover policies: the strictest method the device supports


class LeaseHandover(WireModel):
    """The handover fixed at validate for one slot's lease; release never looks it up again.

    ``zeros_guaranteed``: the wipe method's post-condition covers every LBA (Write
    Zeroes; an NVMe erase whose namespace reads deallocated blocks as zero). Only
    then may a sampled read-back stand as the proof; otherwise the whole device is read.
    ``gpu``: None when the profile passes no GPU through (the lab profile).
    """

    profile: ProfileName
    wipe: WipePolicy
    zeros_guaranteed: bool
    gpu: GpuHandoverPolicy | None = None
    fixed_at: float
    origin: HandoverOrigin = HandoverOrigin.validate
    # The firmware of every device the tenant could reach (GPU, VF and its PF, the disk's controller) before
    # the tenancy: the release reads it again and a change quarantines the slot. None: not read (old lease).
    firmware: list[FirmwareComponent] | None = None
