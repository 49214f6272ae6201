"""An https image source read through a ``curl`` child process: TLS at OpenSSL speed, outside the interpreter.

Why: the streamed first provision (host/images/stream.py) is CPU-bound above ~400 MiB/s when
Python reads TLS (httpx hands out one 16 KiB record per read, most of the stream's CPU). curl
decrypts in its own process, and this side reads its stdout in large chunks into the pump's
buffers (one ``read`` per up to 1 MiB of pipe), which are hashed and written without the GIL.

curl is only the transport of *one* request. Everything that is the cache's safety stays in
Python, exactly as in host/images/httpfetch.py (whose rules this mirrors): every redirect hop is
checked by ``check_hop`` before it is requested (curl never follows one: no ``--location``);
a dropped body is resumed with ``Range``/``If-Range`` and a matching ``206``, at most
``retries`` times; a refused connection or a 502/503/504 before the body is retried after a
backoff; no byte for ``stall_timeout_s`` is a stall (``TimeoutError``). What curl is given:

- ``-q`` first (no ``.curlrc``), a clean environment (no ``SSLKEYLOGFILE``, no proxy variables
  it would read its own way), ``--proto`` of the URL's scheme only, HTTP/1.1, TLS >= 1.2;
- the URL, the request headers and a proxy on stdin (``--config -``), never in argv: a
  presigned URL is a secret, and argv is readable by every user in ``/proc``;
- the trust of the cache's ``SSLContext``: the CA certificates it holds, handed over in a
  memfd (``--cacert /dev/fd/N``). curl would otherwise *add* its built-in CA directory to
  them (measured: ``CApath: /etc/ssl/certs`` beside ``--cacert``), so ``--capath`` names the
  same descriptor: no directory anyone could fill, no extra trust;
- the address Python resolved for the host (``--resolve host:port:addrs``) unless a proxy
  from the environment (the same variables httpx honours, via ``urllib.request``) carries it;
- ``--max-filesize`` (the cache's bound), ``--connect-timeout`` and a stall bound
  (``--speed-limit 1 --speed-time``) as a backstop of this side's own stall check.

A cancel or :meth:`CurlSource.interrupt` kills the child by its PID; the blocked read then
ends at once (the pipe closes) and answers ``download cancelled``.
"""

from __future__ import annotations

import fcntl
import io
import ipaddress
import os
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import urljoin, urlsplit

from gpuaas_agent.host.images.httpfetch import (
    CONNECT_TIMEOUT_S,
    DEFAULT_BACKOFF_S,
    DEFAULT_RETRIES,
    MAX_REDIRECTS,
    REDIRECT_STATUSES,
    RETRY_STATUSES,
    USER_AGENT,
    back_off,
    declared_length,
    resume_headers,
    resume_validator,
    resumes_at,
)
from gpuaas_agent.host.images.source import ImageCacheError
from gpuaas_agent.host.run import spawn_reader

CURL = "curl"
PIPE_BYTES = 1 << 20  # the pipe from curl: one read takes up to 1 MiB (the default 64 KiB means 16x the wake-ups)
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032  # fcntl(2); Python 3.10 names them only on some builds
BATCH_S = 0.001  # an empty pipe with much wanted: wait this long before waking on the next write
BATCH_MIN_BYTES = 256 << 10
HEADER_LIMIT = 64 << 10  # a response head larger than this is refused (no server needs it)
CANCEL_POLL_S = 0.2  # a read waiting for data looks at ``cancel`` this often
KILL_WAIT_S = 10.0
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}

# curl exit codes (curl(1) "EXIT CODES") and what they mean here.
_CONNECT_FAILED = {6, 7}  # could not resolve / connect: may heal (as httpx's ConnectError), retried before the body
_TIMED_OUT = 28  # the connect timeout or the stall bound
_TOO_LARGE = 63  # --max-filesize
_BODY_DROPPED = {16, 18, 52, 55, 56, 92}  # the connection broke: resumable in the body
_CERT_FAILED = {60}  # the peer's certificate did not verify against our CAs


class CurlMissing(ImageCacheError):
    """``curl`` is not installed: https images cannot be fetched (the package depends on it)."""


def curl_path() -> str:
    """The curl binary, or :class:`CurlMissing` naming what to install."""
    path = shutil.which(CURL, path=CLEAN_ENV["PATH"])
    if path is None:
        raise CurlMissing("curl is not installed: https image downloads need it (apt-get install curl; the "
                          "gpuaas-agent package recommends it for slice hosts)", code="fetch_tool_missing",
                          evidence={"tool": CURL, "path": CLEAN_ENV["PATH"]})
    return path


def ca_pem(context: ssl.SSLContext) -> bytes:
    """The CA certificates ``context`` trusts, as PEM: what the child is told to trust, nothing more.

    A context built from a bundle holds its certificates; ``ssl.create_default_context()`` holds the
    system store's (its default CA file). One that holds none yet (a CA directory only, loaded
    lazily) gets the default file and directory's certificates read here.
    """
    certs = context.get_ca_certs(binary_form=True)
    if not certs:
        paths = ssl.get_default_verify_paths()
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.load_verify_locations(cafile=paths.cafile if paths.cafile and os.path.isfile(paths.cafile) else None,
                                    capath=paths.capath if paths.capath and os.path.isdir(paths.capath) else None)
        certs = probe.get_ca_certs(binary_form=True)
    return "".join(ssl.DER_cert_to_PEM_cert(c) for c in certs).encode()


def _writable(value: str) -> bool:
    """No control characters: a config value cannot end its line early and start another option."""
    return not any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)


def _quoted(value: str) -> str:
    """A curl config value: double-quoted, backslash and quote escaped; control characters refused."""
    if not _writable(value):
        raise ValueError("control character in a curl config value")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``https_proxy``, ``all_proxy``, ``no_proxy``), or None."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy:
        return None
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    if urllib.request.proxy_bypass(netloc) or urllib.request.proxy_bypass(host):  # no_proxy (on Linux: the environment's)
        return None
    return proxy


def _pinned(url: str) -> str | None:
    """``host:port:addr[,addr...]`` for ``--resolve``: the addresses resolved here, or None for an IP literal."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addrs = list(dict.fromkeys(f"[{i[4][0]}]" if i[0] == socket.AF_INET6 else str(i[4][0]) for i in infos))
    return f"{host}:{port}:{','.join(addrs)}"


class _Request:
    """One curl process: its response head parsed, its body read from the pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], ca_fd: int) -> None:
        self.proc, self.ca_fd = proc, ca_fd
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.pipe = io.FileIO(self.fd, "rb", closefd=False)
        self.pending = b""
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self.killed = False
        self.batch = False  # the pipe is large enough to nap on (CurlSource._read)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.killed = True
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    def finish(self) -> tuple[int, str]:
        """Wait for the child; its exit status and the last line it printed on stderr."""
        try:
            rc = self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.wait()
        err = b""
        if self.proc.stderr is not None:
            try:
                err = self.proc.stderr.read(4096) or b""
            except (OSError, ValueError):
                err = b""
        lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
        return rc, lines[0] if lines else ""

    def close(self) -> None:
        self.kill()
        self.finish()
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream is not None:
                stream.close()
        os.close(self.ca_fd)


class CurlSource:
    """One download: :meth:`open` follows redirects, :meth:`read_into` streams and resumes, :meth:`close`.

    What the cache reads a source through (``open``, ``read_into``, ``length``, ``describe``, ``interrupt``,
    ``close``), as the httpx reader it replaced (kept for the benchmark in bench/httpx_reader.py).
    """

    def __init__(self, url: str, *, check_hop: Any, verify: ssl.SSLContext, stall_timeout_s: float,
                 cancel: threading.Event | None = None, retries: int = DEFAULT_RETRIES,
                 backoff_s: float = DEFAULT_BACKOFF_S, max_bytes: int | None = None) -> None:
        self.first = url
        self.url = url
        self.check_hop = check_hop
        self.stall_timeout_s = stall_timeout_s
        self.cancel = cancel or threading.Event()
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_bytes = max_bytes
        self.length: int | None = None
        self.received = 0
        self.resumes = 0
        self._validator: str | None = None
        self._curl = curl_path()
        self._ca = ca_pem(verify)
        self._request: _Request | None = None
        self._lock = threading.Lock()  # interrupt() (any thread) against the reader replacing the request

    @property
    def describe(self) -> dict[str, Any]:
        return {"url": self.url}

    def close(self) -> None:
        with self._lock:
            request, self._request = self._request, None
        if request is not None:
            request.close()

    def interrupt(self) -> None:
        """Wake a read blocked in another thread: kill the child (any thread may call it)."""
        with self._lock:
            if self._request is not None:
                self._request.kill()

    # -- one request ------------------------------------------------------------------------

    def _argv(self, url: str, ca: str) -> list[str]:
        scheme = urlsplit(url).scheme
        argv = [self._curl, "-q", "--silent", "--show-error", "--http1.1", "--tlsv1.2", "--proto", f"={scheme}",
                "--dump-header", "-", "--output", "-", "--suppress-connect-headers",
                "--cacert", ca, "--capath", ca,
                "--user-agent", USER_AGENT, "--header", "Accept-Encoding: identity",
                "--connect-timeout", f"{min(CONNECT_TIMEOUT_S, self.stall_timeout_s):g}",
                "--speed-limit", "1", "--speed-time", str(max(1, int(self.stall_timeout_s + 5)))]
        if self.max_bytes is not None:
            argv += ["--max-filesize", str(self.max_bytes)]
        return argv + ["--config", "-"]

    def _config(self, url: str, headers: dict[str, str]) -> bytes:
        lines = [f"url = {_quoted(url)}"]
        lines += [f"header = {_quoted(f'{k}: {v}')}" for k, v in headers.items()]
        proxy = environment_proxy(url)
        if proxy is not None:
            lines.append(f"proxy = {_quoted(proxy)}")
        else:
            lines.append('noproxy = "*"')
            pinned = _pinned(url)
            if pinned is not None:
                lines.append(f"resolve = {_quoted(pinned)}")
        return ("\n".join(lines) + "\n").encode()

    def _spawn(self, url: str, headers: dict[str, str]) -> _Request:
        try:
            config = self._config(url, headers)
        except (OSError, UnicodeError) as exc:  # getaddrinfo: the name does not resolve (may heal)
            raise _ConnectFailed(f"cannot resolve {urlsplit(url).hostname}: {exc}") from exc
        ca_fd = os.memfd_create("gpuaas-image-ca", os.MFD_CLOEXEC)
        try:
            os.write(ca_fd, self._ca)
            ca = f"/dev/fd/{ca_fd}"
            proc = spawn_reader(self._argv(url, ca), env=CLEAN_ENV, pass_fds=(ca_fd,))
        except BaseException:
            os.close(ca_fd)
            raise
        request = _Request(proc, ca_fd)
        with self._lock:
            self._request = request
        try:
            fcntl.fcntl(request.fd, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # a smaller pipe costs wake-ups (and no nap: see _read)
        request.batch = fcntl.fcntl(request.fd, F_GETPIPE_SZ) >= PIPE_BYTES
        os.set_blocking(request.fd, False)
        assert proc.stdin is not None
        try:
            proc.stdin.write(config)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # curl ended already; its exit status says why
        return request

    def _wait_readable(self, request: _Request) -> None:
        """Until the pipe has data or is closed; ``TimeoutError`` after ``stall_timeout_s`` without a byte."""
        deadline = time.monotonic() + self.stall_timeout_s
        poller = select.poll()
        poller.register(request.fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            if self.cancel.is_set():
                request.kill()
                raise ImageCacheError("download cancelled", code="fetch_failed", evidence={"url": self.url})
            left = deadline - time.monotonic()
            if left <= 0:
                request.kill()
                raise TimeoutError(f"no data from {self.url} for {self.stall_timeout_s:g}s")
            if poller.poll(int(min(left, CANCEL_POLL_S) * 1000) + 1):
                return

    def _read(self, request: _Request, buf: memoryview) -> int:
        """One read from the pipe (waiting for data); 0 at its end.

        When the pipe is empty and much is wanted, the reader first naps :data:`BATCH_S`: curl writes
        8 KiB at a time, and waking for each costs more CPU than the copy (measured: ~20,000 reads per
        512 MiB without the nap). The pipe holds :data:`PIPE_BYTES`, so curl never waits on the nap
        below ~1 GiB/s; a pipe that could not be made that large is never napped on.
        """
        while True:
            n = request.pipe.readinto(buf)
            if n is not None:
                return n
            if request.batch and len(buf) >= BATCH_MIN_BYTES:
                time.sleep(BATCH_S)  # not synchronisation: lets the pipe fill so one read takes many writes
                n = request.pipe.readinto(buf)
                if n is not None:
                    return n
            self._wait_readable(request)

    def _head(self, request: _Request) -> None:
        """Read and parse the response head (a 1xx is skipped); the rest of what was read is body."""
        data = bytearray()
        chunk = bytearray(64 << 10)
        while True:
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                head, rest = bytes(data[:end]), bytes(data[end + 4:])
                lines = head.decode("latin-1").split("\r\n")
                status_line = lines[0].split(" ", 2)
                if len(status_line) < 2 or not status_line[0].startswith("HTTP/") or not status_line[1].isdigit():
                    raise self._failed(request, "the image server's answer is not HTTP", end=True)
                status = int(status_line[1])
                if 100 <= status < 200:
                    data = bytearray(rest)
                    continue
                request.status = status
                request.reason = status_line[2] if len(status_line) > 2 else ""
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        request.headers[name.strip().lower()] = value.strip()
                request.pending = rest
                return
            if len(data) > HEADER_LIMIT:
                raise self._failed(request, "the image server's response head is too large", end=True)
            n = self._read(request, memoryview(chunk))
            if not n:
                raise self._ended_before_head(request, bytes(data))
            data += chunk[:n]

    def _failed(self, request: _Request, message: str, *, end: bool = False, **evidence: Any) -> ImageCacheError:
        if end:
            request.kill()
        return ImageCacheError(message, code="fetch_failed", evidence={"url": self.url, **evidence})

    def _ended_before_head(self, request: _Request, partial: bytes) -> Exception:
        """curl ended before a response head: its exit status decides the error.

        ``partial``: what it printed of the head (at ``--max-filesize`` it stops after the header
        lines, before the blank line: the announced length is read from them).
        """
        rc, err = request.finish()
        if request.killed and self.cancel.is_set():
            return ImageCacheError("download cancelled", code="fetch_failed", evidence={"url": self.url})
        error = f"curl exit {rc}: {err}"
        if rc in _CONNECT_FAILED:
            return _ConnectFailed(error)
        if rc == _TIMED_OUT:
            return TimeoutError(error)
        if rc == _TOO_LARGE:
            announced = [line.partition(b":")[2].strip() for line in partial.split(b"\r\n")
                         if line.lower().startswith(b"content-length:")]
            if announced and announced[-1].isdigit():
                length = int(announced[-1])
                return ImageCacheError(f"source announces {length} bytes, more than the allowed {self.max_bytes}",
                                       code="too_large",
                                       evidence={"url": self.url, "length": length, "max_bytes": self.max_bytes})
            return ImageCacheError(f"image is larger than the allowed {self.max_bytes} bytes", code="too_large",
                                   evidence={"url": self.url, "max_bytes": self.max_bytes})
        if rc in _CERT_FAILED:
            error = f"CERTIFICATE_VERIFY_FAILED ({error})"  # the token httpx's ssl error carries, for operators' greps
        return ImageCacheError(f"cannot reach the image server: {error}", code="fetch_failed",
                               evidence={"url": self.url, "error": error, "curl_exit": rc})

    # -- opening ----------------------------------------------------------------------------

    def _backoff(self, attempt: int) -> None:
        back_off(self.cancel, self.backoff_s, attempt, self.url)

    def _send(self, url: str, headers: dict[str, str]) -> _Request:
        """One GET up to its response head, retried on errors that may heal (no connection, 502/503/504)."""
        attempt = 0
        while True:
            self.close()
            request = self._spawn(url, headers)
            try:
                self._head(request)
            except TimeoutError as exc:
                raise ImageCacheError(f"no answer from the image server for {self.stall_timeout_s:g}s",
                                      code="fetch_stalled",
                                      evidence={"url": url, "stall_timeout_s": self.stall_timeout_s}) from exc
            except _ConnectFailed as exc:
                if attempt < self.retries:
                    self._backoff(attempt)
                    attempt += 1
                    continue
                raise ImageCacheError(f"cannot reach the image server: {exc}", code="fetch_failed",
                                      evidence={"url": url, "error": str(exc), "attempts": attempt + 1}) from exc
            if request.status in RETRY_STATUSES and attempt < self.retries:
                self.close()
                self._backoff(attempt)
                attempt += 1
                continue
            return request

    def open(self) -> CurlSource:
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            self.check_hop(url, self.first)
            self.url = url
            request = self._send(url, {})
            location = request.headers.get("location")
            if request.status in REDIRECT_STATUSES and location:
                self.close()
                url = urljoin(url, location)
                continue
            if request.status != 200:
                self.close()
                raise ImageCacheError(f"image server answered HTTP {request.status} {request.reason}",
                                      code="fetch_failed", evidence={"url": url, "http_status": request.status})
            self.length = declared_length(request.headers.get("content-length"))
            validator = resume_validator(request.headers.get("etag"), request.headers.get("last-modified"))
            # A validator that cannot be written into curl's config is not used: no If-Range, so a resume
            # gets a 200 and ends ``truncated`` rather than trusting bytes it cannot pin to this version.
            self._validator = validator if validator and _writable(validator) else None
            return self
        raise ImageCacheError("too many redirects", code="fetch_failed", evidence={"url": self.first})

    # -- reading ----------------------------------------------------------------------------

    def read_into(self, buf: memoryview) -> int:
        """Up to ``len(buf)`` bytes of the body; 0 at its end. A dropped connection is resumed."""
        while True:
            request = self._request
            if request is None:
                raise ImageCacheError("download cancelled", code="fetch_failed", evidence={"url": self.url})
            if request.pending:
                n = min(len(buf), len(request.pending))
                buf[:n] = request.pending[:n]
                request.pending = request.pending[n:]
            else:
                n = self._read(request, buf)
            if n:
                self.received += n
                return n
            rc, err = request.finish()
            if rc == 0:
                return 0
            if request.killed:
                raise ImageCacheError("download cancelled", code="fetch_failed", evidence={"url": self.url})
            if rc == _TIMED_OUT:
                raise TimeoutError(f"curl exit {rc}: {err}")
            if rc == _TOO_LARGE:
                raise ImageCacheError(f"image is larger than the allowed {self.max_bytes} bytes", code="too_large",
                                      evidence={"url": self.url, "max_bytes": self.max_bytes,
                                                "received_bytes_at_least": self.received})
            self._resume(f"curl exit {rc}: {err}", rc)

    def _truncated(self, why: str, error: str, **evidence: Any) -> ImageCacheError:
        return ImageCacheError(f"source stopped before the end: {why}", code="truncated",
                               evidence={"url": self.url, "error": error, "received_bytes": self.received,
                                         "resumes": self.resumes, **evidence})

    def _resume(self, error: str, rc: int) -> None:
        """Reconnect at ``self.received`` with a range request, or raise ``truncated``."""
        self.close()
        if rc not in _BODY_DROPPED:
            raise self._truncated("the transfer failed", error, curl_exit=rc)
        if self.length is None:
            raise self._truncated("the connection dropped and the size is unknown (no resume)", error)
        if self.resumes >= self.retries:
            raise self._truncated(f"the connection dropped {self.resumes + 1} times", error)
        self._backoff(self.resumes)
        self.resumes += 1
        self.check_hop(self.url, self.first)
        request = self._send(self.url, resume_headers(self.received, self._validator))
        if not resumes_at(request.status, request.headers.get("content-range"), self.received, self.length):
            status = request.status
            content_range = request.headers.get("content-range")
            self.close()
            raise self._truncated("the server cannot resume at this byte (no matching 206 answer)", error,
                                  http_status=status, content_range=content_range)


class _ConnectFailed(Exception):
    """No connection (name, refused, unreachable): may heal, retried before the body."""


__all__ = ["CURL", "CurlMissing", "CurlSource", "ca_pem", "curl_path", "environment_proxy"]
