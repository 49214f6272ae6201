"""Cloning real qcow2/raw images onto real loop disks with qemu-img."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from gpuaas_agent.contract.images import ImageFormat
from gpuaas_agent.contract.storage import CloneProgress
from gpuaas_agent.errors import HostError
from gpuaas_agent.guards.disk import DiskGuardError
from gpuaas_agent.host.images.clone import CloneError, ProgressParser, clone_image, convert_argv
from gpuaas_agent.host.storage.blockwipe import wipe_disk
from gpuaas_agent.hostfs import HostRoot
from tests.support.realdev import MiB, read_bytes, sh

LIVE = HostRoot.open("/")


def _image(tmp_path, size_mib: int = 16):
    """A qcow2 converted from a raw file with known bytes (random data, zero holes, a pattern)."""
    raw = tmp_path / "known.raw"
    data = bytearray(size_mib * MiB)
    data[0 : 2 * MiB] = os.urandom(2 * MiB)
    data[7 * MiB : 7 * MiB + 4096] = b"\xc3" * 4096
    data[-MiB:] = os.urandom(MiB)
    raw.write_bytes(bytes(data))
    qcow2 = tmp_path / "known.qcow2"
    sh("qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(qcow2))
    return raw, qcow2, hashlib.sha256(bytes(data)).hexdigest()


def _sha(dev: str, length: int) -> str:
    return hashlib.sha256(read_bytes(dev, 0, length)).hexdigest()


def _children_touching(path: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if path.encode() in cmd and state != "Z":
            found.append(int(pid))
    return found


def test_qcow2_clone_is_byte_identical_and_progress_is_monotonic(realdev, tmp_path):
    raw, qcow2, digest = _image(tmp_path)
    disk = realdev.disk(64)
    events: list[CloneProgress] = []
    result = asyncio.run(clone_image(LIVE, str(qcow2), disk.by_id, lease=disk.lease(), on_progress=events.append))
    assert result.source_format is ImageFormat.qcow2 and result.virtual_size_bytes == 16 * MiB
    assert not result.target_is_zero and "--target-is-zero" not in result.argv
    assert "-n" in result.argv and "-W" in result.argv and result.argv[result.argv.index("-m") + 1] == "16"
    assert _sha(disk.dev, 16 * MiB) == digest
    sh("qemu-img", "compare", "-f", "qcow2", "-F", "raw", str(qcow2), disk.dev)
    percents = [e.percent for e in events]
    assert percents and percents[-1] == 100.0
    assert percents == sorted(percents) and len(set(percents)) == len(percents)


def test_target_is_zero_only_with_a_proof_for_this_disk(realdev, tmp_path):
    raw, qcow2, digest = _image(tmp_path)
    disk, other = realdev.disk(64), realdev.disk(64)
    sh("dd", "if=/dev/urandom", f"of={disk.dev}", "bs=1M", "count=64", "oflag=direct", "status=none")
    proof = asyncio.run(wipe_disk(LIVE, disk.by_id, lease=disk.lease()))
    other_proof = asyncio.run(wipe_disk(LIVE, other.by_id, lease=other.lease()))
    result = asyncio.run(clone_image(LIVE, str(raw), disk.by_id, lease=disk.lease(), wipe_proof=proof))
    assert result.target_is_zero and "--target-is-zero" in result.argv
    assert _sha(disk.dev, 16 * MiB) == digest and not any(read_bytes(disk.dev, 16 * MiB, 48 * MiB))
    result = asyncio.run(clone_image(LIVE, str(raw), disk.by_id, lease=disk.lease(), wipe_proof=other_proof))
    assert not result.target_is_zero


def test_unknown_format_is_refused_before_writing(realdev, tmp_path):
    vmdk = tmp_path / "x.vmdk"
    sh("qemu-img", "create", "-q", "-f", "vmdk", str(vmdk), "8M")
    disk = realdev.disk(16)
    sh("dd", "if=/dev/urandom", f"of={disk.dev}", "bs=1M", "count=1", "status=none")
    before = read_bytes(disk.dev, 0, MiB)
    with pytest.raises(CloneError) as err:
        asyncio.run(clone_image(LIVE, str(vmdk), disk.by_id, lease=disk.lease()))
    assert err.value.code == "unknown_format" and err.value.evidence["format"] == "vmdk"
    assert read_bytes(disk.dev, 0, MiB) == before


def test_truncated_qcow2_is_refused_before_writing(realdev, tmp_path):
    """qemu-img convert of a truncated qcow2 *succeeds* (reads past EOF are zeroes); check catches it."""
    raw, qcow2, _ = _image(tmp_path)
    size = qcow2.stat().st_size
    with open(qcow2, "r+b") as fh:
        fh.truncate(size // 2)
    scratch = realdev.disk(64, link=False)
    sh("qemu-img", "convert", "-n", "-f", "qcow2", "-O", "raw", str(qcow2), scratch.dev)  # no error at all
    disk = realdev.disk(64)
    with pytest.raises(CloneError) as err:
        asyncio.run(clone_image(LIVE, str(qcow2), disk.by_id, lease=disk.lease()))
    assert err.value.code == "clone_failed" and err.value.evidence["returncode"] == 2
    assert err.value.evidence["disk_dirty"] is False and "ERROR" in err.value.evidence["stderr"] + err.value.evidence["stdout"]
    assert not any(read_bytes(disk.dev, 0, 16 * MiB))


def test_a_read_error_mid_clone_is_clone_failed_with_stderr_and_a_dirty_disk(realdev, tmp_path):
    """qemu's blkdebug driver fails the read at 8 MiB: the clone dies half-way, the disk is dirty."""
    raw, _, _ = _image(tmp_path)
    conf = tmp_path / "blkdebug.conf"
    conf.write_text('[inject-error]\nevent = "read_aio"\nerrno = "5"\nsector = "16384"\n')
    disk = realdev.disk(64)
    with pytest.raises(CloneError) as err:
        asyncio.run(clone_image(LIVE, f"blkdebug:{conf}:{raw}", disk.by_id, lease=disk.lease()))
    assert err.value.code == "clone_failed" and err.value.evidence["disk_dirty"] is True
    assert "Input/output error" in err.value.evidence["stderr"]
    assert err.value.evidence["disk"]["kernel_name"] == disk.name


def test_guard_runs_before_the_clone(realdev, tmp_path):
    raw, qcow2, _ = _image(tmp_path)
    disk = realdev.disk(64, partitions_mib=[32])
    realdev.mkfs_ext4(disk.partitions[0])
    realdev.mount(disk.partitions[0])
    before = read_bytes(disk.dev, 0, 4 * MiB)
    with pytest.raises(DiskGuardError) as err:
        asyncio.run(clone_image(LIVE, str(qcow2), disk.by_id, lease=disk.lease()))
    assert err.value.code == "mounted_child"
    assert read_bytes(disk.dev, 0, 4 * MiB) == before


def test_image_larger_than_the_disk_is_refused(realdev, tmp_path):
    raw, qcow2, _ = _image(tmp_path, size_mib=32)
    disk = realdev.disk(16)
    with pytest.raises(CloneError) as err:
        asyncio.run(clone_image(LIVE, str(qcow2), disk.by_id, lease=disk.lease()))
    assert err.value.code == "image_too_large" and err.value.evidence["disk_dirty"] is False


def test_cancel_mid_clone_kills_qemu_img_and_reports_a_dirty_disk(realdev, tmp_path):
    big = tmp_path / "big.qcow2"
    sh("qemu-img", "create", "-q", "-f", "qcow2", str(big), "1G")
    sh("qemu-io", "-f", "qcow2", "-c", "write -P 0xab 0 1G", str(big), timeout=300)
    disk = realdev.disk(1024)

    async def scenario():
        first = asyncio.Event()
        task = asyncio.create_task(
            clone_image(LIVE, str(big), disk.by_id, lease=disk.lease(), on_progress=lambda e: first.set())
        )
        await asyncio.wait_for(first.wait(), 60)
        task.cancel()
        with pytest.raises(CloneError) as err:
            await task
        return err.value

    err = asyncio.run(scenario())
    assert err.code == "clone_cancelled" and err.evidence["disk_dirty"] is True
    assert _children_touching(str(big)) == []
    # the disk is free again (no exclusive holder left behind)
    os.close(os.open(disk.dev, os.O_RDONLY | os.O_EXCL))


def test_progress_parser_handles_split_chunks_and_never_goes_back():
    parser = ProgressParser()
    assert parser.feed(b"    (0.00/100%)\r    (12.") == [0.0]
    assert parser.feed(b"34/100%)\r    (5.00/100%)\r") == [12.34]
    assert parser.feed(b"    (100.00/100%)\r\n") == [100.0]


def test_convert_argv_flags():
    argv = convert_argv("/c/i.qcow2", ImageFormat.qcow2, "/dev/x", direct=True, zero=True)
    assert argv == ["qemu-img", "convert", "-p", "-n", "-f", "qcow2", "-O", "raw", "-t", "none",
                    "-W", "-m", "16", "--target-is-zero", "/c/i.qcow2", "/dev/x"]
    assert "-t" not in convert_argv("/c/i", ImageFormat.raw, "/dev/x", direct=False, zero=False)


def test_the_exclusive_hold_during_a_clone_blocks_mounting_a_partition(realdev):
    """What clone_image holds while qemu-img runs: a mount of any partition now gets EBUSY."""
    from gpuaas_agent.guards.disk import check_disk_writable, open_exclusive

    disk = realdev.disk(64, partitions_mib=[32])
    realdev.mkfs_ext4(disk.partitions[0])
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    hold = open_exclusive(disk.dev, evidence.model_dump(mode="json"))
    try:
        with pytest.raises(HostError) as err:
            realdev.mount(disk.partitions[0])
        assert "busy" in err.value.evidence["stderr"].lower(), err.value.evidence
    finally:
        os.close(hold)


def test_a_failing_progress_callback_does_not_orphan_qemu_img(realdev, tmp_path):
    raw, qcow2, digest = _image(tmp_path)
    disk = realdev.disk(64)

    def broken(_event):
        raise RuntimeError("consumer went away")

    with pytest.raises(RuntimeError):
        asyncio.run(clone_image(LIVE, str(qcow2), disk.by_id, lease=disk.lease(), on_progress=broken))
    assert _children_touching(str(qcow2)) == []
    assert _sha(disk.dev, 16 * MiB) == digest  # qemu-img was allowed to finish


def test_a_disk_that_vanishes_mid_clone_is_reported_missing_and_dirty(realdev, tmp_path):
    """The by-id link goes away while qemu-img runs (hot-unplug, udev re-point); the write then fails."""
    raw, _, _ = _image(tmp_path)
    conf = tmp_path / "blkdebug.conf"
    conf.write_text('[inject-error]\nevent = "read_aio"\nerrno = "5"\nsector = "16384"\n')
    disk = realdev.disk(64)

    def unplug(_event):
        if os.path.lexists(disk.by_id):
            os.unlink(disk.by_id)

    with pytest.raises(CloneError) as err:
        asyncio.run(clone_image(LIVE, f"blkdebug:{conf}:{raw}", disk.by_id, lease=disk.lease(), on_progress=unplug))
    assert err.value.code == "missing" and err.value.evidence["disk_dirty"] is True
