"""Write a cached image onto the slot disk with ``qemu-img convert -O raw`` (docs/safety.md §1, docs/performance.md).

``qemu-img convert -n`` onto a disk whose child partition is mounted succeeds
and overwrites it (seen on CI machines; the seed 004 host had such disks), so
the guard runs immediately before the write, and the disk is held open
O_EXCL for the whole clone: nothing can mount or claim it meanwhile.

Any clone that did not finish leaves the disk *dirty*: every error raised
here says ``disk_dirty=True`` so the caller marks the slot ``cleanup_blocked``
and wipes it, never ``available``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, cast

from gpuaas_agent.contract.images import ImageFormat
from gpuaas_agent.contract.storage import (
    CloneProgress,
    CloneResult,
    DiskEvidence,
    DiskLease,
    WipeProof,
)
from gpuaas_agent.errors import HostError
from gpuaas_agent.guards.disk import check_disk_writable, open_exclusive
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.hostfs import HostRoot

Runner = Callable[..., Awaitable[Completed]]
ProgressCallback = Callable[[CloneProgress], Awaitable[None] | None]
COROUTINES = 16
PROGRESS_RE = re.compile(rb"\((\d+(?:\.\d+)?)/100%\)")


class CloneError(HostError):
    """The clone did not complete; ``evidence['disk_dirty']`` is always true."""

    default_code = "clone_failed"


class ProgressParser:
    """Turns qemu-img's ``\\r``-separated ``(12.34/100%)`` stream into monotonic percent events."""

    def __init__(self) -> None:
        self._buffer = b""
        self.last = -1.0

    def feed(self, chunk: bytes) -> list[float]:
        self._buffer += chunk
        *complete, self._buffer = re.split(rb"[\r\n]", self._buffer)
        out = []
        for piece in complete:
            match = PROGRESS_RE.search(piece)
            if match:
                percent = min(100.0, float(match.group(1)))
                if percent > self.last:
                    self.last = percent
                    out.append(percent)
        return out


async def image_info(source: str, *, runner: Runner = run, timeout: float = 60) -> dict[str, Any]:
    """``qemu-img info --output=json`` of a cached image; ``clone_failed`` when it cannot be read."""
    try:
        done = await runner(["qemu-img", "info", "--output=json", source], timeout=timeout)
        return cast("dict[str, Any]", json.loads(done.stdout))
    except HostError as exc:
        raise CloneError(
            f"cannot read image {source}: {exc.message}",
            evidence={**exc.evidence, "source": source, "disk_dirty": False},
        ) from exc
    except ValueError as exc:
        raise CloneError(
            f"qemu-img info of {source} is not JSON", evidence={"source": source, "disk_dirty": False}
        ) from exc


async def _check_qcow2(source: str, *, runner: Runner, timeout: float = 600) -> None:
    """Metadata consistency of a qcow2 before writing anything.

    A truncated qcow2 *converts without error*: reads past the end of the file
    return zeroes, so the guest would get a silently zeroed disk. ``qemu-img
    check`` (metadata only, fast) reports it. Exit 3 is leaked clusters only: harmless.
    """
    done = await runner(["qemu-img", "check", "-f", "qcow2", source], timeout=timeout, check=False)
    if done.returncode not in (0, 3):
        raise CloneError(
            f"{source} is a corrupt qcow2 (qemu-img check exited {done.returncode})",
            code="clone_failed",
            evidence={
                "source": source,
                "argv": list(done.argv),
                "returncode": done.returncode,
                "stderr": done.stderr.decode("utf-8", "replace")[-2000:],
                "stdout": done.stdout.decode("utf-8", "replace")[-1000:],
                "disk_dirty": False,
            },
        )


def supports_o_direct(dev: str) -> bool:
    """Whether the target takes O_DIRECT (``-t none``); loop over tmpfs, for one, does not."""
    try:
        fd = os.open(dev, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


def target_is_zero(proof: WipeProof | None, evidence: DiskEvidence) -> bool:
    """``--target-is-zero`` only when every LBA of *this very* disk (same link, node, device number) is known zero.

    That takes a proof whose guarantee covers every byte (Write Zeroes, an erase whose namespace reads
    zero, or a whole-device read): after a sampled proof of an advisory discard, qemu-img would skip the
    image's zero regions and leave whatever the sample missed readable on the next tenant's boot disk.
    """
    return (
        proof is not None
        and proof.covers_every_byte
        and proof.by_id == evidence.by_id
        and proof.kernel_name == evidence.kernel_name
        and proof.dev == evidence.dev
        and proof.bytes == evidence.size_bytes
    )


def convert_argv(source: str, source_format: ImageFormat, dev: str, *, direct: bool, zero: bool) -> list[str]:
    argv = ["qemu-img", "convert", "-p", "-n", "-f", source_format.value, "-O", "raw"]
    if direct:
        argv += ["-t", "none"]
    argv += ["-W", "-m", str(COROUTINES)]
    if zero:
        argv.append("--target-is-zero")  # valid only with -n, which is always given
    return argv + [source, dev]


async def clone_image(
    host: HostRoot,
    source: str,
    by_id: str,
    *,
    lease: DiskLease,
    domain_disks: Collection[str] = (),
    wipe_proof: WipeProof | None = None,
    on_progress: ProgressCallback | None = None,
    timeout: float = 3600,
    runner: Runner = run,
) -> CloneResult:
    """Clone ``source`` (raw or qcow2) onto the leased disk ``by_id``.

    ``wipe_proof``: the verified proof of the wipe that last wrote this disk;
    only then is ``--target-is-zero`` used (zeroes are skipped, not written).
    Raises ``DiskGuardError`` (nothing written), ``CloneError`` with
    ``unknown_format`` / ``image_too_large`` (nothing written) or
    ``clone_failed`` / ``clone_cancelled`` / ``missing`` (disk dirty).
    Cancelling the task kills qemu-img and raises ``clone_cancelled``:
    the caller must learn the disk is dirty, so the cancellation becomes a typed error.
    """
    started = time.monotonic()
    if shutil.which("qemu-img") is None:
        raise CloneError("qemu-img is not installed", code="command_not_found", evidence={"disk_dirty": False})
    info = await image_info(source, runner=runner)
    fmt = info.get("format")
    if fmt not in {f.value for f in ImageFormat}:
        raise CloneError(
            f"{source} is {fmt!r}, not one of raw, qcow2",
            code="unknown_format",
            evidence={"source": source, "format": fmt, "disk_dirty": False},
        )
    source_format = ImageFormat(fmt)
    if source_format is ImageFormat.qcow2:
        await _check_qcow2(source, runner=runner)
    virtual_size = int(info.get("virtual-size") or 0)
    evidence = await asyncio.to_thread(check_disk_writable, host, by_id, lease=lease, domain_disks=domain_disks)
    if virtual_size > evidence.size_bytes:
        raise CloneError(
            f"{source} ({virtual_size} bytes) does not fit {by_id} ({evidence.size_bytes} bytes)",
            code="image_too_large",
            evidence={
                "source": source,
                "virtual_size": virtual_size,
                "disk": evidence.model_dump(mode="json"),
                "disk_dirty": False,
            },
        )
    dev = str(host.real(f"/dev/{evidence.kernel_name}"))
    zero = target_is_zero(wipe_proof, evidence)
    argv = convert_argv(source, source_format, dev, direct=supports_o_direct(dev), zero=zero)
    parser = ProgressParser()
    callback_errors: list[BaseException] = []

    async def on_chunk(chunk: bytes) -> None:
        for percent in parser.feed(chunk):
            if on_progress is None or callback_errors:
                continue
            # A failing progress consumer must not abort the stderr pump (run() would then leave
            # qemu-img running unwatched): keep the error, let the clone finish, raise it after.
            try:
                result = on_progress(CloneProgress(by_id=by_id, percent=percent))
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:
                callback_errors.append(exc)

    dirty = {"source": source, "disk": evidence.model_dump(mode="json"), "argv": argv, "disk_dirty": True}
    # Hold the disk exclusively: a mount or dm/md claim on it or a partition now gets EBUSY.
    hold = open_exclusive(dev, evidence.model_dump(mode="json"))  # synchronous: a cancellation must not leak it
    try:
        await runner(argv, timeout=timeout, on_stdout_chunk=on_chunk)  # qemu-img -p writes to stdout
    except asyncio.CancelledError:
        raise CloneError(
            f"clone onto {by_id} was cancelled; the disk is dirty", code="clone_cancelled", evidence=dirty
        ) from None
    except HostError as exc:
        code = "clone_failed" if await asyncio.to_thread(disk_still_there, host, by_id, evidence) else "missing"
        raise CloneError(
            f"qemu-img convert onto {by_id} failed: {exc.message}", code=code, evidence={**exc.evidence, **dirty}
        ) from exc
    finally:
        os.close(hold)
    if parser.last < 100 and on_progress is not None:
        await on_chunk(b"(100.00/100%)\r")
    if callback_errors:
        raise callback_errors[0]
    return CloneResult(
        by_id=by_id,
        kernel_name=evidence.kernel_name,
        source=source,
        source_format=source_format,
        virtual_size_bytes=virtual_size,
        target_is_zero=zero,
        argv=argv,
        duration_s=time.monotonic() - started,
    )


def disk_still_there(host: HostRoot, by_id: str, evidence: DiskEvidence) -> bool:
    """Whether the by-id link still leads to the same device number (the disk did not vanish)."""
    fresh = host.fresh()
    try:
        name = os.path.basename(fresh.resolve(by_id))
        return fresh.read_attr(f"/sys/class/block/{name}/dev") == evidence.dev
    except OSError:
        return False
