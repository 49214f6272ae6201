"""Image cache: fetch an image once, hash it while it arrives, keep it under its SHA-256.

Layout under the cache root::

    sha256/<hex>                 the image, only ever put there by os.replace after its digest matched
    sha256/<hex>.verified.json   CacheEntryMarker, written atomically after the image
    sha256/.<hex>.*.partial      a download in flight (removed on any failure)

A hit needs both the image and its marker (with the same size) and does not
hash again: the digest was proven on the way in (docs/performance.md, "hashed once per
cache entry, not once per clone"). The clone onto a slot disk is another driver.
A digest is not a secret, so a hit is served only to a fetch whose own URL is the
recorded source or answers for the cached bytes (:meth:`ImageCache.prove_source`).

Bounded disk use: the cache holds at most ``cache_max_bytes`` of images and never
lets a download take its file system below ``min_free_bytes`` (the cache often sits
on the OS disk). Least-recently-used entries go first (a hit touches the marker's
mtime); an entry that is pinned (:meth:`ImageCache.pin` / :meth:`ImageCache.in_use`,
held by a provision from its image step until its clone is done) or being fetched
is never evicted. A download that cannot fit even after eviction is refused with
``cache_full`` before a byte is written, and stopped with ``cache_full`` if the
file system fills under it anyway.

Before anything is opened the URL must pass the config's allow-list
(``host/images/source.py``). Every download is bounded: at most
``min(max_bytes, declared size)`` bytes, no byte for ``stall_timeout_s`` fails it,
and an optional whole-download timeout. A failure never reports anything derived
from what was read (no digest of it): the error would otherwise turn the cache into
an oracle for whatever the source could reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import http.client
import json
import logging
import os
import secrets
import ssl
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import ValidationError

from gpuaas_agent.atomicfile import fsync_dir, write_atomic
from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.images import CachedImage, CacheEntryMarker, ImageFormat
from gpuaas_agent.contract.types import SHA256_RE
from gpuaas_agent.errors import ContractError, HostError
from gpuaas_agent.host.images import curlstream, httpfetch
from gpuaas_agent.host.images import source as imagesource
from gpuaas_agent.host.images import stream as imagestream
from gpuaas_agent.host.images.source import ImageCacheError, SourcePolicy
from gpuaas_agent.host.run import run

__all__ = ["CHUNK_BYTES", "DEFAULT_MAX_BYTES", "DEFAULT_STALL_TIMEOUT_S", "DiskSink", "ImageCache", "ImageCacheError",
           "SourcePolicy", "StreamedMiss", "sha256_file", "sha256_file_async", "sha256_stream"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

CHUNK_BYTES = 1 << 20  # 1 MiB: large enough that hashlib (which drops the GIL) runs at full speed
MAX_REDIRECTS = httpfetch.MAX_REDIRECTS
QEMU_IMG_INFO_TIMEOUT_S = 60.0
DEFAULT_MAX_BYTES = 64 << 30
DEFAULT_STALL_TIMEOUT_S = 60.0
FREE_SPACE_CHECK_BYTES = 64 << 20  # re-check the free-space floor every 64 MiB written
DIRECT_ALIGN = 4096  # O_DIRECT offsets and lengths: a multiple of every logical block size (512, 4096)
TICK_S = 0.2  # how often a stream's progress is looked at (an event is sent only when the percent moved)
CACHE_SYNC_BYTES = 64 << 20  # a streamed cache file is flushed every 64 MiB, not all at its end
SOURCE_SAMPLES = 8  # ranges a source other than the recorded one must answer for a hit (ImageCache.prove_source)
SOURCE_SAMPLE_BYTES = 64 << 10


@dataclass(frozen=True)
class CacheStats:
    size_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int


@dataclass(frozen=True)
class _Entry:
    sha256: str
    size_bytes: int
    last_used: float


class _Cancelled(Exception):
    """The awaiting coroutine gave up (deadline or cancellation); the copy thread stops."""


def sha256_stream(read_into: Callable[[memoryview], int], write: Callable[[memoryview], None] | None = None,
                  *, max_bytes: int | None = None, cancel: threading.Event | None = None,
                  head: bytes = b"") -> tuple[str, int]:
    """Hash (and optionally copy) a stream in 1 MiB chunks; one read of every byte.

    One preallocated buffer, no per-chunk allocation. ``read_into`` returns 0 at
    the end. ``head``: bytes of the stream read (and written) before; hashed, not written.
    Returns ``(hex digest, byte count)``. This is the loop the benchmark measures.
    """
    digest = hashlib.sha256(head)
    buf = memoryview(bytearray(CHUNK_BYTES))
    total = len(head)
    while True:
        if cancel is not None and cancel.is_set():
            raise _Cancelled()
        n = read_into(buf)
        if not n:
            break
        if cancel is not None and cancel.is_set():
            raise _Cancelled()  # gave up while this read blocked: nothing more is written
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
    """Digest of a local file with the cache's hashing loop (benchmarks, re-verification).

    Plain ``readinto`` of 1 MiB into one buffer: measured here against ``mmap`` (with and
    without ``MAP_POPULATE``) and chunks of 64 KiB to 4 MiB, it is the fastest (~1.5 GiB/s,
    SHA-NI bound; mmap's page faults cost ~15 %). ``POSIX_FADV_SEQUENTIAL`` doubles the
    read-ahead for a file not yet in the page cache. Blocking: from a coroutine, call
    :func:`sha256_file_async`.
    """
    with open(path, "rb", buffering=0) as fh:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return sha256_stream(fh.readinto)[0]


async def sha256_file_async(path: str | os.PathLike[str]) -> str:
    """:func:`sha256_file` in a worker thread: hashlib drops the GIL, so the event loop keeps running."""
    return await asyncio.to_thread(sha256_file, path)


def _open_direct(path: Path) -> int | None:
    """A second, ``O_DIRECT`` descriptor of a partial file; None where the file system refuses it (tmpfs)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def _datasync(fd: int, cache: ImageCache) -> None:
    try:
        os.fdatasync(fd)
    except OSError as exc:
        code = "cache_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "cache_write_failed"
        raise ImageCacheError(f"cannot flush the cache file: {exc.strerror}", code=code,
                              evidence={"cache": str(cache.entries), "errno": exc.errno}) from exc


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_all(fd: int) -> Callable[[memoryview], None]:
    def write(chunk: memoryview) -> None:
        while chunk:
            written = os.write(fd, chunk)
            chunk = chunk[written:]

    return write


class _Source:
    """An opened source: a readinto function, the length it announced, and how to close it."""

    def __init__(self, read_into: Callable[[memoryview], int], length: int | None, close: Callable[[], None],
                 describe: dict[str, Any], fileno: Callable[[], int] | None = None,
                 set_cancel: Callable[[threading.Event], None] | None = None,
                 interrupt: Callable[[], None] | None = None) -> None:
        self.read_into = read_into
        self.length = length
        self.close = close
        self.describe = describe
        self._fileno = fileno
        self._set_cancel = set_cancel
        self._interrupt = interrupt

    def interrupt(self) -> None:
        """Wake a read blocked in the copy thread (a network source); files never block for long."""
        if self._interrupt is not None:
            self._interrupt()

    def follow(self, cancel: threading.Event) -> None:
        """Obey ``cancel`` from now on (a source opened under one watch and read under another)."""
        if self._set_cancel is not None:
            self._set_cancel(cancel)

    def fileno(self) -> int:
        """The descriptor of a local file source (``pread`` of sampled ranges)."""
        if self._fileno is None:
            raise ValueError("not a file source")
        return self._fileno()


class _Progress:
    """When the copy thread last received a byte (time.monotonic); the stall watchdog reads it."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()


class ImageCache:
    """Content-addressed cache of VM images under ``root``, filled only from allowed sources.

    ``policy``: where images may come from (nothing by default); ``state_dir`` and ``root``
    are never a source. ``max_bytes``: no image is larger. ``stall_timeout_s``: the longest
    wait for the next byte (also the socket timeout, so a stalled connection's thread ends).
    """

    def __init__(self, root: Path, *, policy: SourcePolicy | None = None, state_dir: Path | None = None,
                 ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, cache_max_bytes: int | None = None,
                 min_free_bytes: int = 0) -> None:
        self.root = Path(root)
        self.entries = self.root / "sha256"
        policy = policy or SourcePolicy()
        forbidden = (*policy.forbidden, self.root, *((state_dir,) if state_dir is not None else ()))
        self.policy = SourcePolicy(https_hosts=policy.https_hosts, file_dir=policy.file_dir,
                                   allow_loopback_http=policy.allow_loopback_http, forbidden=forbidden)
        # A context, or how to make one on the first download (the system store's ~140 CAs cost ~0.3-0.7 MiB of
        # OpenSSL's heap, which a host that never fetches an image need not carry: docs/performance.md).
        self._ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] = ssl_context or ssl.create_default_context
        if max_bytes <= 0 or stall_timeout_s <= 0:
            raise ValueError("max_bytes and stall_timeout_s must be positive")
        self.max_bytes = max_bytes
        self.stall_timeout_s = stall_timeout_s
        self.cache_max_bytes = cache_max_bytes
        self.min_free_bytes = min_free_bytes
        self._locks: dict[str, asyncio.Lock] = {}
        self._pins: dict[str, int] = {}  # sha256 -> holders (in-flight fetches, provisions until their clone)
        self._waiting: dict[str, int] = {}  # sha256 -> fetches waiting for its lock
        self.hits = self.misses = self.evictions = 0
        # A dropped connection or a refused one is retried this many times, backing off from this delay.
        self.http_retries = httpfetch.DEFAULT_RETRIES
        self.http_backoff_s = httpfetch.DEFAULT_BACKOFF_S

    @property
    def ssl_context(self) -> ssl.SSLContext:
        """The downloads' TLS context, made on first use when the cache was given how to make it."""
        if not isinstance(self._ssl_context, ssl.SSLContext):
            self._ssl_context = self._ssl_context()
        return self._ssl_context

    # -- bounds: pins, LRU, eviction ------------------------------------------------------

    def pin(self, sha256: str) -> None:
        """Keep ``sha256`` out of eviction until as many :meth:`unpin` calls (a refcount)."""
        sha256 = _digest_arg(sha256)
        self._pins[sha256] = self._pins.get(sha256, 0) + 1

    def unpin(self, sha256: str) -> None:
        sha256 = _digest_arg(sha256)
        held = self._pins.get(sha256, 0) - 1
        if held > 0:
            self._pins[sha256] = held
        else:
            self._pins.pop(sha256, None)

    @contextlib.contextmanager
    def in_use(self, sha256: str) -> Iterator[None]:
        """``with cache.in_use(digest): clone(...)``: the image cannot be evicted meanwhile."""
        self.pin(sha256)
        try:
            yield
        finally:
            self.unpin(sha256)

    def pinned(self) -> set[str]:
        return set(self._pins)

    def _entries(self) -> list[_Entry]:
        """Verified entries with their size and last use (the marker's mtime), oldest use first."""
        if not self.entries.is_dir():
            return []
        found = []
        for path in self.entries.iterdir():
            digest = path.name
            if not SHA256_RE.match(digest):
                continue
            try:
                size = path.stat().st_size
                used = self.marker_path(digest).stat().st_mtime
            except OSError:
                continue
            found.append(_Entry(digest, size, used))
        return sorted(found, key=lambda e: (e.last_used, e.sha256))

    def free_bytes(self) -> int:
        st = os.statvfs(self.entries if self.entries.is_dir() else self.root)
        return st.f_bavail * st.f_frsize

    def stats(self) -> CacheStats:
        entries = self._entries()
        return CacheStats(size_bytes=sum(e.size_bytes for e in entries), entries=len(entries), hits=self.hits,
                          misses=self.misses, evictions=self.evictions)

    def _evict(self, entry: _Entry) -> None:
        self.marker_path(entry.sha256).unlink(missing_ok=True)  # the marker first: a crash leaves no trusted half
        self.image_path(entry.sha256).unlink(missing_ok=True)
        self.evictions += 1
        log.info("event=image_cache_evicted sha256=%s size_bytes=%d", entry.sha256, entry.size_bytes)

    def enforce_bounds(self, incoming_bytes: int = 0) -> list[str]:
        """Evict least-recently-used, unpinned entries until ``incoming_bytes`` more fit both bounds.

        Returns the evicted digests. Does not raise: :meth:`_check_room` says whether it was enough.
        """
        if not self.entries.is_dir():
            return []
        evicted = []
        entries = self._entries()
        total = sum(e.size_bytes for e in entries)
        for entry in entries:
            over_cap = self.cache_max_bytes is not None and total + incoming_bytes > self.cache_max_bytes
            under_floor = self.free_bytes() - incoming_bytes < self.min_free_bytes
            if not (over_cap or under_floor):
                break
            if entry.sha256 in self._pins or self._locks.get(entry.sha256, asyncio.Lock()).locked():
                continue
            self._evict(entry)
            total -= entry.size_bytes
            evicted.append(entry.sha256)
        return evicted

    def _check_room(self, incoming_bytes: int, url: str) -> None:
        """``cache_full`` unless ``incoming_bytes`` fit under the cap and above the free-space floor."""
        self.entries.mkdir(parents=True, exist_ok=True)
        self.enforce_bounds(incoming_bytes)
        total = sum(e.size_bytes for e in self._entries())
        free = self.free_bytes()
        evidence = {"cache": str(self.entries), "url": url, "incoming_bytes": incoming_bytes, "free_bytes": free,
                    "min_free_bytes": self.min_free_bytes, "cache_bytes": total,
                    "cache_max_bytes": self.cache_max_bytes, "pinned": sorted(self._pins)}
        if free - incoming_bytes < self.min_free_bytes:
            raise ImageCacheError(
                f"the image needs {incoming_bytes} bytes; {free} are free and {self.min_free_bytes} must stay free "
                f"(image_cache_min_free_bytes), after evicting every unused image", code="cache_full", evidence=evidence)
        if self.cache_max_bytes is not None and total + incoming_bytes > self.cache_max_bytes:
            raise ImageCacheError(
                f"the image needs {incoming_bytes} bytes; images in use hold {total} of the cache's "
                f"{self.cache_max_bytes} (image_cache_max_bytes)", code="cache_full", evidence=evidence)

    # -- paths and markers ----------------------------------------------------------

    def image_path(self, sha256: str) -> Path:
        return self.entries / sha256

    def marker_path(self, sha256: str) -> Path:
        return self.entries / f"{sha256}.verified.json"

    def lookup(self, sha256: str) -> CachedImage | None:
        """The verified entry for a digest, without hashing; ``None`` on a miss.

        An image without a marker, or whose size differs from the marker's, is not
        trusted (a crash between replace and marker, or someone touched the file). Nor
        is one whose recorded source the policy refuses today: an entry an older agent
        took from a device or the state dir is never served (and is removed at start).
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
        if not self._source_allowed(marker.source_url):
            log.warning("event=image_cache_entry_refused sha256=%s reason=source_not_allowed", sha256)
            return None
        return CachedImage(path=str(path), sha256=sha256, size_bytes=size, source_url=marker.source_url,
                           format=marker.format)

    def _refuse_unless_allowed(self, url: str) -> None:
        """``image_url_refused`` unless the policy accepts ``url``; nothing is opened.

        A file that is missing is not a refusal here (a hit does not need it; on a miss the
        copy thread checks again right before its open and reports ``fetch_failed``).
        """
        try:
            imagesource.check_url(self.policy, url)
        except ImageCacheError as exc:
            if exc.code == "image_url_refused":
                raise

    def _source_allowed(self, url: str) -> bool:
        try:
            self._refuse_unless_allowed(url)
        except ImageCacheError:
            return False
        return True

    def remove_stale_partials(self) -> list[str]:
        """Delete what is not a verified entry; call once at daemon start, before any fetch.

        That is the downloads a crashed agent left (``.*.partial``), an image without a valid
        marker (a crash between the replace and the marker), a marker without its image, and
        an entry whose recorded source the policy refuses.
        """
        if not self.entries.is_dir():
            return []
        removed = []
        for path in sorted(self.entries.iterdir()):
            name = path.name
            digest = name.removesuffix(".verified.json")
            stale = (name.startswith(".") and name.endswith(".partial")) or (
                SHA256_RE.match(digest) is not None and self.lookup(digest) is None)
            if stale and not path.is_dir():
                path.unlink(missing_ok=True)
                removed.append(name)
        return removed

    # -- fetch ------------------------------------------------------------------------

    def bound(self, max_bytes: int | None = None, size_bytes: int | None = None) -> int:
        """The most bytes a fetch may take: the config's limit, lowered by the caller's and the declared size."""
        return min(b for b in (self.max_bytes, max_bytes, size_bytes) if b is not None)

    async def fetch(self, url: str, expected_sha256: str, *, size_bytes: int | None = None,
                    max_bytes: int | None = None, timeout_s: float | None = None, pin: bool = False) -> CachedImage:
        """The verified cached image for ``expected_sha256``, downloading it from ``url`` on a miss.

        ``size_bytes``: the size the task declares; the image must have exactly that many bytes.
        ``max_bytes`` lowers the configured bound. ``timeout_s`` bounds the whole download
        (``None``: only the stall timeout, and the caller's own deadline). ``pin``: the entry is
        pinned before it is returned (no eviction gap between fetch and clone); the caller unpins.
        """
        expected = _digest_arg(expected_sha256)
        bound = self.bound(max_bytes, size_bytes)
        # A URL the policy refuses is refused whether or not the digest is cached: the answer to a
        # task never depends on what other tasks left in the cache.
        self._refuse_unless_allowed(url)
        lock = await self._acquire(expected)
        try:
            hit = await self._serve_hit(url, expected, bound=bound, size_bytes=size_bytes, timeout_s=timeout_s,
                                        pin=pin)
            if hit is not None:
                return hit
            cached = await self._fetch_miss(url, expected, bound=bound, size_bytes=size_bytes, timeout_s=timeout_s)
            return self._settle_new_entry(cached, pin=pin)
        finally:
            lock.release()

    async def fetch_or_open(self, url: str, expected_sha256: str, *, size_bytes: int | None = None,
                            timeout_s: float | None = None, pin: bool = False) -> CachedImage | StreamedMiss:
        """What a provision's image step asks: a hit, or a raw image ready to stream, or a fetched image.

        A hit is :meth:`fetch`'s (its source proven, pinned when ``pin``). On a miss the source is
        opened and its first chunk read and probed here, before any disk is touched (a 404, a
        refused redirect, a format qemu-img refuses fail now, the slot still clean):

        - raw: a :class:`StreamedMiss` that holds this digest's lock until it is written
          (:meth:`StreamedMiss.write`, one pass onto the disk and into the cache) or abandoned;
          another fetch of the digest meanwhile waits for the cache, never reads the partial file;
        - anything else (qcow2 needs random access): the rest is downloaded into the cache as
          :meth:`fetch` does and the entry returned with ``source_proof=None``, for a clone.
        """
        expected = _digest_arg(expected_sha256)
        bound = self.bound(None, size_bytes)
        self._refuse_unless_allowed(url)
        lock = await self._acquire(expected)
        handed_over = False
        try:
            hit = await self._serve_hit(url, expected, bound=bound, size_bytes=size_bytes, timeout_s=timeout_s,
                                        pin=pin)
            if hit is not None:
                return hit
            self.entries.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=self.entries, prefix=f".{expected}.", suffix=".partial")
            tmp = Path(tmp_name)
            source: _Source | None = None
            try:
                source, head = await self._open_head(url, bound, size_bytes, timeout_s)
                await asyncio.to_thread(_pwrite_all, fd, head, 0)
                os.lseek(fd, len(head), os.SEEK_SET)
                head_format = await _probe_head(tmp, url)
            except BaseException:
                if source is not None:
                    source.close()
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            if head_format is ImageFormat.raw:
                handed_over = True
                return StreamedMiss(self, lock, url, expected, source=source, head=head, fd=fd, tmp=tmp,
                                    bound=bound, size_bytes=size_bytes, timeout_s=timeout_s)
            log.info("event=image_not_streamed sha256=%s format=%s reason=needs_random_access", expected,
                     head_format.value if head_format else "unknown")
            cached = await self._fetch_miss(url, expected, bound=bound, size_bytes=size_bytes, timeout_s=timeout_s,
                                            opened=(fd, tmp, source, head))
            return self._settle_new_entry(cached, pin=pin)
        finally:
            if not handed_over:
                lock.release()

    async def _acquire(self, expected: str) -> asyncio.Lock:
        """This digest's lock, acquired: one fetch of a digest at a time (the rest wait for the cache)."""
        lock = self._locks.setdefault(expected, asyncio.Lock())
        self._waiting[expected] = self._waiting.get(expected, 0) + 1
        try:
            await lock.acquire()
        finally:
            self._waiting[expected] -= 1
            if not self._waiting[expected]:
                del self._waiting[expected]
        return lock

    def waiting(self, sha256: str) -> int:
        """How many fetches wait for ``sha256`` while another fetches or streams it."""
        return self._waiting.get(_digest_arg(sha256), 0)

    async def _serve_hit(self, url: str, expected: str, *, bound: int, size_bytes: int | None,
                         timeout_s: float | None, pin: bool) -> CachedImage | None:
        """The hit, its source proven (pinned when ``pin``); or None: a miss, counted, with room for it checked."""
        hit = self.lookup(expected)
        if hit is None:
            self.misses += 1
            self._check_room(size_bytes or 0, url)
            return None
        _check_final_size(hit.size_bytes, bound, size_bytes, {"url": url, "cached": True})
        proof = await self.prove_source(url, hit, bound=bound, size_bytes=size_bytes, timeout_s=timeout_s)
        self.hits += 1
        with contextlib.suppress(OSError):
            os.utime(self.marker_path(expected))  # last use, for LRU eviction
        log.info("event=image_cache_hit sha256=%s size_bytes=%d source_proof=%s", expected, hit.size_bytes, proof)
        if pin:
            self.pin(expected)
        return hit.model_copy(update={"source_proof": proof})

    def _settle_new_entry(self, cached: CachedImage, *, pin: bool) -> CachedImage:
        """Pin a new entry for the caller if asked, then trim the cache (never the new entry itself)."""
        if pin:
            self.pin(cached.sha256)
        self.pin(cached.sha256)  # the new entry is not evicted to make room for itself
        try:
            evicted = self.enforce_bounds()
        finally:
            self.unpin(cached.sha256)
        if evicted:
            log.info("event=image_cache_trimmed evicted=%s", ",".join(evicted))
        return cached

    async def prove_source(self, url: str, hit: CachedImage, *, bound: int, size_bytes: int | None = None,
                           timeout_s: float | None = None) -> str:
        """How ``url`` proved it answers for the cached bytes of ``hit``; raises as a miss from ``url`` would.

        A hit is decided by the digest, and a digest is not a secret: without this, whoever knows
        the digest of another tenant's private image (fetched through a presigned URL) would get it
        by naming any allowed URL, even one that answers 404. So a hit is served only when:

        - ``recorded_source``: ``url`` is the very URL the entry was fetched and verified from;
        - ``ranges``: ``url`` has the entry's size and answers :data:`SOURCE_SAMPLES` ranges of
          :data:`SOURCE_SAMPLE_BYTES` (the first, the last, the rest at offsets drawn now, so they
          cannot be known in advance) with the cached bytes;
        - ``full_read``: a server that answers a range request with the whole body (200) is read
          whole through the digest, written nowhere, and must give ``hit.sha256``.

        Failures carry the codes and messages of a download from ``url``: a 404 is ``fetch_failed``,
        other bytes are ``digest_mismatch`` with nothing derived from what was read, so the answer
        does not tell whether the digest was cached.
        """
        if url == hit.source_url:
            return "recorded_source"
        ranges = sample_ranges(hit.size_bytes)
        try:
            answered = await asyncio.to_thread(self._read_source_ranges, url, ranges, hit.size_bytes, bound,
                                               size_bytes)
        except httpfetch.RangesRefused:
            fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            await self._download_in_thread(url, hit.sha256, fd, bound, size_bytes, timeout_s)
            return "full_read"
        with open(hit.path, "rb", buffering=0) as cached:
            held = [os.pread(cached.fileno(), length, start) for start, length in ranges]
        if answered != held:
            raise _digest_mismatch(url, hit.sha256)
        return "ranges"

    def _read_source_ranges(self, url: str, ranges: list[tuple[int, int]], total: int, bound: int,
                            size_bytes: int | None) -> list[bytes]:
        """Runs in a thread: ``ranges`` of ``url`` (policy-checked like a download), or [] for another size."""
        if urlsplit(url).scheme != "file":
            return httpfetch.read_ranges(url, ranges, total, check_hop=self._check_redirect, verify=self.ssl_context,
                                         stall_timeout_s=self.stall_timeout_s)
        source = self._open(url, bound, size_bytes)
        try:
            if source.length != total:
                return []
            fd = source.fileno()
            return [os.pread(fd, length, start) for start, length in ranges]
        finally:
            source.close()

    async def _fetch_miss(self, url: str, expected: str, *, bound: int, size_bytes: int | None,
                          timeout_s: float | None,
                          opened: tuple[int, Path, _Source, bytes] | None = None) -> CachedImage:
        """Download into a partial file, verify, probe, move under the digest, write the marker.

        ``opened``: (partial fd, its path, the source, the head already read and written) from
        :meth:`fetch_or_open`; the download goes on from there, one read of every byte.
        """
        if opened is None:
            self.entries.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=self.entries, prefix=f".{expected}.", suffix=".partial")
            tmp, source, head = Path(tmp_name), None, b""
        else:
            fd, tmp, source, head = opened
        try:
            size = await self._download_in_thread(url, expected, fd, bound, size_bytes, timeout_s, source=source,
                                                  head=head)
            image_format = await _probe_format(tmp, url)
            os.replace(tmp, self.image_path(expected))
            fsync_dir(self.entries)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self._write_marker(url, expected, size, image_format)

    def _write_marker(self, url: str, expected: str, size: int, image_format: ImageFormat) -> CachedImage:
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

    async def _open_head(self, url: str, bound: int, size_bytes: int | None,
                         timeout_s: float | None) -> tuple[_Source, bytes]:
        """Open ``url`` and read its first chunk (enough for qemu-img's format probe), in a thread."""

        def work(cancel: threading.Event, progress: _Progress) -> tuple[_Source, bytes]:
            source = self._open(url, bound, size_bytes, cancel)
            try:
                if source.length is not None and source.length > bound:
                    # Announced (a file's size, a Content-Length) beyond the bound: refused before any byte
                    # reaches the slot disk, which a streamed provision would otherwise leave to be wiped.
                    raise ImageCacheError(f"image is {source.length} bytes, larger than the allowed {bound}",
                                          code="too_large", evidence={**source.describe, "max_bytes": bound,
                                                                      "announced_bytes": source.length})
                progress.touch()
                buf = bytearray(imagestream.STREAM_CHUNK_BYTES)
                n = imagestream.fill(self._reader(source, progress), memoryview(buf))
                if n > bound:
                    raise ImageCacheError(f"image is larger than the allowed {bound} bytes", code="too_large",
                                          evidence={**source.describe, "max_bytes": bound})
                return source, bytes(buf[:n])
            except BaseException:
                source.close()
                raise

        return await self._watch(work, url, timeout_s, name=f"image-open-{url[-12:]}",
                                 abandoned=lambda value: value[0].close())

    async def _download_in_thread(self, url: str, expected: str, fd: int, bound: int, size_bytes: int | None,
                                  timeout_s: float | None, *, source: _Source | None = None,
                                  head: bytes = b"") -> int:
        """Copy in a thread of its own (it owns and closes ``fd``) while this coroutine watches the clock.

        ``source``/``head``: an opened source and the bytes already read from it (and written).
        """

        def work(cancel: threading.Event, progress: _Progress) -> tuple[str, int]:
            return self._download(url, fd, bound, size_bytes, cancel, progress, source=source, head=head)

        actual, size = await self._watch(work, url, timeout_s, name=f"image-fetch-{expected[:12]}", owns_fd=fd)
        if actual != expected:
            raise _digest_mismatch(url, expected)
        return size

    async def _watch(self, work: Callable[[threading.Event, _Progress], _T], url: str, timeout_s: float | None, *,
                     name: str, owns_fd: int | None = None, abandoned: Callable[[_T], None] | None = None,
                     on_tick: Callable[[], None] | None = None, finish: bool = False,
                     interrupt: Callable[[], None] | None = None) -> _T:
        """Run ``work(cancel, progress)`` in a thread of its own while this coroutine watches the clock.

        No byte for ``stall_timeout_s``: ``fetch_stalled``; past ``timeout_s``: ``fetch_timeout``.
        Either way, or on cancellation, ``cancel`` is set and the thread writes nothing more
        (a blocked socket read returns within the stall timeout); a result it still produces
        goes to ``abandoned``. ``owns_fd`` is closed here only if the thread never started.
        ``on_tick`` runs on the loop every :data:`TICK_S` (progress events). ``interrupt`` wakes a
        read the thread is blocked in, when this coroutine gives up. ``finish``: when this
        coroutine gives up, it still waits for the thread to end (a stalled read ends within the
        stall timeout), so the caller learns of the failure only once nothing holds or writes the
        descriptors the thread owns (a slot disk).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_T] = loop.create_future()
        cancel = threading.Event()
        progress = _Progress()

        def settle(value: _T | None, error: BaseException | None) -> None:
            if done.done():
                if error is None and abandoned is not None:
                    abandoned(value)  # type: ignore[arg-type]
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)  # type: ignore[arg-type]

        def run_work() -> None:
            try:
                value, error = work(cancel, progress), None
            except BaseException as exc:
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:
                if error is None and abandoned is not None:
                    abandoned(value)  # type: ignore[arg-type]  # the loop is gone: nobody waits any more

        thread = threading.Thread(target=run_work, name=name, daemon=True)
        try:
            thread.start()
        except BaseException:
            if owns_fd is not None:
                os.close(owns_fd)
            raise
        started = time.monotonic()
        try:
            while not done.done():
                now = time.monotonic()
                wait = progress.last + self.stall_timeout_s - now
                if timeout_s is not None:
                    wait = min(wait, started + timeout_s - now)
                if wait <= 0:
                    if timeout_s is not None and now - started >= timeout_s:
                        raise ImageCacheError(f"download did not finish within {timeout_s:g}s",
                                              code="fetch_timeout", evidence={"url": url, "timeout_s": timeout_s})
                    raise ImageCacheError(f"no data from the image source for {self.stall_timeout_s:g}s",
                                          code="fetch_stalled",
                                          evidence={"url": url, "stall_timeout_s": self.stall_timeout_s})
                await asyncio.wait([done], timeout=min(wait, TICK_S) if on_tick is not None else wait)
                if on_tick is not None:
                    on_tick()
        finally:
            cancel.set()  # the thread stops before its next write if it is still running
            if interrupt is not None and not done.done():
                interrupt()  # and a read it is blocked in returns now
            if finish and not done.done():
                await asyncio.wait([done], timeout=self.stall_timeout_s + 5.0)
                if done.done() and not done.cancelled():
                    done.exception()  # retrieved: the error that made us give up is the one raised
        return done.result()

    def _download(self, url: str, fd: int, bound: int, size_bytes: int | None, cancel: threading.Event,
                  progress: _Progress, *, source: _Source | None = None, head: bytes = b"") -> tuple[str, int]:
        """Runs in the copy thread: open the source, stream it through the digest into ``fd``."""
        try:
            if source is None:
                source = self._open(url, bound, size_bytes, cancel)
            source.follow(cancel)
            try:
                progress.touch()
                return self._copy(source, fd, url, bound, size_bytes, cancel, progress, head=head)
            finally:
                source.close()
        finally:
            os.close(fd)

    def _reader(self, source: _Source, progress: _Progress) -> Callable[[memoryview], int]:
        """``source.read_into`` with its errors given their codes, touching ``progress`` on every byte."""

        def read_into(buf: memoryview) -> int:
            try:
                n = source.read_into(buf)
            except TimeoutError as exc:
                raise ImageCacheError(
                    f"no data from the image source for {self.stall_timeout_s:g}s",
                    code="fetch_stalled",
                    evidence={**source.describe, "stall_timeout_s": self.stall_timeout_s},
                ) from exc
            except (OSError, http.client.HTTPException) as exc:
                raise ImageCacheError(
                    f"source stopped before the end: {exc}",
                    code="truncated",
                    evidence={**source.describe, "error": repr(exc)},
                ) from exc
            if n:
                progress.touch()
            return n

        return read_into

    def _cache_writer(self, fd: int, url: str, *, direct_fd: int | None = None) -> Callable[..., None]:
        """Writes into the partial file, with the free-space floor and typed errors.

        ``write(chunk, None)`` appends through ``fd``; ``write(chunk, offset)`` puts the chunk at
        ``offset`` through ``direct_fd`` (``O_DIRECT``: a streamed image's 4 MiB chunks skip the page
        cache, which is not copied into and not written back behind the slot disk's writes), its
        unaligned tail through ``fd``.
        """
        write_all = _write_all(fd)
        written = [0, 0]  # bytes written, bytes at the last free-space check

        def write(chunk: memoryview, offset: int | None = None) -> None:
            written[0] += len(chunk)
            if self.min_free_bytes and written[0] - written[1] >= FREE_SPACE_CHECK_BYTES:
                written[1] = written[0]
                free = self.free_bytes()
                if free < self.min_free_bytes:
                    raise ImageCacheError(
                        f"the cache file system has {free} bytes free, below image_cache_min_free_bytes "
                        f"{self.min_free_bytes}: download stopped", code="cache_full",
                        evidence={"cache": str(self.entries), "url": url, "free_bytes": free,
                                  "min_free_bytes": self.min_free_bytes, "written_bytes": written[0]})
            try:
                if offset is None or direct_fd is None:
                    write_all(chunk)
                else:
                    aligned = len(chunk) - len(chunk) % DIRECT_ALIGN
                    if aligned:
                        _pwrite_all(direct_fd, chunk[:aligned], offset)
                    if aligned < len(chunk):
                        _pwrite_all(fd, chunk[aligned:], offset + aligned)
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

        return write

    def _end_checks(self, source: _Source, fd: int, total: int, bound: int, size_bytes: int | None) -> None:
        """After the last byte: the whole announced and declared size arrived; the partial is on disk."""
        if source.length is not None and total < source.length:
            raise ImageCacheError(
                f"source ended after {total} of {source.length} bytes",
                code="truncated",
                evidence={**source.describe, "expected_bytes": source.length, "received_bytes": total},
            )
        _check_final_size(total, bound, size_bytes, source.describe)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):  # not /dev/null (a source proven by a full read)
                os.fsync(fd)
        except OSError as exc:
            code = "cache_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "cache_write_failed"
            raise ImageCacheError(f"cannot flush the cache file: {exc.strerror}", code=code,
                                  evidence={"cache": str(self.entries), "errno": exc.errno}) from exc

    def _copy(self, source: _Source, fd: int, url: str, bound: int, size_bytes: int | None,
              cancel: threading.Event, progress: _Progress, *, head: bytes = b"") -> tuple[str, int]:
        """One pass over the source: every chunk is hashed and written; errors get their code."""
        digest, total = sha256_stream(self._reader(source, progress), self._cache_writer(fd, url), max_bytes=bound,
                                      cancel=cancel, head=head)
        self._end_checks(source, fd, total, bound, size_bytes)
        return digest, total

    def _open(self, url: str, bound: int, size_bytes: int | None, cancel: threading.Event | None = None) -> _Source:
        parts = urlsplit(url)
        if parts.scheme == "file":
            source = _open_file(self.policy, imagesource.check_url(self.policy, url) or "", url)
        else:
            source = self._open_http(url, cancel, bound)
        if source.length is not None and source.length > bound:
            source.close()
            raise ImageCacheError(
                f"source announces {source.length} bytes, more than the allowed {bound}",
                code="too_large",
                evidence={**source.describe, "length": source.length, "max_bytes": bound},
            )
        if source.length is not None and size_bytes is not None and source.length < size_bytes:
            source.close()
            raise ImageCacheError(
                f"source announces {source.length} bytes, fewer than the declared {size_bytes}",
                code="truncated",
                evidence={**source.describe, "length": source.length, "declared_size_bytes": size_bytes},
            )
        return source

    def _check_redirect(self, hop: str, first: str) -> None:
        """Every hop passes the allow-list, and a redirect never leaves http(s) for file://."""
        try:
            if not hop.startswith(("https://", "http://")):
                raise imagesource.refused(hop, imagesource.RULE_SCHEME, "a redirect may not leave http(s)")
            imagesource.check_url(self.policy, hop)
        except ImageCacheError as exc:
            if hop != first:
                exc.evidence["redirected_from"] = first
            raise

    def _open_http(self, url: str, cancel: threading.Event | None = None, bound: int | None = None) -> _Source:
        """A curl child with the environment's proxies and this cache's CA trust (host/images/curlstream.py);
        every redirect hop passes :meth:`_check_redirect`; a dropped body resumes with Range."""
        source = curlstream.CurlSource(url, check_hop=self._check_redirect, verify=self.ssl_context,
                                       stall_timeout_s=self.stall_timeout_s, cancel=cancel,
                                       retries=self.http_retries, backoff_s=self.http_backoff_s, max_bytes=bound)
        try:
            source.open()
        except BaseException:
            source.close()
            raise
        return _Source(source.read_into, source.length, source.close, source.describe,
                       set_cancel=lambda event: setattr(source, "cancel", event), interrupt=source.interrupt)


class DiskSink(Protocol):
    """Where a streamed image's bytes go besides the cache (host/images/streamclone.py's slot disk writer).

    Called from one thread, chunk by chunk in order; :meth:`flush` after the last byte, :meth:`close`
    always, by the copy thread when it ends (so no write can land after the caller was answered).
    """

    def __call__(self, chunk: memoryview, offset: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class StreamedMiss:
    """A raw image not yet cached, its source open and its head read: :meth:`write` finishes it in one pass.

    Made by :meth:`ImageCache.fetch_or_open`; it holds the digest's lock (a second fetch of the
    image waits for the cache) and the partial file, until :meth:`write` ends or :meth:`abandon`.
    """

    format = ImageFormat.raw

    def __init__(self, cache: ImageCache, lock: asyncio.Lock, url: str, sha256: str, *, source: _Source, head: bytes,
                 fd: int, tmp: Path, bound: int, size_bytes: int | None, timeout_s: float | None) -> None:
        self.cache, self.url, self.sha256 = cache, url, sha256
        self.bound, self.size_bytes, self.timeout_s = bound, size_bytes, timeout_s
        self._lock, self._source, self._head, self._fd, self._tmp = lock, source, head, fd, tmp
        self._pending = True

    @property
    def length(self) -> int | None:
        """The image's size when the task declared it or the source announced it; None otherwise."""
        return self.size_bytes if self.size_bytes is not None else self._source.length

    def abandon(self) -> bool:
        """Close the source, remove the partial file, release the lock; False when already written or abandoned."""
        if not self._pending:
            return False
        self._pending = False
        try:
            self._source.close()
            os.close(self._fd)
            self._tmp.unlink(missing_ok=True)
        finally:
            self._lock.release()
        return True

    async def write(self, disk: DiskSink, *, on_bytes: Callable[[int], None] | None = None) -> CachedImage:
        """The rest of the download, each chunk hashed, written into the cache file and onto ``disk``.

        Returns the new verified cache entry, only once the digest matched. Fails with the codes of a
        download (``digest_mismatch``, ``truncated``, ``fetch_stalled``, ``fetch_timeout``, ``too_large``,
        ``cache_full``) or what ``disk`` raised; the partial file is removed and the lock released
        whatever happens, and ``disk`` has been written up to where it stopped. ``on_bytes(n)``: every
        :data:`TICK_S`, the bytes handed to the sinks so far.
        """
        if not self._pending:
            raise RuntimeError("this download was already written or abandoned")
        self._pending = False
        cache, source, fd, head = self.cache, self._source, self._fd, self._head
        handed = [0]

        def work(cancel: threading.Event, progress: _Progress) -> tuple[str, int]:
            direct_fd: int | None = None
            try:
                direct_fd = _open_direct(self._tmp)
                source.follow(cancel)
                digest = hashlib.sha256()
                cache_write = cache._cache_writer(fd, self.url, direct_fd=direct_fd)
                unsynced = [0]

                def hash_sink(chunk: memoryview, offset: int) -> None:
                    digest.update(chunk)

                def cache_sink(chunk: memoryview, offset: int) -> None:
                    already = max(0, len(head) - offset)  # the head is in the partial file since the probe
                    if already >= len(chunk):
                        return
                    if already or direct_fd is None:
                        cache_write(chunk[already:], None)  # appended: the file's position is the head's end
                    else:
                        cache_write(chunk, offset)  # offset is a multiple of the chunk size: O_DIRECT aligned
                        return
                    unsynced[0] += len(chunk)
                    if unsynced[0] >= CACHE_SYNC_BYTES:  # write-behind: the fsync after the last byte stays short
                        unsynced[0] = 0
                        _datasync(fd, cache)

                try:
                    # Three sinks, three threads: the hash, the cache file and the disk each go at their own pace.
                    total = imagestream.pump(cache._reader(source, progress), [hash_sink, cache_sink, disk], head=head,
                                             max_bytes=self.bound, cancel=cancel,
                                             on_chunk=lambda n: handed.__setitem__(0, n))
                except imagestream.TooLarge as exc:
                    raise ImageCacheError(f"image is larger than the allowed {self.bound} bytes", code="too_large",
                                          evidence={**source.describe, "max_bytes": self.bound,
                                                    "received_bytes_at_least": exc.received}) from None
                except imagestream.PumpCancelled:
                    raise _Cancelled() from None
                cache._end_checks(source, fd, total, self.bound, self.size_bytes)  # fsync: both fds, one file
                disk.flush()
                return digest.hexdigest(), total
            finally:
                try:
                    source.close()
                finally:
                    if direct_fd is not None:
                        os.close(direct_fd)
                    os.close(fd)
                    disk.close()

        def tick() -> None:
            if on_bytes is not None:
                on_bytes(handed[0])

        try:
            actual, size = await cache._watch(work, self.url, self.timeout_s, name=f"image-stream-{self.sha256[:12]}",
                                              on_tick=tick, finish=True, interrupt=source.interrupt)
            if actual != self.sha256:
                raise _digest_mismatch(self.url, self.sha256)
            image_format = await _probe_format(self._tmp, self.url)
            if image_format is not ImageFormat.raw:  # the head probed raw; qemu-img must agree on the whole
                raise ImageCacheError(f"the image probed raw from its first bytes and {image_format.value} whole",
                                      code="unknown_format", evidence={"url": self.url, "format": image_format.value})
            os.replace(self._tmp, cache.image_path(self.sha256))
            fsync_dir(cache.entries)
            cached = cache._write_marker(self.url, self.sha256, size, image_format)
        except BaseException:
            self._tmp.unlink(missing_ok=True)
            raise
        finally:
            self._lock.release()
        tick()
        return cache._settle_new_entry(cached, pin=False)


async def _probe_head(path: Path, url: str) -> ImageFormat | None:
    """The format qemu-img sees in an image's first chunk; None when it cannot tell from a prefix.

    qemu-img decides the format from the first bytes (magic numbers; raw is what matches none),
    so a head that probes raw is a raw image, and a refusal here (a format we do not take, a
    qcow2 with a backing file) is the refusal the whole file would get. A qcow2 prefix may not
    open at all: None, and the whole file decides.
    """
    try:
        return await _probe_format(path, url)
    except ImageCacheError:
        raise
    except HostError:
        return None


def _digest_mismatch(url: str, expected: str) -> ImageCacheError:
    # Never the digest or size of what was read: that would reveal the content of a source.
    return ImageCacheError("downloaded image does not have the expected SHA-256", code="digest_mismatch",
                           evidence={"url": url, "expected_sha256": expected})


def sample_ranges(size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the ranges a source must answer for a hit: first, last, and random ones.

    The random offsets come from :mod:`secrets`, drawn for each check: a source that answers
    them all with the cached bytes holds (nearly) the whole image, not a few pieces someone learnt.
    """
    if size == 0:
        return []
    length = min(SOURCE_SAMPLE_BYTES, size)
    starts = {0, size - length} | {secrets.randbelow(size - length + 1) for _ in range(SOURCE_SAMPLES - 2)}
    return [(start, length) for start in sorted(starts)]


def _check_final_size(size: int, bound: int, declared: int | None, describe: dict[str, Any]) -> None:
    """A whole image is within the bound and exactly the declared size, if one was declared."""
    if size > bound:
        raise ImageCacheError(f"image is larger than the allowed {bound} bytes", code="too_large",
                              evidence={**describe, "max_bytes": bound})
    if declared is not None and size != declared:
        raise ImageCacheError(f"image is shorter than the declared {declared} bytes", code="truncated",
                              evidence={**describe, "declared_size_bytes": declared, "received_bytes": size})


def _open_file(policy: SourcePolicy, path: str, url: str) -> _Source:
    fh, length = imagesource.open_file(policy, path, url)
    return _Source(fh.readinto, length, fh.close, {"url": url}, fh.fileno)


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
