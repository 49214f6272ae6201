"""Base model for everything that crosses the wire or the disk.

Unknown fields are rejected: a control plane that sends a field this agent
does not know about is talking a different contract version, and guessing is
how hosts get wiped by mistake.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Bumped when a wire model changes shape; carried by every top-level message.
SCHEMA_VERSION = "gpuaas.agent/v1"


class WireModel(BaseModel):
    """Strict, immutable pydantic model: ``extra="forbid"``, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)
