"""The domain XML builder: goldens, libvirt's own schema, and the refusals of bad specs.

Specs are built from the recorded 8xH200 host (discovery's candidate slots and
the nodes' cpulists), so the goldens show what a real slot's domain looks like.
Every golden is checked by ``virt-xml-validate`` (the QEMU driver's RNG) and by
libvirt itself (``VIR_DOMAIN_DEFINE_VALIDATE`` on the test driver).
Regenerate goldens with ``UPDATE_GOLDEN=1 pytest tests/host/vm/test_domain_xml.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
import xml.etree.ElementTree as ET

import libvirt
import pytest

from gpuaas_agent import __version__
from gpuaas_agent.contract.domain import (
    METADATA_NS,
    DomainSpec,
    DomainSpecError,
    parse_domain_spec,
)
from gpuaas_agent.contract.runtime import DomainType, RuntimeProfile
from gpuaas_agent.discovery.ovmf import find_ovmf
from gpuaas_agent.host.vm.domain_xml import build_domain_xml, read_metadata
from gpuaas_agent.hostfs import HostRoot
from tests.support.domain_specs import (
    GOLDEN_DOMAINS,
    GOLDEN_SPECS,
    lab_spec,
    production_spec,
)

GOLDEN = GOLDEN_DOMAINS


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_xml_matches_golden(name):
    text = build_domain_xml(GOLDEN_SPECS[name]())
    golden = GOLDEN / f"{name}.xml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_same_spec_gives_byte_identical_xml(name):
    assert build_domain_xml(GOLDEN_SPECS[name]()) == build_domain_xml(GOLDEN_SPECS[name]())


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden_passes_virt_xml_validate(name):
    tool = shutil.which("virt-xml-validate")
    assert tool, "virt-xml-validate is missing (apt libvirt-clients)"
    # virt-xml-validate is a shell wrapper around xmllint (apt libxml2-utils); without it, it cannot validate.
    assert shutil.which("xmllint"), "xmllint is missing: virt-xml-validate needs apt package libxml2-utils"
    done = subprocess.run([tool, str(GOLDEN / f"{name}.xml"), "domain"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(GOLDEN_SPECS))
def test_golden_passes_libvirt_schema_validation(name):
    """libvirt validates against the same domain.rng when asked (VIR_DOMAIN_DEFINE_VALIDATE)."""
    conn = libvirt.open("test:///default")
    try:
        xml = (GOLDEN / f"{name}.xml").read_text()
        dom = conn.defineXMLFlags(xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
        try:
            assert read_metadata(dom.XMLDesc()) == GOLDEN_SPECS[name]().metadata()
        finally:
            dom.undefine()
    finally:
        conn.close()


def test_schema_validation_is_able_to_fail():
    """The libvirt check above is real: an attribute the schema does not know is refused."""
    conn = libvirt.open("test:///default")
    try:
        bad = build_domain_xml(lab_spec()).replace('<rng model="virtio"', '<rng model="virtio" bogus="1"')
        with pytest.raises(libvirt.libvirtError) as err:
            conn.defineXMLFlags(bad, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
        assert "schema" in str(err.value)
    finally:
        conn.close()


def _tree(spec: DomainSpec) -> ET.Element:
    return ET.fromstring(build_domain_xml(spec))


def test_production_domain_has_every_required_element():
    spec = production_spec(0)
    root = _tree(spec)
    assert root.get("type") == "kvm"
    assert root.findtext("name") == "gpuaas-slice-23bd713b60734ef78a512897e902365d"
    loader = root.find("os/loader")
    assert loader.text == "/usr/share/OVMF/OVMF_CODE_4M.fd" and loader.get("secure") == "no"
    assert root.find("os/nvram").get("template") == "/usr/share/OVMF/OVMF_VARS_4M.fd"
    assert root.find("features/smm") is None
    assert root.find("devices/tpm") is None
    assert root.find("devices/graphics") is None
    assert root.find("cpu").get("mode") == "host-passthrough"
    assert root.find("vcpu").text == "24" and root.find("vcpu").get("cpuset") == "0-55,112-167"
    assert len(root.findall("cputune/vcpupin")) == 24
    assert {p.get("cpuset") for p in root.findall("cputune/vcpupin")} == {"0-55,112-167"}
    memory = root.find("numatune/memory")
    assert (memory.get("mode"), memory.get("nodeset")) == ("strict", "0")
    assert root.find("memoryBacking/hugepages/page").attrib == {"size": "1048576", "unit": "KiB"}
    hostdevs = root.findall("devices/hostdev")
    assert [h.attrib for h in hostdevs] == [{"mode": "subsystem", "type": "pci", "managed": "no"}] * 2
    assert [h.find("driver").get("name") for h in hostdevs] == ["vfio", "vfio"]
    assert [h.find("source/address").attrib for h in hostdevs] == [
        {"domain": "0x0000", "bus": "0x18", "slot": "0x00", "function": "0x0"},
        {"domain": "0x0000", "bus": "0x19", "slot": "0x00", "function": "0x1"},
    ]
    disk, cdrom = root.findall("devices/disk")
    assert disk.attrib == {"type": "block", "device": "disk"}
    assert disk.find("source").get("dev") == "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331"
    assert (disk.find("driver").get("cache"), disk.find("driver").get("io")) == ("none", "native")
    assert cdrom.get("device") == "cdrom" and cdrom.find("readonly") is not None
    assert cdrom.find("source").get("file") == spec.seed_iso_path
    nic = root.find("devices/interface")
    assert nic.find("virtualport").get("type") == "openvswitch"
    assert nic.find("mac").get("address") == "02:fd:b6:48:63:fd"
    assert nic.find("source").get("bridge") == "ovsbr0"
    assert nic.find("target").get("dev") == spec.vnic_name
    assert root.find("devices/serial").get("type") == "pty"
    agent = root.find(f"metadata/{{{METADATA_NS}}}agent")
    assert agent.findtext(f"{{{METADATA_NS}}}task_id") == "task-provision-0001"
    assert read_metadata(ET.tostring(root, encoding="unicode")) == spec.metadata()


def test_slot_on_numa_node_1_pins_to_node_1():
    root = _tree(production_spec(5))
    assert root.find("numatune/memory").get("nodeset") == "1"
    assert root.find("vcpu").get("cpuset") == "56-111,168-223"


def test_lab_domain_is_tcg_without_hostdevs_hugepages_or_pinning():
    root = _tree(lab_spec(gpu_pci_address="0000:18:00.0", fabric_vf_pci_address="0000:19:00.1"))
    assert root.get("type") == "qemu"
    assert root.find("devices/hostdev") is None  # the lab profile drops them even when the slot has them
    assert root.find("memoryBacking") is None
    assert root.find("cputune") is None and root.find("numatune") is None
    assert root.find("cpu") is None  # TCG cannot do host-passthrough
    assert root.find("memory").text == "512"
    assert root.find("devices/serial/log").get("file") == "/var/log/gpuaas/lab-slot1-serial.log"


def test_found_ovmf_goes_into_the_loader():
    firmware = find_ovmf(HostRoot.open("/"))
    root = _tree(lab_spec(firmware=firmware))
    assert root.find("os/loader").text == firmware.code_path
    assert root.find("os/nvram").get("template") == firmware.vars_template_path


def _refused(spec_factory, code: str) -> DomainSpecError:
    with pytest.raises(DomainSpecError) as err:
        build_domain_xml(spec_factory())
    assert err.value.code == code, err.value
    return err.value


def test_more_vcpus_than_the_numa_node_has_is_refused():
    big = RuntimeProfile(name="big_200c", domain_type=DomainType.kvm, vcpus=200, memory_mib=65536, hugepages_1g=True)
    err = _refused(lambda: production_spec(0, profile=big), "vcpus_exceed_numa_node")
    assert err.evidence["node_cpus"] == 112 and err.evidence["vcpus"] == 200


def test_memory_not_a_hugepage_multiple_is_refused():
    odd = RuntimeProfile(name="odd_mem", domain_type=DomainType.kvm, vcpus=4, memory_mib=65536 + 512, hugepages_1g=True)
    err = _refused(lambda: production_spec(0, profile=odd), "memory_not_hugepage_multiple")
    assert err.evidence["memory_mib"] == 66048


def test_disk_on_another_numa_node_than_its_gpu_is_refused():
    err = _refused(lambda: production_spec(0, nvme_numa_node=1), "disk_numa_mismatch")
    assert (err.evidence["gpu_numa_node"], err.evidence["nvme_numa_node"]) == (0, 1)


def test_production_profile_without_gpu_numa_node_is_refused():
    _refused(lambda: production_spec(0, numa_node=None, numa_cpulist=None), "numa_unknown")


def test_backwards_cpulist_is_refused_typed():
    _refused(lambda: production_spec(0, numa_cpulist="55-0"), "numa_unknown")


def test_production_profile_without_its_vf_is_refused():
    _refused(lambda: production_spec(0, fabric_vf_pci_address=None), "hostdev_missing")


def test_allocation_id_that_is_not_a_uuid_is_refused_typed():
    data = production_spec(0).model_dump()
    data["allocation_id"] = "23bd713b60734ef78a512897e902365d"
    with pytest.raises(DomainSpecError) as err:
        parse_domain_spec(data)
    assert err.value.code == "invalid_domain_spec"
    assert err.value.evidence["errors"][0]["loc"] == ["allocation_id"]


def test_valid_spec_round_trips_through_the_parser():
    spec = production_spec(0)
    assert parse_domain_spec(spec.model_dump(mode="json")) == spec


def test_agent_version_is_the_package_version_when_callers_use_it():
    assert read_metadata(build_domain_xml(lab_spec(agent_version=__version__))).agent_version == __version__


def test_foreign_or_malformed_metadata_is_not_ours():
    assert read_metadata("<domain><name>x</name></domain>") is None
    assert read_metadata("<agent><allocation_id>nope</allocation_id></agent>") is None
    assert read_metadata("not xml") is None
    assert read_metadata(f"<agent><allocation_id>{uuid.uuid4()}</allocation_id></agent>") is None
