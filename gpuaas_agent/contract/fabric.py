"""NVIDIA Fabric Manager's partitions of an NVSwitch host, as the agent reads, plans and leases them.

On an HGX board with NVSwitches a guest holding several GPUs gets NVLink between them only
inside a fabric partition that Fabric Manager (FM) activates in the Shared NVSwitch
virtualization model: FM knows the supported partitions (fixed sets of GPUs), one is
activated before the VM starts and deactivated after it stops, and after an FM restart the
hypervisor tells FM again which partitions are active. Without it the guest's CUDA fails to
initialise NVLink (public reports: error 802, "system not yet initialized").

:class:`FabricPartitionList` is ``fmpm -l`` read into values (``host/devices/fabricmanager.py``);
:class:`PartitionLease` is what the agent's state records for an allocation that holds one.
"""

from __future__ import annotations

from pydantic import Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.types import UUID_PATTERN, PciAddress

# FM_MAX_FABRIC_PARTITIONS of NVIDIA's nv_fm_types.h.
MAX_PARTITIONS = 64


class FabricGpu(WireModel):
    """One GPU of a partition (fmFabricPartitionGpuInfo_t)."""

    physical_id: int = Field(ge=0)
    uuid: str = Field(max_length=80)
    pci_address: PciAddress  # the host's function, normalised from FM's 8-digit-domain pciBusId
    nvlinks_available: int = Field(ge=0)
    nvlinks_max: int = Field(ge=0)
    nvlink_line_rate_mbps: int = Field(ge=0)


class FabricPartition(WireModel):
    """One supported partition (fmFabricPartitionInfo_t)."""

    partition_id: int = Field(ge=0, lt=MAX_PARTITIONS)
    active: bool
    gpus: tuple[FabricGpu, ...]

    @property
    def gpu_addresses(self) -> frozenset[str]:
        return frozenset(g.pci_address for g in self.gpus)

    @property
    def degraded_gpus(self) -> list[str]:
        """GPUs of a multi-GPU partition with fewer NVLinks up than they have: the partition is not healthy."""
        if len(self.gpus) < 2:
            return []
        return [f"{g.pci_address} ({g.nvlinks_available}/{g.nvlinks_max} NVLinks)" for g in self.gpus
                if g.nvlinks_max == 0 or g.nvlinks_available < g.nvlinks_max]


class FabricPartitionList(WireModel):
    """``fmpm -l``: every partition FM supports on this host and whether it is active."""

    max_partitions: int = Field(ge=0)
    partitions: tuple[FabricPartition, ...]

    def by_id(self, partition_id: int) -> FabricPartition | None:
        return next((p for p in self.partitions if p.partition_id == partition_id), None)


class PartitionState(WireEnum):
    """A leased partition: recorded by ``slice.plan`` with the slot leases (``leased``), ``active`` once
    provision activated it (and verified that Fabric Manager lists it active)."""

    leased = "leased"
    active = "active"


class PartitionLease(WireModel):
    """An allocation holds one fabric partition: its id and GPUs, as planned (the lease of its slot set)."""

    allocation_id: str = Field(pattern=UUID_PATTERN)
    partition_id: int = Field(ge=0, lt=MAX_PARTITIONS)
    gpu_pci_addresses: tuple[PciAddress, ...]
    state: PartitionState
    task_id: str = Field(min_length=1, max_length=200)
    recorded_at: float


class PartitionDriftKind(WireEnum):
    """What reconcile finds between FM's active partitions, the agent's partition leases and the domains."""

    active_without_domain = "active_without_domain"  # FM has it active; no running domain of ours uses it
    active_without_lease = "active_without_lease"  # FM has it active; no lease of ours holds it
    domain_without_partition = "domain_without_partition"  # a leased partition's domain runs; FM has it inactive


class PartitionDrift(WireModel):
    kind: PartitionDriftKind
    partition_id: int
    allocation_id: str | None = None
    detail: str
