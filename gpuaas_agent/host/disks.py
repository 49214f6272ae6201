"""Wipe a released slot disk and prove it (docs/safety.md §6): discard, erase signatures, read back.

A disk goes back to ``available`` only with a verified :class:`WipeProof`; a
failed verification raises ``wipe_unverified`` carrying the proof, and the
caller marks the slot ``cleanup_blocked``. Never ``wipefs --force`` (seed 004):
without it wipefs and blkdiscard open the disk O_EXCL and get EBUSY on a disk
in use — a second line behind the guard.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Collection

from gpuaas_agent.contract.storage import (
    DiskEvidence,
    DiskLease,
    WipeMethod,
    WipeProof,
    WipeSample,
)
from gpuaas_agent.discovery.nvme import BlockTable
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.errors import HostError
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.hostfs import HostRoot

Runner = Callable[..., Awaitable[Completed]]
SAMPLE_BYTES = 1 << 20  # per region read back
ZERO_FILL_CHUNK = 8 << 20
DEFAULT_SAMPLES = 16


class WipeError(HostError):
    """A wipe step failed or its result could not be proved; the disk is not clean."""

    default_code = "wipe_failed"


async def wipe_disk(
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    domain_disks: Collection[str] = (),
    samples: int = DEFAULT_SAMPLES,
    seed: int | None = None,
    timeout: float = 3600,
    runner: Runner = run,
    after_erase: Callable[[str], Awaitable[None]] | None = None,
) -> WipeProof:
    """Guard, clear every block, erase signatures, then :func:`verify_wiped`.

    ``after_erase(dev)`` runs between erasing and verifying (fault injection in
    tests: a signature written there must be caught). Raises
    :class:`~gpuaas_agent.guards.disk.DiskGuardError` before touching anything,
    ``WipeError`` (``wipe_failed``) when a step fails, ``wipe_unverified`` when
    the read-back does not prove the disk empty.
    """
    started = time.monotonic()
    evidence = await asyncio.to_thread(check_disk_writable, host, by_id, lease=lease, domain_disks=domain_disks)
    dev = _dev_path(host, evidence)
    method = await _clear_blocks(host, evidence, dev, timeout=timeout, runner=runner)
    await _step(runner, ["wipefs", "--all", dev], timeout, evidence)
    # Drop the kernel's stale partition nodes (the table is gone from the disk).
    await runner(["blockdev", "--rereadpt", dev], timeout=60, check=False)
    if after_erase is not None:
        await after_erase(dev)
    proof = await verify_wiped(
        host, evidence, method=method, samples=samples, seed=seed, started=started, runner=runner, dev=dev
    )
    if method is WipeMethod.discard and not proof.verified and not proof.signatures_found:
        # Discard is a hint: many devices do not promise zeroes afterwards. Write them, then prove again.
        await _step(runner, ["blkdiscard", "--zeroout", dev], timeout, evidence)
        proof = await verify_wiped(
            host, evidence, method=WipeMethod.zeroout, samples=samples, seed=seed, started=started,
            runner=runner, dev=dev,
        )
    if not proof.verified:
        raise WipeError(
            f"{by_id} ({evidence.kernel_name}) is not provably empty after the wipe",
            code="wipe_unverified",
            evidence=proof.model_dump(mode="json"),
        )
    return proof


async def verify_wiped(
    host: HostRoot,
    evidence: DiskEvidence,
    *,
    method: WipeMethod,
    samples: int = DEFAULT_SAMPLES,
    seed: int | None = None,
    started: float | None = None,
    runner: Runner = run,
    dev: str | None = None,
) -> WipeProof:
    """Read the disk back: no signatures (wipefs, blkid -p), no partitions, zero start/end/random regions.

    Returns the proof with ``verified`` set; it does not raise on a dirty disk
    (callers decide), only when the probes themselves cannot run.
    """
    started = time.monotonic() if started is None else started
    dev = dev or _dev_path(host, evidence)
    seed = random.SystemRandom().randrange(1 << 31) if seed is None else seed
    signatures = await _signatures(dev, runner)
    partitions_left = _partitions_now(host, evidence)
    regions = sample_offsets(evidence.size_bytes, samples, seed)
    read = await asyncio.to_thread(_read_samples, dev, regions)
    return WipeProof(
        by_id=evidence.by_id,
        kernel_name=evidence.kernel_name,
        dev=evidence.dev,
        method=method,
        bytes=evidence.size_bytes,
        seed=seed,
        samples=read,
        signatures_found=signatures,
        partitions_left=partitions_left,
        duration_s=time.monotonic() - started,
        verified=not signatures and not partitions_left and all(s.all_zero for s in read) and bool(read),
    )


def sample_offsets(size: int, count: int, seed: int) -> list[tuple[int, int]]:
    """(offset, length) of the first and last region plus ``count`` seeded-random 4 KiB-aligned ones."""
    length = min(SAMPLE_BYTES, size)
    if length <= 0:
        return []
    last = (size - length) // 4096 * 4096
    rng = random.Random(seed)
    offsets = [0, size - length] + [rng.randrange(0, last + 1, 4096) for _ in range(count)]
    return [(o, length) for o in dict.fromkeys(offsets)]


def _read_samples(dev: str, regions: list[tuple[int, int]]) -> list[WipeSample]:
    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Drop cached pages first: the proof is about the device, not the page cache.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = []
        for offset, length in regions:
            data = os.pread(fd, length, offset)
            out.append(WipeSample(offset=offset, length=length, all_zero=len(data) == length and not any(data)))
        return out
    finally:
        os.close(fd)


async def _signatures(dev: str, runner: Runner) -> list[str]:
    """Every signature wipefs or a low-level blkid probe still finds (no udev database needed)."""
    found: list[str] = []
    listed = await runner(["wipefs", "--json", dev], timeout=60)
    if listed.stdout.strip():
        for sig in json.loads(listed.stdout).get("signatures", []):
            found.append(f"wipefs:{sig.get('type')}@{sig.get('offset')}")
    probe = await runner(["blkid", "-p", "-o", "export", dev], timeout=60, check=False)
    if probe.returncode == 0:  # 2 = nothing found
        keys = dict(l.split("=", 1) for l in probe.stdout.decode().splitlines() if "=" in l)
        for key in ("TYPE", "PTTYPE"):
            if key in keys:
                found.append(f"blkid:{key}={keys[key]}")
    elif probe.returncode != 2:
        raise WipeError(
            f"blkid -p {dev} failed", code="wipe_probe_failed", evidence={"stderr": probe.stderr.decode()[-2000:]}
        )
    return found


async def _clear_blocks(
    host: HostRoot, evidence: DiskEvidence, dev: str, *, timeout: float, runner: Runner
) -> WipeMethod:
    """blkdiscard when the device discards, else a zeroing offload, else zero buffers written by us."""
    discard_max = _int_attr(host, f"/sys/class/block/{evidence.kernel_name}/queue/discard_max_bytes")
    if discard_max:
        done = await runner(["blkdiscard", dev], timeout=timeout, check=False)
        if done.returncode == 0:
            return WipeMethod.discard
        if b"busy" in done.stderr.lower():
            raise WipeError(f"blkdiscard {dev}: device busy", code="wipe_failed", evidence=_ev(evidence, done))
    done = await runner(["blkdiscard", "--zeroout", dev], timeout=timeout, check=False)
    if done.returncode == 0:
        return WipeMethod.zeroout
    if b"busy" in done.stderr.lower():
        raise WipeError(f"blkdiscard --zeroout {dev}: device busy", code="wipe_failed", evidence=_ev(evidence, done))
    await asyncio.wait_for(asyncio.to_thread(_zero_fill, dev, evidence.size_bytes), timeout)
    return WipeMethod.zero_fill


def _zero_fill(dev: str, size: int) -> None:
    zeros = bytes(ZERO_FILL_CHUNK)
    fd = os.open(dev, os.O_WRONLY | os.O_EXCL | os.O_CLOEXEC)
    try:
        offset = 0
        while offset < size:
            offset += os.pwrite(fd, zeros[: min(ZERO_FILL_CHUNK, size - offset)], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


async def _step(runner: Runner, argv: list[str], timeout: float, evidence: DiskEvidence) -> Completed:
    try:
        return await runner(argv, timeout=timeout)
    except HostError as exc:
        raise WipeError(
            f"{argv[0]} failed on {evidence.by_id}: {exc.message}",
            code="wipe_failed",
            evidence={**exc.evidence, "disk": evidence.model_dump(mode="json")},
        ) from exc


def _ev(evidence: DiskEvidence, done: Completed) -> dict:
    return {
        "argv": list(done.argv),
        "returncode": done.returncode,
        "stderr": done.stderr.decode("utf-8", "replace")[-2000:],
        "disk": evidence.model_dump(mode="json"),
    }


def _partitions_now(host: HostRoot, evidence: DiskEvidence) -> list[str]:
    """Partitions the kernel shows on the disk right now (a fresh root: the wipe changed sysfs)."""
    blocks = BlockTable(SysReader(host.fresh()))
    disk = blocks.nodes.get(evidence.kernel_name)
    if disk is None:
        raise WipeError(f"{evidence.kernel_name} vanished during the wipe", code="missing",
                        evidence=evidence.model_dump(mode="json"))
    return sorted(p.name for p in blocks.partitions_of(disk))


def _int_attr(host: HostRoot, path: str) -> int:
    try:
        return int(host.read_attr(path))
    except (OSError, ValueError):
        return 0


def _dev_path(host: HostRoot, evidence: DiskEvidence) -> str:
    """The kernel node the guard just matched (by major:minor) to the by-id link."""
    return str(host.real(f"/dev/{evidence.kernel_name}"))
