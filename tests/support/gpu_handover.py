"""A slice host between two tenants, and NVIDIA's GPU admin tool replayed from its answers (fixtures/gpu-admin-tools).

The host is a copy of the synthetic 8xH200 host after a reboot (GPUs and VFs on
vfio-pci) with what the kernel adds on a real one and the fixture does not carry:
each function's ``reset_method`` (an H200 alone below its switch port offers
``flr bus``; a ConnectX-7 VF ``flr``) and the GPU's live ``config`` space holding
the BARs its ``resource`` file says the kernel assigned.

The tool cannot run here (no GPU, and no GPU may be reset for a test): a runner
serves each argv its case's answers hold and refuses any other, so the order and
the exact options the driver sends are checked by the replay itself.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from gpuaas_agent.host.devices.gpuadmin import GpuAdminTool
from gpuaas_agent.host.run import Completed

REPO = Path(__file__).resolve().parents[2]
ANSWERS = REPO / "fixtures" / "gpu-admin-tools"
HOST = "h200-slice-after-reboot"
GPU, VF, BRIDGE = "0000:18:00.0", "0000:19:00.1", "0000:17:00.0"
PYTHON, SCRIPT = "/usr/lib/gpuaas-agent/venv/bin/python3", Path("/usr/lib/gpuaas-agent/nvidia_gpu_tools.py")
DEVICES = "sys/bus/pci/devices"


def config_space(root: Path, address: str, *, bar_override: dict[int, int] | None = None) -> bytes:
    """64 bytes of config space: the ids of ``vendor``/``device`` and every BAR as ``resource`` assigns it."""
    device = root / DEVICES / address
    vendor, dev = (int((device / n).read_text(), 16) for n in ("vendor", "device"))
    regs = [0] * 6
    lines = (device / "resource").read_text().splitlines()[:6]
    for index, line in enumerate(lines):
        start, _end, flags = (int(x, 16) for x in line.split())
        if start == 0:
            continue
        start = (bar_override or {}).get(index, start)
        if flags & 0x00100000:  # IORESOURCE_MEM_64: a 64-bit BAR in two registers
            regs[index] = (start & 0xFFFFFFF0) | 0x4 | (0x8 if flags & 0x2000 else 0)
            regs[index + 1] = start >> 32
        else:
            regs[index] = start & 0xFFFFFFF0
    raw = struct.pack("<HHHH", vendor, dev, 0x0006, 0x0010) + b"\0" * 8 + struct.pack("<6I", *regs)
    return raw + b"\0" * (64 - len(raw))


def between_tenants(root: Path) -> Path:
    """Give a host copy what the kernel shows on a real host: reset methods, the GPU's config space."""
    devices = root / DEVICES
    (devices / GPU / "reset_method").write_text("flr bus\n")
    (devices / VF / "reset_method").write_text("flr\n")
    (devices / GPU / "config").write_bytes(config_space(root, GPU))
    return root


class ReplayTool:
    """Runs nothing: answers each argv from ``fixtures/gpu-admin-tools/<case>`` and refuses any other."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.answers = json.loads((ANSWERS / case / "answers.json").read_text())
        self.calls: list[list[str]] = []

    async def __call__(self, argv, *, timeout, check=True, **_):
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        assert timeout > 0 and check is False, (timeout, check)
        assert argv[:2] == [PYTHON, str(SCRIPT)], f"not the configured tool: {argv[:2]}"
        for answer in self.answers:
            if answer["argv"] == argv[2:]:
                return Completed(argv=tuple(argv), returncode=answer["returncode"],
                                 stdout=answer["stdout"].encode(), stderr=answer["stderr"].encode())
        raise AssertionError(f"gpu-admin-tools case {self.case!r} has no answer recorded for {argv[2:]}")

    def tool(self) -> GpuAdminTool:
        return GpuAdminTool(script=SCRIPT, python=PYTHON, runner=self)

    def options(self) -> list[list[str]]:
        """The options of each run, in order (after ``--gpu-bdf ADDR --log info``)."""
        return [c[6:] for c in self.calls]
