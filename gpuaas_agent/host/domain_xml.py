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

from gpuaas_agent.contract.domain import (
    METADATA_NS,
    METADATA_PREFIX,
    DomainMetadata,
    DomainSpec,
    DomainSpecError,
    cpulist_cpus,
)
from gpuaas_agent.contract.runtime import HUGEPAGE_1G_MIB, DomainType

# Serialise our namespace as "gpuaas:" rather than "ns0:" (idempotent, process-wide by ElementTree's design).
ET.register_namespace(METADATA_PREFIX, METADATA_NS)

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
    """Refuse a spec that cannot run on its slot; returns the NUMA node's CPUs (None: no pinning)."""
    profile = spec.profile
    evidence = {"allocation_id": spec.allocation_id, "slot_index": spec.slot_index, "profile": profile.name}
    if profile.hugepages_1g and profile.memory_mib % HUGEPAGE_1G_MIB:
        raise DomainSpecError(
            f"memory {profile.memory_mib} MiB is not a multiple of the 1 GiB hugepage size",
            code="memory_not_hugepage_multiple",
            evidence={**evidence, "memory_mib": profile.memory_mib, "hugepage_mib": HUGEPAGE_1G_MIB},
        )
    if profile.hostdevs and (spec.gpu_pci_address is None or spec.fabric_vf_pci_address is None):
        raise DomainSpecError(
            f"profile {profile.name} passes through a GPU and a fabric VF but the spec lacks one",
            code="hostdev_missing",
            evidence={**evidence, "gpu": spec.gpu_pci_address, "fabric_vf": spec.fabric_vf_pci_address},
        )
    if (spec.numa_node is None) != (spec.numa_cpulist is None):
        raise DomainSpecError(
            "numa_node and numa_cpulist come together (the node and that node's cpulist)",
            code="numa_unknown",
            evidence={**evidence, "numa_node": spec.numa_node, "numa_cpulist": spec.numa_cpulist},
        )
    if spec.numa_node is None:
        if profile.domain_type is DomainType.kvm:
            # Production pins to the GPU's node; a GPU with no known node (numa_node=-1) cannot be placed.
            raise DomainSpecError(
                f"profile {profile.name} needs the GPU's NUMA node and cpulist for pinning",
                code="numa_unknown",
                evidence=evidence,
            )
        return None
    if spec.nvme_numa_node is not None and spec.nvme_numa_node != spec.numa_node:
        raise DomainSpecError(
            f"slot disk is on NUMA node {spec.nvme_numa_node}, its GPU on node {spec.numa_node}",
            code="disk_numa_mismatch",
            evidence={**evidence, "gpu_numa_node": spec.numa_node, "nvme_numa_node": spec.nvme_numa_node,
                      "nvme_device": spec.nvme_device},
        )
    try:
        cpus = cpulist_cpus(spec.numa_cpulist or "")
    except ValueError as exc:
        raise DomainSpecError(
            f"cpulist {spec.numa_cpulist!r} of NUMA node {spec.numa_node} is not valid: {exc}",
            code="numa_unknown",
            evidence={**evidence, "numa_node": spec.numa_node, "numa_cpulist": spec.numa_cpulist},
        ) from None
    if profile.vcpus > len(cpus):
        raise DomainSpecError(
            f"profile {profile.name} asks for {profile.vcpus} vCPUs; NUMA node {spec.numa_node} has {len(cpus)}",
            code="vcpus_exceed_numa_node",
            evidence={**evidence, "vcpus": profile.vcpus, "numa_node": spec.numa_node,
                      "numa_cpulist": spec.numa_cpulist, "node_cpus": len(cpus)},
        )
    return cpus


def build_domain(spec: DomainSpec) -> ET.Element:
    """The ``<domain>`` element for ``spec``; raises :class:`DomainSpecError` before building anything."""
    node_cpus = check_spec(spec)
    profile = spec.profile
    # type: kvm in production; qemu (TCG) in the lab, where KVM cannot boot a stock kernel (DESIGN.md §5).
    domain = ET.Element("domain", {"type": profile.domain_type.value})
    # name: derived from the allocation only, so it survives an agent restart with no local state.
    _sub(domain, "name", spec.domain_name)
    # metadata: the ownership mark read back by list/define (same name, other owner -> never overwritten).
    metadata = _sub(domain, "metadata")
    agent = _sub(metadata, _q(METADATA_ROOT))
    for field, value in spec.metadata().model_dump().items():
        _sub(agent, _q(field), str(value))
    # memory: the profile's size; MiB so the golden reads like the profile.
    _sub(domain, "memory", str(profile.memory_mib), unit="MiB")
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
    _sub(domain, "vcpu", str(profile.vcpus), **vcpu_attrs)
    if node_cpus is not None:
        # cputune: each vCPU pinned to the node's cpulist; the emulator thread too, so nothing floats off-node.
        cputune = _sub(domain, "cputune")
        for index in range(profile.vcpus):
            _sub(cputune, "vcpupin", vcpu=str(index), cpuset=spec.numa_cpulist or "")
        _sub(cputune, "emulatorpin", cpuset=spec.numa_cpulist or "")
        # numatune strict: guest RAM only from the GPU's node; a host that cannot give it fails start, not latency.
        numatune = _sub(domain, "numatune")
        _sub(numatune, "memory", mode="strict", nodeset=str(spec.numa_node))
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
        # topology: one socket of N cores, matching the vCPU count (libvirt refuses a mismatch); threads=1
        # because the pinned host CPUs are not handed out as sibling pairs.
        _sub(cpu, "topology", sockets="1", dies="1", cores=str(profile.vcpus), threads="1")
    # clock utc: Linux guests keep the RTC in UTC.
    _sub(domain, "clock", offset="utc")
    # on_poweroff destroy: a guest that powers off is gone; on_reboot restart: cloud-init reboots after
    # installing the guest driver; on_crash destroy: a crashed slice is reported, not silently looped.
    _sub(domain, "on_poweroff", "destroy")
    _sub(domain, "on_reboot", "restart")
    _sub(domain, "on_crash", "destroy")
    devices = _sub(domain, "devices")
    # disk: the raw slot NVMe by its stable by-id name (kernel names move); cache=none io=native is the
    # direct-I/O path for a raw block device; discard=unmap lets the guest TRIM the drive.
    disk = _sub(devices, "disk", type="block", device="disk")
    _sub(disk, "driver", name="qemu", type="raw", cache="none", io="native", discard="unmap")
    _sub(disk, "source", dev=spec.nvme_device)
    _sub(disk, "target", dev="vda", bus="virtio")
    # boot order 1: UEFI boots the slot disk; the seed ISO is data for cloud-init, not a boot medium.
    _sub(disk, "boot", order="1")
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
    if profile.hostdevs:
        # hostdev managed='no': the agent binds GPU and VF to vfio-pci itself, after the IOMMU group guard
        # (DESIGN.md §4.3); libvirt's managed detach would bypass that guard. driver vfio: the only backend.
        for address in (spec.gpu_pci_address, spec.fabric_vf_pci_address):
            hostdev = _sub(devices, "hostdev", mode="subsystem", type="pci", managed="no")
            _sub(hostdev, "driver", name="vfio")
            _pci_source(hostdev, address or "")
    # serial + console: the only console (no VNC/SPICE listener); the terminal gateway attaches to it.
    serial = _sub(devices, "serial", type="pty")
    if spec.serial_log_path is not None:
        _sub(serial, "log", file=spec.serial_log_path, append="off")
    _sub(serial, "target", type="isa-serial", port="0")
    console = _sub(devices, "console", type="pty")
    _sub(console, "target", type="serial", port="0")
    # rng: guest entropy at first boot (SSH host keys are generated then).
    rng = _sub(devices, "rng", model="virtio")
    _sub(rng, "backend", "/dev/urandom", model="random")
    # memballoon none: guest RAM is pinned (VFIO, hugepages); a balloon could only lie about it.
    _sub(devices, "memballoon", model="none")
    return domain


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
    if root.tag in (_q(METADATA_ROOT), METADATA_ROOT):
        element = root
    else:
        element = root.find(f"metadata/{_q(METADATA_ROOT)}")
    if element is None:
        return None
    ns = element.tag[: -len(METADATA_ROOT)]
    values = {}
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
