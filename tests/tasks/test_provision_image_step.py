"""The provision's image step: how the image will reach the disk, decided before the disk is touched, and journaled.

A raw image not yet cached is only opened here (the clone step streams it); a qcow2 is
downloaded into the cache for qemu-img; a hit names how this provision's source proved it.
Real files, the real cache and qemu-img; the run is reduced to what the step reads.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from gpuaas_agent.contract.tasks import ImageRef
from gpuaas_agent.host.images.cache import StreamedMiss
from gpuaas_agent.tasks.provision import fetch_image, unpin_image
from tests.support.image_server import cache_leftovers, image_cache, sha256_hex
from tests.support.realdev import sh


def _run(cache, url: str, digest: str):
    return SimpleNamespace(payload=SimpleNamespace(image=ImageRef(url=url, sha256=digest)),
                           drivers=SimpleNamespace(images=cache))


def test_a_raw_miss_is_opened_for_the_clone_step_and_its_undo_abandons_it(tmp_path, src_dir):
    data = os.urandom(9 << 20)
    (src_dir / "a.raw").write_bytes(data)
    cache = image_cache(tmp_path)
    run = _run(cache, (src_dir / "a.raw").as_uri(), sha256_hex(data))

    async def scenario():
        fetched = await fetch_image(run)
        journal = fetched.journal()
        assert isinstance(fetched.stream, StreamedMiss) and fetched.path is None
        assert [p for p in cache_leftovers(cache) if p.endswith(".partial")]  # the head, probed
        undone = await unpin_image(run, SimpleNamespace(output=lambda name: fetched))
        again = await asyncio.wait_for(cache.fetch_or_open(run.payload.image.url, sha256_hex(data)), timeout=10)
        assert isinstance(again, StreamedMiss)  # the lock was released: nobody waits on an abandoned stream
        again.abandon()
        return journal, undone

    journal, undone = asyncio.run(scenario())
    assert journal["delivery"] == "stream" and "one pass" in journal["why"]
    assert undone == {"image": "abandoned"} and cache_leftovers(cache) == []


def test_a_qcow2_miss_is_cached_for_qemu_img_and_the_journal_says_why(tmp_path, src_dir):
    sh("qemu-img", "create", "-q", "-f", "qcow2", str(src_dir / "a.qcow2"), "64M")
    digest = sha256_hex((src_dir / "a.qcow2").read_bytes())
    cache = image_cache(tmp_path)
    fetched = asyncio.run(fetch_image(_run(cache, (src_dir / "a.qcow2").as_uri(), digest)))
    journal = fetched.journal()
    assert fetched.stream is None and fetched.path is not None
    assert journal["delivery"] == "cache_then_clone" and "qcow2 needs random access" in journal["why"]
    assert cache.pinned() == {digest}  # held for the clone, as before
    fetched.pin.release()
    assert cache.pinned() == set()


def test_a_hit_journals_how_the_source_answered_for_it(tmp_path, src_dir):
    data = os.urandom(1 << 20)
    (src_dir / "a.raw").write_bytes(data)
    (src_dir / "copy.raw").write_bytes(data)
    cache = image_cache(tmp_path)
    asyncio.run(cache.fetch((src_dir / "a.raw").as_uri(), sha256_hex(data)))
    fetched = asyncio.run(fetch_image(_run(cache, (src_dir / "copy.raw").as_uri(), sha256_hex(data))))
    assert fetched.journal()["delivery"] == "cache_hit" and fetched.journal()["source_proof"] == "ranges"
    fetched.pin.release()
