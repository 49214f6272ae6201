"""PCI functions from ``/sys/bus/pci/devices``: identity, driver, NUMA, IOMMU and place in the tree.

On many hosts every entry of ``/sys/bus/pci/devices`` is a symlink into
``/sys/devices/pci*`` (seed 004: the first agent skipped all GPUs because it
did not follow them). The resolved path is also what tells which PCIe switch a
function sits behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import overload

from gpuaas_agent.contract.topology import Locality
from gpuaas_agent.contract.types import PCI_ADDRESS_RE
from gpuaas_agent.discovery.sysread import SysReader

PCI_DEVICES = "/sys/bus/pci/devices"
IOMMU_GROUPS = "/sys/kernel/iommu_groups"
BDF_RE = PCI_ADDRESS_RE  # whole-string only: a name with a trailing newline is not an address

CLASS_BRIDGE_PCI = 0x0604  # PCI-to-PCI bridge: root ports and switch ports


@dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs shows it; ``class_code`` is the 24-bit class."""

    address: str
    sysfs_path: str
    vendor: int | None
    device: int | None
    class_code: int | None
    subsystem_vendor: int | None = None
    subsystem_device: int | None = None
    numa_node: int | None = None
    local_cpulist: str | None = None
    driver: str | None = None
    iommu_group: int | None = None
    pci_path: tuple[str, ...] = field(default_factory=tuple)
    root_complex: str | None = None

    @property
    def base_class(self) -> int | None:
        """Class and subclass, e.g. 0x0302 for a 3D controller."""
        return None if self.class_code is None else self.class_code >> 8

    @property
    def is_bridge(self) -> bool:
        return self.base_class == CLASS_BRIDGE_PCI

    @property
    def slot(self) -> str:
        """domain:bus:device, shared by functions of one physical device."""
        return self.address.rsplit(".", 1)[0]

    @overload
    def hex_id(self, value: int) -> str: ...
    @overload
    def hex_id(self, value: None) -> None: ...
    def hex_id(self, value: int | None) -> str | None:
        return None if value is None else f"0x{value:04x}"

    @property
    def class_hex(self) -> str:
        return "unknown" if self.class_code is None else f"0x{self.class_code:06x}"


def _hex(reader: SysReader, path: str, *, required: bool = False, bits: int = 16) -> int | None:
    """A hex id; values that do not fit the field are junk, warned and dropped."""
    value = reader.int_attr(path, required=required, base=16)
    if value is not None and not 0 <= value < (1 << bits):
        reader.findings.warn("sysfs_out_of_range", f"0x{value:x} does not fit {bits} bits", path)
        return None
    return value


def read_function(reader: SysReader, address: str) -> PciFunction | None:
    """Read one function; ``None`` when its entry cannot be resolved at all."""
    entry = f"{PCI_DEVICES}/{address}"
    resolved = reader.resolve(entry)
    if resolved is None:
        return None
    if not reader.host.is_dir(entry):
        reader.findings.warn("pci_entry_dangling", "PCI device entry does not lead to a device directory", entry)
        return None
    components = resolved.split("/")
    ancestors = tuple(c for c in components[:-1] if BDF_RE.match(c))
    root = next((c for c in components if c.startswith("pci") and ":" in c), None)
    group_name = reader.link_name(f"{entry}/iommu_group")
    iommu_group = int(group_name) if group_name is not None and group_name.isdigit() else None
    return PciFunction(
        address=address,
        sysfs_path=resolved,
        vendor=_hex(reader, f"{entry}/vendor", required=True),
        device=_hex(reader, f"{entry}/device", required=True),
        class_code=_hex(reader, f"{entry}/class", required=True, bits=24),
        subsystem_vendor=_hex(reader, f"{entry}/subsystem_vendor"),
        subsystem_device=_hex(reader, f"{entry}/subsystem_device"),
        driver=reader.link_name(f"{entry}/driver"),
        iommu_group=iommu_group,
        pci_path=ancestors,
        root_complex=root,
    )


@dataclass
class PciIndex:
    """All functions of a host; NUMA details are read only for the ones reported.

    Reading ``numa_node`` of every bridge on a one-socket box would only produce
    a page of "-1" warnings about devices nobody asked about.
    """

    reader: SysReader
    functions: dict[str, PciFunction]
    _detailed: set[str] = field(default_factory=set)

    def get(self, address: str | None) -> PciFunction | None:
        return None if address is None else self.functions.get(address)

    def detailed(self, address: str | None) -> PciFunction | None:
        """The function with ``numa_node`` and ``local_cpulist`` read (warns on -1)."""
        fn = self.get(address)
        if fn is None or fn.address in self._detailed:
            return fn
        entry = f"{PCI_DEVICES}/{fn.address}"
        fn = replace(
            fn,
            numa_node=self.reader.numa_node(f"{entry}/numa_node"),
            local_cpulist=self.reader.attr(f"{entry}/local_cpulist"),
        )
        self.functions[fn.address] = fn
        self._detailed.add(fn.address)
        return fn


def read_pci_index(reader: SysReader) -> PciIndex:
    """Every PCI function, keyed by address, in address order."""
    functions: dict[str, PciFunction] = {}
    for name in reader.listdir(PCI_DEVICES, required=True):
        if not BDF_RE.match(name):
            reader.findings.warn("pci_entry_unexpected", "entry is not a PCI address", f"{PCI_DEVICES}/{name}")
            continue
        fn = read_function(reader, name)
        if fn is not None:
            functions[name] = fn
    return PciIndex(reader=reader, functions=functions)


def linked_address(reader: SysReader, path: str) -> str | None:
    """The PCI address a relation link (``physfn``, ``virtfn3``) names; a broken one is warned."""
    name = reader.link_name(path)
    if name is None:
        return None
    if not BDF_RE.match(name):
        reader.findings.warn("pci_link_unexpected", f"link leads to {name!r}, not a PCI function", path)
        return None
    return name


def iommu_group_members(reader: SysReader, group: int | None) -> list[str]:
    """Addresses of every function in an IOMMU group, sorted."""
    if group is None:
        return []
    return [m for m in reader.listdir(f"{IOMMU_GROUPS}/{group}/devices", required=True) if BDF_RE.match(m)]


def iommu_enabled(reader: SysReader) -> bool:
    """IOMMU groups exist only when the IOMMU is on (``intel_iommu=on`` and VT-d)."""
    return bool(reader.listdir(IOMMU_GROUPS))


def locality(a: PciFunction | None, b: PciFunction | None) -> Locality:
    """Same PCIe switch (a shared upstream bridge), else same NUMA node, else remote."""
    assert a is not None and b is not None, "locality of a function missing from the index it was read from"
    if set(a.pci_path) & set(b.pci_path):
        return Locality.same_switch
    if a.numa_node is not None and b.numa_node is not None:
        return Locality.same_numa if a.numa_node == b.numa_node else Locality.remote
    if a.root_complex is not None and a.root_complex == b.root_complex:
        return Locality.same_numa
    return Locality.unknown


LOCALITY_SCORE = {Locality.same_switch: 3, Locality.same_numa: 2, Locality.unknown: 1, Locality.remote: 0}
