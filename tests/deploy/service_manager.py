"""A stand-in for systemd as PID 1, for one ``Type=notify`` unit, driven by the maintainer scripts' own calls.

Why: a test root has no systemd, so ``deb-systemd-invoke`` and ``systemctl`` (called by the package's
prerm/postinst) do nothing there. Here they are shims (on dpkg's PATH, ``DPkg::Path``) that hand each
call over a UNIX socket to this manager and wait for its answer, as ``systemctl stop`` waits for the
stop. The manager then does with the *installed* unit file what systemd does with it:

* ``start``: every ``ExecStartPre=`` line (``+``/``-`` prefixes honoured as far as they matter here:
  ``-`` ignores a failure), then ``ExecStart=`` with ``NOTIFY_SOCKET`` set; the start returns once the
  main process sent ``READY=1`` (``Type=notify``), or fails when it exits first;
* ``stop``: ``SIGTERM`` to the main process only (``KillMode=mixed``), ``SIGKILL`` to the whole unit
  cgroup after ``TimeoutStopSec=``, and after the main process exited ``SIGKILL`` to whatever is left
  in its cgroup (what was left is recorded: a clean stop leaves nothing);
* ``daemon-reload`` reads the unit file again (the new version's, after dpkg unpacked it);
* ``deb-systemd-invoke start`` starts only an enabled unit, as the real one does.

The unit's processes live in a cgroup-v1 ``blkio`` group of their own (the unit's cgroup), so a test
can throttle what the agent and its children (qemu-img) write to a disk, and see what outlives a stop.
The sandboxing directives of the unit are not applied (tests/deploy/test_unit_sandbox.py is their test).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

UNIT = "gpuaas-agent.service"
UNIT_FILE = Path("/lib/systemd/system") / UNIT
AGENT = Path("/opt/gpuaas-agent/bin/gpuaas-agent")
BLKIO = Path("/sys/fs/cgroup/blkio")
START_TIMEOUT_S = 180.0
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

SHIM = """#!/usr/bin/python3
# Hands this systemd call of a maintainer script to the test's service manager; exits with its answer.
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({socket_path!r})
s.sendall(json.dumps({{"tool": os.path.basename(sys.argv[0]), "args": sys.argv[1:]}}).encode() + b"\\n")
sys.exit(int(s.makefile().readline() or "1"))
"""


def parse_seconds(value: str) -> float:
    """systemd time spans as units use them: ``90``, ``90s``, ``1min 30s``, ``500ms``."""
    scale = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 0.001, "min": 60.0, "m": 60.0, "h": 3600.0}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * scale[unit]
    return total


@dataclass(frozen=True)
class UnitFile:
    exec_start_pre: list[list[str]]
    exec_start: list[str]
    timeout_stop_s: float
    kill_mode: str
    type: str

    @classmethod
    def read(cls, path: Path = UNIT_FILE) -> UnitFile:
        section, pre, start, keys = "", [], [], {}
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            if section != "[Service]" or "=" not in line:
                continue
            key, value = (part.strip() for part in line.split("=", 1))
            if key == "ExecStartPre":
                pre.append(value)
            elif key == "ExecStart":
                start.append(value)
            else:
                keys[key] = value
        assert len(start) == 1, f"{path}: one ExecStart= expected, got {start}"
        return cls(exec_start_pre=[_command(v) for v in pre], exec_start=_command(start[0]),
                   timeout_stop_s=parse_seconds(keys.get("TimeoutStopSec", "90s")),
                   kill_mode=keys.get("KillMode", "control-group"), type=keys.get("Type", "simple"))


def _command(value: str) -> list[str]:
    """An Exec line as argv; a leading ``-`` is kept as the marker of an ignored failure."""
    prefixes = ""
    while value and value[0] in "+-@!:":
        prefixes += value[0]
        value = value[1:]
    argv = shlex.split(value)
    return ["-", *argv] if "-" in prefixes else argv


@dataclass
class StopRecord:
    returncode: int | None
    seconds: float
    timed_out: bool            # SIGKILL at TimeoutStopSec, not the agent's own exit
    left_in_cgroup: list[str]  # "pid comm" of what outlived the main process (then SIGKILLed)
    cgroup_empty_s: float      # when the stop returned: everything of the unit gone


@dataclass
class ServiceManager:
    """One unit, one cgroup, one control socket; :meth:`shim_dir` holds the ``systemctl`` and
    ``deb-systemd-invoke`` shims to put first on dpkg's PATH."""

    workdir: Path
    enabled: bool = False
    calls: list[str] = field(default_factory=list)
    stops: list[StopRecord] = field(default_factory=list)
    notifications: list[tuple[int, str]] = field(default_factory=list)  # (sender pid, message)
    ready_at: list[float] = field(default_factory=list)  # wall clock of each start's READY=1
    on_stopped: list = field(default_factory=list)  # callables run after each stop, before the caller is answered
    on_sigterm: list = field(default_factory=list)  # callables run right after a stop's SIGTERM was sent
    main: subprocess.Popen | None = None
    unit: UnitFile | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cgroup = BLKIO / f"gpuaas-agent-ci-{uuid.uuid4().hex[:8]}"
        self.cgroup.mkdir()
        self.log = self.workdir / "agent.log"
        self._lock = threading.Lock()
        self._ready = threading.Condition()
        self._notify_path = self.workdir / "notify.sock"
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self._notify_path))
        self._notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._control_path = self.workdir / "control.sock"
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control.bind(str(self._control_path))
        self._control.listen(4)
        self._closing = False
        self._threads = [threading.Thread(target=self._serve_notify, name="sd-notify", daemon=True),
                         threading.Thread(target=self._serve_control, name="sd-control", daemon=True)]
        for thread in self._threads:
            thread.start()
        shims = self.shim_dir
        shims.mkdir(exist_ok=True)
        for tool in ("systemctl", "deb-systemd-invoke"):
            (shims / tool).write_text(SHIM.format(socket_path=str(self._control_path)))
            (shims / tool).chmod(0o755)

    @property
    def shim_dir(self) -> Path:
        return self.workdir / "shims"

    # -- what systemd does ------------------------------------------------------------------

    def throttle_writes(self, dev: str, bytes_per_s: int) -> None:
        """``dev`` is "major:minor"; 0 lifts the limit (cgroup v1 blkio)."""
        (self.cgroup / "blkio.throttle.write_bps_device").write_text(f"{dev} {bytes_per_s}\n")

    def _in_cgroup(self) -> None:  # preexec_fn: the child joins the unit's cgroup before it execs
        (self.cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def _env(self) -> dict[str, str]:
        return {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root"}

    def start(self) -> None:
        with self._lock:
            if self.main is not None and self.main.poll() is None:
                return
            self.unit = UnitFile.read()
            with open(self.log, "ab") as out:
                for argv in self.unit.exec_start_pre:
                    ignore = argv[0] == "-"
                    argv = argv[1:] if ignore else argv
                    done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self._env(), timeout=START_TIMEOUT_S, preexec_fn=self._in_cgroup,
                                          cwd="/")
                    if done.returncode != 0 and not ignore:
                        raise RuntimeError(f"ExecStartPre {argv} exited {done.returncode}; log {self.log}")
                with self._ready:
                    self.notifications.clear()
                self.main = subprocess.Popen(self.unit.exec_start, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, preexec_fn=self._in_cgroup, cwd="/",
                                             env={**self._env(), "NOTIFY_SOCKET": str(self._notify_path)})
            if self.unit.type != "notify":
                return
            deadline = time.monotonic() + START_TIMEOUT_S
            with self._ready:
                while not any(pid == self.main.pid and "READY=1" in msg.splitlines()
                              for pid, msg in self.notifications):
                    if self.main.poll() is not None:
                        raise RuntimeError(f"{self.unit.exec_start} exited {self.main.returncode} before READY=1")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no READY=1 within {START_TIMEOUT_S}s")
                    self._ready.wait(timeout=0.5)  # woken by each notification; the timeout re-checks the exit
            self.ready_at.append(time.time())

    def stop(self) -> StopRecord | None:
        with self._lock:
            proc = self.main
            if proc is None or proc.poll() is not None:
                self.main = None
                return None
            unit = self.unit or UnitFile.read()
            started = time.monotonic()
            if unit.kill_mode in ("mixed", "process"):
                proc.send_signal(signal.SIGTERM)
            else:
                self._signal_cgroup(signal.SIGTERM)
            for hook in self.on_sigterm:
                hook()
            timed_out = False
            try:
                proc.wait(timeout=unit.timeout_stop_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                self._signal_cgroup(signal.SIGKILL)
                proc.wait(timeout=30)
            seconds = time.monotonic() - started
            left = self._cgroup_procs()
            if unit.kill_mode != "process":
                self._signal_cgroup(signal.SIGKILL)  # the final SIGKILL of mixed/control-group
                # systemd's stop ends when the unit's cgroup is empty (bounded by TimeoutStopSec= again).
                deadline = time.monotonic() + unit.timeout_stop_s
                while (self.cgroup / "cgroup.procs").read_text().strip():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the unit's cgroup is not empty {unit.timeout_stop_s}s after SIGKILL")
                    time.sleep(0.05)  # poll step of the deadline wait above
            record = StopRecord(proc.returncode, seconds, timed_out, left, time.monotonic() - started)
            self.stops.append(record)
            self.main = None
            for hook in self.on_stopped:
                hook(record)
            return record

    def pids(self) -> list[int]:
        """The unit's processes now."""
        return [int(pid) for pid in (self.cgroup / "cgroup.procs").read_text().split()]

    def _cgroup_procs(self) -> list[str]:
        procs = []
        for pid in (self.cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                procs.append(f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}")
        return procs

    def _signal_cgroup(self, sig: int) -> None:
        for pid in (self.cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)

    # -- the shims' side ----------------------------------------------------------------------

    def _installed_version(self) -> str:
        done = subprocess.run([str(AGENT), "--version"], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, env=self._env(), cwd="/")
        return done.stdout.strip() if done.returncode == 0 else f"(none: exit {done.returncode})"

    def handle(self, tool: str, args: list[str]) -> int:
        """One systemd call of a maintainer script; returns the exit status systemctl would."""
        words = [a for a in args if not a.startswith("-")]
        self.calls.append(f"{tool} {' '.join(args)} version={self._installed_version()}")
        action, units = (words[0], words[1:]) if words else ("", [])
        if UNIT not in units:  # another unit of the package (the network baseline): recorded only
            return 0 if action != "is-enabled" else 1
        if action == "is-enabled":
            return 0 if self.enabled else 1
        if action == "is-active":
            return 0 if self.main is not None and self.main.poll() is None else 3
        if action == "stop":
            self.stop()
            return 0
        if action in ("start", "restart"):
            if tool == "deb-systemd-invoke" and not self.enabled:
                return 0  # the real deb-systemd-invoke starts nothing that is disabled
            if action == "restart":
                self.stop()
            self.start()
            return 0
        return 0  # daemon-reload: the unit file is read at each start anyway

    def _serve_control(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._control.accept()
            except OSError:
                return
            with conn:
                try:
                    request = json.loads(conn.makefile().readline())
                    rc = self.handle(request["tool"], request["args"])
                except Exception as exc:  # the maintainer script sees a failed systemctl; the test sees why
                    self.calls.append(f"error: {exc!r}")
                    rc = 1
                with contextlib.suppress(OSError):
                    conn.sendall(f"{rc}\n".encode())

    def _serve_notify(self) -> None:
        creds_size = socket.CMSG_SPACE(12)  # struct ucred: pid, uid, gid
        while not self._closing:
            try:
                data, ancillary, _, _ = self._notify.recvmsg(4096, creds_size)
            except OSError:
                return
            pid = 0
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = int.from_bytes(payload[:4], "little")
            with self._ready:
                self.notifications.append((pid, data.decode(errors="replace")))
                self._ready.notify_all()

    def close(self) -> None:
        """Stop the unit, then the sockets and the cgroup."""
        try:
            self.stop()
        finally:
            self._closing = True
            for sock in (self._control, self._notify):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            for thread in self._threads:
                thread.join(timeout=5)
            self._signal_cgroup(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while (self.cgroup / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.05)  # poll step: the killed processes leave the cgroup as they are reaped
            self.cgroup.rmdir()
