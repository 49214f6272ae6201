"""An http(s) image source on httpx: proxies, CA bundle, timeouts, redirects checked hop by hop, resume.

Why httpx and not a hand-written client: a host behind a proxy (``https_proxy``,
``no_proxy`` in the service's environment, ``trust_env``) reaches its image server the
way every other tool on the host does, and connection handling, chunked bodies and
TLS come from a maintained library.

What stays ours, because it is the safety of the cache (host/images.py):

- redirects are followed here, one hop at a time, and ``check_hop`` (the allow-list of
  host/imagesource.py) sees every hop before it is requested;
- the read timeout is the stall timeout (no byte for that long is ``fetch_stalled``);
- a connection that drops in the middle of the body is resumed from the byte where it
  stopped (``Range: bytes=N-``, with ``If-Range`` on the validator the first answer
  gave), after a backoff, at most ``retries`` times; the answer must be ``206`` whose
  ``Content-Range`` starts at exactly ``N`` and names the same total, or the download
  is ``truncated``. The bytes before ``N`` were hashed as they arrived and are never
  read again: the digest of the resumed download is computed over each byte once;
- a refused connection or a 502/503/504 before the body is retried with the same
  backoff; a TLS verification failure or any other status is not (it will not heal).
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urljoin

import httpx

from gpuaas_agent.host.imagesource import ImageCacheError

USER_AGENT = "gpuaas-agent"
MAX_REDIRECTS = 5
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
CONNECT_TIMEOUT_S = 30.0
RETRY_STATUSES = (502, 503, 504)
CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class HttpSource:
    """One download: :meth:`open` follows redirects, :meth:`read_into` streams and resumes, :meth:`close`."""

    def __init__(self, url: str, *, check_hop: Callable[[str, str], None], verify: ssl.SSLContext,
                 stall_timeout_s: float, cancel: threading.Event | None = None,
                 retries: int = DEFAULT_RETRIES, backoff_s: float = DEFAULT_BACKOFF_S) -> None:
        self.first = url
        self.url = url
        self.check_hop = check_hop
        self.stall_timeout_s = stall_timeout_s
        self.cancel = cancel or threading.Event()
        self.retries = retries
        self.backoff_s = backoff_s
        self.length: int | None = None
        self.received = 0
        self.resumes = 0
        self._validator: str | None = None
        self._response: httpx.Response | None = None
        self._chunks: Iterator[bytes] | None = None
        self._pending = b""
        # trust_env: http_proxy/https_proxy/all_proxy/no_proxy from the environment (the unit's, or a drop-in's).
        self._client = httpx.Client(
            verify=verify, trust_env=True, follow_redirects=False,
            timeout=httpx.Timeout(stall_timeout_s, connect=min(CONNECT_TIMEOUT_S, stall_timeout_s)),
            headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})

    @property
    def describe(self) -> dict[str, Any]:
        return {"url": self.url}

    def close(self) -> None:
        if self._response is not None:
            self._response.close()
        self._client.close()

    def interrupt(self) -> None:
        """Wake a read blocked in another thread: shut the connection's socket down (any thread may call it).

        Closing a descriptor does not wake a ``recv`` blocked on it; ``shutdown`` does, and it acts on
        the socket, so a duplicate descriptor serves (the TLS object of the reading thread is left alone).
        The socket comes from httpx's documented ``network_stream`` response extension.
        """
        response = self._response
        stream = response.extensions.get("network_stream") if response is not None else None
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            return
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            return  # already closed
        try:
            dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            dup.close()

    # -- opening --------------------------------------------------------------------------

    def _backoff(self, attempt: int) -> None:
        """Wait before the next try; returns at once when the download is cancelled."""
        if self.cancel.wait(self.backoff_s * (2 ** attempt)):
            raise ImageCacheError("download cancelled", code="fetch_failed", evidence={"url": self.url})

    def _send(self, url: str, headers: dict[str, str]) -> httpx.Response:
        """One GET, retried on errors that may heal (refused connection, 502/503/504)."""
        attempt = 0
        while True:
            try:
                response = self._client.send(self._client.build_request("GET", url, headers=headers), stream=True)
            except httpx.TimeoutException as exc:
                raise ImageCacheError(f"no answer from the image server for {self.stall_timeout_s:g}s",
                                      code="fetch_stalled",
                                      evidence={"url": url, "stall_timeout_s": self.stall_timeout_s}) from exc
            except httpx.TransportError as exc:
                healable = isinstance(exc, httpx.ConnectError) and not any(
                    isinstance(e, ssl.SSLError) for e in _causes(exc)) and "CERTIFICATE" not in str(exc)
                if healable and attempt < self.retries:
                    self._backoff(attempt)
                    attempt += 1
                    continue
                raise ImageCacheError(f"cannot reach the image server: {exc}", code="fetch_failed",
                                      evidence={"url": url, "error": _error_chain(exc), "attempts": attempt + 1}) from exc
            if response.status_code in RETRY_STATUSES and attempt < self.retries:
                response.close()
                self._backoff(attempt)
                attempt += 1
                continue
            return response

    def open(self) -> HttpSource:
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            self.check_hop(url, self.first)
            response = self._send(url, {})
            location = response.headers.get("location")
            if response.status_code in (301, 302, 303, 307, 308) and location:
                response.close()
                url = urljoin(url, location)
                continue
            self.url = url
            if response.status_code != 200:
                response.close()
                raise ImageCacheError(f"image server answered HTTP {response.status_code} {response.reason_phrase}",
                                      code="fetch_failed", evidence={"url": url, "http_status": response.status_code})
            length = response.headers.get("content-length")
            self.length = int(length) if length and length.isdigit() else None
            etag = response.headers.get("etag")
            # If-Range needs a strong validator; a weak ETag never matches, so fall back to Last-Modified.
            self._validator = etag if etag and not etag.startswith("W/") else response.headers.get("last-modified")
            self._start(response)
            return self
        raise ImageCacheError("too many redirects", code="fetch_failed", evidence={"url": self.first})

    def _start(self, response: httpx.Response) -> None:
        self._response = response
        # No chunk_size: httpx would buffer up to it and lose the buffered bytes when the connection drops;
        # as they arrive, every byte received is a byte counted, so the resume starts exactly after it.
        self._chunks = response.iter_raw()
        self._pending = b""

    # -- reading --------------------------------------------------------------------------

    def read_into(self, buf: memoryview) -> int:
        """Up to ``len(buf)`` bytes of the body; 0 at its end. A dropped connection is resumed."""
        while not self._pending:
            try:
                self._pending = next(self._chunks)  # type: ignore[arg-type]
            except StopIteration:
                return 0
            except httpx.TimeoutException as exc:
                raise TimeoutError(str(exc)) from exc  # the caller's fetch_stalled
            except httpx.TransportError as exc:
                self._resume(exc)
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self.received += n
        return n

    def _truncated(self, why: str, exc: BaseException, **evidence: Any) -> ImageCacheError:
        return ImageCacheError(f"source stopped before the end: {why}", code="truncated",
                               evidence={"url": self.url, "error": repr(exc), "received_bytes": self.received,
                                         "resumes": self.resumes, **evidence})

    def _resume(self, exc: httpx.TransportError) -> None:
        """Reconnect at ``self.received`` with a range request, or raise ``truncated``."""
        if self._response is not None:
            self._response.close()
            self._response = None
        if self.length is None:
            raise self._truncated("the connection dropped and the size is unknown (no resume)", exc)
        if self.resumes >= self.retries:
            raise self._truncated(f"the connection dropped {self.resumes + 1} times", exc)
        self._backoff(self.resumes)
        self.resumes += 1
        self.check_hop(self.url, self.first)
        headers = {"Range": f"bytes={self.received}-"}
        if self._validator:
            headers["If-Range"] = self._validator
        response = self._send(self.url, headers)
        match = CONTENT_RANGE_RE.match(response.headers.get("content-range", ""))
        if response.status_code != 206 or not match or int(match.group(1)) != self.received \
                or int(match.group(3)) != self.length:
            status = response.status_code
            content_range = response.headers.get("content-range")
            response.close()
            raise self._truncated("the server cannot resume at this byte (no matching 206 answer)", exc,
                                  http_status=status, content_range=content_range)
        self._start(response)


def _causes(exc: BaseException) -> list[BaseException]:
    seen = [exc]
    while (cause := seen[-1].__cause__ or seen[-1].__context__) is not None and cause not in seen and len(seen) < 6:
        seen.append(cause)
    return seen


def _error_chain(exc: BaseException) -> str:
    """``repr`` of the error and of what caused it, down to the OS or TLS error (evidence, not prose)."""
    return " <- ".join(repr(e) for e in _causes(exc))


class RangesRefused(Exception):
    """The server answered a range request with the whole body (200): it does not serve ranges."""


def read_ranges(url: str, ranges: list[tuple[int, int]], total: int, *, check_hop: Callable[[str, str], None],
                verify: ssl.SSLContext, stall_timeout_s: float) -> list[bytes]:
    """The bytes of each ``(start, length)`` range of ``url``, whose whole size must be ``total``.

    Why: a cache hit under a URL other than the one the entry was fetched from is served only when
    that URL answers for the entry's bytes (host/images.py). Each range is one GET with
    ``Range: bytes=a-b``, following redirects hop by hop through ``check_hop`` like a download. An
    answer must be ``206`` with ``Content-Range: bytes a-b/total``; any other status is
    ``fetch_failed`` (a 404 is what it is for a download too), a 206 naming another range or total
    is returned as empty bytes (the caller's mismatch). A plain ``200`` raises
    :class:`RangesRefused` before its body is read.
    """
    out = []
    with httpx.Client(verify=verify, trust_env=True, follow_redirects=False,
                      timeout=httpx.Timeout(stall_timeout_s, connect=min(CONNECT_TIMEOUT_S, stall_timeout_s)),
                      headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}) as client:
        for start, length in ranges:
            out.append(_read_range(client, url, start, length, total, check_hop, stall_timeout_s))
    return out


def _read_range(client: httpx.Client, first: str, start: int, length: int, total: int,
                check_hop: Callable[[str, str], None], stall_timeout_s: float) -> bytes:
    url = first
    headers = {"Range": f"bytes={start}-{start + length - 1}"}
    for _ in range(MAX_REDIRECTS + 1):
        check_hop(url, first)
        try:
            with client.stream("GET", url, headers=headers) as response:
                location = response.headers.get("location")
                if response.status_code in (301, 302, 303, 307, 308) and location:
                    url = urljoin(url, location)
                    continue
                if response.status_code == 200:
                    raise RangesRefused()
                if response.status_code != 206:
                    raise ImageCacheError(
                        f"image server answered HTTP {response.status_code} {response.reason_phrase}",
                        code="fetch_failed", evidence={"url": url, "http_status": response.status_code})
                match = CONTENT_RANGE_RE.match(response.headers.get("content-range", ""))
                if not match or (int(match.group(1)), int(match.group(2)), int(match.group(3))) != (
                        start, start + length - 1, total):
                    return b""
                body = bytearray()
                for chunk in response.iter_raw():
                    body += chunk
                    if len(body) > length:
                        return b""
                return bytes(body)
        except httpx.TimeoutException as exc:
            raise ImageCacheError(f"no answer from the image server for {stall_timeout_s:g}s",
                                  code="fetch_stalled", evidence={"url": url, "stall_timeout_s": stall_timeout_s}) from exc
        except httpx.TransportError as exc:
            raise ImageCacheError(f"cannot reach the image server: {exc}", code="fetch_failed",
                                  evidence={"url": url, "error": _error_chain(exc)}) from exc
    raise ImageCacheError("too many redirects", code="fetch_failed", evidence={"url": first})
