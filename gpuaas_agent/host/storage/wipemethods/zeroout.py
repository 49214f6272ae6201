"""``zeroout``: the device writes zeroes (``blkdiscard --zeroout``), or the agent writes zero buffers where it refuses.

Either way every LBA is written zero: the proof's guarantee is ``write_zeroes`` and a sampled
read-back (with the signature probes) checks it (``blockwipe.prove_cleared``).
"""

from __future__ import annotations

from typing import Final

from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import DiskEvidence
from gpuaas_agent.host.storage.blockwipe import zero_out
from gpuaas_agent.host.storage.wipemethods import blocks
from gpuaas_agent.host.storage.wipemethods.base import Erased, WipeCheck, WipeTarget

METHOD: Final = WipeMethod.zeroout
prove = blocks.prove


async def check(policy: WipePolicy, target: WipeTarget) -> WipeCheck:
    """Nothing to ask the device: where it refuses Write Zeroes the agent writes the zeroes itself."""
    return WipeCheck(zeros_guaranteed=True, evidence={
        "policy": policy.method.value, "zeros_guaranteed": True, "guarantee": "write zeroes"})


async def wipe(policy: WipePolicy, target: WipeTarget, disk: DiskEvidence, *, zeros_guaranteed: bool) -> Erased:
    return await blocks.wipe_blocks(target, disk, zero_out, timeout_s=policy.timeout_s, signatures_timeout_s=600)
