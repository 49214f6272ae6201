"""A GPU's VBIOS read from its PCI expansion ROM (sysfs ``rom``), also while it is bound to vfio-pci.

Why here and not in discovery: the kernel exposes the ROM only after ``1`` is written to the
function's ``rom`` file (it enables the ROM BAR decode), and it must be written back to ``0``
afterwards. That is a side effect, so it lives with the drivers, and it is done only on a
function no guest is using (after a release, before the slot is offered again): a tenant who
reflashed the VBIOS through passthrough changes this image.

What is returned: the image's size and SHA-256 (any change of the image shows, whatever its
layout) and, for NVIDIA images, the version the BIT table's ``B`` (BIOSDATA) token holds,
spelled as ``nvidia-smi`` prints it (``96.00.74.00.01``). The BIT layout is the one envytools
documents; an image without it keeps ``version=None`` and still has its digest.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from gpuaas_agent.contract.firmware import FirmwareComponent
from gpuaas_agent.errors import AgentError

ROM_MAX_BYTES = 16 << 20  # a GPU ROM BAR is at most a few MiB; more is not a ROM
BIT_SIGNATURE = b"\xff\xb8BIT\x00"
BIT_TOKEN_BIOSDATA = 0x42  # 'B'


class PciRomError(AgentError):
    """The ROM could not be enabled or read (no ROM BAR, a device that does not answer)."""

    default_code = "pci_rom_unreadable"


@dataclass(frozen=True)
class RomImage:
    size_bytes: int
    sha256: str
    version: str | None


def nvidia_bit_version(image: bytes) -> str | None:
    """The VBIOS version in an NVIDIA image's BIT ``B`` token, or None when the image has no such table."""
    at = image.find(BIT_SIGNATURE)
    if at < 0 or at + 12 > len(image):
        return None
    header_size, token_size, token_count = image[at + 8], image[at + 9], image[at + 10]
    if token_size < 6 or header_size < 12:
        return None
    for i in range(token_count):
        token = at + header_size + i * token_size
        if token + 6 > len(image):
            return None
        token_id, _version, size, offset = struct.unpack_from("<BBHH", image, token)
        if token_id == BIT_TOKEN_BIOSDATA and size >= 5 and offset + 5 <= len(image):
            value, oem = struct.unpack_from("<IB", image, offset)
            return f"{value >> 24:02x}.{value >> 16 & 0xFF:02x}.{value >> 8 & 0xFF:02x}.{value & 0xFF:02x}.{oem:02x}"
    return None


def parse_rom(image: bytes) -> RomImage:
    if image[:2] != b"\x55\xaa":
        raise PciRomError("the ROM image does not start with the PCI expansion ROM signature 55 AA",
                          evidence={"size_bytes": len(image), "head": image[:4].hex()})
    return RomImage(size_bytes=len(image), sha256=hashlib.sha256(image).hexdigest(), version=nvidia_bit_version(image))


def read_rom(sysfs_device: Path) -> RomImage:
    """Enable, read and disable ``<sysfs_device>/rom`` (blocking; root; the function must be idle)."""
    rom = Path(sysfs_device) / "rom"
    try:
        rom.write_text("1")
    except OSError as exc:
        raise PciRomError(f"cannot enable the ROM of {sysfs_device.name}: {exc.strerror}",
                          evidence={"path": str(rom)}) from None
    try:
        with open(rom, "rb") as fh:
            image = fh.read(ROM_MAX_BYTES + 1)
    except OSError as exc:
        raise PciRomError(f"cannot read the ROM of {sysfs_device.name}: {exc.strerror}",
                          evidence={"path": str(rom)}) from None
    finally:
        try:
            rom.write_text("0")
        except OSError:
            pass  # the read already failed or succeeded; a ROM left enabled only decodes reads
    if len(image) > ROM_MAX_BYTES:
        raise PciRomError(f"the ROM of {sysfs_device.name} is larger than {ROM_MAX_BYTES} bytes",
                          evidence={"path": str(rom)})
    return parse_rom(image)


def rom_component(address: str, sysfs_device: Path, model: str | None = None) -> FirmwareComponent:
    """The GPU's ``gpu_vbios`` component from its ROM: the version, and the image digest in ``source``."""
    return image_component(address, read_rom(sysfs_device), sysfs_device, model)


def image_component(address: str, image: RomImage, sysfs_device: Path, model: str | None = None) -> FirmwareComponent:
    """A ROM image as the inventory's component: the BIT version, else the digest's head (a reflash still shows)."""
    return FirmwareComponent(kind="gpu_vbios", id=address, model=model,
                             version=image.version or f"sha256:{image.sha256[:16]}",
                             source=f"{sysfs_device}/rom ({image.size_bytes} bytes, sha256 {image.sha256})")
