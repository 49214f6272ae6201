"""The browser terminal relay of a slice (seed 004 "Slice Terminal Follow-Up"): tasks, frames, audit.

The platform's terminal gateway opens a session with ``slice.terminal_open``; from then on
bytes flow on two core-NATS subjects of the session (``contract/subjects.py``):

* ``gpuaas.node.<node>.terminal.<session>.in``: :class:`TerminalInputFrame`, gateway -> agent:
  keystrokes (``data``) and the gateway's credit for output (``ack_out``);
* ``gpuaas.node.<node>.terminal.<session>.out``: :class:`TerminalOutputFrame`, agent -> gateway:
  what the guest's PTY printed (``data``), how much input reached the guest (``ack_in``),
  and, once, ``closed`` with the session's totals and close reason.

Flow control is a credit window in each direction, counted in bytes of ``data``
(decoded): the agent never has more than ``output_window_bytes`` published and not yet
acknowledged by an ``ack_out`` (it stops reading the guest's PTY, so the guest's writes
block: nothing piles up in the agent), and the gateway must never have more than
``input_window_bytes`` sent beyond the last ``ack_in`` the agent published (the agent
closes a session that does: ``input_window_exceeded``). Frames of each direction carry a
``seq`` that starts at 1 and grows by one; a gap on ``.in`` (a frame lost or injected)
closes the session (``input_out_of_order``): a terminal stream with a hole is worse than none.

``slice.terminal_data`` / ``_resize`` / ``_close`` are tasks on the task stream like every
other: input for gateways that do not speak the session subjects, the PTY's size, the end.
Every field is written by whoever can publish a task: the target IP is the host's own
reservation of the slot (``target_host`` may only repeat it), the user a portable Linux
name (no option, no shell syntax), the session id a UUID.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints

from gpuaas_agent.contract.base import SCHEMA_VERSION, SchemaVersion, WireEnum, WireModel
from gpuaas_agent.contract.cloudinit import LinuxUserName
from gpuaas_agent.contract.types import UUID_PATTERN, IPv4String

# The most bytes one frame (or one terminal_data task) may carry, whatever the config says.
MAX_FRAME_BYTES = 64 << 10
_B64_MAX = 4 * ((MAX_FRAME_BYTES + 2) // 3)
BASE64_PATTERN = r"^[A-Za-z0-9+/]*={0,2}$"
# The gateway's name for who opened the session (a platform user or service id): audit only.
PRINCIPAL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}$"
TERM_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _check_b64(value: str) -> str:
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not standard base64 (padding)") from None
    return value


# Bytes of PTY data as base64 text, at most MAX_FRAME_BYTES decoded.
Base64Data = Annotated[str, StringConstraints(max_length=_B64_MAX, pattern=BASE64_PATTERN), AfterValidator(_check_b64)]


class CloseReason(WireEnum):
    """Why a session ended: the audit row's ``close_reason`` and the last frame's."""

    client_closed = "client_closed"  # slice.terminal_close
    remote_closed = "remote_closed"  # the guest's shell exited or its SSH server closed the channel
    connection_lost = "connection_lost"  # the SSH connection broke (guest gone, network)
    idle_timeout = "idle_timeout"
    absolute_timeout = "absolute_timeout"
    allocation_inactive = "allocation_inactive"  # the slot left `active` for this allocation (release, another lease)
    input_out_of_order = "input_out_of_order"  # an .in frame with the wrong seq: lost or injected
    input_window_exceeded = "input_window_exceeded"  # the gateway ignored the input credit
    protocol_error = "protocol_error"  # an .in frame that is not the contract's, or an impossible ack_out
    agent_shutdown = "agent_shutdown"
    agent_restarted = "agent_restarted"  # found open in the store after the agent died under it
    watchdog_failed = "watchdog_failed"  # the session's periodic check (recheck, byte tick) raised: closed, logged


class TerminalOpenPayload(WireModel):
    """Open an SSH PTY into the slice the allocation holds on ``slot_index``.

    ``session_id`` is the gateway's (it subscribes to ``.out`` before opening, so no byte is
    lost); it names the session's subjects and may be used once. ``target_host`` /
    ``target_port`` (what the seed's gateway sends) are optional and must equal the slot's
    reservation and the agent's configured SSH port: the connection always goes there.
    """

    session_id: str = Field(pattern=UUID_PATTERN)
    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int = Field(ge=0, le=255)
    user: LinuxUserName
    requested_by: str = Field(pattern=PRINCIPAL_PATTERN)
    capacity_shape: Literal["gpu_slice"] = "gpu_slice"
    target_host: IPv4String | None = None
    target_port: int | None = Field(default=None, ge=1, le=65535)
    term: str = Field(default="xterm-256color", pattern=TERM_PATTERN)
    cols: int = Field(default=80, ge=1, le=1000)
    rows: int = Field(default=24, ge=1, le=1000)


class TerminalDataPayload(WireModel):
    """Input for the session's PTY through the task stream (``data``: base64, at most 64 KiB decoded)."""

    session_id: str = Field(pattern=UUID_PATTERN)
    allocation_id: str = Field(pattern=UUID_PATTERN)
    data: Base64Data = Field(min_length=1)

    @property
    def raw(self) -> bytes:
        return base64.b64decode(self.data)


class TerminalResizePayload(WireModel):
    session_id: str = Field(pattern=UUID_PATTERN)
    allocation_id: str = Field(pattern=UUID_PATTERN)
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


class TerminalClosePayload(WireModel):
    """End a session; closing one that already ended answers its audit record (idempotent)."""

    session_id: str = Field(pattern=UUID_PATTERN)
    allocation_id: str = Field(pattern=UUID_PATTERN)


class TerminalInputFrame(WireModel):
    """Gateway -> agent on ``.in``: ``seq`` 1, 2, 3...; ``ack_out``: output bytes the gateway consumed in all."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    session_id: str = Field(pattern=UUID_PATTERN)
    seq: int = Field(ge=1)
    data: Base64Data = ""
    ack_out: int = Field(ge=0)

    @property
    def raw(self) -> bytes:
        return base64.b64decode(self.data)


class SessionTotals(WireModel):
    """What a session moved, in bytes of PTY data: ``bytes_in`` reached the guest, ``bytes_out`` left it."""

    bytes_in: int = Field(ge=0)
    bytes_out: int = Field(ge=0)


class TerminalClosed(WireModel):
    reason: CloseReason
    detail: str = Field(default="", max_length=500)
    totals: SessionTotals
    exit_status: int | None = None


class TerminalOutputFrame(WireModel):
    """Agent -> gateway on ``.out``: ``seq`` 1, 2, 3...; ``offset``: output bytes sent before this frame."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    session_id: str = Field(pattern=UUID_PATTERN)
    seq: int = Field(ge=1)
    offset: int = Field(ge=0)
    data: Base64Data = ""
    ack_in: int = Field(ge=0)
    closed: TerminalClosed | None = None

    @property
    def raw(self) -> bytes:
        return base64.b64decode(self.data)


class HostKeyPin(WireModel):
    """The guest's SSH host key as first seen for an allocation; later connections must present it."""

    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int = Field(ge=0, le=255)
    target_host: IPv4String
    public_key: str = Field(max_length=16384)  # OpenSSH one-line form
    fingerprint: str
    pinned_at: float


class TerminalOpenResult(WireModel):
    """``slice.terminal_open`` output: where to talk, the windows to respect, the guest's key."""

    session_id: str = Field(pattern=UUID_PATTERN)
    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int
    user: str
    target_host: IPv4String
    target_port: int
    subject_in: str
    subject_out: str
    host_key_fingerprint: str
    host_key_pinned: Literal["first_use", "matched"]
    output_window_bytes: int
    input_window_bytes: int
    max_frame_bytes: int
    idle_timeout_s: float
    max_session_s: float
    opened_at: datetime


class TerminalDataResult(WireModel):
    session_id: str = Field(pattern=UUID_PATTERN)
    bytes_written: int
    totals: SessionTotals


class TerminalResizeResult(WireModel):
    session_id: str = Field(pattern=UUID_PATTERN)
    cols: int
    rows: int


class TerminalAudit(WireModel):
    """One session as the store keeps it (and ``slice.terminal_close`` answers): who, where, when, how much."""

    session_id: str = Field(pattern=UUID_PATTERN)
    allocation_id: str = Field(pattern=UUID_PATTERN)
    slot_index: int
    requested_by: str
    user: str
    target_host: str
    target_port: int
    host_key_fingerprint: str
    open_task_id: str
    opened_at: float
    closed_at: float | None = None
    close_reason: CloseReason | None = None
    close_detail: str = ""
    bytes_in: int = 0
    bytes_out: int = 0
