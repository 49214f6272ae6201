"""Find the host's UEFI firmware pair (OVMF CODE + VARS template) with Secure Boot off.

Seed 004: a slice VM booted with Secure Boot on rejected the guest NVIDIA module
("Key was rejected by service"); the fix was ``OVMF_CODE_4M.fd`` /
``OVMF_VARS_4M.fd`` with ``secure='no'``. Paths differ between distributions
and OVMF releases, so they are discovered, not hard-coded: first the QEMU
firmware descriptors (``docs/interop/firmware.json``: the distribution's own
statement of what each image is), then well-known file pairs. CODE and VARS
always come from the same descriptor or the same family: a 2 MiB VARS store
with a 4 MiB CODE image does not boot.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from gpuaas_agent.contract.domain import OvmfFirmware
from gpuaas_agent.errors import HostError
from gpuaas_agent.hostfs import HostRoot

# QEMU's search order; a file name in an earlier directory hides the same name in later ones.
DESCRIPTOR_DIRS = ("/etc/qemu/firmware", "/usr/share/qemu/firmware")
# Features that mean Secure Boot is (or can be) on, or that need SMM the domain does not enable.
REFUSED_FEATURES = frozenset({"secure-boot", "enrolled-keys", "requires-smm", "amd-sev-snp", "intel-tdx"})
# Fallback pairs, best first: (CODE, VARS template).
WELL_KNOWN_PAIRS = (
    ("/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"),
    ("/usr/share/OVMF/OVMF_CODE.fd", "/usr/share/OVMF/OVMF_VARS.fd"),
    ("/usr/share/edk2/ovmf/OVMF_CODE.fd", "/usr/share/edk2/ovmf/OVMF_VARS.fd"),
)
ARCH = "x86_64"
MACHINE = "q35"


class OvmfNotFoundError(HostError):
    """No usable non-Secure-Boot UEFI pair on this host; evidence lists every candidate and why it was passed over."""

    default_code = "ovmf_missing"


def _machines_match(patterns: list[Any]) -> bool:
    # Descriptors list glob patterns such as "pc-q35-*"; the builder uses machine='q35'.
    return any(isinstance(p, str) and ("q35" in p) for p in patterns)


def _why_not(host: HostRoot, doc: Any) -> tuple[str | None, tuple[str, str] | None]:
    """(reason this descriptor is unusable, or None) and its (code, vars) pair."""
    if not isinstance(doc, dict):
        return "not a JSON object", None
    if "uefi" not in (doc.get("interface-types") or []):
        return "not uefi", None
    mapping = doc.get("mapping") or {}
    if mapping.get("device") != "flash":
        return f"mapping device {mapping.get('device')!r} is not flash", None
    targets = doc.get("targets") or []
    if not any(
        isinstance(t, dict) and t.get("architecture") == ARCH and _machines_match(t.get("machines") or [])
        for t in targets
    ):
        return f"no {ARCH} {MACHINE} target", None
    refused = sorted(REFUSED_FEATURES.intersection(doc.get("features") or []))
    if refused:
        return f"features {refused}", None
    code = (mapping.get("executable") or {}).get("filename")
    template = (mapping.get("nvram-template") or {}).get("filename")
    for fmt in ((mapping.get("executable") or {}).get("format"), (mapping.get("nvram-template") or {}).get("format")):
        if fmt not in (None, "raw"):
            return f"format {fmt!r} is not raw", None
    if not isinstance(code, str) or not isinstance(template, str):
        return "no executable or nvram-template filename", None
    for path in (code, template):
        if not path.startswith("/") or not host.exists(path):
            return f"{path} does not exist", None
    return None, (code, template)


def find_ovmf(host: HostRoot) -> OvmfFirmware:
    """The first usable pair: descriptors in QEMU's order, then :data:`WELL_KNOWN_PAIRS`."""
    passed_over: list[dict[str, str]] = []
    seen: dict[str, str] = {}
    for directory in DESCRIPTOR_DIRS:
        try:
            names = host.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.endswith(".json") and name not in seen:
                seen[name] = posixpath.join(directory, name)
    for name in sorted(seen):
        path = seen[name]
        try:
            doc = json.loads(host.read_text(path))
        except (OSError, ValueError) as exc:
            passed_over.append({"candidate": path, "reason": f"unreadable: {exc}"})
            continue
        reason, pair = _why_not(host, doc)
        if pair is None:
            passed_over.append({"candidate": path, "reason": reason or "unusable"})
            continue
        return OvmfFirmware(code_path=pair[0], vars_template_path=pair[1], descriptor=path)
    for code, template in WELL_KNOWN_PAIRS:
        missing = [p for p in (code, template) if not host.exists(p)]
        if not missing:
            return OvmfFirmware(code_path=code, vars_template_path=template)
        passed_over.append({"candidate": code, "reason": f"missing {missing}"})
    raise OvmfNotFoundError(
        "no UEFI firmware pair without Secure Boot found (install the ovmf package)",
        evidence={"root": str(host.root), "passed_over": passed_over},
    )
