"""An image source for image-cache tests: a raw image on disk and a real HTTPS server serving it (stopped by PID).

The fixtures ``src_dir``, ``raw_image`` and ``https_server`` are a pytest plugin (tests/conftest.py);
``image_cache`` makes a cache that trusts those sources, ``fetch_image`` runs one fetch,
``cache_leftovers`` lists what a cache directory holds. Used by tests/host/images/test_cache*.py.
"""

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

from gpuaas_agent.host.images.cache import ImageCache, SourcePolicy
from gpuaas_agent.host.run import run
from tests.support.tiers import starts

# The end of a server script run with ``python -c`` (``Handler``, ``cert``, ``key`` and ``portfile`` defined
# above it): TLS on a free loopback port, the port written to ``portfile`` in one rename, so a reader never
# sees half a number. bench/rate_server.py ends its server the same way.
SERVE_TLS = r"""
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
with open(portfile + ".tmp", "w") as fh:
    fh.write(str(server.server_address[1]))
os.replace(portfile + ".tmp", portfile)
server.serve_forever()
"""

# A tiny HTTPS server in its own process (stopped by PID). Paths:
#   /files/NAME     the file
#   /short/NAME     announces 4096 bytes more than it sends, then closes (truncated transfer)
#   /nolength/NAME  the file without a Content-Length, the end marked by closing the connection
#   /stall/NAME     announces the file, sends its first 64 KiB, then nothing (the connection stays open)
#   /redirect/NAME  302 to /files/NAME
#   /away/NAME      302 to https://localhost:PORT/files/NAME (same server, a host not in the allow-list)
#   /tofile/NAME    302 to file://ROOT/NAME (the same file on this host's disk)
#   /norange/NAME   the file, always whole (200): a Range header is ignored
#   /gated/NAME     the file, but after its first 6 MiB it waits until ROOT/NAME.go exists (a stream held open)
# /files/ and /redirect/ honour one ``Range: bytes=A-B`` with a 206 and its Content-Range.
# Every request's path is appended to ROOT/requests.log.
SERVER = r"""
import http.server, os, shutil, ssl, sys, threading
root, cert, key, portfile = sys.argv[1:5]
forever = threading.Event()

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def redirect(self, location):
        self.send_response(302); self.send_header("Location", location)
        self.send_header("Content-Length", "0"); self.end_headers()
    def do_GET(self):
        with open(os.path.join(root, "requests.log"), "a") as log:
            log.write(self.path + "\n")
        kind, _, name = self.path.lstrip("/").partition("/")
        path = os.path.join(root, os.path.basename(name))
        port = self.server.server_address[1]
        if kind == "redirect":
            return self.redirect("/files/" + name)
        if kind == "away":
            return self.redirect(f"https://localhost:{port}/files/{name}")
        if kind == "tofile":
            return self.redirect("file://" + path)
        if kind not in ("files", "short", "nolength", "stall", "norange", "gated") or not os.path.isfile(path):
            self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers(); return
        size = os.path.getsize(path)
        wanted = self.headers.get("Range", "")
        if kind == "files" and wanted.startswith("bytes="):
            first, _, last = wanted[len("bytes="):].partition("-")
            first, last = int(first), min(int(last or size - 1), size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Length", str(last - first + 1))
            self.end_headers()
            with open(path, "rb") as fh:
                fh.seek(first)
                self.wfile.write(fh.read(last - first + 1))
            return
        self.send_response(200)
        if kind == "nolength":
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(size + (4096 if kind == "short" else 0)))
        self.end_headers()
        with open(path, "rb") as fh:
            if kind == "stall":
                self.wfile.write(fh.read(65536)); self.wfile.flush()
                forever.wait()
            if kind == "gated":
                self.wfile.write(fh.read(6 << 20)); self.wfile.flush()
                while not os.path.exists(path + ".go"):
                    forever.wait(0.01)
            shutil.copyfileobj(fh, self.wfile)
        if kind == "short":
            self.close_connection = True

""" + SERVE_TLS


def make_ca(directory: Path, name: str = "gpuaas test image CA") -> tuple[Path, Path]:
    """(cert, key) of a throwaway CA (basicConstraints CA:TRUE), made by openssl in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.pem", directory / "ca.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
                    "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                   check=True, capture_output=True, timeout=30)
    return cert, key


def issue_server_cert(ca: tuple[Path, Path], directory: Path, *, ip: str = "127.0.0.1") -> tuple[Path, Path]:
    """(cert, key) of a server certificate for ``ip`` (and localhost) signed by ``ca``: not a CA itself."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, csr, ext = (directory / n for n in ("server.pem", "server.key", "server.csr", "server.ext"))
    subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={ip}"], check=True, capture_output=True,
                   timeout=30)
    ext.write_text(f"basicConstraints=CA:FALSE\nsubjectAltName=IP:{ip},DNS:localhost\nextendedKeyUsage=serverAuth\n")
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
                    "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)],
                   check=True, capture_output=True, timeout=30)
    return cert, key


@starts()
def start_https_server(root: Path, cert: Path, key: Path, portfile: Path) -> tuple[subprocess.Popen, int]:
    """The server above over ``root`` with ``cert``/``key``: (process, port); the caller kills it by PID."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(root), str(cert), str(key), str(portfile)],
                            stdin=subprocess.DEVNULL)
    return proc, wait_for_port(proc, portfile)


def wait_for_port(proc: subprocess.Popen, portfile: Path, *, timeout_s: float = 20) -> int:
    """The port a :data:`SERVE_TLS` server wrote to ``portfile``; it is killed if it died or never wrote it."""
    deadline = time.monotonic() + timeout_s
    while not portfile.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError("test HTTPS server did not start")
        time.sleep(0.02)  # poll step of a deadline wait
    return int(portfile.read_text())


def sha256_hex(data: bytes) -> str:
    """The hex SHA-256 of ``data`` (what a payload's ``image.sha256`` carries)."""
    return hashlib.sha256(data).hexdigest()


def fetch_image(cache: ImageCache, url: str, digest: str, **kw):
    """One fetch on a fresh event loop."""
    return asyncio.run(cache.fetch(url, digest, **kw))


def cache_leftovers(cache: ImageCache) -> list[str]:
    """The names in the cache's entry directory, sorted (a failed fetch must leave none)."""
    return sorted(p.name for p in cache.entries.iterdir()) if cache.entries.exists() else []


def image_cache(tmp_path: Path, *, hosts: tuple[str, ...] = (), root: Path | None = None, **kw) -> ImageCache:
    """A cache allowing file:// from tmp_path/src and https from ``hosts``; tmp_path/state is the state dir."""
    policy = SourcePolicy(https_hosts=hosts, file_dir=tmp_path / "src",
                          allow_loopback_http=kw.pop("allow_loopback_http", False))
    return ImageCache(root or tmp_path / "cache", policy=policy, state_dir=kw.pop("state_dir", tmp_path / "state"),
                      **kw)


@pytest.fixture
def src_dir(tmp_path) -> Path:
    """tmp_path/src: the one directory file:// sources may come from."""
    path = tmp_path / "src"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def raw_image(tmp_path, src_dir) -> tuple[Path, bytes]:
    """(path, bytes) of a raw image of 3 MiB + 12345 random bytes in ``src_dir``."""
    data = os.urandom(3 * (1 << 20) + 12345)  # not a multiple of the chunk size
    path = src_dir / "disk.raw"
    path.write_bytes(data)
    return path, data


@pytest.fixture
@starts()
def https_server(tmp_path, raw_image):
    """(base URL, ssl context trusting only the throwaway CA, "127.0.0.1:PORT"); the server is killed by PID."""
    tls = tmp_path / "tls"
    tls.mkdir()
    cert, key = tls / "cert.pem", tls / "key.pem"
    asyncio.run(run([
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
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
        port = portfile.read_text()
        yield f"https://127.0.0.1:{port}", context, f"127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
