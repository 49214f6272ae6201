"""``gpuaas.enroll`` request/reply: a bootstrap token and host identity in, a node id and NATS credentials out."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gpuaas_agent.contract.base import SCHEMA_VERSION, WireModel
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN


class EnrollRequest(WireModel):
    schema_version: Literal[SCHEMA_VERSION] = SCHEMA_VERSION
    # repr=False keeps secrets out of logs and tracebacks; they still serialise onto the wire.
    bootstrap_token: str = Field(min_length=16, max_length=512, repr=False)
    machine_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    hostname: str = Field(min_length=1, max_length=253)
    dmi_serial: str | None = None
    maas_system_id: str | None = Field(default=None, pattern=r"^[a-z0-9]{4,12}$")
    agent_version: str


class NatsCredentials(WireModel):
    user: str = Field(min_length=1)
    password: str = Field(min_length=1, repr=False)
    servers: list[str] = Field(min_length=1)


class EnrollReply(WireModel):
    """Either ``node_id`` + ``credentials`` (accepted) or an ``error`` code (refused)."""

    schema_version: Literal[SCHEMA_VERSION] = SCHEMA_VERSION
    accepted: bool
    node_id: str | None = Field(default=None, pattern=NODE_ID_PATTERN)
    credentials: NatsCredentials | None = None
    error: Literal["token_invalid", "token_expired", "token_reused", "host_mismatch"] | None = None
    message: str | None = None
