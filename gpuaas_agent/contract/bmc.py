"""What the HGX baseboard's BMC says about each GPU and NVSwitch, and the verdict the agent draws from it.

On a slice host the GPUs sit on ``vfio-pci`` and the host has no NVIDIA driver: NVML
cannot see them. The baseboard's BMC (the HGX Management Controller, over Redfish) still
can. A :class:`GpuTelemetry` is what one read returned for one GPU, field by field, with
``unread`` naming what could not be read; a :class:`GpuBmcVerdict` is the judgement
(``ok``/``degraded``/``failed``/``unavailable``, the verdicts of the host's health checks)
with its reasons and that telemetry as evidence. Component quarantine consumes
:class:`BmcReading`'s per-GPU verdicts (``operator/bmc.py`` ``read_bmc_verdicts``).

``unavailable`` is never a pass: a BMC that does not answer, answers garbage or hangs
gives every GPU ``unavailable``, and a GPU whose metrics could not all be read is
``unavailable`` unless what was read already fails or degrades it.

Temperatures carry the thresholds they are judged by and where each came from
(:class:`TemperatureThreshold`): ``bmc`` where the sensor itself carries one, ``nvidia_limit``
where it carries none and NVIDIA's own limit for the GPU stands in (``operator/bmc.py``
``NVIDIA_LIMITS`` says which). A real HGX H100 BMC puts no threshold on the GPU temperature and
only ``UpperCritical`` 95 on the HBM temperature (fixtures/redfish/dgx-h100-viking).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.types import PciAddress

BmcStatus = Literal["ok", "degraded", "failed", "unavailable"]
ThresholdSource = Literal["bmc", "nvidia_limit"]
# Worst first when several reasons apply; unavailable ranks below degraded: what was read and is bad wins.
STATUS_RANK: dict[str, int] = {"ok": 0, "unavailable": 1, "degraded": 2, "failed": 3}


class TemperatureThreshold(WireModel):
    """One limit a temperature is judged by: its value, who set it and its name there."""

    reading_c: float
    source: ThresholdSource  # bmc: the sensor's own Thresholds; nvidia_limit: NVIDIA's limit for the GPU
    name: str = Field(max_length=64)  # UpperCritical (bmc) or the NVML threshold it stands for (nvidia_limit)


class TemperatureReading(WireModel):
    """A temperature sensor's reading with its caution (``degraded``) and critical (``failed``) thresholds."""

    reading_c: float | None = None  # None: the sensor gave no reading
    caution: TemperatureThreshold | None = None
    critical: TemperatureThreshold | None = None
    sensor: str | None = Field(default=None, max_length=512)  # the sensor's Redfish URI, as the BMC linked it


class NvLinkTelemetry(WireModel):
    """A GPU's NVLink ports as the BMC reported them (``Processors/<gpu>/Ports``, each port and its ``Metrics``).

    Ports are counted by ``LinkStatus`` (``LinkUp`` is up) as the real HGX BMC carries it, next to
    ``LinkState`` (``Enabled``). The counters are the sums over the ports of ``Oem.Nvidia.NVLinkErrors``,
    each named after the document's own key (``DataCRCCount`` -> ``data_crc_count``); the two booleans
    there (``RuntimeError``, ``TrainingError``) are counted as the ports that report ``true``. A counter is
    ``None`` when no port's Metrics carried it. Evidence only: no health verdict is drawn from NVLink.
    """

    ports: int = Field(ge=0)  # members of the Ports collection
    ports_up: int = Field(ge=0)  # LinkStatus LinkUp
    ports_down: tuple[str, ...] = Field(default=(), max_length=64)  # port ids with a LinkStatus other than LinkUp
    ports_disabled: int = Field(default=0, ge=0)  # LinkState other than Enabled (an administratively off link)
    metrics_read: int = Field(ge=0)  # ports whose Metrics were read (the counters sum over these)
    data_crc_count: int | None = None  # NVLinkErrors.DataCRCCount
    flit_crc_count: int | None = None  # NVLinkErrors.FlitCRCCount
    recovery_count: int | None = None  # NVLinkErrors.RecoveryCount
    replay_count: int | None = None  # NVLinkErrors.ReplayCount
    runtime_error_ports: int | None = None  # ports with NVLinkErrors.RuntimeError true
    training_error_ports: int | None = None  # ports with NVLinkErrors.TrainingError true
    read_by: Literal["expand", "per_port"]  # one $expand=.($levels=2) GET, or a GET per port and per Metrics


class GpuTelemetry(WireModel):
    """One GPU as the BMC reported it (``None``: the BMC did not say; ``unread``: a resource it could not serve).

    What the slice telemetry reads per GPU, keyed by ``gpu_id`` (and ``sxm_slot``, the board's
    label); the verdict carries the host PCI address the config maps it to.
    """

    gpu_id: str = Field(max_length=64)  # the BMC's processor id, e.g. GPU_SXM_1
    sxm_slot: str | None = Field(default=None, max_length=64)  # Location.PartLocation.ServiceLabel, e.g. SXM1
    serial_number: str | None = None
    uuid: str | None = None
    state: str | None = None  # Redfish Status.State (Enabled, Absent, UnavailableOffline...)
    health: str | None = None  # Redfish Status.Health (OK, Warning, Critical)
    temperature: TemperatureReading | None = None  # the GPU die (HGX_GPU_SXM_n_TEMP_0 on HGX)
    memory_temperature: TemperatureReading | None = None  # the HBM (HGX_GPU_SXM_n_DRAM_0_Temp_0 on HGX)
    power_w: float | None = None
    power_limit_w: float | None = None
    sram_ecc_correctable: int | None = None
    sram_ecc_uncorrectable: int | None = None
    dram_ecc_correctable: int | None = None
    dram_ecc_uncorrectable: int | None = None
    row_remap_correctable: int | None = None
    row_remap_uncorrectable: int | None = None
    row_remapping_failed: bool | None = None
    row_remapping_pending: bool | None = None
    pcie_correctable: int | None = None
    pcie_nonfatal: int | None = None
    pcie_fatal: int | None = None
    # None: the BMC does not say (no field, or ["NA"]: "not available", never a throttle); (): not throttled.
    throttle_reasons: tuple[str, ...] | None = None
    # None: not read, ``nvlink_unread`` says why (never zeros); NVLink is telemetry, not health: its reasons
    # stay out of ``unread``, which makes a GPU unavailable.
    nvlink: NvLinkTelemetry | None = None
    nvlink_unread: str | None = Field(default=None, max_length=512)
    unread: tuple[str, ...] = ()  # "<uri>: <why>" for each resource that could not be read


class NvSwitchTelemetry(WireModel):
    """One NVSwitch as the BMC reported it."""

    switch_id: str = Field(max_length=64)  # e.g. NVSwitch_0
    state: str | None = None
    health: str | None = None
    temperature: TemperatureReading | None = None
    ecc_uncorrectable: int | None = None
    pcie_fatal: int | None = None
    pcie_nonfatal: int | None = None
    unread: tuple[str, ...] = ()


class GpuBmcVerdict(WireModel):
    """The agent's verdict on one GPU from the BMC, with the reasons and the reading that prove it."""

    gpu_id: str = Field(max_length=64)
    pci_address: PciAddress | None = None  # the host function, where the config maps the BMC id to it
    status: BmcStatus
    reasons: tuple[str, ...] = ()
    telemetry: GpuTelemetry | None = None  # None: nothing could be read (the BMC did not answer)


class NvSwitchBmcVerdict(WireModel):
    switch_id: str = Field(max_length=64)
    status: BmcStatus
    reasons: tuple[str, ...] = ()
    telemetry: NvSwitchTelemetry | None = None


class BmcReading(WireModel):
    """One read of the baseboard: every expected GPU and NVSwitch judged, or why none could be."""

    bmc_url: str
    read_at: datetime
    error: str | None = None  # set when the BMC could not be read at all (every verdict is then unavailable)
    gpus: tuple[GpuBmcVerdict, ...] = ()
    nvswitches: tuple[NvSwitchBmcVerdict, ...] = ()

    def sensors_by_pci_address(self) -> dict[str, GpuTelemetry]:
        """Each read GPU's sensors under the host PCI address the config maps it to (what a slot names)."""
        return {v.pci_address: v.telemetry for v in self.gpus if v.pci_address is not None and v.telemetry is not None}
