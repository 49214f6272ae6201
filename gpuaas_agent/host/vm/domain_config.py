"""The guest's libvirt domain as a tree of element classes, each formatting **and** parsing its own XML (pure).

Modelled on openstack/nova's ``virt/libvirt/config.py``: one class per element
the agent writes. A class declares its XML once, field by field, in document
order (:func:`attr`, :func:`text`, :func:`child`, :func:`children`, :func:`flag`,
:func:`child_text`, :func:`child_size`, :func:`attr_size`); :meth:`Element.format_dom`
and :meth:`Element.parse_dom` both walk that one declaration, so the writer
(``domain_xml.build_domain``) and the reader (``libvirt_lifecycle``: reconcile,
power, boot recovery, the disk and hostdev guards) cannot drift apart.
tests/host/vm/test_domain_config.py holds it: every golden parses and formats back
byte-identical, and what libvirt returns after ``defineXML`` parses to the same
values for every element we own (:func:`owned_diff`).

Parsing a live domain keeps only what is declared here: elements and attributes
libvirt adds (``<uuid>``, ``<currentMemory>``, implicit controllers, aliases) are
left out, so a parsed live domain says what the agent owns in it. A value keeps
the text it was written with (so a golden formats back byte for byte) and
compares by meaning (:class:`Size`: ``65536 MiB`` equals libvirt's ``67108864 KiB``;
:class:`CpuSet`: ``0,1`` equals libvirt's ``0-1``; :class:`MachineType`: ``q35`` equals the
QEMU driver's ``pc-q35-7.2``).

Adding a guest device: a class here (its fields in document order), its name in
:data:`DEVICE_CLASSES`, and the builder's line in ``domain_xml.py`` that makes it.
"""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from gpuaas_agent.contract.domain import METADATA_NS, METADATA_PREFIX, cpulist_cpus

# Serialise our namespace as "gpuaas:" rather than "ns0:" (idempotent, process-wide by ElementTree's design).
ET.register_namespace(METADATA_PREFIX, METADATA_NS)
# libvirt's QEMU namespace, for the one fw_cfg argument libvirt has no element for (see domain_xml.build_domain).
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
ET.register_namespace("qemu", QEMU_NS)

E = TypeVar("E", bound="Element")

# -- values: the written text, compared by meaning -----------------------------------------------------

_UNIT_BYTES = {
    "b": 1, "bytes": 1, "KB": 10**3, "k": 2**10, "KiB": 2**10, "MB": 10**6, "M": 2**20, "MiB": 2**20,
    "GB": 10**9, "G": 2**30, "GiB": 2**30, "TB": 10**12, "T": 2**40, "TiB": 2**40,
}


@dataclass(frozen=True, eq=False)
class Size:
    """A memory size as written (``65536`` ``MiB``); equal to any size of the same bytes (libvirt writes KiB)."""

    value: str
    unit: str = "KiB"  # libvirt's unit when the attribute is absent

    @classmethod
    def mib(cls, mib: int) -> Size:
        return cls(str(mib), "MiB")

    @classmethod
    def kib(cls, kib: int) -> Size:
        return cls(str(kib), "KiB")

    def in_bytes(self) -> int | None:
        scale = _UNIT_BYTES.get(self.unit)
        if scale is None or not self.value.isdigit():
            return None
        return int(self.value) * scale

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Size):
            return NotImplemented
        mine, theirs = self.in_bytes(), other.in_bytes()
        if mine is None or theirs is None:
            return (self.value, self.unit) == (other.value, other.unit)
        return mine == theirs

    def __hash__(self) -> int:
        return hash(self.in_bytes())

    def __repr__(self) -> str:
        return f"Size({self.value} {self.unit})"


@dataclass(frozen=True, eq=False)
class CpuSet:
    """A cpulist or nodeset as written (``0,1``); equal to any list of the same numbers (libvirt writes ``0-1``)."""

    text: str

    def numbers(self) -> frozenset[int] | None:
        try:
            return frozenset(cpulist_cpus(self.text))
        except ValueError:  # a form the kernel's cpulist reader does not know (libvirt's ^exclusions)
            return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CpuSet):
            return NotImplemented
        mine, theirs = self.numbers(), other.numbers()
        if mine is None or theirs is None:
            return self.text == other.text
        return mine == theirs

    def __hash__(self) -> int:
        return hash(self.numbers())

    def __repr__(self) -> str:
        return f"CpuSet({self.text!r})"


# A machine-type alias and the versioned types the QEMU driver resolves it to when it defines the domain.
_MACHINE_ALIASES = {"q35": "pc-q35-", "pc": "pc-i440fx-"}


@dataclass(frozen=True, eq=False)
class MachineType:
    """``q35`` as written; equal to the versioned type the QEMU driver stores for it (``pc-q35-7.2``)."""

    text: str

    def family(self) -> str:
        for alias, prefix in _MACHINE_ALIASES.items():
            if self.text == alias or self.text.startswith(prefix):
                return alias
        return self.text

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MachineType):
            return NotImplemented
        if self.text == other.text:
            return True
        # An alias stands for whichever version the driver picks; two versions must be the same version.
        aliased = self.text in _MACHINE_ALIASES or other.text in _MACHINE_ALIASES
        return aliased and self.family() == other.family()

    def __hash__(self) -> int:
        return hash(self.family())

    def __repr__(self) -> str:
        return f"MachineType({self.text!r})"


# -- the declaration: one field, one piece of XML --------------------------------------------------------

Kind = Literal["attr", "text", "child", "children", "flag", "child_text", "child_size", "attr_size"]
Codec = Literal["str", "cpuset", "machine"]


@dataclass(frozen=True)
class _Xml:
    kind: Kind
    name: str = ""  # attribute name or child tag (a child element class names its own tag)
    codec: Codec = "str"
    classes: tuple[type[Element], ...] = ()
    unit_attr: str = "unit"


def _decl(xml: _Xml, *, many: bool = False) -> Any:
    if many:
        return field(default_factory=list, metadata={"xml": xml})
    return field(default=False if xml.kind == "flag" else None, metadata={"xml": xml})


def attr(name: str, codec: Codec = "str") -> Any:
    """An attribute of this element (None: not written)."""
    return _decl(_Xml("attr", name, codec))


def text(codec: Codec = "str") -> Any:
    """This element's text."""
    return _decl(_Xml("text", codec=codec))


def child(cls: type[Element]) -> Any:
    """One child element of class ``cls`` (None: absent)."""
    return _decl(_Xml("child", classes=(cls,)))


def children(*classes: type[Element]) -> Any:
    """Child elements of these classes, in document order; children of other tags are not ours and are skipped."""
    return _decl(_Xml("children", classes=classes), many=True)


def flag(name: str) -> Any:
    """An empty child element whose presence is the value (``<locked/>``, ``<readonly/>``)."""
    return _decl(_Xml("flag", name))


def child_text(name: str, codec: Codec = "str") -> Any:
    """A child element that holds only text (``<name>``, ``<on_crash>``)."""
    return _decl(_Xml("child_text", name, codec))


def child_size(name: str) -> Any:
    """A child element holding a :class:`Size`: ``<memory unit="MiB">65536</memory>``."""
    return _decl(_Xml("child_size", name))


def attr_size(name: str, unit_attr: str = "unit") -> Any:
    """A :class:`Size` in two attributes of this element: ``memory="65536" unit="MiB"``."""
    return _decl(_Xml("attr_size", name, unit_attr=unit_attr))


def _encode(value: Any, codec: Codec) -> str:
    return str(value) if codec == "str" else str(value.text)


def _decode(raw: str, codec: Codec) -> Any:
    if codec == "cpuset":
        return CpuSet(raw)
    return MachineType(raw) if codec == "machine" else raw


def _declared(element: Element | type[Element]) -> list[tuple[str, _Xml]]:
    return [(f.name, f.metadata["xml"]) for f in dataclasses.fields(element)]  # type: ignore[arg-type]


class Element:
    """One XML element: ``TAG`` and the dataclass fields that declare its attributes, text and children."""

    TAG: ClassVar[str]

    def format_dom(self) -> ET.Element:
        element = ET.Element(self.TAG)
        for name, xml in _declared(self):
            value = getattr(self, name)
            if value is None or value is False:
                continue
            if xml.kind == "attr":
                element.set(xml.name, _encode(value, xml.codec))
            elif xml.kind == "attr_size":
                element.set(xml.name, value.value)
                element.set(xml.unit_attr, value.unit)
            elif xml.kind == "text":
                element.text = _encode(value, xml.codec)
            elif xml.kind == "child":
                element.append(value.format_dom())
            elif xml.kind == "children":
                element.extend(item.format_dom() for item in value)
            elif xml.kind == "flag":
                ET.SubElement(element, xml.name)
            elif xml.kind == "child_text":
                ET.SubElement(element, xml.name).text = _encode(value, xml.codec)
            else:  # child_size
                ET.SubElement(element, xml.name, {"unit": value.unit}).text = value.value
        return element

    @classmethod
    def parse_dom(cls: type[E], element: ET.Element) -> E:
        values: dict[str, Any] = {}
        for name, xml in _declared(cls):
            if xml.kind == "attr":
                raw = element.get(xml.name)
                values[name] = None if raw is None else _decode(raw, xml.codec)
            elif xml.kind == "attr_size":
                raw = element.get(xml.name)
                values[name] = None if raw is None else Size(raw, element.get(xml.unit_attr, "KiB"))
            elif xml.kind == "text":
                raw = _text(element)
                values[name] = None if raw is None else _decode(raw, xml.codec)
            elif xml.kind == "child":
                (child_cls,) = xml.classes
                found = element.find(child_cls.TAG)
                values[name] = None if found is None else child_cls.parse_dom(found)
            elif xml.kind == "children":
                by_tag = {c.TAG: c for c in xml.classes}
                values[name] = [by_tag[c.tag].parse_dom(c) for c in element if c.tag in by_tag]
            elif xml.kind == "flag":
                values[name] = element.find(xml.name) is not None
            elif xml.kind == "child_text":
                found = element.find(xml.name)
                raw = None if found is None else _text(found)
                values[name] = None if raw is None else _decode(raw, xml.codec)
            else:  # child_size
                found = element.find(xml.name)
                raw = None if found is None else _text(found)
                values[name] = None if found is None or raw is None else Size(raw, found.get("unit", "KiB"))
        return cls(**values)

    def to_xml(self) -> str:
        """Indented XML text with a trailing newline; deterministic, so goldens pin it."""
        element = self.format_dom()
        ET.indent(element, space="  ")
        return ET.tostring(element, encoding="unicode") + "\n"

    @classmethod
    def parse_str(cls: type[E], xml: str) -> E:
        """Raises ``xml.etree.ElementTree.ParseError`` on text that is not XML."""
        return cls.parse_dom(ET.fromstring(xml))


def _text(element: ET.Element) -> str | None:
    """The text as written: only elements without children carry a text field, so no indentation is in it."""
    return element.text


# -- metadata: the agent's ownership mark -----------------------------------------------------------------


def _q(tag: str) -> str:
    return f"{{{METADATA_NS}}}{tag}"


@dataclass(kw_only=True)
class AgentMetadata(Element):
    """``<gpuaas:agent>``: the mark of a domain this agent owns (contract/domain.py ``DomainMetadata``)."""

    TAG = _q("agent")
    allocation_id: str | None = child_text(_q("allocation_id"))
    slot_index: str | None = child_text(_q("slot_index"))
    task_id: str | None = child_text(_q("task_id"))
    profile: str | None = child_text(_q("profile"))
    agent_version: str | None = child_text(_q("agent_version"))


@dataclass(kw_only=True)
class Metadata(Element):
    TAG = "metadata"
    agent: AgentMetadata | None = child(AgentMetadata)


# -- memory, vCPUs and their placement ---------------------------------------------------------------------


@dataclass(kw_only=True)
class MemTune(Element):
    TAG = "memtune"
    hard_limit: Size | None = child_size("hard_limit")


@dataclass(kw_only=True)
class HugePage(Element):
    TAG = "page"
    size: str | None = attr("size")
    unit: str | None = attr("unit")


@dataclass(kw_only=True)
class HugePages(Element):
    TAG = "hugepages"
    pages: list[HugePage] = children(HugePage)


@dataclass(kw_only=True)
class MemorySource(Element):
    TAG = "source"
    type_: str | None = attr("type")


@dataclass(kw_only=True)
class MemoryAllocation(Element):
    TAG = "allocation"
    mode: str | None = attr("mode")
    threads: str | None = attr("threads")


@dataclass(kw_only=True)
class MemoryBacking(Element):
    TAG = "memoryBacking"
    hugepages: HugePages | None = child(HugePages)
    locked: bool = flag("locked")
    source: MemorySource | None = child(MemorySource)
    allocation: MemoryAllocation | None = child(MemoryAllocation)


@dataclass(kw_only=True)
class Vcpu(Element):
    TAG = "vcpu"
    placement: str | None = attr("placement")
    cpuset: CpuSet | None = attr("cpuset", "cpuset")
    count: str | None = text()


@dataclass(kw_only=True)
class VcpuPin(Element):
    TAG = "vcpupin"
    vcpu: str | None = attr("vcpu")
    cpuset: CpuSet | None = attr("cpuset", "cpuset")


@dataclass(kw_only=True)
class EmulatorPin(Element):
    TAG = "emulatorpin"
    cpuset: CpuSet | None = attr("cpuset", "cpuset")


@dataclass(kw_only=True)
class CpuTune(Element):
    TAG = "cputune"
    vcpupins: list[VcpuPin] = children(VcpuPin)
    emulatorpin: EmulatorPin | None = child(EmulatorPin)


@dataclass(kw_only=True)
class NumaMemory(Element):
    TAG = "memory"
    mode: str | None = attr("mode")
    nodeset: CpuSet | None = attr("nodeset", "cpuset")


@dataclass(kw_only=True)
class NumaMemNode(Element):
    TAG = "memnode"
    cellid: str | None = attr("cellid")
    mode: str | None = attr("mode")
    nodeset: CpuSet | None = attr("nodeset", "cpuset")


@dataclass(kw_only=True)
class NumaTune(Element):
    TAG = "numatune"
    memory: NumaMemory | None = child(NumaMemory)
    memnodes: list[NumaMemNode] = children(NumaMemNode)


# -- firmware, features, CPU ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class OsType(Element):
    TAG = "type"
    arch: str | None = attr("arch")
    machine: MachineType | None = attr("machine", "machine")
    name: str | None = text()


@dataclass(kw_only=True)
class Loader(Element):
    TAG = "loader"
    readonly: str | None = attr("readonly")
    secure: str | None = attr("secure")
    type_: str | None = attr("type")
    path: str | None = text()


@dataclass(kw_only=True)
class Nvram(Element):
    TAG = "nvram"
    template: str | None = attr("template")
    path: str | None = text()


@dataclass(kw_only=True)
class Os(Element):
    TAG = "os"
    type_: OsType | None = child(OsType)
    loader: Loader | None = child(Loader)
    nvram: Nvram | None = child(Nvram)


@dataclass(kw_only=True)
class Features(Element):
    TAG = "features"
    acpi: bool = flag("acpi")
    apic: bool = flag("apic")


@dataclass(kw_only=True)
class CpuTopology(Element):
    TAG = "topology"
    sockets: str | None = attr("sockets")
    dies: str | None = attr("dies")
    cores: str | None = attr("cores")
    threads: str | None = attr("threads")


@dataclass(kw_only=True)
class MaxPhysAddr(Element):
    TAG = "maxphysaddr"
    mode: str | None = attr("mode")


@dataclass(kw_only=True)
class NumaCell(Element):
    TAG = "cell"
    id_: str | None = attr("id")
    cpus: CpuSet | None = attr("cpus", "cpuset")
    memory: Size | None = attr_size("memory")


@dataclass(kw_only=True)
class CpuNuma(Element):
    TAG = "numa"
    cells: list[NumaCell] = children(NumaCell)


@dataclass(kw_only=True)
class Cpu(Element):
    TAG = "cpu"
    mode: str | None = attr("mode")
    check: str | None = attr("check")
    migratable: str | None = attr("migratable")
    topology: CpuTopology | None = child(CpuTopology)
    maxphysaddr: MaxPhysAddr | None = child(MaxPhysAddr)
    numa: CpuNuma | None = child(CpuNuma)


@dataclass(kw_only=True)
class Clock(Element):
    TAG = "clock"
    offset: str | None = attr("offset")


# -- devices -------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Address(Element):
    """A PCI address: the guest's (``type="pci"``) or, inside a hostdev's ``<source>``, the host's (no type)."""

    TAG = "address"
    type_: str | None = attr("type")
    domain: str | None = attr("domain")
    bus: str | None = attr("bus")
    slot: str | None = attr("slot")
    function: str | None = attr("function")

    @classmethod
    def pci(cls, host_address: str) -> Address:
        """``0000:18:00.0`` as a hostdev source address."""
        domain, bus, rest = host_address.split(":")
        slot, function = rest.split(".")
        return cls(domain=f"0x{domain}", bus=f"0x{bus}", slot=f"0x{slot}", function=f"0x{function}")

    @classmethod
    def guest_pci(cls, *, bus: int, slot: int) -> Address:
        return cls(type_="pci", domain="0x0000", bus=f"0x{bus:02x}", slot=f"0x{slot:02x}", function="0x0")

    def pci_address(self) -> str | None:
        """The canonical ``dddd:bb:ss.f`` form; None when a part is missing or not hex."""
        try:
            parts = [int(part or "", 16) for part in (self.domain, self.bus, self.slot, self.function)]
        except ValueError:
            return None
        return f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.{parts[3]:x}"


@dataclass(kw_only=True)
class DiskDriver(Element):
    TAG = "driver"
    name: str | None = attr("name")
    type_: str | None = attr("type")
    cache: str | None = attr("cache")
    io: str | None = attr("io")
    discard: str | None = attr("discard")


@dataclass(kw_only=True)
class DiskSource(Element):
    TAG = "source"
    dev: str | None = attr("dev")
    file: str | None = attr("file")


@dataclass(kw_only=True)
class DiskTarget(Element):
    TAG = "target"
    dev: str | None = attr("dev")
    bus: str | None = attr("bus")


@dataclass(kw_only=True)
class Boot(Element):
    TAG = "boot"
    order: str | None = attr("order")


@dataclass(kw_only=True)
class Disk(Element):
    """A slot's raw NVMe (``type="block"``) or the seed ISO (``type="file" device="cdrom"``)."""

    TAG = "disk"
    type_: str | None = attr("type")
    device: str | None = attr("device")
    driver: DiskDriver | None = child(DiskDriver)
    source: DiskSource | None = child(DiskSource)
    target: DiskTarget | None = child(DiskTarget)
    boot: Boot | None = child(Boot)
    readonly: bool = flag("readonly")
    address: Address | None = child(Address)


@dataclass(kw_only=True)
class ControllerModel(Element):
    TAG = "model"
    name: str | None = attr("name")


@dataclass(kw_only=True)
class ControllerTarget(Element):
    TAG = "target"
    chassis: str | None = attr("chassis")
    port: str | None = attr("port")
    bus_nr: str | None = attr("busNr")
    node: str | None = child_text("node")


@dataclass(kw_only=True)
class Controller(Element):
    """A PCI controller: the q35 root, an expander bus (pxb-pcie, carrying a guest NUMA node), a root port."""

    TAG = "controller"
    type_: str | None = attr("type")
    index: str | None = attr("index")
    model: str | None = attr("model")
    model_name: ControllerModel | None = child(ControllerModel)
    target: ControllerTarget | None = child(ControllerTarget)
    address: Address | None = child(Address)


@dataclass(kw_only=True)
class HostdevDriver(Element):
    TAG = "driver"
    name: str | None = attr("name")


@dataclass(kw_only=True)
class HostdevSource(Element):
    TAG = "source"
    address: Address | None = child(Address)


@dataclass(kw_only=True)
class Hostdev(Element):
    """A passed-through PCI function: the slot's GPU or its fabric VF."""

    TAG = "hostdev"
    mode: str | None = attr("mode")
    type_: str | None = attr("type")
    managed: str | None = attr("managed")
    driver: HostdevDriver | None = child(HostdevDriver)
    source: HostdevSource | None = child(HostdevSource)
    address: Address | None = child(Address)

    def host_address(self) -> str | None:
        """The host PCI function it passes through (``0000:18:00.0``); None if the XML does not say one."""
        if self.source is None or self.source.address is None:
            return None
        return self.source.address.pci_address()


@dataclass(kw_only=True)
class Mac(Element):
    TAG = "mac"
    address: str | None = attr("address")


@dataclass(kw_only=True)
class InterfaceSource(Element):
    TAG = "source"
    bridge: str | None = attr("bridge")


@dataclass(kw_only=True)
class VirtualPortParameters(Element):
    TAG = "parameters"
    interfaceid: str | None = attr("interfaceid")


@dataclass(kw_only=True)
class VirtualPort(Element):
    TAG = "virtualport"
    type_: str | None = attr("type")
    parameters: VirtualPortParameters | None = child(VirtualPortParameters)


@dataclass(kw_only=True)
class InterfaceTarget(Element):
    TAG = "target"
    dev: str | None = attr("dev")


@dataclass(kw_only=True)
class InterfaceModel(Element):
    TAG = "model"
    type_: str | None = attr("type")


@dataclass(kw_only=True)
class Interface(Element):
    TAG = "interface"
    type_: str | None = attr("type")
    mac: Mac | None = child(Mac)
    source: InterfaceSource | None = child(InterfaceSource)
    virtualport: VirtualPort | None = child(VirtualPort)
    target: InterfaceTarget | None = child(InterfaceTarget)
    model: InterfaceModel | None = child(InterfaceModel)


@dataclass(kw_only=True)
class CharLog(Element):
    TAG = "log"
    file: str | None = attr("file")
    append: str | None = attr("append")


@dataclass(kw_only=True)
class CharTarget(Element):
    TAG = "target"
    type_: str | None = attr("type")
    port: str | None = attr("port")


@dataclass(kw_only=True)
class Serial(Element):
    TAG = "serial"
    type_: str | None = attr("type")
    log: CharLog | None = child(CharLog)
    target: CharTarget | None = child(CharTarget)


@dataclass(kw_only=True)
class Console(Element):
    """The console on the serial port. libvirt copies the serial's ``<log>`` onto it; that copy is not ours."""

    TAG = "console"
    type_: str | None = attr("type")
    target: CharTarget | None = child(CharTarget)


@dataclass(kw_only=True)
class RngBackend(Element):
    TAG = "backend"
    model: str | None = attr("model")
    path: str | None = text()


@dataclass(kw_only=True)
class Rng(Element):
    TAG = "rng"
    model: str | None = attr("model")
    backend: RngBackend | None = child(RngBackend)


@dataclass(kw_only=True)
class MemBalloon(Element):
    TAG = "memballoon"
    model: str | None = attr("model")


# The devices the agent writes (and so reads back); a new guest device class is added here.
DEVICE_CLASSES: tuple[type[Element], ...] = (Disk, Controller, Hostdev, Interface, Serial, Console, Rng, MemBalloon)


@dataclass(kw_only=True)
class Devices(Element):
    """``<devices>`` in the order written; parsing keeps the :data:`DEVICE_CLASSES` and skips libvirt's others."""

    TAG = "devices"
    items: list[Element] = children(*DEVICE_CLASSES)

    def of(self, cls: type[E]) -> list[E]:
        return [item for item in self.items if isinstance(item, cls)]


# -- QEMU pass-through arguments ----------------------------------------------------------------------------


@dataclass(kw_only=True)
class QemuArg(Element):
    TAG = f"{{{QEMU_NS}}}arg"
    value: str | None = attr("value")


@dataclass(kw_only=True)
class QemuCommandline(Element):
    """``<qemu:commandline>``: kept by the QEMU driver only (the test driver drops the namespace)."""

    TAG = f"{{{QEMU_NS}}}commandline"
    args: list[QemuArg] = children(QemuArg)


# -- the domain --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Domain(Element):
    """``<domain>``: its children in the order ``domain_xml.build_domain`` writes them (the goldens' order)."""

    TAG = "domain"
    type_: str | None = attr("type")
    name: str | None = child_text("name")
    metadata: Metadata | None = child(Metadata)
    memory: Size | None = child_size("memory")
    memtune: MemTune | None = child(MemTune)
    memory_backing: MemoryBacking | None = child(MemoryBacking)
    vcpu: Vcpu | None = child(Vcpu)
    cputune: CpuTune | None = child(CpuTune)
    numatune: NumaTune | None = child(NumaTune)
    os: Os | None = child(Os)
    features: Features | None = child(Features)
    cpu: Cpu | None = child(Cpu)
    clock: Clock | None = child(Clock)
    on_poweroff: str | None = child_text("on_poweroff")
    on_reboot: str | None = child_text("on_reboot")
    on_crash: str | None = child_text("on_crash")
    devices: Devices | None = child(Devices)
    qemu_commandline: QemuCommandline | None = child(QemuCommandline)

    def device_list(self, cls: type[E]) -> list[E]:
        return [] if self.devices is None else self.devices.of(cls)


# -- comparing what we wrote with what libvirt holds ------------------------------------------------------


def owned_diff(ours: Element, live: Element, path: str = "") -> list[str]:
    """Where ``live`` differs from ``ours`` in what ``ours`` sets (empty: libvirt holds everything we wrote).

    What ``ours`` leaves unset (None, False, no items) is not compared: libvirt may add to a domain
    (addresses, implicit controllers), never change or drop what the agent wrote. Children of a list
    are matched regardless of order (libvirt sorts devices by kind): each of ours needs its own live
    twin of the same class.
    """
    here = path or ours.TAG
    if type(ours) is not type(live):
        return [f"{here}: ours is {type(ours).__name__}, live is {type(live).__name__}"]
    found: list[str] = []
    for name, xml in _declared(ours):
        mine, theirs = getattr(ours, name), getattr(live, name)
        where = f"{here}/{xml.name or name}"
        if mine is None or mine is False or (isinstance(mine, list) and not mine):
            continue
        if isinstance(mine, Element):
            if theirs is None:
                found.append(f"{where}: missing in the live domain")
            else:
                found.extend(owned_diff(mine, theirs, f"{here}/{mine.TAG}"))
        elif isinstance(mine, list):
            found.extend(_list_diff(mine, theirs, here))
        elif mine != theirs:
            found.append(f"{where}: ours {mine!r}, live {theirs!r}")
    return found


def _list_diff(ours: Sequence[Element], live: Sequence[Element], path: str) -> list[str]:
    found: list[str] = []
    unused = list(live)
    for n, item in enumerate(ours):
        where = f"{path}/{item.TAG}[{n}]"
        twins = [c for c in unused if type(c) is type(item)]
        twin = next((c for c in twins if not owned_diff(item, c, where)), None)
        if twin is not None:
            unused.remove(twin)
        elif twins:
            found.extend(owned_diff(item, twins[0], where))
        else:
            found.append(f"{where}: missing in the live domain")
    return found
