"""Wipe a released slot disk the way its profile's :class:`WipePolicy` says, and prove it.

``discard`` is today's path (``host/disks.py``: blkdiscard, zero-out when the
device does not read back zeroes). ``zeroout`` asks the device to write zeroes.
``nvme_format`` / ``nvme_sanitize`` send the controller's own erase
(``host/nvmewipe.py``), only where it reports the capability and only after its
answer names the leased namespace.

Every method ends in the same proof as today (no signatures, no partitions,
sampled regions zero: ``disks.verify_wiped``). Where the method does not promise
zeroes (the namespace's DLFEAT does not say erased blocks read back as zero, as
after a crypto erase on most drives), every byte is read back first; data left
behind is then zeroed (``blkdiscard --zeroout``) and proved again, and the proof
says so (``zeroed_after``). A proof that still fails raises ``wipe_unverified``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping

from gpuaas_agent.contract.nvmewipe import NvmeEraseEvidence, WholeDeviceCheck, WipePolicy, WipePolicyMethod
from gpuaas_agent.contract.runtime import DEFAULT_PROFILE, PROFILES
from gpuaas_agent.contract.storage import DiskEvidence, DiskLease, WipeMethod, WipeProof
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.disks import DEFAULT_SAMPLES, WipeError, _dev_path, _step, verify_wiped, wipe_disk
from gpuaas_agent.host.nvmewipe import WipeRefused, nvme_erase, plan_nvme_erase
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.hostfs import HostRoot

Runner = Callable[..., Awaitable[Completed]]
READ_CHUNK = 8 << 20
DEFAULT_POLICY = WipePolicy()
NVME_METHOD = {WipePolicyMethod.nvme_format: WipeMethod.nvme_format,
               WipePolicyMethod.nvme_sanitize: WipeMethod.nvme_sanitize}


async def wipe_slot_disk(
    policy: WipePolicy,
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    domain_disks: Collection[str] = (),
    samples: int = DEFAULT_SAMPLES,
    seed: int | None = None,
    runner: Runner = run,
    after_erase: Callable[[str], Awaitable[None]] | None = None,
) -> WipeProof:
    """Guard, erase by ``policy``, verify; returns the verified proof naming the method and its evidence.

    Raises :class:`~gpuaas_agent.guards.disk.DiskGuardError` or
    :class:`~gpuaas_agent.host.nvmewipe.WipeRefused` before anything is written,
    ``WipeError`` (``wipe_failed`` / ``wipe_unverified``) after.
    """
    if policy.method is WipePolicyMethod.discard:
        proof = await wipe_disk(host, by_id, lease=lease, domain_disks=domain_disks, samples=samples, seed=seed,
                                timeout=policy.timeout_s, runner=runner, after_erase=after_erase)
        return proof.model_copy(update={"policy": policy.method})
    started = time.monotonic()
    evidence = await asyncio.to_thread(check_disk_writable, host, by_id, lease=lease, domain_disks=domain_disks)
    dev = _dev_path(host, evidence)
    nvme = None
    if policy.method is WipePolicyMethod.zeroout:
        method = WipeMethod.zeroout
        await _step(runner, ["blkdiscard", "--zeroout", dev], policy.timeout_s, evidence)
    else:
        nsid = _namespace_id(host, evidence, policy)
        nvme = await nvme_erase(dev, nsid=nsid, lease_identity=lease.disk_identity, policy=policy, by_id=by_id,
                                runner=runner)
        method = NVME_METHOD[policy.method]
    await _step(runner, ["wipefs", "--all", dev], 600, evidence)
    await runner(["blockdev", "--rereadpt", dev], timeout=60, check=False)
    if after_erase is not None:
        await after_erase(dev)
    return await prove_erased(host, evidence, dev, method=method, policy=policy, nvme=nvme, samples=samples,
                              seed=seed, started=started, runner=runner)


async def check_wipe_policy(
    policy: WipePolicy,
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    runner: Runner = run,
) -> dict:
    """Prove, writing nothing, that ``policy`` can wipe the leased disk: NVMe namespace, identity, capability, scope.

    For a provision's validate (docs/safety.md §8): a profile asking for an erase the
    drive does not offer is refused before a tenant's data lands on it, instead of
    leaving the slot ``cleanup_blocked`` at release. ``discard``/``zeroout`` need nothing.
    Returns the evidence; raises :class:`WipeRefused` / ``NvmeCapsError``.
    """
    if policy.method in (WipePolicyMethod.discard, WipePolicyMethod.zeroout):
        return {"policy": policy.method.value}
    evidence = await asyncio.to_thread(check_disk_writable, host, by_id, lease=lease)
    dev = _dev_path(host, evidence)
    caps, matched, action, argv = await plan_nvme_erase(
        dev, nsid=_namespace_id(host, evidence, policy), lease_identity=lease.disk_identity, policy=policy,
        by_id=by_id, runner=runner)
    return {"policy": policy.method.value, "action": action.value, "argv": argv, "device_identity": matched,
            "zeros_guaranteed": caps.namespace.deallocated_reads_zero}


async def prove_erased(
    host: HostRoot,
    evidence: DiskEvidence,
    dev: str,
    *,
    method: WipeMethod,
    policy: WipePolicy,
    nvme: NvmeEraseEvidence | None = None,
    samples: int = DEFAULT_SAMPLES,
    seed: int | None = None,
    started: float | None = None,
    runner: Runner = run,
) -> WipeProof:
    """Today's proof after an erase, plus a whole-device read where ``nvme`` does not promise zeroes.

    Non-zero data with no signature left (a crypto erase's ciphertext) is zeroed
    and proved again (``zeroed_after``); a signature left is never papered over.
    """
    started = time.monotonic() if started is None else started
    whole = None
    if nvme is not None and not nvme.zeros_guaranteed:
        whole = await asyncio.to_thread(read_whole_device, dev, evidence.size_bytes)
    proof = await verify_wiped(host, evidence, method=method, samples=samples, seed=seed, started=started,
                               runner=runner, dev=dev)
    zeroed = False
    data_left = (whole is not None and not whole.all_zero) or not all(s.all_zero for s in proof.samples)
    if data_left and not proof.signatures_found and not proof.partitions_left and method is not WipeMethod.zeroout:
        # The erase left non-zero data (a crypto erase's ciphertext, say): write zeroes, then prove those.
        await _step(runner, ["blkdiscard", "--zeroout", dev], policy.timeout_s, evidence)
        zeroed = True
        proof = await verify_wiped(host, evidence, method=WipeMethod.zeroout, samples=samples, seed=seed,
                                   started=started, runner=runner, dev=dev)
    proof = proof.model_copy(update={"policy": policy.method, "nvme": nvme, "whole_device": whole,
                                     "zeroed_after": zeroed, "duration_s": time.monotonic() - started})
    if not proof.verified:
        raise WipeError(
            f"{evidence.by_id} ({evidence.kernel_name}) is not provably empty after the {policy.method.value} wipe",
            code="wipe_unverified",
            evidence=proof.model_dump(mode="json"),
        )
    return proof


def _namespace_id(host: HostRoot, evidence: DiskEvidence, policy: WipePolicy) -> int:
    """The NVMe namespace id sysfs gives the guarded disk; a disk that is not an NVMe namespace is refused."""
    try:
        nsid = int(host.read_attr(f"/sys/class/block/{evidence.kernel_name}/nsid"))
    except (OSError, ValueError):
        nsid = 0
    if not 1 <= nsid <= 0xFFFFFFFE:
        raise WipeRefused(
            f"wipe method {policy.method.value} needs an NVMe namespace; {evidence.by_id} "
            f"({evidence.kernel_name}) reports no NVMe namespace id: nothing sent",
            code="wipe_method_unsupported",
            evidence={"policy": policy.model_dump(mode="json"), "disk": evidence.model_dump(mode="json"),
                      "reason": f"/sys/class/block/{evidence.kernel_name}/nsid is missing"},
        )
    return nsid


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


def policy_for_profile(profile: str | None, overrides: Mapping[str, WipePolicy] | None = None) -> WipePolicy:
    """The wipe policy of runtime profile ``profile``: the host's override, else the catalog's.

    An unknown or missing profile (a release whose domain is already gone) gets
    the default profile's policy: the same one the slot was provisioned under
    unless the control plane used a non-default profile.
    """
    name = profile if isinstance(profile, str) and profile in PROFILES else DEFAULT_PROFILE
    overrides = overrides or {}
    return overrides.get(name) or PROFILES[name].wipe_policy


def release_wipe_policy(overrides: Mapping[str, WipePolicy] | None, domain: dict | None) -> WipePolicy:
    """For ``slice.vm_release``: the policy of the profile the slot's domain was defined with (its metadata)."""
    metadata = (domain or {}).get("metadata") or {}
    return policy_for_profile(metadata.get("profile"), overrides)
