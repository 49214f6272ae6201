#!/usr/bin/env python3
"""Read-only NVML sensor probe: everything a per-slice GPU telemetry reader would want, and what this board answers.

Only nvmlDeviceGet*/nvmlSystemGet* calls: nothing is set, reset or cleared.
"""
import json, sys, datetime
import pynvml as n

def ask(fn, *a):
    try:
        v = fn(*a)
        if isinstance(v, bytes):
            v = v.decode()
        return {"ok": v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v)}
    except n.NVMLError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa
        return {"exception": f"{type(e).__name__}: {e}"}

def const(name):
    return getattr(n, name, None)

n.nvmlInit()
out = {"recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
       "driver": ask(n.nvmlSystemGetDriverVersion), "nvml": ask(n.nvmlSystemGetNVMLVersion),
       "cuda_driver": ask(n.nvmlSystemGetCudaDriverVersion_v2) if hasattr(n, "nvmlSystemGetCudaDriverVersion_v2") else None,
       "pynvml_module": getattr(n, "__file__", None), "gpus": []}
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    g = {"index": i, "name": ask(n.nvmlDeviceGetName, h), "uuid": ask(n.nvmlDeviceGetUUID, h),
         "serial": ask(n.nvmlDeviceGetSerial, h), "vbios": ask(n.nvmlDeviceGetVbiosVersion, h),
         "board_part": ask(n.nvmlDeviceGetBoardPartNumber, h),
         "pci_bus_id": ask(lambda x: n.nvmlDeviceGetPciInfo(x).busId, h),
         "pci_device_id": ask(lambda x: hex(n.nvmlDeviceGetPciInfo(x).pciDeviceId), h),
         "temperature_gpu_c": ask(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)}
    th = {}
    for name in dir(n):
        if name.startswith("NVML_TEMPERATURE_THRESHOLD_") and name != "NVML_TEMPERATURE_THRESHOLD_COUNT":
            th[name] = ask(n.nvmlDeviceGetTemperatureThreshold, h, getattr(n, name))
    g["temperature_thresholds_c"] = th
    fields = {}
    for fname in ["NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_POWER_INSTANT", "NVML_FI_DEV_POWER_AVERAGE",
                  "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "NVML_FI_DEV_NVLINK_LINK_COUNT",
                  "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
                  "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
                  "NVML_FI_DEV_ECC_CURRENT", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL",
                  "NVML_FI_DEV_ECC_SBE_AGG_TOTAL", "NVML_FI_DEV_ECC_DBE_AGG_TOTAL",
                  "NVML_FI_DEV_PCIE_REPLAY_COUNTER", "NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS",
                  "NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR", "NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR",
                  "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP", "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_SLOWDOWN",
                  "NVML_FI_DEV_PERF_POLICY_THERMAL", "NVML_FI_DEV_PERF_POLICY_POWER",
                  "NVML_FI_DEV_RETIRED_PENDING", "NVML_FI_DEV_REMAPPED_COR", "NVML_FI_DEV_REMAPPED_UNC",
                  "NVML_FI_DEV_TEMPERATURE_GPU_MAX_TLIMIT", "NVML_FI_DEV_TEMPERATURE_MEM_MAX_TLIMIT",
                  "NVML_FI_DEV_TEMPERATURE_SLOWDOWN_TLIMIT", "NVML_FI_DEV_TEMPERATURE_SHUTDOWN_TLIMIT"]:
        fid = const(fname)
        if fid is None:
            fields[fname] = {"error": "not in this pynvml"}
            continue
        try:
            v = n.nvmlDeviceGetFieldValues(h, [fid])[0]
            if v.nvmlReturn != 0:
                fields[fname] = {"error": f"nvmlReturn={v.nvmlReturn}"}
            else:
                vt = v.valueType
                val = [v.value.dVal, v.value.uiVal, v.value.ulVal, v.value.ullVal, v.value.sllVal, v.value.siVal][vt] if vt < 6 else None
                fields[fname] = {"ok": val, "valueType": vt}
        except Exception as e:
            fields[fname] = {"exception": f"{type(e).__name__}: {e}"}
    g["field_values"] = fields
    g["power_usage_mw"] = ask(n.nvmlDeviceGetPowerUsage, h)
    g["power_limit_enforced_mw"] = ask(n.nvmlDeviceGetEnforcedPowerLimit, h)
    g["power_limit_default_mw"] = ask(n.nvmlDeviceGetPowerManagementDefaultLimit, h)
    g["power_limit_constraints_mw"] = ask(lambda x: list(n.nvmlDeviceGetPowerManagementLimitConstraints(x)), h)
    g["energy_mj"] = ask(n.nvmlDeviceGetTotalEnergyConsumption, h)
    reasons_fn = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
    g["clocks_event_reasons_bitmask"] = ask(reasons_fn, h)
    sup_fn = getattr(n, "nvmlDeviceGetSupportedClocksEventReasons", None) or n.nvmlDeviceGetSupportedClocksThrottleReasons
    g["clocks_event_reasons_supported_bitmask"] = ask(sup_fn, h)
    g["clocks_event_reason_names"] = {k: getattr(n, k) for k in dir(n) if k.startswith("nvmlClocksEventReason") or k.startswith("nvmlClocksThrottleReason")}
    g["clock_sm_mhz"] = ask(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM)
    g["clock_mem_mhz"] = ask(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_MEM)
    g["clock_sm_max_mhz"] = ask(n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM)
    g["pstate"] = ask(n.nvmlDeviceGetPerformanceState, h)
    g["utilization"] = ask(lambda x: {"gpu": n.nvmlDeviceGetUtilizationRates(x).gpu, "memory": n.nvmlDeviceGetUtilizationRates(x).memory}, h)
    g["memory"] = ask(lambda x: {"total": n.nvmlDeviceGetMemoryInfo(x).total, "used": n.nvmlDeviceGetMemoryInfo(x).used}, h)
    g["pcie_link"] = ask(lambda x: {"gen": n.nvmlDeviceGetCurrPcieLinkGeneration(x), "width": n.nvmlDeviceGetCurrPcieLinkWidth(x),
                                    "max_gen": n.nvmlDeviceGetMaxPcieLinkGeneration(x), "max_width": n.nvmlDeviceGetMaxPcieLinkWidth(x)}, h)
    g["fan_speed"] = ask(n.nvmlDeviceGetFanSpeed, h)
    g["persistence_mode"] = ask(n.nvmlDeviceGetPersistenceMode, h)
    g["compute_mode"] = ask(n.nvmlDeviceGetComputeMode, h)
    g["mig_mode"] = ask(lambda x: list(n.nvmlDeviceGetMigMode(x)), h)
    g["ecc_mode"] = ask(lambda x: list(n.nvmlDeviceGetEccMode(x)), h)
    g["ecc_volatile_corrected"] = ask(n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC)
    g["ecc_volatile_uncorrected"] = ask(n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)
    g["remapped_rows"] = ask(lambda x: list(n.nvmlDeviceGetRemappedRows(x)), h)
    links = {}
    for l in range(getattr(n, "NVML_NVLINK_MAX_LINKS", 18)):
        r = ask(n.nvmlDeviceGetNvLinkState, h, l)
        if "error" in r and l > 0 and "Not Supported" in r["error"] and "0" in links and "error" in links["0"]:
            break
        links[str(l)] = r
    g["nvlink_state"] = links
    if hasattr(n, "nvmlDeviceGetGpuFabricInfo"):
        g["gpu_fabric_info"] = ask(lambda x: {k: getattr(n.nvmlDeviceGetGpuFabricInfoV(x), k) for k in ("state", "status", "cliqueId", "healthMask")}, h) if hasattr(n, "nvmlDeviceGetGpuFabricInfoV") else None
    vio = {}
    for name in ("NVML_PERF_POLICY_POWER", "NVML_PERF_POLICY_THERMAL", "NVML_PERF_POLICY_SYNC_BOOST", "NVML_PERF_POLICY_BOARD_LIMIT", "NVML_PERF_POLICY_LOW_UTILIZATION", "NVML_PERF_POLICY_RELIABILITY"):
        c = const(name)
        if c is not None:
            vio[name] = ask(lambda x, c=c: {"reference_time": n.nvmlDeviceGetViolationStatus(x, c).referenceTime, "violation_time_ns": n.nvmlDeviceGetViolationStatus(x, c).violationTime}, h)
    g["violation_status"] = vio
    out["gpus"].append(g)
n.nvmlShutdown()
json.dump(out, sys.stdout, indent=1, default=str)
print()
