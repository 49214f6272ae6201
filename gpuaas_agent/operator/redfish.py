"""Read an HGX baseboard's GPU and NVSwitch telemetry over Redfish with sushy (blocking; one read per call).

sushy is the Redfish library of OpenStack's bare-metal service: every resource below is a
small :class:`sushy.resources.base.ResourceBase` that parses its own JSON document, so
nothing here walks dicts by hand. Only the two collections are named here (the system's
``Processors``, the fabric's ``Switches``); everything else is reached by the links each document
gives, as a real HGX BMC serves them (fixtures/redfish/dgx-h100-viking, a Redfish-Mockup-Creator
capture of a DGX H100): a GPU's ``Metrics`` (ProcessorMetrics), ``EnvironmentMetrics`` (power),
``Links.Memory`` (the HBM and its ``Metrics``), ``Links.Chassis`` and that chassis' ``Sensors``
collection. Among the sensors that collection lists, the GPU temperature is the one whose id ends
``_TEMP_0`` and the HBM's the one ending ``_DRAM_<k>_Temp_<j>``; ``_TEMP_1`` is not a temperature
but the synthesized margin to the slowdown limit (``Implementation: Synthesized``, lower thresholds
0/-2/-8; the capture's GPU at 26.75 C reads 60 there) — which is also what ``EnvironmentMetrics.
TemperatureCelsius`` points to, so that field is never read as the GPU's temperature. A sensor
whose ``ReadingType`` is not ``Temperature`` is unread, not guessed.

NVLink (telemetry, never a verdict): after every GPU and NVSwitch is read, each GPU's ``Ports`` link
(its 18 NVLink ports on HGX H100) is followed. Where the service root advertises
``ProtocolFeaturesSupported.ExpandQuery`` with ``Levels`` and ``MaxLevels`` >= 2 (the real BMC: 5), that is
ONE GET per GPU, ``<Ports>?$expand=.($levels=2)`` (DMTF DSP0266 "$expand": ``.`` expands the subordinate
links, not ``Links``), whose members carry each port and its ``Metrics`` inline. Otherwise (or where the
answer lacks the expanded members) the ports and their ``Metrics`` are read one GET each, only when what is
left of ``MAX_DOCUMENTS`` covers them all; else the GPU's ``nvlink`` is ``None`` and ``nvlink_unread`` says
why (never zeros). Every link inside an expanded answer is checked like any member link (:func:`own_path`).

Every link followed must be a path on the BMC (``/redfish/v1/...``, :func:`_path`); a read is
bounded by ``MAX_DOCUMENTS`` GETs (94 for 8 GPUs and 4 NVSwitches, 102 with NVLink expanded), each document by
``MAX_DOCUMENT_BYTES`` and the request timeout, the whole by the check's deadline (``operator/health.py``).

Why :class:`sushy.auth.BasicAuth` and no session: NVIDIA documents basic authentication for
the DGX/HGX BMC, and a session left behind by a read that timed out would count against the
BMC's session limit. Why ``server_side_retries=1``: sushy's default retries a 5xx ten times,
3 s apart, and tries a refused or timed-out connection 3 times, 2 s apart (0 means "the default"
there); a health read must answer within its interval, and a failing BMC is ``unavailable``
now, not in 30 s. One attempt per connection, one retry of a 5xx 0.2 s later.

Every link the BMC hands us (a collection's ``Members``) is checked against the configured BMC's
origin before it is requested: sushy's connector requests a link with a host of its own as it
is, with the basic-auth header on the session, so a BMC (or whoever answers as it) listing
``https://elsewhere/...``, ``//elsewhere/...`` or ``http://<bmc>/...`` would have the agent send
the BMC password there. Such a link is refused (``ForeignLink``: the whole read is unreadable, every
GPU ``unavailable``) and nothing is sent to it.

Imported lazily by ``operator/bmc.py`` only on a host whose config has a ``[bmc]`` table:
sushy and requests cost ~105 ms and ~6 MiB at import (tests/test_import_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import SplitResult, urlsplit

import requests
import sushy
from sushy import auth as sushy_auth
from sushy import connector as sushy_connector
from sushy.resources import base

from gpuaas_agent.contract.bmc import (
    GpuTelemetry,
    NvLinkTelemetry,
    NvSwitchTelemetry,
    TemperatureReading,
    TemperatureThreshold,
)

ROOT = "/redfish/v1"


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not a boolean")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _path(value: Any) -> str:
    """A link the BMC gave, as the path it must be: absolute, under ``/redfish/v1``, no host of its own."""
    path = _str(value)
    if not path.startswith(ROOT + "/") or "//" in path or "/../" in path or path.endswith("/.."):
        raise ValueError(f"link {path[:200]!r} is not a path under {ROOT}")
    return path


def _link(value: Any) -> str:
    if not isinstance(value, dict):
        raise ValueError(f"{str(value)[:100]!r} is not a link")
    return _path(value["@odata.id"])


def _links(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError("not a list of links")
    return tuple(_link(v) for v in value)


def _members(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError("Members is not a list")
    return [_str(m["@odata.id"]) for m in value]


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError("not a list")
    return tuple(_str(v) for v in value)


class Collection(base.ResourceBase):
    """Any Redfish collection: the URIs of its members."""

    members = base.Field("Members", adapter=_members, required=True)


def _member_docs(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and "@odata.id" in m for m in value):
        raise ValueError("Members is not a list of links")
    return value


class ExpandedCollection(base.ResourceBase):
    """A collection as ``$expand`` answers it: each member a link or, expanded, the member's whole document."""

    members = base.Field("Members", adapter=_member_docs, required=True)


def _link_text(value: Any) -> str:
    """A link as the BMC wrote it, checked only where it is followed (:func:`own_path`, :func:`_path`): a bad
    ``Ports`` link must cost the GPU its NVLink reading, not its processor document (and so its health)."""
    if isinstance(value, dict) and isinstance(value.get("@odata.id"), str):
        return str(value["@odata.id"])
    return f"not a link: {str(value)[:100]}"


def _inline(value: Any) -> dict[str, Any] | None:
    """A link object the service expanded (it carries more than ``@odata.id``): the document; else None."""
    return value if isinstance(value, dict) and set(value) - {"@odata.id"} else None


class Port(base.ResourceBase):
    identity = base.Field("Id", adapter=_str)
    link_status = base.Field("LinkStatus", adapter=_str)  # LinkUp, LinkDown, NoLink, ...
    link_state = base.Field("LinkState", adapter=_str)  # Enabled, Disabled
    metrics = base.Field("Metrics", adapter=_link_text)
    metrics_inline = base.Field("Metrics", adapter=_inline)


# Oem.Nvidia.NVLinkErrors of a port's Metrics as the real BMC names them: the counters summed over the
# ports, the booleans counted as the ports reporting true (contract.bmc.NvLinkTelemetry).
NVLINK_COUNTERS = {"DataCRCCount": "data_crc_count", "FlitCRCCount": "flit_crc_count",
                   "RecoveryCount": "recovery_count", "ReplayCount": "replay_count"}
NVLINK_FLAGS = {"RuntimeError": "runtime_error_ports", "TrainingError": "training_error_ports"}


def _nvlink_errors(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise ValueError("NVLinkErrors is not an object")
    counts = {field: _int(value[key]) for key, field in NVLINK_COUNTERS.items() if key in value}
    counts.update({field: int(_bool(value[key])) for key, field in NVLINK_FLAGS.items() if key in value})
    return counts


class PortMetrics(base.ResourceBase):
    nvlink_errors = base.Field(["Oem", "Nvidia", "NVLinkErrors"], adapter=_nvlink_errors)


class GpuProcessor(base.ResourceBase):
    identity = base.Field("Id", required=True, adapter=_str)
    processor_type = base.Field("ProcessorType", adapter=_str)
    serial_number = base.Field("SerialNumber", adapter=_str)
    uuid = base.Field("UUID", adapter=_str)
    state = base.Field(["Status", "State"], adapter=_str)
    health = base.Field(["Status", "Health"], adapter=_str)
    sxm_slot = base.Field(["Location", "PartLocation", "ServiceLabel"], adapter=_str)
    metrics = base.Field("Metrics", adapter=_link)
    environment_metrics = base.Field("EnvironmentMetrics", adapter=_link)
    memory = base.Field(["Links", "Memory"], adapter=_links)
    chassis = base.Field(["Links", "Chassis"], adapter=_link)
    ports = base.Field("Ports", adapter=_link_text)


class GpuEnvironmentMetrics(base.ResourceBase):
    # TemperatureCelsius is deliberately not read: on HGX it is the TEMP_1 slowdown margin (module docstring).
    power_w = base.Field(["PowerWatts", "Reading"], adapter=_float)
    power_limit_w = base.Field(["PowerLimitWatts", "SetPoint"], adapter=_float)


class GpuProcessorMetrics(base.ResourceBase):
    sram_ecc_correctable = base.Field(["CacheMetricsTotal", "LifeTime", "CorrectableECCErrorCount"], adapter=_int)
    sram_ecc_uncorrectable = base.Field(["CacheMetricsTotal", "LifeTime", "UncorrectableECCErrorCount"],
                                        adapter=_int)
    pcie_correctable = base.Field(["PCIeErrors", "CorrectableErrorCount"], adapter=_int)
    pcie_nonfatal = base.Field(["PCIeErrors", "NonFatalErrorCount"], adapter=_int)
    pcie_fatal = base.Field(["PCIeErrors", "FatalErrorCount"], adapter=_int)
    throttle_reasons = base.Field(["Oem", "Nvidia", "ThrottleReasons"], adapter=_strings)


class GpuMemory(base.ResourceBase):
    metrics = base.Field("Metrics", adapter=_link)
    state = base.Field(["Status", "State"], adapter=_str)
    health = base.Field(["Status", "Health"], adapter=_str)
    row_remapping_failed = base.Field(["Oem", "Nvidia", "RowRemappingFailed"], adapter=_bool)
    row_remapping_pending = base.Field(["Oem", "Nvidia", "RowRemappingPending"], adapter=_bool)


class GpuMemoryMetrics(base.ResourceBase):
    dram_ecc_correctable = base.Field(["LifeTime", "CorrectableECCErrorCount"], adapter=_int)
    dram_ecc_uncorrectable = base.Field(["LifeTime", "UncorrectableECCErrorCount"], adapter=_int)
    row_remap_correctable = base.Field(["Oem", "Nvidia", "RowRemapping", "CorrectableRowRemappingCount"],
                                       adapter=_int)
    row_remap_uncorrectable = base.Field(["Oem", "Nvidia", "RowRemapping", "UncorrectableRowRemappingCount"],
                                         adapter=_int)


class Chassis(base.ResourceBase):
    sensors = base.Field("Sensors", adapter=_link)


class Sensor(base.ResourceBase):
    reading = base.Field("Reading", adapter=_float)
    reading_type = base.Field("ReadingType", adapter=_str)
    upper_caution = base.Field(["Thresholds", "UpperCaution", "Reading"], adapter=_float)
    upper_critical = base.Field(["Thresholds", "UpperCritical", "Reading"], adapter=_float)


class NvSwitch(base.ResourceBase):
    identity = base.Field("Id", required=True, adapter=_str)
    state = base.Field(["Status", "State"], adapter=_str)
    health = base.Field(["Status", "Health"], adapter=_str)
    metrics = base.Field("Metrics", adapter=_link)
    chassis = base.Field(["Links", "Chassis"], adapter=_link)


class NvSwitchMetrics(base.ResourceBase):
    ecc_uncorrectable = base.Field(["InternalMemoryMetrics", "LifeTime", "UncorrectableECCErrorCount"],
                                   adapter=_int)
    pcie_nonfatal = base.Field(["PCIeErrors", "NonFatalErrorCount"], adapter=_int)
    pcie_fatal = base.Field(["PCIeErrors", "FatalErrorCount"], adapter=_int)


class ForeignLink(ValueError):
    """A link that leaves the configured BMC's origin (another host or port, ``http://``): refused, never requested."""


def _origin(url: SplitResult) -> tuple[str, str, int | None]:
    port = url.port  # ValueError for a port that is not a number
    default = {"https": 443, "http": 80}.get(url.scheme.lower())
    return url.scheme.lower(), (url.hostname or "").lower(), port if port is not None else default


def own_path(bmc_url: str, link: str) -> str:
    """``link`` as a path on the BMC at ``bmc_url``; :class:`ForeignLink` when it names another origin.

    Accepted: an absolute path (``/redfish/v1/...``) or an absolute URL of exactly the BMC's scheme,
    host and port. Refused: any other host or port, another scheme (``http://`` for an ``https://``
    BMC), a protocol-relative ``//host/...``, a relative path, userinfo (``https://bmc@elsewhere/``).
    """
    try:
        target = urlsplit(link)
        same = _origin(target) == _origin(urlsplit(bmc_url)) and target.username is None
    except ValueError:
        same = False
        target = urlsplit("")
    if target.scheme or target.netloc or link.startswith("//"):
        if not same:
            raise ForeignLink(f"the BMC listed a link {link[:200]!r} that leaves its origin {bmc_url}: refused, "
                              "nothing was sent there")
    elif not link.startswith("/"):
        raise ForeignLink(f"the BMC listed a link {link[:200]!r} that is not an absolute path: refused")
    return target.path + (f"?{target.query}" if target.query else "")


# What a hostile or broken BMC makes sushy raise while one resource is fetched and parsed: an HTTP
# error, a refused/reset/timed-out connection, a body that is not JSON (requests' JSONDecodeError is a
# ValueError), or JSON of the wrong shape (a list where an object belongs: AttributeError/TypeError).
READ_ERRORS = (sushy.exceptions.SushyError, requests.RequestException, ValueError, TypeError, AttributeError,
               KeyError)

# GETs one read may make: 2 collections + 9 per GPU + 5 per NVSwitch is 94 on an 8-GPU HGX (+ the FPGA's
# document, + 1 per GPU for its NVLink ports expanded: 103); a BMC that lists more members than a baseboard
# has, or links in circles, is cut off here. NVLink read port by port (no $expand) takes 1 + 36 GETs per GPU
# and gets only what the health reads left.
MAX_DOCUMENTS = 160
# A chassis' Sensors collection of an HGX GPU lists 7; more than this is not a GPU's chassis.
MAX_SENSOR_MEMBERS = 64
MAX_MEMORY_LINKS = 4
# An HGX GPU has 18 NVLink ports (H100, H200); a Ports collection listing more than this is not a GPU's.
MAX_PORT_MEMBERS = 64
# $expand=.($levels=2) on a GPU's Ports: level 1 the ports, level 2 each port's Metrics.
NVLINK_EXPAND_LEVELS = 2


# The largest document a pass reads is ~3 KB on the real BMC (a GPU's Processor); a body over this is refused
# before it is parsed. Its download is bounded by the request timeout between bytes and the check's deadline.
MAX_DOCUMENT_BYTES = 1 << 20


class DocumentBudgetExceeded(ValueError):
    """The read asked for more documents than MAX_DOCUMENTS: the rest is unread, not waited for."""


class DocumentTooLarge(ValueError):
    """A document over MAX_DOCUMENT_BYTES: unread, not parsed."""


def refuse_large(response: requests.Response) -> None:
    """sushy's ``response_callback``: runs on every response before sushy parses its JSON."""
    if len(response.content) > MAX_DOCUMENT_BYTES:
        raise DocumentTooLarge(f"{response.url}: {len(response.content)} bytes, more than {MAX_DOCUMENT_BYTES}")


def _sensor_id(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def is_memory_temperature(path: str) -> bool:
    """The HBM's temperature sensor among a GPU chassis' sensors (``HGX_GPU_SXM_1_DRAM_0_Temp_0``)."""
    parts = _sensor_id(path).upper().split("_")
    return len(parts) >= 4 and parts[-4] == "DRAM" and parts[-2] == "TEMP" and parts[-1].isdigit()


def is_die_temperature(path: str) -> bool:
    """The GPU's (or NVSwitch's) own temperature (``..._TEMP_0``; ``_TEMP_1`` is the slowdown margin)."""
    return _sensor_id(path).upper().endswith("_TEMP_0") and not is_memory_temperature(path)


@dataclass(frozen=True)
class BaseboardRead:
    gpus: list[GpuTelemetry]
    nvswitches: list[NvSwitchTelemetry]


class HgxBmc:
    """One authenticated sushy connection to a baseboard BMC; :meth:`read` fetches every GPU and NVSwitch."""

    def __init__(self, url: str, username: str, password: str, *, verify: bool | str = True,
                 timeout_s: float = 5.0, system_id: str = "HGX_Baseboard_0",
                 fabric_id: str = "HGX_NVLinkFabric_0") -> None:
        self._connector = sushy_connector.Connector(url, verify=verify, server_side_retries=1,
                                                    response_callback=refuse_large,
                                                    server_side_retries_delay=0.2, default_request_timeout=timeout_s,
                                                    connect_timeout=timeout_s)
        # Sushy() reads the service root: a BMC that does not answer fails here, before any GPU is looked at.
        self._root = sushy.Sushy(url, auth=sushy_auth.BasicAuth(username=username, password=password),
                                 connector=self._connector)
        self._url = url
        self._documents = 0
        self._system = f"{ROOT}/Systems/{system_id}"
        self._fabric = f"{ROOT}/Fabrics/{fabric_id}"
        self._ports: dict[str, str | None] = {}  # gpu id -> its processor's Ports link (None: it gives none)

    def _get(self, cls: type[base.ResourceBase], path: str) -> Any:
        self._documents += 1
        if self._documents > MAX_DOCUMENTS:
            raise DocumentBudgetExceeded(f"more than {MAX_DOCUMENTS} documents in one read: not requested")
        return cls(self._connector, path, redfish_version=self._root.redfish_version, root=self._root)

    def close(self) -> None:
        self._connector.close()

    def read(self) -> BaseboardRead:
        """Every GPU of the baseboard's system and every NVSwitch of its NVLink fabric (raises READ_ERRORS
        only when the lists themselves cannot be read)."""
        processors = self._members(f"{self._system}/Processors")
        switches = self._members(f"{self._fabric}/Switches")
        gpus = [self._gpu(path) for path in processors]
        nvswitches = [self._switch(p) for p in switches]
        # NVLink last: telemetry only, it gets what the health reads above left of the document budget.
        return BaseboardRead(gpus=[self._with_nvlink(g) for g in gpus if g is not None], nvswitches=nvswitches)

    def _members(self, collection: str) -> list[str]:
        """The collection's member paths, every one on our BMC's origin (:func:`own_path`), before any is read."""
        return [own_path(self._url, link) for link in self._get(Collection, collection).members]

    def _gpu(self, path: str) -> GpuTelemetry | None:
        gpu_id = path.rstrip("/").rsplit("/", 1)[-1]
        fields: dict[str, Any] = {"gpu_id": gpu_id}
        unread: list[str] = []

        def take(cls: type[base.ResourceBase], uri: str | None, what: str) -> Any:
            if uri is None:
                unread.append(f"{path}: the BMC gives no link to its {what}")
                return None
            try:
                return self._get(cls, uri)
            except READ_ERRORS as exc:
                unread.append(f"{uri}: {type(exc).__name__}: {str(exc)[:200]}")
                return None

        proc = take(GpuProcessor, path, "processor")
        if proc is None:
            return GpuTelemetry(gpu_id=gpu_id, unread=tuple(unread))
        if proc.processor_type not in (None, "GPU"):
            return None  # the baseboard's FPGA_0, a CPU: not a GPU, not ours to judge
        fields.update(serial_number=proc.serial_number, uuid=proc.uuid, state=proc.state, health=proc.health,
                      sxm_slot=proc.sxm_slot)
        self._ports[gpu_id] = proc.ports
        metrics = take(GpuProcessorMetrics, proc.metrics, "ProcessorMetrics")
        if metrics is not None:
            fields.update({n: getattr(metrics, n) for n in (
                "sram_ecc_correctable", "sram_ecc_uncorrectable", "pcie_correctable", "pcie_nonfatal", "pcie_fatal")})
            fields["throttle_reasons"] = throttle_reasons(metrics.throttle_reasons)
        if proc.environment_metrics is not None:  # power only: telemetry, not health, so optional
            env = take(GpuEnvironmentMetrics, proc.environment_metrics, "EnvironmentMetrics")
            if env is not None:
                fields.update(power_w=env.power_w, power_limit_w=env.power_limit_w)
        self._memory(proc, fields, take)
        chassis = take(Chassis, proc.chassis, "chassis")
        if chassis is not None:
            sensors = self._sensors(chassis.sensors, path, unread)
            fields["temperature"] = self._temperature(
                next((s for s in sensors if is_die_temperature(s)), None), "GPU temperature", path, unread)
            fields["memory_temperature"] = self._temperature(
                next((s for s in sensors if is_memory_temperature(s)), None), "memory temperature", path, unread)
        return GpuTelemetry(**fields, unread=tuple(unread))

    def _memory(self, proc: GpuProcessor, fields: dict[str, Any], take: Any) -> None:
        """The GPU's HBM (``Links.Memory``, one on HGX): remap state and lifetime counts, summed over the links."""
        links = proc.memory or ()
        if not links:
            take(GpuMemory, None, "memory (Links.Memory)")
            return
        for link in links[:MAX_MEMORY_LINKS]:
            mem = take(GpuMemory, link, "memory")
            if mem is None:
                continue
            for name in ("row_remapping_failed", "row_remapping_pending"):
                value = getattr(mem, name)
                if value is not None:
                    fields[name] = bool(fields.get(name)) or value
            if mem.health not in (None, "OK") and fields.get("health") in (None, "OK"):
                fields["health"] = mem.health  # the HBM's own health rolls up into the GPU's
            counts = take(GpuMemoryMetrics, mem.metrics, "MemoryMetrics")
            if counts is None:
                continue
            for name in ("dram_ecc_correctable", "dram_ecc_uncorrectable", "row_remap_correctable",
                         "row_remap_uncorrectable"):
                value = getattr(counts, name)
                if value is not None:
                    fields[name] = (fields.get(name) or 0) + value

    def _sensors(self, collection: str | None, owner: str, unread: list[str]) -> tuple[str, ...]:
        if collection is None:
            unread.append(f"{owner}: its chassis gives no Sensors link")
            return ()
        try:
            members = self._get(Collection, collection).members
        except READ_ERRORS as exc:
            unread.append(f"{collection}: {type(exc).__name__}: {str(exc)[:200]}")
            return ()
        if len(members) > MAX_SENSOR_MEMBERS:
            unread.append(f"{collection}: lists {len(members)} sensors, more than {MAX_SENSOR_MEMBERS}")
            return ()
        try:
            return tuple(_path(m) for m in members)
        except ValueError as exc:
            unread.append(f"{collection}: {exc}")
            return ()

    def _temperature(self, uri: str | None, what: str, owner: str, unread: list[str]) -> TemperatureReading | None:
        if uri is None:
            unread.append(f"{owner}: no {what} sensor among its chassis' sensors")
            return None
        try:
            sensor = self._get(Sensor, uri)
        except READ_ERRORS as exc:
            unread.append(f"{uri}: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        if sensor.reading_type != "Temperature":
            unread.append(f"{uri}: ReadingType {sensor.reading_type!r} is not Temperature")
            return None
        return TemperatureReading(
            reading_c=sensor.reading, sensor=uri,
            caution=None if sensor.upper_caution is None else TemperatureThreshold(
                reading_c=sensor.upper_caution, source="bmc", name="UpperCaution"),
            critical=None if sensor.upper_critical is None else TemperatureThreshold(
                reading_c=sensor.upper_critical, source="bmc", name="UpperCritical"))

    def _expand_supported(self) -> bool:
        """The service root advertises ``ExpandQuery`` with ``Levels`` and ``MaxLevels`` >= 2."""
        features = self._root.protocol_features_supported
        expand = getattr(features, "expand_query", None) if features is not None else None
        if not isinstance(expand, dict) or expand.get("Levels") is not True:
            return False
        levels = expand.get("MaxLevels")
        return isinstance(levels, int) and not isinstance(levels, bool) and levels >= NVLINK_EXPAND_LEVELS

    def _with_nvlink(self, gpu: GpuTelemetry) -> GpuTelemetry:
        if gpu.gpu_id not in self._ports:
            return gpu.model_copy(update={"nvlink_unread": "its processor document was not read"})
        ports = self._ports[gpu.gpu_id]
        if ports is None:
            return gpu.model_copy(update={"nvlink_unread": "its processor gives no Ports link"})
        try:
            return gpu.model_copy(update={"nvlink": self._nvlink(ports)})
        except READ_ERRORS as exc:
            return gpu.model_copy(update={"nvlink_unread": f"{ports}: {type(exc).__name__}: {str(exc)[:300]}"})

    def _nvlink(self, ports: str) -> NvLinkTelemetry:
        """The GPU's NVLink ports and counters, or a READ_ERRORS naming why they are not read."""
        ports = _path(own_path(self._url, ports))
        listing: list[dict[str, Any]] | None = None
        if self._expand_supported():
            try:
                listing = self._get(ExpandedCollection, f"{ports}?$expand=.($levels={NVLINK_EXPAND_LEVELS})").members
            except DocumentBudgetExceeded:
                raise
            except READ_ERRORS:
                listing = None  # the service refused the query (or its answer was too large): the plain collection
        expanded = listing is not None
        if listing is None:
            listing = self._get(ExpandedCollection, ports).members
        if len(listing) > MAX_PORT_MEMBERS:
            raise ValueError(f"lists {len(listing)} ports, more than {MAX_PORT_MEMBERS}")
        # Every member link is checked before any port is read or requested, each Metrics link before it is
        # read: one foreign link refuses the GPU's NVLink (ForeignLink), and nothing is sent to it.
        entries: list[tuple[str, dict[str, Any] | None]] = [
            (_path(own_path(self._url, _str(m["@odata.id"]))), _inline(m)) for m in listing]
        gets = sum(2 if doc is None else (0 if _inline(doc.get("Metrics")) else 1) for _, doc in entries)
        read_by: Literal["expand", "per_port"] = "expand" if expanded and gets == 0 else "per_port"
        left = MAX_DOCUMENTS - self._documents
        if gets > left:
            raise DocumentBudgetExceeded(f"reading its {len(entries)} ports one by one takes {gets} GETs, "
                                         f"the document budget leaves {left}: not read")
        version, root = self._root.redfish_version, self._root
        totals: dict[str, int] = {}
        up, disabled, metrics_read = 0, 0, 0
        down: list[str] = []
        for path, doc in entries:
            port = (Port(self._connector, path, redfish_version=version, root=root, json_doc=doc) if doc
                    else self._get(Port, path))
            port_id = port.identity or path.rstrip("/").rsplit("/", 1)[-1]
            if port.link_status == "LinkUp":
                up += 1
            elif port.link_status is not None:  # a port that does not say is neither up nor down
                down.append(port_id[:64])
            if port.link_state not in (None, "Enabled"):
                disabled += 1
            if port.metrics is None:
                continue
            metrics_path = _path(own_path(self._url, port.metrics))
            metrics = (PortMetrics(self._connector, metrics_path, redfish_version=version, root=root,
                                   json_doc=port.metrics_inline) if port.metrics_inline
                       else self._get(PortMetrics, metrics_path))
            if metrics.nvlink_errors is None:
                continue
            metrics_read += 1
            for name, value in metrics.nvlink_errors.items():
                totals[name] = totals.get(name, 0) + value
        return NvLinkTelemetry(ports=len(entries), ports_up=up, ports_down=tuple(down[:64]), ports_disabled=disabled,
                               metrics_read=metrics_read, read_by=read_by, **totals)

    def _switch(self, path: str) -> NvSwitchTelemetry:
        switch_id = path.rstrip("/").rsplit("/", 1)[-1]
        fields: dict[str, Any] = {"switch_id": switch_id}
        unread: list[str] = []
        try:
            switch = self._get(NvSwitch, path)
        except READ_ERRORS as exc:
            return NvSwitchTelemetry(switch_id=switch_id, unread=(f"{path}: {type(exc).__name__}: {str(exc)[:200]}",))
        fields.update(state=switch.state, health=switch.health)
        for cls, uri, what in ((NvSwitchMetrics, switch.metrics, "SwitchMetrics"), (Chassis, switch.chassis, "chassis")):
            if uri is None:
                unread.append(f"{path}: the BMC gives no link to its {what}")
                continue
            try:
                resource = self._get(cls, uri)
            except READ_ERRORS as exc:
                unread.append(f"{uri}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if isinstance(resource, NvSwitchMetrics):
                fields.update({n: getattr(resource, n) for n in ("ecc_uncorrectable", "pcie_nonfatal", "pcie_fatal")})
            else:
                sensors = self._sensors(resource.sensors, path, unread)
                fields["temperature"] = self._temperature(
                    next((s for s in sensors if is_die_temperature(s)), None), "NVSwitch temperature", path, unread)
        return NvSwitchTelemetry(**fields, unread=tuple(unread))


def throttle_reasons(reported: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """``Oem.Nvidia.ThrottleReasons`` as the agent reads it: ``["NA"]`` (every GPU of the real DGX H100 capture
    reads so) or no field is "not available" (None), never a throttle; ``["None"]`` is "not throttled"."""
    if reported is None:
        return None
    reasons = tuple(r for r in reported if r not in ("NA", "None"))
    if not reasons and "NA" in reported:
        return None
    return reasons
