"""The one way the agent runs a host command: argv list, deadline, captured output, no shell.

Every driver goes through :func:`run` so timeouts, cancellation and error
evidence behave the same everywhere: a command that overruns is killed (its
whole process group), a cancelled caller leaves no child behind, and a failure
carries the argv, exit code and stderr an operator needs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuaas_agent.errors import HostError

STDERR_EVIDENCE_BYTES = 4096  # enough to show the error, not a whole log


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes


def _evidence(argv: Sequence[str], returncode: int | None, stderr: bytes) -> dict[str, Any]:
    return {
        "argv": list(argv),
        "returncode": returncode,
        "stderr": stderr[-STDERR_EVIDENCE_BYTES:].decode("utf-8", "replace"),
    }


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the child's process group and reap it (children of the child die too)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    await proc.wait()


async def run(
    argv: Sequence[str],
    *,
    timeout: float,
    check: bool = True,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
    on_stderr_chunk: Callable[[bytes], Awaitable[None] | None] | None = None,
    on_stdout_chunk: Callable[[bytes], Awaitable[None] | None] | None = None,
) -> Completed:
    """Run ``argv`` with a deadline of ``timeout`` seconds.

    ``check``: a non-zero exit raises :class:`HostError` (code ``command_failed``).
    ``on_stderr_chunk`` / ``on_stdout_chunk``: called with each chunk as it
    arrives (progress parsers: ``qemu-img -p`` writes to stdout); the output is
    still captured. A callback that raises stops the command like a timeout does.
    Raises ``HostError`` with code ``command_timeout`` or ``command_not_found``.
    """
    if isinstance(argv, str) or not argv:
        raise TypeError("argv must be a non-empty sequence of strings, never a shell string")
    argv = tuple(str(a) for a in argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # own process group: a timeout kills everything it started
        )
    except FileNotFoundError as exc:
        raise HostError(f"{argv[0]} is not installed", code="command_not_found", evidence={"argv": list(argv)}) from exc

    stdout_chunks: list[bytes] = []
    stderr_chunks: list[bytes] = []

    async def pump(stream: asyncio.StreamReader | None, into: list[bytes],
                   callback: Callable[[bytes], Awaitable[None] | None] | None) -> None:
        assert stream is not None
        while chunk := await stream.read(4096):
            into.append(chunk)
            if callback is not None:
                result = callback(chunk)
                if asyncio.iscoroutine(result):
                    await result

    async def communicate() -> None:
        if stdin is not None:
            assert proc.stdin is not None
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()
        await asyncio.gather(
            pump(proc.stdout, stdout_chunks, on_stdout_chunk),
            pump(proc.stderr, stderr_chunks, on_stderr_chunk),
        )
        await proc.wait()

    try:
        await asyncio.wait_for(communicate(), timeout)
    except TimeoutError:
        await _kill_group(proc)
        raise HostError(
            f"{argv[0]} did not finish within {timeout:g}s and was killed",
            code="command_timeout",
            evidence=_evidence(argv, proc.returncode, b"".join(stderr_chunks)),
        ) from None
    except BaseException:  # cancelled, or a callback raised: no child may outlive the caller
        await _kill_group(proc)
        raise
    stdout, stderr = b"".join(stdout_chunks), b"".join(stderr_chunks)
    if check and proc.returncode != 0:
        raise HostError(
            f"{argv[0]} exited with {proc.returncode}",
            code="command_failed",
            evidence=_evidence(argv, proc.returncode, stderr),
        )
    assert proc.returncode is not None  # waited for above
    return Completed(argv=argv, returncode=proc.returncode, stdout=stdout, stderr=stderr)


def run_sync(argv: Sequence[str], *, timeout: float, check: bool = True) -> Completed:
    """:func:`run` for synchronous readers (discovery's network evidence, the fixture recorder).

    Same rules: argv only, own process group killed on timeout, the same error codes.
    """
    if isinstance(argv, str) or not argv:
        raise TypeError("argv must be a non-empty sequence of strings, never a shell string")
    argv = tuple(str(a) for a in argv)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except FileNotFoundError as exc:
        raise HostError(f"{argv[0]} is not installed", code="command_not_found", evidence={"argv": list(argv)}) from exc
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group_sync(proc)
        raise HostError(f"{argv[0]} did not finish within {timeout:g}s and was killed", code="command_timeout",
                        evidence=_evidence(argv, proc.returncode, b"")) from None
    except BaseException:
        _kill_group_sync(proc)
        raise
    if check and proc.returncode != 0:
        raise HostError(f"{argv[0]} exited with {proc.returncode}", code="command_failed",
                        evidence=_evidence(argv, proc.returncode, stderr))
    return Completed(argv=argv, returncode=proc.returncode, stdout=stdout, stderr=stderr)


def spawn_reader(argv: Sequence[str], *, env: dict[str, str], pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """A child whose stdout is read while it runs (a download's ``curl``): argv only, pipes, own process group.

    The one exception to "run to completion with a timeout": the caller reads the output as it
    comes, so the caller owns the deadline (host/images/curlstream.py: no byte for the stall timeout,
    the whole download's timeout, a cancel) and kills the child by its PID when it gives up, then
    waits for it. stdin, stdout and stderr are pipes; ``env`` replaces the environment.
    """
    if isinstance(argv, str) or not argv:
        raise TypeError("argv must be a non-empty sequence of strings, never a shell string")
    argv = tuple(str(a) for a in argv)
    try:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, pass_fds=tuple(pass_fds), close_fds=True, start_new_session=True)
    except FileNotFoundError as exc:
        raise HostError(f"{argv[0]} is not installed", code="command_not_found", evidence={"argv": list(argv)}) from exc


def _kill_group_sync(proc: subprocess.Popen[bytes]) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()
