"""The `slice.topology_discover` report: what a host has and which slots it could offer.

Field names are the control plane's vocabulary (seed 002 Phase 2, seed 004
"final topology discovery result"); keep them.
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from gpuaas_agent.contract.base import SCHEMA_VERSION, WireEnum, WireModel
from gpuaas_agent.contract.fabricvf import FabricVfIdentity
from gpuaas_agent.contract.firmware import FirmwareInventory
from gpuaas_agent.contract.types import ByIdPath, DiskIdentity, KernelName, MacAddress, PciAddress, PciId


class StorageIdentityKind(WireEnum):
    """Which stable /dev/disk/by-id link names a disk (docs/architecture.md)."""

    nvme_eui_by_id = "nvme_eui_by_id"
    nvme_wwn_by_id = "nvme_wwn_by_id"
    nvme_serial_by_id = "nvme_serial_by_id"
    kernel_name_only = "kernel_name_only"


class FabricClaimMode(WireEnum):
    per_slot_vf = "per_slot_vf"


class SharingMechanism(WireEnum):
    """How a slot shares its GPU (seed 002 design tasks: room for fractional GPUs).

    ``exclusive_device``: the whole GPU is passed through to one slice; the only mechanism
    implemented. ``mig`` (MIG instances of one GPU) and ``vgpu`` (mediated vGPU devices) are
    known names so that a control plane can speak of them, but every model refuses them until
    the agent implements them: a slot that claims one is refused at the edge, not half-provisioned.
    """

    exclusive_device = "exclusive_device"
    mig = "mig"
    vgpu = "vgpu"


IMPLEMENTED_SHARING = frozenset({SharingMechanism.exclusive_device})


def check_sharing_mechanism(value: SharingMechanism) -> SharingMechanism:
    """A field validator: a known-but-not-implemented mechanism is refused with its name."""
    if value not in IMPLEMENTED_SHARING:
        # A custom error keeps ctx plain JSON (a ValueError would put an exception object into the evidence).
        raise PydanticCustomError(
            "sharing_mechanism_not_implemented",
            "sharing mechanism {mechanism} is known but not implemented by this agent; implemented: {implemented}",
            {"mechanism": value.value, "implemented": ",".join(sorted(m.value for m in IMPLEMENTED_SHARING))})
    return value


def check_parent_slot_id(value: str | None) -> str | None:
    """A field validator: child slots (a MIG instance of a parent GPU slot) need a sharing mechanism that has them."""
    if value is not None:
        raise PydanticCustomError(
            "parent_slot_not_implemented",
            "a parent slot needs a sharing mechanism with child slots (mig, vgpu); none is implemented, "
            "so parent_slot_id must be null")
    return value


class Locality(WireEnum):
    """How close two PCI functions are, best first."""

    same_switch = "same_switch"
    same_numa = "same_numa"
    remote = "remote"
    unknown = "unknown"


class Finding(WireModel):
    """A blocker or a warning: a stable code, what it means, and where it was seen."""

    code: str
    detail: str
    path: str | None = None


class PciBar(WireModel):
    """One memory BAR of a PCI function, from sysfs ``resource`` (sizes decide the guest's MMIO window)."""

    index: int = Field(ge=0, le=5)
    size_bytes: int = Field(gt=0)
    is_64bit: bool
    prefetchable: bool


class GpuDevice(WireModel):
    pci_address: PciAddress
    vendor_id: PciId
    device_id: PciId | None
    subsystem_vendor_id: PciId | None = None
    subsystem_device_id: PciId | None = None
    class_code: str
    name: str | None = None
    numa_node: int | None = None
    local_cpulist: str | None = None
    iommu_group: int | None = None
    iommu_group_members: list[PciAddress] = Field(default_factory=list)
    driver: str | None = None
    pci_path: list[PciAddress] = Field(default_factory=list, description="upstream bridges, root port first")
    bars: list[PciBar] = Field(default_factory=list, description="memory BARs from sysfs resource; empty: unknown")
    # pynvml enrichment, live hosts only.
    model: str | None = None
    memory_total_bytes: int | None = None
    uuid: str | None = None


class NvSwitchDevice(WireModel):
    """An NVSwitch (NVIDIA, PCI class 0x0680): the HGX NVLink fabric between the node's GPUs."""

    pci_address: PciAddress
    device_id: PciId | None
    class_code: str
    numa_node: int | None = None
    driver: str | None = None


class MountedChild(WireModel):
    """A partition (or a holder on top of one) of a disk that is mounted somewhere."""

    partition: KernelName
    mountpoint: str
    fstype: str | None = None
    via_holder: KernelName | None = None


class Partition(WireModel):
    name: KernelName
    number: int | None = None
    size_bytes: int | None = None
    fstype: str | None = None
    part_type: str | None = None
    holders: list[KernelName] = Field(default_factory=list)
    mountpoints: list[str] = Field(default_factory=list)


class NvmeDevice(WireModel):
    by_id: ByIdPath | None = None
    by_id_links: list[ByIdPath] = Field(default_factory=list)
    storage_identity_kind: StorageIdentityKind
    kernel_name: KernelName
    dev: str | None = Field(default=None, description="major:minor, advisory like the kernel name")
    wwid: str | None = None
    disk_identity: DiskIdentity | None = Field(
        default=None, description="what the disk is, whatever by-id alias names it: uuid/nguid/eui/wwid/dev")
    pci_address: PciAddress | None = None
    controller_pci_addresses: list[PciAddress] = Field(default_factory=list)
    pci_path: list[PciAddress] = Field(default_factory=list)
    numa_node: int | None = None
    size_bytes: int | None = None
    serial: str | None = None
    model: str | None = None
    mounted: bool
    mountpoints: list[str] = Field(default_factory=list)
    mounted_children: list[MountedChild] = Field(default_factory=list)
    holders: list[KernelName] = Field(default_factory=list)
    partitions: list[Partition] = Field(default_factory=list)
    signatures: list[str] = Field(default_factory=list, description="partition table / filesystem types udev saw")
    swap: bool = False
    os_disk: bool
    slice_eligible: bool
    ineligible_reasons: list[Finding] = Field(default_factory=list)


class FabricDevice(WireModel):
    pci_address: PciAddress
    vendor_id: PciId
    device_id: PciId | None
    class_code: str
    kind: str = Field(description="infiniband | ethernet | network")
    is_vf: bool
    physfn: PciAddress | None = None
    virtfns: list[PciAddress] = Field(default_factory=list)
    sriov_totalvfs: int | None = None
    sriov_numvfs: int | None = None
    numa_node: int | None = None
    driver: str | None = None
    iommu_group: int | None = None
    ib_device: str | None = None
    netdev: str | None = None
    netdevs: list[str] = Field(default_factory=list)
    port_state: str | None = None
    link_layer: str | None = None
    pci_path: list[PciAddress] = Field(default_factory=list)


class CandidateSlot(WireModel):
    slot_index: int
    gpu_pci_address: PciAddress
    nvme_device: ByIdPath | None
    storage_identity_kind: StorageIdentityKind | None
    nvme_kernel_name: KernelName | None = Field(default=None, description="advisory only")
    fabric_vf_pci_address: PciAddress | None
    fabric_pf_pci_address: PciAddress | None = None
    fabric_claim_mode: FabricClaimMode = FabricClaimMode.per_slot_vf
    mac: MacAddress
    private_ip: str | None
    ovs_bridge: str
    numa_node: int | None
    nvme_locality: Locality | None = None
    fabric_locality: Locality | None = None
    # The VF's MAC and IB node/port GUIDs, derived from host identity + slot index (contract/fabricvf.py).
    fabric_vf_identity: FabricVfIdentity | None = None
    blockers: list[Finding] = Field(default_factory=list)
    warnings: list[Finding] = Field(default_factory=list)
    # Room for fractional GPUs: discovery emits whole-device slots only, with no parent.
    sharing_mechanism: SharingMechanism = SharingMechanism.exclusive_device
    parent_slot_id: str | None = Field(default=None, max_length=100)

    _sharing = field_validator("sharing_mechanism")(check_sharing_mechanism)
    _parent = field_validator("parent_slot_id")(check_parent_slot_id)


class HostIdentity(WireModel):
    hostname: str | None = None
    machine_id: str | None = None
    dmi_product_uuid: str | None = None
    dmi_serial: str | None = None
    dmi_vendor: str | None = None
    dmi_product: str | None = None
    identity_source: str = Field(description="which field seeded MAC suggestions")


class DiscoverySummary(WireModel):
    """The seed's summary line: gpu_devices=8 fabric_devices=.. nvme_devices=9 ..."""

    gpu_devices: int
    fabric_devices: int
    nvme_devices: int
    mounted_nvme_devices: int
    candidate_slots: int
    ready_candidate_slots: int

    def as_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.model_dump().items())


class GpuEnrichment(WireModel):
    source: str = "pynvml"
    status: str = Field(description="used | unavailable | not_live_host")
    detail: str | None = None


class TopologyReport(WireModel):
    schema_version: str = SCHEMA_VERSION
    host: HostIdentity
    summary: DiscoverySummary
    gpus: list[GpuDevice]
    nvme_devices: list[NvmeDevice]
    fabric_devices: list[FabricDevice]
    candidate_slots: list[CandidateSlot]
    blockers: list[Finding]
    warnings: list[Finding]
    gpu_enrichment: GpuEnrichment
    # HGX fabric: multi-GPU guests need a Fabric Manager partition for NVLink (tasks/placement.py).
    nvswitches: list[NvSwitchDevice] = Field(default_factory=list)
    # What the slice's devices and the host run (discovery/firmware.py; docs/firmware.md).
    firmware: FirmwareInventory | None = None
