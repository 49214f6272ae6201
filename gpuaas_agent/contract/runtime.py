"""Runtime profiles: the named VM shapes a slot can be provisioned with (seed 002 Phase 5, seed 004).

A profile is chosen by name in the provision payload; the control plane and
the agent must agree on what the name means, so the catalog lives in the
contract. ``h200_1g_24c_64g`` is the tuned prototype shape of seed 004 (24 vCPU,
64 GiB, 1 GiB hugepages, UEFI with Secure Boot off, no vTPM). ``lab_tcg_1c_512m``
is the CI lab shape: ``type='qemu'`` (TCG, docs/testing.md: KVM on CI machines cannot
boot a stock kernel), no PCI passthrough, no hugepages.
"""

from __future__ import annotations

from types import MappingProxyType

from pydantic import Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.handover import GpuHandoverPolicy
from gpuaas_agent.contract.nvmewipe import WipePolicy
from gpuaas_agent.contract.placement import Placement
from gpuaas_agent.errors import ContractError

HUGEPAGE_1G_MIB = 1024


class DomainType(WireEnum):
    """libvirt ``<domain type=...>``: ``kvm`` in production, ``qemu`` (TCG) for the lab."""

    kvm = "kvm"
    qemu = "qemu"


class NicModel(WireEnum):
    virtio = "virtio"
    e1000e = "e1000e"


class OnHostBoot(WireEnum):
    """What the agent does with an active slice whose domain is shut off after the host rebooted.

    ``restart``: re-validate the slot's devices (disk identity, vfio-pci, hugepages) and start the domain
    through the guarded start; ``leave_stopped``: re-validate and report (``boot_restart_held``), the control
    plane or the tenant starts it. Either way a slice the tenant had stopped stays stopped.
    """

    restart = "restart"
    leave_stopped = "leave_stopped"


class IngressPolicing(WireModel):
    """OVS ``ingress_policing_rate``/``_burst`` for the slot's vNIC (applied by the OVS driver, not libvirt)."""

    rate_kbps: int = Field(gt=0)
    burst_kb: int = Field(ge=0)


class RuntimeProfile(WireModel):
    """One VM shape. Cross-field checks against the host (NUMA size, hugepages) happen in the XML builder."""

    name: str = Field(pattern=r"^[a-z0-9_]{1,64}$")
    domain_type: DomainType
    vcpus: int = Field(ge=1, le=512)
    memory_mib: int = Field(ge=128)
    hugepages_1g: bool = False
    # False only for the lab profile: CI machines have no GPU or VF to pass through.
    hostdevs: bool = True
    nic_model: NicModel = NicModel.virtio
    ingress_policing: IngressPolicing | None = None
    # How the slot's disk is cleared on release (seed 002 tenant-isolation wipe policy); a host's
    # config may override it per profile (SliceConfig.wipe_policies). Default: today's discard + verify.
    wipe_policy: WipePolicy = Field(default_factory=WipePolicy)
    # The state each passed-through GPU is reset, cleared and restored to between tenants (host/devices/gpuhandover).
    gpu_handover: GpuHandoverPolicy = Field(default_factory=GpuHandoverPolicy)
    # Readiness also proves egress (a lost NAT rule is otherwise invisible to it): the guest's first boot reaches the host's configured
    # target beyond the NAT (SliceConfig.readiness_egress_target) and conntrack shows it source-NATed.
    readiness_egress: bool = False
    # The weakest locality a multi-slot allocation of this profile accepts (tasks/placement.py).
    placement: Placement = Placement.any
    on_host_boot: OnHostBoot = OnHostBoot.restart  # boot recovery's policy (tasks/boot_recovery.py)
    # NVIDIA Fabric Manager runs on the host and this profile's slices get their GPUs through an FM partition
    # (Shared NVSwitch model; docs/hgx.md). False (the seed's guidance: no host FM unless the profile says it
    # is safe): no partition is planned, and a multi-GPU set on an NVSwitch host gets no NVLink (a placement
    # warning). True: on an NVSwitch host the set must be exactly a supported, healthy FM partition, FM must
    # answer before anything is leased, and provision activates the partition before the domain starts.
    fabric_partitions: bool = False


class UnknownProfileError(ContractError):
    """A task named a runtime profile this agent does not know."""

    default_code = "unknown_profile"


PROFILES: MappingProxyType[str, RuntimeProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            RuntimeProfile(
                name="h200_1g_24c_64g",
                domain_type=DomainType.kvm,
                vcpus=24,
                memory_mib=64 * 1024,
                hugepages_1g=True,
                hostdevs=True,
            ),
            # The tuned shape for NUMA-bound multi-GPU work: a set of its slots must sit on one NUMA node
            # (a 2- or 4-GPU slice on an HGX node; an 8-GPU slice spans both nodes and takes the plain profile).
            RuntimeProfile(
                name="h200_1g_24c_64g_numa",
                domain_type=DomainType.kvm,
                vcpus=24,
                memory_mib=64 * 1024,
                hugepages_1g=True,
                hostdevs=True,
                placement=Placement.same_numa,
            ),
            # NVLink slices of 1, 2, 4 or 8 GPUs on an HGX node whose host runs Fabric Manager (Shared NVSwitch).
            RuntimeProfile(
                name="h200_nvlink_24c_64g",
                domain_type=DomainType.kvm,
                vcpus=24,
                memory_mib=64 * 1024,
                hugepages_1g=True,
                hostdevs=True,
                fabric_partitions=True,
            ),
            RuntimeProfile(
                name="lab_tcg_1c_512m",
                domain_type=DomainType.qemu,
                vcpus=1,
                memory_mib=512,
                hugepages_1g=False,
                hostdevs=False,
            ),
            RuntimeProfile(
                name="lab_tcg_1c_512m_egress",
                domain_type=DomainType.qemu,
                vcpus=1,
                memory_mib=512,
                hugepages_1g=False,
                hostdevs=False,
                readiness_egress=True,
            ),
        )
    }
)
DEFAULT_PROFILE = "h200_1g_24c_64g"


def get_profile(name: str) -> RuntimeProfile:
    """The catalog profile called ``name``, or :class:`UnknownProfileError`."""
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise UnknownProfileError(
            f"runtime profile {name!r} is not in this agent's catalog",
            evidence={"field": "runtime_profile", "profile": name, "known": sorted(PROFILES)},
        ) from None
