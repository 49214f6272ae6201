#!/usr/bin/env python3
"""Write a Redfish mockup of an NVIDIA HGX H100/H200 8-GPU baseboard, as its HMC (the baseboard's BMC) serves it.

No HGX BMC is reachable from CI, so tests serve this tree with a real Redfish server
process (sushy-tools' ``sushy-static``, the DMTF mockup layout: ``<path>/index.json``
per URI) and the agent's Redfish client reads it over HTTPS like a real BMC.

What the shape is based on (public sources, read for facts, nothing copied):

* NVIDIA's OpenBMC fork (``NVIDIA/bmcweb``, ``redfish-core/lib/metric_report*``): the
  platform metric URIs of the HGX baseboard, ``/redfish/v1/Systems/HGX_Baseboard_0/
  Processors/GPU_SXM_<n>/ProcessorMetrics`` (``CacheMetricsTotal.LifeTime.*ECCErrorCount``,
  ``PCIeErrors.{Correctable,NonFatal,Fatal}ErrorCount``, ``Oem.Nvidia.ThrottleReasons``),
  ``/Memory/GPU_SXM_<n>_DRAM_0`` (``Oem.Nvidia.RowRemappingFailed``/``RowRemappingPending``)
  and its ``MemoryMetrics`` (``LifeTime.*ECCErrorCount``, ``Oem.Nvidia.RowRemapping.
  {Correctable,Uncorrectable}RowRemappingCount``), ``/redfish/v1/Fabrics/HGX_NVLinkFabric_0/
  Switches/NVSwitch_<n>/SwitchMetrics`` (``InternalMemoryMetrics.LifeTime``, ``PCIeErrors``);
* NVIDIA nsmd/entity-manager configurations and public HMC examples: chassis
  ``HGX_GPU_SXM_<n>`` with sensors ``HGX_GPU_SXM_<n>_TEMP_0`` / ``HGX_GPU_SXM_<n>_Power_0``,
  ``HGX_NVSwitch_<n>`` with ``HGX_NVSwitch_<n>_TEMP_0``;
* checked against a real capture (fixtures/redfish/dgx-h100-viking, PROVENANCE.md there) and
  brought in line with it: the GPU temperature carries no threshold, the HBM temperature
  ``HGX_GPU_SXM_<n>_DRAM_0_Temp_0`` carries ``UpperCritical`` 95, the GPU's power is in its
  ``EnvironmentMetrics``, the board label in ``Location.PartLocation.ServiceLabel``. The capture
  itself is what the verdict tests run on; this mockup is for hostile variants and the lab;
* the DGX H100/H200 user guide ("Redfish APIs Support"): basic authentication, DSP0266
  1.7 / schema 2019.1 and later; DMTF schemas ``Sensor.v1_x`` (``Reading``,
  ``Thresholds.UpperCaution/UpperCritical``), ``Processor``, ``Memory``, ``Switch``.

GPUs are numbered 1..8 (``GPU_SXM_1``), NVSwitches 0..3 as on HGX H100/H200. Stdlib only;
:func:`write_mockup` takes overrides so tests make hostile variants (a failed row remap, a
hot GPU, a malformed document) from the healthy baseline.

    python lab/hgx_redfish_mockup.py OUT_DIR     # a healthy baseboard
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEM = "HGX_Baseboard_0"
FABRIC = "HGX_NVLinkFabric_0"
GPU_COUNT = 8
NVSWITCH_COUNT = 4
ROOT = "/redfish/v1"

Doc = dict[str, Any]


def _ref(path: str) -> Doc:
    return {"@odata.id": path}


def _collection(path: str, odata_type: str, name: str, members: list[str]) -> Doc:
    return {"@odata.id": path, "@odata.type": odata_type, "Name": name,
            "Members": [_ref(m) for m in members], "Members@odata.count": len(members)}


def _ok() -> Doc:
    return {"State": "Enabled", "Health": "OK", "HealthRollup": "OK"}


def _sensor(chassis: str, sensor_id: str, reading: float, units: str, reading_type: str,
            caution: float | None = None, critical: float | None = None) -> Doc:
    doc: Doc = {"@odata.id": f"{ROOT}/Chassis/{chassis}/Sensors/{sensor_id}", "@odata.type": "#Sensor.v1_7_0.Sensor",
                "Id": sensor_id, "Name": sensor_id.replace("_", " "), "Reading": reading, "ReadingUnits": units,
                "ReadingType": reading_type, "Status": _ok()}
    thresholds: Doc = {}
    if caution is not None:
        thresholds["UpperCaution"] = {"Reading": caution}
    if critical is not None:
        thresholds["UpperCritical"] = {"Reading": critical}
    if thresholds:
        doc["Thresholds"] = thresholds
    return doc


def baseboard(gpu_count: int = GPU_COUNT, nvswitch_count: int = NVSWITCH_COUNT) -> dict[str, Doc]:
    """URI -> JSON document of a healthy HGX 8-GPU baseboard."""
    docs: dict[str, Doc] = {}
    gpus = [f"GPU_SXM_{n}" for n in range(1, gpu_count + 1)]
    switches = [f"NVSwitch_{n}" for n in range(nvswitch_count)]
    chassis = [f"HGX_GPU_SXM_{n}" for n in range(1, gpu_count + 1)] + [f"HGX_{s}" for s in switches]
    docs[ROOT] = {
        "@odata.id": ROOT, "@odata.type": "#ServiceRoot.v1_15_0.ServiceRoot", "Id": "RootService",
        "Name": "Root Service", "RedfishVersion": "1.17.0", "UUID": "1d8c7f2e-0000-4000-8000-48475842d000",
        "Vendor": "NVIDIA", "Product": "HGX H100 8-GPU",
        "Systems": _ref(f"{ROOT}/Systems"), "Chassis": _ref(f"{ROOT}/Chassis"), "Fabrics": _ref(f"{ROOT}/Fabrics"),
        "Managers": _ref(f"{ROOT}/Managers"), "Links": {"Sessions": _ref(f"{ROOT}/SessionService/Sessions")},
    }
    docs[f"{ROOT}/Systems"] = _collection(f"{ROOT}/Systems", "#ComputerSystemCollection.ComputerSystemCollection",
                                          "Computer System Collection", [f"{ROOT}/Systems/{SYSTEM}"])
    system = f"{ROOT}/Systems/{SYSTEM}"
    docs[system] = {"@odata.id": system, "@odata.type": "#ComputerSystem.v1_17_0.ComputerSystem", "Id": SYSTEM,
                    "Name": SYSTEM, "SystemType": "Physical", "Status": _ok(),
                    "Processors": _ref(f"{system}/Processors"), "Memory": _ref(f"{system}/Memory")}
    docs[f"{system}/Processors"] = _collection(f"{system}/Processors", "#ProcessorCollection.ProcessorCollection",
                                               "Processors Collection", [f"{system}/Processors/{g}" for g in gpus])
    docs[f"{system}/Memory"] = _collection(f"{system}/Memory", "#MemoryCollection.MemoryCollection",
                                           "Memory Collection", [f"{system}/Memory/{g}_DRAM_0" for g in gpus])
    for n, gpu in enumerate(gpus, start=1):
        proc = f"{system}/Processors/{gpu}"
        mem = f"{system}/Memory/{gpu}_DRAM_0"
        docs[proc] = {
            "@odata.id": proc, "@odata.type": "#Processor.v1_18_0.Processor", "Id": gpu, "Name": f"GPU SXM {n}",
            "ProcessorType": "GPU", "Manufacturer": "NVIDIA", "Model": "NVIDIA H100 80GB HBM3",
            "SerialNumber": f"1654123{n:06d}", "UUID": f"5d3b0b9e-7c1e-4c6a-9f2e-0000000000{n:02d}",
            "Status": _ok(), "Metrics": _ref(f"{proc}/ProcessorMetrics"),
            "EnvironmentMetrics": _ref(f"{proc}/EnvironmentMetrics"),
            "Location": {"PartLocation": {"LocationType": "Embedded", "ServiceLabel": f"SXM{n}"}},
            "Links": {"Memory": [_ref(mem)], "Chassis": _ref(f"{ROOT}/Chassis/HGX_GPU_SXM_{n}")},
            "SystemInterface": {"InterfaceType": "PCIe", "PCIe": {"PCIeType": "Gen5", "MaxLanes": 16}},
        }
        docs[f"{proc}/ProcessorMetrics"] = {
            "@odata.id": f"{proc}/ProcessorMetrics", "@odata.type": "#ProcessorMetrics.v1_6_1.ProcessorMetrics",
            "Id": "ProcessorMetrics", "Name": f"GPU SXM {n} Processor Metrics", "OperatingSpeedMHz": 1980,
            "BandwidthPercent": 0,
            "CacheMetricsTotal": {"LifeTime": {"CorrectableECCErrorCount": 0, "UncorrectableECCErrorCount": 0}},
            "PCIeErrors": {"CorrectableErrorCount": 0, "NonFatalErrorCount": 0, "FatalErrorCount": 0,
                           "L0ToRecoveryCount": 0, "ReplayCount": 0, "ReplayRolloverCount": 0,
                           "NAKSentCount": 0, "NAKReceivedCount": 0},
            "Oem": {"Nvidia": {"@odata.type": "#NvidiaProcessorMetrics.v1_0_0.NvidiaGPUProcessorMetrics",
                               "ThrottleReasons": ["None"]}},
        }
        docs[f"{proc}/EnvironmentMetrics"] = {
            "@odata.id": f"{proc}/EnvironmentMetrics", "@odata.type": "#EnvironmentMetrics.v1_3_0.EnvironmentMetrics",
            "Id": "Environment Metrics", "Name": f"GPU_SXM_{n} Environment Metrics",
            "PowerWatts": {"DataSourceUri": f"{ROOT}/Chassis/HGX_GPU_SXM_{n}/Sensors/HGX_GPU_SXM_{n}_Power_0",
                           "Reading": 71.5},
            "PowerLimitWatts": {"AllowableMax": 700, "AllowableMin": 200, "SetPoint": 700},
        }
        docs[mem] = {
            "@odata.id": mem, "@odata.type": "#Memory.v1_17_0.Memory", "Id": f"{gpu}_DRAM_0",
            "Name": f"GPU SXM {n} DRAM 0", "MemoryDeviceType": "HBM3", "CapacityMiB": 81559, "Status": _ok(),
            "Metrics": _ref(f"{mem}/MemoryMetrics"),
            "Oem": {"Nvidia": {"@odata.type": "#NvidiaMemory.v1_0_0.NvidiaMemory",
                               "RowRemappingFailed": False, "RowRemappingPending": False}},
        }
        docs[f"{mem}/MemoryMetrics"] = {
            "@odata.id": f"{mem}/MemoryMetrics", "@odata.type": "#MemoryMetrics.v1_7_0.MemoryMetrics",
            "Id": "MemoryMetrics", "Name": f"GPU SXM {n} DRAM 0 Memory Metrics", "BandwidthPercent": 0,
            "LifeTime": {"CorrectableECCErrorCount": 0, "UncorrectableECCErrorCount": 0},
            "Oem": {"Nvidia": {"@odata.type": "#NvidiaMemoryMetrics.v1_0_0.NvidiaGPUMemoryMetrics",
                               "RowRemapping": {"CorrectableRowRemappingCount": 0,
                                                "UncorrectableRowRemappingCount": 0}}},
        }
    docs[f"{ROOT}/Chassis"] = _collection(f"{ROOT}/Chassis", "#ChassisCollection.ChassisCollection",
                                          "Chassis Collection", [f"{ROOT}/Chassis/{c}" for c in chassis])
    for name in chassis:
        path = f"{ROOT}/Chassis/{name}"
        sensors = [f"{name}_TEMP_0"] + ([f"{name}_DRAM_0_Temp_0", f"{name}_Power_0"] if "GPU" in name else [])
        docs[path] = {"@odata.id": path, "@odata.type": "#Chassis.v1_21_0.Chassis", "Id": name, "Name": name,
                      "ChassisType": "Component", "Status": _ok(), "Sensors": _ref(f"{path}/Sensors")}
        docs[f"{path}/Sensors"] = _collection(f"{path}/Sensors", "#SensorCollection.SensorCollection",
                                              f"{name} Sensors", [f"{path}/Sensors/{s}" for s in sensors])
        if "GPU" in name:
            docs[f"{path}/Sensors/{name}_TEMP_0"] = _sensor(name, f"{name}_TEMP_0", 34.0, "Cel", "Temperature")
            docs[f"{path}/Sensors/{name}_DRAM_0_Temp_0"] = _sensor(name, f"{name}_DRAM_0_Temp_0", 40.0, "Cel",
                                                                  "Temperature", critical=95.0)
            docs[f"{path}/Sensors/{name}_Power_0"] = _sensor(name, f"{name}_Power_0", 71.5, "W", "Power")
        else:
            docs[f"{path}/Sensors/{name}_TEMP_0"] = _sensor(name, f"{name}_TEMP_0", 41.0, "Cel", "Temperature",
                                                           critical=102.0)
    docs[f"{ROOT}/Fabrics"] = _collection(f"{ROOT}/Fabrics", "#FabricCollection.FabricCollection",
                                          "Fabric Collection", [f"{ROOT}/Fabrics/{FABRIC}"])
    fabric = f"{ROOT}/Fabrics/{FABRIC}"
    docs[fabric] = {"@odata.id": fabric, "@odata.type": "#Fabric.v1_2_0.Fabric", "Id": FABRIC, "Name": FABRIC,
                    "FabricType": "NVLink", "Status": _ok(), "Switches": _ref(f"{fabric}/Switches")}
    docs[f"{fabric}/Switches"] = _collection(f"{fabric}/Switches", "#SwitchCollection.SwitchCollection",
                                             "Switch Collection", [f"{fabric}/Switches/{s}" for s in switches])
    for switch in switches:
        path = f"{fabric}/Switches/{switch}"
        docs[path] = {"@odata.id": path, "@odata.type": "#Switch.v1_8_0.Switch", "Id": switch, "Name": switch,
                      "SwitchType": "NVLink", "Manufacturer": "NVIDIA", "Status": _ok(),
                      "Metrics": _ref(f"{path}/SwitchMetrics"),
                      "Links": {"Chassis": _ref(f"{ROOT}/Chassis/HGX_{switch}")}}
        docs[f"{path}/SwitchMetrics"] = {
            "@odata.id": f"{path}/SwitchMetrics", "@odata.type": "#SwitchMetrics.v1_0_0.SwitchMetrics",
            "Id": "SwitchMetrics", "Name": f"{switch} Metrics",
            "InternalMemoryMetrics": {"LifeTime": {"CorrectableECCErrorCount": 0, "UncorrectableECCErrorCount": 0}},
            "PCIeErrors": {"CorrectableErrorCount": 0, "NonFatalErrorCount": 0, "FatalErrorCount": 0},
        }
    return docs


def set_field(docs: dict[str, Doc], uri: str, dotted: str, value: Any) -> None:
    """Set ``A.B.C`` of the document at ``uri`` (a hostile or degraded reading for one test)."""
    node = docs[uri]
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def write_mockup(out: Path, docs: dict[str, Doc] | None = None,
                 raw: dict[str, str] | None = None, edit: Callable[[dict[str, Doc]], None] | None = None) -> Path:
    """Write ``docs`` (default: :func:`baseboard`) as a mockup tree under ``out``; ``raw`` URIs get text as is.

    The tree is what ``sushy-static -m OUT`` serves: ``OUT/<path below /redfish/v1>/index.json``.
    """
    docs = baseboard() if docs is None else docs
    if edit is not None:
        edit(docs)
    for uri, doc in docs.items():
        _write(out, uri, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    for uri, text in (raw or {}).items():
        _write(out, uri, text)
    return out


def _write(out: Path, uri: str, text: str) -> None:
    assert uri == ROOT or uri.startswith(ROOT + "/"), uri
    path = out / uri[len(ROOT):].lstrip("/") / "index.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: hgx_redfish_mockup.py OUT_DIR")
    print(write_mockup(Path(sys.argv[1])))
