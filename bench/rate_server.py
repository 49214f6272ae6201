"""The HTTPS image server of bench_stream.py: serves one directory at a fixed rate, spending little CPU.

Why: the benchmark's ratio must measure the agent, not its test server. The server runs on the
same (small) machine as the agent, so whatever CPU it burns is taken from the stream being
timed, a cost no real image server puts on the host. Two kinds:

- ``nginx`` (default when ``nginx``, ``ip`` and ``tc`` exist): nginx in its own network namespace,
  reached over a veth pair (MTU 65000, like loopback's 64 KiB), serving unthrottled with TLS
  (``sendfile off``: without kernel TLS nginx encrypts in user space anyway). The fixed rate is the
  kernel's: a ``tbf`` qdisc on the namespace's end of the veth, so pacing costs no process CPU
  and does not drift when the server is starved (a rate kept by ``sleep`` in the server does).
  nginx's own ``limit_rate`` is not used: it counts in whole seconds (a 512 MiB file at 300 MiB/s
  arrived at ~600 MiB/s) and, with large output buffers, sleeps after each send without
  subtracting the send's own time (300 MiB/s delivered ~230 MiB/s, less when the CPU is busy).
  Install: ``apt-get install nginx-light`` (Debian 12 / Ubuntu 24.04; the package's service is not
  needed: ``systemctl disable --now nginx``). Needs root (netns, veth, tc).
- ``python``: the former server (``http.server`` + ``ssl`` on 127.0.0.1, token bucket by ``sleep``),
  the fallback when nginx is missing, and for A/B runs (``--server python``).

The server's CPU is read from ``/proc/<pid>/stat`` (user + system of all its threads); kernel
work done in softirq context on its behalf (veth transmit, the qdisc's timer) is not in it.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.image_server import SERVE_TLS, wait_for_port

# A HTTPS server that sends every file at a fixed rate (token bucket, 256 KiB sends); honours nothing else.
PYTHON_SERVER = r"""
import http.server, os, ssl, sys, time
root, cert, key, portfile, rate = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        path = os.path.join(root, os.path.basename(self.path))
        size = os.path.getsize(path)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        start, sent = time.monotonic(), 0
        with open(path, "rb") as fh:
            while True:
                block = fh.read(256 << 10)
                if not block:
                    break
                self.wfile.write(block)
                sent += len(block)
                ahead = sent / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)

""" + SERVE_TLS

NGINX_CONF = """\
user root;
worker_processes 1;
master_process off;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/ngx-body; proxy_temp_path {tmp}/ngx-proxy; fastcgi_temp_path {tmp}/ngx-fcgi;
    uwsgi_temp_path {tmp}/ngx-uwsgi; scgi_temp_path {tmp}/ngx-scgi;
    sendfile off;
    server {{
        listen {addr}:443 ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        root {root};
        location / {{ }}
    }}
}}
"""

CLK_TCK = os.sysconf("SC_CLK_TCK")


def native_missing() -> str | None:
    """Why the nginx server cannot run here, or None."""
    missing = [tool for tool in ("nginx", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install nginx-light iproute2"
    if os.geteuid() != 0:
        return "not root (netns, veth, tc)"
    return None


def _make_cert(tmp: Path, ip: str) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={ip}",
                    "-addext", f"subjectAltName=IP:{ip}"], check=True, capture_output=True, timeout=30)
    return cert, key


def _sh(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _wait_tcp(ip: str, port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the {what} server exited ({proc.returncode})")
        try:
            socket.create_connection((ip, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the {what} server did not start") from None
            time.sleep(0.05)


class RateServer:
    """``with RateServer(kind, root, tmp, rate_bytes) as srv``: ``srv.base`` (https URL), ``srv.cert``, ``srv.cpu()``."""

    def __init__(self, kind: str, root: Path, tmp: Path, rate_bytes: float, *, cpus: str | None = None) -> None:
        self.kind, self.root, self.tmp, self.rate_bytes, self.cpus = kind, root, tmp, rate_bytes, cpus
        self.proc: subprocess.Popen | None = None
        self.netns: str | None = None
        self.host_if: str | None = None

    def _pin(self, argv: list[str]) -> list[str]:
        return ["taskset", "-c", self.cpus, *argv] if self.cpus else argv

    def __enter__(self) -> RateServer:
        try:
            (self._start_nginx if self.kind == "nginx" else self._start_python)()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start_python(self) -> None:
        self.cert, key = _make_cert(self.tmp, "127.0.0.1")
        portfile = self.tmp / "port"
        rate = self.rate_bytes if self.rate_bytes > 0 else 1e15
        self.proc = subprocess.Popen(self._pin([sys.executable, "-c", PYTHON_SERVER, str(self.root), str(self.cert),
                                                str(key), str(portfile), str(rate)]))
        self.base = f"https://127.0.0.1:{wait_for_port(self.proc, portfile, timeout_s=10)}"
        self.describe = (f"python http.server + ssl on 127.0.0.1, rate by sleep "
                         f"({self.rate_bytes / 2**20:g} MiB/s)" if self.rate_bytes > 0 else
                         "python http.server + ssl on 127.0.0.1, unthrottled")

    def _start_nginx(self) -> None:
        pid = os.getpid()
        # 198.18.0.0/15 is set aside for benchmarks (RFC 2544): no lab or host route uses it.
        net = ipaddress.ip_network(f"198.18.{(pid >> 6) & 0xFF}.{(pid & 0x3F) << 2}/30")
        host_ip, srv_ip = str(net[1]), str(net[2])
        self.netns, self.host_if, peer = f"gpbs-{pid}", f"gpbs{pid}h", f"gpbs{pid}s"
        _sh(["ip", "netns", "add", self.netns])
        _sh(["ip", "link", "add", self.host_if, "mtu", "65000", "type", "veth", "peer", "name", peer, "mtu", "65000",
             "netns", self.netns])
        _sh(["ip", "addr", "add", f"{host_ip}/30", "dev", self.host_if])
        _sh(["ip", "link", "set", self.host_if, "up"])
        ns = ["ip", "-n", self.netns]
        _sh([*ns, "addr", "add", f"{srv_ip}/30", "dev", peer])
        _sh([*ns, "link", "set", peer, "up"])
        _sh([*ns, "link", "set", "lo", "up"])
        if self.rate_bytes > 0:
            # burst 4 MiB: ahead of the schedule by < 1% of a 512 MiB image; latency bounds the queue.
            _sh([*ns[:1], "netns", "exec", self.netns, "tc", "qdisc", "add", "dev", peer, "root", "tbf",
                 "rate", f"{int(self.rate_bytes * 8)}bit", "burst", str(4 << 20), "latency", "20ms"])
        self.cert, key = _make_cert(self.tmp, srv_ip)
        conf = self.tmp / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=self.tmp, addr=srv_ip, cert=self.cert, key=key, root=self.root))
        self.proc = subprocess.Popen(self._pin(["ip", "netns", "exec", self.netns, "nginx", "-e",
                                                str(self.tmp / "nginx-error.log"), "-p", str(self.tmp), "-c",
                                                str(conf)]))
        _wait_tcp(srv_ip, 443, self.proc, "nginx")
        self.base = f"https://{srv_ip}"
        self.describe = (f"nginx (one process, TLS, sendfile off) in a netns over veth, rate by tbf "
                         f"({self.rate_bytes / 2**20:g} MiB/s)" if self.rate_bytes > 0 else
                         "nginx (one process, TLS, sendfile off) in a netns over veth, unthrottled")

    def cpu(self) -> float:
        """User + system CPU seconds of the server process (all its threads) so far."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.host_if is not None:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        if self.netns is not None:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)


def machine_cpu() -> tuple[float, float]:
    """(busy, steal): CPU seconds all CPUs of this VM ran anything (every process, irq and softirq included),
    and the seconds the hypervisor gave them to someone else; so far."""
    with open("/proc/stat") as fh:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fh.readline().split()[1:9])
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK
