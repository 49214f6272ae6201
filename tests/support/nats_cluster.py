"""A real 3-server JetStream cluster on loopback (docs/testing.md): one store dir each, each stopped by its PID.

Each member is a :class:`NatsServer` (127.0.0.1 only, foreground under ``Popen``) with a
server name and routes to the others on 127.0.0.1 ports. The members are spawned together
(a member's JetStream is up only once a meta leader is elected, which needs a quorum), then
readiness is a condition with a deadline: every member's ``/healthz`` says ok **and** its
``/jsz`` names the meta leader. :meth:`member` finds a member by the server name the cluster
reports (``ConsumerInfo.cluster.leader``), so a test can stop exactly the leader of an asset.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.nats_server import READY_DEADLINE_S, NatsServer, free_port
from tests.support.tiers import starts

CLUSTER_NAME = "gpuaas-test"


@starts("fleet")
class NatsCluster:
    """``size`` members named ``n1`` … ``n<size>``; :meth:`stop` stops every one still running."""

    def __init__(self, binary: str, root: Path, size: int = 3) -> None:
        self.names = [f"n{i + 1}" for i in range(size)]
        route_ports = [free_port() for _ in self.names]
        self.members: list[NatsServer] = []
        for name, port in zip(self.names, route_ports):
            store = root / name
            store.mkdir(parents=True)
            routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports if p != port)
            self.members.append(NatsServer(binary, store, root / f"{name}.log", extra_args=(
                "--server_name", name, "--cluster_name", CLUSTER_NAME,
                "--cluster", f"nats://127.0.0.1:{port}", "--routes", routes)))

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def member(self, name: str) -> NatsServer:
        return self.members[self.names.index(name)]

    def name_of(self, member: NatsServer) -> str:
        return self.names[self.members.index(member)]

    def start(self) -> None:
        for m in self.members:
            m.spawn()
        try:
            for m in self.members:
                m._wait_ready()
            self._wait_meta_leader()
        except BaseException:
            self.stop()
            raise

    def _wait_meta_leader(self) -> None:
        deadline = time.monotonic() + READY_DEADLINE_S
        seen: list = []
        while time.monotonic() < deadline:
            try:
                seen = [_get(m, "/jsz").get("meta_cluster", {}).get("leader") for m in self.members]
            except (OSError, urllib.error.URLError, ValueError) as exc:
                seen = [repr(exc)]
            if len(seen) == len(self.members) and all(leader in self.names for leader in seen):
                return
            # Poll interval of a readiness check with a deadline, not synchronisation by sleeping.
            time.sleep(0.1)
        raise RuntimeError(f"JetStream cluster has no meta leader every member knows within {READY_DEADLINE_S}s: {seen}")

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def _get(member: NatsServer, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{member.http_port}{path}", timeout=2) as resp:
        return json.load(resp)
