"""GPUs: NVIDIA functions of display class 0x0300 (VGA) or 0x0302 (3D) only.

NVSwitch bridges (0x0680) are NVIDIA functions but not GPUs, and a BMC's VGA
(Matrox/ASPEED, 0x0300) is a display but not NVIDIA: both are excluded.
"""

from __future__ import annotations

from gpuaas_agent.contract.topology import GpuDevice
from gpuaas_agent.discovery.bars import read_bars
from gpuaas_agent.discovery.pci import PciFunction, PciIndex, iommu_group_members

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = frozenset({0x0300, 0x0302})

# Names of the data-centre parts this agent is built for (pci.ids); others stay unnamed.
KNOWN_GPU_NAMES = {
    0x2335: "H200 SXM 141GB",
    0x233B: "H200 NVL",
    0x2330: "H100 SXM5 80GB",
    0x2331: "H100 PCIe",
    0x2321: "H100 NVL",
    0x20B0: "A100 SXM4 40GB",
    0x20B2: "A100 SXM4 80GB",
    0x20B5: "A100 PCIe 80GB",
}


def is_gpu(vendor: int | None, class_code: int | None) -> bool:
    return vendor == NVIDIA_VENDOR and class_code is not None and (class_code >> 8) in GPU_CLASSES


def read_gpus(index: PciIndex) -> list[GpuDevice]:
    """Every GPU function in address order."""
    gpus = []
    fn: PciFunction | None  # each function, then its detailed read
    for address, fn in index.functions.items():
        if not is_gpu(fn.vendor, fn.class_code):
            continue
        fn = index.detailed(address)
        assert fn is not None and fn.vendor is not None  # is_gpu matched the vendor
        gpus.append(
            GpuDevice(
                pci_address=fn.address,
                vendor_id=fn.hex_id(fn.vendor),
                device_id=fn.hex_id(fn.device),
                subsystem_vendor_id=fn.hex_id(fn.subsystem_vendor),
                subsystem_device_id=fn.hex_id(fn.subsystem_device),
                class_code=fn.class_hex,
                name=KNOWN_GPU_NAMES.get(fn.device or -1),
                numa_node=fn.numa_node,
                local_cpulist=fn.local_cpulist,
                iommu_group=fn.iommu_group,
                iommu_group_members=iommu_group_members(index.reader, fn.iommu_group),
                driver=fn.driver,
                pci_path=list(fn.pci_path),
                bars=read_bars(index.reader, fn.address),
            )
        )
    return gpus
