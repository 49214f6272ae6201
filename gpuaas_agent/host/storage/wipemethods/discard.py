"""``discard`` (opt-in): blkdiscard (Write Zeroes where the device does not discard), then every byte read back.

A discard is a hint a device may honour in part, so its proof reads the whole device
(``blockwipe.prove_cleared``); data found there is zeroed and read again.
"""

from __future__ import annotations

from typing import Final

from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import DiskEvidence
from gpuaas_agent.host.storage.blockwipe import clear_blocks
from gpuaas_agent.host.storage.wipemethods import blocks
from gpuaas_agent.host.storage.wipemethods.base import Erased, WipeCheck, WipeTarget

METHOD: Final = WipeMethod.discard
prove = blocks.prove


async def check(policy: WipePolicy, target: WipeTarget) -> WipeCheck:
    """Nothing to ask the device: any block device takes a discard (or Write Zeroes); no zeroes promised."""
    return WipeCheck(zeros_guaranteed=False, evidence={
        "policy": policy.method.value, "zeros_guaranteed": False, "guarantee": "whole device read after the discard"})


async def wipe(policy: WipePolicy, target: WipeTarget, disk: DiskEvidence, *, zeros_guaranteed: bool) -> Erased:
    return await blocks.wipe_blocks(target, disk, clear_blocks, timeout_s=policy.timeout_s,
                                    signatures_timeout_s=policy.timeout_s)
