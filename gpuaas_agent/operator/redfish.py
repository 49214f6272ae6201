"""Read an HGX baseboard's GPU and NVSwitch telemetry over Redfish with sushy (blocking; one read per call).

sushy is the Redfish library of OpenStack's bare-metal service: every resource below is a
small :class:`sushy.resources.base.ResourceBase` that parses its own JSON document, so
nothing here walks dicts by hand. The URIs are those NVIDIA's HGX Management Controller
serves (``lab/hgx_redfish_mockup.py`` says where they come from); the GPU's chassis and
sensors are found by the HGX naming (``HGX_GPU_SXM_<n>``, ``..._TEMP_0``, ``..._Power_0``).

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
from typing import Any
from urllib.parse import SplitResult, urlsplit

import requests
import sushy
from sushy import auth as sushy_auth
from sushy import connector as sushy_connector
from sushy.resources import base

from gpuaas_agent.contract.bmc import GpuTelemetry, NvSwitchTelemetry

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


class GpuProcessor(base.ResourceBase):
    identity = base.Field("Id", required=True, adapter=_str)
    processor_type = base.Field("ProcessorType", adapter=_str)
    serial_number = base.Field("SerialNumber", adapter=_str)
    uuid = base.Field("UUID", adapter=_str)
    state = base.Field(["Status", "State"], adapter=_str)
    health = base.Field(["Status", "Health"], adapter=_str)


class GpuProcessorMetrics(base.ResourceBase):
    sram_ecc_correctable = base.Field(["CacheMetricsTotal", "LifeTime", "CorrectableECCErrorCount"], adapter=_int)
    sram_ecc_uncorrectable = base.Field(["CacheMetricsTotal", "LifeTime", "UncorrectableECCErrorCount"],
                                        adapter=_int)
    pcie_correctable = base.Field(["PCIeErrors", "CorrectableErrorCount"], adapter=_int)
    pcie_nonfatal = base.Field(["PCIeErrors", "NonFatalErrorCount"], adapter=_int)
    pcie_fatal = base.Field(["PCIeErrors", "FatalErrorCount"], adapter=_int)
    throttle_reasons = base.Field(["Oem", "Nvidia", "ThrottleReasons"], adapter=_strings)


class GpuMemory(base.ResourceBase):
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


class Sensor(base.ResourceBase):
    reading = base.Field("Reading", adapter=_float)
    reading_type = base.Field("ReadingType", adapter=_str)
    upper_caution = base.Field(["Thresholds", "UpperCaution", "Reading"], adapter=_float)
    upper_critical = base.Field(["Thresholds", "UpperCritical", "Reading"], adapter=_float)


class NvSwitch(base.ResourceBase):
    identity = base.Field("Id", required=True, adapter=_str)
    state = base.Field(["Status", "State"], adapter=_str)
    health = base.Field(["Status", "Health"], adapter=_str)


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
                                                    server_side_retries_delay=0.2, default_request_timeout=timeout_s,
                                                    connect_timeout=timeout_s)
        # Sushy() reads the service root: a BMC that does not answer fails here, before any GPU is looked at.
        self._root = sushy.Sushy(url, auth=sushy_auth.BasicAuth(username=username, password=password),
                                 connector=self._connector)
        self._url = url
        self._system = f"{ROOT}/Systems/{system_id}"
        self._fabric = f"{ROOT}/Fabrics/{fabric_id}"

    def _get(self, cls: type[base.ResourceBase], path: str) -> Any:
        return cls(self._connector, path, redfish_version=self._root.redfish_version, root=self._root)

    def close(self) -> None:
        self._connector.close()

    def read(self) -> BaseboardRead:
        """Every GPU of the baseboard's system and every NVSwitch of its NVLink fabric (raises READ_ERRORS
        only when the lists themselves cannot be read)."""
        processors = self._members(f"{self._system}/Processors")
        switches = self._members(f"{self._fabric}/Switches")
        gpus = [self._gpu(path) for path in processors]
        return BaseboardRead(gpus=[g for g in gpus if g is not None], nvswitches=[self._switch(p) for p in switches])

    def _members(self, collection: str) -> list[str]:
        """The collection's member paths, every one on our BMC's origin (:func:`own_path`), before any is read."""
        return [own_path(self._url, link) for link in self._get(Collection, collection).members]

    def _gpu(self, path: str) -> GpuTelemetry | None:
        gpu_id = path.rstrip("/").rsplit("/", 1)[-1]
        fields: dict[str, Any] = {"gpu_id": gpu_id}
        unread: list[str] = []

        def take(cls: type[base.ResourceBase], uri: str, names: tuple[str, ...]) -> Any:
            try:
                resource = self._get(cls, uri)
            except READ_ERRORS as exc:
                unread.append(f"{uri}: {type(exc).__name__}: {str(exc)[:200]}")
                return None
            fields.update({n: getattr(resource, n) for n in names})
            return resource

        proc = take(GpuProcessor, path, ("serial_number", "uuid", "state", "health"))
        if proc is not None and proc.processor_type not in (None, "GPU"):
            return None  # a CPU or accelerator of another kind in the same system: not ours to judge
        take(GpuProcessorMetrics, f"{path}/ProcessorMetrics",
             ("sram_ecc_correctable", "sram_ecc_uncorrectable", "pcie_correctable", "pcie_nonfatal", "pcie_fatal",
              "throttle_reasons"))
        memory = f"{self._system}/Memory/{gpu_id}_DRAM_0"
        mem = take(GpuMemory, memory, ("row_remapping_failed", "row_remapping_pending"))
        if mem is not None and mem.health not in (None, "OK") and fields.get("health") in (None, "OK"):
            fields["health"] = mem.health  # the HBM's own health rolls up into the GPU's
        take(GpuMemoryMetrics, f"{memory}/MemoryMetrics",
             ("dram_ecc_correctable", "dram_ecc_uncorrectable", "row_remap_correctable", "row_remap_uncorrectable"))
        chassis = f"{ROOT}/Chassis/HGX_{gpu_id}"
        temp = take(Sensor, f"{chassis}/Sensors/HGX_{gpu_id}_TEMP_0", ())
        if temp is not None:
            fields.update(temperature_c=temp.reading, temperature_caution_c=temp.upper_caution,
                          temperature_critical_c=temp.upper_critical)
        power = take(Sensor, f"{chassis}/Sensors/HGX_{gpu_id}_Power_0", ())
        if power is not None:
            fields["power_w"] = power.reading
        fields["throttle_reasons"] = tuple(fields.get("throttle_reasons") or ())
        return GpuTelemetry(**fields, unread=tuple(unread))

    def _switch(self, path: str) -> NvSwitchTelemetry:
        switch_id = path.rstrip("/").rsplit("/", 1)[-1]
        fields: dict[str, Any] = {"switch_id": switch_id}
        unread: list[str] = []
        for cls, uri, names in (
            (NvSwitch, path, ("state", "health")),
            (NvSwitchMetrics, f"{path}/SwitchMetrics", ("ecc_uncorrectable", "pcie_nonfatal", "pcie_fatal")),
        ):
            try:
                resource = self._get(cls, uri)
            except READ_ERRORS as exc:
                unread.append(f"{uri}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            fields.update({n: getattr(resource, n) for n in names})
        sensor = f"{ROOT}/Chassis/HGX_{switch_id}/Sensors/HGX_{switch_id}_TEMP_0"
        try:
            temp = self._get(Sensor, sensor)
            fields.update(temperature_c=temp.reading, temperature_critical_c=temp.upper_critical)
        except READ_ERRORS as exc:
            unread.append(f"{sensor}: {type(exc).__name__}: {str(exc)[:200]}")
        return NvSwitchTelemetry(**fields, unread=tuple(unread))
