"""Finding the UEFI pair: QEMU firmware descriptors first, well-known files second, Secure Boot never."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuaas_agent.discovery.ovmf import OvmfNotFoundError, find_ovmf
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host


def _descriptor(code: str, vars_: str, features: list[str], machines=("pc-q35-*",)) -> dict:
    return {
        "description": "test",
        "interface-types": ["uefi"],
        "mapping": {
            "device": "flash",
            "executable": {"filename": code, "format": "raw"},
            "nvram-template": {"filename": vars_, "format": "raw"},
        },
        "targets": [{"architecture": "x86_64", "machines": list(machines)}],
        "features": features,
        "tags": [],
    }


def _root(tmp_path: Path, files: dict[str, object]) -> HostRoot:
    for path, content in files.items():
        real = tmp_path / path.lstrip("/")
        real.parent.mkdir(parents=True, exist_ok=True)
        real.write_text(content if isinstance(content, str) else json.dumps(content))
    return HostRoot.open(tmp_path)


SB_CODE = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd"
CODE = "/usr/share/OVMF/OVMF_CODE_4M.fd"
VARS = "/usr/share/OVMF/OVMF_VARS_4M.fd"
MS_VARS = "/usr/share/OVMF/OVMF_VARS_4M.ms.fd"


def test_this_machine_has_the_debian_non_secure_boot_descriptor():
    firmware = find_ovmf(HostRoot.open("/"))
    assert firmware.descriptor == "/usr/share/qemu/firmware/60-edk2-x86_64.json"
    assert (firmware.code_path, firmware.vars_template_path) == (CODE, VARS)
    assert firmware.secure_boot is False


def test_secure_boot_and_enrolled_keys_descriptors_are_passed_over(tmp_path):
    host = _root(tmp_path, {
        SB_CODE: "", CODE: "", VARS: "", MS_VARS: "",
        "/usr/share/qemu/firmware/40-secure-enrolled.json": _descriptor(SB_CODE, MS_VARS, ["enrolled-keys", "requires-smm", "secure-boot"]),
        "/usr/share/qemu/firmware/50-secure.json": _descriptor(SB_CODE, VARS, ["requires-smm", "secure-boot"]),
        "/usr/share/qemu/firmware/60-plain.json": _descriptor(CODE, VARS, ["acpi-s3"]),
    })
    firmware = find_ovmf(host)
    assert firmware.descriptor == "/usr/share/qemu/firmware/60-plain.json"
    assert firmware.code_path == CODE


def test_etc_descriptor_hides_the_same_name_under_usr(tmp_path):
    other_code, other_vars = "/opt/edk2/CODE.fd", "/opt/edk2/VARS.fd"
    host = _root(tmp_path, {
        CODE: "", VARS: "", other_code: "", other_vars: "",
        "/usr/share/qemu/firmware/60-plain.json": _descriptor(CODE, VARS, []),
        "/etc/qemu/firmware/60-plain.json": _descriptor(other_code, other_vars, []),
    })
    firmware = find_ovmf(host)
    assert firmware.descriptor == "/etc/qemu/firmware/60-plain.json" and firmware.code_path == other_code


def test_descriptor_naming_missing_files_falls_back_to_the_well_known_pair(tmp_path):
    host = _root(tmp_path, {
        CODE: "", VARS: "",
        "/usr/share/qemu/firmware/60-plain.json": _descriptor("/nowhere/CODE.fd", VARS, []),
        "/usr/share/qemu/firmware/70-i440fx-only.json": _descriptor(CODE, VARS, [], machines=("pc-i440fx-*",)),
    })
    firmware = find_ovmf(host)
    assert firmware.descriptor is None and (firmware.code_path, firmware.vars_template_path) == (CODE, VARS)


def test_the_recorded_h200_host_uses_the_well_known_4m_pair():
    firmware = find_ovmf(HostRoot.open(fixture_host("h200-slice-after-transition")))
    assert (firmware.code_path, firmware.vars_template_path, firmware.descriptor) == (CODE, VARS, None)


def test_families_are_never_mixed(tmp_path):
    """A 4M CODE without its 4M VARS does not pair with the 2M VARS."""
    host = _root(tmp_path, {CODE: "", "/usr/share/OVMF/OVMF_VARS.fd": ""})
    with pytest.raises(OvmfNotFoundError):
        find_ovmf(host)


def test_missing_ovmf_is_a_typed_error_listing_what_was_passed_over(tmp_path):
    host = _root(tmp_path, {
        SB_CODE: "", VARS: "",
        "/usr/share/qemu/firmware/50-secure.json": _descriptor(SB_CODE, VARS, ["requires-smm", "secure-boot"]),
        "/usr/share/qemu/firmware/99-broken.json": "{not json",
    })
    with pytest.raises(OvmfNotFoundError) as err:
        find_ovmf(host)
    assert err.value.code == "ovmf_missing"
    reasons = {p["candidate"]: p["reason"] for p in err.value.evidence["passed_over"]}
    assert "secure-boot" in reasons["/usr/share/qemu/firmware/50-secure.json"]
    assert reasons["/usr/share/qemu/firmware/99-broken.json"].startswith("unreadable")
    assert CODE in reasons
