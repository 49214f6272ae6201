"""GPU and NVSwitch health from the HGX baseboard's BMC: credentials, one read, the per-GPU verdicts, the check.

The ``gpu_nvml`` check answers ``unavailable`` for every GPU a slice holds (vfio-pci, no
host driver); the baseboard's BMC sees them whatever the host's driver. On the health
interval :func:`bmc_check` reads it (``operator/redfish.py``, sushy) and judges each GPU:

- ``failed``: Redfish health ``Critical``; the GPU ``Absent``/``UnavailableOffline`` or not
  listed at all while the config maps it; row remapping failed (NVIDIA: the HBM has no spare
  rows left, an RMA case); a fatal PCIe error; the GPU or its memory temperature at or above
  its critical threshold;
- ``degraded``: health ``Warning``; a row remap pending (the GPU needs a reset before the
  remap takes effect); uncorrectable SRAM ECC errors (SRAM has no remapping); non-fatal PCIe
  errors; a temperature at or above its caution threshold; a hardware slowdown (``HW*`` throttle
  reasons: thermal, power brake). ``ThrottleReasons: ["NA"]`` is "not available", no verdict;
- ``unavailable``: anything that could not be read: no answer, malformed JSON, a hang past the
  request timeout, a resource missing. Never ``ok``.

Lifetime DRAM ECC and row-remap counts are evidence, not verdicts: a remapped row is the
repair working (NVIDIA's row-remapping guidance), its failure is what matters.

Thresholds: a sensor's own (``bmc``) where it carries one, else NVIDIA's limit (``nvidia_limit``,
:data:`NVIDIA_LIMITS`). A real HGX H100 BMC carries none on the GPU temperature and only
``UpperCritical`` 95 on the memory temperature (fixtures/redfish/dgx-h100-viking), so the GPU
temperature is judged by NVIDIA's limits and the memory temperature by the BMC's.

NVSwitches are judged alike; their verdicts ride in the same reading (a partition through a
failed NVSwitch is not healthy). :func:`read_bmc_verdicts` is what component quarantine uses.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from types import ModuleType

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import BmcConfig
from gpuaas_agent.contract.bmc import (
    STATUS_RANK,
    BmcReading,
    BmcStatus,
    GpuBmcVerdict,
    GpuTelemetry,
    NvSwitchBmcVerdict,
    NvSwitchTelemetry,
    TemperatureReading,
    TemperatureThreshold,
)
from gpuaas_agent.contract.tasks import HealthCheck
from gpuaas_agent.control.transport import check_secret_file
from gpuaas_agent.errors import AgentError

CHECK_NAME = "gpu_bmc"
_ABSENT_STATES = ("Absent", "UnavailableOffline")

# NVIDIA's temperature limits for the GPU, as NVML reports them, recorded on a lent H200 on 2026-11-28
# (fixtures/nvml/h200-lent-2026-11-28.sensors.json, NVML_TEMPERATURE_THRESHOLD_*): they stand in where the
# BMC's sensor carries no threshold of its own. GPU: caution at the maximum operating temperature (87 C;
# the slowdown at 89 C lies between), critical at shutdown (95 C). Memory: critical at MEM_MAX (95 C), no
# caution (NVML has none). Other GPU models may differ: these are the H200's.
NVIDIA_LIMITS: dict[str, dict[str, TemperatureThreshold]] = {
    "temperature": {
        "caution": TemperatureThreshold(reading_c=87.0, source="nvidia_limit", name="NVML_TEMPERATURE_THRESHOLD_GPU_MAX"),
        "critical": TemperatureThreshold(reading_c=95.0, source="nvidia_limit",
                                         name="NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
    },
    "memory_temperature": {
        "critical": TemperatureThreshold(reading_c=95.0, source="nvidia_limit", name="NVML_TEMPERATURE_THRESHOLD_MEM_MAX"),
    },
}


class BmcError(AgentError):
    default_code = "bmc_credentials_invalid"


class BmcCredentials(BaseModel):
    """The BMC account the agent reads with (a read-only ``ReadOnly`` role is enough)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    username: str = Field(min_length=1, max_length=256)
    password: SecretStr


def load_credentials(path: Path) -> BmcCredentials:
    """The credentials file, with the NATS ``.creds`` checks first (regular file, ours, 0600/0400)."""
    check_secret_file(path, what="BMC credentials")
    try:
        return BmcCredentials.model_validate(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, ValueError, ValidationError) as exc:
        # ValidationError and JSONDecodeError are ValueErrors: neither message carries the password.
        raise BmcError(f"BMC credentials {path} are not JSON {{\"username\": ..., \"password\": ...}}",
                       evidence={"path": str(path), "error": type(exc).__name__}) from None


# -- judging (pure) --------------------------------------------------------------------------


def _worst(found: Iterable[tuple[BmcStatus, str]]) -> tuple[BmcStatus, tuple[str, ...]]:
    found = list(found)
    if not found:
        return "ok", ()
    status = max((s for s, _ in found), key=STATUS_RANK.__getitem__)
    return status, tuple(reason for s, reason in found if s == status)


def with_limits(reading: TemperatureReading | None, limits: dict[str, TemperatureThreshold]) -> TemperatureReading | None:
    """``reading`` with NVIDIA's limit in each threshold the sensor left empty (the sensor's own always wins)."""
    if reading is None:
        return None
    return reading.model_copy(update={
        "caution": reading.caution or limits.get("caution"), "critical": reading.critical or limits.get("critical")})


def with_nvidia_limits(t: GpuTelemetry) -> GpuTelemetry:
    return t.model_copy(update={
        "temperature": with_limits(t.temperature, NVIDIA_LIMITS["temperature"]),
        "memory_temperature": with_limits(t.memory_temperature, NVIDIA_LIMITS["memory_temperature"])})


def _threshold_text(th: TemperatureThreshold) -> str:
    return f"{th.reading_c:g} C ({'BMC ' if th.source == 'bmc' else 'NVIDIA '}{th.name})"


def judge_temperature(what: str, reading: TemperatureReading | None) -> list[tuple[BmcStatus, str]]:
    if reading is None or reading.reading_c is None:
        return []
    value = reading.reading_c
    if reading.critical is not None and value >= reading.critical.reading_c:
        return [("failed", f"{what} {value:g} C >= critical {_threshold_text(reading.critical)}")]
    if reading.caution is not None and value >= reading.caution.reading_c:
        return [("degraded", f"{what} {value:g} C >= caution {_threshold_text(reading.caution)}")]
    return []


def judge_redfish_status(t: GpuTelemetry | NvSwitchTelemetry) -> list[tuple[BmcStatus, str]]:
    """What Redfish itself says of a GPU or NVSwitch: its ``Status.Health`` and ``Status.State``."""
    found: list[tuple[BmcStatus, str]] = []
    if t.health == "Critical":
        found.append(("failed", "Redfish health Critical"))
    elif t.health == "Warning":
        found.append(("degraded", "Redfish health Warning"))
    if t.state in _ABSENT_STATES:
        found.append(("failed", f"Redfish state {t.state}"))
    return found


def judge_pcie_errors(t: GpuTelemetry | NvSwitchTelemetry) -> list[tuple[BmcStatus, str]]:
    """A GPU's or NVSwitch's PCIe error counters: a fatal one fails it, a non-fatal one degrades it."""
    found: list[tuple[BmcStatus, str]] = []
    if t.pcie_fatal:
        found.append(("failed", f"PCIe fatal errors {t.pcie_fatal}"))
    if t.pcie_nonfatal:
        found.append(("degraded", f"PCIe non-fatal errors {t.pcie_nonfatal}"))
    return found


def judge_gpu(t: GpuTelemetry) -> tuple[BmcStatus, tuple[str, ...]]:
    """The verdict on one GPU's telemetry and the reasons of that verdict (the worst ones only)."""
    t = with_nvidia_limits(t)  # idempotent: judge() has applied them already to the telemetry it keeps
    found = judge_redfish_status(t)
    if t.row_remapping_failed:
        found.append(("failed", "row remapping failed (no spare HBM rows)"))
    if t.row_remapping_pending:
        found.append(("degraded", "row remapping pending (needs a GPU reset)"))
    found += judge_pcie_errors(t)
    if t.sram_ecc_uncorrectable:
        found.append(("degraded", f"uncorrectable SRAM ECC errors {t.sram_ecc_uncorrectable}"))
    found += judge_temperature("temperature", t.temperature)
    found += judge_temperature("memory temperature", t.memory_temperature)
    slowdowns = [r for r in t.throttle_reasons or () if r.startswith("HW")]
    if slowdowns:
        found.append(("degraded", f"hardware slowdown {','.join(slowdowns)}"))
    for what in t.unread:
        found.append(("unavailable", f"unread {what}"))
    return _worst(found)


def judge_nvswitch(t: NvSwitchTelemetry) -> tuple[BmcStatus, tuple[str, ...]]:
    found = judge_redfish_status(t)
    found += judge_pcie_errors(t)
    if t.ecc_uncorrectable:
        found.append(("degraded", f"uncorrectable ECC errors {t.ecc_uncorrectable}"))
    found += judge_temperature("temperature", t.temperature)
    for what in t.unread:
        found.append(("unavailable", f"unread {what}"))
    return _worst(found)


def judge(config: BmcConfig, gpus: list[GpuTelemetry], nvswitches: list[NvSwitchTelemetry], *,
          read_at: datetime) -> BmcReading:
    """Verdicts for every GPU the BMC listed, plus ``failed`` for each mapped GPU it did not list."""
    verdicts = []
    for t in map(with_nvidia_limits, gpus):
        status, reasons = judge_gpu(t)
        verdicts.append(GpuBmcVerdict(gpu_id=t.gpu_id, pci_address=config.gpu_pci_addresses.get(t.gpu_id),
                                      status=status, reasons=reasons, telemetry=t))
    listed = {t.gpu_id for t in gpus}
    for gpu_id, address in sorted(config.gpu_pci_addresses.items()):
        if gpu_id not in listed:
            verdicts.append(GpuBmcVerdict(gpu_id=gpu_id, pci_address=address, status="failed",
                                          reasons=(f"not in the BMC's processor list of {config.system_id}",)))
    switches = [NvSwitchBmcVerdict(switch_id=t.switch_id, status=s, reasons=r, telemetry=t)
                for t in nvswitches for s, r in [judge_nvswitch(t)]]
    return BmcReading(bmc_url=config.url, read_at=read_at, gpus=tuple(sorted(verdicts, key=lambda v: v.gpu_id)),
                      nvswitches=tuple(switches))


def unreadable(config: BmcConfig, error: str, *, read_at: datetime) -> BmcReading:
    """The reading of a BMC that could not be read: every mapped GPU ``unavailable`` with the reason."""
    return BmcReading(bmc_url=config.url, read_at=read_at, error=error[:2000], gpus=tuple(
        GpuBmcVerdict(gpu_id=gpu_id, pci_address=address, status="unavailable", reasons=(error[:500],))
        for gpu_id, address in sorted(config.gpu_pci_addresses.items())))


# -- reading (blocking) ----------------------------------------------------------------------


def _redfish() -> ModuleType:
    """The sushy-based reader, imported on first use (tests/test_import_graph.py LAZY_IMPORTS says why)."""
    from gpuaas_agent.operator import redfish

    return redfish


def read_bmc_verdicts(config: BmcConfig) -> BmcReading:
    """Read the BMC once and judge every GPU and NVSwitch (blocking: run it in a thread with a deadline).

    Never raises for what the BMC does: a refused connection, a timeout, malformed JSON or bad
    credentials give a reading whose ``error`` says why and whose verdicts are ``unavailable``.
    """
    now = datetime.now(UTC)
    try:
        creds = load_credentials(config.credentials_file)
    except AgentError as exc:
        return unreadable(config, f"{exc.code}: {exc.message}", read_at=now)
    try:
        redfish = _redfish()
    except ImportError as exc:
        return unreadable(config, f"the Redfish client is not installed ({exc.name}): install gpuaas-agent[bmc]",
                          read_at=now)
    verify: bool | str = str(config.ca_file) if config.ca_file is not None else True
    try:
        bmc = redfish.HgxBmc(config.url, creds.username, creds.password.get_secret_value(), verify=verify,
                             timeout_s=config.request_timeout_s, system_id=config.system_id,
                             fabric_id=config.fabric_id)
    except redfish.READ_ERRORS as exc:
        return unreadable(config, f"BMC {config.url} did not answer its service root: "
                                  f"{type(exc).__name__}: {str(exc)[:300]}", read_at=now)
    try:
        read = bmc.read()
    except redfish.READ_ERRORS as exc:
        return unreadable(config, f"BMC {config.url} did not list the baseboard's GPUs and NVSwitches: "
                                  f"{type(exc).__name__}: {str(exc)[:300]}", read_at=now)
    finally:
        bmc.close()
    return judge(config, read.gpus, read.nvswitches, read_at=now)


def summarise_reading(reading: BmcReading) -> tuple[BmcStatus, str]:
    """The ``gpu_bmc`` check's verdict (the worst component's) and its one-line detail."""
    if reading.error is not None:
        return "unavailable", reading.error
    parts = [(v.status, f"{v.gpu_id}{f' ({v.pci_address})' if v.pci_address else ''}: {'; '.join(v.reasons)}")
             for v in reading.gpus if v.status != "ok"]
    parts += [(v.status, f"{v.switch_id}: {'; '.join(v.reasons)}") for v in reading.nvswitches if v.status != "ok"]
    if not reading.gpus:
        parts.append(("unavailable", "the BMC listed no GPU"))
    if not parts:
        return "ok", f"{len(reading.gpus)} GPU(s) and {len(reading.nvswitches)} NVSwitch(es) ok on {reading.bmc_url}"
    status, _ = _worst(parts)
    return status, "; ".join(f"{s} {text}" for s, text in sorted(parts, key=lambda p: -STATUS_RANK[p[0]]))


def bmc_check(config: BmcConfig) -> HealthCheck:
    """The ``gpu_bmc`` health check (blocking): one read, the worst verdict, every non-ok component named."""
    return check_of(read_bmc_verdicts(config))


def check_of(reading: BmcReading) -> HealthCheck:
    """The ``gpu_bmc`` check of a reading already made (the health round keeps the reading for quarantine)."""
    status, detail = summarise_reading(reading)
    return HealthCheck(name=CHECK_NAME, status=status, detail=detail[:4000], checked_at=reading.read_at)
