"""Base model for everything that crosses the wire or the disk.

Unknown fields are rejected: a control plane that sends a field this agent
does not know about is talking a different contract version, and guessing is
how hosts get wiped by mistake.

Models are *strict*: ``"2"`` is not the slot index 2 and ``"true"`` is not a
boolean (a hostile or buggy control plane must not have its input guessed
into shape). Data that arrived as JSON goes through :meth:`WireModel.from_wire`,
which validates in JSON mode, where an enum's value, an ISO datetime or an
IPv4 string are the legitimate spellings and still parse.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import to_json

from gpuaas_agent.compat import Self

# Bumped when a wire model changes shape; carried by every top-level message.
SCHEMA_VERSION: Final = "gpuaas.agent/v1"
# Compatible bump for multi-GPU slices: slice.vm_provision / slice.vm_release may carry ``slots`` (one allocation, N slots).
# Every v1 message is a valid v1.1 message; an envelope may name either, the agent accepts both.
SCHEMA_VERSION_MULTI_SLOT: Final = "gpuaas.agent/v1.1"
# Incompatible bump of the enrollment and credential messages only (tasks, results, heartbeats stay v1/v1.1):
# keys born on the node (only its public NKEY travels; the reply is a user JWT), the bootstrap token proven by an
# HMAC over a server nonce instead of sent, rotation as "new key pair, ask for a JWT", and the node's consumer
# created by the control plane (docs/contract.md "What a control plane implements").
SCHEMA_VERSION_AUTH: Final = "gpuaas.agent/v2"
SchemaVersionAuth = Literal["gpuaas.agent/v2"]
assert get_args(SchemaVersionAuth) == (SCHEMA_VERSION_AUTH,)
# The same versions as types for the models' schema_version fields (a Literal takes literal strings only).
SchemaVersion = Literal["gpuaas.agent/v1"]
SchemaVersionOrMultiSlot = Literal["gpuaas.agent/v1", "gpuaas.agent/v1.1"]
assert get_args(SchemaVersion) == (SCHEMA_VERSION,)
assert get_args(SchemaVersionOrMultiSlot) == (SCHEMA_VERSION, SCHEMA_VERSION_MULTI_SLOT)


class WireEnum(str, Enum):
    """An enum of the contract: its value is its one spelling, on the wire and in Python alike.

    Strict models would take only enum *instances* from Python code; a value
    such as ``"reserved"`` is not a coercion to guard against (JSON has no other
    way to say it), so enum fields stay lax while ints, bools and floats are strict.
    """

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        schema = handler(source)
        schema["strict"] = False
        return schema


class WireModel(BaseModel):
    """Strict, immutable pydantic model: ``extra="forbid"``, frozen, no type coercion."""

    # defer_build: a model's validator is built on its first use, not at import. The daemon imports ~300 wire
    # models and an idle one uses a few (heartbeat, result, lease): ~3 MiB of RSS at import
    # (tests/operator/test_idle_footprint.py; tests/contract/test_schemas.py builds every one, so a broken
    # model still fails the suite, not a task).
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False, strict=True, defer_build=True)

    @classmethod
    def from_wire(cls, data: Any) -> Self:
        """Validate JSON-decoded data (a dict from a message, a file or the store) with JSON's strict rules."""
        return cls.model_validate_json(to_json(data))


def first_error(exc: ValidationError) -> tuple[str, str]:
    """``(field, reason)`` of a validation error's first complaint: a one-line answer, not a dump.

    ``field`` is the dotted location (``ssh_authorized_keys.0``), ``(payload)``
    for a problem with the whole object.
    """
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return "(payload)", "does not match the contract"
    err = errors[0]
    field = ".".join(str(p) for p in err["loc"]) or "(payload)"
    reason = str(err.get("msg", "invalid"))
    if reason.startswith("Value error, "):  # our own validators' messages, without pydantic's prefix
        reason = reason[len("Value error, "):]
    reason = " ".join(reason.split())  # one line, whatever a validator said
    return field, reason[:300]
