"""Image cache: real files, FIFOs, symlinks and a loop device, a real HTTPS server on 127.0.0.1,
real qemu-img, a real full tmpfs."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from gpuaas_agent.contract.images import CacheEntryMarker, ImageFormat
from gpuaas_agent.errors import ContractError
from gpuaas_agent.host.images import cache as images_mod
from gpuaas_agent.host.images.cache import ImageCache, ImageCacheError, SourcePolicy, sha256_file
from gpuaas_agent.host.run import run
from tests.support.image_server import cache_leftovers, fetch_image, image_cache, sha256_hex


def _wait_for(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # poll step of a deadline wait
    return value


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("image-fetch-")]


def _open_partials() -> list[str]:
    """Descriptors of this process still open on a download in flight (a thread still writing)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if ".partial" in target:
            found.append(target)
    return found


# -- file:// --------------------------------------------------------------------------------


def test_file_fetch_is_verified_and_stored_under_its_digest(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    image = fetch_image(cache, path.as_uri(), sha256_hex(data))
    assert image.path == str(tmp_path / "cache" / "sha256" / sha256_hex(data))
    assert Path(image.path).read_bytes() == data
    assert (image.sha256, image.size_bytes, image.format) == (sha256_hex(data), len(data), ImageFormat.raw)
    marker = CacheEntryMarker.model_validate_json(cache.marker_path(sha256_hex(data)).read_bytes())
    assert (marker.sha256, marker.size_bytes, marker.source_url) == (sha256_hex(data), len(data), path.as_uri())
    assert cache_leftovers(cache) == [sha256_hex(data), f"{sha256_hex(data)}.verified.json"]


def test_symlink_inside_the_image_dir_to_an_image_there_is_followed(tmp_path, raw_image):
    path, data = raw_image
    (path.parent / "current.raw").symlink_to(path.name)
    image = fetch_image(image_cache(tmp_path), (path.parent / "current.raw").as_uri(), sha256_hex(data))
    assert Path(image.path).read_bytes() == data


def test_cache_hit_does_not_hash_or_read_the_source_again(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    cache = image_cache(tmp_path)
    first = fetch_image(cache, path.as_uri(), sha256_hex(data))
    path.unlink()  # the source is gone: a hit must not need it

    def no_hashing(*args, **kwargs):
        raise AssertionError("a cache hit hashed the image again")

    monkeypatch.setattr(images_mod, "sha256_stream", no_hashing)
    again = fetch_image(cache, path.as_uri(), sha256_hex(data).upper())
    assert again == first.model_copy(update={"source_proof": "recorded_source"})


def test_cache_hit_under_a_refused_url_is_refused(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    fetch_image(cache, path.as_uri(), sha256_hex(data))
    for url in ("file:///dev/zero", (tmp_path / "state" / "enrollment.json").as_uri()):
        with pytest.raises(ImageCacheError) as err:
            fetch_image(cache, url, sha256_hex(data))  # the digest is cached: the answer must not depend on it
        assert (err.value.code, err.value.evidence["rule"]) == ("image_url_refused", "forbidden_path")


def test_image_without_marker_is_not_trusted(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    cache.entries.mkdir(parents=True)
    cache.image_path(sha256_hex(data)).write_bytes(b"not the image")
    assert cache.lookup(sha256_hex(data)) is None
    image = fetch_image(cache, path.as_uri(), sha256_hex(data))
    assert Path(image.path).read_bytes() == data


def test_digest_mismatch_deletes_the_partial_and_never_reveals_what_was_read(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(b"something else"))
    assert err.value.code == "digest_mismatch"
    # Only what the task itself said: no digest or size of the content that was read.
    assert err.value.evidence == {"url": path.as_uri(), "expected_sha256": sha256_hex(b"something else")}
    assert sha256_hex(data) not in repr(err.value.evidence) + str(err.value)
    assert str(len(data)) not in repr(err.value.evidence) + str(err.value)
    assert cache_leftovers(cache) == []


def test_missing_file_source_is_fetch_failed(tmp_path, src_dir):
    cache = image_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, (src_dir / "nope.raw").as_uri(), sha256_hex(b""))
    assert err.value.code == "fetch_failed"
    assert cache_leftovers(cache) == []


def test_file_that_shrinks_while_read_is_truncated(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    cache = image_cache(tmp_path)
    real_open = images_mod._open_file

    def open_then_truncate(policy, file_path, url):
        source = real_open(policy, file_path, url)
        os.truncate(file_path, 1 << 20)  # the source vanishes under us after stat
        return source

    monkeypatch.setattr(images_mod, "_open_file", open_then_truncate)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data))
    assert err.value.code == "truncated"
    assert (err.value.evidence["expected_bytes"], err.value.evidence["received_bytes"]) == (len(data), 1 << 20)
    assert cache_leftovers(cache) == []


def test_malformed_digest_is_a_contract_error(tmp_path, raw_image):
    with pytest.raises(ContractError) as err:
        fetch_image(image_cache(tmp_path), raw_image[0].as_uri(), "sha256:abc")
    assert err.value.code == "invalid_digest"


def test_download_past_its_deadline_is_fetch_timeout(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    cache = image_cache(tmp_path)

    def endless_slow_source(policy, file_path, url):
        def read_into(buf):
            time.sleep(0.02)  # a slow source, not synchronisation
            buf[:4096] = b"x" * 4096
            return 4096

        return images_mod._Source(read_into, None, lambda: None, {"url": url})

    monkeypatch.setattr(images_mod, "_open_file", endless_slow_source)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data), timeout_s=0.3)
    assert err.value.code == "fetch_timeout"
    _wait_for(lambda: not _fetch_threads(), "the copy thread to stop")
    assert cache_leftovers(cache) == [] and _open_partials() == []


# -- where an image may come from: refused before anything is opened --------------------------


@pytest.fixture
def loop_device(tmp_path):
    """A real, attached loop device (a block device under /dev), detached afterwards."""
    backing = tmp_path / "tenant-b-disk.img"
    backing.write_bytes(b"tenant B secret " * 65536)
    done = asyncio.run(run(["losetup", "--find", "--show", str(backing)], timeout=30, check=False))
    if done.returncode != 0:
        pytest.fail(f"cannot attach a loop device (the test needs root): {done.stderr.decode().strip()}")
    dev = done.stdout.decode().strip()
    try:
        assert stat.S_ISBLK(os.stat(dev).st_mode)
        yield Path(dev), backing
    finally:
        asyncio.run(run(["losetup", "--detach", dev], timeout=30))


def _refused(cache: ImageCache, url: str, digest: str = "0" * 64, **kw) -> dict:
    """Fetch must be refused as image_url_refused with nothing in the cache; returns the evidence."""
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, url, digest, **kw)
    assert err.value.code == "image_url_refused", (err.value.code, err.value.message)
    first = err.value.evidence.get("redirected_from", err.value.evidence["url"])
    assert first == url and set(err.value.evidence) <= {"url", "rule", "redirected_from"}
    assert cache_leftovers(cache) == []
    assert "\n" not in err.value.message
    return err.value.evidence


def test_dev_zero_is_refused(tmp_path, src_dir):
    assert _refused(image_cache(tmp_path), "file:///dev/zero")["rule"] == "forbidden_path"


def test_dev_zero_is_refused_even_with_the_image_dir_set_to_dev(tmp_path):
    cache = ImageCache(tmp_path / "cache", policy=SourcePolicy(file_dir=Path("/dev")))
    assert _refused(cache, "file:///dev/zero")["rule"] == "forbidden_path"


def test_by_id_like_symlink_in_the_image_dir_to_a_block_device_is_refused(tmp_path, src_dir, loop_device):
    dev, backing = loop_device
    link = src_dir / "nvme-TENANT_B_DISK"
    link.symlink_to(dev)
    digest = sha256_file(backing)  # even with the right digest, the disk never reaches the cache
    assert _refused(image_cache(tmp_path), link.as_uri(), digest)["rule"] == "forbidden_path"


def test_device_node_inside_the_image_dir_is_refused(tmp_path, src_dir, loop_device):
    dev, backing = loop_device
    node = src_dir / "disk.raw"
    os.mknod(node, 0o600 | stat.S_IFBLK, os.stat(dev).st_rdev)  # the same block device, outside /dev
    assert _refused(image_cache(tmp_path), node.as_uri(), sha256_file(backing))["rule"] == "not_regular_file"


def test_symlink_escaping_the_image_dir_is_refused(tmp_path, src_dir):
    outside = tmp_path / "outside.raw"
    outside.write_bytes(b"not an image of the dir")
    (src_dir / "escape.raw").symlink_to(outside)
    evidence = _refused(image_cache(tmp_path), (src_dir / "escape.raw").as_uri(), sha256_hex(outside.read_bytes()))
    assert evidence["rule"] == "outside_image_dir"


def test_symlinked_directory_then_dotdot_is_resolved_before_the_check(tmp_path, src_dir):
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "secret.raw").write_bytes(b"secret")
    (src_dir / "link").symlink_to(tmp_path / "deep" / "er")
    # Spelled inside the dir, but link/.. is tmp_path/deep: tmp_path/deep/../secret.raw is outside.
    url = f"file://{src_dir}/link/../../secret.raw"
    assert _refused(image_cache(tmp_path), url, sha256_hex(b"secret"))["rule"] == "outside_image_dir"


@pytest.mark.parametrize("spelling", ["{src}/../outside.raw", "{src}/%2e%2e/outside.raw", "{src}/%2E%2E/outside.raw",
                                      "{src}/sub/../../outside.raw", "{src}%2f..%2foutside.raw"])
def test_traversal_out_of_the_image_dir_is_refused(tmp_path, src_dir, spelling):
    outside = tmp_path / "outside.raw"
    outside.write_bytes(b"outside")
    (src_dir / "sub").mkdir()
    url = "file://" + spelling.format(src=src_dir)
    assert _refused(image_cache(tmp_path), url, sha256_hex(b"outside"))["rule"] == "outside_image_dir"


def test_hard_link_in_the_image_dir_is_refused_and_nothing_is_cached(tmp_path, src_dir):
    """A second name, inside the dir, of a file outside it (another tenant's upload, a key) passes every
    path rule; st_nlink gives it away."""
    secret = tmp_path / "secret.raw"
    secret.write_bytes(b"another tenant's private image")
    os.link(secret, src_dir / "innocent.raw")
    cache = image_cache(tmp_path)
    evidence = _refused(cache, (src_dir / "innocent.raw").as_uri(), sha256_hex(secret.read_bytes()))
    assert evidence["rule"] == "hard_linked_file"
    assert cache.lookup(sha256_hex(secret.read_bytes())) is None


def test_file_hard_linked_after_the_check_is_refused_on_the_descriptor(tmp_path, src_dir):
    from gpuaas_agent.host.images import source as imagesource

    image = src_dir / "plain.raw"
    image.write_bytes(b"plain")
    policy = SourcePolicy(file_dir=src_dir)
    os.link(image, tmp_path / "elsewhere.raw")  # a second name appears between the check and the open
    with pytest.raises(ImageCacheError) as refused:
        imagesource.open_file(policy, str(image), image.as_uri())
    assert refused.value.evidence["rule"] == "hard_linked_file"


def test_fifo_in_the_image_dir_is_refused_without_blocking(tmp_path, src_dir):
    os.mkfifo(src_dir / "pipe.raw")  # opening it for reading would block until a writer came
    started = time.monotonic()
    assert _refused(image_cache(tmp_path), (src_dir / "pipe.raw").as_uri())["rule"] == "not_regular_file"
    assert time.monotonic() - started < 5


def test_directory_is_refused(tmp_path, src_dir):
    (src_dir / "images.d").mkdir()
    assert _refused(image_cache(tmp_path), (src_dir / "images.d").as_uri())["rule"] == "not_regular_file"
    assert _refused(image_cache(tmp_path), src_dir.as_uri())["rule"] == "outside_image_dir"  # the dir itself


def test_enrollment_credentials_in_the_state_dir_are_refused(tmp_path, src_dir):
    state = tmp_path / "state"
    state.mkdir()
    (state / "enrollment.json").write_text('{"nats_password": "secret"}')
    digest = sha256_hex((state / "enrollment.json").read_bytes())
    assert _refused(image_cache(tmp_path), (state / "enrollment.json").as_uri(), digest)["rule"] == "forbidden_path"
    # Also when the image dir is set to include the state dir (a misconfiguration), and by a symlink.
    cache = ImageCache(tmp_path / "cache", policy=SourcePolicy(file_dir=tmp_path), state_dir=state)
    assert _refused(cache, (state / "enrollment.json").as_uri(), digest)["rule"] == "forbidden_path"
    (src_dir / "creds.raw").symlink_to(state / "enrollment.json")
    assert _refused(cache, (src_dir / "creds.raw").as_uri(), digest)["rule"] == "forbidden_path"


def test_the_cache_itself_is_never_a_source(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path, root=path.parent / "cache")  # a cache inside the image dir (misconfigured)
    fetch_image(cache, path.as_uri(), sha256_hex(data))
    entry = cache.image_path(sha256_hex(data))
    other = "1" * 64
    for url in (entry.as_uri(), (path.parent / "cache").as_uri(), cache.marker_path(sha256_hex(data)).as_uri()):
        with pytest.raises(ImageCacheError) as err:
            fetch_image(cache, url, other)
        assert (err.value.code, err.value.evidence["rule"]) == ("image_url_refused", "forbidden_path")
    assert cache_leftovers(cache) == [sha256_hex(data), f"{sha256_hex(data)}.verified.json"]


def _swap_before_open(monkeypatch, swap) -> None:
    """Run ``swap`` between the URL check and the open: what a racing writer of the image dir could do."""
    real_open = images_mod._open_file

    def swapped(policy, file_path, url):
        swap()
        return real_open(policy, file_path, url)

    monkeypatch.setattr(images_mod, "_open_file", swapped)


def test_file_swapped_for_a_fifo_after_the_check_is_refused(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    _swap_before_open(monkeypatch, lambda: (path.unlink(), os.mkfifo(path)))
    assert _refused(image_cache(tmp_path), path.as_uri(), sha256_hex(data))["rule"] == "not_regular_file"


def test_file_swapped_for_a_symlink_after_the_check_is_refused(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    _swap_before_open(monkeypatch, lambda: (path.unlink(), path.symlink_to("/dev/zero")))
    assert _refused(image_cache(tmp_path), path.as_uri(), sha256_hex(data))["rule"] == "not_regular_file"


def test_directory_swapped_for_a_symlink_to_the_state_dir_after_the_check_is_refused(tmp_path, src_dir,
                                                                                     monkeypatch):
    (src_dir / "sub").mkdir()
    (src_dir / "sub" / "enrollment.json").write_bytes(b"an image")
    state = tmp_path / "state"
    state.mkdir()
    (state / "enrollment.json").write_bytes(b"an image")  # same bytes: only the location refuses it

    def swap():
        (src_dir / "sub").rename(tmp_path / "old-sub")
        (src_dir / "sub").symlink_to(state)

    _swap_before_open(monkeypatch, swap)
    url = (src_dir / "sub" / "enrollment.json").as_uri()
    assert _refused(image_cache(tmp_path), url, sha256_hex(b"an image"))["rule"] == "forbidden_path"


def test_file_urls_are_refused_when_no_image_dir_is_configured(tmp_path, raw_image):
    path, data = raw_image
    assert _refused(ImageCache(tmp_path / "cache"), path.as_uri(), sha256_hex(data))["rule"] == "scheme"


@pytest.mark.parametrize("url,rule", [
    ("file://otherhost{src}/disk.raw", "host_not_allowed"),
    ("file://localhost{src}/disk.raw", "host_not_allowed"),
    ("FILE://{src}/disk.raw", "scheme"),
    ("File://{src}/disk.raw", "scheme"),
    (" file://{src}/disk.raw", "scheme"),
    ("file:{src}/disk.raw", "scheme"),
    ("fi\tle://{src}/disk.raw", "scheme"),
    ("HTTPS://images.example.com/disk.raw", "scheme"),
    ("ftp://images.example.com/disk.raw", "scheme"),
    ("{src}/disk.raw", "scheme"),
    ("file://{src}/disk.raw?x=1", "malformed_url"),
    ("file://{src}/disk%00.raw", "malformed_url"),
    ("file://{src}/disk.raw\n", "malformed_url"),
    ("https://images.example.com/disk.raw", "host_not_allowed"),
    ("https://127.0.0.1:1/disk.raw", "host_not_allowed"),
    ("https://user:pw@127.0.0.1:443/disk.raw", "host_not_allowed"),
    ("https://127.0.0.1:99999/disk.raw", "malformed_url"),
    ("http://127.0.0.1/disk.raw", "scheme"),
])
def test_urls_outside_the_policy_are_refused(tmp_path, raw_image, url, rule):
    url = url.format(src=raw_image[0].parent)
    cache = image_cache(tmp_path, hosts=("127.0.0.1",))
    assert _refused(cache, url, sha256_hex(raw_image[1]))["rule"] == rule


@pytest.mark.parametrize("url,rule", [
    ("http://10.0.0.1/disk.raw", "host_not_allowed"),
    ("http://images.example.com/disk.raw", "host_not_allowed"),
    ("http://127.0.0.1.example.com/disk.raw", "host_not_allowed"),
])
def test_loopback_http_never_reaches_another_host(tmp_path, url, rule):
    cache = image_cache(tmp_path, allow_loopback_http=True)
    assert _refused(cache, url)["rule"] == rule


def test_https_host_not_in_the_list_is_refused_before_connecting(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=("images.example.com", "127.0.0.1"), ssl_context=context)  # not this port
    assert _refused(cache, f"{base}/files/{path.name}", sha256_hex(data))["rule"] == "host_not_allowed"


def test_https_redirect_to_a_host_not_in_the_list_is_refused(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context)
    evidence = _refused(cache, f"{base}/away/{path.name}", sha256_hex(data))
    assert evidence == {"url": f"https://localhost:{host.split(':')[1]}/files/{path.name}",
                        "rule": "host_not_allowed", "redirected_from": f"{base}/away/{path.name}"}


def test_https_redirect_to_a_file_url_is_refused(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context)  # file:// of the image dir is allowed directly
    evidence = _refused(cache, f"{base}/tofile/{path.name}", sha256_hex(data))
    assert (evidence["rule"], evidence["url"]) == ("scheme", path.as_uri())


# -- size bounds ------------------------------------------------------------------------------


def test_configured_max_bytes_refuses_a_larger_file(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path, max_bytes=1 << 20)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data))
    assert (err.value.code, err.value.evidence["max_bytes"]) == ("too_large", 1 << 20)
    assert cache_leftovers(cache) == []


def test_caller_max_bytes_only_lowers_the_configured_bound(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path, max_bytes=1 << 20)
    assert cache.bound(max_bytes=1 << 30) == 1 << 20 and cache.bound(size_bytes=10) == 10
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data), max_bytes=1 << 30)
    assert err.value.code == "too_large"


def test_declared_size_shorter_than_the_file_is_too_large(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data), size_bytes=len(data) - 1)
    assert (err.value.code, err.value.evidence["max_bytes"]) == ("too_large", len(data) - 1)
    assert cache_leftovers(cache) == []


def test_declared_size_longer_than_the_file_is_truncated(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data), size_bytes=len(data) + 1)
    assert (err.value.code, err.value.evidence["declared_size_bytes"]) == ("truncated", len(data) + 1)
    assert cache_leftovers(cache) == []


def test_declared_size_that_matches_is_accepted_and_checked_again_on_a_hit(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    assert fetch_image(cache, path.as_uri(), sha256_hex(data), size_bytes=len(data)).size_bytes == len(data)
    for declared, code in ((len(data) + 1, "truncated"), (len(data) - 1, "too_large")):
        with pytest.raises(ImageCacheError) as err:
            fetch_image(cache, path.as_uri(), sha256_hex(data), size_bytes=declared)
        assert err.value.code == code
    assert cache_leftovers(cache) == [sha256_hex(data), f"{sha256_hex(data)}.verified.json"]  # the verified entry stays


def test_endless_source_is_cut_at_the_bound(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    cache = image_cache(tmp_path, max_bytes=8 << 20)

    def endless(policy, file_path, url):  # what /dev/zero was before the allow-list: no length, no end
        def read_into(buf):
            buf[:] = bytes(len(buf))
            return len(buf)

        return images_mod._Source(read_into, None, lambda: None, {"url": url})

    monkeypatch.setattr(images_mod, "_open_file", endless)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data))
    assert err.value.code == "too_large" and err.value.evidence["received_bytes_at_least"] > 8 << 20
    assert cache_leftovers(cache) == []


# -- formats (real qemu-img) ----------------------------------------------------------------


def _qemu_img(*argv: str) -> None:
    asyncio.run(run(["qemu-img", *argv], timeout=30))


def test_qcow2_is_accepted(tmp_path, src_dir):
    src = src_dir / "disk.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", str(src), "64M")
    image = fetch_image(image_cache(tmp_path), src.as_uri(), sha256_file(src))
    assert image.format == ImageFormat.qcow2


def test_other_formats_are_refused_and_not_cached(tmp_path, src_dir):
    src = src_dir / "disk.vmdk"
    _qemu_img("create", "-q", "-f", "vmdk", str(src), "64M")
    cache = image_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, src.as_uri(), sha256_file(src))
    assert (err.value.code, err.value.evidence["format"]) == ("unknown_format", "vmdk")
    assert cache_leftovers(cache) == []


def test_qcow2_with_a_backing_file_is_refused(tmp_path, src_dir):
    base, top = src_dir / "base.raw", src_dir / "top.qcow2"
    base.write_bytes(b"\0" * 65536)
    _qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(top))
    cache = image_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, top.as_uri(), sha256_file(top))
    assert err.value.code == "backing_file_refused"
    assert err.value.evidence["backing_filename"] == str(base)
    assert cache_leftovers(cache) == []


# -- ENOSPC on a real, tiny tmpfs ----------------------------------------------------------


@pytest.fixture
def tiny_cache_fs(tmp_path):
    mnt = tmp_path / "tinyfs"
    mnt.mkdir()
    done = asyncio.run(run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], timeout=10, check=False))
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (the test needs root): {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        asyncio.run(run(["umount", str(mnt)], timeout=10))


def test_full_cache_is_cache_full_and_leaves_no_partial(tiny_cache_fs, tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path, root=tiny_cache_fs)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data))
    assert err.value.code == "cache_full"
    assert cache_leftovers(cache) == []
    assert os.statvfs(tiny_cache_fs).f_bfree == os.statvfs(tiny_cache_fs).f_blocks  # space given back


# -- what a crashed agent left behind ---------------------------------------------------------


def test_remove_stale_partials_keeps_only_verified_entries(tmp_path, raw_image):
    path, data = raw_image
    cache = image_cache(tmp_path)
    fetch_image(cache, path.as_uri(), sha256_hex(data))
    orphan_image, orphan_marker = "a" * 64, "b" * 64
    (cache.entries / f".{'c' * 64}.x1.partial").write_bytes(b"half a download")
    cache.image_path(orphan_image).write_bytes(b"replaced, marker never written")
    cache.marker_path(orphan_marker).write_text("{}")
    assert sorted(cache.remove_stale_partials()) == sorted(
        [f".{'c' * 64}.x1.partial", orphan_image, f"{orphan_marker}.verified.json"])
    assert cache_leftovers(cache) == [sha256_hex(data), f"{sha256_hex(data)}.verified.json"]
    assert cache.remove_stale_partials() == []
    assert ImageCache(tmp_path / "never-created").remove_stale_partials() == []


def test_entry_from_a_source_the_policy_now_refuses_is_never_served_and_removed_at_start(tmp_path, raw_image):
    path, data = raw_image
    old_agent = ImageCache(tmp_path / "cache", policy=SourcePolicy(file_dir=path.parent))
    fetch_image(old_agent, path.as_uri(), sha256_hex(data))  # cached while file:// of src was allowed
    cache = ImageCache(tmp_path / "cache", policy=SourcePolicy(file_dir=tmp_path / "elsewhere"))
    assert cache.lookup(sha256_hex(data)) is None
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, path.as_uri(), sha256_hex(data))  # a miss now: the URL itself must pass
    assert (err.value.code, err.value.evidence["rule"]) == ("image_url_refused", "outside_image_dir")
    assert sorted(cache.remove_stale_partials()) == [sha256_hex(data), f"{sha256_hex(data)}.verified.json"]
    assert cache_leftovers(cache) == []


# -- https (real TLS server, CA given explicitly) --------------------------------------------


def test_https_fetch_verifies_and_caches(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context)
    image = fetch_image(cache, f"{base}/files/{path.name}", sha256_hex(data))
    assert Path(image.path).read_bytes() == data and image.source_url == f"{base}/files/{path.name}"


def test_https_redirect_inside_the_list_is_followed(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context)
    image = fetch_image(cache, f"{base}/redirect/{path.name}", sha256_hex(data), size_bytes=len(data))
    assert image.size_bytes == len(data)


def test_https_server_without_trusted_ca_is_fetch_failed(tmp_path, raw_image, https_server):
    base, _, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,))  # system CAs only: the throwaway cert is not trusted
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/files/{path.name}", sha256_hex(data))
    assert err.value.code == "fetch_failed"
    assert "CERTIFICATE_VERIFY_FAILED" in err.value.evidence["error"]


def test_https_404_is_fetch_failed(tmp_path, https_server):
    base, context, host = https_server
    with pytest.raises(ImageCacheError) as err:
        fetch_image(image_cache(tmp_path, hosts=(host,), ssl_context=context), f"{base}/files/absent.raw", sha256_hex(b""))
    assert (err.value.code, err.value.evidence["http_status"]) == ("fetch_failed", 404)


def test_https_body_shorter_than_content_length_is_truncated(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/short/{path.name}", sha256_hex(data))
    assert err.value.code == "truncated"
    assert cache_leftovers(cache) == []


def test_https_announcing_more_than_the_bound_is_too_large_before_reading(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context, max_bytes=1 << 20)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/files/{path.name}", sha256_hex(data))
    assert (err.value.code, err.value.evidence["length"]) == ("too_large", len(data))
    assert cache_leftovers(cache) == []


def test_https_streaming_more_than_the_bound_is_too_large(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context, max_bytes=1 << 20)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/nolength/{path.name}", sha256_hex(data))  # no Content-Length to refuse up front
    assert err.value.code == "too_large" and "length" not in err.value.evidence
    assert cache_leftovers(cache) == []


def test_https_streaming_fewer_bytes_than_declared_is_truncated(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/nolength/{path.name}", sha256_hex(data), size_bytes=len(data) + 4096)
    assert (err.value.code, err.value.evidence["received_bytes"]) == ("truncated", len(data))
    assert cache_leftovers(cache) == []
    assert fetch_image(cache, f"{base}/nolength/{path.name}", sha256_hex(data), size_bytes=len(data)).size_bytes == len(data)


def test_https_stalled_transfer_is_fetch_stalled_and_its_thread_ends(tmp_path, raw_image, https_server):
    base, context, host = https_server
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context, stall_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/stall/{path.name}", sha256_hex(data))  # 64 KiB, then silence on an open connection
    elapsed = time.monotonic() - started
    assert err.value.code == "fetch_stalled" and err.value.evidence["stall_timeout_s"] == 0.5
    assert 0.5 <= elapsed < 5, elapsed
    assert cache_leftovers(cache) == []
    _wait_for(lambda: not _fetch_threads(), "the copy thread to stop", timeout=5)
    assert _open_partials() == [] and cache_leftovers(cache) == []  # and nothing was written after the error


def test_connection_refused_is_fetch_failed(tmp_path):
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ImageCacheError) as err:
        fetch_image(image_cache(tmp_path, hosts=(f"127.0.0.1:{port}",)), f"https://127.0.0.1:{port}/x.raw", sha256_hex(b""))
    assert err.value.code == "fetch_failed"
    assert "curl exit 7" in err.value.evidence["error"]  # curl's "couldn't connect", retried then given up
    assert err.value.evidence["attempts"] == 4
