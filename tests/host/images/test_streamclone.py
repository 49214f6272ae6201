"""A raw image not yet cached goes onto the slot disk and into the cache in one pass, hashed on the way.

Real pieces: the throwaway-CA HTTPS server (tests/support/image_server.py), loop disks with
by-id links and leases (tests/support/realdev.py), qemu-img. What is proven is correctness, not speed:
the provision goes on only with the digest matched, and every way the stream can end early
leaves the cache without a partial file and the disk reported dirty.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from gpuaas_agent.contract.storage import CloneProgress
from gpuaas_agent.guards.disk import DiskGuardError
from gpuaas_agent.host.images.cache import ImageCache, StreamedMiss
from gpuaas_agent.host.images.clone import CloneError, clone_image
from gpuaas_agent.host.images.streamclone import stream_image
from gpuaas_agent.host.storage.blockwipe import wipe_disk
from gpuaas_agent.hostfs import HostRoot
from tests.support.image_server import cache_leftovers, image_cache, sha256_hex
from tests.support.realdev import MiB, read_bytes, sh

LIVE = HostRoot.open("/")
SIZE = 10 * MiB + 4097  # several 4 MiB chunks, an unaligned tail


def _wait_for(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def image(src_dir) -> tuple[str, bytes]:
    """(name, bytes) of a raw image with data, a 4 MiB zero run and an unaligned tail, in the served dir."""
    data = bytearray(os.urandom(SIZE))
    data[4 * MiB:8 * MiB] = bytes(4 * MiB)
    (src_dir / "big.raw").write_bytes(bytes(data))
    return "big.raw", bytes(data)


@pytest.fixture
def served(tmp_path, https_server):
    base, context, hostport = https_server
    return base, image_cache(tmp_path, hosts=(hostport,), ssl_context=context, stall_timeout_s=2.0)


def _requests(src_dir: Path, path: str) -> int:
    log = src_dir / "requests.log"
    return log.read_text().splitlines().count(path) if log.exists() else 0


async def _open(cache: ImageCache, url: str, digest: str) -> StreamedMiss:
    miss = await cache.fetch_or_open(url, digest)
    assert isinstance(miss, StreamedMiss)
    return miss


def test_a_raw_image_is_written_to_the_disk_and_the_cache_in_one_pass(realdev, served, image, src_dir):
    base, cache = served
    name, data = image
    disk = realdev.disk(16)
    sh("dd", "if=/dev/urandom", f"of={disk.dev}", "bs=1M", "count=16", "oflag=direct", "status=none")
    events: list[CloneProgress] = []

    async def scenario():
        miss = await _open(cache, f"{base}/files/{name}", sha256_hex(data))
        return await stream_image(LIVE, miss, disk.by_id, lease=disk.lease(), on_progress=events.append)

    result, cached = asyncio.run(scenario())
    assert result.method == "stream" and result.argv == [] and not result.target_is_zero
    assert result.virtual_size_bytes == SIZE and result.zero_bytes_skipped == 0
    assert read_bytes(disk.dev, 0, SIZE) == data  # the zero run was written, not skipped: no proof of zero
    assert Path(cached.path).read_bytes() == data and cached.format.value == "raw"
    assert cache_leftovers(cache) == [sha256_hex(data), f"{sha256_hex(data)}.verified.json"]
    assert _requests(src_dir, f"/files/{name}") == 1  # one download for the disk and the cache
    percents = [e.percent for e in events]
    assert percents and percents[-1] == 100.0 and percents == sorted(set(percents))


def test_zero_chunks_are_skipped_only_on_a_disk_proven_zero(realdev, served, image):
    base, cache = served
    name, data = image
    disk = realdev.disk(16)
    sh("dd", "if=/dev/urandom", f"of={disk.dev}", "bs=1M", "count=16", "oflag=direct", "status=none")
    proof = asyncio.run(wipe_disk(LIVE, disk.by_id, lease=disk.lease()))

    async def scenario():
        miss = await _open(cache, f"{base}/files/{name}", sha256_hex(data))
        return await stream_image(LIVE, miss, disk.by_id, lease=disk.lease(), wipe_proof=proof)

    result, _ = asyncio.run(scenario())
    assert result.target_is_zero and result.zero_bytes_skipped == 4 * MiB
    assert read_bytes(disk.dev, 0, SIZE) == data


def _failed_stream(cache: ImageCache, disk, url: str, digest: str) -> CloneError:
    async def scenario():
        miss = await _open(cache, url, digest)
        await stream_image(LIVE, miss, disk.by_id, lease=disk.lease())

    with pytest.raises(CloneError) as err:
        asyncio.run(scenario())
    assert err.value.evidence["disk_dirty"] is True and err.value.evidence["method"] == "stream"
    return err.value


def _lock_is_free(cache: ImageCache, digest: str) -> bool:
    async def probe():
        async def take():
            lock = await cache._acquire(digest)
            lock.release()

        await asyncio.wait_for(take(), timeout=5)

    asyncio.run(probe())
    return True


def test_a_mismatch_at_the_last_byte_fails_dirty_and_caches_nothing(realdev, served, image, src_dir):
    base, cache = served
    name, data = image
    (src_dir / "lastbyte.raw").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    err = _failed_stream(cache, realdev.disk(16), f"{base}/files/lastbyte.raw", sha256_hex(data))
    assert err.code == "digest_mismatch" and err.evidence["expected_sha256"] == sha256_hex(data)
    assert cache_leftovers(cache) == [] and _lock_is_free(cache, sha256_hex(data))


def test_a_server_closing_early_is_truncated_and_caches_nothing(realdev, served, image):
    base, cache = served
    name, data = image
    err = _failed_stream(cache, realdev.disk(16), f"{base}/short/{name}", sha256_hex(data))
    assert err.code == "truncated", (err.message, err.evidence)
    assert cache_leftovers(cache) == [] and _lock_is_free(cache, sha256_hex(data))


def test_a_stalling_server_is_fetch_stalled_and_caches_nothing(realdev, served, image, src_dir):
    base, cache = served
    name, data = image
    err = _failed_stream(cache, realdev.disk(16), f"{base}/gated/{name}", sha256_hex(data))  # never opened
    assert err.code == "fetch_stalled"
    assert cache_leftovers(cache) == [] and _lock_is_free(cache, sha256_hex(data))


def test_a_cancelled_stream_is_clone_cancelled_dirty_and_caches_nothing(realdev, served, image, src_dir):
    base, cache = served
    cache.stall_timeout_s = 60.0
    name, data = image
    disk = realdev.disk(16)

    async def scenario():
        miss = await _open(cache, f"{base}/gated/{name}", sha256_hex(data))
        task = asyncio.create_task(stream_image(LIVE, miss, disk.by_id, lease=disk.lease()))
        deadline = time.monotonic() + 15
        while not any(read_bytes(disk.dev, 0, 4096)):  # the first chunk reached the disk: it is dirty
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(CloneError) as err:
            await task
        return err.value

    err = asyncio.run(scenario())
    assert err.code == "clone_cancelled" and err.evidence["disk_dirty"] is True
    os.close(os.open(disk.dev, os.O_RDONLY | os.O_EXCL))  # the stream had let go of the disk before answering
    # ...because its thread ends: the read blocked on the silent server is woken, not waited out (60 s).
    for thread in [t for t in threading.enumerate() if t.name.startswith("image-stream-")]:
        thread.join(timeout=30)
        assert not thread.is_alive()
    (src_dir / f"{name}.go").touch()  # let the server finish; nothing may appear in the cache
    assert cache_leftovers(cache) == [] and _lock_is_free(cache, sha256_hex(data))


def test_a_second_provision_waits_for_the_cache_and_never_reads_the_partial(realdev, served, image, src_dir):
    base, cache = served
    cache.stall_timeout_s = 60.0
    name, data = image
    url = f"{base}/gated/{name}"
    first_disk, second_disk = realdev.disk(16), realdev.disk(16)

    async def scenario():
        miss = await _open(cache, url, sha256_hex(data))
        first = asyncio.create_task(stream_image(LIVE, miss, first_disk.by_id, lease=first_disk.lease()))
        second = asyncio.create_task(cache.fetch_or_open(url, sha256_hex(data), pin=True))
        deadline = time.monotonic() + 15
        while cache.waiting(sha256_hex(data)) != 1:  # the second fetch is parked on the digest's lock
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert [p for p in cache_leftovers(cache) if p.endswith(".partial")]  # the first is mid-stream
        (src_dir / f"{name}.go").touch()
        result, cached = await first
        hit = await second
        await clone_image(LIVE, hit.path, second_disk.by_id, lease=second_disk.lease())
        cache.unpin(hit.sha256)
        return result, cached, hit

    result, cached, hit = asyncio.run(scenario())
    assert not isinstance(hit, StreamedMiss) and hit.source_proof == "recorded_source"
    assert hit.path == cached.path and Path(hit.path).read_bytes() == data
    assert _requests(src_dir, f"/gated/{name}") == 1 and cache.misses == 1 and cache.hits == 1
    assert read_bytes(first_disk.dev, 0, SIZE) == data == read_bytes(second_disk.dev, 0, SIZE)


def test_the_guard_refuses_before_any_byte_and_the_download_is_abandoned(realdev, served, image):
    base, cache = served
    name, data = image
    disk, other = realdev.disk(16), realdev.disk(16)

    async def scenario():
        miss = await _open(cache, f"{base}/files/{name}", sha256_hex(data))
        await stream_image(LIVE, miss, disk.by_id, lease=other.lease())

    with pytest.raises(DiskGuardError):
        asyncio.run(scenario())
    assert not any(read_bytes(disk.dev, 0, MiB))
    assert cache_leftovers(cache) == [] and _lock_is_free(cache, sha256_hex(data))


def test_an_image_larger_than_the_disk_is_refused_before_writing(realdev, served, image):
    base, cache = served
    name, data = image
    disk = realdev.disk(8)

    async def scenario():
        miss = await _open(cache, f"{base}/files/{name}", sha256_hex(data))
        await stream_image(LIVE, miss, disk.by_id, lease=disk.lease())

    with pytest.raises(CloneError) as err:
        asyncio.run(scenario())
    assert err.value.code == "image_too_large" and err.value.evidence["disk_dirty"] is False
    assert not any(read_bytes(disk.dev, 0, MiB)) and cache_leftovers(cache) == []


def test_a_qcow2_is_not_streamed_it_is_cached_for_qemu_img(tmp_path, served, image, src_dir):
    base, cache = served
    name, data = image
    sh("qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(src_dir / name), str(src_dir / "big.qcow2"))
    digest = hashlib.sha256((src_dir / "big.qcow2").read_bytes()).hexdigest()
    got = asyncio.run(cache.fetch_or_open(f"{base}/files/big.qcow2", digest))
    assert not isinstance(got, StreamedMiss) and got.format.value == "qcow2" and got.source_proof is None
    assert Path(got.path).read_bytes() == (src_dir / "big.qcow2").read_bytes()


def test_a_file_source_streams_into_a_cache_that_refuses_o_direct(realdev, tmp_path, image, src_dir, monkeypatch):
    """A cache file system that refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE): buffered, same bytes.

    This kernel's tmpfs takes O_DIRECT, so the refusal is the one seam stood in for.
    """
    from gpuaas_agent.host.images import cache as images_mod

    monkeypatch.setattr(images_mod, "_open_direct", lambda path: None)
    monkeypatch.setattr(images_mod, "CACHE_SYNC_BYTES", 4 << 20)  # the write-behind flush runs too
    name, data = image
    cache = image_cache(tmp_path)
    disk = realdev.disk(16)

    async def scenario():
        miss = await _open(cache, (src_dir / name).as_uri(), sha256_hex(data))
        return await stream_image(LIVE, miss, disk.by_id, lease=disk.lease())

    result, cached = asyncio.run(scenario())
    assert result.method == "stream" and Path(cached.path).read_bytes() == data
    assert read_bytes(disk.dev, 0, SIZE) == data
