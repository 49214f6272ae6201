"""What a test needs, declared where the need is made: on the fixture or helper that starts a server.

A fixture, helper function or class that starts something a test must wait for (a server, a daemon,
a namespace, a guest, an agent) says so at its definition::

    @pytest.fixture
    @starts("libvirtd")
    def libvirtd(tmp_path): ...

    @starts("nats")
    class NatsServer: ...

``tests/conftest.py`` marks every collected test with the needs of the declared fixtures in its
closure and of the declared objects its code (and its module's fixtures and helpers) refers to; the
fast tier is a marker expression over them (docs/testing.md). ``starts()`` with no need declares a
helper whose process is cheap and private (an HTTP server on a free port, a lock holder): in the
fast tier, and said so. ``tests/test_tiers.py`` fails when a function that starts a process is not
declared, and when a test reaches a declared helper without carrying its marker.

Put ``@starts`` below ``@pytest.fixture`` (it must see the function itself). Code outside ``tests/``
(``lab/``, ``bench/``) does not import the test support: its modules are declared in
``NEEDS_BY_MODULE`` below instead.
"""

from __future__ import annotations

import ast
import inspect
import types
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

# Every need a declaration may name (registered as markers in pyproject.toml; --strict-markers is on).
NEEDS = frozenset({"lab", "crash", "deploy", "fleet", "libvirtd", "netns", "agent", "ovs", "nats", "loopdev"})

# Full name (module.qualname) of each declared fixture function, helper or class -> what it starts.
DECLARED: dict[str, tuple[str, ...]] = {}
# Fixture name -> what it starts, for the declared fixtures (a test asks for a fixture by name).
DECLARED_FIXTURES: dict[str, tuple[str, ...]] = {}

# Modules outside tests/ that start what a test waits for (a key names everything under it).
NEEDS_BY_MODULE: dict[str, tuple[str, ...]] = {
    "lab.harness": ("lab",),            # the lab-in-a-box
    "lab.nvme_guest": ("lab",),         # a TCG guest with QEMU's NVMe controller
    "lab.build_guest_image": ("lab",),  # the guest image, built from Debian packages
    "lab.igb_guest": ("lab",),          # a TCG guest with QEMU 10's igb SR-IOV NIC (docs/fabric-igb.md)
    "lab.qemu_backport": ("lab",),      # that QEMU, fetched from bookworm-backports
    "lab.systemd_manager": ("deploy",),  # a stand-in for systemd in a deploy root
    "lab.upstream": (),                 # a private HTTP server for the image tests (cheap, in the fast tier)
    "bench.protocol_node": ("fleet",),  # the fleet bench's nodes
    "bench.bench_fleet": ("fleet",),
    "bench.rate_server": ("netns",),    # nginx in a network namespace
    "bench.bench_idle": ("agent",),     # a whole agent, measured idle
    "bench.bench_guest_perf": ("lab",),  # guests on a GPU host
    "bench.bench_telemetry": ("lab",),  # --libvirt: TCG guests on a libvirtd it starts; no test runs it
}


def full_name(obj: object) -> str | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


def starts(*needs: str) -> Callable[[T], T]:
    """Declare what the decorated fixture function, helper or class starts (its tier markers); returns it unchanged."""
    unknown = set(needs) - NEEDS
    if unknown:
        raise ValueError(f"unknown needs {sorted(unknown)}: one of {sorted(NEEDS)}")

    def declare(obj: T) -> T:
        name = full_name(obj)
        if name is None:
            raise TypeError(f"@starts declares a function or a class, not {obj!r}")
        DECLARED[name] = tuple(needs)
        if callable(obj) and not isinstance(obj, type):
            DECLARED_FIXTURES.setdefault(getattr(obj, "__name__", ""), tuple(needs))
        return obj

    return declare


def needs_of_name(name: str) -> tuple[str, ...]:
    """The needs of a full name: its own declaration, its class's or module's (a key names everything under it)."""
    found: list[str] = []
    for table in (DECLARED, NEEDS_BY_MODULE):
        for key, needs in table.items():
            if name == key or name.startswith(key + "."):
                found += needs
    return tuple(found)


# -- the checks of tests/test_tiers.py ------------------------------------------------------------------------

# Code whose functions and classes a test's reach is followed into (the package itself starts nothing a test waits for).
FOLLOWED = ("tests.", "lab.", "bench.")
# Calls that start a process which outlives the call (subprocess.run and friends wait for theirs).
SPAWNERS = frozenset({"Popen", "create_subprocess_exec", "create_subprocess_shell"})


def functions_of(obj: object) -> Iterator[types.FunctionType]:
    """The function itself, or each method of a class (static, class methods and properties included)."""
    obj = inspect.unwrap(obj)  # type: ignore[arg-type]
    if isinstance(obj, types.FunctionType):
        yield obj
    elif isinstance(obj, type):
        for member in vars(obj).values():
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                yield member


def reached(fn: object, seen: set[int] | None = None) -> set[str]:
    """Full names of everything ``fn`` refers to, followed through every function and class of the test
    support, the lab and the benches it reaches, in any module (conftest's marking reads one module only)."""
    seen = set() if seen is None else seen
    names: set[str] = set()
    for function in functions_of(fn):
        if id(function.__code__) in seen:
            continue
        seen.add(id(function.__code__))
        referred: set[str] = set()
        stack = [function.__code__]
        while stack:
            code = stack.pop()
            referred.update(code.co_names)
            stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        scopes = [function.__globals__]  # and the followed modules it refers to (``harness.Lab``, ``support.x()``)
        scopes += [vars(m) for n in referred if isinstance(m := function.__globals__.get(n), types.ModuleType)
                   and m.__name__.startswith(FOLLOWED)]
        for name in referred:
            scope = next((s for s in scopes if name in s), None)
            if scope is None:
                continue
            target = scope[name]
            own = target.__name__ if isinstance(target, types.ModuleType) else full_name(inspect.unwrap(target))
            if own is None:
                continue
            names.add(own)
            if own.startswith(FOLLOWED) and not isinstance(target, types.ModuleType):
                names |= reached(target, seen)
    return names


def missing_markers(functions: list[object], markers: set[str]) -> dict[str, list[str]]:
    """Each need a declared helper reached from ``functions`` has that ``markers`` lack -> the helpers that need it."""
    missing: dict[str, list[str]] = {}
    seen: set[int] = set()
    names: set[str] = set()
    for fn in functions:
        own = full_name(inspect.unwrap(fn))  # type: ignore[arg-type]
        if own:
            names.add(own)
        names |= reached(fn, seen)
    for name in sorted(names):
        for need in needs_of_name(name):
            if need not in markers:
                missing.setdefault(need, []).append(name)
    return missing


def _declared(node: ast.AST) -> bool:
    for decorator in getattr(node, "decorator_list", ()):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (isinstance(target, ast.Name) and target.id == "starts") or \
                (isinstance(target, ast.Attribute) and target.attr == "starts"):
            return True
    return False


def undeclared_spawners(source: str, where: str) -> list[str]:
    """``where:line in function`` of each call in ``source`` that starts a process outliving it (``Popen``,
    ``create_subprocess_exec``) outside a function or class declared with ``@starts``."""
    found: list[str] = []

    def visit(node: ast.AST, declared: bool, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, declared or _declared(child), [*scope, child.name])
                continue
            if isinstance(child, ast.Call) and not declared:
                callee = child.func.attr if isinstance(child.func, ast.Attribute) else \
                    child.func.id if isinstance(child.func, ast.Name) else None
                if callee in SPAWNERS:
                    found.append(f"{where}:{child.lineno} in {'.'.join(scope) or 'the module'}")
            visit(child, declared, scope)

    visit(ast.parse(source), False, [])
    return found
