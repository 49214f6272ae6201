"""The VBIOS from a PCI expansion ROM image: NVIDIA's BIT version, the digest, and what is refused.

No machine here has a GPU ROM: the images are built to the layout envytools documents (PCI ROM
header 55 AA, BIT header ``FF B8 'BIT' 00``, token ``B`` = BIOSDATA holding the version dword and
the OEM byte). ``read_rom``'s enable/read/disable needs a real ROM BAR and is not exercised here.
"""

from __future__ import annotations

import struct

import pytest

from gpuaas_agent.host.devices.pcirom import PciRomError, image_component, nvidia_bit_version, parse_rom, read_rom


def _image(version: int = 0x96007400, oem: int = 0x01, *, bit: bool = True) -> bytes:
    image = bytearray(b"\x55\xaa" + bytes(0x3FE))
    if bit:
        at = 0x100
        tokens = [(0x32, 1, 4, 0x300), (0x42, 2, 8, 0x200)]  # an unrelated token first, then 'B'
        image[at:at + 12] = _bit_header(len(tokens))
        for i, tok in enumerate(tokens):
            struct.pack_into("<BBHH", image, at + 12 + 6 * i, *tok)
        struct.pack_into("<IB", image, 0x200, version, oem)
    return bytes(image)


def _bit_header(count: int) -> bytes:
    return b"\xff\xb8BIT\x00" + struct.pack("<HBBBB", 0x0100, 12, 6, count, 0)


def test_the_bit_version_is_spelled_as_nvidia_smi_prints_it():
    assert nvidia_bit_version(_image()) == "96.00.74.00.01"
    assert nvidia_bit_version(_image(0x96009900, 0x05)) == "96.00.99.00.05"


def test_an_image_without_bit_keeps_its_digest_but_no_version():
    rom = parse_rom(_image(bit=False))
    assert rom.version is None and len(rom.sha256) == 64 and rom.size_bytes == 0x400
    assert parse_rom(_image()).sha256 != parse_rom(_image(0x96009900)).sha256  # a reflash changes the digest


@pytest.mark.parametrize("image", [b"", b"\x00\x00" + bytes(100), b"MZ" + bytes(10)])
def test_what_is_not_a_rom_is_refused(image):
    with pytest.raises(PciRomError):
        parse_rom(image)


def test_truncated_bit_tables_are_not_read_past_the_image():
    image = _image()
    assert nvidia_bit_version(image[:0x110]) is None
    assert nvidia_bit_version(image[:0x202]) is None


def test_the_inventory_component_carries_the_version_or_the_digest(tmp_path):
    device = tmp_path / "0000:18:00.0"
    named = image_component("0000:18:00.0", parse_rom(_image()), device, model="10de:2335")
    assert named.kind == "gpu_vbios" and named.version == "96.00.74.00.01" and "sha256" in named.source
    bare = parse_rom(_image(bit=False))
    assert image_component("0000:18:00.0", bare, device).version == f"sha256:{bare.sha256[:16]}"


def test_a_function_without_a_rom_is_refused(tmp_path):
    device = tmp_path / "0000:19:00.0"
    device.mkdir()
    with pytest.raises(PciRomError) as err:
        read_rom(device / "absent")
    assert err.value.code == "pci_rom_unreadable"
