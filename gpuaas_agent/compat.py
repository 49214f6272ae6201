"""The few Python 3.11 APIs the agent uses, also on Python 3.10 (Ubuntu 22.04's python3).

Why: one ``.deb`` installs on Debian 12 (3.11), Ubuntu 22.04 (3.10) and Ubuntu 24.04
(3.12). Its venv is built against the distro's ``/usr/bin/python3`` because the distro's
libvirt, systemd and Open vSwitch bindings (python3-libvirt, python3-systemd,
python3-openvswitch) are compiled for that interpreter only; a newer interpreter on
22.04 would lose them. So the agent runs on 3.10, and every 3.11 name it needs comes
from here: on 3.11+ the standard library's own object, on 3.10 an equivalent.

- ``UTC``: ``datetime.UTC`` is ``datetime.timezone.utc``.
- ``StrEnum``: a ``str`` enum whose ``str()`` and ``format()`` are the value (3.11's contract).
- ``Self``: ``typing.Self``, else typing_extensions' (a locked dependency of pydantic).
- ``tomllib``: the stdlib module, else ``tomli`` (the project it was taken from; locked for 3.10).
- ``timeout``: ``asyncio.timeout``, else an equivalent that cancels the task at the deadline
  and raises ``TimeoutError``. Unlike 3.11's it cannot tell a cancellation from outside that
  lands in the same loop iteration as the deadline (3.10 has no ``Task.uncancel``): that one
  becomes ``TimeoutError`` too.
- ``TimeoutError``: from 3.11 ``asyncio.TimeoutError`` (what ``asyncio.wait_for`` raises) and
  ``concurrent.futures.TimeoutError`` *are* the builtin ``TimeoutError``, and the agent's
  ``except TimeoutError`` clauses rely on it. On 3.10 importing this module makes them the
  builtin too (gpuaas_agent/__init__.py imports it first, before nats-py subclasses
  ``asyncio.TimeoutError``), so a timed-out ``wait_for`` is caught the same on every supported
  Python. Nothing else is changed.

tests/test_compat.py keeps these names out of every other module.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timezone
from enum import Enum
from types import TracebackType
from typing import Any

__all__ = ["UTC", "Self", "StrEnum", "timeout", "tomllib"]

UTC = timezone.utc

if sys.version_info >= (3, 11):
    from asyncio import timeout
    from enum import StrEnum
    from typing import Self

    import tomllib
else:  # pragma: no cover - exercised by the Ubuntu 22.04 package test and the 3.10 unit run
    import asyncio.exceptions
    import concurrent.futures
    import concurrent.futures._base

    import tomli as tomllib
    from typing_extensions import Self

    asyncio.TimeoutError = TimeoutError  # type: ignore[misc, assignment]
    asyncio.exceptions.TimeoutError = TimeoutError  # type: ignore[misc, assignment]
    concurrent.futures.TimeoutError = TimeoutError  # type: ignore[misc, assignment]
    concurrent.futures._base.TimeoutError = TimeoutError  # type: ignore[misc, assignment]

    class StrEnum(str, Enum):
        """3.11's ``enum.StrEnum``: members are strings; ``str()`` and ``format()`` give the value."""

        def __str__(self) -> str:
            return str.__str__(self)

        def __format__(self, spec: str) -> str:
            return str.__format__(str.__str__(self), spec)

        @staticmethod
        def _generate_next_value_(name: str, start: int, count: int, last_values: list[Any]) -> str:
            return name.lower()

    class _Timeout:
        """``async with timeout(delay)``: the body is cancelled at the deadline and ``TimeoutError`` raised."""

        def __init__(self, delay: float | None) -> None:
            self._delay = delay
            self._task: asyncio.Task[Any] | None = None
            self._handle: asyncio.TimerHandle | None = None
            self._expired = False

        def expired(self) -> bool:
            return self._expired

        def _on_deadline(self) -> None:
            assert self._task is not None
            self._expired = True
            self._task.cancel()

        async def __aenter__(self) -> _Timeout:
            self._task = asyncio.current_task()
            if self._task is None:
                raise RuntimeError("timeout() must be used inside a task")
            if self._delay is not None:
                self._handle = asyncio.get_running_loop().call_later(max(self._delay, 0), self._on_deadline)
            return self

        async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                            tb: TracebackType | None) -> None:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            if self._expired and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def timeout(delay: float | None) -> _Timeout:
        """3.11's ``asyncio.timeout``: ``None`` waits forever, a delay <= 0 expires at the first await."""
        return _Timeout(delay)
