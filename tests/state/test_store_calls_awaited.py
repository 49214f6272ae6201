"""Every store call inside a coroutine of the package is awaited.

``ctx.store`` is the :class:`~gpuaas_agent.state.aio.StoreThread`: its methods
return coroutines, so a call written without ``await`` silently never runs (a
journal line or a lease that is never written). The blocking view refuses the
loop thread at run time; this scan catches the missing ``await`` before it ships.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

STORE_NAMES = ("store", "state")


def _is_store_call(call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value
    return ((isinstance(owner, ast.Attribute) and owner.attr in STORE_NAMES)
            or (isinstance(owner, ast.Name) and owner.id in STORE_NAMES))


def unawaited_store_calls(source: str, name: str) -> list[str]:
    """``name:line: call`` for each store method call in an ``async def`` body that is not the operand of ``await``."""
    found: list[str] = []

    def visit(node: ast.AST, awaited: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return  # a nested def runs elsewhere (a worker thread, its own coroutine): scanned on its own
        if isinstance(node, ast.Call) and _is_store_call(node) and not awaited:
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:100]}")
        for child in ast.iter_child_nodes(node):
            visit(child, isinstance(node, ast.Await) and child is node.value)

    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.AsyncFunctionDef):
            for statement in fn.body:
                visit(statement, False)
    return found


def test_the_scan_finds_a_store_call_written_without_await():
    source = ("async def step(ctx, run):\n"
              "    await ctx.store.journal('t', 's', 'started', {})\n"
              "    ctx.store.journal('t', 's', 'succeeded', {})\n"
              "    lease = run.store.lease_for_slot(1)\n"
              "    def off_loop(store):\n"
              "        return store.leases()\n")
    assert [line.split(": ", 1)[0] for line in unawaited_store_calls(source, "m")] == ["m:3", "m:4"]


def test_every_store_call_in_a_package_coroutine_is_awaited():
    found: list[str] = []
    for path in sorted((REPO / "gpuaas_agent").rglob("*.py")):
        found += unawaited_store_calls(path.read_text(), str(Path(path).relative_to(REPO)))
    assert found == []
