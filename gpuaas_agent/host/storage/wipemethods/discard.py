"""``discard`` (opt-in): blkdiscard (Write Zeroes where the device does not discard), then every byte read back.

A discard is a hint a device may honour in part, so its proof reads the whole device
(``blockwipe.prove_cleared``); data found there is zeroed and read again.
"""

from __future__ import annotations

from typing import Final

from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import DiskEvidence, WipeProof
from gpuaas_agent.host.storage.blockwipe import clear_blocks, clear_signatures, kernel_node, prove_cleared
from gpuaas_agent.host.storage.wipemethods.base import Erased, WipeCheck, WipeTarget

METHOD: Final = WipeMethod.discard


async def check(policy: WipePolicy, target: WipeTarget) -> WipeCheck:
    """Nothing to ask the device: any block device takes a discard (or Write Zeroes); no zeroes promised."""
    return WipeCheck(zeros_guaranteed=False, evidence={
        "policy": policy.method.value, "zeros_guaranteed": False, "guarantee": "whole device read after the discard"})


async def wipe(policy: WipePolicy, target: WipeTarget, disk: DiskEvidence, *, zeros_guaranteed: bool) -> Erased:
    dev = kernel_node(target.host, disk)
    method = await clear_blocks(target.host, disk, dev, timeout=policy.timeout_s, runner=target.runner)
    await clear_signatures(target.runner, dev, disk, timeout=policy.timeout_s)
    return Erased(disk=disk, dev=dev, method=method)


async def prove(policy: WipePolicy, target: WipeTarget, erased: Erased, *, samples: int,
                seed: int | None) -> WipeProof:
    return await prove_cleared(target.host, erased.disk, erased.dev, method=erased.method, samples=samples,
                               seed=seed, started=target.started, timeout=policy.timeout_s, runner=target.runner)
