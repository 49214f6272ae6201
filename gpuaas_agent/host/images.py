"""Image cache: fetch an image once, hash it while it arrives, keep it under its SHA-256.

Layout under the cache root::

    sha256/<hex>                 the image, only ever put there by os.replace after its digest matched
    sha256/<hex>.verified.json   CacheEntryMarker, written atomically after the image
    sha256/.<hex>.*.partial      a download in flight (removed on any failure)

A hit needs both the image and its marker (with the same size) and does not
hash again: the digest was proven on the way in (DESIGN.md §7, "hashed once per
cache entry, not once per clone"). The clone onto a slot disk is another driver.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import http.client
import ipaddress
import json
import logging
import os
import re
import ssl
import tempfile
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

from pydantic import ValidationError

from gpuaas_agent.atomicfile import fsync_dir, write_atomic
from gpuaas_agent.contract.images import CachedImage, CacheEntryMarker, ImageFormat
from gpuaas_agent.errors import ContractError, HostError
from gpuaas_agent.host.run import run

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # 1 MiB: large enough that hashlib (which drops the GIL) runs at full speed
MAX_REDIRECTS = 5
QEMU_IMG_INFO_TIMEOUT_S = 60.0
SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")


class ImageCacheError(HostError):
    """Fetching or verifying an image failed; no partial file is left in the cache.

    Codes: ``digest_mismatch``, ``truncated``, ``cache_full``, ``too_large``,
    ``unsupported_url``, ``fetch_failed``, ``unknown_format``, ``backing_file_refused``,
    ``fetch_timeout``.
    """

    default_code = "image_cache_error"


class _Cancelled(Exception):
    """The awaiting coroutine gave up (deadline or cancellation); the copy thread stops."""


def sha256_stream(read_into: Callable[[memoryview], int], write: Callable[[memoryview], None] | None = None,
                  *, max_bytes: int | None = None, cancel: threading.Event | None = None) -> tuple[str, int]:
    """Hash (and optionally copy) a stream in 1 MiB chunks; one read of every byte.

    One preallocated buffer, no per-chunk allocation. ``read_into`` returns 0 at
    the end. Returns ``(hex digest, byte count)``. This is the loop the
    benchmark measures.
    """
    digest = hashlib.sha256()
    buf = memoryview(bytearray(CHUNK_BYTES))
    total = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise _Cancelled()
        n = read_into(buf)
        if not n:
            break
        total += n
        if max_bytes is not None and total > max_bytes:
            raise ImageCacheError(
                f"image is larger than the allowed {max_bytes} bytes",
                code="too_large",
                evidence={"max_bytes": max_bytes, "received_bytes_at_least": total},
            )
        chunk = buf[:n]
        digest.update(chunk)
        if write is not None:
            write(chunk)
    return digest.hexdigest(), total


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Digest of a local file with the cache's hashing loop (benchmarks, re-verification)."""
    with open(path, "rb", buffering=0) as fh:
        return sha256_stream(fh.readinto)[0]


def _write_all(fd: int) -> Callable[[memoryview], None]:
    def write(chunk: memoryview) -> None:
        while chunk:
            written = os.write(fd, chunk)
            chunk = chunk[written:]

    return write


def _is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Source:
    """An opened source: a readinto function, the length it announced, and how to close it."""

    def __init__(self, read_into: Callable[[memoryview], int], length: int | None, close: Callable[[], None],
                 describe: dict) -> None:
        self.read_into = read_into
        self.length = length
        self.close = close
        self.describe = describe


class ImageCache:
    """Content-addressed cache of VM images under ``root``."""

    def __init__(self, root: Path, *, ssl_context: ssl.SSLContext | None = None,
                 network_timeout_s: float = 30.0, allow_loopback_http: bool = False) -> None:
        self.root = Path(root)
        self.entries = self.root / "sha256"
        self.ssl_context = ssl_context or ssl.create_default_context()
        self.network_timeout_s = network_timeout_s
        # Plain http is only for tests against a server on 127.0.0.1; images come over https.
        self.allow_loopback_http = allow_loopback_http
        self._locks: dict[str, asyncio.Lock] = {}

    # -- paths and markers ----------------------------------------------------------

    def image_path(self, sha256: str) -> Path:
        return self.entries / sha256

    def marker_path(self, sha256: str) -> Path:
        return self.entries / f"{sha256}.verified.json"

    def lookup(self, sha256: str) -> CachedImage | None:
        """The verified entry for a digest, without hashing; ``None`` on a miss.

        An image without a marker, or whose size differs from the marker's, is not
        trusted (a crash between replace and marker, or someone touched the file).
        """
        sha256 = _digest_arg(sha256)
        path = self.image_path(sha256)
        try:
            marker = CacheEntryMarker.model_validate_json(self.marker_path(sha256).read_bytes())
            size = path.stat().st_size
        except (OSError, ValidationError):
            return None
        if marker.sha256 != sha256 or marker.size_bytes != size:
            return None
        return CachedImage(path=str(path), sha256=sha256, size_bytes=size, source_url=marker.source_url,
                           format=marker.format)

    def remove_stale_partials(self) -> list[str]:
        """Delete downloads left by a crashed agent; call once at daemon start, before any fetch."""
        removed = []
        for partial in self.entries.glob(".*.partial"):
            partial.unlink(missing_ok=True)
            removed.append(partial.name)
        return removed

    # -- fetch ------------------------------------------------------------------------

    async def fetch(self, url: str, expected_sha256: str, *, max_bytes: int | None = None,
                    timeout_s: float | None = None) -> CachedImage:
        """The verified cached image for ``expected_sha256``, downloading it from ``url`` on a miss.

        ``timeout_s`` bounds the whole download (``None``: only the per-read network timeout).
        """
        expected = _digest_arg(expected_sha256)
        lock = self._locks.setdefault(expected, asyncio.Lock())
        async with lock:
            hit = self.lookup(expected)
            if hit is not None:
                log.info("event=image_cache_hit sha256=%s size_bytes=%d", expected, hit.size_bytes)
                return hit
            return await self._fetch_miss(url, expected, max_bytes=max_bytes, timeout_s=timeout_s)

    async def _fetch_miss(self, url: str, expected: str, *, max_bytes: int | None,
                          timeout_s: float | None) -> CachedImage:
        self._check_url(url)
        self.entries.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self.entries, prefix=f".{expected}.", suffix=".partial")
        os.close(fd)  # the copy thread opens its own descriptor: it may outlive this coroutine by one chunk
        tmp = Path(tmp_name)
        cancel = threading.Event()
        try:
            try:
                actual, size = await asyncio.wait_for(
                    asyncio.to_thread(self._download, url, tmp, max_bytes, cancel), timeout_s
                )
            except TimeoutError:
                raise ImageCacheError(
                    f"download did not finish within {timeout_s:g}s",
                    code="fetch_timeout",
                    evidence={"url": url, "timeout_s": timeout_s},
                ) from None
            finally:
                cancel.set()  # the thread stops at its next chunk if it is still running
            if actual != expected:
                raise ImageCacheError(
                    "downloaded image does not have the expected SHA-256",
                    code="digest_mismatch",
                    evidence={"url": url, "expected_sha256": expected, "actual_sha256": actual, "size_bytes": size},
                )
            image_format = await _probe_format(tmp, url)
            os.replace(tmp, self.image_path(expected))
            fsync_dir(self.entries)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        marker = CacheEntryMarker(sha256=expected, size_bytes=size, source_url=url, format=image_format,
                                  verified_at=datetime.now(UTC))
        try:
            write_atomic(self.marker_path(expected), marker.model_dump_json().encode(), mode=0o600)
        except OSError as exc:
            # An image without its marker is never trusted: give the space back now.
            self.image_path(expected).unlink(missing_ok=True)
            code = "cache_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "cache_write_failed"
            raise ImageCacheError(f"cannot write the cache entry marker: {exc.strerror}", code=code,
                                  evidence={"cache": str(self.entries), "errno": exc.errno}) from exc
        log.info("event=image_cached sha256=%s size_bytes=%d format=%s", expected, size, image_format.value)
        return CachedImage(path=str(self.image_path(expected)), sha256=expected, size_bytes=size, source_url=url,
                           format=image_format)

    def _check_url(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme == "https" and parts.hostname:
            return
        if parts.scheme == "file" and parts.netloc in ("", "localhost") and parts.path:
            return
        if parts.scheme == "http" and self.allow_loopback_http and _is_loopback(parts.hostname):
            return
        raise ImageCacheError(
            f"cannot fetch images from {parts.scheme or 'a scheme-less'} URL",
            code="unsupported_url",
            evidence={"url": url, "accepted": ["https://", "file://"]},
        )

    def _download(self, url: str, tmp: Path, max_bytes: int | None, cancel: threading.Event) -> tuple[str, int]:
        """Runs in a worker thread: open the source, stream it through the digest into ``tmp``."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
        try:
            source = self._open(url, max_bytes)
            try:
                return self._copy(source, fd, url, max_bytes, cancel)
            finally:
                source.close()
        finally:
            os.close(fd)

    def _copy(self, source: _Source, fd: int, url: str, max_bytes: int | None,
              cancel: threading.Event) -> tuple[str, int]:
        """One pass over the source: every chunk is hashed and written; errors get their code."""

        def read_into(buf: memoryview) -> int:
            try:
                return source.read_into(buf)
            except (OSError, http.client.HTTPException) as exc:
                raise ImageCacheError(
                    f"source stopped before the end: {exc}",
                    code="truncated",
                    evidence={**source.describe, "error": repr(exc)},
                ) from exc

        write_all = _write_all(fd)

        def write(chunk: memoryview) -> None:
            try:
                write_all(chunk)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ImageCacheError(
                        "the image cache file system is full",
                        code="cache_full",
                        evidence={"cache": str(self.entries), "url": url, "errno": exc.errno},
                    ) from exc
                raise ImageCacheError(
                    f"cannot write the cache file: {exc.strerror}",
                    code="cache_write_failed",
                    evidence={"cache": str(self.entries), "errno": exc.errno},
                ) from exc

        digest, total = sha256_stream(read_into, write, max_bytes=max_bytes, cancel=cancel)
        if source.length is not None and total < source.length:
            raise ImageCacheError(
                f"source ended after {total} of {source.length} bytes",
                code="truncated",
                evidence={**source.describe, "expected_bytes": source.length, "received_bytes": total},
            )
        try:
            os.fsync(fd)
        except OSError as exc:
            code = "cache_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "cache_write_failed"
            raise ImageCacheError(f"cannot flush the cache file: {exc.strerror}", code=code,
                                  evidence={"cache": str(self.entries), "errno": exc.errno}) from exc
        return digest, total

    def _open(self, url: str, max_bytes: int | None) -> _Source:
        parts = urlsplit(url)
        if parts.scheme == "file":
            source = _open_file(unquote(parts.path), url)
        else:
            source = self._open_http(url)
        if max_bytes is not None and source.length is not None and source.length > max_bytes:
            source.close()
            raise ImageCacheError(
                f"source announces {source.length} bytes, more than the allowed {max_bytes}",
                code="too_large",
                evidence={**source.describe, "length": source.length, "max_bytes": max_bytes},
            )
        return source

    def _open_http(self, url: str) -> _Source:
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            self._check_url(url)  # a redirect may not downgrade to http or leave for file://
            if parts.scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    parts.hostname, parts.port, timeout=self.network_timeout_s, context=self.ssl_context
                )
            else:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.network_timeout_s)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            try:
                conn.request("GET", target, headers={"Accept-Encoding": "identity", "User-Agent": "gpuaas-agent"})
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise ImageCacheError(
                    f"cannot reach the image server: {exc}",
                    code="fetch_failed",
                    evidence={"url": url, "error": repr(exc)},
                ) from exc
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location"))
                conn.close()
                continue
            if response.status != 200:
                conn.close()
                raise ImageCacheError(
                    f"image server answered HTTP {response.status} {response.reason}",
                    code="fetch_failed",
                    evidence={"url": url, "http_status": response.status},
                )
            return _Source(response.readinto, response.length, conn.close, {"url": url})
        raise ImageCacheError("too many redirects", code="fetch_failed", evidence={"url": url})


def _open_file(path: str, url: str) -> _Source:
    try:
        fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the _Source
        length = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise ImageCacheError(
            f"cannot open the image source: {exc.strerror}",
            code="fetch_failed",
            evidence={"url": url, "errno": exc.errno},
        ) from exc
    return _Source(fh.readinto, length, fh.close, {"url": url})


async def _probe_format(path: Path, url: str) -> ImageFormat:
    """The format qemu-img sees; only raw and qcow2 without external files may reach a disk.

    A qcow2 with a backing file or an external data file would make the clone read a
    path on this host chosen by whoever built the image.
    """
    done = await run(["qemu-img", "info", "--output=json", str(path)], timeout=QEMU_IMG_INFO_TIMEOUT_S)
    info = json.loads(done.stdout)
    name = info.get("format")
    try:
        image_format = ImageFormat(name)
    except ValueError:
        raise ImageCacheError(
            f"image format {name!r} is not accepted (raw and qcow2 only)",
            code="unknown_format",
            evidence={"url": url, "format": name},
        ) from None
    data_file = ((info.get("format-specific") or {}).get("data") or {}).get("data-file")
    if info.get("backing-filename") or info.get("full-backing-filename") or data_file:
        raise ImageCacheError(
            "image refers to another file (backing file or external data file)",
            code="backing_file_refused",
            evidence={"url": url, "backing_filename": info.get("backing-filename"), "data_file": data_file},
        )
    return image_format


def _digest_arg(value: str) -> str:
    digest = value.lower()
    if not SHA256_RE.match(digest):
        raise ContractError("expected a SHA-256 digest as 64 hex digits", code="invalid_digest",
                            evidence={"value": value[:80]})
    return digest




