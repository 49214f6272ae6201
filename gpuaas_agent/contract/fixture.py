"""The manifest written next to a recorded host fixture (``OUT/.gpuaas-fixture/manifest.json``).

It says what was recorded, from where, what could not be and why, and which
commands ran. It carries no timestamps: two recordings of the same tree must be
byte-identical, so a fixture diff in review shows only what changed on the host.
"""

from __future__ import annotations

from pydantic import Field

from gpuaas_agent.contract.base import SCHEMA_VERSION, WireModel

# Where the recorder keeps its own files inside OUT (never a host path).
FIXTURE_META_DIR = ".gpuaas-fixture"
MANIFEST_NAME = "manifest.json"


class SkippedPath(WireModel):
    """A whitelisted host path that exists but could not be recorded."""

    path: str = Field(description="host path, e.g. /sys/class/dmi/id/product_serial")
    reason: str


class RecordedCommand(WireModel):
    """One command run on a live host; its stdout is saved under ``output_file``."""

    name: str
    argv: list[str]
    exit_code: int | None = Field(default=None, description="None when the command did not run or timed out")
    output_file: str | None = Field(default=None, description=f"relative to {FIXTURE_META_DIR}/")
    error: str | None = None


class FixtureManifest(WireModel):
    """Summary of one recording; ``files`` and ``links`` count host-tree entries only."""

    schema_version: str = SCHEMA_VERSION
    agent_version: str
    source_root: str
    live: bool
    hostname: str | None = None
    files: int = Field(ge=0)
    links: int = Field(ge=0)
    skipped: list[SkippedPath] = Field(default_factory=list)
    commands: list[RecordedCommand] = Field(default_factory=list)
