"""Wipe a released slot disk the way its lease's handover policy says, and prove it for every byte.

The policy is fixed at the provision's validate (:func:`resolve_handover`) and
stored with the slot's lease: release never looks it up again, so a data slot
whose domain is gone, a retried release or one finished after a crash wipes the
way the tenant's validate promised. ``auto`` resolves, from the device's own
answers, to a method whose post-condition the device must honour: a crypto erase
(Sanitize, else Format) on a namespace that reads erased blocks as zero, inside
the lease's scope, else Write Zeroes. A lease from before handover policies gets
the strictest method the device supports (:func:`strictest_handover`).

Every method ends in a proof that says what its claim over every byte rests on
(``WipeProof.guarantee``): Write Zeroes written by the device or the agent
(``write_zeroes``); an NVMe erase on a namespace whose DLFEAT says erased blocks
read zero (``erase_reads_zero``); otherwise every byte read back
(``whole_device_read``) — always so after an opt-in ``discard``, which a device
may honour in part. Data left behind is zeroed and proved again
(``zeroed_after``); a proof that still fails raises ``wipe_unverified``.

What each method does (check, wipe, prove) is its module's in ``wipemethods/``, found by the
method in ``WIPE_METHODS``; this module resolves ``auto``, runs the disk guard before any
method's wipe, and records the policy in the proof.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from gpuaas_agent.contract.handover import HandoverOrigin, LeaseHandover
from gpuaas_agent.contract.nvmewipe import (
    FormatErase,
    NvmeCapabilities,
    SanitizeAction,
    WipeMethod,
    WipePolicy,
)
from gpuaas_agent.contract.runtime import DEFAULT_PROFILE, PROFILES, RuntimeProfile
from gpuaas_agent.contract.storage import DiskLease, WipeProof
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.run import Completed, run
from gpuaas_agent.host.storage.blockwipe import DEFAULT_SAMPLES, kernel_node, read_whole_device, verify_wiped
from gpuaas_agent.host.storage.nvmecaps import NvmeCapsError, read_capabilities
from gpuaas_agent.host.storage.nvmewipe import (
    WipeRefused,
    check_identity,
    check_scope,
    choose_action,
    namespace_id,
    zeros_after,
)
from gpuaas_agent.host.storage.wipemethods import wipe_method
from gpuaas_agent.host.storage.wipemethods.base import WipeTarget
from gpuaas_agent.hostfs import HostRoot

Runner = Callable[..., Awaitable[Completed]]
DEFAULT_POLICY = WipePolicy()
ZEROOUT = WipePolicy(method=WipeMethod.zeroout)
# What ``auto`` tries, in order: a crypto erase takes seconds on any size, but only where erased blocks read zero.
AUTO_CANDIDATES = (
    WipePolicy(method=WipeMethod.nvme_sanitize, sanitize_action=SanitizeAction.crypto_erase),
    WipePolicy(method=WipeMethod.nvme_format, format_erase=FormatErase.crypto),
)
# A lease from before handover policies: the strictest erase the device offers (Sanitize reaches every
# media location, caches included; then Format), inside the lease's scope, else Write Zeroes.
STRICTEST_CANDIDATES = (
    WipePolicy(method=WipeMethod.nvme_sanitize, sanitize_action=SanitizeAction.block_erase),
    WipePolicy(method=WipeMethod.nvme_sanitize, sanitize_action=SanitizeAction.crypto_erase),
    WipePolicy(method=WipeMethod.nvme_sanitize, sanitize_action=SanitizeAction.overwrite),
    WipePolicy(method=WipeMethod.nvme_format, format_erase=FormatErase.crypto),
    WipePolicy(method=WipeMethod.nvme_format, format_erase=FormatErase.user_data),
)


async def wipe_slot_disk(
    policy: WipePolicy,
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    zeros_guaranteed: bool = True,
    domain_disks: Collection[str] = (),
    samples: int = DEFAULT_SAMPLES,
    seed: int | None = None,
    runner: Runner = run,
    after_erase: Callable[[str], Awaitable[None]] | None = None,
) -> WipeProof:
    """Guard, erase by ``policy``, prove; returns the verified proof naming the method, its guarantee and evidence.

    ``zeros_guaranteed``: what the lease's validate found (an NVMe erase is proved by a
    sample only if both it and the device's answer now say erased blocks read zero).
    ``auto`` is resolved here only for a caller without a lease policy (tools, benches).
    Raises :class:`~gpuaas_agent.guards.disk.DiskGuardError` or
    :class:`~gpuaas_agent.host.storage.nvmewipe.WipeRefused` before anything is written,
    ``WipeError`` (``wipe_failed`` / ``wipe_unverified``) after.
    """
    if policy.method is WipeMethod.auto:
        policy, zeros_guaranteed, _ = await resolve_policy(policy, host, by_id, lease=lease, runner=runner)
    method = wipe_method(policy.method)
    target = WipeTarget(host=host, by_id=by_id, lease=lease, runner=runner, domain_disks=domain_disks)
    # The guard runs here, before any method's wipe: a method only ever gets the disk it let through.
    disk = await asyncio.to_thread(check_disk_writable, host, by_id, lease=lease, domain_disks=domain_disks)
    erased = await method.wipe(policy, target, disk, zeros_guaranteed=zeros_guaranteed)
    if after_erase is not None:
        await after_erase(erased.dev)
    proof = await method.prove(policy, target, erased, samples=samples, seed=seed)
    return proof.model_copy(update={"policy": policy.method})


async def resolve_policy(
    policy: WipePolicy,
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    runner: Runner = run,
    candidates: tuple[WipePolicy, ...] = AUTO_CANDIDATES,
    require_zeros: bool = True,
) -> tuple[WipePolicy, bool, dict[str, Any]]:
    """The concrete policy a lease stores for ``policy`` on this disk: (policy, zeros guaranteed, evidence).

    Writes nothing. ``auto`` (and ``candidates``) choose from the device's answers: the
    first candidate the controller offers, whose erase stays inside the lease and — with
    ``require_zeros`` (``auto``'s rule) — whose namespace reads erased blocks as zero; else Write Zeroes. A named
    NVMe method the device cannot carry out is refused (``wipe_method_unsupported``,
    ``wipe_scope_exceeds_lease``): the profile asked for it, the tenant's data must not
    land on a disk that cannot be erased that way.
    """
    if policy.method is not WipeMethod.auto:
        checked = await wipe_method(policy.method).check(policy, WipeTarget(host=host, by_id=by_id, lease=lease,
                                                                            runner=runner))
        return policy, checked.zeros_guaranteed, checked.evidence
    disk = await asyncio.to_thread(check_disk_writable, host, by_id, lease=lease)
    dev = kernel_node(host, disk)
    nsid = namespace_id(host, disk)
    fallback = ZEROOUT.model_copy(update={"timeout_s": policy.timeout_s})
    if nsid is None:
        return fallback, True, {"policy": "zeroout", "chosen_from": policy.method.value,
                                "reason": f"{disk.kernel_name} is not an NVMe namespace: Write Zeroes"}
    try:
        caps = await read_capabilities(dev, nsid, runner=runner)
    except NvmeCapsError as exc:
        return fallback, True, {"policy": "zeroout", "chosen_from": policy.method.value,
                                "reason": f"the controller's capabilities could not be read: {exc.message}"}
    check_identity(caps, lease.disk_identity, by_id=by_id, dev=dev)  # another disk behind the path: refused
    resolved, zeros, evidence = choose_from_capabilities(caps, candidates, require_zeros=require_zeros,
                                                         timeout_s=policy.timeout_s)
    return resolved, zeros, {**evidence, "chosen_from": policy.method.value}


def choose_from_capabilities(
    caps: NvmeCapabilities,
    candidates: tuple[WipePolicy, ...],
    *,
    require_zeros: bool,
    timeout_s: float = DEFAULT_POLICY.timeout_s,
) -> tuple[WipePolicy, bool, dict[str, Any]]:
    """Pure: the first candidate the controller offers whose erase stays inside the lease (and, with
    ``require_zeros``, after which erased blocks read zero); else Write Zeroes. With the reasons for each pass-over."""
    refusals: list[dict[str, Any]] = []
    for candidate in candidates:
        chosen = candidate.model_copy(update={"timeout_s": timeout_s})
        try:
            action = choose_action(chosen, caps)
            check_scope(action, caps)
        except WipeRefused as exc:
            refusals.append({"policy": chosen.model_dump(mode="json"), "code": exc.code, "reason": exc.message})
            continue
        zeros = zeros_after(action, caps)
        if require_zeros and not zeros:
            refusals.append({"policy": chosen.model_dump(mode="json"), "code": "zeroes_not_guaranteed",
                             "reason": f"DLFEAT {caps.namespace.dlfeat:#x}: erased blocks are not promised to read zero"})
            continue
        return chosen, zeros, {"policy": chosen.method.value, "action": action.value, "zeros_guaranteed": zeros,
                               "not_chosen": refusals}
    return ZEROOUT.model_copy(update={"timeout_s": timeout_s}), True, {
        "policy": "zeroout", "not_chosen": refusals, "zeros_guaranteed": True,
        "reason": "no erase the controller offers is both inside the lease and zero-reading: Write Zeroes"}


async def resolve_handover(
    profile: RuntimeProfile,
    overrides: Mapping[str, WipePolicy] | None,
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    runner: Runner = run,
    clock: Callable[[], float] = time.time,
) -> tuple[LeaseHandover, dict[str, Any]]:
    """The handover a provision's validate fixes in the slot's lease, with the evidence it was chosen on."""
    resolved, zeros, evidence = await resolve_policy(policy_for_profile(profile.name, overrides), host, by_id,
                                                     lease=lease, runner=runner)
    return LeaseHandover(profile=profile.name, wipe=resolved, zeros_guaranteed=zeros,
                         gpu=profile.gpu_handover if profile.hostdevs else None, fixed_at=clock(),
                         origin=HandoverOrigin.validate), evidence


async def strictest_handover(
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    runner: Runner = run,
    clock: Callable[[], float] = time.time,
) -> tuple[LeaseHandover, dict[str, Any]]:
    """For a lease from before handover policies: the strictest erase the device supports, GPU handover on."""
    resolved, zeros, evidence = await resolve_policy(WipePolicy(), host, by_id, lease=lease, runner=runner,
                                                     candidates=STRICTEST_CANDIDATES, require_zeros=False)
    default = PROFILES[DEFAULT_PROFILE]
    return LeaseHandover(profile=DEFAULT_PROFILE, wipe=resolved, zeros_guaranteed=zeros, gpu=default.gpu_handover,
                         fixed_at=clock(), origin=HandoverOrigin.legacy), evidence


async def check_wipe_policy(
    policy: WipePolicy,
    host: HostRoot,
    by_id: str,
    *,
    lease: DiskLease,
    runner: Runner = run,
) -> dict[str, Any]:
    """Prove, writing nothing, that ``policy`` can wipe the leased disk: NVMe namespace, identity, capability, scope.

    For a provision's validate (docs/safety.md §8): a profile asking for an erase the
    drive does not offer is refused before a tenant's data lands on it, instead of
    leaving the slot ``cleanup_blocked`` at release. ``discard``/``zeroout`` need nothing.
    Returns the evidence; raises :class:`WipeRefused` / ``NvmeCapsError``.
    """
    if policy.method is WipeMethod.auto:
        return {"policy": policy.method.value, "zeros_guaranteed": True}  # resolved from the device at validate
    checked = await wipe_method(policy.method).check(policy, WipeTarget(host=host, by_id=by_id, lease=lease,
                                                                        runner=runner))
    return checked.evidence


def policy_for_profile(profile: str | None, overrides: Mapping[str, WipePolicy] | None = None) -> WipePolicy:
    """The wipe policy of runtime profile ``profile``: the host's override, else the catalog's.

    An unknown or missing profile (a release whose domain is already gone) gets
    the default profile's policy: the same one the slot was provisioned under
    unless the control plane used a non-default profile.
    """
    name = profile if isinstance(profile, str) and profile in PROFILES else DEFAULT_PROFILE
    overrides = overrides or {}
    return overrides.get(name) or PROFILES[name].wipe_policy


__all__ = ["read_whole_device", "verify_wiped"]  # re-exported: the proofs' readers (benches, tests)
