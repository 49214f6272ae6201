"""JSON Schemas of every wire model, generated from the pydantic models into ``docs/schemas/``.

The models are the single source; ``tests/contract/test_schemas.py`` fails when
the committed schemas drift. Regenerate: ``python -m gpuaas_agent.contract.schemas docs/schemas``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.dhcp import GuestReadiness, HostsFileJunk, LeaseStatus, Reservation
from gpuaas_agent.contract.domain import DefineOutcome, DomainInfo, ShutdownOutcome, UndefineOutcome, VmStartEvidence
from gpuaas_agent.contract.drift import DriftReport
from gpuaas_agent.contract.enrollment import CredsRotation, CredsRotationReply, EnrollReply, EnrollRequest
from gpuaas_agent.contract.images import CachedImage
from gpuaas_agent.contract.nvmewipe import WipePolicy
from gpuaas_agent.contract.ovs import BridgeEvidence, OvsPort
from gpuaas_agent.contract.parity import ParityReport, SliceNetworkEvidence
from gpuaas_agent.contract.plan import BundlePlan
from gpuaas_agent.contract.slots import ApprovedSlot
from gpuaas_agent.contract.storage import CloneResult, WipeProof
from gpuaas_agent.contract.tasks import PAYLOADS, ConsoleLogResult, Heartbeat, ProgressEvent, TaskEnvelope, TaskResult
from gpuaas_agent.contract.telemetry import SliceTelemetry
from gpuaas_agent.contract.terminal import (
    TerminalAudit,
    TerminalDataResult,
    TerminalInputFrame,
    TerminalOpenResult,
    TerminalOutputFrame,
    TerminalResizeResult,
)
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.contract.vfio import VfioBindResult

WIRE_MODELS: tuple[type[WireModel], ...] = (
    EnrollRequest,
    EnrollReply,
    CredsRotation,
    CredsRotationReply,
    TaskEnvelope,
    *PAYLOADS.values(),
    TaskResult,
    ProgressEvent,
    Heartbeat,
    DriftReport,
    ApprovedSlot,
    TopologyReport,
    # Records reported inside task outputs (plan, cleanup proof, clone, binding, image).
    BundlePlan,
    WipeProof,
    WipePolicy,  # a slot profile's wipe policy (seed 002 tenant isolation)
    CloneResult,
    VfioBindResult,
    CachedImage,
    # The slot vNIC as ovsdb holds it, and its bridge (slice.vm_provision / slice.reconcile outputs).
    OvsPort,
    BridgeEvidence,
    # slice.preflight output and the slice_network evidence beside the topology report.
    ParityReport,
    SliceNetworkEvidence,
    # The slot's libvirt domain: define/start/stop/undefine outcomes and start preconditions.
    DomainInfo,
    DefineOutcome,
    VmStartEvidence,
    ShutdownOutcome,
    UndefineOutcome,
    # The slot's DHCP reservation, junk found in the hosts file, and guest readiness (lease + SSH).
    Reservation,
    HostsFileJunk,
    LeaseStatus,
    GuestReadiness,
    # The terminal relay: task outputs, the session's frames on its .in/.out subjects, the audit record.
    TerminalOpenResult,
    TerminalDataResult,
    TerminalResizeResult,
    TerminalAudit,
    TerminalInputFrame,
    TerminalOutputFrame,
    # slice.console_log's output: the tail that fits the wire (cut_to_fit).
    ConsoleLogResult,
    # Slice telemetry, one message per allocation per interval on gpuaas.node.<node>.telemetry.<allocation>.
    SliceTelemetry,
)


def render() -> dict[str, str]:
    """File name -> schema text, deterministic (sorted keys, trailing newline)."""
    return {
        f"{model.__name__}.json": json.dumps(model.model_json_schema(mode="serialization"), indent=2, sort_keys=True) + "\n"
        for model in WIRE_MODELS
    }


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas")):
        print(path)
