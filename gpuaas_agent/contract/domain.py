"""The libvirt domain of a slot: what the XML builder is given, and what the lifecycle driver reports.

:class:`DomainSpec` is everything the builder needs, already resolved on the
host (OVMF pair, the GPU's NUMA node and its cpulist), so building XML is a pure
function and a golden file pins it. The reports (:class:`DomainInfo`,
:class:`DefineOutcome`, :class:`ShutdownOutcome`, :class:`UndefineOutcome`) go
into task outputs and the journal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationError

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.runtime import DomainType, RuntimeProfile
from gpuaas_agent.contract.storage import DiskEvidence
from gpuaas_agent.contract.topology import PciBar
from gpuaas_agent.contract.types import BRIDGE_NAME_PATTERN, UUID_PATTERN, ByIdPath, MacAddress, PciAddress
from gpuaas_agent.errors import ContractError

AbsolutePath = Annotated[str, Field(pattern=r"^/[^\x00\n]*$", max_length=4096)]
# The kernel's cpulist format as sysfs prints it: 0-55,112-167
CpuList = Annotated[str, Field(pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$")]
AllocationId = Annotated[str, Field(pattern=UUID_PATTERN)]
TaskId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]

# Our namespace inside libvirt's <metadata>: the mark of a domain this agent owns.
METADATA_NS = "https://gpuaas.invalid/agent/v1"
METADATA_PREFIX = "gpuaas"


class OvmfFirmware(WireModel):
    """A matched UEFI CODE/VARS pair, never mixed across families (a 2 MiB VARS with a 4 MiB CODE does not boot)."""

    code_path: AbsolutePath
    vars_template_path: AbsolutePath
    # The QEMU firmware descriptor that named the pair; None when found by the well-known path fallback.
    descriptor: AbsolutePath | None = None
    secure_boot: Literal[False] = False


class _SlotDomainNames:
    """The names a slot's domain and vNIC derive from (allocation + slot): one definition for both models."""

    if TYPE_CHECKING:  # fields of the models that mix this in (never pydantic fields of the mixin)
        allocation_id: str
        slot_index: int

    @property
    def domain_name(self) -> str:
        return domain_name(self.allocation_id)

    @property
    def vnic_name(self) -> str:
        return vnic_name(self.allocation_id, self.slot_index)


class GuestSlot(WireModel):
    """One slot's devices inside a (possibly multi-GPU) domain: GPU, fabric VF, raw NVMe and their host node.

    A multi-slot allocation is one domain: the spec's own fields are its first slot (the one that boots the
    image); :attr:`DomainSpec.extra_slots` are the others, whose NVMe is a raw data disk.
    """

    slot_index: int = Field(ge=0, le=255)
    gpu_pci_address: PciAddress | None = None
    fabric_vf_pci_address: PciAddress | None = None
    nvme_device: ByIdPath
    nvme_numa_node: int | None = Field(default=None, ge=0)
    numa_node: int | None = Field(default=None, ge=0)
    numa_cpulist: CpuList | None = None
    # Memory BARs read by discovery (sysfs resource): they size the guest's 64-bit MMIO window.
    gpu_bars: list[PciBar] = Field(default_factory=list, max_length=6)
    fabric_vf_bars: list[PciBar] = Field(default_factory=list, max_length=6)


class DomainSpec(_SlotDomainNames, WireModel):
    """Inputs of one slot's domain; the builder checks how they fit together."""

    allocation_id: AllocationId
    slot_index: int = Field(ge=0, le=255)
    task_id: TaskId
    profile: RuntimeProfile
    gpu_pci_address: PciAddress | None = None
    fabric_vf_pci_address: PciAddress | None = None
    nvme_device: ByIdPath
    # NUMA node of the NVMe controller, when known: a slot whose disk is on another node than its GPU is refused.
    nvme_numa_node: int | None = Field(default=None, ge=0)
    mac: MacAddress
    ovs_bridge: str = Field(pattern=BRIDGE_NAME_PATTERN)
    seed_iso_path: AbsolutePath
    # The GPU's NUMA node and that node's cpulist (/sys/devices/system/node/nodeN/cpulist).
    numa_node: int | None = Field(default=None, ge=0)
    numa_cpulist: CpuList | None = None
    firmware: OvmfFirmware
    # None: libvirt copies the VARS template to its own per-domain NVRAM path.
    nvram_path: AbsolutePath | None = None
    # Where libvirt also writes the serial console (host/vm/consolelog.py: slice.console_log reads it); None: pty only.
    serial_log_path: AbsolutePath | None = None
    agent_version: str = Field(min_length=1, max_length=64)
    # Multi-GPU guests: the first slot's BARs, and every further slot of the same allocation.
    gpu_bars: list[PciBar] = Field(default_factory=list, max_length=6)
    fabric_vf_bars: list[PciBar] = Field(default_factory=list, max_length=6)
    extra_slots: list[GuestSlot] = Field(default_factory=list, max_length=15)

    def guest_slots(self) -> list[GuestSlot]:
        """Every slot of the domain, the boot slot first."""
        first = GuestSlot(slot_index=self.slot_index, gpu_pci_address=self.gpu_pci_address,
                          fabric_vf_pci_address=self.fabric_vf_pci_address, nvme_device=self.nvme_device,
                          nvme_numa_node=self.nvme_numa_node, numa_node=self.numa_node,
                          numa_cpulist=self.numa_cpulist, gpu_bars=self.gpu_bars, fabric_vf_bars=self.fabric_vf_bars)
        return [first, *self.extra_slots]

    def start_target(self) -> StartTarget:
        return StartTarget(allocation_id=self.allocation_id, slot_index=self.slot_index, profile=self.profile,
                           gpu_pci_address=self.gpu_pci_address, fabric_vf_pci_address=self.fabric_vf_pci_address,
                           nvme_device=self.nvme_device, ovs_bridge=self.ovs_bridge, numa_node=self.numa_node)

    def metadata(self) -> DomainMetadata:
        return DomainMetadata(
            allocation_id=self.allocation_id,
            slot_index=self.slot_index,
            task_id=self.task_id,
            profile=self.profile.name,
            agent_version=self.agent_version,
        )


class StartTarget(_SlotDomainNames, WireModel):
    """What the start guard checks about a domain: the facts of a :class:`DomainSpec` a start depends on.

    Provision has the whole spec; a power-on of an existing domain (``slice.vm_power``) rebuilds
    these facts from the host's lease, the domain's own metadata and its live XML instead.
    """

    allocation_id: AllocationId
    slot_index: int = Field(ge=0, le=255)
    profile: RuntimeProfile
    gpu_pci_address: PciAddress | None = None
    fabric_vf_pci_address: PciAddress | None = None
    nvme_device: ByIdPath
    ovs_bridge: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,15}$")
    numa_node: int | None = Field(default=None, ge=0)



def cpulist_cpus(cpulist: str) -> list[int]:
    """CPU numbers of a kernel cpulist (``0-3,8`` -> [0, 1, 2, 3, 8]), sorted and unique."""
    cpus: set[int] = set()
    for part in cpulist.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"cpulist range {part!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


class DomainSpecError(ContractError):
    """A domain spec that cannot describe a VM on this host; nothing was defined.

    Codes: ``invalid_domain_spec``, ``vcpus_exceed_numa_node``, ``memory_not_hugepage_multiple``,
    ``numa_unknown``, ``disk_numa_mismatch``, ``hostdev_missing``, ``hostdevs_not_allowed``,
    ``duplicate_slot_device``, ``gpu_bars_unknown``, ``too_many_numa_nodes``, ``too_many_devices_on_node``.
    """

    default_code = "invalid_domain_spec"


def parse_domain_spec(data: Any) -> DomainSpec:
    """Validate untrusted input into a :class:`DomainSpec`, raising :class:`DomainSpecError` (not pydantic's)."""
    try:
        return DomainSpec.model_validate(data)
    except ValidationError as exc:
        raise DomainSpecError(
            "domain spec does not match the contract",
            evidence={"errors": [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]},
        ) from None


class DomainMetadata(WireModel):
    """What the agent writes into ``<metadata>`` and reads back to recognise its domains after a restart."""

    allocation_id: AllocationId
    slot_index: int = Field(ge=0, le=255)
    task_id: TaskId
    profile: str
    agent_version: str

    def same_owner(self, other: DomainMetadata) -> bool:
        """Same allocation, slot, task and profile: redefining would change nothing (agent version may differ)."""
        return (self.allocation_id, self.slot_index, self.task_id, self.profile) == (
            other.allocation_id,
            other.slot_index,
            other.task_id,
            other.profile,
        )


class DomainState(WireEnum):
    """libvirt's ``virDomainState`` by name."""

    nostate = "nostate"
    running = "running"
    blocked = "blocked"
    paused = "paused"
    shutdown = "shutdown"  # being shut down
    shutoff = "shutoff"
    crashed = "crashed"
    pmsuspended = "pmsuspended"


class DomainInfo(WireModel):
    """One domain as libvirt reports it; ``metadata`` is None for a domain this agent does not own."""

    name: str
    uuid: str
    state: DomainState
    persistent: bool
    metadata: DomainMetadata | None = None


class DefineOutcome(WireModel):
    """``created``: defined now; ``existing``: the same allocation/slot/task was already defined (idempotent)."""

    domain: DomainInfo
    action: Literal["created", "existing"]


class ShutdownOutcome(WireModel):
    """How a domain stopped: ACPI within the deadline, or ``destroy`` after it."""

    name: str
    graceful: bool
    destroyed: bool
    already_off: bool
    waited_s: float
    # Set when the driver refused the ACPI flag (the test driver does) and plain shutdown() was used.
    note: str | None = None


class UndefineOutcome(WireModel):
    """``nvram_removed``: libvirt deleted the NVRAM with the domain; False after the plain-undefine fallback."""

    name: str
    undefined: bool
    nvram_removed: bool
    attempts: list[str]
    note: str | None = None


class DomainInterface(WireModel):
    mac: str
    bridge: str | None = None
    target_dev: str | None = None


class DomainDevices(WireModel):
    """What a defined domain will use when it starts, read back from its live XML (never from a task)."""

    name: str
    domain_type: str
    block_disks: list[str]
    hostdevs: list[PciAddress]
    interfaces: list[DomainInterface]
    # <numatune><memory nodeset=...>: where QEMU takes guest RAM (and its hugepages) from.
    numa_nodeset: str | None = None


class ResetOutcome(WireModel):
    """``virDomainReset``: the domain was hard-reset and stays running (the guest gets no say)."""

    name: str
    state: DomainState


class VmStartEvidence(WireModel):
    """Proof that a domain's start preconditions held (docs/safety.md §4); the lifecycle driver starts only with one."""

    domain_name: str
    domain_type: DomainType
    # "usable" (char device, read-write) or "not_required" (TCG lab profile).
    kvm: Literal["usable", "not_required"]
    ovs_bridge: str
    hugepages_1g_needed: int = Field(ge=0)
    hugepages_1g_free: int | None = None
    numa_node: int | None = None
    vfio_bound: list[PciAddress]
    disk: DiskEvidence
    checks_passed: list[str]
