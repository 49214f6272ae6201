"""The domain's element classes (host/vm/domain_config.py): the writer and the reader of the domain XML are one.

Over every golden under tests/golden/domain/ (compared byte for byte, as test_domain_xml.py does):
parse -> format gives the golden's bytes back, parse gives the very objects the builder made, and
the domain libvirt holds after ``defineXML`` on the test driver (``test:///default``) parses to the
same values for every element we wrote (:func:`owned_diff`). Each check is shown able to fail:
an element the classes do not declare is lost by the round trip, and a value libvirt holds
differently is named by its path.
"""

from __future__ import annotations

import libvirt
import pytest

from gpuaas_agent.host.vm.domain_config import (
    CpuSet,
    Disk,
    Domain,
    Hostdev,
    MachineType,
    Size,
    owned_diff,
)
from gpuaas_agent.host.vm.domain_xml import guest_domain
from gpuaas_agent.host.vm.libvirt_lifecycle import domain_devices, parse_domain_devices
from tests.support.domain_specs import GOLDEN_DOMAINS, GOLDEN_SPECS

GOLDENS = sorted(GOLDEN_SPECS)


def _golden(name: str) -> str:
    return (GOLDEN_DOMAINS / f"{name}.xml").read_text()


def test_every_golden_file_is_round_tripped():
    """A golden added without its spec (or the other way round) would escape the round trip."""
    assert sorted(p.stem for p in GOLDEN_DOMAINS.glob("*.xml")) == GOLDENS


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_parses_and_formats_back_byte_identical(name):
    text = _golden(name)
    assert Domain.parse_str(text).to_xml() == text


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_parses_to_the_objects_the_builder_made(name):
    assert Domain.parse_str(_golden(name)) == guest_domain(GOLDEN_SPECS[name]())


def _live(conn: libvirt.virConnect, xml: str) -> Domain:
    dom = conn.defineXMLFlags(xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
    try:
        return Domain.parse_str(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
    finally:
        dom.undefine()


@pytest.fixture(scope="module")
def test_driver():
    conn = libvirt.open("test:///default")
    yield conn
    conn.close()


def _without_qemu_args(domain: Domain) -> Domain:
    # The test driver drops the QEMU namespace (<qemu:commandline>); the QEMU driver keeps it
    # (tests/host/vm/test_domain_xml_qemu_driver.py reads the argument back from the QEMU command line).
    parsed = Domain.parse_str(domain.to_xml())
    parsed.qemu_commandline = None
    return parsed


@pytest.mark.parametrize("name", GOLDENS)
def test_libvirt_holds_every_element_we_wrote(name, test_driver):
    ours = Domain.parse_str(_golden(name))
    live = _live(test_driver, _golden(name))
    assert owned_diff(_without_qemu_args(ours), live) == []
    # What libvirt reports for the guards and reconcile is what the spec asked for (libvirt writes a
    # nodeset its own way: "0-1" for our "0,1").
    live_devices, our_devices = domain_devices("d", live), domain_devices("d", ours)
    assert live_devices.model_dump(exclude={"numa_nodeset"}) == our_devices.model_dump(exclude={"numa_nodeset"})
    assert CpuSet(live_devices.numa_nodeset or "") == CpuSet(our_devices.numa_nodeset or "")


def test_a_live_domain_parses_to_what_we_own_only(test_driver):
    """libvirt's additions outside the classes (uuid, currentMemory, the console's copy of the log) are left out."""
    live = _live(test_driver, _golden("lab-tcg"))
    text = live.to_xml()
    assert "<uuid>" not in text and "currentMemory" not in text and text.count("<log ") == 1
    assert live.memory == Size.mib(512) and live.memory.unit == "KiB"  # libvirt's unit, the same bytes


def test_an_element_the_classes_do_not_declare_fails_the_round_trip():
    """Writer/reader drift: XML written outside the classes is not read back, and the round trip says so."""
    text = _golden("lab-tcg").replace("  <clock offset", "  <iothreads>2</iothreads>\n  <clock offset")
    assert Domain.parse_str(text).to_xml() != text


def test_a_value_libvirt_holds_differently_is_named_by_its_path(test_driver):
    ours = Domain.parse_str(_golden("h200-slot0-numa0"))
    live = _live(test_driver, _golden("h200-slot0-numa0").replace('cache="none"', 'cache="writeback"')
                 .replace('nodeset="0" />\n    <memnode', 'nodeset="1" />\n    <memnode'))
    assert owned_diff(_without_qemu_args(ours), live) == [
        "domain/numatune/memory/nodeset: ours CpuSet('0'), live CpuSet('1')",
        "domain/devices/disk[7]/driver/cache: ours 'none', live 'writeback'",
    ]


def test_an_element_libvirt_dropped_is_missing():
    ours = Domain.parse_str(_golden("lab-tcg"))
    live = Domain.parse_str(_golden("lab-tcg").replace('    <memballoon model="none" />\n', ""))
    assert owned_diff(ours, live) == ["domain/devices/memballoon[6]: missing in the live domain"]


def test_values_compare_by_meaning_and_keep_their_text():
    assert Size.mib(64) == Size.kib(65536) == Size("67108864", "b")
    assert Size.mib(64) != Size.mib(65)
    assert CpuSet("0,1") == CpuSet("0-1") and CpuSet("0,1") != CpuSet("0-2")
    assert CpuSet("0,1").text == "0,1"
    assert MachineType("q35") == MachineType("pc-q35-7.2") and MachineType("pc-q35-7.2") != MachineType("pc-q35-8.0")
    assert MachineType("q35") != MachineType("pc-i440fx-7.2")


def test_hostdevs_and_disks_are_read_as_the_guards_need_them():
    domain = Domain.parse_str(_golden("h200-2gpu-numa0"))
    assert [h.host_address() for h in domain.device_list(Hostdev)] == [
        "0000:18:00.0", "0000:19:00.1", "0000:3a:00.0", "0000:3b:00.1"]
    assert [d.source.dev or d.source.file for d in domain.device_list(Disk)] == [
        "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331",
        "/dev/disk/by-id/nvme-eui.000000000000000100a075244a10dcab",
        "/var/lib/gpuaas/seeds/23bd713b-6073-4ef7-8a51-2897e902365d.iso",
    ]
    devices = parse_domain_devices("d", _golden("h200-2gpu-numa0"))
    assert devices.block_disks == [d.source.dev for d in domain.device_list(Disk)][:2]
    assert devices.numa_nodeset == "0"
