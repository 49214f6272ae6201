"""``gpuaas.enroll`` request/reply: a bootstrap token and host identity in, a node id and NATS credentials out."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gpuaas_agent.contract.base import SCHEMA_VERSION, SchemaVersion, WireModel
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN


class EnrollRequest(WireModel):
    schema_version: SchemaVersion = SCHEMA_VERSION
    # repr=False keeps secrets out of logs and tracebacks; they still serialise onto the wire.
    bootstrap_token: str = Field(min_length=16, max_length=512, repr=False)
    machine_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    hostname: str = Field(min_length=1, max_length=253)
    dmi_serial: str | None = None
    maas_system_id: str | None = Field(default=None, pattern=r"^[a-z0-9]{4,12}$")
    agent_version: str


class NatsCredentials(WireModel):
    """How the node logs in: a NATS user ``.creds`` (JWT + NKEY seed; recommended) or user + password."""

    user: str | None = Field(default=None, min_length=1)
    password: str | None = Field(default=None, min_length=1, repr=False)
    # The text of a NATS user .creds file; the agent stores it as <state_dir>/nats.creds (0600).
    creds: str | None = Field(default=None, min_length=1, max_length=16384, repr=False)
    servers: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_login(self) -> NatsCredentials:
        if (self.creds is None) == (self.user is None or self.password is None):
            raise ValueError("either creds or user + password, not both and not neither")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together")
        return self


class CredsRotation(WireModel):
    """``gpuaas.node.<node>.creds``: the control plane's new ``.creds`` for this node (request/reply)."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    creds: str = Field(min_length=1, max_length=16384, repr=False)


class CredsRotationReply(WireModel):
    schema_version: SchemaVersion = SCHEMA_VERSION
    accepted: bool
    error: str | None = None
    message: str | None = None


class EnrollReply(WireModel):
    """Either ``node_id`` + ``credentials`` (accepted) or an ``error`` code (refused)."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    accepted: bool
    node_id: str | None = Field(default=None, pattern=NODE_ID_PATTERN)
    credentials: NatsCredentials | None = None
    error: Literal["token_invalid", "token_expired", "token_reused", "host_mismatch"] | None = None
    message: str | None = None
