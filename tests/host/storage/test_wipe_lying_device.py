"""The handover on a disk that acknowledges a discard but keeps the data in some ranges (a real FUSE-backed loop).

NVMe Deallocate is advisory; a controller may answer success and keep a few ranges.
A sampled proof misses such ranges (16 regions of 1 MiB on a 3.84 TB disk), and the
clone after it would then skip writing the image's zero regions over them. These
tests run the agent's wipe on a real block device that lies that way
(tests/support/lyingfs.py): the proof must find the data, and the disk is never
reported clean while it is there.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from gpuaas_agent.contract.nvmewipe import WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import ProofGuarantee
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.images.clone import target_is_zero
from gpuaas_agent.host.storage.blockwipe import WipeError, read_whole_device, sample_offsets, verify_wiped
from gpuaas_agent.host.storage.wipepolicy import wipe_slot_disk
from gpuaas_agent.hostfs import HostRoot
from tests.support.lyingfs import LyingDisk
from tests.support.realdev import LoopDisk, MiB, read_bytes, write_bytes

LIVE = HostRoot.open("/")
SIZE = 48 * MiB
KEPT = [(5 * MiB + 4096, 64 << 10), (23 * MiB, 64 << 10), (41 * MiB + 8192, 64 << 10)]  # three 64 KiB ranges
TENANT = b"tenant secret \xa5"
SEED = 2  # its 18 sampled regions miss all three kept ranges (asserted below)


def _missed_by_the_sample(seed: int) -> bool:
    regions = sample_offsets(SIZE, 16, seed)
    return not any(o < k + n and k < o + length for o, length in regions for k, n in KEPT)


@pytest.fixture
def lying(realdev, tmp_path):
    def make(*, lie_zeroout: bool = False) -> LoopDisk:
        disk = LyingDisk(tmp_path / ("z" if lie_zeroout else "d"), SIZE, KEPT, lie_zeroout=lie_zeroout)
        realdev._push(f"lyingfs {disk.mountpoint}", disk.close)
        loop = LoopDisk(image=disk.file, dev=disk.dev, by_id=realdev.by_id_link(f"../../{os.path.basename(disk.dev)}"))
        fill = (TENANT * (MiB // len(TENANT) + 1))[:MiB]
        for offset in range(0, SIZE, MiB):
            write_bytes(loop.dev, offset, fill)
        return loop

    (tmp_path / "d").mkdir()
    (tmp_path / "z").mkdir()
    return make


def test_the_device_really_keeps_data_after_an_acknowledged_discard(lying):
    disk = lying()
    assert asyncio.run(_run(["blkdiscard", disk.dev])).returncode == 0  # acknowledged
    for offset, _ in KEPT:
        assert read_bytes(disk.dev, offset, len(TENANT)) != bytes(len(TENANT))
    assert read_bytes(disk.dev, 0, 4096) == bytes(4096)  # elsewhere it did discard


def test_a_discard_that_kept_data_is_found_by_the_whole_read_zeroed_and_read_again(lying):
    disk = lying()
    assert _missed_by_the_sample(SEED), "the seed must pick samples that miss the kept ranges"
    fooled = []

    async def sampled_proof_in_between(dev: str) -> None:
        # What the proof used to be (16 seeded samples): it calls this disk clean.
        evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
        sample = await verify_wiped(LIVE, evidence, method=WipeMethod.discard, samples=16, seed=SEED, dev=dev)
        fooled.append(sample.verified)

    proof = asyncio.run(wipe_slot_disk(WipePolicy(method=WipeMethod.discard), LIVE, disk.by_id,
                                       lease=disk.lease(), seed=SEED, after_erase=sampled_proof_in_between))
    assert fooled == [True]  # the sample alone would have handed the tenant's data to the next one
    assert proof.left_by_erase is not None and not proof.left_by_erase.all_zero
    assert proof.left_by_erase.first_nonzero_offset == KEPT[0][0]
    assert proof.zeroed_after and proof.method is WipeMethod.zeroout
    assert proof.guarantee is ProofGuarantee.whole_device_read and proof.whole_device.all_zero
    assert proof.whole_device.bytes_read == SIZE and proof.verified
    assert all(read_bytes(disk.dev, offset, length) == bytes(length) for offset, length in KEPT)
    assert read_whole_device(disk.dev, SIZE).all_zero


def test_a_device_that_breaks_write_zeroes_too_is_never_reported_clean(lying):
    disk = lying(lie_zeroout=True)
    with pytest.raises(WipeError) as failed:
        asyncio.run(wipe_slot_disk(WipePolicy(method=WipeMethod.discard), LIVE, disk.by_id,
                                   lease=disk.lease(), seed=SEED))
    assert failed.value.code == "wipe_unverified"
    evidence = failed.value.evidence
    assert evidence["verified"] is False and evidence["whole_device"]["all_zero"] is False
    assert evidence["whole_device"]["first_nonzero_offset"] == KEPT[0][0]
    assert str(KEPT[0][0]) in failed.value.message
    assert read_bytes(disk.dev, KEPT[1][0], len(TENANT)) != bytes(len(TENANT))  # still there: and reported so


def test_a_clone_skips_zero_regions_only_after_a_proof_over_every_byte(lying):
    disk = lying()
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    sampled = asyncio.run(verify_wiped(LIVE, evidence, method=WipeMethod.discard, samples=16, seed=SEED,
                                       dev=disk.dev))
    assert not sampled.covers_every_byte and not target_is_zero(sampled.model_copy(update={"verified": True}),
                                                                 evidence)
    proof = asyncio.run(wipe_slot_disk(WipePolicy(method=WipeMethod.discard), LIVE, disk.by_id,
                                       lease=disk.lease(), seed=SEED))
    assert proof.covers_every_byte and target_is_zero(proof, evidence)


async def _run(argv):
    from gpuaas_agent.host.run import run

    return await run(argv, timeout=60, check=False)
