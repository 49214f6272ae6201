"""The agent's error hierarchy: every refusal is a value with a stable code.

A dependency-free leaf: every room, contract/ included, may import it.

An operator running hundreds of hosts acts on ``code`` and ``evidence``; the
``message`` is the one sentence a person reads. Catch narrowly, never turn one
of these into a warning.
"""

from __future__ import annotations

from typing import Any


class AgentError(Exception):
    """Base of every error the agent reports on purpose."""

    default_code = "agent_error"

    def __init__(self, message: str, *, code: str | None = None, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code
        self.message = message
        self.evidence = dict(evidence or {})

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class HostRootError(AgentError):
    """The host root given to the agent cannot be used."""

    default_code = "host_root_error"


class ContractError(AgentError):
    """Input from the wire or disk that does not match the contract."""

    default_code = "contract_error"


class FixtureError(AgentError):
    """Recording a fixture failed (output exists, unreadable source, ...)."""

    default_code = "fixture_error"


class HostError(AgentError):
    """A host command or file operation failed (the evidence names the command and its stderr)."""

    default_code = "host_error"


class GuardError(AgentError):
    """A safety guard refused an action; nothing was changed."""

    default_code = "guard_refused"
