"""Erase a leased NVMe namespace with the controller's own command: Format NVM or Sanitize.

Order of a call, each step refusing before anything is sent:

1. ask the device (``nvme id-ctrl`` / ``id-ns`` / ``ns-descs`` / ``list-ns``) through
   the namespace node the disk guard just checked;
2. the controller's answer must name the namespace the lease holds (UUID, NGUID,
   EUI-64 or the kernel's serial/model wwid, and the nsid): a different disk
   behind the same path is ``wipe_identity_mismatch``, naming both;
3. the policy's method must be one the controller reports (OACS/FNA for Format,
   SANICAP for Sanitize), else ``wipe_method_unsupported`` with the capability;
4. the command must not reach beyond the leased namespace: Sanitize always acts
   on the whole NVM subsystem, and a Format secure erase does when FNA says so,
   so those need a controller with the leased namespace as its only one
   (``wipe_scope_exceeds_lease``);
5. send the command; Sanitize runs in the background and is polled through the
   sanitize status log (0x81) at intervals set by the controller's estimate,
   until it ends or the policy's deadline passes.

Only step 5 writes. The runner is injected: the agent runs nvme-cli on the host,
the lab runs it inside a guest whose QEMU-emulated controller answers for real.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from gpuaas_agent.contract.nvmewipe import (
    FormatErase,
    NvmeCapabilities,
    NvmeEraseAction,
    NvmeEraseEvidence,
    SanitizeAction,
    SanitizeStatus,
    WipeMethod,
    WipePolicy,
)
from gpuaas_agent.contract.storage import DiskEvidence
from gpuaas_agent.errors import GuardError, HostError
from gpuaas_agent.host.storage.nvmecaps import (
    NvmeCapsError,
    Runner,
    device_identities,
    normalize_identity,
    nvme_json,
    parse_sanitize_log,
    read_capabilities,
)
from gpuaas_agent.hostfs import HostRoot

SANACT = {
    NvmeEraseAction.sanitize_block_erase: 2,
    NvmeEraseAction.sanitize_overwrite: 3,
    NvmeEraseAction.sanitize_crypto_erase: 4,
}
SES = {NvmeEraseAction.format_user_data: 1, NvmeEraseAction.format_crypto: 2}
# Which sanitize status log field holds the controller's estimate for an action (deallocating run).
ESTIMATE_KEY = {
    NvmeEraseAction.sanitize_block_erase: "time_block_erase",
    NvmeEraseAction.sanitize_overwrite: "time_over_write",
    NvmeEraseAction.sanitize_crypto_erase: "time_crypto_erase",
}
SSTAT_DONE = (1, 4)  # completed successfully / completed without deallocation
SSTAT_RUNNING = 2
SSTAT_FAILED = 3
POLL_MIN_S = 0.5
POLL_MAX_S = 30.0


class WipeRefused(GuardError):
    """A wipe method was refused before any command was sent; ``evidence`` holds what the device reported."""

    default_code = "wipe_refused"


class NvmeEraseError(HostError):
    """The NVMe erase command failed, or its completion could not be seen; the disk is not proven clean."""

    default_code = "wipe_failed"


def _caps_evidence(caps: NvmeCapabilities) -> dict[str, Any]:
    c, n = caps.controller, caps.namespace
    return {
        "capabilities": caps.model_dump(mode="json"),
        "format_supported": c.format_supported, "format_crypto_erase": c.format_crypto_erase,
        "sanitize_crypto_erase": c.sanitize_crypto_erase, "sanitize_block_erase": c.sanitize_block_erase,
        "sanitize_overwrite": c.sanitize_overwrite, "deallocated_reads_zero": n.deallocated_reads_zero,
    }  # fmt: skip


def _unsupported(policy: WipePolicy, caps: NvmeCapabilities, reason: str) -> WipeRefused:
    return WipeRefused(
        f"wipe method {policy.method.value} is not supported by {caps.controller.model} "
        f"(serial {caps.controller.serial}): {reason}",
        code="wipe_method_unsupported",
        evidence={"policy": policy.model_dump(mode="json"), "reason": reason, **_caps_evidence(caps)},
    )


def choose_action(policy: WipePolicy, caps: NvmeCapabilities) -> NvmeEraseAction:
    """The NVMe action ``policy`` asks for, only where the controller reports the capability; else a refusal."""
    ctrl = caps.controller
    if policy.method is WipeMethod.nvme_format:
        if not ctrl.format_supported:
            raise _unsupported(policy, caps, "OACS bit 1 (Format NVM) is clear")
        if policy.format_erase is FormatErase.crypto and not ctrl.format_crypto_erase:
            raise _unsupported(policy, caps, "FNA bit 2 (cryptographic erase) is clear")
        if policy.format_erase is FormatErase.user_data or not ctrl.format_crypto_erase:
            return NvmeEraseAction.format_user_data
        return NvmeEraseAction.format_crypto
    if policy.method is WipeMethod.nvme_sanitize:
        offered = {
            SanitizeAction.crypto_erase: (ctrl.sanitize_crypto_erase, NvmeEraseAction.sanitize_crypto_erase),
            SanitizeAction.block_erase: (ctrl.sanitize_block_erase, NvmeEraseAction.sanitize_block_erase),
            SanitizeAction.overwrite: (ctrl.sanitize_overwrite, NvmeEraseAction.sanitize_overwrite),
        }
        if policy.sanitize_action is SanitizeAction.auto:
            for supported, action in offered.values():  # crypto erase, block erase, overwrite: fastest first
                if supported:
                    return action
            raise _unsupported(policy, caps, f"SANICAP {ctrl.sanicap:#x} offers no sanitize action")
        supported, action = offered[policy.sanitize_action]
        if not supported:
            raise _unsupported(policy, caps, f"SANICAP {ctrl.sanicap:#x} lacks {policy.sanitize_action.value}")
        return action
    raise _unsupported(policy, caps, "not an NVMe method")


def check_identity(caps: NvmeCapabilities, lease_identity: str, *, by_id: str, dev: str) -> str:
    """The device identity that matches the lease, or ``wipe_identity_mismatch`` naming both."""
    wanted = normalize_identity(lease_identity)
    offered = device_identities(caps)
    if wanted in offered:
        return wanted
    raise WipeRefused(
        f"{by_id} ({dev}) answers as {offered[0]} (serial {caps.controller.serial}, nsid {caps.namespace.nsid}), "
        f"but the lease holds {lease_identity}: nothing sent",
        code="wipe_identity_mismatch",
        evidence={"by_id": by_id, "dev": dev, "lease_identity": lease_identity, "device_identities": offered,
                  "serial": caps.controller.serial, "model": caps.controller.model, "nsid": caps.namespace.nsid},
    )


def check_scope(action: NvmeEraseAction, caps: NvmeCapabilities) -> None:
    """Refuse a command that would erase more than the leased namespace (another slot's, a detached one, the OS).

    Sanitize always acts on the whole NVM subsystem, and a Format secure erase does when
    FNA says so: such a command needs the leased namespace to be the only one allocated
    (``list-ns --all``: attached or detached) on a single-controller subsystem. A
    controller that cannot list its allocated namespaces is refused too: a detached
    namespace it does not show would be erased unseen.
    """
    ctrl, nsid = caps.controller, caps.namespace.nsid
    subsystem_wide = action in SANACT or (action in SES and (ctrl.format_all_namespaces
                                                             or ctrl.secure_erase_all_namespaces))
    if not subsystem_wide:
        return
    others = sorted(set(caps.active_nsids) - {nsid})
    detached = sorted(set(caps.allocated_nsids or ()) - set(caps.active_nsids) - {nsid})
    unlisted = caps.allocated_nsids is None
    if others or detached or unlisted or nsid not in caps.active_nsids or ctrl.multi_controller:
        scope = "Sanitize acts on the whole NVM subsystem" if action in SANACT else \
            f"FNA {ctrl.fna:#x}: a secure erase format acts on every namespace"
        beyond = ([f"active namespace {n}" for n in others] + [f"detached namespace {n}" for n in detached]
                  + (["namespaces the controller did not list (list-ns --all unanswered)"] if unlisted else [])
                  + (["another controller of the subsystem"] if ctrl.multi_controller else []))
        raise WipeRefused(
            f"{action.value} on {ctrl.model} (serial {ctrl.serial}) would reach beyond namespace {nsid} "
            f"({', '.join(beyond) or 'the leased namespace is not active'}): {scope}",
            code="wipe_scope_exceeds_lease",
            evidence={"action": action.value, "nsid": nsid, "active_nsids": caps.active_nsids,
                      "allocated_nsids": caps.allocated_nsids, "beyond_lease": beyond,
                      "multi_controller": ctrl.multi_controller, "fna": ctrl.fna},
        )


def build_argv(action: NvmeEraseAction, dev: str, caps: NvmeCapabilities, policy: WipePolicy) -> list[str]:
    """nvme-cli argv for ``action`` on the namespace node ``dev`` (the LBA format kept as it is)."""
    if action in SES:
        lbaf = (caps.namespace.flbas & 0xF) | ((caps.namespace.flbas >> 5) & 0x3) << 4
        # --timeout: the kernel's default admin timeout (60 s) is shorter than a user-data erase of a big drive.
        return ["nvme", "format", dev, f"--namespace-id={caps.namespace.nsid}", f"--lbaf={lbaf}",
                f"--ses={SES[action]}", f"--timeout={int(policy.timeout_s * 1000)}", "--force"]
    argv = ["nvme", "sanitize", dev, f"--sanact={SANACT[action]}"]
    if action is NvmeEraseAction.sanitize_overwrite:
        argv += ["--owpass=1", "--ovrpat=0"]  # one pass of zeroes, not inverted
    return argv


def zeros_after(action: NvmeEraseAction, caps: NvmeCapabilities) -> bool:
    """Whether every LBA reads zero after ``action``: an overwrite of zeroes writes them; others need DLFEAT."""
    return action is NvmeEraseAction.sanitize_overwrite or caps.namespace.deallocated_reads_zero


def namespace_id(host: HostRoot, evidence: DiskEvidence) -> int | None:
    """The NVMe namespace id sysfs gives the guarded disk; None for a disk that is no NVMe namespace."""
    try:
        nsid = int(host.read_attr(f"/sys/class/block/{evidence.kernel_name}/nsid"))
    except (OSError, ValueError):
        return None
    return nsid if 1 <= nsid <= 0xFFFFFFFE else None


async def read_sanitize_status(dev: str, action: NvmeEraseAction, *, runner: Runner,
                               timeout: float = 60) -> SanitizeStatus:
    doc = await nvme_json(runner, ["nvme", "sanitize-log", dev, "--output-format=json"], timeout)
    return parse_sanitize_log(doc, estimate_key=ESTIMATE_KEY.get(action))


async def plan_nvme_erase(
    dev: str, *, nsid: int, lease_identity: str, policy: WipePolicy, by_id: str, runner: Runner
) -> tuple[NvmeCapabilities, str, NvmeEraseAction, list[str]]:
    """Steps 1-4 without step 5: (capabilities, matched identity, action, argv), or the refusal.

    Reads only (Identify, namespace list): a provision's validate can call it to
    prove, before a tenant's data is on the disk, that its release will be able to
    erase it the way the profile asks.
    """
    caps = await read_capabilities(dev, nsid, runner=runner)
    matched = check_identity(caps, lease_identity, by_id=by_id, dev=dev)
    action = choose_action(policy, caps)
    check_scope(action, caps)
    return caps, matched, action, build_argv(action, dev, caps, policy)


async def nvme_erase(
    dev: str,
    *,
    nsid: int,
    lease_identity: str,
    policy: WipePolicy,
    by_id: str,
    runner: Runner,
    clock: Callable[[], float] = time.monotonic,
) -> NvmeEraseEvidence:
    """Check identity, capability and scope, then run the one erase command; returns its evidence.

    Raises :class:`WipeRefused` (nothing sent), :class:`NvmeCapsError` (the device
    could not be read: nothing sent) or :class:`NvmeEraseError` (sent, and failed
    or not seen to finish).
    """
    started = clock()
    caps, matched, action, argv = await plan_nvme_erase(dev, nsid=nsid, lease_identity=lease_identity,
                                                        policy=policy, by_id=by_id, runner=runner)
    try:
        await runner(argv, timeout=policy.timeout_s + 60)
    except HostError as exc:
        raise NvmeEraseError(f"{action.value} on {by_id} failed: {exc.message}",
                             evidence={**exc.evidence, "action": action.value, **_caps_evidence(caps)}) from exc
    final, polls, estimate = None, 0, None
    if action in SANACT:
        final, polls = await _poll_sanitize(dev, action, by_id=by_id, runner=runner, deadline=started + policy.timeout_s,
                                            clock=clock)
        estimate = final.estimated_s
    return NvmeEraseEvidence(
        action=action, argv=argv, capabilities=caps, lease_identity=lease_identity, device_identity=matched,
        zeros_guaranteed=caps.namespace.deallocated_reads_zero, estimated_s=estimate, status_polls=polls,
        final_status=final, duration_s=clock() - started,
    )


async def _poll_sanitize(dev: str, action: NvmeEraseAction, *, by_id: str, runner: Runner, deadline: float,
                         clock: Callable[[], float]) -> tuple[SanitizeStatus, int]:
    """Read the sanitize status log until the sanitize we started ends; interval from the controller's estimate."""
    polls = 0
    while True:
        status = await read_sanitize_status(dev, action, runner=runner)
        polls += 1
        if status.status in SSTAT_DONE:
            if status.cdw10 is not None and status.cdw10 & 0x7 != SANACT[action]:
                # The log describes another sanitize (an earlier one): ours was not seen to run.
                raise NvmeEraseError(f"{action.value} on {by_id}: the sanitize status log describes sanitize "
                                     f"action {status.cdw10 & 0x7}, not {SANACT[action]}",
                                     evidence={"status": status.model_dump(mode="json"), "polls": polls})
            return status, polls
        if status.status == SSTAT_FAILED:
            raise NvmeEraseError(f"{action.value} on {by_id} failed (sanitize status log)", evidence={
                "status": status.model_dump(mode="json"), "polls": polls})
        if status.status != SSTAT_RUNNING:
            raise NvmeEraseError(f"{action.value} on {by_id}: the sanitize status log shows no sanitize "
                                 f"(status {status.status})", evidence={"status": status.model_dump(mode="json")})
        now = clock()
        if now >= deadline:
            raise NvmeEraseError(f"{action.value} on {by_id} still running at the policy's deadline",
                                 code="wipe_timeout", evidence={"status": status.model_dump(mode="json"),
                                                                 "polls": polls})
        interval = POLL_MIN_S if not status.estimated_s else status.estimated_s / 20
        await asyncio.sleep(min(max(interval, POLL_MIN_S), POLL_MAX_S, deadline - now))  # device poll interval


__all__ = ["NvmeCapsError", "NvmeEraseError", "WipeRefused", "build_argv", "check_identity",
           "check_scope", "choose_action", "namespace_id", "nvme_erase", "plan_nvme_erase",
           "read_sanitize_status", "zeros_after"]
