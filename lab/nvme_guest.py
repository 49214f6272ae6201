"""A lab guest with a real (QEMU-emulated) NVMe controller and nvme-cli, for the wipe lane.

Why it exists: a slice host's NVMe erase commands (Format NVM, Sanitize) cannot
run against a loop device, and CI machines have no NVMe. QEMU emulates an NVMe
controller; a TCG guest sees it as ``/dev/nvme0n1`` and nvme-cli inside the guest
sends the real admin commands to it. The host then reads the backing file to
see what the controller really did.

The guest is the lab guest's initramfs (``lab/build_guest_image.py``) plus a second
cpio archive appended to it (the kernel unpacks concatenated archives in order):
the host's ``nvme`` binary with its shared libraries, and the ``nvme`` kernel
modules. It boots directly (``-kernel``/``-initrd``, no firmware: seconds fewer
under TCG), takes the root key from a ``cidata`` seed ISO, and answers SSH through
a user-mode network port forwarded to 127.0.0.1. Tests and the lab only.
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NVME_BINARY = Path("/usr/sbin/nvme")
NVME_MODULES = ("nvme",)
SERIAL = "GPUAASLABNVME0001"
NS_UUID = "6c616267-6e76-6d65-0000-000000000001"
NS_EUI64 = "6c6162676e766d01"
QEMU = "qemu-system-x86_64"


def _builder():
    from tests.realvm import load_builder  # the lab builder is a script, loaded by path

    return load_builder()


def build_nvme_initrd(kernel, dest: Path) -> Path:
    """The lab initramfs with nvme-cli and the nvme driver appended (written to ``dest``)."""
    builder = _builder()
    if not NVME_BINARY.is_file():
        raise builder.LabImageError(f"{NVME_BINARY} is missing (apt install nvme-cli)", path=str(NVME_BINARY))
    base = builder.build_initramfs(kernel)
    extra = builder.Cpio()
    extra.file(str(NVME_BINARY).lstrip("/"), NVME_BINARY.read_bytes(), 0o755)
    for lib in builder._shared_libraries(NVME_BINARY):
        extra.file(str(lib).lstrip("/"), lib.resolve().read_bytes(), 0o755)
    # The whole module list again (this archive's etc/modules.load replaces the first one's).
    order = builder.module_load_order(kernel.modules, (*builder.GUEST_MODULES, *NVME_MODULES))
    loaded = []
    for rel in order:
        plain = re.sub(r"\.(xz|zst|gz)$", "", rel)
        extra.file(f"lib/modules/{kernel.version}/{plain}", builder._decompress_module(kernel.modules / rel))
        name = re.sub(r"\.ko$", "", os.path.basename(plain)).replace("-", "_")
        params = builder.MODULE_PARAMS.get(name)
        loaded.append(f"{plain} {params}" if params else plain)
    extra.file("etc/modules.load", "".join(f"{m}\n" for m in loaded).encode())
    extra.dir("etc/nvme")
    dest.write_bytes(base + gzip.compress(extra.render(), compresslevel=6, mtime=0))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NvmeGuest:
    """One booted guest: its QEMU process, the NVMe backing file, and how to reach it."""

    workdir: Path
    backing: Path
    ssh_port: int
    key: object  # asyncssh.SSHKey
    proc: subprocess.Popen
    serial_log: Path
    argv: list[str] = field(default_factory=list)

    def log_text(self) -> str:
        return self.serial_log.read_text(errors="replace") if self.serial_log.exists() else ""

    def stop(self) -> None:
        from tests.support.daemons import stop_pid

        stop_pid(self.proc, timeout_s=10)


def boot_nvme_guest(workdir: Path, *, backing_mib: int = 64, cache: Path | None = None) -> NvmeGuest:
    """Start QEMU (TCG) with one NVMe controller (serial ``SERIAL``) and one namespace on ``backing``."""
    import asyncssh

    from gpuaas_agent.host.vm.cloudinit import build_seed_iso

    builder = _builder()
    cache = cache or Path(os.environ.get("GPUAAS_LAB_CACHE", "/var/cache/gpuaas-agent-lab"))
    kernel = builder.fetch_kernel(cache)
    workdir.mkdir(parents=True, exist_ok=True)
    initrd = build_nvme_initrd(kernel, workdir / "initrd-nvme.gz")
    backing = workdir / "nvme.raw"
    with open(backing, "wb") as fh:
        fh.truncate(backing_mib << 20)
    key = asyncssh.generate_private_key("ssh-ed25519")
    pub = key.export_public_key().decode().strip()
    seed = workdir / "seed.iso"
    seed.write_bytes(build_seed_iso({
        "meta-data": b"instance-id: nvme-lab\nlocal-hostname: nvme-lab\n",
        "user-data": f"#cloud-config\nssh_authorized_keys:\n  - {pub}\n".encode(),
    }))
    port = free_port()
    serial_log = workdir / "serial.log"
    argv = [
        QEMU, "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-m", "512", "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", str(kernel.vmlinuz), "-initrd", str(initrd), "-append", "console=ttyS0 panic=-1",
        "-serial", f"file:{serial_log}",
        "-drive", f"file={backing},if=none,id=nvm,format=raw,cache=none,aio=threads",
        "-device", f"nvme,serial={SERIAL},id=nvme0",
        "-device", f"nvme-ns,drive=nvm,bus=nvme0,nsid=1,uuid={NS_UUID},eui64=0x{NS_EUI64}",
        "-drive", f"file={seed},if=none,id=seed,media=cdrom,format=raw,readonly=on",
        "-device", "ide-cd,drive=seed",
        "-netdev", f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:22",
        "-device", "virtio-net-pci,netdev=n0",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(workdir / "qemu.out", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return NvmeGuest(workdir=workdir, backing=backing, ssh_port=port, key=key, proc=proc,
                     serial_log=serial_log, argv=argv)


async def connect(guest: NvmeGuest, *, timeout_s: float = 240.0):
    """An SSH connection to the guest's root, retried until the deadline (TCG boots take a while)."""
    import asyncio

    import asyncssh

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if guest.proc.poll() is not None:
            raise RuntimeError(f"qemu exited {guest.proc.returncode}: "
                               f"{(guest.workdir / 'qemu.out').read_text(errors='replace')[-2000:]}")
        if "GPUAAS-LAB-DHCP" in guest.log_text():
            try:
                return await asyncio.wait_for(asyncssh.connect(
                    "127.0.0.1", guest.ssh_port, username="root", client_keys=[guest.key], known_hosts=None,
                ), 20)
            except (OSError, asyncssh.Error, TimeoutError) as exc:
                last = exc
        await asyncio.sleep(0.5)  # poll step of the deadline wait above
    raise TimeoutError(f"guest SSH not up within {timeout_s}s (last: {last!r}); serial:\n{guest.log_text()[-3000:]}")


def guest_runner(conn):
    """A :data:`gpuaas_agent.host.run.Runner` that runs argv inside the guest (quoted; the guest has a shell)."""
    from gpuaas_agent.errors import HostError
    from gpuaas_agent.host.run import Completed

    async def run(argv: Sequence[str], *, timeout: float, check: bool = True, **_: object) -> Completed:
        argv = tuple(str(a) for a in argv)
        done = await conn.run(shlex.join(argv), check=False, timeout=timeout, encoding=None)
        code = done.exit_status if done.exit_status is not None else -1
        if check and code != 0:
            raise HostError(f"{argv[0]} exited with {code} in the lab guest", code="command_failed",
                            evidence={"argv": list(argv), "returncode": code,
                                      "stderr": (done.stderr or b"").decode("utf-8", "replace")[-4000:]})
        return Completed(argv=argv, returncode=code, stdout=done.stdout or b"", stderr=done.stderr or b"")

    return run


def qemu_version() -> str:
    return subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]


if __name__ == "__main__":  # exploration: boot, print id-ctrl / id-ns, stop
    import asyncio
    import sys
    import tempfile

    async def main(work: Path) -> None:
        guest = boot_nvme_guest(work)
        try:
            conn = await connect(guest)
            run = guest_runner(conn)
            for argv in sys.argv[1:] or ["nvme id-ctrl /dev/nvme0n1 -o json"]:
                done = await run(argv.split(), timeout=60, check=False)
                print(f"$ {argv} -> {done.returncode}\n{done.stdout.decode()}{done.stderr.decode()}")
            conn.close()
        finally:
            guest.stop()

    with tempfile.TemporaryDirectory(prefix="nvme-guest-") as tmp:
        asyncio.run(main(Path(tmp)))
