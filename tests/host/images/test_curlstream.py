"""The curl child that reads an https image: what it is told, what it trusts, and that it can always be stopped.

Real pieces: the throwaway-CA HTTPS server (tests/support/image_server.py) and the host's curl.
The download rules themselves (redirects checked hop by hop, resume, retries, proxies, sizes)
are the cache's, tested through the cache in tests/host/images/test_cache*.py and test_streamclone.py.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from pathlib import Path

import pytest

from gpuaas_agent.host.images import curlstream
from gpuaas_agent.host.images.cache import ImageCacheError
from gpuaas_agent.host.images.curlstream import CurlSource
from tests.support.image_server import cache_leftovers, fetch_image, image_cache, make_ca, sha256_hex

SECRET = "X-Amz-Signature-3f9a1c"  # stands in for a presigned URL's signature


def _curl_children() -> list[int]:
    """PIDs of this process's children that run curl."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm == "curl" and int(rest[1]) == os.getpid():
            found.append(int(entry))
    return found


def _wait_for(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # poll step of a deadline wait


def _source(url: str, context: ssl.SSLContext, **kw) -> CurlSource:
    return CurlSource(url, check_hop=lambda hop, first: None, verify=context, **{"stall_timeout_s": 10.0, **kw})


@pytest.fixture
def secret_image(src_dir) -> tuple[str, bytes]:
    """A served image whose name carries the secret, so any URL that leaks it is visible."""
    data = os.urandom((1 << 20) + 333)
    name = f"{SECRET}.raw"
    (src_dir / name).write_bytes(data)
    return name, data


def test_the_url_is_never_in_curls_argv_or_environment_and_trust_is_the_contexts_only(https_server, secret_image):
    base, context, _ = https_server
    name, _ = secret_image
    source = _source(f"{base}/stall/{name}", context).open()  # sends 64 KiB, then holds the connection open
    try:
        _wait_for(lambda: _curl_children(), "the curl child")
        (pid,) = _curl_children()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert not any(SECRET.encode() in arg for arg in argv) and SECRET.encode() not in environ
        assert argv[1] == b"-q"  # first: no .curlrc is read
        assert argv[argv.index(b"--config") + 1] == b"-"  # the URL came on stdin
        assert argv[argv.index(b"--proto") + 1] == b"=https"
        assert b"--location" not in argv and b"-L" not in argv and b"--insecure" not in argv  # redirects are ours
        # The CA file is the context's certificates in a descriptor, and the CA directory is that same
        # descriptor: curl's built-in /etc/ssl/certs is not added to what the cache trusts.
        cacert = argv[argv.index(b"--cacert") + 1]
        assert cacert.startswith(b"/dev/fd/") and argv[argv.index(b"--capath") + 1] == cacert
        assert {line.split(b"=")[0] for line in environ.split(b"\0") if line} <= {b"PATH", b"LC_ALL"}
    finally:
        source.close()
    assert _curl_children() == []


def test_a_server_certificate_the_context_does_not_trust_is_refused(tmp_path, https_server, raw_image):
    base, _, host = https_server
    unrelated, _ = make_ca(tmp_path / "other-ca")
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=ssl.create_default_context(cafile=str(unrelated)))
    path, data = raw_image
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/files/{path.name}", sha256_hex(data))
    assert err.value.code == "fetch_failed" and "CERTIFICATE_VERIFY_FAILED" in err.value.evidence["error"]
    assert err.value.evidence["curl_exit"] == 60 and cache_leftovers(cache) == []


def test_a_curlrc_in_home_is_never_read(tmp_path, https_server, raw_image, monkeypatch):
    base, context, host = https_server
    home = tmp_path / "home"
    home.mkdir()
    (home / ".curlrc").write_text('proxy = "http://127.0.0.1:9"\ninsecure\nlocation\n')  # a dead proxy
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CURL_HOME", str(home))
    path, data = raw_image
    image = fetch_image(image_cache(tmp_path, hosts=(host,), ssl_context=context), f"{base}/files/{path.name}",
                        sha256_hex(data))
    assert Path(image.path).read_bytes() == data


def test_a_host_name_is_resolved_here_and_pinned(tmp_path, https_server, raw_image):
    base, context, host = https_server
    port = host.rsplit(":", 1)[1]
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(f"localhost:{port}",), ssl_context=context)
    image = fetch_image(cache, f"https://localhost:{port}/files/{path.name}", sha256_hex(data))
    assert Path(image.path).read_bytes() == data


def test_interrupt_kills_the_child_and_a_blocked_read_answers_cancelled(https_server, raw_image):
    base, context, _ = https_server
    path, _ = raw_image
    source = _source(f"{base}/stall/{path.name}", context).open()
    buf = memoryview(bytearray(1 << 20))
    got = 0
    while got < 65536:  # the server's first 64 KiB, then it holds the connection open
        got += source.read_into(buf)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            source.read_into(buf)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    _wait_for(lambda: _curl_children(), "the curl child")
    source.interrupt()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert isinstance(outcome[0], ImageCacheError) and outcome[0].message == "download cancelled"
    source.close()
    assert _curl_children() == []


def test_no_byte_for_the_stall_timeout_is_a_timeout_and_the_child_is_gone(https_server, raw_image):
    base, context, _ = https_server
    path, _ = raw_image
    source = _source(f"{base}/stall/{path.name}", context, stall_timeout_s=0.5).open()
    buf = memoryview(bytearray(1 << 20))
    with pytest.raises(TimeoutError):
        while source.read_into(buf):
            pass
    source.close()
    assert _curl_children() == []


def test_without_curl_an_https_fetch_fails_naming_it(tmp_path, https_server, raw_image, monkeypatch):
    base, context, host = https_server
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setitem(curlstream.CLEAN_ENV, "PATH", str(empty))
    path, data = raw_image
    cache = image_cache(tmp_path, hosts=(host,), ssl_context=context)
    with pytest.raises(ImageCacheError) as err:
        fetch_image(cache, f"{base}/files/{path.name}", sha256_hex(data))
    assert err.value.code == "fetch_tool_missing" and err.value.evidence["tool"] == "curl"
    assert "apt-get install curl" in err.value.message and cache_leftovers(cache) == []


def test_config_values_are_quoted_and_control_characters_refused():
    assert curlstream._quoted('https://h/a"b\\c') == '"https://h/a\\"b\\\\c"'
    with pytest.raises(ValueError):
        curlstream._quoted("https://h/a\nurl = https://elsewhere/")
    assert not curlstream._writable('"v1"\tx') and curlstream._writable('"v1-abc"')
