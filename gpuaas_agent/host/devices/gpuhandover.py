"""Hand one GPU (and a slot's fabric VF) from one tenant to the next: reset, clear, restore, prove.

For one GPU, with no domain holding it (docs/safety.md §12), the declared steps of
:data:`GPU_HANDOVER_STEPS` after :meth:`GpuHandover.begin` chose the reset:

1. ``query_before``: what the last tenant left (evidence; a failed query is recorded, not fatal);
2. ``stage_settings``: CC mode, PPCIe mode, ECC on and MIG off *for the next boot*, always, whatever
   the query said: a tenant can stage a change (``nvidia-smi -e 0``) that no query shows until a reset;
3. ``reset_and_clear``: the reset :func:`~gpuaas_agent.guards.gpureset.choose_gpu_reset` chose, the
   tool waiting for the firmware's memory scrub, then the memory-clear flag read back (``--read-bar0``);
4. ``config_space``: the config space read from sysfs and compared with the kernel's BAR assignment;
5. ``query_after``: the settings read back and compared with the policy;
6. ``back_on_vfio``: the device back on vfio-pci (bound again through host/devices/vfio.py if the reset moved it).

Like the task pipelines' declarations (tasks/pipeline.py ``StepDef``), the steps are data: the
release runs them through the pipeline runner, so each is journaled ``gpu_handover.<step>`` and has
its crash points before and after its side effect, and the crash harness enumerates them from here.
Nothing undoes a step: an interrupted handover is run again whole (a reset is never skipped
because an earlier run journaled it).

The tool is NVIDIA's (host/devices/gpuadmin.py). Each failure is a :class:`GpuHandoverError` whose
evidence holds every tool run so far; the release turns it into ``cleanup_blocked``.
The fabric VF gets the kernel's function-level reset (its ``reset`` attribute, FLR first).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from gpuaas_agent.contract.gpuhandover import (
    ConfigSpaceCheck,
    GpuHandoverResult,
    GpuResetChoice,
    GpuResetMethod,
    GpuSettings,
    ToolRun,
    VfResetResult,
)
from gpuaas_agent.contract.handover import CcMode, GpuHandoverPolicy
from gpuaas_agent.contract.vfio import VFIO_DRIVER
from gpuaas_agent.errors import AgentError, HostError
from gpuaas_agent.guards.gpureset import PCI_DEVICES, GpuHandoverRefused, check_vf_resettable, choose_gpu_reset
from gpuaas_agent.host.devices.gpuadmin import GpuAdminTool, ToolAnswer, memory_clear_register
from gpuaas_agent.host.devices.vfio import AfterWrite, bind_to_vfio, write_sysfs_attr
from gpuaas_agent.hostfs import HostRoot

log = logging.getLogger(__name__)

# Words of the tool's reset paths (cli/per_device.py, pci/bridge.py): an error naming one is the reset's.
_RESET_WORDS = ("SBR", "FLR", "reset", "link training", "broken", "config space")


class GpuHandoverError(HostError):
    """A GPU could not be handed over; ``evidence`` has the reset chosen and every tool run.

    Codes: ``gpu_reset_failed``, ``gpu_memory_clear_unverified``, ``gpu_settings_not_restored``,
    ``gpu_config_space_not_restored``, ``gpu_handover_tool_missing``.
    """

    default_code = "gpu_handover_failed"


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(self.end - time.monotonic(), 0.001)


def read_config_space(host: HostRoot, address: str) -> ConfigSpaceCheck:
    """The live config space (sysfs ``config``) against sysfs ``vendor``/``device`` and ``resource`` (pure read).

    An SBR returns every BAR to zero; the tool writes the saved config space back.
    ``restored``: the ids read live match and every BAR the kernel assigned
    (``resource`` line *i*, start non-zero) holds that base again.
    """
    device = f"{PCI_DEVICES}/{address}"
    try:
        raw = host.real(host.resolve(f"{device}/config")).read_bytes()[:64]
        expected = (int(host.read_attr(f"{device}/vendor"), 16), int(host.read_attr(f"{device}/device"), 16))
        resources = [int(line.split()[0], 16) for line in host.read_text(f"{device}/resource").splitlines()[:6]]
    except (OSError, ValueError, IndexError) as exc:
        raise GpuHandoverError(f"the config space of {address} cannot be read back: {exc}",
                               code="gpu_config_space_not_restored",
                               evidence={"address": address, "error": str(exc)}) from exc
    if len(raw) < 40:
        raise GpuHandoverError(f"the config space of {address} reads {len(raw)} bytes",
                               code="gpu_config_space_not_restored", evidence={"address": address, "bytes": len(raw)})
    vendor, dev = struct.unpack_from("<HH", raw, 0)
    regs = struct.unpack_from("<6I", raw, 0x10)
    bars: dict[str, str] = {}
    restored = (vendor, dev) == expected
    index = 0
    while index < 6:
        low = regs[index]
        if low & 1:  # I/O BAR
            base, width = low & ~0x3, 1
        elif (low >> 1) & 0x3 == 2 and index < 5:  # 64-bit memory BAR: this register and the next
            base, width = (low & ~0xF) | (regs[index + 1] << 32), 2
        else:
            base, width = low & ~0xF, 1
        if index < len(resources) and resources[index]:
            bars[str(index)] = f"0x{base:x}"
            restored = restored and base == resources[index]
        index += width
    return ConfigSpaceCheck(vendor_device=f"{vendor:04x}:{dev:04x}", bars=bars, restored=restored)


def _mismatches(policy: GpuHandoverPolicy, after: GpuSettings, ppcie_supported: bool) -> dict[str, dict[str, Any]]:
    wanted: dict[str, Any] = {"mig_enabled": policy.mig_enabled, "cc_mode": policy.cc_mode.value}
    if policy.cc_mode is CcMode.off:  # the tool cannot read ECC while CC is on (its own refusal)
        wanted["ecc_enabled"] = policy.ecc_enabled
    if ppcie_supported:
        wanted["ppcie_mode"] = policy.ppcie_mode.value
    return {k: {"expected": v, "found": getattr(after, k)} for k, v in wanted.items() if getattr(after, k) != v}


class GpuHandover:
    """One GPU's handover under way: what every step reads, and what the steps found so far.

    :meth:`begin` chooses the reset (a refusal here touches nothing); then each step of
    :data:`GPU_HANDOVER_STEPS` runs in order on this object, recording its findings on it and
    every tool run in ``runs`` (the evidence each failure carries); :meth:`result` is the proof.
    """

    def __init__(self, host: HostRoot, address: str, policy: GpuHandoverPolicy, *, choice: GpuResetChoice,
                 tool: GpuAdminTool, after_write: AfterWrite | None = None) -> None:
        self.host, self.address, self.policy, self.choice, self.tool = host, address, policy, choice, tool
        self.after_write = after_write
        self.started = time.monotonic()
        self.deadline = _Deadline(policy.timeout_s)
        self.flag_register: int | None = None
        self.runs: list[ToolRun] = []
        self.warnings: list[str] = []
        # What the steps found (None until the step that reads it has run).
        self.before: GpuSettings | None = None
        self.ppcie_supported = True
        self.flag: int | None = None
        self.config: ConfigSpaceCheck | None = None
        self.after: GpuSettings | None = None
        self.driver: str | None = None
        self.vfio_rebound = False

    @classmethod
    async def begin(cls, host: HostRoot, address: str, policy: GpuHandoverPolicy, *, held: Collection[str],
                    tool: GpuAdminTool, after_write: AfterWrite | None = None) -> GpuHandover:
        """The reset chosen from sysfs and the memory-clear flag register known; nothing run, nothing written.

        ``held``: PCI addresses any defined libvirt domain names (refused: ``gpu_held_by_domain``).
        """
        choice = await asyncio.to_thread(choose_gpu_reset, host, address, held=held, clear_memory=policy.clear_memory)
        handover = cls(host, address, policy, choice=choice, tool=tool, after_write=after_write)
        if policy.clear_memory:
            device_id = int(await asyncio.to_thread(host.read_attr, f"{PCI_DEVICES}/{address}/device"), 16)
            handover.flag_register = memory_clear_register(device_id)
            if handover.flag_register is None:
                raise handover.fail("gpu_memory_clear_unverified",
                                    f"no known memory-clear flag register for device id 0x{device_id:04x}",
                                    device_id=device_id)
        return handover

    def fail(self, code: str, message: str, **evidence: Any) -> GpuHandoverError:
        return GpuHandoverError(f"{self.address}: {message}", code=code, evidence={
            "address": self.address, "reset": self.choice.model_dump(mode="json"),
            "policy": self.policy.model_dump(mode="json"), **evidence,
            "tool_runs": [r.model_dump(mode="json") for r in self.runs]})

    async def invoke(self, purpose: str, options: list[str], failure_code: str) -> tuple[ToolRun, ToolAnswer]:
        """One run of the tool with the time left of the policy's deadline, kept in ``runs``."""
        try:
            record, answer = await self.tool.invoke(purpose, self.address, options, timeout=self.deadline.left())
        except HostError as exc:
            code = "gpu_handover_tool_missing" if exc.code == "command_not_found" else failure_code
            raise self.fail(code, f"the GPU admin tool ({purpose}) failed: {exc.message}", tool_error=exc.code,
                            tool_evidence=exc.evidence) from exc
        self.runs.append(record)
        return record, answer

    def result(self) -> GpuHandoverResult:
        """The proof, once every step of :data:`GPU_HANDOVER_STEPS` has passed."""
        if self.config is None or self.after is None or self.driver is None:
            raise RuntimeError(f"the handover of {self.address} has not run all its steps")
        result = GpuHandoverResult(
            address=self.address, policy=self.policy, reset=self.choice, before=self.before,
            memory_cleared=self.flag_register is not None,
            memory_clear_flag=None if self.flag is None else f"0x{self.flag:x}", after=self.after,
            config_space=self.config, driver=self.driver, vfio_rebound=self.vfio_rebound, tool_runs=self.runs,
            warnings=self.warnings, duration_s=round(time.monotonic() - self.started, 3))
        log.info("event=gpu_handed_over address=%s reset=%s memory_cleared=%s rebound=%s",
                 self.address, self.choice.method.value, result.memory_cleared, self.vfio_rebound)
        return result


# -- the steps: each a named function of the handover, its rule beside it; each returns what its journal entry says --


async def query_before(h: GpuHandover) -> dict[str, Any]:
    """What the last tenant left (evidence only: a failed query is a warning); PPCIe support is learned here."""
    query = ["--query-cc-mode", "--query-ecc-state", "--query-mig-mode", "--query-ppcie-mode"]
    first, seen = await h.invoke("query_before", query, "gpu_reset_failed")
    h.before = seen.settings() if seen.read_anything else None
    if first.returncode != 0 or seen.errors:
        h.warnings.append(f"the query before the reset did not answer fully: {'; '.join(seen.errors) or 'exit ' + str(first.returncode)}")
    h.ppcie_supported = not seen.ppcie_unsupported
    return {"before": None if h.before is None else h.before.model_dump(mode="json"),
            "ppcie_supported": h.ppcie_supported}


async def stage_settings(h: GpuHandover) -> dict[str, Any]:
    """The next boot's settings, staged always, whatever the query said (a staged change shows in no query)."""
    policy = h.policy
    stage = ["--set-cc-mode", policy.cc_mode.value]
    if policy.ecc_enabled:
        stage.append("--force-ecc-on-after-reset")
    if not policy.mig_enabled:
        stage.append("--force-mig-off-after-reset")
    if h.ppcie_supported:
        stage += ["--set-ppcie-mode", policy.ppcie_mode.value]
    staged, answer = await h.invoke("stage_settings", stage, "gpu_settings_not_restored")
    if staged.returncode != 0 or answer.errors:
        raise h.fail("gpu_settings_not_restored", "staging the profile's settings for the next boot failed: "
                     + ("; ".join(answer.errors) or f"exit {staged.returncode}"))
    return {"options": stage}


async def reset_and_clear(h: GpuHandover) -> dict[str, Any]:
    """The reset chosen at :meth:`GpuHandover.begin`, the firmware's memory scrub, the flag read back.

    The tool's exit status is not trusted alone: an error line naming the reset fails it, and the
    memory clear counts only when the flag register reads bit 0 set (not ``0xffffffff``/``0xbadf....``).
    """
    choice, flag_register = h.choice, h.flag_register
    reset = ["--reset-with-sbr" if choice.method is GpuResetMethod.sbr else "--reset-with-flr"]
    if flag_register is not None:
        reset += ["--clear-memory", "--read-bar0", f"0x{flag_register:x}"]
    done, answer = await h.invoke("reset_and_clear", reset, "gpu_reset_failed")
    reset_errors = [e for e in answer.errors if "memory_clear" not in e and any(w in e for w in _RESET_WORDS)]
    clear_errors = [e for e in answer.errors if "memory_clear" in e]
    if reset_errors or (done.returncode != 0 and not clear_errors):
        raise h.fail("gpu_reset_failed", f"the {choice.method.value.upper()} did not complete: "
                     + ("; ".join(reset_errors or answer.errors) or f"exit {done.returncode}"))
    flag = answer.bar0.get(flag_register) if flag_register is not None else None
    if flag_register is not None:
        proven = flag is not None and flag != 0xFFFFFFFF and flag >> 16 != 0xBADF and flag & 1 == 1
        if clear_errors or not proven or answer.errors or done.returncode != 0:
            raise h.fail("gpu_memory_clear_unverified",
                         "the firmware's memory scrub was not proven finished after the reset: "
                         + ("; ".join(clear_errors or answer.errors) or
                            f"flag register 0x{flag_register:x} = {'unread' if flag is None else hex(flag)}"),
                         flag_register=f"0x{flag_register:x}", flag=None if flag is None else f"0x{flag:x}")
    elif answer.errors:
        raise h.fail("gpu_reset_failed", "the reset reported errors: " + "; ".join(answer.errors))
    h.flag = flag
    return {"method": choice.method.value, "memory_clear_flag": None if flag is None else f"0x{flag:x}"}


async def config_space(h: GpuHandover) -> dict[str, Any]:
    """The config space back as the kernel assigned it (the agent's own read of sysfs, not the tool's word)."""
    config = await asyncio.to_thread(read_config_space, h.host.fresh(), h.address)
    if not config.restored:
        raise h.fail("gpu_config_space_not_restored", f"config space after the reset reads {config.vendor_device} "
                     f"with BARs {config.bars}", config_space=config.model_dump(mode="json"))
    h.config = config
    return config.model_dump(mode="json")


async def query_after(h: GpuHandover) -> dict[str, Any]:
    """The settings read back and compared with the policy (ECC is unreadable while CC is on: a warning)."""
    policy = h.policy
    unreadable: dict[str, str] = {}
    query = ["--query-cc-mode", "--query-mig-mode"]
    if policy.cc_mode is CcMode.off:
        query.append("--query-ecc-state")
    else:
        unreadable["ecc_enabled"] = f"the tool refuses to read ECC with CC mode {policy.cc_mode.value}"
        h.warnings.append(unreadable["ecc_enabled"])
    if h.ppcie_supported:
        query.append("--query-ppcie-mode")
    read, answer = await h.invoke("query_after", query, "gpu_settings_not_restored")
    if read.returncode != 0 or answer.errors:
        raise h.fail("gpu_settings_not_restored", "the settings could not be read back after the reset: "
                     + ("; ".join(answer.errors) or f"exit {read.returncode}"))
    after = answer.settings(unreadable)
    if not h.ppcie_supported:
        after = after.model_copy(update={"ppcie_mode": "unsupported"})
    wrong = _mismatches(policy, after, h.ppcie_supported)
    if wrong:
        raise h.fail("gpu_settings_not_restored", "read back after the reset: " + ", ".join(
            f"{k}={v['found']!r} (profile: {v['expected']!r})" for k, v in wrong.items()),
            mismatches=wrong, after=after.model_dump(mode="json"))
    h.after = after
    return after.model_dump(mode="json")


async def back_on_vfio(h: GpuHandover) -> dict[str, Any]:
    """Still on vfio-pci, or bound back through host/devices/vfio.py (guarded, verified); else ``gpu_reset_failed``."""
    h.driver, h.vfio_rebound = await _ensure_vfio(h.host, h.address, h.after_write)
    return {"driver": h.driver, "vfio_rebound": h.vfio_rebound}


@dataclass(frozen=True)
class HandoverStep:
    """One declared step of a GPU's handover: ``run(handover)`` acts and returns its journal entry's detail.

    Nothing undoes a handover step (``no_compensation`` says why): an interrupted handover is run
    again whole from :meth:`GpuHandover.begin`, never resumed half way.
    """

    name: str
    run: Callable[[GpuHandover], Awaitable[dict[str, Any]]]
    no_compensation: str


_REDONE = "the whole handover runs again after an interruption; a failure leaves the slot cleanup_blocked"

# The GPU handover, in order (docs/gpu-handover.md "The sequence"): the release runs these through the pipeline
# runner (journal, progress, crash points: tasks/release.py), and the crash harness enumerates them from here.
GPU_HANDOVER_STEPS: tuple[HandoverStep, ...] = (
    HandoverStep("query_before", query_before, "a read: what the last tenant left, kept as evidence"),
    HandoverStep("stage_settings", stage_settings, _REDONE),
    HandoverStep("reset_and_clear", reset_and_clear, "a reset is not undone; " + _REDONE),
    HandoverStep("config_space", config_space, "a read of sysfs"),
    HandoverStep("query_after", query_after, "a read: the settings compared with the policy"),
    HandoverStep("back_on_vfio", back_on_vfio, "vfio-pci is where a passed-through GPU stays between tenants"),
)


async def hand_over_gpu(host: HostRoot, address: str, policy: GpuHandoverPolicy, *, held: Collection[str],
                        tool: GpuAdminTool, after_write: AfterWrite | None = None) -> GpuHandoverResult:
    """Reset, clear, restore and prove one GPU (see the module docstring); raises a typed error on any failure.

    The steps of :data:`GPU_HANDOVER_STEPS` in order, without a journal (the release runs the same
    steps through its pipeline runner). ``held``: PCI addresses any defined libvirt domain names
    (refused: ``gpu_held_by_domain``). ``after_write``: passed to the vfio re-bind (a fixture stands
    in for the kernel there).
    """
    handover = await GpuHandover.begin(host, address, policy, held=held, tool=tool, after_write=after_write)
    for step in GPU_HANDOVER_STEPS:
        await step.run(handover)
    return handover.result()


async def _ensure_vfio(host: HostRoot, address: str, after_write: AfterWrite | None) -> tuple[str, bool]:
    driver = host.fresh().link_name(f"{PCI_DEVICES}/{address}/driver")
    if driver == VFIO_DRIVER:
        return driver, False
    try:
        bound = await bind_to_vfio(host.fresh(), address, [address], after_write=after_write)
    except AgentError as exc:
        raise GpuHandoverError(f"{address} is on {driver or 'no driver'} after the reset and could not be bound "
                               f"back to vfio-pci: {exc.message}", code="gpu_reset_failed",
                               evidence={"address": address, "driver": driver, "bind_code": exc.code,
                                         "bind_evidence": exc.evidence}) from exc
    return bound.driver, True


async def reset_fabric_vf(host: HostRoot, address: str, *, held: Collection[str],
                          write_timeout_s: float = 30.0, after_write: AfterWrite | None = None) -> VfResetResult:
    """The kernel's FLR of the slot's fabric VF (write ``1`` to its ``reset``; FLR must be the first method)."""
    if address in held:
        raise GpuHandoverRefused(f"{address} is named by a defined libvirt domain: no reset while a guest holds it",
                                 code="gpu_held_by_domain", evidence={"address": address, "held": [address]})
    methods = await asyncio.to_thread(check_vf_resettable, host, address)
    if methods[0] != "flr":
        raise GpuHandoverRefused(f"fabric VF {address}: the kernel would try {methods[0]} before FLR",
                                 code="gpu_reset_path_missing", evidence={"address": address, "reset_methods": methods})
    try:
        await write_sysfs_attr(host, f"{PCI_DEVICES}/{address}/reset", "1", write_timeout_s)
    except (OSError, TimeoutError) as exc:
        raise GpuHandoverError(f"the FLR of fabric VF {address} failed: {exc!r}", code="gpu_reset_failed",
                               evidence={"address": address, "reset_methods": methods, "error": repr(exc)}) from exc
    driver, rebound = await _ensure_vfio(host, address, after_write)
    return VfResetResult(address=address, reset_methods=methods, driver=driver, vfio_rebound=rebound)


__all__ = ["GPU_HANDOVER_STEPS", "GpuHandover", "GpuHandoverError", "GpuResetChoice", "HandoverStep", "hand_over_gpu",
           "read_config_space", "reset_fabric_vf"]
