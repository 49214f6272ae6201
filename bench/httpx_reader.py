"""The https reader the agent used before the curl child: httpx in the agent's process (bench only).

Why it is here: ``bench_stream.py --compare-httpx`` times it beside the curl reader in the same
run (docs/performance.md). The agent no longer uses it (host/images/curlstream.py reads https bodies):
Python reads TLS one 16 KiB record per call through h11/httpcore, which made the streamed first
provision CPU-bound above ~400 MiB/s. Same rules as the agent's reader: redirects checked hop
by hop, resume with Range/If-Range, retries on 502/503/504 and refused connections.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urljoin

import httpx

from gpuaas_agent.host.images.httpfetch import (
    CONNECT_TIMEOUT_S,
    DEFAULT_BACKOFF_S,
    DEFAULT_RETRIES,
    MAX_REDIRECTS,
    REDIRECT_STATUSES,
    RETRY_STATUSES,
    USER_AGENT,
    _causes,
    _error_chain,
    back_off,
    declared_length,
    resume_headers,
    resume_validator,
    resumes_at,
)
from gpuaas_agent.host.images.source import ImageCacheError


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
        back_off(self.cancel, self.backoff_s, attempt, self.url)

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
            if response.status_code in REDIRECT_STATUSES and location:
                response.close()
                url = urljoin(url, location)
                continue
            self.url = url
            if response.status_code != 200:
                response.close()
                raise ImageCacheError(f"image server answered HTTP {response.status_code} {response.reason_phrase}",
                                      code="fetch_failed", evidence={"url": url, "http_status": response.status_code})
            self.length = declared_length(response.headers.get("content-length"))
            self._validator = resume_validator(response.headers.get("etag"), response.headers.get("last-modified"))
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
        response = self._send(self.url, resume_headers(self.received, self._validator))
        if not resumes_at(response.status_code, response.headers.get("content-range"), self.received, self.length):
            status = response.status_code
            content_range = response.headers.get("content-range")
            response.close()
            raise self._truncated("the server cannot resume at this byte (no matching 206 answer)", exc,
                                  http_status=status, content_range=content_range)
        self._start(response)
