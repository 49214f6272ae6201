"""NVIDIA Fabric Manager's partitions through ``fmpm`` (NVIDIA/Fabric-Manager-Client): list, activate, deactivate.

``fmpm`` is NVIDIA's partition-manager client of the FM API: ``-l`` prints the supported
partitions as JSON (jsoncpp's StyledWriter: ``partitionInfo[].{partitionId, isActive,
numGpus, gpuInfo[].{physicalId, uuid, pciBusId, numNvLinksAvailable, maxNumNvLinks,
nvlinkLineRateMBps}}``); ``-a N`` / ``-d N`` print nothing on success and
``Failed to activate partition. fmReturn: -N`` otherwise; a failure's exit status is the
negative ``fmReturn_t`` (exit 255 is FM_ST_BADPARAM, 247 FM_ST_CONNECTION_NOT_VALID: FM is
not running); ``--set-activated-list 1,3`` tells a restarted FM (resiliency mode,
``FABRIC_MODE_RESTART=1``) which partitions were active.

Every call is an argv through ``host/run.py`` with a timeout. What FM answers is read back
rather than trusted: an activation is verified by a fresh ``-l`` (FM has it active), and so is
a restore after an FM restart (fmpm 1.0.1's ``--set-activated-list`` counts its list with
``*numPartitions++``, which sends FM an empty list: only the read-back shows it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuaas_agent.contract.fabric import FabricGpu, FabricPartition, FabricPartitionList
from gpuaas_agent.errors import HostError
from gpuaas_agent.host.run import Completed, run

# fmReturn_t of NVIDIA's nv_fm_types.h, by value.
FM_RETURN = {0: "FM_ST_SUCCESS", -1: "FM_ST_BADPARAM", -2: "FM_ST_GENERIC_ERROR", -3: "FM_ST_NOT_SUPPORTED",
             -4: "FM_ST_UNINITIALIZED", -5: "FM_ST_TIMEOUT", -6: "FM_ST_VERSION_MISMATCH", -7: "FM_ST_IN_USE",
             -8: "FM_ST_NOT_CONFIGURED", -9: "FM_ST_CONNECTION_NOT_VALID", -10: "FM_ST_NVLINK_ERROR"}
# Return codes that mean "no Fabric Manager to talk to", not "FM refused this".
_FM_ABSENT = {-4, -9}
_PCI_BUS_ID = re.compile(r"^(?:[0-9a-fA-F]{4})?([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_FM_RETURN_LINE = re.compile(r"fmReturn:\s*(-?\d+)")

Runner = Callable[..., Awaitable[Completed]]


class FabricManagerError(HostError):
    default_code = "fm_failed"


def pci_address(pci_bus_id: str) -> str:
    """FM's ``00000000:18:00.0`` (NVML's 8-digit domain) as the kernel's ``0000:18:00.0``."""
    m = _PCI_BUS_ID.match(pci_bus_id.strip())
    if m is None:
        raise ValueError(f"{pci_bus_id!r} is not a PCI bus id")
    domain, bus, dev, fn = m.groups()
    return f"{domain.lower()}:{bus.lower()}:{dev.lower()}.{fn}"


def _fm_return(returncode: int, stdout: str) -> int:
    m = _FM_RETURN_LINE.search(stdout)
    if m is not None:
        return int(m.group(1))
    return returncode - 256 if returncode > 127 else -returncode


def parse_partition_list(text: str) -> FabricPartitionList:
    """``fmpm -l``'s JSON into values; ``fm_output_invalid`` for anything else (a half-written list included)."""
    try:
        doc: Any = json.loads(text)
        partitions = []
        for info in doc["partitionInfo"]:
            gpus = tuple(FabricGpu(physical_id=int(g["physicalId"]), uuid=str(g["uuid"]),
                                   pci_address=pci_address(str(g["pciBusId"])),
                                   nvlinks_available=int(g["numNvLinksAvailable"]),
                                   nvlinks_max=int(g["maxNumNvLinks"]),
                                   nvlink_line_rate_mbps=int(g["nvlinkLineRateMBps"])) for g in info["gpuInfo"])
            if len(gpus) != int(info["numGpus"]):
                raise ValueError(f"partition {info['partitionId']} says numGpus {info['numGpus']}, lists {len(gpus)}")
            partitions.append(FabricPartition(partition_id=int(info["partitionId"]), active=bool(info["isActive"]),
                                              gpus=gpus))
        if len(partitions) != int(doc["numPartitions"]):
            raise ValueError(f"numPartitions {doc['numPartitions']}, {len(partitions)} listed")
        return FabricPartitionList(max_partitions=int(doc["maxNumPartitions"]), partitions=tuple(partitions))
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError and pydantic's ValidationError are ValueErrors
        raise FabricManagerError(f"fmpm -l printed something that is not a partition list: {exc}",
                                 code="fm_output_invalid",
                                 evidence={"stdout": text[-2000:], "error": str(exc)[:500]}) from None


@dataclass(frozen=True)
class FabricManager:
    """The host's Fabric Manager, reached with ``fmpm`` over TCP (``--hostname`` when set, else fmpm's 127.0.0.1).

    No ``--unix-domain-socket``: fmpm parses it and connects over TCP to the hostname anyway
    (config.py ``FabricManagerConfig`` says where in fmpm.cpp).
    """

    fmpm: str = "fmpm"
    timeout_s: float = 30.0
    hostname: str | None = None
    runner: Runner = run

    def _argv(self, *args: str) -> list[str]:
        argv = [self.fmpm, *args]
        if self.hostname is not None:
            argv += ["--hostname", self.hostname]
        return argv

    async def _call(self, what: str, args: Sequence[str]) -> str:
        argv = self._argv(*args)
        try:
            done = await self.runner(argv, timeout=self.timeout_s, check=False)
        except HostError as exc:  # not installed, or killed at the deadline: no answer from FM
            raise FabricManagerError(f"Fabric Manager did not answer {what}: {exc.message}", code="fm_unavailable",
                                     evidence={"argv": argv, "cause": exc.code}) from None
        stdout = done.stdout.decode("utf-8", "replace")
        if done.returncode == 0:
            return stdout
        fm_return = _fm_return(done.returncode, stdout)
        name = FM_RETURN.get(fm_return, f"fmReturn {fm_return}")
        evidence = {"argv": argv, "returncode": done.returncode, "fm_return": name, "stdout": stdout[-2000:],
                    "stderr": done.stderr.decode("utf-8", "replace")[-2000:]}
        if fm_return in _FM_ABSENT or "Failed to connect to Fabric Manager" in stdout:
            raise FabricManagerError(f"Fabric Manager is not running or not reachable ({name}) for {what}",
                                     code="fm_unavailable", evidence=evidence)
        raise FabricManagerError(f"Fabric Manager refused {what}: {name}", code="fm_refused", evidence=evidence)

    async def partitions(self) -> FabricPartitionList:
        return parse_partition_list(await self._call("the partition list", ["-l"]))

    async def activate(self, partition_id: int) -> FabricPartition:
        """Activate, then read back: FM must list the partition active (``fm_activation_unverified`` if not)."""
        await self._call(f"activating partition {partition_id}", ["-a", str(partition_id)])
        return await self._expect(partition_id, active=True, code="fm_activation_unverified")

    async def deactivate(self, partition_id: int) -> FabricPartition:
        await self._call(f"deactivating partition {partition_id}", ["-d", str(partition_id)])
        return await self._expect(partition_id, active=False, code="fm_deactivation_unverified")

    async def set_activated(self, partition_ids: Sequence[int]) -> FabricPartitionList:
        """After an FM restart: tell FM which partitions are active, then read back that each one is."""
        ids = sorted(set(partition_ids))
        await self._call(f"restoring active partitions {ids}", ["--set-activated-list", ",".join(map(str, ids))])
        listed = await self.partitions()
        missing = [i for i in ids if (p := listed.by_id(i)) is None or not p.active]
        if missing:
            raise FabricManagerError(
                f"after --set-activated-list {ids} Fabric Manager lists partitions {missing} inactive",
                code="fm_restore_unverified", evidence={"requested": ids, "inactive": missing})
        return listed

    async def _expect(self, partition_id: int, *, active: bool, code: str) -> FabricPartition:
        listed = await self.partitions()
        partition = listed.by_id(partition_id)
        if partition is None or partition.active is not active:
            state = "absent" if partition is None else ("active" if partition.active else "inactive")
            raise FabricManagerError(
                f"fmpm reported success but Fabric Manager lists partition {partition_id} {state}",
                code=code, evidence={"partition_id": partition_id, "listed": state})
        return partition
