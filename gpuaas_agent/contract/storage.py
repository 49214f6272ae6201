"""Records of the slot disk: the lease that lets the agent write it, and the evidence of each write.

These cross the wire (task results, cleanup_blocked evidence) and the task
journal, so they are strict models: a proof that does not parse is no proof.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.images import ImageFormat
from gpuaas_agent.contract.nvmewipe import NvmeEraseEvidence, PolicyMethod, ProofMethod, WholeDeviceCheck
from gpuaas_agent.contract.types import MAJOR_MINOR_PATTERN, UUID_PATTERN, ByIdPath, DiskIdentity, KernelName

NonNegative = Annotated[int, Field(ge=0)]


class DiskLease(WireModel):
    """The slot a task holds: the only disk it may write is the one ``disk_identity`` names.

    ``nvme_device`` is the name the lease was taken under; any other by-id alias
    of the same namespace is the same disk, a link that resolves to another
    namespace is refused (``not_in_lease``) whatever it is called.
    """

    allocation_id: Annotated[str, Field(pattern=UUID_PATTERN)]
    slot_index: NonNegative
    nvme_device: ByIdPath
    disk_identity: DiskIdentity


class DiskEvidence(WireModel):
    """What the disk guard saw when it let a write through (kernel names are advisory)."""

    by_id: ByIdPath
    kernel_name: KernelName
    dev: Annotated[str, Field(pattern=MAJOR_MINOR_PATTERN)]
    disk_identity: DiskIdentity | None = None
    size_bytes: NonNegative
    partitions: list[KernelName]
    checks_passed: list[str]


class ProofGuarantee(WireEnum):
    """What a wipe proof's claim over *every* byte rests on (a sample alone covers only what it read)."""

    write_zeroes = "write_zeroes"  # every LBA written zero: Write Zeroes honoured, or zero buffers the agent wrote
    erase_reads_zero = "erase_reads_zero"  # an NVMe erase, on a namespace whose DLFEAT says erased blocks read zero
    whole_device_read = "whole_device_read"  # every byte read back and found zero
    sampled = "sampled"  # only the samples were read: no claim beyond them (proofs from before guarantees)


EVERY_BYTE = frozenset({ProofGuarantee.write_zeroes, ProofGuarantee.erase_reads_zero,
                        ProofGuarantee.whole_device_read})


class WipeSample(WireModel):
    """One region read back after the wipe."""

    offset: NonNegative
    length: Annotated[int, Field(gt=0)]
    all_zero: bool


class WipeProof(WireModel):
    """Evidence that a released disk holds nothing: the only ticket back to ``available`` (docs/safety.md §6)."""

    by_id: ByIdPath
    kernel_name: KernelName
    dev: Annotated[str, Field(pattern=MAJOR_MINOR_PATTERN)]
    method: ProofMethod  # how the blocks were cleared
    bytes: NonNegative
    seed: int
    samples: list[WipeSample]
    signatures_found: list[str]
    partitions_left: list[KernelName]
    duration_s: Annotated[float, Field(ge=0)]
    verified: bool
    # Wipe policies (all optional: a proof from before them still parses). ``policy``: what the slot
    # profile asked for; ``nvme``: the NVMe command and the capability evidence it was chosen on;
    # ``whole_device``: every byte read back (methods that do not promise zeroes); ``zeroed_after``:
    # the method left non-zero data, so the agent wrote zeroes (``method``) and proved those.
    policy: PolicyMethod | None = None
    nvme: NvmeEraseEvidence | None = None
    whole_device: WholeDeviceCheck | None = None
    zeroed_after: bool = False
    # What the claim over every byte rests on; a proof from before this field claims only its samples.
    guarantee: ProofGuarantee = ProofGuarantee.sampled
    # The whole-device read that found data an acknowledged erase left behind (then zeroed and read again).
    left_by_erase: WholeDeviceCheck | None = None
    # The disk this proves empty, by what it is (the lease's ``disk_identity``, checked by the wipe's guards), not
    # by a name: an unquarantine re-check accepts only a proof of the quarantined disk itself. None in a proof
    # from before this field, which therefore returns no quarantined disk.
    disk_identity: DiskIdentity | None = None

    @property
    def covers_every_byte(self) -> bool:
        """Verified, and by a guarantee over every LBA: only then may a clone skip writing zeroes."""
        return self.verified and self.guarantee in EVERY_BYTE


class CloneProgress(WireModel):
    """One progress event of a clone; ``percent`` never goes down."""

    by_id: ByIdPath
    percent: Annotated[float, Field(ge=0, le=100)]


class CloneResult(WireModel):
    """A finished clone: which image went onto which disk, how, and how fast."""

    by_id: ByIdPath
    kernel_name: KernelName
    source: str
    source_format: ImageFormat
    virtual_size_bytes: NonNegative
    target_is_zero: bool
    argv: list[str]
    duration_s: Annotated[float, Field(ge=0)]
    # "stream": a raw image not yet cached, written onto the disk as it downloaded and hashed (argv is empty);
    # "qemu-img": the cached image converted onto the disk by ``argv``.
    method: Literal["qemu-img", "stream"] = "qemu-img"
    zero_bytes_skipped: NonNegative = 0  # a stream onto a disk proven zero skips zero chunks
