"""Wipe and verification on real loop disks (docs/safety.md §6)."""

from __future__ import annotations

import asyncio

import pytest

from gpuaas_agent.contract.nvmewipe import WipeMethod
from gpuaas_agent.contract.storage import WipeProof
from gpuaas_agent.guards.disk import DiskGuardError, check_disk_writable
from gpuaas_agent.host.storage.blockwipe import WipeError, sample_offsets, verify_wiped, wipe_disk
from gpuaas_agent.hostfs import HostRoot
from tests.support.realdev import MiB, read_bytes, sh, write_bytes

LIVE = HostRoot.open("/")


def _used_disk(realdev):
    """A disk that held a tenant: GPT, ext4 with a file, bytes at the very end."""
    disk = realdev.disk(64, partitions_mib=[40])
    # The tenant's file goes in at mkfs (-d), not through a mount: where / is a private mount, a mount namespace
    # made meanwhile (any `ip netns exec` of a parallel test) keeps its own copy of the mount after our umount, and
    # the disk stays busy to the guard's exclusive open (seen once in a parallel suite run).
    content = realdev.tmp / "tenant-root"
    content.mkdir()
    (content / "tenant").write_bytes(b"secret" * 100000)
    sh("mkfs.ext4", "-q", "-F", "-d", str(content), disk.partitions[0])
    write_bytes(disk.dev, 64 * MiB - 4096, b"\x5a" * 4096)
    return disk


def test_wipe_of_a_used_disk_is_verified(realdev):
    disk = _used_disk(realdev)
    assert "ext4" in sh("blkid", "-p", disk.partitions[0])
    proof = asyncio.run(wipe_disk(LIVE, disk.by_id, lease=disk.lease(), samples=8, seed=7))
    assert proof.verified, proof
    assert proof.method in (WipeMethod.discard, WipeMethod.zeroout)
    assert proof.signatures_found == [] and proof.partitions_left == []
    assert proof.bytes == 64 * MiB and proof.seed == 7
    offsets = [s.offset for s in proof.samples]
    assert offsets[0] == 0 and offsets[1] == 64 * MiB - MiB and len(offsets) >= 3
    assert all(s.all_zero for s in proof.samples)
    assert read_bytes(disk.dev, 64 * MiB - 4096, 4096) == bytes(4096)
    # the proof round-trips as a wire record
    assert WipeProof.model_validate_json(proof.model_dump_json()) == proof
    # and the disk passes the guard again with no partitions
    assert check_disk_writable(LIVE, disk.by_id, lease=disk.lease()).partitions == []


def test_a_signature_written_after_the_erase_fails_verification(realdev):
    disk = _used_disk(realdev)

    async def plant(dev: str) -> None:
        await asyncio.to_thread(sh, "mkfs.ext4", "-q", "-F", dev)

    with pytest.raises(WipeError) as err:
        asyncio.run(wipe_disk(LIVE, disk.by_id, lease=disk.lease(), after_erase=plant))
    assert err.value.code == "wipe_unverified"
    proof = WipeProof.model_validate(err.value.evidence)
    assert not proof.verified
    assert any("ext4" in s for s in proof.signatures_found)


def test_verify_of_a_disk_never_wiped_finds_signatures_and_data(realdev):
    disk = _used_disk(realdev)
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    proof = asyncio.run(verify_wiped(LIVE, evidence, method=WipeMethod.discard, samples=4, seed=1))
    assert not proof.verified
    assert any("gpt" in s for s in proof.signatures_found)
    assert proof.partitions_left == [disk.name + "p1"]
    assert proof.samples[0].all_zero is False and proof.samples[1].all_zero is False  # GPT at 0, 0x5a at the end


def test_nonzero_data_without_signature_is_caught_by_samples(realdev):
    disk = realdev.disk(16)
    write_bytes(disk.dev, 16 * MiB - 512, b"\x01" * 512)
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    proof = asyncio.run(verify_wiped(LIVE, evidence, method=WipeMethod.zero_fill, samples=2, seed=3))
    assert proof.signatures_found == [] and not proof.verified and proof.samples[1].all_zero is False


def test_wipe_refuses_a_disk_with_a_mounted_child_and_leaves_it_intact(realdev):
    disk = realdev.disk(64, partitions_mib=[32])
    realdev.mkfs_ext4(disk.partitions[0])
    realdev.mount(disk.partitions[0])
    before = read_bytes(disk.dev, 0, MiB)
    with pytest.raises(DiskGuardError) as err:
        asyncio.run(wipe_disk(LIVE, disk.by_id, lease=disk.lease()))
    assert err.value.code == "mounted_child"
    assert read_bytes(disk.dev, 0, MiB) == before


def test_sample_offsets_are_seeded_aligned_and_inside():
    size = 10 * (1 << 30)
    a, b = sample_offsets(size, 16, 42), sample_offsets(size, 16, 42)
    assert a == b and a[0] == (0, MiB) and a[1] == (size - MiB, MiB)
    assert all(o % 4096 == 0 and o + n <= size for o, n in a[2:])
    assert sample_offsets(size, 16, 43) != a
    assert sample_offsets(4096, 3, 1) == [(0, 4096)]


def _runner_with(fake: dict[str, int]):
    """The real runner, except that ``blkdiscard`` variants listed in ``fake`` 'exit' with the given code
    without touching the disk (a device that does not discard, or discards without zeroing)."""
    from gpuaas_agent.host.run import Completed, run

    async def runner(argv, **kw):
        key = " ".join(argv[:-1])
        if key in fake:
            return Completed(argv=tuple(argv), returncode=fake[key], stdout=b"", stderr=b"Operation not supported\n")
        return await run(argv, **kw)

    return runner


def test_discard_that_does_not_zero_falls_back_to_zeroout(realdev):
    disk = _used_disk(realdev)
    proof = asyncio.run(wipe_disk(LIVE, disk.by_id, lease=disk.lease(), runner=_runner_with({"blkdiscard": 0})))
    assert proof.verified and proof.method is WipeMethod.zeroout


def test_no_discard_and_no_zeroout_falls_back_to_zero_fill(realdev):
    disk = _used_disk(realdev)
    runner = _runner_with({"blkdiscard": 1, "blkdiscard --zeroout": 1})
    proof = asyncio.run(wipe_disk(LIVE, disk.by_id, lease=disk.lease(), runner=runner))
    assert proof.verified and proof.method is WipeMethod.zero_fill
    assert read_bytes(disk.dev, 64 * MiB - 4096, 4096) == bytes(4096)
