"""Fabric functions: Mellanox/NVIDIA (vendor 0x15b3) network and InfiniBand PFs and VFs.

Only network-class functions count: a BlueField-3 also shows a "SoC
Management Interface" DMA controller (0x0801) that carries no fabric. The
per-slot fabric is a VF (``physfn`` link present); a PF with
``sriov_numvfs=0`` offers none, which the planner reports as a blocker instead
of handing out the shared PF (seed 004's concurrent-slice failure).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuaas_agent.contract.topology import FabricDevice
from gpuaas_agent.discovery.pci import PCI_DEVICES, PciFunction, PciIndex, linked_address
from gpuaas_agent.discovery.sysread import SysReader

MELLANOX_VENDOR = 0x15B3
NETWORK_BASE_CLASS = 0x02
FABRIC_KIND = {0x0207: "infiniband", 0x0200: "ethernet"}
PHYS_PORT_RE = re.compile(r"^p\d+\Z")
VIRTFN_RE = re.compile(r"^virtfn(\d+)\Z")


def is_fabric(vendor: int | None, class_code: int | None) -> bool:
    return vendor == MELLANOX_VENDOR and class_code is not None and (class_code >> 16) == NETWORK_BASE_CLASS


def _primary_netdev(reader: SysReader, entry: str, netdevs: list[str]) -> str | None:
    """The uplink netdev: the one named ``p<N>`` by the driver, else the first.

    In switchdev mode a PF also carries representors (``pf0hpf``, ``pf0vf3``).
    """
    for name in netdevs:
        port_name = reader.attr(f"{entry}/net/{name}/phys_port_name")
        if port_name and PHYS_PORT_RE.match(port_name):
            return name
    return netdevs[0] if netdevs else None


def _port_state(raw: str | None) -> str | None:
    """``4: ACTIVE`` -> ``ACTIVE``."""
    if raw is None:
        return None
    return raw.split(":", 1)[-1].strip() or None


def read_fabric_devices(index: PciIndex) -> list[FabricDevice]:
    reader = index.reader
    devices = []
    fn: PciFunction | None  # each function, then its detailed read
    for address, fn in index.functions.items():
        if not is_fabric(fn.vendor, fn.class_code):
            continue
        fn = index.detailed(address)
        assert fn is not None and fn.vendor is not None  # is_fabric matched the vendor
        entry = f"{PCI_DEVICES}/{address}"
        names = reader.listdir(entry)
        virtfns = sorted(
            (int(m.group(1)), linked_address(reader, f"{entry}/{n}")) for n in names if (m := VIRTFN_RE.match(n))
        )
        physfn = linked_address(reader, f"{entry}/physfn") if "physfn" in names else None
        netdevs = reader.listdir(f"{entry}/net") if "net" in names else []
        ib_devices = reader.listdir(f"{entry}/infiniband") if "infiniband" in names else []
        ib_device = ib_devices[0] if ib_devices else None
        port_state = link_layer = None
        if ib_device is not None:
            ports = reader.listdir(f"{entry}/infiniband/{ib_device}/ports")
            if ports:
                port_dir = f"{entry}/infiniband/{ib_device}/ports/{ports[0]}"
                port_state = _port_state(reader.attr(f"{port_dir}/state"))
                link_layer = reader.attr(f"{port_dir}/link_layer")
        devices.append(
            FabricDevice(
                pci_address=address,
                vendor_id=fn.hex_id(fn.vendor),
                device_id=fn.hex_id(fn.device),
                class_code=fn.class_hex,
                kind=FABRIC_KIND.get(fn.base_class or 0, "network"),
                is_vf=physfn is not None,
                physfn=physfn,
                virtfns=[v for _, v in virtfns if v is not None],
                sriov_totalvfs=reader.int_attr(f"{entry}/sriov_totalvfs") if "sriov_totalvfs" in names else None,
                sriov_numvfs=reader.int_attr(f"{entry}/sriov_numvfs") if "sriov_numvfs" in names else None,
                numa_node=fn.numa_node,
                driver=fn.driver,
                iommu_group=fn.iommu_group,
                ib_device=ib_device,
                netdev=_primary_netdev(reader, entry, netdevs),
                netdevs=netdevs,
                port_state=port_state,
                link_layer=link_layer,
                pci_path=list(fn.pci_path),
            )
        )
    return devices


@dataclass(frozen=True)
class VfOnPf:
    """Where a VF is counted: its PF's netdev, its index there (``virtfn<N>``), the PF's driver."""

    vf_pci_address: str
    pf_pci_address: str
    pf_netdev: str
    vf_index: int
    pf_driver: str | None


def vf_on_pf(reader: SysReader, vf_pci_address: str) -> VfOnPf | None:
    """The VF's PF netdev and index from its ``physfn`` link and the PF's ``virtfn<N>`` links (a few readlinks:
    the telemetry round's, not a discovery); None when the host does not show the VF on a PF with a netdev."""
    entry = f"{PCI_DEVICES}/{vf_pci_address}"
    pf = linked_address(reader, f"{entry}/physfn")
    if pf is None:
        return None
    pf_entry = f"{PCI_DEVICES}/{pf}"
    names = reader.listdir(pf_entry)
    index = next((int(m.group(1)) for n in names if (m := VIRTFN_RE.match(n))
                  and linked_address(reader, f"{pf_entry}/{n}") == vf_pci_address), None)
    netdev = _primary_netdev(reader, pf_entry, reader.listdir(f"{pf_entry}/net") if "net" in names else [])
    if index is None or netdev is None:
        return None
    return VfOnPf(vf_pci_address=vf_pci_address, pf_pci_address=pf, pf_netdev=netdev, vf_index=index,
                  pf_driver=reader.link_name(f"{pf_entry}/driver"))
