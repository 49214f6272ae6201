"""Build a slot's libvirt domain XML from a :class:`DomainSpec` (pure: same spec, same bytes).

Every element is there for a reason, given in the comment next to it; what is
*absent* is deliberate too: no ``<tpm>`` (seed 004: swtpm_setup failed on the
host and virt-install had auto-added a vTPM), no ``<graphics>`` (seed 002: raw
VNC is never exposed; the console is the serial port, gatewayed), no
``<emulator>`` (libvirt picks the binary from its capabilities), no
``<bandwidth>`` (ingress policing is set on the OVS interface by the OVS driver;
two policers on one port would fight).

The XML is made of the element classes of ``domain_config.py``, which also parse
it: this module decides *what* the domain holds, those classes *how* each piece is
written and read back (libvirt_lifecycle reads live domains through them).

The metadata element in our own namespace is how the agent recognises its
domains after a restart; :func:`read_metadata` is its inverse.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from gpuaas_agent.contract.domain import (
    METADATA_NS,
    DomainMetadata,
    DomainSpec,
    DomainSpecError,
    GuestSlot,
    cpulist_cpus,
)
from gpuaas_agent.contract.runtime import HUGEPAGE_1G_MIB, DomainType
from gpuaas_agent.host.vm.domain_config import (
    Address,
    AgentMetadata,
    Boot,
    CharLog,
    CharTarget,
    Clock,
    Console,
    Controller,
    ControllerModel,
    ControllerTarget,
    Cpu,
    CpuNuma,
    CpuSet,
    CpuTopology,
    CpuTune,
    Devices,
    Disk,
    DiskDriver,
    DiskSource,
    DiskTarget,
    Domain,
    EmulatorPin,
    Features,
    Hostdev,
    HostdevDriver,
    HostdevSource,
    HugePage,
    HugePages,
    Interface,
    InterfaceModel,
    InterfaceSource,
    InterfaceTarget,
    Loader,
    Mac,
    MachineType,
    MaxPhysAddr,
    MemBalloon,
    MemoryAllocation,
    MemoryBacking,
    MemorySource,
    MemTune,
    Metadata,
    NumaCell,
    NumaMemNode,
    NumaMemory,
    NumaTune,
    Nvram,
    Os,
    OsType,
    QemuArg,
    QemuCommandline,
    Rng,
    RngBackend,
    Serial,
    Size,
    Vcpu,
    VcpuPin,
    VirtualPort,
    VirtualPortParameters,
)
from gpuaas_agent.host.vm.guest_topology import GuestCell, GuestLayout, plan_layout


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
    return guest_domain(spec).format_dom()


def guest_domain(spec: DomainSpec) -> Domain:
    """The slot's domain as element objects (``domain_config.py``); raises :class:`DomainSpecError` first."""
    node_cpus = check_spec(spec)
    profile = spec.profile
    # Passthrough guests get the host's NUMA/PCIe layout (host/vm/guest_topology.py), one slot or eight.
    layout = plan_layout(spec) if profile.hostdevs else None
    # type: kvm in production; qemu (TCG) in the lab, where KVM cannot boot a stock kernel (docs/testing.md).
    # name: derived from the allocation only, so it survives an agent restart with no local state.
    # metadata: the ownership mark read back by list/define (same name, other owner -> never overwritten).
    domain = Domain(type_=profile.domain_type.value, name=spec.domain_name,
                    metadata=Metadata(agent=agent_metadata(spec.metadata())))
    if layout is not None:
        _topology_head(domain, spec, layout)
    else:
        _single_node_head(domain, spec, node_cpus)
    domain.os = Os(
        # q35: PCIe topology, needed for GPU passthrough with large BARs.
        type_=OsType(arch="x86_64", machine=MachineType("q35"), name="hvm"),
        # loader: OVMF CODE discovered on the host (discovery/ovmf.py); secure='no' because Secure Boot rejected
        # the guest NVIDIA module in seed 004 ("Key was rejected by service").
        loader=Loader(readonly="yes", secure="no", type_="pflash", path=spec.firmware.code_path),
        # nvram: per-domain copy of the matching VARS template; removed by undefine with VIR_DOMAIN_UNDEFINE_NVRAM.
        nvram=Nvram(template=spec.firmware.vars_template_path, path=spec.nvram_path),
    )
    # acpi: the guest sees the power button, which is how a graceful shutdown is asked for.
    # apic: required for SMP x86 guests.
    domain.features = Features(acpi=True, apic=True)
    if profile.domain_type is DomainType.kvm:
        # cpu host-passthrough: the guest sees the host CPU (and its physical address bits, which the
        # H200's large BARs need). TCG cannot emulate the host CPU, so the lab keeps QEMU's default model.
        # check=none: no CPU model comparison to do; migratable=off: a VFIO guest never migrates, so expose
        # every host feature (including the non-migratable invariant TSC).
        cpu = Cpu(mode="host-passthrough", check="none", migratable="off")
        if layout is None:
            # topology: one socket of N cores, matching the vCPU count (libvirt refuses a mismatch); threads=1
            # because the pinned host CPUs are not handed out as sibling pairs.
            cpu.topology = CpuTopology(sockets="1", dies="1", cores=str(profile.vcpus), threads="1")
        else:
            _topology_cpu(cpu, layout)
        domain.cpu = cpu
    # clock utc: Linux guests keep the RTC in UTC.
    domain.clock = Clock(offset="utc")
    # on_poweroff destroy: a guest that powers off is gone; on_reboot restart: cloud-init reboots after
    # installing the guest driver; on_crash destroy: a crashed slice is reported, not silently looped.
    domain.on_poweroff, domain.on_reboot, domain.on_crash = "destroy", "restart", "destroy"
    devices = Devices()
    if layout is None:
        # disk: the raw slot NVMe by its stable by-id name (kernel names move); cache=none io=native is the
        # direct-I/O path for a raw block device; discard=unmap lets the guest TRIM the drive.
        # boot order 1: UEFI boots the slot disk; the seed ISO is data for cloud-init, not a boot medium.
        for n, slot in enumerate(spec.guest_slots()):
            devices.items.append(_slot_disk(slot.nvme_device, n, boot=n == 0))
    else:
        _topology_devices(devices, spec, layout)
    # cdrom: the cloud-init seed (label cidata), read-only so the guest cannot alter its own configuration.
    devices.items.append(Disk(type_="file", device="cdrom", driver=DiskDriver(name="qemu", type_="raw"),
                              source=DiskSource(file=spec.seed_iso_path), target=DiskTarget(dev="sda", bus="sata"),
                              readonly=True))
    # interface: the slot vNIC on the OVS bridge with the platform-owned MAC (DHCP reservation keys on it);
    # interfaceid = allocation id, written by libvirt as external_ids:iface-id, traces the port back.
    # target dev: our own tap name (libvirt reserves "vnet*").
    devices.items.append(Interface(
        type_="bridge", mac=Mac(address=spec.mac), source=InterfaceSource(bridge=spec.ovs_bridge),
        virtualport=VirtualPort(type_="openvswitch",
                                parameters=VirtualPortParameters(interfaceid=spec.allocation_id)),
        target=InterfaceTarget(dev=spec.vnic_name), model=InterfaceModel(type_=profile.nic_model.value)))
    # serial + console: the only console (no VNC/SPICE listener); the terminal gateway attaches to it.
    # log append: a restarted domain (power start, reboot) adds to the log instead of erasing what the last
    # boot printed (host/vm/consolelog.py caps it).
    log = None if spec.serial_log_path is None else CharLog(file=spec.serial_log_path, append="on")
    devices.items.append(Serial(type_="pty", log=log, target=CharTarget(type_="isa-serial", port="0")))
    devices.items.append(Console(type_="pty", target=CharTarget(type_="serial", port="0")))
    # rng: guest entropy at first boot (SSH host keys are generated then).
    devices.items.append(Rng(model="virtio", backend=RngBackend(model="random", path="/dev/urandom")))
    # memballoon none: guest RAM is pinned (VFIO, hugepages); a balloon could only lie about it.
    devices.items.append(MemBalloon(model="none"))
    domain.devices = devices
    if layout is not None:
        # -fw_cfg opt/ovmf/X-PciMmio64Mb: OVMF sizes its 64-bit PCI window from it; its default (32 GiB) cannot map
        # one H200's 256 GiB BAR ("BAR1 is 0M" in the guest). Sized from the BARs discovery read
        # (guest_topology.py). Why qemu:commandline and not <sysinfo type='fwcfg'>: libvirt reserves the
        # opt/ovmf/ names there ("That firmware name is reserved", libvirt 9.0 QEMU driver), and has no element
        # for OVMF's window; libvirt marks the domain tainted (custom-argv), which is expected for this one arg.
        domain.qemu_commandline = QemuCommandline(args=[
            QemuArg(value="-fw_cfg"), QemuArg(value=f"name=opt/ovmf/X-PciMmio64Mb,string={layout.mmio64_mib}")])
    return domain


def _single_node_head(domain: Domain, spec: DomainSpec, node_cpus: list[int] | None) -> None:
    """Memory and vCPUs of a guest without passthrough (the lab's TCG shape): one cell, optional pinning."""
    profile = spec.profile
    slots = len(spec.guest_slots())
    # memory: the profile's size per slot; MiB so the golden reads like the profile.
    domain.memory = Size.mib(profile.memory_mib * slots)
    if profile.hugepages_1g:
        # memoryBacking: 1 GiB pages (seed 004 tuned profile); no nodeset (the guest has one NUMA cell),
        # host placement comes from numatune below.
        domain.memory_backing = MemoryBacking(hugepages=_hugepages_1g())
    # cpuset: vCPUs and emulator threads stay on the GPU's NUMA node (PCIe locality of GPU, VF, NVMe).
    cpuset = CpuSet(spec.numa_cpulist or "") if node_cpus is not None else None
    domain.vcpu = Vcpu(placement="static", cpuset=cpuset, count=str(profile.vcpus * slots))
    if cpuset is not None:
        # cputune: each vCPU pinned to the node's cpulist; the emulator thread too, so nothing floats off-node.
        domain.cputune = CpuTune(vcpupins=[VcpuPin(vcpu=str(index), cpuset=cpuset)
                                           for index in range(profile.vcpus * slots)],
                                 emulatorpin=EmulatorPin(cpuset=cpuset))
        # numatune strict: guest RAM only from the GPU's node; a host that cannot give it fails start, not latency.
        domain.numatune = NumaTune(memory=NumaMemory(mode="strict", nodeset=CpuSet(str(spec.numa_node))))


def _hugepages_1g() -> HugePages:
    return HugePages(pages=[HugePage(size="1048576", unit="KiB")])


def _topology_head(domain: Domain, spec: DomainSpec, layout: GuestLayout) -> None:
    """Memory, vCPUs, pinning and NUMA placement of a passthrough guest: one guest cell per host node used."""
    profile = spec.profile
    # memory: every slot's share (profile size x slots).
    domain.memory = Size.mib(layout.memory_mib)
    # memtune hard_limit: also the memlock limit QEMU gets; VFIO pins all guest RAM at start, so without room
    # for it the start fails with "cannot allocate memory" (VFIO_IOMMU_MAP_DMA). Sized in guest_topology.py.
    domain.memtune = MemTune(hard_limit=Size.kib(layout.memlock_kib))
    domain.memory_backing = MemoryBacking(
        # hugepages 1 GiB on every guest cell; which host node each cell's pages come from is numatune's memnode.
        hugepages=_hugepages_1g() if profile.hugepages_1g else None,
        # locked: guest RAM is never swapped (VFIO has pinned it anyway); libvirt then applies hard_limit as memlock.
        locked=True,
        # source memfd: one anonymous file per cell, hugetlb-backed when hugepages are on (QEMU's memfd backend).
        source=MemorySource(type_="memfd"),
        # allocation immediate with threads: preallocate (touch) guest RAM from several threads before the vCPUs
        # run, instead of VFIO faulting every page in from one thread at device realize (bench/bench_guest_start.py).
        allocation=MemoryAllocation(mode="immediate", threads=str(layout.prealloc_threads)),
    )
    # vcpu cpuset: the union of the nodes used; each vCPU is then pinned to its own cell's node.
    domain.vcpu = Vcpu(placement="static", cpuset=CpuSet(layout.vcpu_cpuset), count=str(layout.vcpus))
    domain.cputune = CpuTune(
        vcpupins=[VcpuPin(vcpu=str(vcpu), cpuset=CpuSet(cell.host_cpulist))
                  for cell in layout.cells for vcpu in range(cell.vcpu_first, cell.vcpu_first + cell.vcpus)],
        # emulatorpin: the first (boot) slot's node; QEMU's main loop and I/O threads stay next to the boot disk.
        emulatorpin=EmulatorPin(cpuset=CpuSet(_cell_for_node(layout, spec.numa_node).host_cpulist)),
    )
    # numatune strict: all guest RAM from the nodes used, and each guest cell from exactly its host node.
    domain.numatune = NumaTune(
        memory=NumaMemory(mode="strict", nodeset=CpuSet(",".join(str(c.host_node) for c in layout.cells))),
        memnodes=[NumaMemNode(cellid=str(cell.cell_id), mode="strict", nodeset=CpuSet(str(cell.host_node)))
                  for cell in layout.cells],
    )


def _cell_for_node(layout: GuestLayout, node: int | None) -> GuestCell:
    return next(c for c in layout.cells if c.host_node == node)


def _topology_cpu(cpu: Cpu, layout: GuestLayout) -> None:
    """CPU topology and guest NUMA cells of a passthrough guest."""
    counts = {c.vcpus for c in layout.cells}
    # topology: one socket per cell when the cells are equal (the guest's sockets then match its NUMA nodes);
    # else one socket (libvirt refuses a topology that does not multiply to the vCPU count). threads=1: pinned
    # host CPUs are not handed out as sibling pairs.
    sockets = len(layout.cells) if len(counts) == 1 else 1
    cpu.topology = CpuTopology(sockets=str(sockets), dies="1", cores=str(layout.vcpus // sockets), threads="1")
    # maxphysaddr passthrough: the guest gets the host's physical address width, so a multi-TiB MMIO window
    # above guest RAM is addressable (QEMU's 40-bit default ends at 1 TiB).
    cpu.maxphysaddr = MaxPhysAddr(mode="passthrough")
    cpu.numa = CpuNuma(cells=[
        NumaCell(id_=str(cell.cell_id), cpus=CpuSet(f"{cell.vcpu_first}-{cell.vcpu_first + cell.vcpus - 1}"),
                 memory=Size.mib(cell.memory_mib))
        for cell in layout.cells])


def _topology_devices(devices: Devices, spec: DomainSpec, layout: GuestLayout) -> None:
    """Expanders, root ports, and each slot's GPU, VF and NVMe behind its own node's expander."""
    # pcie-root: the q35 root complex (index 0), named so the expanders' addresses have a parent to refer to.
    devices.items.append(Controller(type_="pci", index="0", model="pcie-root"))
    for cell in layout.cells:
        # pcie-expander-bus (pxb-pcie): a host bridge carrying the guest NUMA node (<node>) of its host node's
        # cell; the guest kernel reports that node for every device behind it (numa_node in the guest's sysfs).
        devices.items.append(Controller(
            type_="pci", index=str(cell.expander_index), model="pcie-expander-bus",
            model_name=ControllerModel(name="pxb-pcie"),
            target=ControllerTarget(bus_nr=str(cell.expander_bus), node=str(cell.cell_id)),
            address=Address.guest_pci(bus=0, slot=cell.expander_index)))
    disk_number = 0
    for port in layout.root_ports:
        # pcie-root-port: one per device (PCIe has one device per link); chassis/port unique per parent.
        devices.items.append(Controller(
            type_="pci", index=str(port.index), model="pcie-root-port",
            model_name=ControllerModel(name="pcie-root-port"),
            target=ControllerTarget(chassis=str(port.chassis), port=f"0x{port.port:x}"),
            address=Address.guest_pci(bus=port.expander_index, slot=port.port)))
        if port.kind == "nvme":
            devices.items.append(_slot_disk(port.nvme_device or "", disk_number, boot=port.boot, bus=port.index))
            disk_number += 1
        else:
            # hostdev managed='no': the agent binds GPU and VF to vfio-pci itself, after the IOMMU group guard
            # (docs/safety.md §3); libvirt's managed detach would bypass that guard. driver vfio: the only backend.
            devices.items.append(Hostdev(
                mode="subsystem", type_="pci", managed="no", driver=HostdevDriver(name="vfio"),
                source=HostdevSource(address=Address.pci(port.host_address or "")),
                address=Address.guest_pci(bus=port.index, slot=0)))


def _slot_disk(nvme_device: str, number: int, *, boot: bool, bus: int | None = None) -> Disk:
    """A slot's raw NVMe (virtio-blk); the boot slot's carries boot order 1, the others are data disks."""
    # disk: the raw slot NVMe by its stable by-id name (kernel names move); cache=none io=native is the
    # direct-I/O path for a raw block device; discard=unmap lets the guest TRIM the drive.
    return Disk(
        type_="block", device="disk",
        driver=DiskDriver(name="qemu", type_="raw", cache="none", io="native", discard="unmap"),
        source=DiskSource(dev=nvme_device),
        target=DiskTarget(dev="vd" + chr(ord("a") + number), bus="virtio"),
        # boot order 1: UEFI boots the slot disk; the seed ISO is data for cloud-init, not a boot medium.
        boot=Boot(order="1") if boot else None,
        address=None if bus is None else Address.guest_pci(bus=bus, slot=0),
    )


def build_domain_xml(spec: DomainSpec) -> str:
    """``spec`` as indented XML text with a trailing newline; deterministic, so goldens pin it."""
    return guest_domain(spec).to_xml()


def agent_metadata(metadata: DomainMetadata) -> AgentMetadata:
    """The ownership mark as its element object."""
    return AgentMetadata(**{field: str(value) for field, value in metadata.model_dump().items()})


def read_metadata(agent_xml: str) -> DomainMetadata | None:
    """Parse our ``<gpuaas:agent>`` element (as libvirt returns it, or a whole ``<domain>``); None if absent/foreign.

    A malformed ownership mark is treated as absent: the domain is not provably ours.
    """
    try:
        root = ET.fromstring(agent_xml)
    except ET.ParseError:
        return None
    if root.tag == "agent":
        # virDomainGetMetadata returns the element with its namespace stripped (<agent>); XMLDesc keeps it.
        for element in root.iter():
            if not element.tag.startswith("{"):
                element.tag = f"{{{METADATA_NS}}}{element.tag}"
    if root.tag == AgentMetadata.TAG:
        agent = AgentMetadata.parse_dom(root)
    else:
        metadata = Domain.parse_dom(root).metadata
        if metadata is None or metadata.agent is None:
            return None
        agent = metadata.agent
    return _domain_metadata(agent)


def _domain_metadata(agent: AgentMetadata) -> DomainMetadata | None:
    values: dict[str, Any] = {field: getattr(agent, field) for field in DomainMetadata.model_fields}
    if any(value is None for value in values.values()):
        return None
    if not values["slot_index"].isascii() or not values["slot_index"].isdigit():
        return None  # XML text: the one integer field is converted here, the model itself is strict
    values["slot_index"] = int(values["slot_index"])
    try:
        return DomainMetadata.model_validate(values)
    except ValueError:
        return None


def metadata_element_xml(metadata: DomainMetadata) -> str:
    """Just the ``<gpuaas:agent>`` element, as ``virDomainSetMetadata`` takes it."""
    return ET.tostring(agent_metadata(metadata).format_dom(), encoding="unicode")
