"""The platform's terminal gateway, as the tests play it: one session's ``.out`` in, ``.in`` frames out."""

from __future__ import annotations

import asyncio
import base64

from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.terminal import TerminalInputFrame, TerminalOutputFrame

DEADLINE_S = 60.0  # a failure bound for every wait, never a timer


class Gateway:
    """The platform's terminal gateway: subscribes to ``.out`` first, sends ``.in`` frames in seq order."""

    def __init__(self, nc, session_id: str, *, node: str, auto_ack: bool = True) -> None:
        self.nc, self.session_id, self.auto_ack, self.node = nc, session_id, auto_ack, node
        self.frames: list[TerminalOutputFrame] = []
        self.output = bytearray()
        self.seq = 0
        self.changed = asyncio.Condition()

    async def start(self) -> Gateway:
        self.sub = await self.nc.subscribe(subjects.terminal_out(self.node, self.session_id), cb=self._on_out)
        await self.nc.flush()
        return self

    async def _on_out(self, msg) -> None:
        frame = TerminalOutputFrame.model_validate_json(msg.data)
        async with self.changed:
            assert frame.seq == len(self.frames) + 1, "the agent's .out frames come in seq order"
            assert frame.offset == len(self.output)
            self.frames.append(frame)
            self.output.extend(frame.raw)
            self.changed.notify_all()
        if self.auto_ack and frame.data:
            await self.send(b"")

    async def send(self, data: bytes, *, ack_out: int | None = None, seq: int | None = None) -> None:
        self.seq = self.seq + 1 if seq is None else seq
        frame = TerminalInputFrame(session_id=self.session_id, seq=self.seq, data=base64.b64encode(data).decode(),
                                   ack_out=len(self.output) if ack_out is None else ack_out)
        await self.nc.publish(subjects.terminal_in(self.node, self.session_id), frame.model_dump_json().encode())

    async def wait(self, predicate, timeout: float = DEADLINE_S):
        async def waiter():
            async with self.changed:
                while not (value := predicate(self)):
                    await self.changed.wait()
                return value

        return await asyncio.wait_for(waiter(), timeout)

    async def wait_for_output(self, marker: bytes, timeout: float = DEADLINE_S) -> None:
        await self.wait(lambda g: marker in g.output, timeout)

    async def wait_closed(self, timeout: float = DEADLINE_S) -> TerminalOutputFrame:
        return await self.wait(lambda g: next((f for f in g.frames if f.closed), None), timeout)
