"""The image cache stays within its size cap and free-space floor: LRU eviction, pins, cache_full."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from gpuaas_agent.host.images.cache import ImageCache, ImageCacheError, SourcePolicy

MIB = 1 << 20


def _image(src: Path, name: str, size: int) -> tuple[str, str]:
    data = os.urandom(size)
    path = src / name
    path.write_bytes(data)
    return path.as_uri(), hashlib.sha256(data).hexdigest()


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "src"
    path.mkdir()
    return path


def _cache(tmp_path: Path, src: Path, **kw) -> ImageCache:
    return ImageCache(tmp_path / "cache", policy=SourcePolicy(file_dir=src), state_dir=tmp_path / "state", **kw)


def _fetch(cache: ImageCache, url: str, digest: str, **kw):
    return asyncio.run(cache.fetch(url, digest, **kw))


def test_least_recently_used_image_is_evicted_to_stay_under_the_cap(tmp_path, src):
    cache = _cache(tmp_path, src, cache_max_bytes=5 * MIB)
    a, b, c = (_image(src, n, 2 * MIB) for n in ("a.raw", "b.raw", "c.raw"))
    _fetch(cache, *a)
    _fetch(cache, *b)
    os.utime(cache.marker_path(a[1]), (1, 1))
    os.utime(cache.marker_path(b[1]), (2, 2))
    _fetch(cache, *a)  # a hit: a is now the most recently used
    _fetch(cache, *c, size_bytes=2 * MIB)
    assert cache.lookup(b[1]) is None and cache.lookup(a[1]) and cache.lookup(c[1])
    stats = cache.stats()
    assert stats.size_bytes == 4 * MIB and stats.evictions == 1 and stats.hits == 1 and stats.misses == 3


def test_a_pinned_image_is_never_evicted_and_the_download_is_refused_cache_full(tmp_path, src):
    cache = _cache(tmp_path, src, cache_max_bytes=3 * MIB)
    a, b = _image(src, "a.raw", 2 * MIB), _image(src, "b.raw", 2 * MIB)
    _fetch(cache, *a, pin=True)  # a provision holds it from its image step until its clone is done
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, *b, size_bytes=2 * MIB)
    assert err.value.code == "cache_full" and err.value.evidence["pinned"] == [a[1]]
    assert cache.lookup(a[1]) is not None
    assert [p.name for p in cache.entries.iterdir() if p.name.endswith(".partial")] == []
    cache.unpin(a[1])
    with cache.in_use(b[1]):
        _fetch(cache, *b, size_bytes=2 * MIB)  # now a may go
        assert cache.pinned() == {b[1]}
    assert cache.lookup(a[1]) is None and cache.lookup(b[1]) is not None and cache.pinned() == set()


def test_a_download_that_would_cross_the_free_space_floor_is_refused_before_a_byte_is_written(tmp_path, src):
    probe = _cache(tmp_path, src)
    probe.entries.mkdir(parents=True)
    floor = probe.free_bytes() - MIB  # the file system has 1 MiB above the floor (give or take other writers)
    cache = _cache(tmp_path, src, min_free_bytes=floor)
    url, digest = _image(src, "big.raw", 8 * MIB)
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, url, digest, size_bytes=8 * MIB)
    assert err.value.code == "cache_full" and "image_cache_min_free_bytes" in err.value.message
    assert list(cache.entries.iterdir()) == []
