"""Bind a slot's PCI functions to vfio-pci through ``driver_override`` (docs/safety.md §3).

The kernel's sequence (Documentation/ABI/testing/sysfs-bus-pci)::

    echo vfio-pci     > /sys/bus/pci/devices/ADDR/driver_override
    echo ADDR         > /sys/bus/pci/drivers/CURRENT/unbind
    echo ADDR         > /sys/bus/pci/drivers_probe

``driver_override`` rather than ``new_id``: new_id claims every device with the
same vendor:device id, including GPUs of other slots. Each write runs in its own
daemon thread under a deadline: an unbind the nvidia driver cannot finish
(``nvidia-persistenced`` or ``nv-fabricmanager`` keep the device open) blocks in
the kernel and would otherwise stall the agent; we report who holds it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from gpuaas_agent.contract.vfio import VFIO_DRIVER, DeviceHolder, SysfsWrite, VfioBindResult
from gpuaas_agent.errors import HostError
from gpuaas_agent.guards.vfio import check_vfio_bindable
from gpuaas_agent.hostfs import HostRoot

log = logging.getLogger(__name__)

PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"

# Device nodes through which host services keep a function busy, by the driver it is leaving.
HOLDER_DEVICE_PREFIXES: dict[str, tuple[str, ...]] = {
    "nvidia": ("/dev/nvidia",),
    "mlx5_core": ("/dev/infiniband/",),
}
DEFAULT_HOLDER_PREFIXES = ("/dev/nvidia", "/dev/infiniband/", "/dev/vfio/")
# Who usually holds them, by /proc/<pid>/comm (cut by the kernel at 15 characters; compared as a
# prefix): named when the kernel refuses the agent that process's fd links (find_device_holders).
KNOWN_HOLDERS: dict[str, tuple[str, ...]] = {
    "/dev/nvidia": ("nvidia-persiste", "nv-fabricmanage", "nv-hostengine"),
    "/dev/vfio/": ("qemu-system-",),
}

# Called after each write has landed, before the next one. On a live host nothing is
# needed; on a fixture copy a test stands in for the kernel (e.g. re-points ``driver``).
AfterWrite = Callable[[SysfsWrite], Awaitable[None] | None]


class VfioBindError(HostError):
    """Binding started and did not finish; ``evidence`` has the writes made and what was seen.

    Codes: ``vfio_driver_missing``, ``sysfs_write_failed``, ``unbind_failed``,
    ``unbind_timeout``, ``bind_not_verified``.
    """

    default_code = "vfio_bind_failed"


async def bind_to_vfio(
    host: HostRoot,
    address: str,
    approved: Collection[str],
    *,
    write_timeout_s: float = 10.0,
    verify_timeout_s: float = 10.0,
    poll_interval_s: float = 0.05,
    after_write: AfterWrite | None = None,
) -> VfioBindResult:
    """Bind ``address`` to vfio-pci after the guard passed; idempotent.

    Already on vfio-pci: no write at all, ``changed=False``. Otherwise the three
    writes above, then the ``driver`` link is read until it names vfio-pci
    (``verify_timeout_s``). Raises :class:`VfioGuardError` (nothing written) or
    :class:`VfioBindError`.
    """
    guard = await asyncio.to_thread(check_vfio_bindable, host, address, approved)
    device = f"{PCI_DEVICES}/{address}"
    previous = host.link_name(f"{device}/driver")
    if previous == VFIO_DRIVER:
        log.info("event=vfio_bind_noop address=%s", address)
        return VfioBindResult(address=address, previous_driver=previous, driver=VFIO_DRIVER, changed=False,
                              writes=[], guard=guard)
    if not host.is_dir(f"{PCI_DRIVERS}/{VFIO_DRIVER}"):
        raise VfioBindError(
            "the vfio-pci driver is not loaded (modprobe vfio-pci)",
            code="vfio_driver_missing",
            evidence={"address": address, "driver": previous},
        )

    writes: list[SysfsWrite] = []

    async def write(path: str, value: str, *, failure_code: str = "sysfs_write_failed") -> None:
        step = SysfsWrite(path=path, value=value)
        try:
            await _write_with_deadline(host, path, value, write_timeout_s)
        except TimeoutError:
            raise await _bind_error(host, address, previous, writes, step, failure_code, timed_out=True,
                                    timeout_s=write_timeout_s) from None
        except OSError as exc:
            raise await _bind_error(host, address, previous, writes, step, failure_code, error=exc) from exc
        writes.append(step)
        log.info("event=sysfs_write address=%s path=%s value=%s", address, path, value)
        if after_write is not None:
            result = after_write(step)
            if asyncio.iscoroutine(result):
                await result

    await write(f"{device}/driver_override", VFIO_DRIVER)
    if previous is not None:
        # Named through drivers/<name>, never devices/ADDR/driver/unbind: HostRoot caches each
        # link it resolves through, and the driver link is exactly the one about to change.
        try:
            await write(f"{PCI_DRIVERS}/{previous}/unbind", address, failure_code="unbind_failed")
        except VfioBindError:
            await _clear_override(host, device, write_timeout_s, writes)
            raise
    await write(DRIVERS_PROBE, address)

    driver = await _wait_for_driver(host, device, VFIO_DRIVER, verify_timeout_s, poll_interval_s)
    if driver != VFIO_DRIVER:
        raise VfioBindError(
            f"{address} is on {driver or 'no driver'} after the probe, not {VFIO_DRIVER}",
            code="bind_not_verified",
            evidence={"address": address, "previous_driver": previous, "driver": driver,
                      "writes": [w.model_dump() for w in writes], "waited_s": verify_timeout_s},
        )
    log.info("event=vfio_bound address=%s previous_driver=%s", address, previous)
    return VfioBindResult(address=address, previous_driver=previous, driver=driver, changed=True, writes=writes,
                          guard=guard)


def find_device_holders(host: HostRoot, prefixes: Collection[str] = DEFAULT_HOLDER_PREFIXES) -> list[DeviceHolder]:
    """Processes with a device node under ``prefixes`` open, from ``/proc/*/fd`` (through the host root).

    Reads on-disk paths without following links (``/proc/PID/fd/N`` targets are
    host paths, not paths inside the root). Processes that exit mid-scan are skipped.

    The agent runs without ``CAP_SYS_PTRACE`` (the same capability would open every guest's
    memory through ``/proc/<qemu>/mem``), so the kernel refuses the fd links of another user's
    process, or of one with capabilities the agent lacks. Such a process is still named when its
    ``comm`` is a known holder of ``prefixes`` (:data:`KNOWN_HOLDERS`), with ``devices`` empty:
    what it holds could not be read, that it is the usual suspect could.
    """
    holders = []
    try:
        pids = sorted((name for name in os.listdir(host.real("/proc")) if name.isdigit()), key=int)
    except OSError:
        return []
    suspects = tuple(name for prefix in prefixes for name in KNOWN_HOLDERS.get(prefix, ()))
    for pid in pids:
        fd_dir = host.real(f"/proc/{pid}/fd")
        refused = False
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            fds, refused = [], True
        except OSError:
            continue
        devices = set()
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except PermissionError:
                refused = True
                continue
            except OSError:
                continue
            if target.startswith(tuple(prefixes)):
                devices.add(target)
        if not devices and not (refused and suspects):
            continue
        try:
            comm = host.real(f"/proc/{pid}/comm").read_text(errors="replace").strip() or None
        except OSError:
            comm = None
        if devices or (comm is not None and comm.startswith(suspects)):
            holders.append(DeviceHolder(pid=int(pid), comm=comm, devices=sorted(devices)))
    return holders


async def _bind_error(host: HostRoot, address: str, previous: str | None, writes: list[SysfsWrite],
                      step: SysfsWrite, code: str, *, timed_out: bool = False, timeout_s: float | None = None,
                      error: OSError | None = None) -> VfioBindError:
    evidence: dict[str, Any] = {
        "address": address,
        "previous_driver": previous,
        "failed_write": step.model_dump(),
        "writes": [w.model_dump() for w in writes],
    }
    if timed_out:
        code = "unbind_timeout" if code == "unbind_failed" else code
        evidence["timeout_s"] = timeout_s
        message = f"writing {step.value!r} to {step.path} did not return within {timeout_s:g}s"
    else:
        assert error is not None
        evidence["errno"] = error.errno
        evidence["error"] = error.strerror or repr(error)
        message = f"writing {step.value!r} to {step.path} failed: {error.strerror or error}"
    if code in ("unbind_failed", "unbind_timeout"):
        prefixes = HOLDER_DEVICE_PREFIXES.get(previous or "", DEFAULT_HOLDER_PREFIXES)
        holders = await asyncio.to_thread(find_device_holders, host, prefixes)
        evidence["holders"] = [h.model_dump() for h in holders]
        if holders:
            message += "; held open by " + ", ".join(f"{h.comm or '?'} (pid {h.pid})" for h in holders)
    return VfioBindError(message, code=code, evidence=evidence)


async def _clear_override(host: HostRoot, device: str, timeout_s: float, writes: list[SysfsWrite]) -> None:
    """Compensation after a failed unbind: the device stays on its driver, without a pending override.

    Best effort (the refusal being raised is the error that matters); a newline clears the override.
    """
    path = f"{device}/driver_override"
    try:
        await _write_with_deadline(host, path, "\n", timeout_s)
    except (OSError, TimeoutError) as exc:
        log.warning("event=driver_override_not_cleared path=%s error=%r", path, exc)
    else:
        writes.append(SysfsWrite(path=path, value="\n"))


async def write_sysfs_attr(host: HostRoot, host_path: str, value: str, timeout_s: float) -> None:
    """One deadline-bound write of a sysfs attribute (a device's ``reset``): the same write binding uses."""
    await _write_with_deadline(host, host_path, value, timeout_s)


async def _write_with_deadline(host: HostRoot, host_path: str, value: str, timeout_s: float) -> None:
    """One ``write(2)`` of ``value`` (a sysfs store takes the whole value in one call).

    Runs in a daemon thread of its own, not the default executor: a write stuck
    in the kernel cannot be interrupted, and it must neither occupy an executor
    worker forever nor keep the process from exiting. ``O_CREAT`` is never used:
    a missing attribute is an error, not a file to make.
    """
    real = host.real(host.resolve(host_path))
    data = value.encode()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def deliver(exc: BaseException | None) -> None:
        def settle() -> None:
            if done.done():
                return
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

        # RuntimeError: the loop is closed, its caller gave up on this write long ago.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle)

    def worker() -> None:
        try:
            fd = os.open(real, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
            try:
                written = os.write(fd, data)
            finally:
                os.close(fd)
            if written != len(data):
                raise OSError(0, f"short write: {written} of {len(data)} bytes", str(real))
        except BaseException as exc:
            deliver(exc)
        else:
            deliver(None)

    threading.Thread(target=worker, name=f"sysfs-write {host_path}", daemon=True).start()
    await asyncio.wait_for(done, timeout_s)


async def _wait_for_driver(host: HostRoot, device: str, wanted: str, timeout_s: float,
                           poll_interval_s: float) -> str | None:
    """Read the ``driver`` link until it names ``wanted`` or the deadline passes; returns the last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        driver = host.link_name(f"{device}/driver")
        if driver == wanted or time.monotonic() >= deadline:
            return driver
        await asyncio.sleep(poll_interval_s)

