"""Fleet scale of the control channel: N simulated nodes against one real ``nats-server -js``.

Each simulated node is the agent's real code on its own NATS connection: ``connect_nats``
(per-node inbox, backoff with full jitter), ``TaskWorker`` (consumer created on the
filtered API, pull expiry ``--pull-expiry``), the operator ``Reporter`` heartbeat loop,
and a real ``StateStore`` (SQLite on /dev/shm, one per process). Many nodes per process
(asyncio), ``--procs`` processes. The control plane is ``tests/support/controlplane.py``.

Per N it reports: consumer creation (all nodes bound, and per-node bind p50/p99),
nats-server VmRSS and CPU (cores, from /proc/<pid>/stat) and messages/s while idle, a
steady trickle of tasks (publish→claim p50/p99), one task to every node at once (drain
time, publish→claim p50/p99), and a server restart (time until all N reconnected, and until
one task per node published at restart is claimed). "Claim" is the handler starting.

``--servers 3``: a JetStream cluster of three servers on loopback (routes on 127.0.0.1 ports, one
store dir each, each stopped by its PID); ``--replicas 3`` makes the task and result streams R3,
``--consumer-memory`` the node consumers R1 + memory (docs/performance.md "Fleet layout"). Then it also reports
the Raft groups (``/jsz?raft=1``, each asset at its leader), leader elections (the servers' logs)
and each member's ``/healthz?js-enabled-only=true`` and ``/healthz``; the restart stops every member
(``--restart-one``: only the first). The burst's CPU is split: servers, the simulated nodes' event
loops and other threads, the control plane; ``--profile PATH`` cProfiles the first simulated
process's event loop during the burst only.

``--node-impl wire`` keeps the server traffic of a claim (the worker's own consumer, a 30 s pull, the
delivery, a PubAck'd result, an ack) and drops the agent's Python around it (journal, store thread,
heartbeats): the server's capacity, apart from thousands of simulated agents sharing its cores.
``--node-impl protocol`` sends the same traffic from nodes that speak the NATS protocol themselves
(``bench/protocol_node.py``, asyncio.Protocol callbacks, no nats.py task or future per message; the
consumer still bound by ``TaskWorker._bind``): a fraction of the client CPU, so on a small machine the
burst measures the server rather than the simulator.

``BENCH_DEBUG=1`` prints each trickle task and, when a burst is not drained after 8 s, each unclaimed
task's consumer as the server sees it (waiting pulls, pending, delivered); ``BENCH_TRACE=PATH`` writes
each wire/protocol node's pulls, statuses, messages and client timeouts to ``PATH.<pid>.json``.

Layouts (``--layout``): ``shared`` — one work-queue stream ``gpuaas.node.*.task.>`` for
every node; ``partitioned`` — streams of ``--per-stream`` nodes each
(``ControlPlane.create_task_partitions``); ``per-node`` — the supported layout: each node's own task and result
stream (``control/streams.py``), ``--replicas`` (1: R1, placed by the meta leader), file storage unless
``--stream-memory``, created by the plane with ``--create-concurrency`` in flight (each create retried).

``--accounts per-node,single`` (each in turn per N, in one run): operator mode with a full resolver whose directory
on every member holds every account JWT before the servers start; ``per-node``: an account per node
(``control/accounts.py``, the node's pulls under ``NODE_JS_API_PREFIX``), ``single``: every node a user of the plane's
account with the same permissions. Each node logs in with its own user JWT (the nats.py bind with its creds file, the
protocol node signing the server's nonce) and pulls on the member its bind went to. Per phase the CPU seconds of the
servers, the simulated nodes' processes and the plane are printed (``bind_*``, ``burst_*``, ``restart_*``: where a
2-core machine's time went), and server RSS per node less the servers' RSS before any stream (``server_kib_per_node_net``).
``--nats-server PATH``: the server binary (``.venv/bin/nats-server``, the pinned release). Prints one JSON line per N
and login mode and a table; never asserts. Needs root only for a large ``ulimit -n``.

    .venv/bin/python bench/bench_fleet.py --nodes 100,500,1000 --layout partitioned
    .venv/bin/python bench/bench_fleet.py --nodes 1000 --servers 3 --layout per-node --accounts per-node,single \
        --node-impl protocol --pull-heartbeat 5 --nats-server .venv/bin/nats-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import queue
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import nats.errors
import nats.js.errors
import nkeys
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from bench.protocol_node import ProtocolNode
from gpuaas_agent.compat import UTC
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.tasks import ResultStatus, TaskResult, TaskType
from gpuaas_agent.control.accounts import NODE_JS_API_PREFIX
from gpuaas_agent.control.connection import Backoff, NatsConnectError, connect_nats
from gpuaas_agent.control.enroll import node_inbox_prefix
from gpuaas_agent.control.permissions import node_permissions
from gpuaas_agent.control.pull import TaskPull, pull_status
from gpuaas_agent.control.streams import node_result_stream_config, node_task_stream_config, task_stream_name
from gpuaas_agent.control.taskpolicy import WorkerSettings
from gpuaas_agent.control.transport import TransportSecurity
from gpuaas_agent.control.worker import ConsumerMissing, TaskWorker
from gpuaas_agent.operator.health import CheckThreads, HealthSettings
from gpuaas_agent.operator.reporter import Reporter, ReporterSettings
from gpuaas_agent.state.store import StateStore
from tests.natsauth.natsjwt import Key
from tests.support.controlplane import RESULT_STREAM, ControlPlane

TASK = TaskType.topology_discover
CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVER_BINARY: str | None = None  # --nats-server; None: the nats-server on PATH (Debian's)


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the server -------------------------------------------------------------------------


class Server:
    """One nats-server: standalone (``-js``) or, with ``cluster``, one member of a JetStream cluster."""

    def __init__(self, root: Path, *, name: str = "s1") -> None:
        self.root, self.name, self.port, self.http = root, name, free_port(), free_port()
        self.route_port = free_port()
        self.store = root / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.routes: list[int] | None = None  # the cluster's route ports (ours included); None: standalone
        self.auth_conf: str | None = None  # operator mode: the operator, system account and full resolver lines
        self.killed = 0  # stops that SIGTERM did not end in time

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def resolver_dir(self) -> Path:
        """The full resolver's directory (operator mode): each account's JWT, pushed there before the first login."""
        return self.root / "jwt"

    def argv(self) -> list[str]:
        binary = SERVER_BINARY or shutil.which("nats-server") or "nats-server"
        if self.routes is None and self.auth_conf is None:
            return [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.http), "-sd", str(self.store)]
        conf = self.root / "nats.conf"
        text = (f'server_name: "{self.name}"\nlisten: "127.0.0.1:{self.port}"\nhttp: "127.0.0.1:{self.http}"\n'
                f'jetstream {{ store_dir: "{self.store}", max_memory_store: 4GB, max_file_store: 20GB }}\n')
        if self.routes is not None:
            routes = ", ".join(f'"nats-route://127.0.0.1:{r}"' for r in self.routes if r != self.route_port)
            text += f'cluster {{ name: "bench", listen: "127.0.0.1:{self.route_port}", routes: [{routes}] }}\n'
        if self.auth_conf is not None:
            text += self.auth_conf
        if os.environ.get("BENCH_SERVER_DEBUG"):
            text += "debug: true\n"
        conf.write_text(text)
        return [binary, "-c", str(conf)]

    def spawn(self) -> None:
        log = (self.root / "nats.log").open("ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def healthz(self, query: str = "") -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/healthz{query}", timeout=5) as resp:
                return resp.status, resp.read().decode().strip()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode().strip()
        except OSError as exc:
            return 0, repr(exc)

    def wait_ready(self, deadline_s: float = 120) -> float:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server {self.name} exited: {(self.root / 'nats.log').read_text()[-2000:]}")
            if self.healthz()[0] == 200:
                return time.time()
            time.sleep(0.05)  # readiness poll
        raise RuntimeError(f"nats-server {self.name} not ready: {self.healthz()}")

    def start(self) -> float:
        self.spawn()
        return self.wait_ready()

    def stop(self, timeout_s: float = 300.0) -> None:
        """SIGTERM and wait (a member with thousands of file streams may take minutes to shut down); SIGKILL past
        ``timeout_s``, noted in ``killed``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=60)
                self.killed += 1
        self.proc = None

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}{path}", timeout=30) as resp:
            return json.load(resp)

    def varz(self) -> dict:
        return self.get("/varz")

    def log_count(self, needle: str) -> int:
        return (self.root / "nats.log").read_text(errors="replace").count(needle)


class Servers:
    """One standalone server, or a JetStream cluster of ``count`` on loopback (routes on 127.0.0.1 ports,
    one store dir each, each stopped by its PID). CPU, memory and message rates are the members' sum."""

    def __init__(self, root: Path, count: int) -> None:
        self.members = [Server(root / f"s{i + 1}", name=f"s{i + 1}") for i in range(count)]
        if count > 1:
            routes = [m.route_port for m in self.members]
            for m in self.members:
                m.routes = routes

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def start(self) -> float:
        for m in self.members:
            m.spawn()
        up = max(m.wait_ready() for m in self.members)
        if len(self.members) > 1:  # a meta leader is elected and every member knows it
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                metas = [m.get("/jsz").get("meta_cluster") or {} for m in self.members]
                if all(meta.get("leader") for meta in metas) and all(m.healthz()[0] == 200 for m in self.members):
                    return time.time()
                time.sleep(0.1)  # readiness poll
            raise RuntimeError("cluster has no meta leader")
        return up

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def cpu_s(self) -> float:
        return sum(m.cpu_s() for m in self.members)

    def rss_mib(self) -> float:
        return sum(m.rss_mib() for m in self.members)

    def varz(self) -> dict:
        rows = [m.varz() for m in self.members]
        return {"in_msgs": sum(r["in_msgs"] for r in rows), "connections": [r["connections"] for r in rows],
                "slow_consumers": sum(r.get("slow_consumers", 0) for r in rows)}


class FleetAuth:
    """Operator-mode logins for ``--accounts``: ``per-node`` — an account per node (``control/accounts.py``, signed by
    ``tests/natsauth/fleet.py``: no JetStream, its own task stream's consumer and its own subjects imported under
    ``NODE_JS_API_PREFIX``), its user with the node's permissions; ``single`` — one user per node, with the same
    permissions, in the control plane's account (``$JS.API``). Both: operator JWT, system account, a full resolver.

    Every account JWT is written into each member's resolver directory before the servers start (what ``nsc push``
    leaves there; the plane signs a node's account at enrollment, not at its login): a login finds its account on disk.
    """

    def __init__(self, mode: str, nodes: list[str]) -> None:
        from tests.natsauth.fleet import FleetOperator
        from tests.natsauth.natsjwt import encode_jwt

        self.mode = mode
        self.op = FleetOperator()
        self.prefix = NODE_JS_API_PREFIX if mode == "per-node" else "$JS.API"
        self.logins: dict[str, tuple[str, str]] = {}  # node id -> (user JWT, user seed)
        self.jwts: dict[str, str] = {}  # account public key -> account JWT (the resolver's files)
        t = time.monotonic()
        for node_id in nodes:
            user = Key.new(nkeys.PREFIX_BYTE_USER)
            if mode == "per-node":
                account = self.op.node_account(node_id, task_stream_name(node_id))
                self.jwts[account.public] = self.op.node_jwt(node_id)
                token = self.op.node_user_jwt(node_id, user.public)
            else:
                perms = node_permissions(node_id, self.prefix)
                token = encode_jwt(self.op.account, user.public, node_id, {
                    "type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1,
                    "pub": {"allow": perms["publish"]}, "sub": {"allow": perms["subscribe"]},
                    "resp": {"max": 1, "ttl": 0}})
            self.logins[node_id] = (token, user.seed.decode())
        self.op.nodes.clear()  # node accounts come from the resolver's directory, not the config's preload
        self.sign_s = round(time.monotonic() - t, 2)
        self.plane_creds, _ = self.op.user("bench-control-plane")

    def install(self, servers: Servers, root: Path) -> Path:
        """Each member's config and resolver directory; returns the plane's creds file."""
        for member in servers.members:
            member.resolver_dir.mkdir(parents=True, exist_ok=True)
            for public, token in self.jwts.items():
                (member.resolver_dir / f"{public}.jwt").write_text(token)
            member.auth_conf = self.op.resolver_config(member.resolver_dir)
        creds = root / "plane.creds"
        creds.write_text(self.plane_creds)
        creds.chmod(0o600)
        return creds


def server_version() -> str:
    binary = SERVER_BINARY or shutil.which("nats-server") or "nats-server"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    return out.strip().rsplit("v", 1)[-1]


def raft_inventory(servers: Servers) -> dict:
    """Raft groups seen by the cluster: streams and consumers by replica count (from one member's /jsz)."""
    streams = consumers = 0
    by_replicas: dict[str, int] = {}
    leaders: dict[str, int] = {}
    for m in servers.members:
        jsz = m.get("/jsz?accounts=1&streams=1&consumers=1&config=1&raft=1")
        for account in jsz.get("account_details") or []:
            for stream in account.get("stream_detail") or []:
                cluster = stream.get("cluster") or {}
                if cluster.get("leader") == m.name:  # count each asset once: at its leader
                    streams += 1
                    r = (stream.get("config") or {}).get("num_replicas", 1)
                    by_replicas[f"stream_R{r}"] = by_replicas.get(f"stream_R{r}", 0) + 1
                    leaders[m.name] = leaders.get(m.name, 0) + 1
                for consumer in stream.get("consumer_detail") or []:
                    if (consumer.get("cluster") or {}).get("leader") != m.name:
                        continue
                    consumers += 1
                    config = consumer.get("config") or {}
                    r = config.get("num_replicas") or (stream.get("config") or {}).get("num_replicas", 1)
                    kind = "mem" if config.get("mem_storage") else "file"
                    by_replicas[f"consumer_R{r}_{kind}"] = by_replicas.get(f"consumer_R{r}_{kind}", 0) + 1
    replicated = sum(v for k, v in by_replicas.items() if not k.split("_")[1] == "R1")
    return {"streams": streams, "consumers": consumers, "raft_groups": dict(sorted(by_replicas.items())),
            "replicated_raft_groups": replicated, "stream_leaders_per_server": leaders}


def cluster_health(servers: Servers) -> dict:
    out = {}
    for m in servers.members:
        out[m.name] = {"js_enabled_only": m.healthz("?js-enabled-only=true")[0], "full": m.healthz()[0]}
    return out


def elections(servers: Servers) -> dict:
    """Leader elections logged so far (nats-server INFO lines), summed over the members."""
    return {"meta": sum(m.log_count("JetStream cluster new metadata leader") for m in servers.members),
            "stream": sum(m.log_count("JetStream cluster new stream leader") for m in servers.members),
            "consumer": sum(m.log_count("JetStream cluster new consumer leader") for m in servers.members)}


# -- simulated nodes (child processes) --------------------------------------------------


def child_main(urls: list[str], nodes: list[str], root: str, events, stop, args: dict) -> None:
    logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "ERROR"))  # WARNING: the agents' warnings too
    if args.get("profile"):
        # The burst only: the parent sends SIGUSR1 before it publishes and SIGUSR2 once all claimed.
        # cProfile sees the event loop's thread (the store thread's SQLite time is in thread_cpu below).
        import cProfile
        import signal

        profiler = cProfile.Profile()

        def done(*_):
            profiler.disable()
            profiler.dump_stats(args["profile"])

        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
        signal.signal(signal.SIGUSR2, done)
    asyncio.run(_child(urls, nodes, Path(root), events, stop, args))


def _trace_agents() -> None:
    """BENCH_TRACE in agent mode: each task message's arrival on a node's connection, the worker's kicks and
    the start of its processing, per node (a bench probe around nats.py and the worker, not agent code)."""
    import nats.aio.client as nats_client

    original_process_msg = nats_client.Client._process_msg
    original_process, original_kick = TaskWorker._process, TaskWorker.kick

    async def process_msg(self, sid, subject, reply, data, headers):
        if reply and b'"task_id"' in data:
            TRACE.setdefault(self.options.get("name") or "?", []).append(
                (round(time.time(), 3), "arrived", json.loads(data).get("task_id"), sid))
        return await original_process_msg(self, sid, subject, reply, data, headers)

    async def process(self, msg):
        TRACE.setdefault(self.node_id, []).append((round(time.time(), 3), "process", json.loads(msg.data).get("task_id")))
        return await original_process(self, msg)

    def kick(self):
        TRACE.setdefault(self.node_id, []).append((round(time.time(), 3), "kick", self._fetching is not None))
        return original_kick(self)

    original_pull_one, original_fetch = TaskPull.pull_one, TaskWorker._fetch

    async def pull_one(self, expiry_s, heartbeat_s):
        trace = TRACE.setdefault(self.nc.options.get("name") or "?", [])
        trace.append((round(time.time(), 3), "pull_one", self.queued()))
        try:
            msgs = await original_pull_one(self, expiry_s, heartbeat_s)
        except BaseException as exc:
            trace.append((round(time.time(), 3), "pull_one raised", type(exc).__name__))
            raise
        trace.append((round(time.time(), 3), "pull_one got", [json.loads(m.data).get("task_id") for m in msgs]))
        return msgs

    async def fetch(self):
        msgs = await original_fetch(self)
        TRACE.setdefault(self.node_id, []).append((round(time.time(), 3), "fetch returned", msgs is not None))
        return msgs

    nats_client.Client._process_msg = process_msg
    TaskWorker._process = process
    TaskWorker.kick = kick
    TaskPull.pull_one = pull_one
    TaskWorker._fetch = fetch


async def _child(urls, nodes, root: Path, events, stop, args) -> None:
    if TRACE_PATH and args["node_impl"] == "agent":
        _trace_agents()
    store = StateStore.open(root / "state.db")
    logins: dict[str, tuple[str, str]] = args.get("logins") or {}
    js_api_prefix = args.get("js_api_prefix") or "$JS.API"

    def security(node_id: str) -> TransportSecurity:
        """Plaintext on loopback; in operator mode the node's own creds file (written here, 0600)."""
        if node_id not in logins:
            return TransportSecurity(insecure=True)
        from tests.natsauth.natsjwt import creds_text

        path = root / f"{node_id}.creds"
        if not path.exists():
            token, seed = logins[node_id]
            path.write_text(creds_text(token, seed.encode()))
            path.chmod(0o600)
        return TransportSecurity(insecure=True, creds_file=path)
    gate = asyncio.Semaphore(args["connect_concurrency"])
    running: list = []

    async def handler(payload, ctx):
        events.put(("claim", ctx.envelope.task_id, time.time()))
        return {}

    async def wire_pull_loop(worker: TaskWorker) -> None:
        """``--node-impl wire``: the server-side traffic of a claim, without the agent's Python around it.

        The consumer is the worker's own (``TaskWorker._bind``) and so is the pull (``worker.pull``,
        control/pull.py: the same request and the same reader); per task: one pull request (with the
        worker's idle heartbeat), the delivery, a result published with its PubAck awaited, an ack.
        "Claim" is the delivery.
        """
        expiry, heartbeat = args["pull_expiry"], worker._pull_heartbeat_s()
        bound = pull_bound_s(expiry, heartbeat)
        loop = asyncio.get_running_loop()
        result_subject = f"gpuaas.node.{worker.node_id}.result"
        trace = TRACE.setdefault(worker.node_id, []) if TRACE_PATH else None
        while True:
            try:
                await worker.pull.request(expiry, heartbeat)
            except nats.errors.ConnectionClosedError:
                return  # the bench is closing the connections
            end = loop.time() + bound
            if trace is not None:
                trace.append((round(time.time(), 3), "pull"))
            msg = status = None
            while True:
                try:
                    msg = await worker.pull.take(max(0.001, end - loop.time()))
                except (nats.errors.TimeoutError, TimeoutError):
                    msg = None
                    if trace is not None:
                        trace.append((round(time.time(), 3), "client-timeout"))
                    break
                status = pull_status(msg)
                if trace is not None:
                    trace.append((round(time.time(), 3), f"status {status}" if status else "msg"))
                if status == "100":
                    continue  # an idle heartbeat: the pull is alive
                break
            if msg is None or status is not None:
                continue  # 404/408: the pull ended empty (or timed out here); pull again
            task_id = json.loads(msg.data)["task_id"]
            events.put(("claim", task_id, time.time()))
            result = TaskResult(task_id=task_id, node_id=worker.node_id, type=TASK.value, attempt=1,
                                status=ResultStatus.succeeded, finished_at=datetime.now(UTC))
            await worker.js.publish(result_subject, result.model_dump_json().encode(), stream=args.get("result_stream"),
                                    headers={"Nats-Msg-Id": f"{task_id}-1"})
            await msg.ack()

    claimed: list = []  # --node-impl protocol: claims sent to the parent in batches, not one queue put each

    async def flush_claims() -> None:
        while True:
            await asyncio.sleep(0.02)  # batch window of the claim events
            if claimed:
                batch = claimed[:]
                claimed.clear()
                events.put(("claims", None, batch))

    def bind_error(exc: BaseException) -> str:
        """A failed try's kind, for the doc to say why binds fail: timeout, no responders, a JS API error code."""
        if isinstance(exc, NatsConnectError):  # its code, and the cause's type (a timeout, a refusal, an EOF)
            return f"connect:{exc.code}:{str(exc.evidence.get('error', '')).split('(', 1)[0]}"
        if isinstance(exc, ConsumerMissing):
            return "bind:consumer_missing"
        if isinstance(exc, nats.errors.NoRespondersError):
            return "bind:no_responders"
        if isinstance(exc, (nats.errors.TimeoutError, TimeoutError)):
            return "bind:timeout"
        if isinstance(exc, nats.js.errors.APIError):
            return f"bind:api_{exc.code}_{exc.err_code}"
        return f"bind:{type(exc).__name__}"

    async def connect_and_bind(node_id: str, started: float) -> tuple:
        """The agent's first connect and bind, tried until ``--bind-deadline`` (the only give-up).

        As the daemon does (daemon.py ``_connect``, control/worker.py ``TaskWorker.run``): a failed connect
        (``--connect-timeout``, the agent's ``connect_timeout_s``) is tried again after the reconnect backoff
        (full jitter, 0.5 s .. ``--backoff-max``); a failed bind on the connection it has is tried again after
        0.2 s, doubling to 5 s, no jitter (``consumer_bind_failed`` / ``consumer_missing``); each JetStream API
        call is bounded by ``--request-timeout`` (the agent's ``request_timeout_s``). Each try holds the
        connect gate (``--connect-concurrency``), never its pause. Per node the tries and each failed try's
        error kind go to the parent (``bind_tries``).
        """
        rng = random.Random()
        reconnect = Backoff(0.5, args["backoff_max"])
        deadline = started + args["bind_deadline"]
        nc = worker = None
        connect_attempt, bind_backoff, tries, errors, first_try = 0, 0.2, 0, [], None
        while True:
            tries += 1
            await gate.acquire()  # a try that binds keeps it through the node's protocol login (the caller releases)
            try:
                first_try = first_try or time.time()
                if nc is not None and nc.is_closed:  # nats.py gave the connection up: connect again
                    nc = worker = None
                if nc is None:
                    # reconnect: the daemon's connection reconnects by itself after a server drops it; without
                    # it a bind retried on a connection the server dropped fails until the deadline.
                    nc = await connect_nats(list(urls), timeout_s=args["connect_timeout"], name=node_id,
                                            reconnect=reconnect, rng=rng,
                                            inbox_prefix=node_inbox_prefix(node_id), security=security(node_id))
                    worker = TaskWorker(nc, store, node_id, {TASK: handler}, WorkerSettings(
                        fetch_timeout_s=args["pull_expiry"], fetch_heartbeat_s=args["pull_heartbeat"] or None,
                        ack_wait_s=60, request_timeout_s=args["request_timeout"], js_api_prefix=js_api_prefix,
                        consumer_replicas=1 if args["consumer_memory"] else None,
                        consumer_memory=args["consumer_memory"]))
                worker.pull.bind(await worker._bind())
            except (NatsConnectError, ConsumerMissing, nats.errors.Error, TimeoutError) as exc:
                gate.release()
                kind = bind_error(exc)
                # What nats.py saw on the connection since the last try (connection.py's callbacks keep it): why
                # the server dropped it (a stale connection, an -ERR), taken and cleared per try.
                seen = getattr(getattr(nc, "_error_cb", None), "__self__", None)
                if nc is not None and getattr(seen, "last_error", None) is not None:
                    kind += f"<{str(seen.last_error)[:60] or type(seen.last_error).__name__}>"
                    seen.last_error = None
                errors.append(kind)
                if nc is None:
                    delay = reconnect.delay(connect_attempt, rng)
                    connect_attempt += 1
                else:
                    delay, bind_backoff = bind_backoff, min(bind_backoff * 2, 5.0)
                events.put(("bind_retry", f"{node_id}-{tries}", time.time()))
            except BaseException:
                gate.release()
                raise
            else:
                events.put(("bind_tries", node_id, {"tries": tries, "errors": errors, "bound": True, "at": time.time()}))
                return nc, worker, first_try
            if time.time() + delay > deadline:
                events.put(("bind_tries", node_id, {"tries": tries, "errors": errors, "bound": False, "at": time.time()}))
                if nc is not None:
                    await nc.close()
                raise RuntimeError(f"{node_id}: no bind within --bind-deadline after {tries} tries: {errors[-3:]}")
            await asyncio.sleep(delay)  # the agent's pause before the next try

    protocol_nodes: list[ProtocolNode] = []

    async def protocol_node(node_id: str) -> None:
        """``--node-impl protocol``: the worker binds its consumer on nats.py, then a ProtocolNode pulls."""
        nc, worker, started = await connect_and_bind(node_id, time.time())  # ready: since its first try
        try:  # the gate connect_and_bind holds for this node: its bind and its protocol login are one try
            next_subject, heartbeat = worker.pull.next_subject, worker._pull_heartbeat_s()
            # The node's pulls go to the server its bind went to, as the agent's one connection does: a login
            # of the same account on a second member at once races that member's load of the account from the
            # route's interest (nats-server 2.15.1 then refused some nodes' logins there again and again:
            # "Account JWT has expired" / "not signed by trusted operator", docs/performance.md).
            url = urlsplit(nc.connected_url.geturl()) if nc.connected_url else urlsplit(urls[len(protocol_nodes) % len(urls)])
            try:  # bounded, as the daemon's closes are: 529-658 of 10,000 bind connections sat open and unread for
                # minutes after their bind (nats.py's close waiting, we think, for the server to drop them)
                await asyncio.wait_for(nc.close(), args["request_timeout"])
            except TimeoutError:
                events.put(("close_stalled", node_id, time.time()))
            node = ProtocolNode(node_id=node_id, host=url.hostname, port=url.port, inbox_prefix=node_inbox_prefix(node_id),
                                next_subject=next_subject, task_type=TASK.value, expiry_s=args["pull_expiry"],
                                bound_s=pull_bound_s(args["pull_expiry"], heartbeat),
                                heartbeat_s=heartbeat, backoff=Backoff(0.5, args["backoff_max"]),
                                on_claim=lambda task_id, t: claimed.append((task_id, t)),
                                on_reconnect=lambda t: events.put(("reconnected", node_id, t)),
                                trace=TRACE.setdefault(node_id, []) if TRACE_PATH else None,
                                jwt=logins[node_id][0] if node_id in logins else None,
                                seed=logins[node_id][1].encode() if node_id in logins else None)
            protocol_nodes.append(node)
            await node.connect(max(30.0, started + args["bind_deadline"] - time.time()))
            events.put(("ready", node_id, time.time() - started))
        finally:
            gate.release()

    if args["node_impl"] == "protocol":
        flusher = asyncio.create_task(flush_claims())
        await asyncio.gather(*(protocol_node(n) for n in nodes))
        refused = [e for pnode in protocol_nodes for e in pnode.errors]
        if refused:  # logins the server dropped before one succeeded (the node tried again)
            print(f"protocol nodes, while connecting: {len(refused)} errors, e.g. {sorted(set(refused))[:3]}",
                  file=sys.stderr, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        for pnode in protocol_nodes:
            pnode.close()
        errors = [e for pnode in protocol_nodes for e in pnode.errors]
        if errors:
            print(f"protocol nodes: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
        flusher.cancel()
        store.close()
        if TRACE_PATH:
            Path(f"{TRACE_PATH}.{os.getpid()}.json").write_text(json.dumps(TRACE))
        return

    async def node(node_id: str) -> None:
        async with gate:
            started = time.time()
            nc = await connect_nats(list(urls), timeout_s=60, name=node_id, reconnect=Backoff(0.5, args["backoff_max"]),
                                    inbox_prefix=node_inbox_prefix(node_id), security=security(node_id))
            nc.reconnect_listeners.append(lambda: events.put(("reconnected", node_id, time.time())))
            worker = TaskWorker(nc, store, node_id, {TASK: handler},
                                WorkerSettings(fetch_timeout_s=args["pull_expiry"], keepalive_interval_s=10,
                                               js_api_prefix=js_api_prefix,
                                               fetch_heartbeat_s=args["pull_heartbeat"] or None,
                                               ack_wait_s=60, request_timeout_s=30,
                                               consumer_replicas=1 if args["consumer_memory"] else None,
                                               consumer_memory=args["consumer_memory"]))
            state = root / node_id
            state.mkdir(exist_ok=True)
            reporter = Reporter(ReporterSettings(node_id=node_id, state_dir=state,
                                                 heartbeat_interval_s=args["heartbeat"], health_interval_s=3600,
                                                 request_timeout_s=30), store, HealthSettings(host_root=Path("/")),
                                None, lambda **_: True, threads=CheckThreads())
            reporter.attach(nc, worker)
            if args["node_impl"] == "wire":
                worker.pull.bind(await worker._bind())
                run = asyncio.create_task(wire_pull_loop(worker))
                worker.ready.set()
            else:
                run = asyncio.create_task(worker.run())
                await worker.ready.wait()
            events.put(("ready", node_id, time.time() - started))
        await asyncio.sleep(random.uniform(0, args["heartbeat"]))  # spread the heartbeat phase
        running.append((nc, worker, run, asyncio.create_task(reporter.loop()) if args["node_impl"] == "agent" else None))

    await asyncio.gather(*(node(n) for n in nodes))
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    for nc, worker, run, beat in running:
        if beat is not None:
            beat.cancel()
        worker.stop()
        if args["node_impl"] == "wire":
            run.cancel()
    await asyncio.gather(*(w.drain(1) for _, w, _, _ in running), return_exceptions=True)
    await asyncio.gather(*(nc.close() for nc, _, _, _ in running), return_exceptions=True)
    store.close()
    if TRACE_PATH:
        Path(f"{TRACE_PATH}.{os.getpid()}.json").write_text(json.dumps(TRACE))


def pull_bound_s(expiry_s: float, heartbeat_s: float | None) -> float:
    """How long a simulated node waits on one pull, from sending it; never restarted by a heartbeat.

    The worker's pull (``TaskPull.pull_one``) waits ``min(1 s, heartbeat)`` past the expiry for the server's 408 (nats.py's
    ``fetch`` gives up at the expiry and drops a late 408 itself); a node here waits 1 s past it without a
    heartbeat, so a 408 normally ends the pull and is never taken for the end of the next one.
    nats-server before 2.9.16 may drop that 408 when a message arrives as the pull expires (nats-server
    PR #3942): a wait restarted at each heartbeat, as ``next_msg`` in a loop does, then held the message
    ~35 s.
    """
    return expiry_s + min(1.0, heartbeat_s or 1.0)


TRACE_PATH = os.environ.get("BENCH_TRACE")  # BENCH_TRACE=/tmp/x: each wire node's pulls, statuses and messages
TRACE: dict[str, list] = {}


# -- the run ----------------------------------------------------------------------------


class ChildCpu:
    """CPU seconds (user + system) of the simulated nodes' processes, from /proc/<pid>/stat."""

    pids: list[int] = []

    def cpu_s(self) -> float:
        total = 0.0
        for pid in self.pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        return total

    def by_thread(self) -> dict[str, float]:
        """CPU seconds of the event-loop threads and of all other threads of the simulated nodes' processes."""
        out: dict[str, float] = {}
        for pid in self.pids:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    raw = (task / "stat").read_text()
                except OSError:
                    continue
                # Python 3.11 names no OS threads: the main one runs the event loop; the others are the
                # store thread (SQLite), the mp.Queue feeder and the executor waiting for the stop event.
                name = "event-loop" if task.name == str(pid) else "other-threads"
                fields = raw.rsplit(")", 1)[1].split()
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
        return out


def machine_cpu() -> dict[str, float]:
    """The whole machine's CPU seconds so far, all cores (/proc/stat): busy, idle (iowait included), steal."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {"busy": (user + nice + system + irq + softirq) / CLK_TCK, "idle": (idle + iowait) / CLK_TCK,
            "steal": steal / CLK_TCK}


def time_split(prefix: str, wall_s: float, m0: dict, m1: dict, ours: dict[str, float]) -> dict:
    """Where a phase's wall time went on this machine: ``ours`` (servers, simulator, plane: CPU seconds), the
    rest of the machine's busy CPU (other processes: other sessions' work), idle cores (nobody runnable: waits
    on timeouts, backoff, the network) and steal, against ``wall x cores``."""
    busy, idle, steal = (m1[k] - m0[k] for k in ("busy", "idle", "steal"))
    out = {f"{prefix}_wall_s": round(wall_s, 1), f"{prefix}_cores": os.cpu_count(),
           f"{prefix}_machine_busy_cpu_s": round(busy, 1), f"{prefix}_machine_idle_cpu_s": round(idle, 1),
           f"{prefix}_steal_cpu_s": round(steal, 1),
           f"{prefix}_other_procs_cpu_s": round(busy - sum(ours.values()), 1)}
    return out


LOG_LEVELS = ("[WRN]", "[ERR]", "[FTL]")


def log_kind(line: str) -> str | None:
    """A nats-server warning or error line's kind: its message without client address, ids, names and numbers."""
    import re

    for level in LOG_LEVELS:
        if level in line:
            text = line.split(level, 1)[1].strip()
            break
    else:
        return None
    text = re.sub(r"^[\d.:\[\]]+ - (?:cid|rid|lid|gid):\d+(?: - \"[^\"]*\")* - ", "", text)  # the client tag
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\bnode-f\d+\b|\bGPUAAS_\w+|\bA[A-Z2-7]{55}\b|\$JS\.\S+|gpuaas\.\S+|_INBOX\S*", "…", text)
    text = re.sub(r"\d+(?:\.\d+)?", "N", text)
    return f"{level} {text[:100]}"


def log_kinds(servers: Servers) -> dict[str, int]:
    """Warning and error kinds in the members' logs so far, counted, most frequent first."""
    counts: dict[str, int] = {}
    for m in servers.members:
        path = m.root / "nats.log"
        if not path.exists():
            continue
        with path.open(errors="replace") as f:
            for line in f:
                kind = log_kind(line)
                if kind is not None:
                    counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:25])


def bind_summary(tries: dict[str, dict], t0: float) -> dict:
    """Per node tries and failed tries' errors (``bind_tries`` events): how many needed more than one, the error
    kinds, and how many nodes were bound N seconds after the simulator started."""
    errors: dict[str, int] = {}
    hist: dict[str, int] = {}
    for row in tries.values():
        hist[str(row["tries"])] = hist.get(str(row["tries"]), 0) + 1
        for e in row["errors"]:
            errors[e] = errors.get(e, 0) + 1
    bound_at = sorted(row["at"] - t0 for row in tries.values() if row["bound"])
    marks = [10, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900]
    return {"bind_tries_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "bind_failed_tries": sum(errors.values()), "bind_error_kinds": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
            "bind_gave_up": sum(1 for row in tries.values() if not row["bound"]),
            "bound_by_s": {str(m): sum(1 for x in bound_at if x <= m) for m in marks if not bound_at or m < bound_at[-1] + 60}}


class Events:
    """Child events drained by a thread into dicts; async waits poll them with a deadline."""

    def __init__(self, q) -> None:
        self.q = q
        self.claims: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.reconnected: dict[str, float] = {}
        self.bind_retries: dict[str, float] = {}
        self.bind_tries: dict[str, dict] = {}  # node id -> its tries, each failed try's error kind, bound or not
        self.close_stalled: dict[str, float] = {}  # node id -> when its bind connection's close gave up
        self._stop = False
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self._stop:
            try:
                kind, key, value = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "claims":  # a batch of (task_id, time)
                for task_id, t in value:
                    self.claims.setdefault(task_id, t)
                continue
            {"claim": self.claims, "ready": self.ready, "reconnected": self.reconnected,
             "bind_retry": self.bind_retries, "bind_tries": self.bind_tries,
             "close_stalled": self.close_stalled}[kind].setdefault(key, value)

    async def until(self, predicate, deadline_s: float) -> bool:
        end = time.monotonic() + deadline_s
        while not predicate():
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.02)  # poll interval of a bench wait with a deadline
        return True


async def publish_all(plane: ControlPlane, targets: list[str], sent: dict[str, float], concurrency: int = 256) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(node_id: str) -> None:
        envelope = plane.envelope(node_id, TASK.value)
        TARGETS[envelope.task_id] = node_id
        async with gate:
            sent[envelope.task_id] = time.time()
            for attempt in range(20):  # a control plane retries a publish the restarting server did not ack
                try:
                    await plane.enqueue(envelope, msg_id=envelope.task_id)
                    return
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError):
                    await asyncio.sleep(0.2)  # retry pacing
            raise RuntimeError(f"could not enqueue {envelope.task_id}")

    await asyncio.gather(*(one(n) for n in targets))


async def debug_stuck(plane, sent: dict[str, float], events, server=None) -> None:
    """BENCH_DEBUG: each unclaimed task's consumer as the server sees it (waiting pulls, pending, delivered),
    and the server's connections named after its node (a second one is a connection the client gave up on)."""
    conns: dict[str, list] = {}
    for member in getattr(server, "members", []):
        try:
            for c in member.get("/connz?limit=100000&subs=1").get("connections", []):
                conns.setdefault(c.get("name", ""), []).append(
                    (member.name, c.get("cid"), c.get("start"), c.get("last_activity"), c.get("num_subscriptions"),
                     c.get("pending_bytes"), c.get("out_msgs")))
        except Exception as exc:  # a probe
            print("STUCK connz failed", repr(exc), file=sys.stderr)
    if conns:
        print("STUCK connections", sum(len(v) for v in conns.values()), "names with more than one:",
              sum(1 for v in conns.values() if len(v) > 1), file=sys.stderr)
    targets = plane_targets(plane, sent)
    unclaimed = sorted((t, n) for t, n in targets.items() if t not in events.claims)
    print("STUCK", len(unclaimed), "unclaimed; the first 20:", file=sys.stderr)
    for task_id, node_id in unclaimed[:20]:
        try:
            stream = await plane.js.find_stream_name_by_subject(subjects.tasks(node_id))
            info = await plane.js.consumer_info(stream, WorkerSettings().durable_name(node_id))
            print("STUCK", node_id, task_id, stream, round(time.time() - sent[task_id], 2),
                  "reconnected", node_id in events.reconnected,
                  "waiting", info.num_waiting, "pending", info.num_pending, "ack_pending", info.num_ack_pending,
                  "delivered", info.delivered, "ack_floor", info.ack_floor, "conns", conns.get(node_id), file=sys.stderr)
        except Exception as exc:  # a probe: print what failed and go on
            print("STUCK", node_id, task_id, "probe failed", repr(exc), file=sys.stderr)


def plane_targets(plane, sent):
    return {t: n for t, n in TARGETS.items() if t in sent}


TARGETS: dict[str, str] = {}


def latencies(sent: dict[str, float], claims: dict[str, float]) -> list[float]:
    return [claims[t] - s for t, s in sent.items() if t in claims]


async def retried(call, out: dict, tries: int = 8):
    """A plane's create, tried again (it is idempotent) when the meta layer timed out or failed it; counted."""
    for attempt in range(tries):
        try:
            return await call()
        except (nats.errors.TimeoutError, nats.js.errors.APIError, TimeoutError) as exc:  # 503: no meta leader now
            out["create_retries"] = out.get("create_retries", 0) + 1
            out.setdefault("create_errors", []).append(repr(exc)[:160]) if len(out.get("create_errors", [])) < 5 else None
            if attempt == tries - 1:
                raise
            await asyncio.sleep(1.0 + 2 * attempt)  # the retry's pacing


async def run_one(n: int, args, root: Path, accounts: str = "none") -> dict:
    """One N and one login mode; the servers are stopped by PID whatever happens."""
    servers: list[Servers] = []
    out: dict = {}  # what was measured before a failure is printed with it
    try:
        return await _run_one(n, args, root, accounts, servers, out)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:400]
        return out
    finally:
        for s in servers:
            s.stop()


async def _run_one(n: int, args, root: Path, accounts: str, servers_out: list, out: dict) -> dict:
    rundir = root / f"n{n}-{accounts}"
    server = Servers(rundir, args.servers)
    servers_out.append(server)
    nodes = [f"node-f{i:05d}" for i in range(n)]
    auth = FleetAuth(accounts, nodes) if accounts != "none" else None
    options: dict = {}
    if auth is not None:
        options["user_credentials"] = str(auth.install(server, rundir))
    server.start()
    plane = await ControlPlane.connect(server.urls, **options)
    out.update({"nodes": n, "node_impl": args.node_impl, "servers": args.servers, "layout": args.layout,
                 "accounts": accounts, "server_version": server_version(),
                 "stream_replicas": args.replicas,
                 "consumer_memory": args.consumer_memory, "pull_expiry_s": args.pull_expiry, "procs": args.procs,
                 "pull_heartbeat_s": args.pull_heartbeat})
    if auth is not None:
        out["sign_s"] = auth.sign_s
    out["rss_empty_mib"] = round(server.rss_mib(), 1)
    cpu_setup0 = server.cpu_s()
    t = time.time()
    if args.layout == "per-node":
        # Each node's own task and result stream (control/streams.py), file storage, --replicas (R1: placed by
        # the meta leader on one member), made by the plane at enrollment; the consumer below on its task stream.
        storage = StorageType.MEMORY if args.stream_memory else StorageType.FILE
        gate = asyncio.Semaphore(args.create_concurrency)

        async def streams_of(node_id: str) -> None:
            async with gate:
                for config in (node_task_stream_config(node_id, storage=storage, replicas=args.replicas),
                               node_result_stream_config(node_id, storage=storage, replicas=args.replicas)):
                    await retried(lambda: plane.js.add_stream(config), out)
        await asyncio.gather(*(streams_of(x) for x in nodes))
        plane.partitioned = True  # tasks are published without an expected stream
        out["streams"] = 2 * n
    elif args.layout == "partitioned":
        out["streams"] = len(await plane.create_task_partitions(nodes, per_stream=args.per_stream,
                                                                replicas=args.replicas))
        await plane.js.add_stream(StreamConfig(  # results land in a stream, as in create_streams()
            name=RESULT_STREAM, subjects=["gpuaas.node.*.result"], retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE, duplicate_window=120, num_replicas=args.replicas))
    else:
        await plane.create_streams()
        out["streams"] = 1
    out["stream_create_s"] = round(time.time() - t, 2)
    # Each node's consumer is the control plane's to create (a node may only look it up, pull and ack).
    t = time.time()
    consumer_settings = WorkerSettings(ack_wait_s=60, consumer_replicas=1 if args.consumer_memory else None,
                                       consumer_memory=args.consumer_memory)
    creating = asyncio.Semaphore(args.create_concurrency)

    async def create_consumer(node_id: str) -> None:
        async with creating:
            if args.layout == "per-node":  # its stream is known: no lookup by subject among 2N streams
                plane.consumers[node_id] = consumer_settings
                await retried(lambda: plane.js.add_consumer(task_stream_name(node_id),
                                                            consumer_settings.consumer_config(node_id)), out)
            else:
                await plane.create_node_consumer(node_id, consumer_settings)
    await asyncio.gather(*(create_consumer(n) for n in nodes))
    out["consumer_create_s"] = round(time.time() - t, 2)
    out["setup_server_cpu_s"] = round(server.cpu_s() - cpu_setup0, 2)
    if args.consumer_memory:  # R1 consumers: the plane re-creates one whose member is lost (--restart-one)
        plane.watch_consumers(interval_s=2.0, probe_timeout_s=2.0)

    q, stop = mp.Queue(), mp.Event()
    events = Events(q)
    child_args = {"node_impl": args.node_impl, "consumer_memory": args.consumer_memory, "pull_expiry": args.pull_expiry, "heartbeat": args.heartbeat, "backoff_max": args.backoff_max,
                  "connect_concurrency": args.connect_concurrency}
    child_args["pull_heartbeat"] = args.pull_heartbeat
    child_args.update(connect_timeout=args.connect_timeout, request_timeout=args.request_timeout,
                      bind_deadline=args.bind_deadline)
    child_args["result_stream"] = None if args.layout == "per-node" else RESULT_STREAM
    if auth is not None:
        child_args["js_api_prefix"] = auth.prefix
    child_cpu = ChildCpu()
    procs = []
    t0 = time.time()
    for p in range(args.procs):
        part = nodes[p::args.procs]
        pdir = rundir / f"p{p}"
        pdir.mkdir(parents=True, exist_ok=True)
        this_args = dict(child_args, logins={x: auth.logins[x] for x in part} if auth is not None else None, profile=str(Path(args.profile).with_suffix(f".n{n}.prof")) if args.profile and p == 0 else None)
        proc = mp.Process(target=child_main, args=(server.urls, part, str(pdir), q, stop, this_args))
        proc.start()
        procs.append(proc)
    child_cpu.pids = [proc.pid for proc in procs]
    bind_cpu0, bind_pcpu0, bind_m0 = server.cpu_s(), time.process_time(), machine_cpu()
    try:
        # The simulated nodes retry (the agent's backoff) until --bind-deadline; a process ends only on that give-up.
        ok = await events.until(lambda: len(events.ready) >= n or any(p.exitcode for p in procs),
                                args.bind_deadline + 60)
        ok = ok and len(events.ready) >= n  # a simulated process that died ends the wait (its traceback above)
        out["all_bound_s"] = round(time.time() - t0, 1) if ok else None
        # Where the bind's time went: CPU seconds of the servers, the simulated nodes' processes, the plane + bench.
        out["bind_server_cpu_s"] = round(server.cpu_s() - bind_cpu0, 2)
        out["bind_sim_cpu_s"] = round(child_cpu.cpu_s(), 2)  # the children started with the bind
        out["bind_plane_cpu_s"] = round(time.process_time() - bind_pcpu0, 2)
        out.update(time_split("bind", time.time() - t0, bind_m0, machine_cpu(), {
            "servers": out["bind_server_cpu_s"], "sim": out["bind_sim_cpu_s"], "plane": out["bind_plane_cpu_s"]}))
        out["bound"] = len(events.ready)
        out["bind_retries"] = len(events.bind_retries)
        out["bind_p50_s"] = round(pct(list(events.ready.values()), 50) or 0, 3)
        out["bind_p99_s"] = round(pct(list(events.ready.values()), 99) or 0, 3)
        out.update(bind_summary(dict(events.bind_tries), t0))
        out["bind_close_stalled"] = len(events.close_stalled)  # bind connections whose close took over --request-timeout
        out["log_after_bind"] = log_kinds(server)
        if not ok:
            out["error"] = f"{len(events.ready)} of {n} bound"
            return out
        if args.servers > 1:
            await asyncio.sleep(2)  # let consumer leaders settle before counting them
            out["raft"] = raft_inventory(server)
            out["elections_after_bind"] = elections(server)
            out["health_after_bind"] = cluster_health(server)
            out["clients_per_server"] = server.varz()["connections"]
        await asyncio.sleep(args.heartbeat)  # let the heartbeat phases spread before measuring idle

        # Idle: server CPU, memory and message rate with every node connected and pulling.
        cpu0, v0, w0 = server.cpu_s(), server.varz(), time.time()
        await asyncio.sleep(args.idle_s)
        cpu1, v1, w1 = server.cpu_s(), server.varz(), time.time()
        out["idle_server_cores"] = round((cpu1 - cpu0) / (w1 - w0), 3)
        out["idle_server_cpu_ms_per_node_s"] = round((cpu1 - cpu0) / (w1 - w0) / n * 1000, 4)
        out["idle_in_msgs_per_s"] = round((v1["in_msgs"] - v0["in_msgs"]) / (w1 - w0), 1)
        out["server_rss_mib"] = round(server.rss_mib(), 1)
        out["server_kib_per_node"] = round(server.rss_mib() * 1024 / n, 1)
        # Per host, less what the servers held with no streams, consumers or nodes (accounts preloaded only).
        out["server_kib_per_node_net"] = round((server.rss_mib() - out["rss_empty_mib"]) * 1024 / n, 1)
        out["loadavg"] = os.getloadavg()[0]

        # Steady trickle.
        sent: dict[str, float] = {}
        interval = 1.0 / args.trickle_rate
        end = time.monotonic() + args.trickle_s
        while time.monotonic() < end:
            await publish_all(plane, [random.choice(nodes)], sent)
            await asyncio.sleep(interval)  # the trickle's pacing
        await events.until(lambda: all(t in events.claims for t in sent), 60)
        lat = latencies(sent, events.claims)
        out["trickle_tasks"] = len(sent)
        out["trickle_claimed"] = len(lat)
        out["trickle_p50_s"], out["trickle_p99_s"] = round(pct(lat, 50), 3), round(pct(lat, 99), 3)
        out["trickle_over_1s"] = sum(1 for x in lat if x > 1.0)
        if os.environ.get("BENCH_DEBUG"):
            targets = plane_targets(plane, sent)
            for t, s0 in sorted(sent.items(), key=lambda kv: kv[1]):
                print("DEBUG", targets.get(t), t, round(s0 - min(sent.values()), 2),
                      round(events.claims.get(t, 0) - s0, 3), file=sys.stderr)

        # One task to every node at once.
        sent = {}
        threads0 = child_cpu.by_thread()
        if args.profile:
            os.kill(procs[0].pid, signal.SIGUSR1)
        cpu0, ccpu0, pcpu0, b0, burst_m0 = server.cpu_s(), child_cpu.cpu_s(), time.process_time(), time.time(), machine_cpu()
        await publish_all(plane, nodes, sent)
        published = time.time()
        ok = await events.until(lambda: all(t in events.claims for t in sent), 8.0 if os.environ.get("BENCH_DEBUG") else args.burst_deadline)
        if not ok and os.environ.get("BENCH_DEBUG"):
            await debug_stuck(plane, sent, events, server)
            for member in getattr(server, "members", []):
                print("SERVER LOG", member.name, (member.root / "nats.log").read_text(errors="replace")[-3000:], file=sys.stderr)
            ok = await events.until(lambda: all(t in events.claims for t in sent), args.burst_deadline)
        lat = latencies(sent, events.claims)
        last = max((events.claims[t] for t in sent if t in events.claims), default=None)
        out["burst_publish_s"] = round(published - b0, 2)
        out["burst_drain_s"] = round(last - b0, 2) if ok and last else None
        out["burst_claimed"] = len(lat)
        out["burst_p50_s"], out["burst_p99_s"] = round(pct(lat, 50), 3), round(pct(lat, 99), 3)
        out["burst_server_cpu_s"] = round(server.cpu_s() - cpu0, 2)
        out["burst_sim_nodes_cpu_s"] = round(child_cpu.cpu_s() - ccpu0, 2)  # the simulated agents' processes
        out["burst_plane_cpu_s"] = round(time.process_time() - pcpu0, 2)  # control plane + this bench
        out.update(time_split("burst", time.time() - b0, burst_m0, machine_cpu(), {
            "servers": out["burst_server_cpu_s"], "sim": out["burst_sim_nodes_cpu_s"], "plane": out["burst_plane_cpu_s"]}))
        threads1 = child_cpu.by_thread()
        out["burst_sim_cpu_by_thread_s"] = {k: round(v - threads0.get(k, 0.0), 2) for k, v in threads1.items()
                                            if v - threads0.get(k, 0.0) >= 0.01}
        if args.profile:
            os.kill(procs[0].pid, signal.SIGUSR2)
        out["burst_over_1s"] = sum(1 for x in lat if x > 1.0)
        out["burst_max_s"] = round(max(lat), 3) if lat else None
        out["slow_consumers_so_far"] = server.varz().get("slow_consumers")  # the server cut a client that fell behind
        out["reconnects_so_far"] = len(events.reconnected)
        out["burst_over_5s"] = sum(1 for x in lat if x > 5.0)
        if os.environ.get("BENCH_DEBUG"):
            targets = plane_targets(plane, sent)
            for t, s0 in sent.items():
                if events.claims.get(t, 1e18) - s0 > 5:
                    print("SLOW", targets.get(t), t, round(events.claims.get(t, 0) - s0, 3), file=sys.stderr)

        # Server restart: reconnect with backoff + jitter; one task per node published at once.
        if args.restart:
            events.reconnected.clear()
            if args.restart_one:  # one member of the cluster: its clients fail over, its leaders move
                member = server.members[0]
                expected = member.varz()["connections"]
                member.stop()
                down = time.time()
                member.spawn()
                up = member.wait_ready()
            else:  # every server: all N reconnect at once (the herd)
                expected = n
                stop0 = time.time()
                server.stop()
                down = time.time()
                out["restart_stop_s"] = round(down - stop0, 1)  # SIGTERM to all three exited, one after another
                out["restart_stop_killed"] = sum(m.killed for m in server.members)
                restart_cpu0, restart_ccpu0, restart_pcpu0 = 0.0, child_cpu.cpu_s(), time.process_time()
                restart_m0 = machine_cpu()
                up = server.start()
            out["restart_members"] = 1 if args.restart_one else args.servers
            out["restart_expected_reconnects"] = expected
            out["restart_server_down_s"] = round(up - down, 2)
            sent = {}
            await events.until(lambda: plane.nc.is_connected, 120)
            await publish_all(plane, nodes, sent)
            out["restart_all_published_s"] = round(time.time() - up, 2)  # the plane's retries included
            ok_r = await events.until(lambda: len(events.reconnected) >= expected, args.burst_deadline)
            ok_c = await events.until(lambda: all(t in events.claims for t in sent),
                                      20.0 if os.environ.get("BENCH_DEBUG") else args.burst_deadline)
            if not ok_c and os.environ.get("BENCH_DEBUG"):
                await debug_stuck(plane, sent, events, server)
                ok_c = await events.until(lambda: all(t in events.claims for t in sent), args.burst_deadline)
            rec = sorted(v - up for v in events.reconnected.values())
            out["restart_reconnected"] = len(rec)
            out["restart_all_reconnected_s"] = round(rec[-1], 2) if ok_r and rec else None
            out["restart_reconnect_p50_s"] = round(pct(rec, 50), 2) if rec else None
            last = max((events.claims[t] for t in sent if t in events.claims), default=None)
            out["restart_all_claimed_s"] = round(last - up, 2) if ok_c and last else None
            out["restart_claimed_after_published_s"] = (round(last - up - out["restart_all_published_s"], 2)
                                                        if ok_c and last else None)
            out["restart_claimed"] = sum(1 for t in sent if t in events.claims)
            # Since the server(s) stopped (a cluster's clients reconnect to the first member back, before all are up).
            out["restart_all_reconnected_since_down_s"] = round(max(events.reconnected.values()) - down, 2) if ok_r and rec else None
            out["restart_all_claimed_since_down_s"] = round(last - down, 2) if ok_c and last else None
            if not args.restart_one:  # since the stop: the servers' processes are new ones
                out["restart_server_cpu_s"] = round(server.cpu_s() - restart_cpu0, 2)
                out["restart_sim_cpu_s"] = round(child_cpu.cpu_s() - restart_ccpu0, 2)
                out["restart_plane_cpu_s"] = round(time.process_time() - restart_pcpu0, 2)
                out["restart_rss_mib"] = round(server.rss_mib(), 1)
                out.update(time_split("restart", time.time() - down, restart_m0, machine_cpu(), {
                    "servers": out["restart_server_cpu_s"], "sim": out["restart_sim_cpu_s"],
                    "plane": out["restart_plane_cpu_s"]}))
            if args.servers > 1:
                out["elections_total"] = elections(server)
                out["health_after_restart"] = cluster_health(server)
    finally:
        out["log_total"] = log_kinds(server)
        if args.log_dir:  # the servers' logs of the run, kept (the run's directory is removed after it)
            keep = Path(args.log_dir) / f"n{n}-{accounts}"
            keep.mkdir(parents=True, exist_ok=True)
            for member in server.members:
                if (member.root / "nats.log").exists():
                    shutil.copy(member.root / "nats.log", keep / f"{member.name}.log")
        stop.set()
        for proc in procs:
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
        events._stop = True
        try:
            await plane.close()
        except Exception:
            pass
        server.stop()
    return out


COLUMNS = [("nodes", "N"), ("accounts", "accounts"), ("streams", "streams"), ("all_bound_s", "bind all s"), ("bind_p99_s", "bind p99"),
           ("idle_server_cores", "idle cores"), ("idle_in_msgs_per_s", "idle msg/s"), ("server_rss_mib", "RSS MiB"),
           ("trickle_p50_s", "trickle p50"), ("trickle_p99_s", "trickle p99"), ("burst_drain_s", "burst drain s"),
           ("burst_p50_s", "burst p50"), ("burst_p99_s", "burst p99"), ("restart_all_reconnected_s", "reconn all s"),
           ("restart_all_published_s", "restart published s"), ("restart_all_claimed_s", "restart claimed s"),
           ("restart_all_claimed_since_down_s", "restart claimed since stop s"), ("server_kib_per_node", "KiB/node"), ("server_kib_per_node_net", "net KiB/node"),
           ("loadavg", "load")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="100,500,1000")
    ap.add_argument("--layout", choices=("shared", "partitioned", "per-node"), default="partitioned",
                    help="per-node: each node's own task and result stream (control/streams.py), the supported layout")
    ap.add_argument("--accounts", default="none",
                    help="comma-separated, each run in turn per N: none (no auth), per-node (an account per node, "
                         "the supported layout), single (every node a user of the plane's account); operator mode")
    ap.add_argument("--create-concurrency", type=int, default=64, help="the plane's stream/consumer creates in flight")
    ap.add_argument("--stream-memory", action="store_true", help="--layout per-node: memory-storage streams")
    ap.add_argument("--nats-server", default=None, help="the nats-server binary (default: the one on PATH)")
    ap.add_argument("--per-stream", type=int, default=100)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--pull-expiry", type=float, default=30.0)
    ap.add_argument("--pull-heartbeat", type=float, default=0.0,
                    help="idle heartbeat asked for on each pull, seconds (0: none, the agent's default)")
    ap.add_argument("--heartbeat", type=float, default=15.0)
    ap.add_argument("--backoff-max", type=float, default=10.0)
    ap.add_argument("--connect-concurrency", type=int, default=50)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--trickle-rate", type=float, default=20.0)
    ap.add_argument("--trickle-s", type=float, default=15.0)
    ap.add_argument("--bind-deadline", type=float, default=900.0,
                    help="a simulated node retries its connect and bind (the agent's backoff) until this, then gives up")
    ap.add_argument("--connect-timeout", type=float, default=5.0, help="one connect try (the agent's connect_timeout_s)")
    ap.add_argument("--request-timeout", type=float, default=5.0,
                    help="one JetStream API call of the bind (the agent's request_timeout_s)")
    ap.add_argument("--log-dir", default=None, help="keep each run's nats-server logs here (n<N>-<accounts>/s1.log...)")
    ap.add_argument("--burst-deadline", type=float, default=300.0)
    ap.add_argument("--consumer-memory", action="store_true", help="R1 memory-storage consumers")
    ap.add_argument("--no-restart", dest="restart", action="store_false")
    ap.add_argument("--servers", type=int, default=1, help="1: one server; 3: a JetStream cluster on loopback")
    ap.add_argument("--replicas", type=int, default=1, help="task and result stream replicas (3 in a cluster)")
    ap.add_argument("--restart-one", action="store_true", help="restart one cluster member instead of all")
    ap.add_argument("--node-impl", choices=("agent", "wire", "protocol"), default="agent",
                    help="agent: the agent's TaskWorker + Reporter; wire: the server traffic of a claim only "
                         "(the worker's consumer, pull, PubAck'd result, ack), to measure the server apart "
                         "from the simulated agents' Python on the same cores; protocol: the same traffic from "
                         "nodes speaking the NATS protocol themselves (bench/protocol_node.py), less client CPU")
    ap.add_argument("--profile", default=None, help="cProfile the first simulated-node process into this path")
    ap.add_argument("--root", default="/dev/shm")
    args = ap.parse_args()
    # SIGTERM (a timeout around the run): unwind, so each run's servers are stopped by PID and its store removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    global SERVER_BINARY
    SERVER_BINARY = args.nats_server
    modes = args.accounts.split(",")
    if "per-node" in modes and args.layout != "per-node":
        ap.error("--accounts per-node needs --layout per-node (a node account imports its own task stream)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 200000)), hard))
    logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "ERROR"))  # WARNING: the agents' warnings too
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-", dir=args.root) as tmp:
        for n in (int(x) for x in args.nodes.split(",")):
            for mode in modes:
                row = asyncio.run(run_one(n, args, Path(tmp), mode))
                print(json.dumps(row), flush=True)
                rows.append(row)
                shutil.rmtree(Path(tmp) / f"n{n}-{mode}", ignore_errors=True)
    print()
    print(" | ".join(h for _, h in COLUMNS))
    for row in rows:
        print(" | ".join(str(row.get(k)) for k, _ in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
