"""What an NVMe controller says it can erase, read with nvme-cli into :class:`NvmeCapabilities`.

The parse is pure (recorded ``nvme id-ctrl -o json`` / ``id-ns`` / ``ns-descs`` /
``list-ns`` output in, typed model out) so the same code runs over fixtures and
live answers; :func:`read_capabilities` is the thin shell that asks the device.
nvme-cli's JSON is a dump of the Identify structures: strings are space-padded,
128-bit counters are strings, and field names follow the spec's mnemonics.

The identity a controller reports is compared with the lease's ``disk_identity``
(``discovery/nvme.py`` builds that from sysfs) by :func:`device_identities`,
which derives every spelling the kernel could have used for this namespace,
including the ``wwid`` fallback ``nvme.<vid>-<serial hex>-<model hex>-<nsid>``
the kernel uses when the namespace ids are absent or (QEMU) ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from gpuaas_agent.contract.nvmewipe import (
    NvmeCapabilities,
    NvmeControllerCaps,
    NvmeNamespaceCaps,
    SanitizeStatus,
)
from gpuaas_agent.errors import HostError
from gpuaas_agent.host.run import Completed

Runner = Callable[..., Awaitable[Completed]]
NOT_REPORTED = 0xFFFFFFFF  # sanitize log: "no time estimate"
_HEX_RE = re.compile(r"[^0-9a-f]")
_STATUS_RE = re.compile(r"^\((\d+)\)")


class NvmeCapsError(HostError):
    """The device's answer could not be read or did not parse: no NVMe method is chosen on it."""

    default_code = "nvme_caps_unreadable"


def _field(doc: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = doc.get(key)
    if kind is int and isinstance(value, str) and value.isdigit():
        value = int(value)  # nvme-cli prints 128-bit fields (and some others) as strings
    if not isinstance(value, kind) or isinstance(value, bool):
        raise NvmeCapsError(f"{what}: field {key!r} missing or not {kind.__name__}", evidence={"field": key,
                            "value": repr(value)[:200]})
    return value


def _hex_id(value: Any, length: int) -> str | None:
    """An NGUID/EUI64 as lower hex, ``None`` when absent or all zeroes (NVMe's "not reported")."""
    if not isinstance(value, str):
        return None
    digits = _HEX_RE.sub("", value.lower().removeprefix("0x"))
    if len(digits) != length or not digits.strip("0"):
        return None
    return digits


def parse_id_ctrl(doc: dict[str, Any]) -> NvmeControllerCaps:
    what = "nvme id-ctrl"
    try:
        return NvmeControllerCaps(
            vid=_field(doc, "vid", int, what),
            serial=_field(doc, "sn", str, what).strip(),
            model=_field(doc, "mn", str, what).strip(),
            firmware=_field(doc, "fr", str, what).strip(),
            cntlid=_field(doc, "cntlid", int, what),
            version=_field(doc, "ver", int, what),
            cmic=_field(doc, "cmic", int, what),
            oacs=_field(doc, "oacs", int, what),
            fna=_field(doc, "fna", int, what),
            sanicap=_field(doc, "sanicap", int, what),
            nn=_field(doc, "nn", int, what),
            subnqn=str(doc.get("subnqn", "")).strip()[:256],
        )
    except ValidationError as exc:
        raise NvmeCapsError(f"{what} answer is out of range", evidence={"errors": exc.errors(include_url=False,
                            include_input=False)}) from None


def parse_id_ns(doc: dict[str, Any], nsid: int, descs: dict[str, Any] | None = None) -> NvmeNamespaceCaps:
    """``id-ns`` (+ ``ns-descs`` for the UUID) of namespace ``nsid`` (id-ns does not say its own nsid)."""
    what = "nvme id-ns"
    flbas = _field(doc, "flbas", int, what)
    lbafs = doc.get("lbafs")
    index = (flbas & 0xF) | ((flbas >> 5) & 0x3) << 4  # FLBAS bits 3:0 + 6:5
    if not isinstance(lbafs, list) or index >= len(lbafs) or not isinstance(lbafs[index], dict):
        raise NvmeCapsError(f"{what}: LBA format {index} not listed", evidence={"flbas": flbas})
    ds = _field(lbafs[index], "ds", int, what)
    uuid = None
    for desc in (descs or {}).get("ns-descs", []) if isinstance(descs, dict) else []:
        if isinstance(desc, dict) and desc.get("type") == "uuid" and isinstance(desc.get("uuid"), str):
            value = desc["uuid"].lower()
            uuid = value if value.strip("0-") else None
    try:
        return NvmeNamespaceCaps(
            nsid=nsid,
            nsze=_field(doc, "nsze", int, what),
            lba_bytes=1 << ds if 9 <= ds <= 16 else 0,
            flbas=flbas,
            dlfeat=_field(doc, "dlfeat", int, what),
            nguid=_hex_id(doc.get("nguid"), 32),
            eui64=_hex_id(doc.get("eui64"), 16),
            uuid=uuid,
        )
    except ValidationError as exc:
        raise NvmeCapsError(f"{what} answer is out of range", evidence={"errors": exc.errors(include_url=False,
                            include_input=False)}) from None


def parse_list_ns(doc: dict[str, Any]) -> list[int]:
    entries = doc.get("nsid_list")
    if not isinstance(entries, list):
        raise NvmeCapsError("nvme list-ns: no nsid_list", evidence={"keys": sorted(doc)[:20]})
    out = []
    for entry in entries:
        nsid = entry.get("nsid") if isinstance(entry, dict) else None
        if not isinstance(nsid, int) or isinstance(nsid, bool) or nsid < 1:
            raise NvmeCapsError("nvme list-ns: bad entry", evidence={"entry": repr(entry)[:200]})
        out.append(nsid)
    return sorted(out)


def parse_capabilities(id_ctrl: dict[str, Any], id_ns: dict[str, Any], nsid: int, *, descs: dict[str, Any] | None = None,
                       list_ns: dict[str, Any] | None = None, list_ns_all: dict[str, Any] | None = None,
                       source: str = "nvme-cli") -> NvmeCapabilities:
    """The typed capability model from recorded or live nvme-cli JSON (``list_ns_all``: ``list-ns --all``)."""
    active = parse_list_ns(list_ns) if list_ns is not None else [nsid]
    allocated = parse_list_ns(list_ns_all) if list_ns_all is not None else None
    return NvmeCapabilities(controller=parse_id_ctrl(id_ctrl), namespace=parse_id_ns(id_ns, nsid, descs),
                            active_nsids=active, allocated_nsids=allocated, source=source)


def parse_sanitize_log(doc: dict[str, Any], *, estimate_key: str | None = None) -> SanitizeStatus:
    """One sanitize status log (page 0x81) as nvme-cli prints it: ``{"<dev>": {"sprog": .., "sstat": {..}}}``.

    The status is read from the ``"(N) text"`` string nvme-cli writes (its key
    changed between versions, so any ``(N)``-prefixed value of ``sstat`` counts).
    """
    body = doc
    if "sprog" not in body and len(doc) == 1:
        body = next(iter(doc.values()))
    if not isinstance(body, dict):
        raise NvmeCapsError("nvme sanitize-log: unexpected shape", evidence={"doc": repr(doc)[:300]})
    sprog = _field(body, "sprog", int, "nvme sanitize-log")
    sstat = body.get("sstat")
    status = None
    if isinstance(sstat, dict):
        for value in sstat.values():
            match = _STATUS_RE.match(value) if isinstance(value, str) else None
            if match:
                status = int(match.group(1))
    elif isinstance(sstat, int):
        status = sstat & 0x7
    if status is None or status > 7:
        raise NvmeCapsError("nvme sanitize-log: no sanitize status", evidence={"sstat": repr(sstat)[:300]})
    estimate = body.get(estimate_key) if estimate_key else None
    if not isinstance(estimate, int) or isinstance(estimate, bool) or estimate in (0, NOT_REPORTED) or estimate < 0:
        estimate = None
    cdw10 = body.get("cdw10_info")
    if not isinstance(cdw10, int) or isinstance(cdw10, bool) or not 0 <= cdw10 <= 0xFFFFFFFF:
        cdw10 = None
    return SanitizeStatus(sprog=sprog, status=status, estimated_s=estimate, cdw10=cdw10)


# --- identity ---------------------------------------------------------------------------------------


def normalize_identity(identity: str) -> str:
    """``kind:value`` with hex ids reduced to their digits (sysfs spells an EUI ``6c 61 ...``, nvme-cli ``6c61...``)."""
    kind, _, value = identity.partition(":")
    value = value.lower()
    if kind in ("nguid", "eui"):
        value = _HEX_RE.sub("", value)
    elif kind == "wwid" and value.startswith("eui."):
        value = "eui." + _HEX_RE.sub("", value[4:])
    return f"{kind}:{value}"


def device_identities(caps: NvmeCapabilities) -> list[str]:
    """Every ``disk_identity`` the kernel could have given this namespace, from the controller's own answers.

    The kernel's sysfs ``wwid`` is ``uuid.<uuid>``, ``eui.<nguid>``, ``eui.<eui64>``, or
    ``nvme.<vid>-<serial hex>-<model hex>-<nsid>`` (serial/model without trailing blanks).
    The kernel may ignore ids a controller reports (QEMU's, by quirk), so all are offered.
    """
    ns, ctrl = caps.namespace, caps.controller
    out: list[str] = []
    if ns.uuid:
        out += [f"uuid:{ns.uuid}", f"wwid:uuid.{ns.uuid}"]
    if ns.nguid:
        out += [f"nguid:{ns.nguid}", f"wwid:eui.{ns.nguid}"]
    if ns.eui64:
        out += [f"eui:{ns.eui64}", f"wwid:eui.{ns.eui64}"]
    serial = ctrl.serial.rstrip(" \0").encode().hex()
    model = ctrl.model.rstrip(" \0").encode().hex()
    out.append(f"wwid:nvme.{ctrl.vid:04x}-{serial}-{model}-{ns.nsid:08x}")
    return [normalize_identity(i) for i in out]


# --- the shell: ask the device ----------------------------------------------------------------------


async def nvme_json(runner: Runner, argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one nvme-cli query (``--output-format=json``) and parse its answer; ``NvmeCapsError`` when it fails."""
    try:
        done = await runner(argv, timeout=timeout)
    except HostError as exc:
        raise NvmeCapsError(f"{' '.join(argv[:2])} failed: {exc.message}", evidence=exc.evidence) from exc
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        raise NvmeCapsError(f"{' '.join(argv[:2])} printed no JSON", evidence={
            "argv": argv, "stdout": done.stdout[:500].decode("utf-8", "replace")}) from None
    if not isinstance(doc, dict):
        raise NvmeCapsError(f"{' '.join(argv[:2])} printed a JSON {type(doc).__name__}", evidence={"argv": argv})
    return doc


async def read_capabilities(dev: str, nsid: int, *, runner: Runner, timeout: float = 60) -> NvmeCapabilities:
    """Ask the namespace node ``dev`` (``/dev/nvmeXnY``) for the controller's and namespace's Identify data.

    Commands go to the namespace's own node, the one the disk guard just checked,
    so they reach the controller that serves the leased namespace.
    """
    id_ctrl = await nvme_json(runner, ["nvme", "id-ctrl", dev, "--output-format=json"], timeout)
    id_ns = await nvme_json(runner, ["nvme", "id-ns", dev, f"--namespace-id={nsid}", "--output-format=json"], timeout)
    descs = await nvme_json(runner, ["nvme", "ns-descs", dev, f"--namespace-id={nsid}", "--output-format=json"], timeout)
    list_ns = await nvme_json(runner, ["nvme", "list-ns", dev, "--output-format=json"], timeout)
    # Attached or not: a sanitize, or a format over all namespaces, erases the detached ones too.
    try:
        list_ns_all: dict[str, Any] | None = await nvme_json(runner, ["nvme", "list-ns", dev, "--all", "--output-format=json"],
                                               timeout)
    except NvmeCapsError:
        list_ns_all = None  # no namespace management: the scope check then refuses any subsystem-wide erase
    return parse_capabilities(id_ctrl, id_ns, nsid, descs=descs, list_ns=list_ns, list_ns_all=list_ns_all)
