"""Discovery as one call: host root in, :class:`TopologyReport` out. Reads only; writes nothing."""

from __future__ import annotations

from gpuaas_agent.contract.topology import DiscoverySummary, Finding, TopologyReport
from gpuaas_agent.discovery.fabric import read_fabric_devices
from gpuaas_agent.discovery.firmware import read_firmware
from gpuaas_agent.discovery.gpu import read_gpus
from gpuaas_agent.discovery.identity import identity_key, read_identity
from gpuaas_agent.discovery.nvme import read_nvme_devices
from gpuaas_agent.discovery.nvml import enrich
from gpuaas_agent.discovery.nvswitch import read_nvswitches
from gpuaas_agent.discovery.pci import iommu_enabled, read_pci_index
from gpuaas_agent.discovery.slots import PlanConfig, plan_slots
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.hostfs import HostRoot


def discover(host: HostRoot, config: PlanConfig | None = None) -> TopologyReport:
    """Read the host (live or recorded) and propose candidate slots."""
    config = config or PlanConfig()
    reader = SysReader(host)
    identity = read_identity(reader)
    index = read_pci_index(reader)
    gpus, enrichment = enrich(read_gpus(index), live=host.is_live)
    fabric = read_fabric_devices(index)
    disks = read_nvme_devices(index)
    slots = plan_slots(gpus, disks, fabric, index, identity_key(identity), config)

    blockers: list[Finding] = []
    if not gpus:
        blockers.append(Finding(code="no_gpus", detail="no NVIDIA GPU function (class 0x0300/0x0302) found", path="/sys/bus/pci/devices"))
    if index.functions and not iommu_enabled(reader):
        blockers.append(Finding(code="iommu_disabled", detail="no IOMMU groups: VT-d/AMD-Vi off in firmware or kernel", path="/sys/kernel/iommu_groups"))
    if gpus and not any(f.is_vf for f in fabric):
        pfs = [f for f in fabric if f.sriov_totalvfs]
        detail = ", ".join(f"{f.pci_address} sriov_numvfs={f.sriov_numvfs}/{f.sriov_totalvfs}" for f in pfs) or "no SR-IOV capable fabric function"
        blockers.append(Finding(code="no_fabric_vfs", detail=f"no fabric VFs exist: {detail}"))

    summary = DiscoverySummary(
        gpu_devices=len(gpus),
        fabric_devices=len(fabric),
        nvme_devices=len(disks),
        mounted_nvme_devices=sum(d.mounted for d in disks),
        candidate_slots=len(slots),
        ready_candidate_slots=sum(not s.blockers for s in slots),
    )
    return TopologyReport(
        host=identity,
        summary=summary,
        gpus=gpus,
        nvme_devices=disks,
        fabric_devices=fabric,
        candidate_slots=slots,
        blockers=blockers,
        warnings=reader.findings.items,
        gpu_enrichment=enrichment,
        nvswitches=read_nvswitches(index),
        firmware=read_firmware(host),
    )
