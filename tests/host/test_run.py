"""The command runner: real processes, real timeouts, real cancellation."""

import asyncio
import time

import pytest

from gpuaas_agent.errors import HostError
from gpuaas_agent.host.run import run, run_sync, spawn_reader


def _running(pid: int) -> bool:
    """Alive and not a zombie (orphans may wait for a PID 1 that never reaps them)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pid: int, deadline_s: float = 10.0) -> bool:
    """SIGKILL is delivered asynchronously: wait (a failure bound, not a timer) for the process to die."""
    end = time.monotonic() + deadline_s
    while _running(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_output_and_exit_code_are_captured():
    done = asyncio.run(run(["sh", "-c", "echo out; echo err >&2"], timeout=10))
    assert done.stdout == b"out\n" and done.stderr == b"err\n" and done.returncode == 0


def test_failure_carries_argv_code_and_stderr():
    with pytest.raises(HostError) as err:
        asyncio.run(run(["sh", "-c", "echo boom >&2; exit 3"], timeout=10))
    assert err.value.code == "command_failed"
    assert err.value.evidence == {"argv": ["sh", "-c", "echo boom >&2; exit 3"], "returncode": 3, "stderr": "boom\n"}


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(HostError) as err:
        asyncio.run(run(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout=0.5))
    assert err.value.code == "command_timeout"
    assert _gone_within(int(pidfile.read_text()))


def test_cancellation_leaves_no_child(tmp_path):
    pidfile = tmp_path / "child.pid"

    async def scenario():
        task = asyncio.create_task(run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"], timeout=30))
        deadline = asyncio.get_running_loop().time() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert asyncio.get_running_loop().time() < deadline, "child never started"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert _gone_within(int(pidfile.read_text()))


def test_missing_tool_and_shell_strings_are_refused():
    with pytest.raises(HostError) as err:
        asyncio.run(run(["/nonexistent/tool"], timeout=5))
    assert err.value.code == "command_not_found"
    with pytest.raises(TypeError):
        asyncio.run(run("echo hi", timeout=5))


def test_stderr_progress_callback_sees_chunks():
    seen: list[bytes] = []
    asyncio.run(run(["sh", "-c", "printf '10%%\\r' >&2; printf '100%%\\r' >&2"], timeout=10, on_stderr_chunk=seen.append))
    assert b"".join(seen) == b"10%\r100%\r"


def test_stdout_callback_sees_chunks_and_output_is_still_captured():
    seen: list[bytes] = []
    done = asyncio.run(run(["sh", "-c", "printf '(50.00/100%%)\\r'"], timeout=10, on_stdout_chunk=seen.append))
    assert b"".join(seen) == b"(50.00/100%)\r" == done.stdout


def test_a_raising_callback_kills_the_child(tmp_path):
    pidfile = tmp_path / "child.pid"

    def explode(_chunk: bytes) -> None:
        raise RuntimeError("consumer broke")

    with pytest.raises(RuntimeError, match="consumer broke"):
        asyncio.run(run(["sh", "-c", f"echo $$ > {pidfile}; echo tick; exec sleep 60"], timeout=30, on_stdout_chunk=explode))
    assert _gone_within(int(pidfile.read_text()))


def test_run_sync_captures_output_and_refuses_like_run(tmp_path):
    done = run_sync(["sh", "-c", "echo out; echo err >&2; exit 4"], timeout=10, check=False)
    assert (done.stdout, done.stderr, done.returncode) == (b"out\n", b"err\n", 4)
    with pytest.raises(HostError) as failed:
        run_sync(["sh", "-c", "exit 4"], timeout=10)
    assert failed.value.code == "command_failed"
    with pytest.raises(HostError) as missing:
        run_sync(["no-such-tool-gpuaas"], timeout=10)
    assert missing.value.code == "command_not_found"
    with pytest.raises(TypeError):
        run_sync("echo shell string", timeout=10)


def test_run_sync_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(HostError) as err:
        run_sync(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout=0.5)
    assert err.value.code == "command_timeout"
    assert _gone_within(int(pidfile.read_text()))


def test_spawn_reader_gives_a_child_in_its_own_session_with_only_the_given_environment(tmp_path):
    with pytest.raises(TypeError):
        spawn_reader("echo hi", env={})
    proc = spawn_reader(["sh", "-c", 'read line; echo "$line:$ONLY"; ps -o sid= -p $$'], env={"ONLY": "x",
                        "PATH": "/usr/bin:/bin"})
    out, _ = proc.communicate(b"in\n", timeout=10)
    first, sid = out.decode().split("\n")[:2]
    assert first == "in:x" and int(sid) == proc.pid  # a session (and process group) of its own
    with pytest.raises(HostError) as err:
        spawn_reader([str(tmp_path / "absent")], env={})
    assert err.value.code == "command_not_found"


def test_no_module_starts_a_process_outside_host_run():
    """Every subprocess is an argv list with a timeout, through host/run.py only."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "gpuaas_agent"
    spawners = {("subprocess", n) for n in ("run", "Popen", "call", "check_call", "check_output", "getoutput")}
    spawners |= {("os", n) for n in ("system", "popen", "execv", "execvp", "spawnv", "fork")}
    spawners |= {("asyncio", "create_subprocess_exec"), ("asyncio", "create_subprocess_shell")}
    offenders = []
    for path in package.rglob("*.py"):
        if path == package / "host" / "run.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in spawners):
                offenders.append(f"{path.relative_to(package)}:{node.lineno} {node.func.value.id}.{node.func.attr}")
            # pyroute2's NetNS forks the daemon: the child shares asyncio's signal wake-up socket, and the
            # SIGTERM NetNS.close() sends it stopped the daemon (netevidence reads other namespaces with ip -n).
            if isinstance(node, ast.alias) and node.name == "NetNS":
                offenders.append(f"{path.relative_to(package)}:{node.lineno} imports pyroute2 NetNS")
    assert offenders == []
