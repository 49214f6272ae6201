"""A real Redfish server for tests: sushy-tools' ``sushy-static`` serving the HGX-shaped mockup over TLS.

Shared by the BMC check's tests and the packaged-agent test (the .deb's venv reads it from a chroot, which
shares this machine's network). The server reads each mockup file per request, so a test may break a document
while it runs; it prints every request's headers, which proves what a client sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuaas_agent.config import BmcConfig
from gpuaas_agent.host.run import run
from lab.hgx_redfish_mockup import write_mockup
from tests.support.daemons import stop_pid
from tests.support.tiers import starts

SUSHY_STATIC = Path(sys.executable).parent / "sushy-static"
# sushy-static that also answers $expand=.($levels=N) from the documents it holds (DSP0266; the real HGX BMC does)
EXPANDING = [sys.executable, str(Path(__file__).with_name("redfish_expand.py"))]
PCI = {f"GPU_SXM_{n}": f"0000:{0x18 + 0x10 * (n - 1):02x}:00.0" for n in range(1, 9)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@starts()
class RedfishServer:
    """sushy-static on 127.0.0.1 with a throwaway self-signed certificate and a 0600 credentials file."""

    def __init__(self, tmp_path: Path, *, expand: bool = False) -> None:
        self.argv = EXPANDING if expand else [str(SUSHY_STATIC)]
        self.mockup = tmp_path / "mockup"
        self.log = tmp_path / "requests.log"
        tls = tmp_path / "tls"
        tls.mkdir()
        self.cert, self.key = tls / "cert.pem", tls / "key.pem"
        asyncio.run(run([
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(self.key), "-out", str(self.cert), "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ], timeout=30))
        self.creds = tmp_path / "bmc.json"
        self.creds.write_text(json.dumps({"username": "agent-ro", "password": "s3cret-pw"}))
        self.creds.chmod(0o600)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> None:
        self.port = _free_port()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self.argv, "-i", "127.0.0.1", "-p", str(self.port),
                                          "-m", str(self.mockup), "-c", str(self.cert), "-k", str(self.key)],
                                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                     "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 20
        while True:  # deadline-bounded wait until the server accepts connections
            assert self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "sushy-static did not listen within 20 s"
                time.sleep(0.05)  # poll step of the deadline wait above

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        stop_pid(self.proc)

    def config(self, **kw) -> BmcConfig:
        base = {"url": f"https://127.0.0.1:{self.port}", "credentials_file": self.creds, "ca_file": self.cert,
                "gpu_pci_addresses": PCI, "request_timeout_s": 3.0}
        return BmcConfig(**{**base, **kw})

    def requests_seen(self) -> str:
        return self.log.read_text() if self.log.exists() else ""




def started_server(tmp_path: Path) -> RedfishServer:
    """The HGX mockup written and served; the caller stops it."""
    server = RedfishServer(tmp_path)
    write_mockup(server.mockup)
    server.start()
    return server


@contextmanager
def editable_documents(server: RedfishServer) -> Iterator[RedfishServer]:
    """``server`` with ``server.edit(rel, change)``: ``change`` gets one served document (``<rel>/index.json``) as
    JSON and alters it in place; every document changed is put back as it was when the block ends."""
    saved: dict[Path, str] = {}

    def edit(rel: str, change: Callable[[dict], None]) -> None:
        path = server.mockup / rel / "index.json"
        saved.setdefault(path, path.read_text())
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))

    server.edit = edit  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        for path, text in saved.items():
            path.write_text(text)


@contextmanager
def serving_capture(tmp_path: Path, capture: Path) -> Iterator[RedfishServer]:
    """A recorded BMC capture (a Redfish-Mockup-Creator tree) served over TLS with ``$expand`` answered; stopped by
    PID when the block ends."""
    server = RedfishServer(tmp_path, expand=True)
    shutil.copytree(capture, server.mockup)
    server.start()
    try:
        yield server
    finally:
        server.stop()
