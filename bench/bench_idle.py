"""The idle daemon's footprint (docs/performance.md: < 50 MiB RSS, < 0.1 CPU-s per minute, a few messages a minute).

Starts what a host runs: a real ``nats-server -js``, a control plane that enrolls the node,
then ``python -m gpuaas_agent run`` with the production intervals (heartbeat 15 s, health
60 s, keepalive 10 s, /metrics on, uevent watch on) over the recorded H200 fixture host, lets
it settle, and measures it over a window while nothing is asked of it. The package's bytecode is compiled first
as the installer compiles it (:func:`compile_package`): an installed daemon never compiles its modules.

- CPU seconds per minute from ``/proc/<pid>/stat`` (utime + stime; the reaped children's
  cutime + cstime shown apart: health checks that run ``ip``/``iptables`` count there);
- memory: ``VmRSS`` (with its ``RssAnon``/``RssFile`` split) and ``Pss`` (``smaps_rollup``) at the end of the
  window, and whether the daemon maps libvirt (``/proc/<pid>/maps``: ``libvirt.so``, ``libvirtmod``);
- wakeups: context switches of every thread (``/proc/<pid>/task/*/status``) per minute;
- control-plane traffic: the agent connection's in/out messages per minute (``/connz``);
- device events the daemon rediscovered on in the window (its own ``gpuaas_agent_uevents_total``):
  on a shared lab machine other work (loop devices, taps, netns) makes them, and each burst is a
  rediscovery; ``--no-uevents`` measures without the watch.

In the same run and the same window, the baselines: a bare interpreter sleeping
(``python -c 'import time; time.sleep(N)'``) and the daemon module imported and sleeping
(``import gpuaas_agent.daemon``: the import-only footprint). Ratios are against those.

libvirt is the test driver over a node with no domain (``--libvirt-uri``; a file in the work directory): an idle
slice host's libvirtd holds none. ``--libvirt-uri test:///default`` keeps the driver's own ``test`` domain, which
makes the timer reconcile (every 300 s: ``--settle 310`` includes one) load libvirt-python as any domain would.

``--fetch-timeout S`` runs the daemon with the worker's empty-pull expiry set to S seconds
(bench only, through a wrapper that patches the settings the daemon builds; the worker's
code is not changed) to split the idle CPU between the pull loop and everything else.

Run as root from the repo: ``.venv/bin/python bench/bench_idle.py [--window 150] [--settle 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuaas_agent.control.enroll import EnrollIdentity, enroll
from gpuaas_agent.control.transport import TransportSecurity
from lab.fixture_hosts import fixture_host
from tests.control.conftest import NatsServer, free_port
from tests.support.controlplane import ControlPlane

CLK_TCK = os.sysconf("SC_CLK_TCK")
IDENTITY = EnrollIdentity(machine_id="1221a371a78ea21b24acbc2cf895b074", hostname="j22u05", agent_version="0.1.0")
# The daemon with the pull expiry patched (bench only): WorkerSettings as the daemon builds it, plus fetch_timeout_s.
PATCHED_RUN = """
import functools, sys
import gpuaas_agent.daemon as d
d.WorkerSettings = functools.partial(d.WorkerSettings, fetch_timeout_s=float(sys.argv[1]))
from gpuaas_agent.cli import main
sys.exit(main(["run", "--config", sys.argv[2]]))
"""


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(utime + stime, cutime + cstime) of ``pid`` in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "Threads:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0])
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["Pss"] = int(line.split()[1])
    return out


def maps_libvirt(pid: int) -> bool:
    """Whether the process maps libvirt-python's extension or libvirt's library."""
    return any("libvirt.so" in line or "libvirtmod" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def switches(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:  # a thread that ended between listing and reading
            continue
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                total += int(line.split()[1])
    return total


def uevents_seen(metrics_port: int) -> float:
    """``gpuaas_agent_uevents_total`` from the daemon's own /metrics (device events it rediscovered on)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("gpuaas_agent_uevents_total "):
                return float(line.split()[1])
    return 0.0


def agent_messages(server: NatsServer, name: str) -> tuple[int, int]:
    """(in_msgs, out_msgs) of the connection named ``name`` as the server counts them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/connz?limit=1024", timeout=5) as resp:
        conns = json.load(resp)["connections"] or []
    for conn in conns:
        if conn.get("name") == name:
            return conn["in_msgs"], conn["out_msgs"]
    return 0, 0


class Probe:
    """Counters of one process at the start of the window; :meth:`finish` gives the per-minute rates."""

    def __init__(self, label: str, pid: int) -> None:
        self.label, self.pid = label, pid
        self.t0 = time.monotonic()
        self.cpu0, self.child0 = cpu_ticks(pid)
        self.sw0 = switches(pid)

    def finish(self) -> dict:
        took = time.monotonic() - self.t0
        cpu, child = cpu_ticks(self.pid)
        per_min = 60.0 / took
        mem = memory_kib(self.pid)
        return {"label": self.label, "window_s": round(took, 1),
                "cpu_s_per_min": round((cpu - self.cpu0) / CLK_TCK * per_min, 4),
                "children_cpu_s_per_min": round((child - self.child0) / CLK_TCK * per_min, 4),
                "wakeups_per_min": round((switches(self.pid) - self.sw0) * per_min, 1),
                "rss_mib": round(mem["VmRSS"] / 1024, 1), "pss_mib": round(mem.get("Pss", 0) / 1024, 1),
                "rss_anon_mib": round(mem["RssAnon"] / 1024, 1), "rss_file_mib": round(mem["RssFile"] / 1024, 1),
                "threads": mem["Threads"], "maps_libvirt": maps_libvirt(self.pid)}


async def _enrolled_config(server: NatsServer, work: Path, metrics_port: int, uevent_watch: bool,
                           libvirt_uri: str) -> tuple[str, Path]:
    plane = await ControlPlane.connect(server.url)
    try:
        await plane.create_streams()
        await plane.serve_enrollment()
        token = work / "token"
        token.write_text(plane.issue_token())
        record = await enroll(server.url, token, work / "state", IDENTITY, timeout=10, security=TransportSecurity(insecure=True))
    finally:
        await plane.close()
    config = {"state_dir": str(work / "state"), "host_root": str(fixture_host("h200-slice-after-transition")),
              "nats_url": server.url, "insecure": True, "metrics_listen": f"127.0.0.1:{metrics_port}", "uevent_watch": uevent_watch,
              "slice": {"libvirt_uri": libvirt_uri}}
    path = work / "agent.json"
    path.write_text(json.dumps(config))
    return record.node_id, path


def timer_reconciles(log: Path) -> dict[str, int]:
    """The daemon's timer reconciles since its start, by outcome (from its log): the window's libvirt use includes
    the reconcile's listing only once one has run (every 300 s)."""
    counts = {"reconcile_done": 0, "reconcile_failed": 0}
    for line in log.read_text().splitlines():
        for event in counts:
            if event in line:
                counts[event] += 1
    return counts


def compile_package(env: dict[str, str]) -> int:
    """The package's bytecode, as the installed agent has it (packaging/install_venv.py: ``compileall
    --invalidation-mode checked-hash``; the unit's /opt is read-only, so the daemon never compiles). A checkout run
    with ``PYTHONDONTWRITEBYTECODE=1`` (this dev VM's environment) has no ``.pyc`` of its own modules, and every
    daemon start compiled ~140 modules from source: ~2.3 MiB of ``RssAnon`` the compiler leaves in the allocator,
    which no installed host pays. Written to the checkout's ``__pycache__`` (ignored by git); a checked-hash
    ``.pyc`` is never trusted over a changed source. Returns how many ``.pyc`` files the package then has."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash",
                    str(REPO / "gpuaas_agent")], env=env, check=True, timeout=300, stdout=subprocess.DEVNULL)
    return sum(1 for _ in (REPO / "gpuaas_agent").rglob("__pycache__/*.cpython-*.pyc"))


def _wait_ready(proc: subprocess.Popen, log: Path, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if "agent_ready" in log.read_text():
            return
        time.sleep(0.2)  # poll interval of a readiness wait with a deadline
    raise SystemExit(f"the agent was not ready within {deadline_s:g}s:\n{log.read_text()[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=150.0, help="seconds measured (default 150)")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after READY before measuring")
    parser.add_argument("--fetch-timeout", type=float, default=None,
                        help="run the daemon with this empty-pull expiry (bench-only patch); default: as shipped")
    parser.add_argument("--no-uevents", action="store_true",
                        help="uevent_watch off: splits out the rediscoveries that other activity on the host triggers")
    parser.add_argument("--libvirt-uri", default=None,
                        help="the daemon's libvirt (default: the test driver over a node with no domain)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    nats_bin = shutil.which("nats-server")
    if nats_bin is None:
        raise SystemExit("nats-server is not installed")
    work = Path(tempfile.mkdtemp(prefix="gpuaas-bench-idle-", dir="/var/tmp"))
    server = NatsServer(nats_bin, work / "js", work / "nats.log")
    procs: list[subprocess.Popen] = []
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONPATH"] = str(REPO)
    compiled = compile_package(env)
    try:
        server.start()
        metrics_port = free_port()
        libvirt_uri = args.libvirt_uri
        if libvirt_uri is None:
            (work / "no-domains.xml").write_text("<node>\n</node>\n")
            libvirt_uri = f"test://{work / 'no-domains.xml'}"
        node_id, config = asyncio.run(_enrolled_config(server, work, metrics_port, not args.no_uevents, libvirt_uri))
        log = work / "agent.log"
        if args.fetch_timeout is None:
            argv = [sys.executable, "-m", "gpuaas_agent", "run", "--config", str(config)]
        else:
            argv = [sys.executable, "-c", PATCHED_RUN, str(args.fetch_timeout), str(config)]
        with log.open("ab") as err:
            agent = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=err)
        procs.append(agent)
        _wait_ready(agent, log)
        sleep_for = str(args.settle + args.window + 60)
        bare = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({sleep_for})"], env=env)
        imported = subprocess.Popen([sys.executable, "-c", f"import gpuaas_agent.daemon, time; time.sleep({sleep_for})"],
                                    cwd=REPO, env=env)
        procs += [bare, imported]
        time.sleep(args.settle)  # let the first health round, heartbeat and pull settle: the bench's own timing
        name = f"gpuaas-agent-{node_id}"
        msgs0, uevents0 = agent_messages(server, name), uevents_seen(metrics_port)
        probes = [Probe("daemon (idle, connected)", agent.pid), Probe("import gpuaas_agent.daemon; sleep", imported.pid),
                  Probe("bare python; sleep", bare.pid)]
        time.sleep(args.window)  # the measured window itself
        rows = [p.finish() for p in probes]
        msgs1, uevents1 = agent_messages(server, name), uevents_seen(metrics_port)
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited during the window:\n{log.read_text()[-3000:]}")
        reconciles = timer_reconciles(log)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    daemon, imported_row, bare_row = rows
    per_min = 60.0 / daemon["window_s"]
    report = {
        "fetch_timeout_s": args.fetch_timeout, "libvirt_uri": libvirt_uri, "package_pyc_files": compiled, "timer_reconciles": reconciles, "window_s": daemon["window_s"], "settle_s": args.settle,
        "processes": rows,
        "daemon_msgs_in_per_min": round((msgs1[0] - msgs0[0]) * per_min, 1),
        "daemon_msgs_out_per_min": round((msgs1[1] - msgs0[1]) * per_min, 1),
        "uevents_in_window": uevents1 - uevents0, "uevent_watch": not args.no_uevents,
        "rss_vs_bare": round(daemon["rss_mib"] / bare_row["rss_mib"], 2),
        "rss_vs_import_only": round(daemon["rss_mib"] / imported_row["rss_mib"], 2),
        "targets": {"cpu_s_per_min": 0.1, "rss_mib": 50},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"window {daemon['window_s']} s after {args.settle:g} s settle; fetch expiry "
          f"{'as shipped' if args.fetch_timeout is None else f'{args.fetch_timeout:g} s (patched)'}")
    print(f"{'process':36} {'CPU-s/min':>9} {'child':>7} {'wakeups/min':>11} {'RSS MiB':>8} {'anon':>6} {'file':>6} "
          f"{'PSS MiB':>8} {'thr':>4} libvirt")
    for r in rows:
        print(f"{r['label']:36} {r['cpu_s_per_min']:9.4f} {r['children_cpu_s_per_min']:7.4f} "
              f"{r['wakeups_per_min']:11.1f} {r['rss_mib']:8.1f} {r['rss_anon_mib']:6.1f} {r['rss_file_mib']:6.1f} "
              f"{r['pss_mib']:8.1f} {r['threads']:4d} {'mapped' if r['maps_libvirt'] else 'no'}")
    print(f"package bytecode: {compiled} .pyc files (compiled checked-hash before the start, as installed)")
    print(f"libvirt: {libvirt_uri}; timer reconciles since start: {reconciles['reconcile_done']} done, "
          f"{reconciles['reconcile_failed']} failed")
    print(f"daemon NATS messages/min: {report['daemon_msgs_in_per_min']} in (published by the agent), "
          f"{report['daemon_msgs_out_per_min']} out (delivered to it)")
    print(f"uevents the daemon rediscovered on during the window: {report['uevents_in_window']:g}"
          f"{'' if report['uevent_watch'] else ' (uevent_watch off)'}")
    print(f"RSS ratio: {report['rss_vs_bare']}x bare interpreter, {report['rss_vs_import_only']}x import-only")
    print(f"targets: < 0.1 CPU-s/min ({'met' if daemon['cpu_s_per_min'] + daemon['children_cpu_s_per_min'] < 0.1 else 'NOT met'}), "
          f"< 50 MiB RSS ({'met' if daemon['rss_mib'] < 50 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
