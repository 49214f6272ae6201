"""What every hand-started test daemon needs: wait for it, stop it by PID, and queue on a host-wide lock.

PID 1 reaps nothing on CI machines, so daemons run in the foreground under
``Popen`` and are stopped (and reaped) here. Daemons that exist once per
machine (the system libvirtd, a netdev datapath in the root namespace) are
shared by sessions only one at a time: :func:`host_lock` queues them.
"""

from __future__ import annotations

import fcntl
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def stop_pid(proc: subprocess.Popen | None, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` by PID, SIGKILL if the process lingers past ``timeout_s``, and reap it."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def wait_for_daemons(predicate: Callable[[], bool], what: str, procs: Mapping[str, subprocess.Popen],
                     log_tail: Callable[[], str], timeout: float, *, poll_s: float) -> None:
    """Poll ``predicate`` until it holds; fail at once when one of ``procs`` (name -> process) exits, or after
    ``timeout``, with ``log_tail()`` (the daemons' logs) in the error."""
    deadline = time.monotonic() + timeout
    while not predicate():
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode} while waiting for {what}\n{log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{log_tail()}")
        time.sleep(poll_s)  # poll step of the deadline wait above


@contextmanager
def host_lock(path: Path, timeout_s: float, *, poll_s: float = 0.1) -> Iterator[None]:
    """Hold an exclusive flock on ``path``; waits (deadline-bounded polling) while another session holds it."""
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another test session held {path} for over {timeout_s}s") from None
                time.sleep(poll_s)  # poll step of the deadline wait above
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
