"""Write a raw image onto the slot disk while it downloads: one pass, hashed on the way (docs/safety.md §1, docs/performance.md).

The image step opened the source and saw a raw image (host/images/cache.py ``StreamedMiss``); this
is the clone step's other way to fill the disk. The guard runs immediately before the first
byte is written, with the lease, exactly as for ``qemu-img convert`` (host/images/clone.py), and the
disk is held ``O_EXCL`` for the whole write. Writes are ``O_DIRECT`` in 4 MiB chunks where the
device takes it (the last, unaligned piece goes through the page cache), then flushed.

The provision goes on only when the digest matched: :func:`stream_image` returns after the
last byte was hashed and compared. Until then, and on any failure (a mismatch at the last
byte, a source that closes early or stalls, a cancel), the disk holds some prefix of the
image: every error here says ``disk_dirty=True`` and the clone step's ``touches_disk``
makes the slot ``cleanup_blocked`` until a release wipes it. The cache never keeps the partial file.

Zero chunks are skipped only when the caller's wipe proof says this very disk reads zero
(:func:`host.images.clone.target_is_zero`, the rule of ``--target-is-zero``); otherwise every byte is written.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Collection
from typing import Any

from gpuaas_agent.compat import timeout as compat_timeout
from gpuaas_agent.contract.images import CachedImage, ImageFormat
from gpuaas_agent.contract.storage import CloneProgress, CloneResult, DiskLease, WipeProof
from gpuaas_agent.errors import HostError
from gpuaas_agent.guards.disk import check_disk_writable, open_exclusive
from gpuaas_agent.host.images.cache import StreamedMiss
from gpuaas_agent.host.images.clone import (
    CloneError,
    ProgressCallback,
    disk_still_there,
    supports_o_direct,
    target_is_zero,
)
from gpuaas_agent.host.images.stream import STREAM_CHUNK_BYTES
from gpuaas_agent.hostfs import HostRoot

DIRECT_ALIGN = 4096  # a multiple of every logical block size (512, 4096): O_DIRECT offsets and lengths
_ZEROS = bytes(STREAM_CHUNK_BYTES)


def _is_zero(chunk: memoryview) -> bool:
    # The first page decides for almost every chunk of data; only a zero page pays for the whole compare.
    if chunk[:DIRECT_ALIGN].tobytes() != _ZEROS[:min(DIRECT_ALIGN, len(chunk))]:
        return False
    return chunk.tobytes() == (_ZEROS if len(chunk) == len(_ZEROS) else bytes(len(chunk)))


class DiskWriter:
    """The slot disk as a sink of the stream: exclusive hold, ``O_DIRECT`` writes, typed errors, flush."""

    def __init__(self, dev: str, *, size_bytes: int, skip_zero: bool, evidence: dict[str, Any]) -> None:
        self.dev, self.size_bytes, self.skip_zero, self.evidence = dev, size_bytes, skip_zero, evidence
        self.direct = supports_o_direct(dev)
        self.written = self.skipped = 0
        self._hold = open_exclusive(dev, evidence)  # a mount or dm/md claim now gets EBUSY, until close
        self._fds: list[int] = []
        try:
            self._fd = self._open(os.O_DIRECT if self.direct else 0)
            self._tail_fd = self._open(0) if self.direct else self._fd
        except BaseException:
            self.close()
            raise

    def _open(self, extra: int) -> int:
        fd = os.open(self.dev, os.O_WRONLY | os.O_CLOEXEC | extra)
        self._fds.append(fd)
        return fd

    def _failure(self, message: str, code: str = "clone_failed", **extra: Any) -> CloneError:
        return CloneError(message, code=code, evidence={"disk": self.evidence, "dev": self.dev, "disk_dirty": True,
                                                        "written_bytes": self.written, **extra})

    def __call__(self, chunk: memoryview, offset: int) -> None:
        n = len(chunk)
        if offset + n > self.size_bytes:
            raise self._failure(f"the image is larger than {self.dev} ({self.size_bytes} bytes)", code="image_too_large",
                              received_bytes_at_least=offset + n)
        if self.skip_zero and _is_zero(chunk):
            self.skipped += n
            return
        aligned = n - n % DIRECT_ALIGN if self.direct else n
        try:
            if aligned:
                _pwrite_all(self._fd, chunk[:aligned], offset)
            if aligned < n:
                _pwrite_all(self._tail_fd, chunk[aligned:], offset + aligned)
        except OSError as exc:
            raise self._failure(f"write to {self.dev} failed: {exc.strerror}", errno=exc.errno,
                              offset=offset) from exc
        self.written += n

    def flush(self) -> None:
        try:
            for fd in dict.fromkeys((self._fd, self._tail_fd)):
                os.fsync(fd)
        except OSError as exc:
            raise self._failure(f"flush of {self.dev} failed: {exc.strerror}", errno=exc.errno) from exc

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        if self._hold >= 0:
            os.close(self._hold)
            self._hold = -1


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


async def stream_image(host: HostRoot, miss: StreamedMiss, by_id: str, *, lease: DiskLease,
                       domain_disks: Collection[str] = (), wipe_proof: WipeProof | None = None,
                       on_progress: ProgressCallback | None = None,
                       timeout: float = 3600) -> tuple[CloneResult, CachedImage]:
    """Write ``miss`` onto the leased disk ``by_id`` and into the cache in one pass; the result and the entry.

    Raises ``DiskGuardError`` (nothing written; the download is abandoned), ``CloneError``
    ``image_too_large`` when the announced size does not fit (nothing written), and once writing
    began: the download's codes (``digest_mismatch``, ``truncated``, ``fetch_stalled``, ...) or
    ``clone_failed`` / ``clone_cancelled`` / ``missing``, each as a ``CloneError`` with
    ``disk_dirty=True``. Cancelling the task stops the stream and raises ``clone_cancelled``.
    """
    started = time.monotonic()
    try:
        evidence = await asyncio.to_thread(check_disk_writable, host, by_id, lease=lease, domain_disks=domain_disks)
        if miss.length is not None and miss.length > evidence.size_bytes:
            raise CloneError(f"{miss.url} ({miss.length} bytes) does not fit {by_id} ({evidence.size_bytes} bytes)",
                             code="image_too_large",
                             evidence={"source": miss.url, "virtual_size": miss.length,
                                       "disk": evidence.model_dump(mode="json"), "disk_dirty": False})
        dev = str(host.real(f"/dev/{evidence.kernel_name}"))
        zero = target_is_zero(wipe_proof, evidence)
        disk = DiskWriter(dev, size_bytes=evidence.size_bytes, skip_zero=zero,
                          evidence=evidence.model_dump(mode="json"))
    except BaseException:
        miss.abandon()
        raise
    dirty = {"source": miss.url, "disk": evidence.model_dump(mode="json"), "method": "stream", "disk_dirty": True}
    pending: set[asyncio.Future[Any]] = set()
    last = [-1.0]

    def report(_handed: int | None = None) -> None:
        # What reached the disk (written or skipped as zero), not what the reader handed out: up to
        # 32 MiB are in flight, and a percent must mean the disk, as qemu-img's does.
        if on_progress is None or not miss.length:
            return
        percent = round(min(100.0, 100.0 * (disk.written + disk.skipped) / miss.length), 2)
        if percent <= last[0] or (percent < 100 and last[0] >= 0 and percent - last[0] < 1.0):
            return  # at most one event per percent, as qemu-img -p prints them
        last[0] = percent
        result = on_progress(CloneProgress(by_id=by_id, percent=percent))
        if asyncio.iscoroutine(result):
            pending.add(asyncio.ensure_future(result))

    try:
        async with compat_timeout(timeout):
            cached = await miss.write(disk, on_bytes=report)
    except asyncio.CancelledError:
        raise CloneError(f"streaming onto {by_id} was cancelled; the disk is dirty", code="clone_cancelled",
                         evidence=dirty) from None
    except TimeoutError:
        raise CloneError(f"streaming onto {by_id} did not finish within {timeout:g}s; the disk is dirty",
                         evidence={**dirty, "timeout_s": timeout}) from None
    except HostError as exc:  # the disk writer's CloneError, or the download's ImageCacheError
        code = exc.code
        if code == "clone_failed" and not await asyncio.to_thread(disk_still_there, host, by_id, evidence):
            code = "missing"
        message = exc.message if isinstance(exc, CloneError) else f"streaming onto {by_id} failed: {exc.message}"
        raise CloneError(message, code=code, evidence={**exc.evidence, **dirty}) from exc
    finally:
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if on_progress is not None and last[0] < 100:
        report()
        if pending:
            await asyncio.gather(*pending)
    return CloneResult(by_id=by_id, kernel_name=evidence.kernel_name, source=miss.url,
                       source_format=ImageFormat.raw, virtual_size_bytes=cached.size_bytes, target_is_zero=zero,
                       argv=[], duration_s=time.monotonic() - started, method="stream",
                       zero_bytes_skipped=disk.skipped), cached
