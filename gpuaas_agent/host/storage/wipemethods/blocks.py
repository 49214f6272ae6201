"""What the block-level methods (``discard``, ``zeroout``) share: clear the blocks and signatures, read them back.

Each method names how it clears the blocks and how long the signature erase may take
(:func:`wipe_blocks`); the proof is the same for both (:func:`prove`, ``blockwipe.prove_cleared``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import DiskEvidence, WipeProof
from gpuaas_agent.host.storage.blockwipe import clear_signatures, kernel_node, prove_cleared
from gpuaas_agent.host.storage.wipemethods.base import Erased, Runner, WipeTarget
from gpuaas_agent.hostfs import HostRoot


class ClearBlocks(Protocol):
    """``blockwipe.clear_blocks`` or ``blockwipe.zero_out``: clear every block of ``dev``, say how it was done."""

    def __call__(self, host: HostRoot, evidence: DiskEvidence, dev: str, *, timeout: float,
                 runner: Runner) -> Awaitable[WipeMethod]: ...


async def wipe_blocks(target: WipeTarget, disk: DiskEvidence, clear: ClearBlocks, *, timeout_s: float,
                      signatures_timeout_s: float) -> Erased:
    """Clear the guarded disk's blocks with ``clear``, then erase its signatures (``blockwipe.clear_signatures``)."""
    dev = kernel_node(target.host, disk)
    method = await clear(target.host, disk, dev, timeout=timeout_s, runner=target.runner)
    await clear_signatures(target.runner, dev, disk, timeout=signatures_timeout_s)
    return Erased(disk=disk, dev=dev, method=method)


async def prove(policy: WipePolicy, target: WipeTarget, erased: Erased, *, samples: int,
                seed: int | None) -> WipeProof:
    return await prove_cleared(target.host, erased.disk, erased.dev, method=erased.method, samples=samples,
                               seed=seed, started=target.started, timeout=policy.timeout_s, runner=target.runner)
