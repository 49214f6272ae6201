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
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from gpuaas_agent.contract.nvmewipe import WholeDeviceCheck, WipeMethod
from gpuaas_agent.contract.storage import DiskEvidence, DiskLease, ProofGuarantee, WipeProof, WipeSample
from gpuaas_agent.discovery.nvme import BlockTable
from gpuaas_agent.discovery.sysread import SysReader
from gpuaas_agent.errors import HostError
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)
Runner = Callable[..., Awaitable[Completed]]
SAMPLE_BYTES = 1 << 20  # per region read back
ZERO_FILL_CHUNK = 8 << 20
READ_CHUNK = 8 << 20
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
    dev = kernel_node(host, evidence)
    method = await clear_blocks(host, evidence, dev, timeout=timeout, runner=runner)
    await clear_signatures(runner, dev, evidence, timeout=timeout)
    if after_erase is not None:
        await after_erase(dev)
    return await prove_cleared(host, evidence, dev, method=method, samples=samples, seed=seed, started=started,
                               timeout=timeout, runner=runner)


async def prove_cleared(
    host: HostRoot,
    evidence: DiskEvidence,
    dev: str,
    *,
    method: WipeMethod,
    samples: int = DEFAULT_SAMPLES,
    seed: int | None = None,
    started: float,
    timeout: float,
    runner: Runner = run,
) -> WipeProof:
    """The proof after a block clear, resting on what the method guarantees for every byte.

    Write Zeroes and the agent's own zero buffers write every LBA: the samples and
    the signature probes check that, and the guarantee is ``write_zeroes``. A
    discard is a hint a device may honour in part (a controller that kept a few
    ranges answers success all the same), so after it every byte is read back; data
    found there is zeroed (Write Zeroes) and every byte read again, since the device
    has shown it does not do what it acknowledges. Raises ``wipe_unverified``.
    """
    whole = left = None
    guarantee = ProofGuarantee.write_zeroes
    zeroed = False
    if method is WipeMethod.discard:
        whole = await asyncio.to_thread(read_whole_device, dev, evidence.size_bytes)
        guarantee = ProofGuarantee.whole_device_read
        if not whole.all_zero and not await _signatures(dev, runner):
            # The device acknowledged a discard it did not carry out: write zeroes, then read every byte again.
            log_event(log, "discard_left_data", logging.WARNING, by_id=evidence.by_id,
                      kernel_name=evidence.kernel_name, first_nonzero_offset=whole.first_nonzero_offset)
            left = whole
            method = await zero_out(host, evidence, dev, timeout=timeout, runner=runner)
            zeroed = True
            whole = await asyncio.to_thread(read_whole_device, dev, evidence.size_bytes)
    proof = await verify_wiped(
        host, evidence, method=method, samples=samples, seed=seed, started=started, runner=runner, dev=dev
    )
    verified = proof.verified and (whole is None or whole.all_zero)
    proof = proof.model_copy(update={"verified": verified, "whole_device": whole, "guarantee": guarantee,
                                     "zeroed_after": zeroed, "left_by_erase": left,
                                     "duration_s": time.monotonic() - started})
    if not proof.verified:
        raise WipeError(
            f"{evidence.by_id} ({evidence.kernel_name}) is not provably empty after the wipe"
            + (f": non-zero data at byte {whole.first_nonzero_offset}" if whole is not None and not whole.all_zero
               else ""),
            code="wipe_unverified",
            evidence=proof.model_dump(mode="json"),
        )
    return proof


def read_whole_device(dev: str, size: int) -> WholeDeviceCheck:
    """Read every byte of ``dev`` (page cache dropped first); stops at the first non-zero byte."""
    started = time.monotonic()
    zeros = bytes(READ_CHUNK)
    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        offset = 0
        while offset < size:
            data = os.pread(fd, min(READ_CHUNK, size - offset), offset)
            if not data:
                break
            if data != zeros[: len(data)]:
                first = offset + next(i for i, b in enumerate(data) if b)
                return WholeDeviceCheck(bytes_read=offset + len(data), all_zero=False, first_nonzero_offset=first,
                                        duration_s=time.monotonic() - started)
            offset += len(data)
        return WholeDeviceCheck(bytes_read=offset, all_zero=offset == size, duration_s=time.monotonic() - started)
    finally:
        os.close(fd)


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
    dev = dev or kernel_node(host, evidence)
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


async def clear_blocks(
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
    return await zero_out(host, evidence, dev, timeout=timeout, runner=runner)


async def zero_out(host: HostRoot, evidence: DiskEvidence, dev: str, *, timeout: float,
                    runner: Runner) -> WipeMethod:
    """Write Zeroes (``blkdiscard --zeroout``); where the device refuses it, the agent writes zero buffers itself.

    Either way every LBA is written zero: the guarantee a sampled read-back may rest on.
    A busy device is never zero-filled by hand (it is in use: the O_EXCL open says so).
    """
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


async def clear_signatures(runner: Runner, dev: str, evidence: DiskEvidence, *, timeout: float) -> None:
    """Erase every signature wipefs knows (never ``--force``: a disk in use answers EBUSY), then drop the
    kernel's stale partition nodes (the table is gone from the disk)."""
    await wipe_step(runner, ["wipefs", "--all", dev], timeout, evidence)
    await runner(["blockdev", "--rereadpt", dev], timeout=60, check=False)


async def wipe_step(runner: Runner, argv: list[str], timeout: float, evidence: DiskEvidence) -> Completed:
    """Run one command of a wipe; its failure is ``wipe_failed`` naming the disk (the disk is not clean)."""
    try:
        return await runner(argv, timeout=timeout)
    except HostError as exc:
        raise WipeError(
            f"{argv[0]} failed on {evidence.by_id}: {exc.message}",
            code="wipe_failed",
            evidence={**exc.evidence, "disk": evidence.model_dump(mode="json")},
        ) from exc


def _ev(evidence: DiskEvidence, done: Completed) -> dict[str, Any]:
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


def kernel_node(host: HostRoot, evidence: DiskEvidence) -> str:
    """The kernel node the guard just matched (by major:minor) to the by-id link."""
    return str(host.real(f"/dev/{evidence.kernel_name}"))
