"""Image cache: real files, a real HTTPS server on 127.0.0.1, real qemu-img, a real full tmpfs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuaas_agent.contract.images import CacheEntryMarker, ImageFormat
from gpuaas_agent.errors import ContractError
from gpuaas_agent.host import images as images_mod
from gpuaas_agent.host.images import ImageCache, ImageCacheError, sha256_file
from gpuaas_agent.host.run import run

# A tiny HTTPS server in its own process (stopped by PID). Paths:
#   /files/NAME     the file
#   /short/NAME     announces 4096 bytes more than it sends, then closes (truncated transfer)
#   /redirect/NAME  302 to /files/NAME
SERVER = r"""
import http.server, os, shutil, ssl, sys
root, cert, key, portfile = sys.argv[1:5]

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        kind, _, name = self.path.lstrip("/").partition("/")
        path = os.path.join(root, os.path.basename(name))
        if kind == "redirect":
            self.send_response(302); self.send_header("Location", "/files/" + name)
            self.send_header("Content-Length", "0"); self.end_headers(); return
        if kind not in ("files", "short") or not os.path.isfile(path):
            self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers(); return
        size = os.path.getsize(path)
        self.send_response(200)
        self.send_header("Content-Length", str(size + (4096 if kind == "short" else 0)))
        self.end_headers()
        with open(path, "rb") as fh:
            shutil.copyfileobj(fh, self.wfile)
        if kind == "short":
            self.close_connection = True

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
with open(portfile + ".tmp", "w") as fh:
    fh.write(str(server.server_address[1]))
os.replace(portfile + ".tmp", portfile)
server.serve_forever()
"""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fetch(cache: ImageCache, url: str, digest: str, **kw):
    return asyncio.run(cache.fetch(url, digest, **kw))


def _leftovers(cache: ImageCache) -> list[str]:
    return sorted(p.name for p in cache.entries.iterdir()) if cache.entries.exists() else []


@pytest.fixture
def raw_image(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(3 * (1 << 20) + 12345)  # not a multiple of the chunk size
    path = tmp_path / "src" / "disk.raw"
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


@pytest.fixture
def https_server(tmp_path, raw_image):
    """(base URL, ssl context trusting only the throwaway CA); the server is killed by PID."""
    tls = tmp_path / "tls"
    tls.mkdir()
    cert, key = tls / "cert.pem", tls / "key.pem"
    asyncio.run(run([
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1",
    ], timeout=30))
    portfile = tmp_path / "port"
    argv = [sys.executable, "-c", SERVER, str(raw_image[0].parent), str(cert), str(key), str(portfile)]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 10
        while not portfile.exists():
            assert proc.poll() is None, "test HTTPS server exited"
            assert time.monotonic() < deadline, "test HTTPS server did not start"
            time.sleep(0.02)
        context = ssl.create_default_context(cafile=str(cert))
        yield f"https://127.0.0.1:{portfile.read_text()}", context
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# -- file:// --------------------------------------------------------------------------------


def test_file_fetch_is_verified_and_stored_under_its_digest(tmp_path, raw_image):
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")
    image = _fetch(cache, path.as_uri(), _sha(data))
    assert image.path == str(tmp_path / "cache" / "sha256" / _sha(data))
    assert Path(image.path).read_bytes() == data
    assert (image.sha256, image.size_bytes, image.format) == (_sha(data), len(data), ImageFormat.raw)
    marker = CacheEntryMarker.model_validate_json(cache.marker_path(_sha(data)).read_bytes())
    assert (marker.sha256, marker.size_bytes, marker.source_url) == (_sha(data), len(data), path.as_uri())
    assert _leftovers(cache) == [_sha(data), f"{_sha(data)}.verified.json"]


def test_cache_hit_does_not_hash_or_read_the_source_again(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")
    first = _fetch(cache, path.as_uri(), _sha(data))
    path.unlink()  # the source is gone: a hit must not need it

    def no_hashing(*args, **kwargs):
        raise AssertionError("a cache hit hashed the image again")

    monkeypatch.setattr(images_mod, "sha256_stream", no_hashing)
    assert _fetch(cache, path.as_uri(), _sha(data).upper()) == first


def test_image_without_marker_is_not_trusted(tmp_path, raw_image):
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")
    cache.entries.mkdir(parents=True)
    cache.image_path(_sha(data)).write_bytes(b"not the image")
    assert cache.lookup(_sha(data)) is None
    image = _fetch(cache, path.as_uri(), _sha(data))
    assert Path(image.path).read_bytes() == data


def test_digest_mismatch_deletes_the_partial(tmp_path, raw_image):
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, path.as_uri(), _sha(b"something else"))
    assert err.value.code == "digest_mismatch"
    assert err.value.evidence["actual_sha256"] == _sha(data)
    assert _leftovers(cache) == []


def test_missing_file_source_is_fetch_failed(tmp_path):
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, (tmp_path / "nope.raw").as_uri(), _sha(b""))
    assert err.value.code == "fetch_failed"
    assert _leftovers(cache) == []


def test_file_that_shrinks_while_read_is_truncated(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")
    real_open = images_mod._open_file

    def open_then_truncate(file_path, url):
        source = real_open(file_path, url)
        os.truncate(file_path, 1 << 20)  # the source vanishes under us after stat
        return source

    monkeypatch.setattr(images_mod, "_open_file", open_then_truncate)
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, path.as_uri(), _sha(data))
    assert err.value.code == "truncated"
    assert (err.value.evidence["expected_bytes"], err.value.evidence["received_bytes"]) == (len(data), 1 << 20)
    assert _leftovers(cache) == []


@pytest.mark.parametrize("url", ["ftp://example.com/x.raw", "http://images.example.com/x.raw", "/tmp/x.raw",
                                 "file://otherhost/x.raw"])
def test_unsupported_urls_are_refused(tmp_path, url):
    with pytest.raises(ImageCacheError) as err:
        _fetch(ImageCache(tmp_path / "cache"), url, _sha(b""))
    assert err.value.code == "unsupported_url"


def test_malformed_digest_is_a_contract_error(tmp_path, raw_image):
    with pytest.raises(ContractError) as err:
        _fetch(ImageCache(tmp_path / "cache"), raw_image[0].as_uri(), "sha256:abc")
    assert err.value.code == "invalid_digest"


def test_max_bytes_refuses_a_larger_image(tmp_path, raw_image):
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, path.as_uri(), _sha(data), max_bytes=1 << 20)
    assert err.value.code == "too_large"
    assert _leftovers(cache) == []


def test_download_past_its_deadline_is_fetch_timeout(tmp_path, raw_image, monkeypatch):
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")

    def endless_slow_source(file_path, url):
        def read_into(buf):
            time.sleep(0.02)
            buf[:4096] = b"x" * 4096
            return 4096

        return images_mod._Source(read_into, None, lambda: None, {"url": url})

    monkeypatch.setattr(images_mod, "_open_file", endless_slow_source)
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, path.as_uri(), _sha(data), timeout_s=0.3)
    assert err.value.code == "fetch_timeout"
    assert _leftovers(cache) == []


# -- formats (real qemu-img) ----------------------------------------------------------------


def _qemu_img(*argv: str) -> None:
    asyncio.run(run(["qemu-img", *argv], timeout=30))


def test_qcow2_is_accepted(tmp_path):
    src = tmp_path / "disk.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", str(src), "64M")
    image = _fetch(ImageCache(tmp_path / "cache"), src.as_uri(), sha256_file(src))
    assert image.format == ImageFormat.qcow2


def test_other_formats_are_refused_and_not_cached(tmp_path):
    src = tmp_path / "disk.vmdk"
    _qemu_img("create", "-q", "-f", "vmdk", str(src), "64M")
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, src.as_uri(), sha256_file(src))
    assert (err.value.code, err.value.evidence["format"]) == ("unknown_format", "vmdk")
    assert _leftovers(cache) == []


def test_qcow2_with_a_backing_file_is_refused(tmp_path):
    base, top = tmp_path / "base.raw", tmp_path / "top.qcow2"
    base.write_bytes(b"\0" * 65536)
    _qemu_img("create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(top))
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, top.as_uri(), sha256_file(top))
    assert err.value.code == "backing_file_refused"
    assert err.value.evidence["backing_filename"] == str(base)
    assert _leftovers(cache) == []


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


def test_full_cache_is_cache_full_and_leaves_no_partial(tiny_cache_fs, raw_image):
    path, data = raw_image
    cache = ImageCache(tiny_cache_fs)
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, path.as_uri(), _sha(data))
    assert err.value.code == "cache_full"
    assert _leftovers(cache) == []
    assert os.statvfs(tiny_cache_fs).f_bfree == os.statvfs(tiny_cache_fs).f_blocks  # space given back


# -- https (real TLS server, CA given explicitly) --------------------------------------------


def test_https_fetch_verifies_and_caches(tmp_path, raw_image, https_server):
    base, context = https_server
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache", ssl_context=context)
    image = _fetch(cache, f"{base}/files/{path.name}", _sha(data))
    assert Path(image.path).read_bytes() == data and image.source_url == f"{base}/files/{path.name}"


def test_https_redirect_is_followed(tmp_path, raw_image, https_server):
    base, context = https_server
    path, data = raw_image
    image = _fetch(ImageCache(tmp_path / "cache", ssl_context=context), f"{base}/redirect/{path.name}", _sha(data))
    assert image.size_bytes == len(data)


def test_https_server_without_trusted_ca_is_fetch_failed(tmp_path, raw_image, https_server):
    base, _ = https_server
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache")  # system CAs only: the throwaway cert is not trusted
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, f"{base}/files/{path.name}", _sha(data))
    assert err.value.code == "fetch_failed"
    assert "CERTIFICATE_VERIFY_FAILED" in err.value.evidence["error"]


def test_https_404_is_fetch_failed(tmp_path, https_server):
    base, context = https_server
    with pytest.raises(ImageCacheError) as err:
        _fetch(ImageCache(tmp_path / "cache", ssl_context=context), f"{base}/files/absent.raw", _sha(b""))
    assert (err.value.code, err.value.evidence["http_status"]) == ("fetch_failed", 404)


def test_https_body_shorter_than_content_length_is_truncated(tmp_path, raw_image, https_server):
    base, context = https_server
    path, data = raw_image
    cache = ImageCache(tmp_path / "cache", ssl_context=context)
    with pytest.raises(ImageCacheError) as err:
        _fetch(cache, f"{base}/short/{path.name}", _sha(data))
    assert err.value.code == "truncated"
    assert _leftovers(cache) == []


def test_connection_refused_is_fetch_failed(tmp_path):
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ImageCacheError) as err:
        _fetch(ImageCache(tmp_path / "cache"), f"https://127.0.0.1:{port}/x.raw", _sha(b""))
    assert err.value.code == "fetch_failed"
    assert "ConnectionRefusedError" in err.value.evidence["error"]
