"""``zeroout``: the device writes zeroes (``blkdiscard --zeroout``), or the agent writes zero buffers where it refuses.

Either way every LBA is written zero: the proof's guarantee is ``write_zeroes`` and a sampled
read-back (with the signature probes) checks it (``blockwipe.prove_cleared``).
"""

from __future__ import annotations

from typing import Final

from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import DiskEvidence, WipeProof
from gpuaas_agent.host.storage.blockwipe import clear_signatures, kernel_node, prove_cleared, zero_out
from gpuaas_agent.host.storage.wipemethods.base import Erased, WipeCheck, WipeTarget

METHOD: Final = WipeMethod.zeroout


async def check(policy: WipePolicy, target: WipeTarget) -> WipeCheck:
    """Nothing to ask the device: where it refuses Write Zeroes the agent writes the zeroes itself."""
    return WipeCheck(zeros_guaranteed=True, evidence={
        "policy": policy.method.value, "zeros_guaranteed": True, "guarantee": "write zeroes"})


async def wipe(policy: WipePolicy, target: WipeTarget, disk: DiskEvidence, *, zeros_guaranteed: bool) -> Erased:
    dev = kernel_node(target.host, disk)
    method = await zero_out(target.host, disk, dev, timeout=policy.timeout_s, runner=target.runner)
    await clear_signatures(target.runner, dev, disk, timeout=600)
    return Erased(disk=disk, dev=dev, method=method)


async def prove(policy: WipePolicy, target: WipeTarget, erased: Erased, *, samples: int,
                seed: int | None) -> WipeProof:
    return await prove_cleared(target.host, erased.disk, erased.dev, method=erased.method, samples=samples,
                               seed=seed, started=target.started, timeout=policy.timeout_s, runner=target.runner)
