"""Build a slot's libvirt domain XML from a :class:`DomainSpec` (pure: same spec, same bytes).

Every element is there for a reason, given in the comment next to it; what is
*absent* is deliberate too: no ``<tpm>`` (seed 004: swtpm_setup failed on the
host and virt-install had auto-added a vTPM), no ``<graphics>`` (seed 002: raw
VNC is never exposed; the console is the serial port, gatewayed), no
``<emulator>`` (libvirt picks the binary from its capabilities), no
``<bandwidth>`` (ingress policing is set on the OVS interface by the OVS driver;
two policers on one port would fight).

The metadata element in our own namespace is how the agent recognises its
domains after a restart; :func:`read_metadata` is its inverse.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from gpuaas_agent.contract.domain import (
    METADATA_NS,
    METADATA_PREFIX,
    DomainMetadata,
    DomainSpec,
    DomainSpecError,
    GuestSlot,
    cpulist_cpus,
)
from gpuaas_agent.contract.runtime import HUGEPAGE_1G_MIB, DomainType
from gpuaas_agent.host.vm.guest_topology import GuestCell, GuestLayout, plan_layout

# Serialise our namespace as "gpuaas:" rather than "ns0:" (idempotent, process-wide by ElementTree's design).
ET.register_namespace(METADATA_PREFIX, METADATA_NS)
# libvirt's QEMU namespace, for the one fw_cfg argument libvirt has no element for (see build_domain).
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
ET.register_namespace("qemu", QEMU_NS)

METADATA_ROOT = "agent"
_METADATA_FIELDS = ("allocation_id", "slot_index", "task_id", "profile", "agent_version")


def _q(tag: str) -> str:
    return f"{{{METADATA_NS}}}{tag}"


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    element = ET.SubElement(parent, tag, attrs)
    if text is not None:
        element.text = text
    return element


def _pci_source(parent: ET.Element, address: str) -> None:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    source = _sub(parent, "source")
    _sub(source, "address", domain=f"0x{domain}", bus=f"0x{bus}", slot=f"0x{slot}", function=f"0x{function}")


def check_spec(spec: DomainSpec) -> list[int] | None:
    """Refuse a spec that cannot run on its slots; returns the first slot's NUMA node CPUs (None: no pinning)."""
    profile = spec.profile
    if profile.hugepages_1g and profile.memory_mib % HUGEPAGE_1G_MIB:
        raise DomainSpecError(
            f"memory {profile.memory_mib} MiB is not a multiple of the 1 GiB hugepage size",
            code="memory_not_hugepage_multiple",
            evidence={"allocation_id": spec.allocation_id, "slot_index": spec.slot_index, "profile": profile.name,
                      "memory_mib": profile.memory_mib, "hugepage_mib": HUGEPAGE_1G_MIB},
        )
    first = None
    for n, slot in enumerate(spec.guest_slots()):
        cpus = _check_slot(spec, slot)
        if n == 0:
            first = cpus
    return first


def _check_slot(spec: DomainSpec, slot: GuestSlot) -> list[int] | None:
    profile = spec.profile
    evidence = {"allocation_id": spec.allocation_id, "slot_index": slot.slot_index, "profile": profile.name}
    if profile.hostdevs and (slot.gpu_pci_address is None or slot.fabric_vf_pci_address is None):
        raise DomainSpecError(
            f"profile {profile.name} passes through a GPU and a fabric VF but the spec lacks one",
            code="hostdev_missing",
            evidence={**evidence, "gpu": slot.gpu_pci_address, "fabric_vf": slot.fabric_vf_pci_address},
        )
    if (slot.numa_node is None) != (slot.numa_cpulist is None):
        raise DomainSpecError(
            "numa_node and numa_cpulist come together (the node and that node's cpulist)",
            code="numa_unknown",
            evidence={**evidence, "numa_node": slot.numa_node, "numa_cpulist": slot.numa_cpulist},
        )
    if slot.numa_node is None:
        if profile.domain_type is DomainType.kvm or profile.hostdevs:
            # Production pins to the GPU's node; a GPU with no known node (numa_node=-1) cannot be placed.
            raise DomainSpecError(
                f"profile {profile.name} needs the GPU's NUMA node and cpulist for pinning",
                code="numa_unknown",
                evidence=evidence,
            )
        return None
    if slot.nvme_numa_node is not None and slot.nvme_numa_node != slot.numa_node:
        raise DomainSpecError(
            f"slot disk is on NUMA node {slot.nvme_numa_node}, its GPU on node {slot.numa_node}",
            code="disk_numa_mismatch",
            evidence={**evidence, "gpu_numa_node": slot.numa_node, "nvme_numa_node": slot.nvme_numa_node,
                      "nvme_device": slot.nvme_device},
        )
    try:
        cpus = cpulist_cpus(slot.numa_cpulist or "")
    except ValueError as exc:
        raise DomainSpecError(
            f"cpulist {slot.numa_cpulist!r} of NUMA node {slot.numa_node} is not valid: {exc}",
            code="numa_unknown",
            evidence={**evidence, "numa_node": slot.numa_node, "numa_cpulist": slot.numa_cpulist},
        ) from None
    if profile.vcpus > len(cpus):
        raise DomainSpecError(
            f"profile {profile.name} asks for {profile.vcpus} vCPUs; NUMA node {slot.numa_node} has {len(cpus)}",
            code="vcpus_exceed_numa_node",
            evidence={**evidence, "vcpus": profile.vcpus, "numa_node": slot.numa_node,
                      "numa_cpulist": slot.numa_cpulist, "node_cpus": len(cpus)},
        )
    return cpus


def build_domain(spec: DomainSpec) -> ET.Element:
    """The ``<domain>`` element for ``spec``; raises :class:`DomainSpecError` before building anything."""
    node_cpus = check_spec(spec)
    profile = spec.profile
    # Passthrough guests get the host's NUMA/PCIe layout (host/vm/guest_topology.py), one slot or eight.
    layout = plan_layout(spec) if profile.hostdevs else None
    # type: kvm in production; qemu (TCG) in the lab, where KVM cannot boot a stock kernel (docs/testing.md).
    domain = ET.Element("domain", {"type": profile.domain_type.value})
    # name: derived from the allocation only, so it survives an agent restart with no local state.
    _sub(domain, "name", spec.domain_name)
    # metadata: the ownership mark read back by list/define (same name, other owner -> never overwritten).
    metadata = _sub(domain, "metadata")
    agent = _sub(metadata, _q(METADATA_ROOT))
    for field, value in spec.metadata().model_dump().items():
        _sub(agent, _q(field), str(value))
    if layout is not None:
        _topology_head(domain, spec, layout)
    else:
        _single_node_head(domain, spec, node_cpus)
    os_ = _sub(domain, "os")
    # q35: PCIe topology, needed for GPU passthrough with large BARs.
    _sub(os_, "type", "hvm", arch="x86_64", machine="q35")
    # loader: OVMF CODE discovered on the host (discovery/ovmf.py); secure='no' because Secure Boot rejected
    # the guest NVIDIA module in seed 004 ("Key was rejected by service").
    _sub(os_, "loader", spec.firmware.code_path, readonly="yes", secure="no", type="pflash")
    # nvram: per-domain copy of the matching VARS template; removed by undefine with VIR_DOMAIN_UNDEFINE_NVRAM.
    nvram = _sub(os_, "nvram", spec.nvram_path, template=spec.firmware.vars_template_path)
    if spec.nvram_path is None:
        nvram.text = None
    features = _sub(domain, "features")
    # acpi: the guest sees the power button, which is how a graceful shutdown is asked for.
    _sub(features, "acpi")
    # apic: required for SMP x86 guests.
    _sub(features, "apic")
    if profile.domain_type is DomainType.kvm:
        # cpu host-passthrough: the guest sees the host CPU (and its physical address bits, which the
        # H200's large BARs need). TCG cannot emulate the host CPU, so the lab keeps QEMU's default model.
        # check=none: no CPU model comparison to do; migratable=off: a VFIO guest never migrates, so expose
        # every host feature (including the non-migratable invariant TSC).
        cpu = _sub(domain, "cpu", mode="host-passthrough", check="none", migratable="off")
        if layout is None:
            # topology: one socket of N cores, matching the vCPU count (libvirt refuses a mismatch); threads=1
            # because the pinned host CPUs are not handed out as sibling pairs.
            _sub(cpu, "topology", sockets="1", dies="1", cores=str(profile.vcpus), threads="1")
        else:
            _topology_cpu(cpu, layout)
    # clock utc: Linux guests keep the RTC in UTC.
    _sub(domain, "clock", offset="utc")
    # on_poweroff destroy: a guest that powers off is gone; on_reboot restart: cloud-init reboots after
    # installing the guest driver; on_crash destroy: a crashed slice is reported, not silently looped.
    _sub(domain, "on_poweroff", "destroy")
    _sub(domain, "on_reboot", "restart")
    _sub(domain, "on_crash", "destroy")
    devices = _sub(domain, "devices")
    if layout is None:
        # disk: the raw slot NVMe by its stable by-id name (kernel names move); cache=none io=native is the
        # direct-I/O path for a raw block device; discard=unmap lets the guest TRIM the drive.
        # boot order 1: UEFI boots the slot disk; the seed ISO is data for cloud-init, not a boot medium.
        for n, slot in enumerate(spec.guest_slots()):
            _slot_disk(devices, slot.nvme_device, n, boot=n == 0)
    else:
        _topology_devices(devices, spec, layout)
    # cdrom: the cloud-init seed (label cidata), read-only so the guest cannot alter its own configuration.
    cdrom = _sub(devices, "disk", type="file", device="cdrom")
    _sub(cdrom, "driver", name="qemu", type="raw")
    _sub(cdrom, "source", file=spec.seed_iso_path)
    _sub(cdrom, "target", dev="sda", bus="sata")
    _sub(cdrom, "readonly")
    # interface: the slot vNIC on the OVS bridge with the platform-owned MAC (DHCP reservation keys on it);
    # interfaceid = allocation id, written by libvirt as external_ids:iface-id, traces the port back.
    # target dev: our own tap name (libvirt reserves "vnet*").
    interface = _sub(devices, "interface", type="bridge")
    _sub(interface, "mac", address=spec.mac)
    _sub(interface, "source", bridge=spec.ovs_bridge)
    virtualport = _sub(interface, "virtualport", type="openvswitch")
    _sub(virtualport, "parameters", interfaceid=spec.allocation_id)
    _sub(interface, "target", dev=spec.vnic_name)
    _sub(interface, "model", type=profile.nic_model.value)
    # serial + console: the only console (no VNC/SPICE listener); the terminal gateway attaches to it.
    serial = _sub(devices, "serial", type="pty")
    if spec.serial_log_path is not None:
        # append: a restarted domain (power start, reboot) adds to the log instead of erasing what the last
        # boot printed (host/vm/consolelog.py caps it).
        _sub(serial, "log", file=spec.serial_log_path, append="on")
    _sub(serial, "target", type="isa-serial", port="0")
    console = _sub(devices, "console", type="pty")
    _sub(console, "target", type="serial", port="0")
    # rng: guest entropy at first boot (SSH host keys are generated then).
    rng = _sub(devices, "rng", model="virtio")
    _sub(rng, "backend", "/dev/urandom", model="random")
    # memballoon none: guest RAM is pinned (VFIO, hugepages); a balloon could only lie about it.
    _sub(devices, "memballoon", model="none")
    if layout is not None:
        # -fw_cfg opt/ovmf/X-PciMmio64Mb: OVMF sizes its 64-bit PCI window from it; its default (32 GiB) cannot map
        # one H200's 256 GiB BAR ("BAR1 is 0M" in the guest). Sized from the BARs discovery read
        # (guest_topology.py). Why qemu:commandline and not <sysinfo type='fwcfg'>: libvirt reserves the
        # opt/ovmf/ names there ("That firmware name is reserved", libvirt 9.0 QEMU driver), and has no element
        # for OVMF's window; libvirt marks the domain tainted (custom-argv), which is expected for this one arg.
        commandline = _sub(domain, f"{{{QEMU_NS}}}commandline")
        _sub(commandline, f"{{{QEMU_NS}}}arg", value="-fw_cfg")
        _sub(commandline, f"{{{QEMU_NS}}}arg", value=f"name=opt/ovmf/X-PciMmio64Mb,string={layout.mmio64_mib}")
    return domain


def _single_node_head(domain: ET.Element, spec: DomainSpec, node_cpus: list[int] | None) -> None:
    """Memory and vCPUs of a guest without passthrough (the lab's TCG shape): one cell, optional pinning."""
    profile = spec.profile
    slots = len(spec.guest_slots())
    # memory: the profile's size per slot; MiB so the golden reads like the profile.
    _sub(domain, "memory", str(profile.memory_mib * slots), unit="MiB")
    if profile.hugepages_1g:
        # memoryBacking: 1 GiB pages (seed 004 tuned profile); no nodeset (the guest has one NUMA cell),
        # host placement comes from numatune below.
        backing = _sub(domain, "memoryBacking")
        hugepages = _sub(backing, "hugepages")
        _sub(hugepages, "page", size="1048576", unit="KiB")
    vcpu_attrs = {"placement": "static"}
    if node_cpus is not None:
        # cpuset: vCPUs and emulator threads stay on the GPU's NUMA node (PCIe locality of GPU, VF, NVMe).
        vcpu_attrs["cpuset"] = spec.numa_cpulist or ""
    _sub(domain, "vcpu", str(profile.vcpus * slots), **vcpu_attrs)
    if node_cpus is not None:
        # cputune: each vCPU pinned to the node's cpulist; the emulator thread too, so nothing floats off-node.
        cputune = _sub(domain, "cputune")
        for index in range(profile.vcpus * slots):
            _sub(cputune, "vcpupin", vcpu=str(index), cpuset=spec.numa_cpulist or "")
        _sub(cputune, "emulatorpin", cpuset=spec.numa_cpulist or "")
        # numatune strict: guest RAM only from the GPU's node; a host that cannot give it fails start, not latency.
        numatune = _sub(domain, "numatune")
        _sub(numatune, "memory", mode="strict", nodeset=str(spec.numa_node))


def _topology_head(domain: ET.Element, spec: DomainSpec, layout: GuestLayout) -> None:
    """Memory, vCPUs, pinning and NUMA placement of a passthrough guest: one guest cell per host node used."""
    profile = spec.profile
    # memory: every slot's share (profile size x slots).
    _sub(domain, "memory", str(layout.memory_mib), unit="MiB")
    # memtune hard_limit: also the memlock limit QEMU gets; VFIO pins all guest RAM at start, so without room
    # for it the start fails with "cannot allocate memory" (VFIO_IOMMU_MAP_DMA). Sized in guest_topology.py.
    memtune = _sub(domain, "memtune")
    _sub(memtune, "hard_limit", str(layout.memlock_kib), unit="KiB")
    backing = _sub(domain, "memoryBacking")
    if profile.hugepages_1g:
        # hugepages 1 GiB on every guest cell; which host node each cell's pages come from is numatune's memnode.
        hugepages = _sub(backing, "hugepages")
        _sub(hugepages, "page", size="1048576", unit="KiB")
    # locked: guest RAM is never swapped (VFIO has pinned it anyway); libvirt then applies hard_limit as memlock.
    _sub(backing, "locked")
    # source memfd: one anonymous file per cell, hugetlb-backed when hugepages are on (QEMU's memfd backend).
    _sub(backing, "source", type="memfd")
    # allocation immediate with threads: preallocate (touch) guest RAM from several threads before the vCPUs run,
    # instead of VFIO faulting every page in from one thread at device realize (bench/bench_guest_start.py).
    _sub(backing, "allocation", mode="immediate", threads=str(layout.prealloc_threads))
    # vcpu cpuset: the union of the nodes used; each vCPU is then pinned to its own cell's node.
    _sub(domain, "vcpu", str(layout.vcpus), placement="static", cpuset=layout.vcpu_cpuset)
    cputune = _sub(domain, "cputune")
    for cell in layout.cells:
        for vcpu in range(cell.vcpu_first, cell.vcpu_first + cell.vcpus):
            _sub(cputune, "vcpupin", vcpu=str(vcpu), cpuset=cell.host_cpulist)
    # emulatorpin: the first (boot) slot's node; QEMU's main loop and I/O threads stay next to the boot disk.
    _sub(cputune, "emulatorpin", cpuset=_cell_for_node(layout, spec.numa_node).host_cpulist)
    # numatune strict: all guest RAM from the nodes used, and each guest cell from exactly its host node.
    numatune = _sub(domain, "numatune")
    _sub(numatune, "memory", mode="strict", nodeset=",".join(str(c.host_node) for c in layout.cells))
    for cell in layout.cells:
        _sub(numatune, "memnode", cellid=str(cell.cell_id), mode="strict", nodeset=str(cell.host_node))


def _cell_for_node(layout: GuestLayout, node: int | None) -> GuestCell:
    return next(c for c in layout.cells if c.host_node == node)


def _topology_cpu(cpu: ET.Element, layout: GuestLayout) -> None:
    """CPU topology and guest NUMA cells of a passthrough guest."""
    counts = {c.vcpus for c in layout.cells}
    # topology: one socket per cell when the cells are equal (the guest's sockets then match its NUMA nodes);
    # else one socket (libvirt refuses a topology that does not multiply to the vCPU count). threads=1: pinned
    # host CPUs are not handed out as sibling pairs.
    sockets = len(layout.cells) if len(counts) == 1 else 1
    _sub(cpu, "topology", sockets=str(sockets), dies="1", cores=str(layout.vcpus // sockets), threads="1")
    # maxphysaddr passthrough: the guest gets the host's physical address width, so a multi-TiB MMIO window
    # above guest RAM is addressable (QEMU's 40-bit default ends at 1 TiB).
    _sub(cpu, "maxphysaddr", mode="passthrough")
    numa = _sub(cpu, "numa")
    for cell in layout.cells:
        last = cell.vcpu_first + cell.vcpus - 1
        _sub(numa, "cell", id=str(cell.cell_id), cpus=f"{cell.vcpu_first}-{last}", memory=str(cell.memory_mib),
             unit="MiB")


def _topology_devices(devices: ET.Element, spec: DomainSpec, layout: GuestLayout) -> None:
    """Expanders, root ports, and each slot's GPU, VF and NVMe behind its own node's expander."""
    # pcie-root: the q35 root complex (index 0), named so the expanders' addresses have a parent to refer to.
    _sub(devices, "controller", type="pci", index="0", model="pcie-root")
    for cell in layout.cells:
        # pcie-expander-bus (pxb-pcie): a host bridge carrying the guest NUMA node (<node>) of its host node's
        # cell; the guest kernel reports that node for every device behind it (numa_node in the guest's sysfs).
        pxb = _sub(devices, "controller", type="pci", index=str(cell.expander_index), model="pcie-expander-bus")
        _sub(pxb, "model", name="pxb-pcie")
        target = _sub(pxb, "target", busNr=str(cell.expander_bus))
        _sub(target, "node", str(cell.cell_id))
        _pci_address(pxb, bus=0, slot=cell.expander_index)
    disk_number = 0
    for port in layout.root_ports:
        # pcie-root-port: one per device (PCIe has one device per link); chassis/port unique per parent.
        rp = _sub(devices, "controller", type="pci", index=str(port.index), model="pcie-root-port")
        _sub(rp, "model", name="pcie-root-port")
        _sub(rp, "target", chassis=str(port.chassis), port=f"0x{port.port:x}")
        _pci_address(rp, bus=port.expander_index, slot=port.port)
        if port.kind == "nvme":
            _slot_disk(devices, port.nvme_device or "", disk_number, boot=port.boot, bus=port.index)
            disk_number += 1
        else:
            # hostdev managed='no': the agent binds GPU and VF to vfio-pci itself, after the IOMMU group guard
            # (docs/safety.md §3); libvirt's managed detach would bypass that guard. driver vfio: the only backend.
            hostdev = _sub(devices, "hostdev", mode="subsystem", type="pci", managed="no")
            _sub(hostdev, "driver", name="vfio")
            _pci_source(hostdev, port.host_address or "")
            _pci_address(hostdev, bus=port.index, slot=0)


def _pci_address(parent: ET.Element, *, bus: int, slot: int) -> None:
    _sub(parent, "address", type="pci", domain="0x0000", bus=f"0x{bus:02x}", slot=f"0x{slot:02x}", function="0x0")


def _slot_disk(devices: ET.Element, nvme_device: str, number: int, *, boot: bool, bus: int | None = None) -> None:
    """A slot's raw NVMe (virtio-blk); the boot slot's carries boot order 1, the others are data disks."""
    # disk: the raw slot NVMe by its stable by-id name (kernel names move); cache=none io=native is the
    # direct-I/O path for a raw block device; discard=unmap lets the guest TRIM the drive.
    disk = _sub(devices, "disk", type="block", device="disk")
    _sub(disk, "driver", name="qemu", type="raw", cache="none", io="native", discard="unmap")
    _sub(disk, "source", dev=nvme_device)
    _sub(disk, "target", dev="vd" + chr(ord("a") + number), bus="virtio")
    if boot:
        # boot order 1: UEFI boots the slot disk; the seed ISO is data for cloud-init, not a boot medium.
        _sub(disk, "boot", order="1")
    if bus is not None:
        _pci_address(disk, bus=bus, slot=0)


def build_domain_xml(spec: DomainSpec) -> str:
    """``spec`` as indented XML text with a trailing newline; deterministic, so goldens pin it."""
    domain = build_domain(spec)
    ET.indent(domain, space="  ")
    return ET.tostring(domain, encoding="unicode") + "\n"


def read_metadata(agent_xml: str) -> DomainMetadata | None:
    """Parse our ``<gpuaas:agent>`` element (as libvirt returns it, or a whole ``<domain>``); None if absent/foreign.

    A malformed ownership mark is treated as absent: the domain is not provably ours.
    """
    try:
        root = ET.fromstring(agent_xml)
    except ET.ParseError:
        return None
    # virDomainGetMetadata returns the element with its namespace stripped (<agent>); XMLDesc keeps it.
    element: ET.Element | None
    if root.tag in (_q(METADATA_ROOT), METADATA_ROOT):
        element = root
    else:
        element = root.find(f"metadata/{_q(METADATA_ROOT)}")
    if element is None:
        return None
    ns = element.tag[: -len(METADATA_ROOT)]
    values: dict[str, Any] = {}  # XML text, then slot_index as an int
    for field in _METADATA_FIELDS:
        child = element.find(ns + field)
        if child is None or child.text is None:
            return None
        values[field] = child.text
    if not values["slot_index"].isascii() or not values["slot_index"].isdigit():
        return None  # XML text: the one integer field is converted here, the model itself is strict
    values["slot_index"] = int(values["slot_index"])
    try:
        return DomainMetadata.model_validate(values)
    except ValueError:
        return None


def metadata_element_xml(metadata: DomainMetadata) -> str:
    """Just the ``<gpuaas:agent>`` element, as ``virDomainSetMetadata`` takes it."""
    agent = ET.Element(_q(METADATA_ROOT))
    for field, value in metadata.model_dump().items():
        _sub(agent, _q(field), str(value))
    return ET.tostring(agent, encoding="unicode")
