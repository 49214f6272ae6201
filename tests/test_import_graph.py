"""The package's import graph: imports at the top of each module, rooms that only import downward, no cycles.

docs/architecture.md draws the rooms; :data:`LAYERS` is that drawing as data, lowest first. A
function-local import hides a cycle or an upward edge from the reader (and from this test's
graph), so there is none outside :data:`LAZY_IMPORTS`, where each entry carries the measured
reason it is deferred: an optional dependency, or an import cost a command or an idle daemon
should not pay. The scan reads the source (``ast``): nothing is imported, so it takes well under
a second.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "gpuaas_agent"

# Lowest first. A module may import modules of its own room and of rooms on lower lines, never a
# room on its own line or above it. A room is a directory of the package or a top-level module;
# ``host.run`` sits apart from ``host/``: it is the one way every room runs a program (STYLE.md),
# so discovery's readers use it while ``host/``'s drivers use discovery.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gpuaas_agent.compat",),  # Python 3.10 stand-ins for 3.11 names; the package's __init__ loads it first
    ("gpuaas_agent", "gpuaas_agent.errors", "gpuaas_agent.exitcodes"),  # version, typed errors, exit codes
    ("gpuaas_agent.contract",),  # what crosses the wire or the disk
    ("gpuaas_agent.atomicfile", "gpuaas_agent.hostfs", "gpuaas_agent.logs", "gpuaas_agent.host.run"),
    ("gpuaas_agent.config",),  # the config file's model: every room below the tasks reads its settings
    ("gpuaas_agent.discovery", "gpuaas_agent.state"),  # pure readers of a host root; the SQLite store
    ("gpuaas_agent.guards",),  # checks on discovered facts, called by the drivers
    ("gpuaas_agent.host",),  # side-effect drivers
    ("gpuaas_agent.deploy",),  # making a fresh host ready (prepare-host, relay key, baseline, user-data)
    ("gpuaas_agent.tasks",),  # one handler per task type; the registry; the slice drivers
    ("gpuaas_agent.control",),  # NATS: connection, enrollment, the worker that runs the registry's handlers
    ("gpuaas_agent.operator",),  # health, metrics, status, heartbeat
    ("gpuaas_agent.daemon",),  # the one wiring point
    ("gpuaas_agent.cli",),
    ("gpuaas_agent.__main__",),  # python -m gpuaas_agent
)

_CLI_COST = ("a subcommand imports its room when it runs: `gpuaas-agent --version`/`--help` take ~55 ms, "
             "importing the daemon ~950 ms, parity ~420 ms, status ~290 ms, discover ~230 ms (python -X importtime, "
             "2-core CI host)")
_PYROUTE2 = ("pyroute2 costs ~185 ms at import and only a read of the live host's netlink needs it, not the "
             "readers of a recorded root (parity --root, the guards, `status --no-checks`)")
_SEED_ISO = ("an idle daemon never builds a seed ISO: pycdlib and PyYAML stay out of its memory "
             "(tests/operator/test_idle_footprint.py, bench/bench_idle.py)")
_NVML = "pynvml is the optional `nvml` extra: a host without an NVIDIA driver has none"
_SUSHY = ("sushy and requests cost ~105 ms and ~6 MiB RSS at import (python -X importtime, 2-core CI host) and only "
          "a host with a [bmc] table reads a BMC: an idle daemon without one never pays them")
_ASYNCSSH = ("asyncssh (and the cryptography modules it loads) costs ~10 MiB RSS at import (python -X importtime "
             "and /proc/self/status, 2-core CI host) and only an open terminal session uses it: an idle daemon never "
             "pays it (tests/operator/test_idle_footprint.py)")
_HTTPX = ("httpx (with click and pygments through its CLI module) is only the range reads of a cache hit under another "
          "URL; downloads go through curl: an idle daemon never pays it (tests/operator/test_idle_footprint.py)")
_LIBVIRT = ("libvirt-python (~11 MiB RSS with libvirt.so.0 and the ~20 libraries it links, /proc/self/status) is imported "
            "by the drivers' first libvirt connection: a host with no domain answers the health round's libvirtd check and "
            "the timer reconcile's listing through a virsh -r child (host/vm/virsh.py) and never loads it "
            "(tests/operator/test_idle_footprint.py, bench/bench_idle.py)")
_HANDLER_MODULE = ("a task handler's module (and what only it imports: provision's pipeline, release, the terminal relay) "
                   "is imported when the row's first task arrives (tasks/registry.py OnFirstTask): an idle daemon does "
                   "not carry code it may never run (tests/operator/test_idle_footprint.py)")
_SEALING = ("cryptography's X25519, AEAD, HKDF and serialization modules (with bcrypt through its ssh module, ~1.5 MiB "
            "RSS) seal and open credentials at enrollment and rotation only; a connected daemon signs its nonce with "
            "Ed25519 alone (tests/operator/test_idle_footprint.py)")
_ED25519_FALLBACK = ("cryptography's Rust binding (~8.8 MiB RSS, its own OpenSSL) signs only where the interpreter's libcrypto "
                     "cannot be reached (control/ed25519.py); a daemon whose _ssl links libcrypto never loads it "
                     "(tests/operator/test_idle_footprint.py)")
_SLOT_ONLY = ("code only a slot, a domain, a partition or a quarantine re-check runs (the domain XML model with "
              "xml.etree, an active slot's rebind, guarded start and power plan, the provision guards and GPU reset "
              "checks, the firmware re-check, preflight's readers, the GPU admin tool): an idle host's "
              "start, health round, isolation probe and reconcile never run it (tests/operator/test_idle_footprint.py)")

# "path:function" -> why its imports are deferred. Nothing else in the package imports inside a function.
LAZY_IMPORTS: dict[str, str] = {
    **{f"gpuaas_agent/cli.py:{fn}": _CLI_COST
       for fn in ("_cmd_discover", "_cmd_parity", "_cmd_status", "_cmd_record_fixture", "_cmd_run", "_cmd_enroll",
                  "_cmd_cloud_init", "_cmd_prepare_host", "_cmd_network_baseline", "_cmd_maintenance")},
    "gpuaas_agent/discovery/netevidence.py:_netlink": _PYROUTE2,
    "gpuaas_agent/discovery/netevidence.py:_read_netlink": _PYROUTE2,
    "gpuaas_agent/host/network/egress_readiness.py:read_conntrack": _PYROUTE2,
    **{f"gpuaas_agent/host/network/fabricvf.py:{fn}": _PYROUTE2 for fn in ("_ipr", "read", "apply", "stats")},
    "gpuaas_agent/host/vm/cloudinit.py:_dump": _SEED_ISO,
    "gpuaas_agent/host/vm/cloudinit.py:_pycdlib_modules_with_clock": _SEED_ISO,
    "gpuaas_agent/host/vm/cloudinit.py:_pin_pycdlib_clock": _SEED_ISO,
    "gpuaas_agent/host/vm/cloudinit.py:build_seed_iso": _SEED_ISO,
    "gpuaas_agent/discovery/nvml.py:enrich": _NVML,
    "gpuaas_agent/operator/nvml.py:_binding": _NVML,
    "gpuaas_agent/operator/bmc.py:_redfish": _SUSHY,
    "gpuaas_agent/operator/health.py:libvirtd_check_in_process": _LIBVIRT,
    **{f"gpuaas_agent/host/vm/libvirt_lifecycle.py:{fn}": _LIBVIRT
       for fn in ("_codes", "_close_quietly", "_is_loss", "_invoke", "_lookup", "_metadata", "op", "request",
                  "_defined_devices")},
    "gpuaas_agent/tasks/terminal.py:_client_key": _ASYNCSSH,
    "gpuaas_agent/tasks/terminal.py:open": _ASYNCSSH,
    "gpuaas_agent/host/images/httpfetch.py:read_ranges": _HTTPX,
    "gpuaas_agent/host/images/httpfetch.py:_read_range": _HTTPX,
    **{f"gpuaas_agent/control/ed25519.py:{fn}": _ED25519_FALLBACK for fn in ("sign", "public_key", "verify")},
    "gpuaas_agent/control/enroll.py:_open_reply": _SEALING,
    "gpuaas_agent/control/enroll.py:enroll": _SEALING,
    "gpuaas_agent/control/rotation.py:_rotate": _SEALING,
    **{f"gpuaas_agent/host/vm/libvirt_lifecycle.py:{fn}": _SLOT_ONLY
       for fn in ("define", "parse_domain_devices", "domain_devices")},
    **{f"gpuaas_agent/tasks/boot_recovery.py:{fn}": _SLOT_ONLY for fn in ("rebind", "recover_slot")},
    "gpuaas_agent/tasks/drivers.py:gpu_admin": _SLOT_ONLY,
    "gpuaas_agent/tasks/fabric_partitions.py:fabric_for": _SLOT_ONLY,
    "gpuaas_agent/tasks/recheck.py:recheck_firmware": _SLOT_ONLY,
    "gpuaas_agent/tasks/registry.py:preflight_sockets": _SLOT_ONLY,
    **{f"gpuaas_agent/tasks/registry.py:{fn}": _HANDLER_MODULE
       for fn in ("load_topology_discover", "load_preflight", "load_plan", "load_provision", "load_provision_recovery",
                  "load_release_set", "load_release_set_recovery", "load_reconcile", "load_power", "load_terminal_operation",
                  "load_console_log", "load_maintenance", "load_quarantine", "load_unquarantine")},
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted (a name imported from a package resolves to its submodule)
    path: str  # importing file, relative to the repository
    line: int
    function: str | None  # the enclosing function, when the import is function-local
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, names: list[str]) -> list[str]:
    """``from pkg import sub`` names the submodule when ``sub`` is one; otherwise the module itself."""
    base = REPO.joinpath(*module.split("."))
    if base.is_dir():
        found = [f"{module}.{n}" for n in names if (base / f"{n}.py").exists() or (base / n).is_dir()]
        return found if len(found) == len(names) else [*found, module]
    return [module]


def _imports_of(path: Path) -> list[Import]:
    source, rel = module_name(path), str(path.relative_to(REPO))
    found: list[Import] = []

    def visit(node: ast.AST, function: str | None, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name, type_only)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, function, True)
            elif isinstance(child, ast.Import | ast.ImportFrom):
                if isinstance(child, ast.ImportFrom):
                    assert child.level == 0, f"{rel}:{child.lineno}: relative import"
                    targets = _resolve(child.module or "", [a.name for a in child.names])
                else:
                    targets = [a.name for a in child.names]
                found.extend(Import(source, t, rel, child.lineno, function, type_only) for t in targets)
            else:
                visit(child, function, type_only)

    visit(ast.parse(path.read_text(), rel), None, False)
    return found


def package_imports() -> list[Import]:
    """Every import statement of the package (standard library and third-party ones included)."""
    return [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in _imports_of(path)]


def _in_package(module: str) -> bool:
    return module == "gpuaas_agent" or module.startswith("gpuaas_agent.")


def layer_of(module: str) -> tuple[int, str]:
    """The layer index and room of a package module (the longest entry of :data:`LAYERS` that names it)."""
    best: tuple[int, str] | None = None
    for index, rooms in enumerate(LAYERS):
        for room in rooms:
            matches = module == room or (room != "gpuaas_agent" and module.startswith(room + "."))
            if matches and (best is None or len(room) > len(best[1])):
                best = (index, room)
    assert best is not None, f"{module} is in no layer of LAYERS: add its room"
    return best


def test_no_function_local_imports_outside_the_reasoned_list():
    """Third-party and standard-library imports count too: the scan sees every import statement."""
    local = [i for i in package_imports() if i.function is not None]
    unlisted = sorted({f"{i.path}:{i.line} in {i.function}()" for i in local
                       if f"{i.path}:{i.function}" not in LAZY_IMPORTS})
    assert not unlisted, ("imports inside functions (move them to the top; a cycle is fixed by moving the shared "
                          "definition down a room, see docs/architecture.md): " + ", ".join(unlisted))
    stale = sorted(set(LAZY_IMPORTS) - {f"{i.path}:{i.function}" for i in local})
    assert not stale, f"LAZY_IMPORTS names functions that import nothing any more: {stale}"


def test_rooms_import_only_rooms_below_them():
    upward = []
    for imp in package_imports():
        if not _in_package(imp.target):
            continue
        (src_layer, src_room), (dst_layer, dst_room) = layer_of(imp.source), layer_of(imp.target)
        if src_room != dst_room and dst_layer >= src_layer:
            upward.append(f"{imp.path}:{imp.line} {src_room} -> {dst_room}")
    assert not upward, "imports of a room on the same line of LAYERS or above: " + "; ".join(upward)


def test_module_graph_has_no_cycle():
    """Within a room too: every import counts, type-only and deferred ones included."""
    graph: dict[str, set[str]] = {}
    for imp in package_imports():
        if _in_package(imp.target) and imp.target != imp.source:
            graph.setdefault(imp.source, set()).add(imp.target)
    cycles = [scc for scc in _strongly_connected(graph) if len(scc) > 1]
    assert not cycles, f"import cycles: {cycles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    result.append(sorted(scc))
    return result


def test_the_scan_sees_an_upward_edge_and_a_cycle():
    """The checks can fail: a graph with a cycle is found, and a contract module importing tasks is upward."""
    assert _strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"], ["c"]]
    assert layer_of("gpuaas_agent.contract.tasks")[0] < layer_of("gpuaas_agent.tasks.registry")[0]
    assert layer_of("gpuaas_agent.host.run")[1] == "gpuaas_agent.host.run"
    assert layer_of("gpuaas_agent.host.network.ovs")[1] == "gpuaas_agent.host"
    assert layer_of("gpuaas_agent")[1] == "gpuaas_agent"


def test_layers_name_every_room_of_the_package():
    rooms = {"gpuaas_agent." + p.stem for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    named = {room for line in LAYERS for room in line}
    assert rooms <= named, sorted(rooms - named)


# --- host/ sub-rooms ----------------------------------------------------------------------------------
# host/ is split by concern. A sub-room imports its own modules, the rooms on lower lines of LAYERS and
# host/run.py (a lower layer of its own: every room runs programs through it), never another sub-room
# sideways, except along an edge listed in HOST_EDGES with the reason it is there.
HOST = "gpuaas_agent.host"
HOST_ROOMS: tuple[str, ...] = ("network", "storage", "images", "vm", "devices")
# (importing sub-room, imported sub-room) -> why. None today: each driver's helpers sit in its own room
# (gpuhandover binds back through devices/vfio; streamclone writes through images/clone and images/stream;
# wipepolicy runs storage/blockwipe and storage/nvmewipe; domain_xml lays out vm/guest_topology).
HOST_EDGES: dict[tuple[str, str], str] = {}
# Modules that stay at host/ itself: shared by every sub-room.
HOST_SHARED: tuple[str, ...] = ("gpuaas_agent.host", "gpuaas_agent.host.run")


def host_room(module: str) -> str | None:
    """``gpuaas_agent.host.network.ovs`` -> ``network``; None for host/run.py and modules outside host/."""
    if module in HOST_SHARED or not module.startswith(HOST + "."):
        return None
    return module[len(HOST) + 1:].split(".")[0]


def sideways_host_imports(imports: list[Import]) -> list[str]:
    found = []
    for imp in imports:
        src, dst = host_room(imp.source), host_room(imp.target)
        if src and dst and src != dst and (src, dst) not in HOST_EDGES:
            found.append(f"{imp.path}:{imp.line} host/{src} -> host/{dst}")
    return found


def test_host_sub_rooms_import_each_other_only_along_listed_edges():
    """Type-only imports count too: a sideways edge under TYPE_CHECKING still couples the two rooms."""
    found = sideways_host_imports(package_imports())
    assert not found, ("an import across host/ sub-rooms: move the shared piece into the importing room or below "
                       "host/, or list the edge in HOST_EDGES with its reason: " + "; ".join(found))
    used = {(host_room(i.source), host_room(i.target)) for i in package_imports()}
    assert not (set(HOST_EDGES) - used), f"HOST_EDGES lists edges no import uses any more: {set(HOST_EDGES) - used}"


def test_every_host_module_sits_in_a_listed_sub_room():
    """Nothing flat at host/ but run.py: a new driver goes to the room of its concern (or a new, listed room)."""
    modules = {module_name(p) for p in (PACKAGE / "host").rglob("*.py")}
    flat = sorted(m for m in modules if m not in HOST_SHARED and host_room(m) not in HOST_ROOMS)
    assert not flat, f"host/ modules outside the sub-rooms {HOST_ROOMS}: {flat}"
    unlisted = sorted(p.name for p in (PACKAGE / "host").iterdir() if (p / "__init__.py").exists()
                      and p.name not in HOST_ROOMS)
    assert not unlisted, f"host/ sub-rooms not in HOST_ROOMS: {unlisted}"


def test_the_host_scan_sees_a_sideways_edge():
    edge = Import("gpuaas_agent.host.network.readiness", "gpuaas_agent.host.vm.sshrelay", "x.py", 1, None, False)
    down = Import("gpuaas_agent.host.network.readiness", "gpuaas_agent.host.run", "x.py", 2, None, False)
    inside = Import("gpuaas_agent.host.network.readiness", "gpuaas_agent.host.network.dnsmasq", "x.py", 3, None, False)
    assert sideways_host_imports([edge, down, inside]) == ["x.py:1 host/network -> host/vm"]
