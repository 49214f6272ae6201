"""What the two NVMe methods (``nvme_format``, ``nvme_sanitize``) share: the controller's own erase, then its proof.

Check: the disk guard, then ``nvmewipe.plan_nvme_erase`` (namespace, identity, capability, scope),
writing nothing. Wipe: the same refusals, then the one erase command (``nvmewipe.nvme_erase``) and
the signatures. Prove: :func:`prove_erased`, which reads every byte back where the namespace does
not promise that erased blocks read zero. Which command and setting each method sends is
``nvmewipe.choose_action``'s, from the policy and the controller's answers.
"""

from __future__ import annotations

import asyncio
import time

from gpuaas_agent.contract.nvmewipe import NvmeEraseEvidence, WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import DiskEvidence, ProofGuarantee, WipeProof
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.run import run
from gpuaas_agent.host.storage.blockwipe import (
    DEFAULT_SAMPLES,
    WipeError,
    clear_signatures,
    kernel_node,
    read_whole_device,
    verify_wiped,
    wipe_step,
)
from gpuaas_agent.host.storage.nvmewipe import WipeRefused, namespace_id, nvme_erase, plan_nvme_erase, zeros_after
from gpuaas_agent.host.storage.wipemethods.base import Erased, Runner, WipeCheck, WipeTarget
from gpuaas_agent.hostfs import HostRoot


async def check(policy: WipePolicy, target: WipeTarget) -> WipeCheck:
    """Prove, writing nothing, that ``policy`` can erase the leased disk: NVMe namespace, identity, capability, scope.

    Raises :class:`~gpuaas_agent.host.storage.nvmewipe.WipeRefused` / ``NvmeCapsError``.
    """
    disk = await asyncio.to_thread(check_disk_writable, target.host, target.by_id, lease=target.lease)
    dev = kernel_node(target.host, disk)
    caps, matched, action, argv = await plan_nvme_erase(
        dev, nsid=require_namespace_id(target.host, disk, policy), lease_identity=target.lease.disk_identity,
        policy=policy, by_id=target.by_id, runner=target.runner)
    zeros = zeros_after(action, caps)
    return WipeCheck(zeros_guaranteed=zeros, evidence={
        "policy": policy.method.value, "action": action.value, "argv": argv, "device_identity": matched,
        "zeros_guaranteed": zeros})


async def wipe(policy: WipePolicy, target: WipeTarget, disk: DiskEvidence, *, zeros_guaranteed: bool) -> Erased:
    """The controller's erase of the leased namespace (refused, nothing sent, unless identity, capability and scope
    hold), then the signatures. The lease's weaker word on zeroes wins over the device's answer now."""
    dev = kernel_node(target.host, disk)
    nvme = await nvme_erase(dev, nsid=require_namespace_id(target.host, disk, policy),
                            lease_identity=target.lease.disk_identity, policy=policy, by_id=target.by_id,
                            runner=target.runner)
    if not zeros_guaranteed and nvme.zeros_guaranteed:
        nvme = nvme.model_copy(update={"zeros_guaranteed": False})  # the lease's word was weaker: read it all
    await clear_signatures(target.runner, dev, disk, timeout=600)
    return Erased(disk=disk, dev=dev, method=policy.method, nvme=nvme)


async def prove(policy: WipePolicy, target: WipeTarget, erased: Erased, *, samples: int,
                seed: int | None) -> WipeProof:
    return await prove_erased(target.host, erased.disk, erased.dev, method=erased.method, policy=policy,
                              nvme=erased.nvme, samples=samples, seed=seed, started=target.started,
                              runner=target.runner)


def require_namespace_id(host: HostRoot, evidence: DiskEvidence, policy: WipePolicy) -> int:
    """The NVMe namespace id sysfs gives the guarded disk; a disk that is not an NVMe namespace is refused."""
    nsid = namespace_id(host, evidence)
    if nsid is None:
        raise WipeRefused(
            f"wipe method {policy.method.value} needs an NVMe namespace; {evidence.by_id} "
            f"({evidence.kernel_name}) reports no NVMe namespace id: nothing sent",
            code="wipe_method_unsupported",
            evidence={"policy": policy.model_dump(mode="json"), "disk": evidence.model_dump(mode="json"),
                      "reason": f"/sys/class/block/{evidence.kernel_name}/nsid is missing"},
        )
    return nsid


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
        await wipe_step(runner, ["blkdiscard", "--zeroout", dev], policy.timeout_s, evidence)
        zeroed = True
        proof = await verify_wiped(host, evidence, method=WipeMethod.zeroout, samples=samples, seed=seed,
                                   started=started, runner=runner, dev=dev)
    left = whole if zeroed and whole is not None and not whole.all_zero else None
    if zeroed:
        guarantee = ProofGuarantee.write_zeroes
    elif whole is not None:
        guarantee = ProofGuarantee.whole_device_read
    else:
        guarantee = ProofGuarantee.erase_reads_zero if nvme is not None else ProofGuarantee.sampled
    proof = proof.model_copy(update={"policy": policy.method, "nvme": nvme, "whole_device": whole,
                                     "zeroed_after": zeroed, "guarantee": guarantee, "left_by_erase": left,
                                     "verified": proof.verified and (whole is None or whole.all_zero or zeroed),
                                     "duration_s": time.monotonic() - started})
    if not proof.verified:
        raise WipeError(
            f"{evidence.by_id} ({evidence.kernel_name}) is not provably empty after the {policy.method.value} wipe",
            code="wipe_unverified",
            evidence=proof.model_dump(mode="json"),
        )
    return proof
