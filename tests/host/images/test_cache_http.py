"""Image downloads through httpx (issue #22): resume after a dropped connection, proxies, the CA bundle.

Real servers on loopback, started in the test: an HTTP server that drops the connection
in the middle of the body and answers range requests (or refuses them), a forward proxy
that also tunnels CONNECT, and the throwaway-CA HTTPS server of tests/host/images/test_cache.py.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuaas_agent.config import ConfigError, load_config
from gpuaas_agent.host.images.cache import ImageCacheError
from gpuaas_agent.host.images.httpfetch import declared_length, resume_headers, resume_validator, resumes_at
from gpuaas_agent.tasks.drivers import SliceDrivers
from tests.support.image_server import cache_leftovers, fetch_image, image_cache, sha256_hex

BODY = os.urandom((5 << 20) + 777)  # several chunks, not a multiple of the chunk size
ETAG = '"v1-' + hashlib.sha256(BODY).hexdigest()[:16] + '"'


@dataclass
class Origin:
    """What the origin does and what it saw; handlers read and write it under ``lock``."""

    drops: int = 0  # how many times to cut the body off after ``drop_at`` bytes
    drop_at: int = 1 << 20
    ranges: bool = True  # honour Range (206); otherwise answer 200 with the whole body again
    unavailable: int = 0  # answer this many requests with 503 first
    requests: list[dict] = field(default_factory=list)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _origin_handler(state: Origin):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            with state.lock:
                state.requests.append({"path": self.path, "range": self.headers.get("Range"),
                                       "if_range": self.headers.get("If-Range"), "host": self.headers.get("Host")})
                drop = state.drops > 0
                if drop:
                    state.drops -= 1
                busy = state.unavailable > 0
                if busy:
                    state.unavailable -= 1
            if busy:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path.startswith("/away"):
                self.send_response(302)
                self.send_header("Location", "http://10.0.0.1/disk.raw")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = 0
            wanted = self.headers.get("Range")
            if wanted and state.ranges and self.headers.get("If-Range") == ETAG:
                start = int(wanted.removeprefix("bytes=").rstrip("-"))
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(BODY) - 1}/{len(BODY)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(BODY) - start))
            self.send_header("ETag", ETAG)
            self.end_headers()
            end = min(len(BODY), start + state.drop_at) if drop else len(BODY)
            self.wfile.write(BODY[start:end])
            self.wfile.flush()
            with state.lock:
                state.sent += end - start
            if drop:
                # The connection drops mid-body: shut the socket down under the client.
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


@pytest.fixture
def origin() -> Iterator[tuple[str, Origin]]:
    state = Origin()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _origin_handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="test-origin", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _http_cache(tmp_path: Path, **kw):
    cache = image_cache(tmp_path, allow_loopback_http=True, **kw)
    cache.http_backoff_s = 0.01  # the backoff's length is not what these tests measure
    return cache


def test_a_dropped_connection_resumes_with_range_and_each_byte_is_fetched_and_hashed_once(tmp_path, origin):
    base, state = origin
    state.drops, state.drop_at = 2, (1 << 20) + 3
    cache = _http_cache(tmp_path)
    image = fetch_image(cache, f"{base}/disk.raw", sha256_hex(BODY))
    assert Path(image.path).read_bytes() == BODY and image.sha256 == sha256_hex(BODY)
    # Three requests: the first, then two resumes each starting at the byte the previous one stopped at.
    assert [r["range"] for r in state.requests] == [None, f"bytes={state.drop_at}-", f"bytes={2 * state.drop_at}-"]
    assert [r["if_range"] for r in state.requests] == [None, ETAG, ETAG]
    # The server sent every byte exactly once: nothing was downloaded (or hashed) twice.
    assert state.sent == len(BODY)
    assert cache_leftovers(cache) == [image.sha256, f"{image.sha256}.verified.json"]


def test_a_server_that_cannot_resume_is_truncated_and_leaves_no_partial(tmp_path, origin):
    base, state = origin
    state.drops, state.ranges = 1, False
    cache = _http_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/disk.raw", sha256_hex(BODY))
    assert err.value.code == "truncated"
    assert err.value.evidence["http_status"] == 200 and err.value.evidence["received_bytes"] == state.drop_at
    assert cache_leftovers(cache) == []


def test_a_connection_that_keeps_dropping_gives_up_after_the_retries(tmp_path, origin):
    base, state = origin
    state.drops, state.drop_at = 100, 1 << 19
    cache = _http_cache(tmp_path)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/disk.raw", sha256_hex(BODY))
    assert err.value.code == "truncated" and err.value.evidence["resumes"] == cache.http_retries
    assert len(state.requests) == cache.http_retries + 1
    assert cache_leftovers(cache) == []


def test_a_503_before_the_body_is_retried_with_backoff_then_given_up(tmp_path, origin):
    base, state = origin
    state.unavailable = 2
    cache = _http_cache(tmp_path)
    assert fetch_image(cache, f"{base}/disk.raw", sha256_hex(BODY)).sha256 == sha256_hex(BODY)
    assert len(state.requests) == 3 and state.sent == len(BODY)

    state.unavailable = 100
    with pytest.raises(ImageCacheError) as err:
        fetch_image(_http_cache(tmp_path / "b"), f"{base}/disk.raw", sha256_hex(BODY))
    assert (err.value.code, err.value.evidence["http_status"]) == ("fetch_failed", 503)
    assert len(state.requests) == 3 + cache.http_retries + 1


# -- proxies ---------------------------------------------------------------------------------


@dataclass
class Proxy:
    url: str
    seen: list[str]


def _pipe(a: socket.socket, b: socket.socket) -> None:
    sockets = [a, b]
    while True:
        ready, _, _ = select.select(sockets, [], [], 30)
        if not ready:
            return
        for sock in ready:
            data = sock.recv(65536)
            if not data:
                return
            (b if sock is a else a).sendall(data)


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    """A forward proxy: absolute-form GET is relayed, CONNECT is tunnelled. It records each request line."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_CONNECT(self):
            seen.append(self.requestline)
            host, port = self.path.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)), timeout=30)
            self.send_response(200, "Connection established")
            self.end_headers()
            self.wfile.flush()
            try:
                _pipe(self.connection, upstream)
            finally:
                upstream.close()
                self.close_connection = True

        def do_GET(self):
            seen.append(self.requestline)
            assert self.path.startswith("http://")
            hostport, _, rest = self.path.removeprefix("http://").partition("/")
            host, port = hostport.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)), timeout=30)
            try:
                headers = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items() if k.lower() != "proxy-connection")
                upstream.sendall(f"GET /{rest} HTTP/1.1\r\n{headers}Connection: close\r\n\r\n".encode())
                while data := upstream.recv(65536):
                    self.wfile.write(data)
            finally:
                upstream.close()
                self.close_connection = True

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="test-proxy", daemon=True)
    thread.start()
    try:
        yield Proxy(f"http://127.0.0.1:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _proxy_env(monkeypatch, url: str) -> None:
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, url)


def test_http_proxy_from_the_environment_is_used(tmp_path, origin, proxy, monkeypatch):
    base, state = origin
    _proxy_env(monkeypatch, proxy.url)
    image = fetch_image(_http_cache(tmp_path), f"{base}/disk.raw", sha256_hex(BODY))
    assert image.sha256 == sha256_hex(BODY)
    assert proxy.seen == [f"GET {base}/disk.raw HTTP/1.1"]
    assert len(state.requests) == 1


def test_https_goes_through_the_proxys_connect_tunnel_and_tls_is_still_checked_end_to_end(
        tmp_path, raw_image, https_server, proxy, monkeypatch):
    base, context, host = https_server
    path, data = raw_image
    _proxy_env(monkeypatch, proxy.url)
    image = fetch_image(image_cache(tmp_path, hosts=(host,), ssl_context=context), f"{base}/files/{path.name}", sha256_hex(data))
    assert image.sha256 == sha256_hex(data)
    assert proxy.seen == [f"CONNECT {host} HTTP/1.1"]
    # Through the tunnel the server's certificate is still verified against our CAs, not the proxy's word.
    with pytest.raises(ImageCacheError) as err:
        fetch_image(image_cache(tmp_path / "b", hosts=(host,)), f"{base}/files/{path.name}", sha256_hex(data))
    assert err.value.code == "fetch_failed" and "CERTIFICATE_VERIFY_FAILED" in err.value.evidence["error"]


def test_no_proxy_in_the_environment_is_honoured(tmp_path, origin, proxy, monkeypatch):
    base, _ = origin
    _proxy_env(monkeypatch, proxy.url)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    fetch_image(_http_cache(tmp_path), f"{base}/disk.raw", sha256_hex(BODY))
    assert proxy.seen == []


def test_a_redirect_to_a_host_outside_the_policy_is_refused_before_the_proxy_is_asked(tmp_path, origin, proxy,
                                                                                     monkeypatch):
    base, _ = origin
    _proxy_env(monkeypatch, proxy.url)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(_http_cache(tmp_path), f"{base}/away/disk.raw", sha256_hex(BODY))
    assert err.value.code == "image_url_refused" and err.value.evidence["redirected_from"] == f"{base}/away/disk.raw"
    assert proxy.seen == [f"GET {base}/away/disk.raw HTTP/1.1"]  # the hop to 10.0.0.1 was never requested


# -- the CA bundle from the config -------------------------------------------------------------


def _config(tmp_path: Path, host: str, ca_bundle: Path | None) -> Path:
    lines = [f'state_dir = "{tmp_path / "state"}"', "[slice]", f'image_https_hosts = ["{host}"]']
    if ca_bundle is not None:
        lines.append(f'image_ca_bundle = "{ca_bundle}"')
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"agent-{'ca' if ca_bundle else 'system'}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_configured_ca_bundle_is_what_https_image_fetches_trust(tmp_path, raw_image, https_server):
    base, _, host = https_server
    path, data = raw_image
    cert = tmp_path / "tls" / "cert.pem"  # the throwaway CA of the https_server fixture
    with_ca = SliceDrivers.from_config(load_config(_config(tmp_path, host, cert)))
    assert fetch_image(with_ca.images, f"{base}/files/{path.name}", sha256_hex(data)).sha256 == sha256_hex(data)

    system_only = SliceDrivers.from_config(load_config(_config(tmp_path / "other", host, None)))
    with pytest.raises(ImageCacheError) as err:
        fetch_image(system_only.images, f"{base}/files/{path.name}", sha256_hex(data))
    assert "CERTIFICATE_VERIFY_FAILED" in err.value.evidence["error"]


def test_a_ca_bundle_that_is_not_pem_is_refused_when_the_config_loads(tmp_path):
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate\n")
    with pytest.raises(ConfigError) as err:
        load_config(_config(tmp_path, "images.example.com", bogus))
    assert "image_ca_bundle" in str(err.value) and "bogus.pem" in str(err.value)


def test_a_resume_is_taken_only_as_a_206_at_the_exact_byte_of_the_same_body():
    # The rule every reader applies (curl child and the benchmark's httpx reader): anything else would splice
    # other bytes after the ones already hashed.
    assert resume_headers(1000, '"v1"') == {"Range": "bytes=1000-", "If-Range": '"v1"'}
    assert resume_headers(1000, None) == {"Range": "bytes=1000-"}
    assert resumes_at(206, "bytes 1000-4999/5000", 1000, 5000)
    for status, content_range in [
        (200, "bytes 1000-4999/5000"),  # the validator no longer matched: the whole (maybe new) body
        (206, "bytes 0-4999/5000"),  # another start
        (206, "bytes 1001-4999/5000"),
        (206, "bytes 1000-5999/6000"),  # another total: another version of the file
        (206, "bytes 1000-4999/*"),  # an unknown total
        (206, "bytes  1000-4999/5000"), (206, "bytes 1000-4999/5000, 0-1/5000"), (206, "items 1000-4999/5000"),
        (206, ""), (206, None), (416, "bytes */5000"),
    ]:
        assert not resumes_at(status, content_range, 1000, 5000), (status, content_range)


def test_only_a_strong_validator_or_last_modified_pins_a_resume_and_only_a_plain_length_allows_one():
    assert resume_validator('"abc"', "Tue, 01 Dec 2026 00:00:00 GMT") == '"abc"'
    assert resume_validator('W/"abc"', "Tue, 01 Dec 2026 00:00:00 GMT") == "Tue, 01 Dec 2026 00:00:00 GMT"
    assert resume_validator('W/"abc"', None) is None and resume_validator(None, None) is None
    assert declared_length("5000") == 5000 and declared_length("0") == 0
    for hostile in (None, "", "-1", "+5", " 5000", "5000 ", "5e3", "0x10", "5000, 5000", "½", "\u00b2", "\u0661\u0662"):
        assert declared_length(hostile) is None, hostile
