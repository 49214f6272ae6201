"""Identifier shapes live in contract/types.py only, and both forms of each accept exactly the same strings.

The compiled forms are what discovery, the recorder, host drivers and the vfio
guard (through ``discovery.pci.BDF_RE``) call; the pydantic forms guard the
wire. A trailing newline is the trap: Python's ``$`` matches before it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from gpuaas_agent.contract import types
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.discovery.pci import BDF_RE
from gpuaas_agent.discovery.record import BDF_RE as RECORDER_BDF_RE
from tests.conftest import REPO

CASES = {
    "PCI_ADDRESS": (types.PciAddress, types.PCI_ADDRESS_RE,
                    ["0000:18:00.0", "10000:e1:00.0", "ffffffff:ff:1f.7"],
                    ["0000:18:00.8", "000:18:00.0", "100000000:e1:00.0", "0000:18:00.0\n", "0000:1B:00.0", " 0000:18:00.0"]),
    "MAC": (types.MacAddress, types.MAC_RE,
            ["02:00:00:00:00:01"],
            ["02:00:00:00:00:01\n", "02:00:00:00:00:0G", "02-00-00-00-00-01", "02:00:00:00:00", "02:00:00:00:00:01:02"]),
    "UUID": (types.Uuid, types.UUID_RE,
             ["127f3bd0-1c2d-4e5f-8a9b-0c1d2e3f4a5b"],
             ["127f3bd0-1c2d-4e5f-8a9b-0c1d2e3f4a5b\n", "127F3BD0-1c2d-4e5f-8a9b-0c1d2e3f4a5b", "127f3bd01c2d4e5f8a9b0c1d2e3f4a5b"]),
    "SHA256": (types.Sha256Hex, types.SHA256_RE,
               ["0" * 64],
               ["0" * 64 + "\n", "0" * 63, "A" * 64]),
    "BY_ID_PATH": (types.ByIdPath, types.BY_ID_PATH_RE,
                   ["/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331"],
                   ["/dev/disk/by-id/nvme-eui.0001\n", "/dev/disk/by-id/../../nvme0n1", "/dev/nvme0n1", "/dev/disk/by-id/"]),
    "MAJOR_MINOR": (None, types.MAJOR_MINOR_RE, ["259:3", "8:0"], ["259:3\n", "٢٥٩:٣", "259:", ":3"]),
}


@pytest.mark.parametrize("shape", sorted(CASES))
def test_compiled_and_wire_forms_accept_the_same_strings(shape):
    annotated, compiled, good, bad = CASES[shape]
    adapter = TypeAdapter(annotated) if annotated is not None else None
    for value in good:
        assert compiled.match(value) and compiled.fullmatch(value), (shape, value)
        if adapter:
            assert adapter.validate_python(value) == value
    for value in bad:
        assert not compiled.match(value) and not compiled.fullmatch(value), (shape, value)
        if adapter:
            with pytest.raises(ValidationError):
                adapter.validate_python(value)


def test_pydantic_patterns_are_anchored_shapes_and_compiled_ones_end_at_the_end():
    assert types.PCI_ADDRESS_PATTERN == f"^{types.PCI_ADDRESS}$"
    assert types.UUID_PATTERN == f"^{types.UUID}$"
    assert types.PCI_ADDRESS_RE.pattern.endswith(r")\Z")
    assert re.match(f"^{types.PCI_ADDRESS}$", "0000:18:00.0\n")  # why the compiled form is not ^...$


def test_recorder_discovery_and_the_vfio_guard_share_one_pci_shape():
    """The recorder took only 4-digit domains while discovery took 4 to 8: a VMD host lost its NVMe."""
    assert RECORDER_BDF_RE is BDF_RE is types.PCI_ADDRESS_RE
    assert BDF_RE.match("10000:e1:00.0") and not BDF_RE.match("0000:18:00.0\n")


def test_wire_models_take_their_uuid_from_the_shared_shape():
    base = {"slot_index": 0, "gpu_pci_address": "0000:18:00.0", "fabric_vf_pci_address": "10000:19:00.1",
            "nvme_device": "/dev/disk/by-id/nvme-eui.01", "disk_identity": "eui:01", "task_id": "t",
                "taken_at": 0.0}
    SlotLease(allocation_id="127f3bd0-1c2d-4e5f-8a9b-0c1d2e3f4a5b", **base)
    with pytest.raises(ValidationError):
        SlotLease(allocation_id="127f3bd0-1c2d-4e5f-8a9b-0c1d2e3f4a5b\n", **base)


# Copies that still live in files this change could not edit (owned by other work); remove as they are ported.
KNOWN_COPIES: set[tuple[str, str]] = set()
SHAPE_TEXTS = {
    "PCI_ADDRESS": ("[0-9a-f]{4", "]{2}:[0-9a-f]{2}\\."),
    "MAC": ("[0-9a-f]{2}(:[0-9a-f]{2}){5}", "[0-9A-Fa-f]{2}(:"),
    "UUID": ("[0-9a-f]{8}-[0-9a-f]{4}",),
    "SHA256": ("[0-9a-f]{64}",),
    "BY_ID_PATH": ("/dev/disk/by-id/{",),
}


def test_no_module_spells_a_shared_shape_itself():
    found = set()
    for path in sorted((REPO / "gpuaas_agent").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel == "gpuaas_agent/contract/types.py":
            continue
        text = path.read_text()
        for shape, needles in SHAPE_TEXTS.items():
            if any(needle in text for needle in needles):
                found.add((rel, shape))
    assert found == KNOWN_COPIES, "import the shape from gpuaas_agent/contract/types.py instead"
    for rel, _ in KNOWN_COPIES:
        assert Path(REPO / rel).is_file()
