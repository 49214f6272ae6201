"""Records of VFIO binding: the guard's evidence, each sysfs write made, and the bind result."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.types import PciAddress

VFIO_DRIVER = "vfio-pci"


class IommuGroupMember(WireModel):
    """One function of the IOMMU group of a device about to be given to a guest."""

    address: PciAddress
    driver: str | None
    is_bridge: bool
    approved: bool

    @property
    def isolated(self) -> bool:
        """May share the group with a passed-through device (docs/safety.md §3)."""
        return self.approved or self.driver == VFIO_DRIVER or self.is_bridge


class VfioGuardEvidence(WireModel):
    """Why binding ``address`` to vfio-pci was allowed."""

    address: PciAddress
    iommu_group: Annotated[int, Field(ge=0)]
    members: list[IommuGroupMember]


class SysfsWrite(WireModel):
    """One write to a host file, in the order it was made (host path, not the on-disk path)."""

    path: str
    value: str


class DeviceHolder(WireModel):
    """A process with a device node open, e.g. nvidia-persistenced holding /dev/nvidia0."""

    pid: Annotated[int, Field(gt=0)]
    comm: str | None
    devices: list[str]


class VfioBindResult(WireModel):
    """Outcome of binding one function to vfio-pci; ``changed`` is False when it already was."""

    address: PciAddress
    previous_driver: str | None
    driver: str
    changed: bool
    writes: list[SysfsWrite]
    guard: VfioGuardEvidence
