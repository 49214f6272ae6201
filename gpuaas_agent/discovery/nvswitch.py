"""NVSwitches: NVIDIA functions of PCI class 0x0680 ("bridge, other"), the NVLink fabric of an HGX board.

On an HGX H200 node every GPU's NVLinks end in the NVSwitches; a guest holding several
GPUs can use NVLink between them only inside a fabric partition that NVIDIA Fabric
Manager activates (shared-NVSwitch multitenancy mode). The agent activates partitions only for runtime
profiles with ``fabric_partitions`` on a host with ``[slice.fabric_manager]`` (docs/hgx.md); discovery
sees neither, so :func:`check_nvswitch_partition` keeps the WARN in the parity report, and a
multi-slot placement without a partition carries the same warning (``tasks/placement.py``).
"""

from __future__ import annotations

from gpuaas_agent.contract.parity import ParityCheck, ParityStatus
from gpuaas_agent.contract.topology import NvSwitchDevice, TopologyReport
from gpuaas_agent.discovery.gpu import NVIDIA_VENDOR
from gpuaas_agent.discovery.pci import PciFunction, PciIndex

CLASS_BRIDGE_OTHER = 0x0680


def read_nvswitches(index: PciIndex) -> list[NvSwitchDevice]:
    """Every NVSwitch function in address order."""
    out = []
    fn: PciFunction | None  # each function, then its detailed read
    for address, fn in index.functions.items():
        if fn.vendor != NVIDIA_VENDOR or fn.base_class != CLASS_BRIDGE_OTHER:
            continue
        fn = index.detailed(address)
        assert fn is not None
        out.append(NvSwitchDevice(pci_address=fn.address, device_id=fn.hex_id(fn.device), class_code=fn.class_hex,
                                  numa_node=fn.numa_node, driver=fn.driver))
    return out


def check_nvswitch_partition(report: TopologyReport) -> ParityCheck:
    """PASS without NVSwitches; WARN with them: multi-GPU slices would get GPUs without a fabric partition."""
    switches = [s.pci_address for s in report.nvswitches]
    if not switches:
        return ParityCheck(status=ParityStatus.PASS, check="nvswitch_partition", hard=False,
                           detail="no NVSwitch: GPUs of a multi-GPU slice peer over PCIe only",
                           evidence="vendor 0x10de class 0x0680 functions: none")
    return ParityCheck(
        status=ParityStatus.WARN, check="nvswitch_partition", hard=False,
        detail=(f"{len(switches)} NVSwitches and no fabric partition mechanism: a multi-GPU slice's GPUs "
                "get no usable NVLink"),
        remediation=("run NVIDIA Fabric Manager in shared-NVSwitch multitenancy mode, configure [slice.fabric_manager] "
                     "and sell profiles with fabric_partitions (docs/hgx.md), or sell single-GPU slices only on "
                     "this node"),
        evidence="nvswitches " + ",".join(switches))
