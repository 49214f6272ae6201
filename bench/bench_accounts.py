"""What an account per node costs a nats-server: RSS and connect time, against one account with N users.

Usage: ``.venv/bin/python bench/bench_accounts.py [--nodes 100,1000,5000] [--concurrency 100]``

Per N, two servers in the same run, both operator mode with a full resolver (the same auth path:
a user JWT verified against its account, the account JWT read from the resolver's directory):

* ``single``: the control plane's account; N node users in it, each with ``node_permissions``;
* ``per-node``: the account-per-node layout of ``gpuaas_agent/control/accounts.py`` — the plane's
  account with its exports, N node accounts each with its 13 imports (one activation JWT each),
  one user per node account with the node's permissions under ``NODE_JS_API_PREFIX``.

Each node then connects once (the raw client protocol: INFO, CONNECT with JWT and nonce signature,
the agent's 3 subscriptions, PING/PONG), ``--concurrency`` at a time, and stays connected.
Reported: server RSS idle (accounts not yet loaded), RSS with all N connected, the time to connect
all N and the per-connection p50/p99, the time to connect all N again (accounts already loaded), the JWT bytes the resolver holds; then per-node/single ratios.
No assertion: figures only (docs/security-auth.md "What the layout costs").
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nkeys

from gpuaas_agent.contract import subjects
from gpuaas_agent.control.permissions import node_permissions
from tests.natsauth.fleet import FleetOperator
from tests.natsauth.natsjwt import ACCOUNT_LIMITS, Key, encode_jwt
from tests.support.nats_server import NatsServer

STREAM = "GPUAAS_TASKS"


def node_id(k: int) -> str:
    return f"bench-{k:05d}"


def user_jwt(account: Key, node: str, prefix: str) -> tuple[str, Key]:
    user = Key.new(nkeys.PREFIX_BYTE_USER)
    perms = node_permissions(node, prefix)
    claims = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1, "pub": {"allow": perms["publish"]},
              "sub": {"allow": perms["subscribe"]}, "resp": {"max": 1, "ttl": 0}}
    return encode_jwt(account, user.public, node, claims), user


def build(layout: str, n: int, root: Path) -> tuple[Path, list[tuple[str, str, Key]], int, float]:
    """The server config (resolver dir filled), each node's (id, user JWT, user key), the JWT bytes, build seconds."""
    start = time.monotonic()
    op = FleetOperator()
    jwt_dir = root / "jwt"
    jwt_dir.mkdir()
    logins: list[tuple[str, str, Key]] = []
    stored = 0
    for k in range(n):
        node = node_id(k)
        if layout == "per-node":
            account = op.node_account(node, STREAM)
            account_jwt = op.node_jwt(node)
            (jwt_dir / f"{account.public}.jwt").write_text(account_jwt)  # what `nsc push` leaves there
            stored += len(account_jwt)
            token, user = user_jwt(account, node, "gpuaas.js.API")
        else:
            token, user = user_jwt(op.account, node, "$JS.API")
        logins.append((node, token, user))
    if layout == "single":  # the plane's account without the exports: one account for everyone
        op.account_jwt = lambda: encode_jwt(op.key, op.account.public, "gpuaas", {  # type: ignore[method-assign]
            "type": "account", "version": 2, "limits": ACCOUNT_LIMITS})
    op.nodes.clear()  # node accounts come from the directory, not the config's preload
    config = root / "nats.conf"
    config.write_text(op.resolver_config(jwt_dir))
    stored += len(op.account_jwt())
    return config, logins, stored, time.monotonic() - start


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def login(port: int, node: str, token: str, user: Key) -> tuple[float, asyncio.StreamWriter]:
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    info = json.loads((await reader.readline())[5:])
    sig = base64.urlsafe_b64encode(user.sign(info["nonce"].encode())).rstrip(b"=").decode()
    connect = {"verbose": False, "pedantic": False, "jwt": token, "sig": sig, "protocol": 1, "headers": True,
               "no_responders": True, "name": node, "lang": "bench", "version": "0"}
    subs = [f"{subjects.inbox_prefix(node)}.>", subjects.creds(node), subjects.terminal_in_any(node)]
    writer.write(f"CONNECT {json.dumps(connect)}\r\n".encode()
                 + b"".join(f"SUB {s} {i}\r\n".encode() for i, s in enumerate(subs, 1)) + b"PING\r\n")
    await writer.drain()
    while True:
        line = await reader.readline()
        if not line:
            raise RuntimeError(f"{node}: connection closed")
        if line.startswith(b"-ERR"):
            raise RuntimeError(f"{node}: {line!r}")
        if line.startswith(b"PONG"):
            return time.monotonic() - start, writer
        if line.startswith(b"PING"):
            writer.write(b"PONG\r\n")


async def connect_all(port: int, logins: list[tuple[str, str, Key]], concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(login_):
        async with gate:
            return await login(port, *login_)
    start = time.monotonic()
    done = await asyncio.gather(*(one(x) for x in logins))
    return time.monotonic() - start, [t for t, _ in done], [w for _, w in done]


def run_one(layout: str, n: int, concurrency: int, binary: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"bench-acct-{layout}-") as tmp:
        root = Path(tmp)
        config, logins, stored, build_s = build(layout, n, root)
        (root / "store").mkdir()
        server = NatsServer(binary, root / "store", root / "nats.log", extra_args=("-c", str(config)))
        t0 = time.monotonic()
        server.start()
        ready_s = time.monotonic() - t0
        assert server.proc is not None
        idle = rss_mib(server.proc.pid)

        async def go():
            total, each, writers = await connect_all(server.port, logins, concurrency)
            connected = rss_mib(server.proc.pid)  # type: ignore[union-attr]
            for w in writers:
                w.close()
            # Every node again (a server's clients after a network blip): its account is loaded already.
            again, _, writers = await connect_all(server.port, logins, concurrency)
            for w in writers:
                w.close()
            return total, each, connected, again
        try:
            total, each, connected, again = asyncio.run(go())
        finally:
            server.stop()
        each.sort()
        return {"build_s": build_s, "ready_s": ready_s, "rss_idle_mib": idle, "rss_connected_mib": connected,
                "connect_all_s": total, "reconnect_all_s": again, "connect_p50_ms": statistics.median(each) * 1000,
                "connect_p99_ms": each[min(len(each) - 1, int(len(each) * 0.99))] * 1000,
                "jwt_kib": stored / 1024, "kib_per_node": connected * 1024 / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,1000", help="comma-separated fleet sizes")
    parser.add_argument("--concurrency", type=int, default=100, help="connects in flight at once")
    args = parser.parse_args()
    binary = shutil.which("nats-server")
    if binary is None:
        sys.exit("nats-server is not installed")
    sizes = [int(x) for x in args.nodes.split(",")]
    need = 2 * max(sizes) + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    version = __import__("subprocess").run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    print(f"{version.strip()}; concurrency {args.concurrency}")
    keys = ("rss_idle_mib", "rss_connected_mib", "kib_per_node", "connect_all_s", "reconnect_all_s", "connect_p50_ms", "connect_p99_ms",
            "ready_s", "jwt_kib", "build_s")
    print(f"{'N':>6} {'layout':>9} " + " ".join(f"{k:>17}" for k in keys))
    for n in sizes:
        rows = {layout: run_one(layout, n, args.concurrency, binary) for layout in ("single", "per-node")}
        for layout, row in rows.items():
            print(f"{n:>6} {layout:>9} " + " ".join(f"{row[k]:>17.2f}" for k in keys))
        ratio = {k: rows["per-node"][k] / rows["single"][k] if rows["single"][k] else float("nan") for k in keys}
        print(f"{n:>6} {'ratio':>9} " + " ".join(f"{ratio[k]:>17.2f}" for k in keys), flush=True)


if __name__ == "__main__":
    main()
