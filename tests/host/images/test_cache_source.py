"""A cache hit is served only to a fetch whose own source answers for the cached bytes.

The digest names the image; it is not a secret. A tenant who learnt the digest of another
tenant's private image must not get it from the cache by naming a URL that answers 404 or
answers other bytes. Real sources: files in the image dir and the throwaway-CA HTTPS server.
"""

from __future__ import annotations

import os
import shutil

import pytest

from gpuaas_agent.host.images import cache as images_mod
from gpuaas_agent.host.images.cache import ImageCacheError, sample_ranges
from tests.support.image_server import cache_leftovers, fetch_image, image_cache, sha256_hex


@pytest.fixture
def cached(tmp_path, raw_image, https_server):
    """A cache holding raw_image, fetched from its file:// URL, that trusts the HTTPS server too."""
    path, data = raw_image
    base, context, hostport = https_server
    cache = image_cache(tmp_path, hosts=(hostport,), ssl_context=context)
    fetch_image(cache, path.as_uri(), sha256_hex(data))
    return cache, base, path, data


def _refusal(cache, url, digest) -> ImageCacheError:
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, url, digest)
    return err.value


def test_hit_under_a_url_that_answers_404_is_refused_as_the_miss_would_be(tmp_path, cached):
    cache, base, path, data = cached
    before = cache_leftovers(cache)
    hit = _refusal(cache, f"{base}/files/nothing-here.raw", sha256_hex(data))
    miss = _refusal(image_cache(tmp_path, root=tmp_path / "empty", hosts=(base.split("//")[1],),
                                ssl_context=cache.ssl_context),
                    f"{base}/files/nothing-here.raw", sha256_hex(data))
    assert (hit.code, hit.message, hit.evidence) == (miss.code, miss.message, miss.evidence)
    assert hit.code == "fetch_failed" and hit.evidence["http_status"] == 404
    assert cache_leftovers(cache) == before  # the entry stays for its rightful owners
    assert cache.hits == 0


def test_hit_under_a_url_that_answers_other_bytes_is_digest_mismatch_revealing_nothing(cached):
    cache, base, path, data = cached
    (path.parent / "other.raw").write_bytes(os.urandom(len(data)))  # same size, other bytes
    err = _refusal(cache, f"{base}/files/other.raw", sha256_hex(data))
    assert err.code == "digest_mismatch"
    assert err.evidence == {"url": f"{base}/files/other.raw", "expected_sha256": sha256_hex(data)}


def test_hit_under_a_source_differing_in_one_sampled_byte_is_refused(cached, monkeypatch):
    cache, base, path, data = cached
    changed = bytearray(data)
    changed[len(data) // 2] ^= 0xFF
    (path.parent / "almost.raw").write_bytes(bytes(changed))
    # Pin the draw so the changed byte is in a sampled range (the draw itself is secrets.randbelow).
    monkeypatch.setattr(images_mod.secrets, "randbelow", lambda n: min(len(data) // 2, n - 1))
    assert _refusal(cache, f"{base}/files/almost.raw", sha256_hex(data)).code == "digest_mismatch"


def test_hit_under_a_source_of_another_size_is_refused(cached):
    cache, base, path, data = cached
    (path.parent / "longer.raw").write_bytes(data + b"x")
    assert _refusal(cache, f"{base}/files/longer.raw", sha256_hex(data)).code == "digest_mismatch"


def test_hit_under_another_url_serving_the_same_bytes_is_proven_by_ranges(cached):
    cache, base, path, data = cached
    shutil.copy(path, path.parent / "mirror.raw")
    hit = fetch_image(cache, f"{base}/files/mirror.raw", sha256_hex(data))
    assert hit.source_proof == "ranges" and cache.hits == 1 and cache.misses == 1


def test_hit_under_a_server_without_ranges_is_proven_by_reading_it_whole_and_written_nowhere(cached):
    cache, base, path, data = cached
    before = cache_leftovers(cache)
    hit = fetch_image(cache, f"{base}/norange/disk.raw", sha256_hex(data))
    assert hit.source_proof == "full_read" and cache_leftovers(cache) == before
    (path.parent / "other.raw").write_bytes(os.urandom(len(data)))
    assert _refusal(cache, f"{base}/norange/other.raw", sha256_hex(data)).code == "digest_mismatch"
    assert cache_leftovers(cache) == before


def test_hit_under_a_missing_file_url_is_fetch_failed(cached):
    cache, base, path, data = cached
    err = _refusal(cache, (path.parent / "gone.raw").as_uri(), sha256_hex(data))
    assert err.code == "fetch_failed"


def test_hit_under_another_file_with_other_bytes_is_refused_and_the_same_bytes_served(cached):
    cache, base, path, data = cached
    (path.parent / "other.raw").write_bytes(os.urandom(len(data)))
    assert _refusal(cache, (path.parent / "other.raw").as_uri(), sha256_hex(data)).code == "digest_mismatch"
    shutil.copy(path, path.parent / "copy.raw")
    assert fetch_image(cache, (path.parent / "copy.raw").as_uri(), sha256_hex(data)).source_proof == "ranges"


def test_hit_under_the_recorded_source_reads_nothing(cached):
    cache, base, path, data = cached
    path.unlink()
    assert fetch_image(cache, path.as_uri(), sha256_hex(data)).source_proof == "recorded_source"


def test_sampled_ranges_cover_both_ends_and_stay_inside_the_image():
    for size in (1, 100, 64 << 10, (64 << 10) + 1, 5 << 20):
        ranges = sample_ranges(size)
        assert ranges[0][0] == 0 and ranges[-1][0] + ranges[-1][1] == size
        assert all(0 <= start and start + length <= size for start, length in ranges)
    assert sample_ranges(0) == []
