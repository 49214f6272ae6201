"""OvsDriver (the ``ovs`` IDL, our poll/commit loop) vs ovsdbapp 3.0 on a real ovsdb-server + vswitchd.

Decides issue 15 item 4 (keep the IDL or adopt ovsdbapp) on numbers, printed as ratios:

1. footprint, each in a fresh interpreter that already imported the agent's OVS driver
   (the daemon does): RSS and threads after one connection — OvsDriver vs ovsdbapp's
   ``Connection`` + ``OvsdbIdl`` (the tables OvsDriver monitors only, and ovsdbapp's
   default ``register_all``); import time and modules ovsdbapp adds on top;
2. latency: add then remove one VM port, ``--iterations`` times (default 100), each
   op waiting until vswitchd applied it (``cur_cfg``), like ``ovs-vsctl`` —
   ``OvsDriver.add_vm_port``/``remove_vm_port`` vs ovsdbapp's own ``add_port`` +
   ``db_set`` external_ids / ``del_port`` in one ``OvsVsctlTransaction``
   (its commands verify what they read, as ours do). Blocks of each variant in
   turn (only that variant's connection open), medians. ``idl_nosync`` is OvsDriver
   without its pre-decision sync round trip, to show what that round trip costs;
3. semantics the decision rests on: whether a second ovsdbapp backend for another
   remote gets its own connection, and whether ovsdbapp's schema fetch returns
   from a server that accepts and never answers.

Needs root (the fixture's network namespace). Prints; never asserts a time.
    .venv/bin/python bench/bench_ovsdb.py [--iterations 100]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuaas_agent.contract.naming import vnic_name
from gpuaas_agent.host.network.ovs import _COLUMNS, OvsDriver
from tests.support.ovsdb_fixture import running_ovs

FOOTPRINT = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
remote, mode = sys.argv[2], sys.argv[3]
def rss_kib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
import gpuaas_agent.daemon, gpuaas_agent.host.network.ovs   # what the daemon has loaded anyway
before, modules, t0 = rss_kib(), len(sys.modules), time.perf_counter()
if mode == "idl":
    conn = gpuaas_agent.host.network.ovs.OvsDriver(remote)
    conn.list_agent_ports()
    imported_s = 0.0
else:
    from ovsdbapp.backend.ovs_idl import connection
    from ovsdbapp.schema.open_vswitch import impl_idl
    imported_s = time.perf_counter() - t0
    tables = None if mode == "ovsdbapp_all" else list(gpuaas_agent.host.network.ovs._COLUMNS)
    idl = connection.OvsdbIdl.from_server(remote, "Open_vSwitch", helper_tables=tables)
    api = impl_idl.OvsdbIdl(connection.Connection(idl, timeout=10))
    api.list_br().execute(check_error=True)
print(json.dumps({"rss_mib": (rss_kib() - before) / 1024, "threads": threading.active_count(),
                  "modules": len(sys.modules) - modules, "import_s": imported_s}))
"""


def footprint(remote: str, mode: str) -> dict:
    runs = []
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", FOOTPRINT, str(REPO), remote, mode],
                              capture_output=True, text=True, timeout=120, check=True)
        runs.append(json.loads(done.stdout))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def slot() -> dict:
    allocation_id = str(uuid.uuid4())
    return {"allocation_id": allocation_id, "slot_index": 3, "port_name": vnic_name(allocation_id, 3),
            "vm_uuid": str(uuid.uuid4()), "mac": "52:54:00:12:34:56"}


class _NoSyncDriver(OvsDriver):
    """OvsDriver without the read-your-writes round trip before each decision (what ovsdbapp does):
    only to show where the latency difference comes from; the agent never runs this."""

    def _sync(self, deadline: float) -> None:
        self._ready(deadline)


def idl_round(driver: OvsDriver, bridge: str) -> tuple[float, float]:
    s = slot()
    t0 = time.perf_counter()
    driver.add_vm_port(bridge, s["port_name"], mac=s["mac"], vm_uuid=s["vm_uuid"],
                       allocation_id=s["allocation_id"], slot_index=s["slot_index"])
    t1 = time.perf_counter()
    assert driver.remove_vm_port(bridge, s["port_name"], allocation_id=s["allocation_id"])
    return t1 - t0, time.perf_counter() - t1


def ovsdbapp_round(api, bridge: str) -> tuple[float, float]:
    s = slot()
    ids = {"iface-id": str(uuid.uuid4()), "attached-mac": s["mac"], "vm-uuid": s["vm_uuid"],
           "gpuaas-allocation": s["allocation_id"], "gpuaas-slot": "3"}
    t0 = time.perf_counter()
    with api.transaction(check_error=True, log_errors=False) as txn:
        txn.add(api.add_port(bridge, s["port_name"]))
        txn.add(api.db_set("Interface", s["port_name"], ("external_ids", ids)))
    t1 = time.perf_counter()
    api.del_port(s["port_name"], bridge=bridge).execute(check_error=True, log_errors=False)
    return t1 - t0, time.perf_counter() - t1


def semantics(remote_a: str, bridge_a: str) -> None:
    """Two facts the decision rests on, shown rather than asserted."""
    from ovsdbapp.backend.ovs_idl import connection, idlutils
    from ovsdbapp.schema.open_vswitch import impl_idl

    with running_ovs() as b:
        impl_idl.OvsdbIdl._ovsdb_connection = None
        apis = [impl_idl.OvsdbIdl(connection.Connection(
            connection.OvsdbIdl.from_server(remote, "Open_vSwitch", helper_tables=list(_COLUMNS)), timeout=10))
            for remote in (remote_a, b.remote)]
        seen = apis[1].list_br().execute(check_error=True)
        print(f"semantics: a backend made for {b.remote} (bridge {b.bridge}) lists {seen}: "
              f"{'its own server' if b.bridge in seen else 'the FIRST server (' + bridge_a + ')'}")
        apis[0].ovsdb_connection.stop()
        impl_idl.OvsdbIdl._ovsdb_connection = None
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        silent = socket.socket(socket.AF_UNIX)
        silent.bind(f"{d}/db.sock")
        silent.listen(4)
        def fetch() -> None:
            try:
                idlutils.fetch_schema_json(f"unix:{d}/db.sock", "Open_vSwitch")
            except Exception as exc:
                print(f"semantics: (ovsdbapp's fetch ended with {exc})")

        t = threading.Thread(target=fetch, daemon=True)
        started = time.monotonic()
        t.start()
        t.join(8)
        print(f"semantics: ovsdbapp fetch_schema_json on a silent server: "
              f"{'still blocked' if t.is_alive() else 'returned'} after {time.monotonic() - started:.1f} s")
        try:
            OvsDriver(f"unix:{d}/db.sock", timeout_s=2.0)
        except Exception as exc:
            print(f"semantics: OvsDriver on the same server: {getattr(exc, 'code', exc)} "
                  f"after {time.monotonic() - started - 8:.1f} s (timeout_s=2)")
        silent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    args = parser.parse_args()
    from ovsdbapp.backend.ovs_idl import connection
    from ovsdbapp.schema.open_vswitch import impl_idl

    with running_ovs() as sw:
        fp = {mode: footprint(sw.remote, mode) for mode in ("idl", "ovsdbapp_selected", "ovsdbapp_all")}
        for mode, f in fp.items():
            print(f"footprint {mode:18} +RSS {f['rss_mib']:5.2f} MiB  threads {f['threads']:.0f}  "
                  f"+modules {f['modules']:.0f}  import {f['import_s'] * 1000:.0f} ms")
        times: dict[str, list[tuple[float, float]]] = {"idl": [], "ovsdbapp": [], "idl_nosync": []}
        # Blocks of one variant at a time with only its own connection open: an idle
        # ovsdbapp connection's thread wakes for every update the other variant makes.
        for block in range(4):
            for variant in times:
                if variant == "ovsdbapp":
                    idl = connection.OvsdbIdl.from_server(sw.remote, "Open_vSwitch", helper_tables=list(_COLUMNS))
                    conn = connection.Connection(idl, timeout=10)
                    impl_idl.OvsdbIdl._ovsdb_connection = None  # a class attribute: else the first one wins
                    api = impl_idl.OvsdbIdl(conn)
                    def run(api=api) -> tuple[float, float]:
                        return ovsdbapp_round(api, sw.bridge)
                else:
                    driver = (OvsDriver if variant == "idl" else _NoSyncDriver)(sw.remote)
                    def run(driver=driver) -> tuple[float, float]:
                        return idl_round(driver, sw.bridge)
                for _ in range(3):
                    run()
                times[variant] += [run() for _ in range(max(1, args.iterations // 4))]
                if variant == "ovsdbapp":
                    conn.stop()
                else:
                    driver.close()
        med = {k: (statistics.median(a for a, _ in v) * 1000, statistics.median(r for _, r in v) * 1000)
               for k, v in times.items()}
        for k, (a, r) in med.items():
            print(f"latency {k:10} add {a:6.2f} ms  remove {r:6.2f} ms  (median of {len(times[k])})")
        print(f"ratio ovsdbapp/idl_nosync (neither syncs first): add {med['ovsdbapp'][0] / med['idl_nosync'][0]:.2f}x  "
              f"remove {med['ovsdbapp'][1] / med['idl_nosync'][1]:.2f}x")
        print(f"ratio ovsdbapp/idl: add {med['ovsdbapp'][0] / med['idl'][0]:.2f}x  "
              f"remove {med['ovsdbapp'][1] / med['idl'][1]:.2f}x  "
              f"RSS +{fp['ovsdbapp_selected']['rss_mib'] - fp['idl']['rss_mib']:.2f} MiB  "
              f"threads +{fp['ovsdbapp_selected']['threads'] - fp['idl']['threads']:.0f} per connection")
        semantics(sw.remote, sw.bridge)


if __name__ == "__main__":
    main()
