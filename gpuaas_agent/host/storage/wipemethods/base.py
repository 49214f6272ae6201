"""What every wipe method module offers (check, wipe, prove) and the values that pass between the three.

A method module (``discard.py``, ``zeroout.py``, ...) is registered in :data:`WIPE_METHODS
<gpuaas_agent.host.storage.wipemethods.WIPE_METHODS>` under its :class:`WipeMethod`; mypy checks each
module against :class:`WipeMethodModule`. The caller (``wipepolicy.wipe_slot_disk``) runs the disk
guard before ``wipe``, so a method never receives a disk the guard did not let through.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuaas_agent.contract.nvmewipe import NvmeEraseEvidence, WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import DiskEvidence, DiskLease, WipeProof
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.hostfs import HostRoot

Runner = Callable[..., Awaitable[Completed]]


@dataclass(frozen=True)
class WipeTarget:
    """The leased disk a method checks or wipes, and how it reaches the host."""

    host: HostRoot
    by_id: str
    lease: DiskLease
    runner: Runner = run
    domain_disks: Collection[str] = ()
    started: float = field(default_factory=time.monotonic)  # the wipe's start, for the proof's duration


@dataclass(frozen=True)
class WipeCheck:
    """What a method proved, writing nothing, about wiping the leased disk: for the lease and validate's evidence."""

    zeros_guaranteed: bool  # the disk will read zero after the method's erase, by the device's own contract
    evidence: dict[str, Any]


@dataclass(frozen=True)
class Erased:
    """What a method's ``wipe`` did to the guarded disk: handed, unchanged, to its ``prove``."""

    disk: DiskEvidence  # what the guard let through
    dev: str  # the kernel node the guard matched
    method: WipeMethod  # how the blocks were cleared (``zero_fill`` where a zeroout fell back to the agent's buffers)
    nvme: NvmeEraseEvidence | None = None  # the NVMe command an erase rests on


class WipeMethodModule(Protocol):
    """One wipe method: a module with these three functions (ironic's erase methods, one plug-in point each)."""

    @property
    def METHOD(self) -> WipeMethod:  # a module constant: the key it is registered under
        ...

    async def check(self, policy: WipePolicy, target: WipeTarget) -> WipeCheck:
        """Prove, writing nothing, that ``policy`` can wipe the leased disk; raise the refusal otherwise."""
        ...

    async def wipe(self, policy: WipePolicy, target: WipeTarget, disk: DiskEvidence, *,
                   zeros_guaranteed: bool) -> Erased:
        """Erase the guarded disk and its signatures; ``zeros_guaranteed`` is what the lease's validate found."""
        ...

    async def prove(self, policy: WipePolicy, target: WipeTarget, erased: Erased, *, samples: int,
                    seed: int | None) -> WipeProof:
        """Read the disk back; the verified proof, or ``wipe_unverified`` carrying the one that failed."""
        ...
