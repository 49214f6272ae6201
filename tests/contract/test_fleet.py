"""Fleet payloads refuse hostile input at the edge: reasons that forge log lines, components of the wrong shape."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.fleet import (
    MAX_REASON_CHARS,
    ComponentRef,
    MaintenancePayload,
    QuarantinePayload,
    UnquarantinePayload,
)
from gpuaas_agent.contract.tasks import TaskEnvelope, TaskType, task_payload
from gpuaas_agent.errors import ContractError

GPU = "0000:18:00.0"
DISK = "eui:000000000000000100a075244a103331"

HOSTILE_REASONS = {
    "empty": "",
    "blank": "   ",
    "newline forges a log line": "disk swap\nevent=host_drained reason=forged",
    "carriage return": "ok\rFAKE",
    "escape sequence": "\x1b[2J\x1b[31mcleared",
    "nul": "a\x00b",
    "DEL": "a\x7fb",
    "C1 control": "a\x85b",
    "bidi override": "swap disk \u202etxt.exe",
    "zero-width joiner": "a\u200db",
    "line separator": "a\u2028b",
    "too long": "x" * (MAX_REASON_CHARS + 1),
}


@pytest.mark.parametrize("reason", HOSTILE_REASONS.values(), ids=HOSTILE_REASONS.keys())
def test_a_hostile_reason_is_refused_by_every_fleet_payload(reason):
    with pytest.raises(ValidationError):
        MaintenancePayload.from_wire({"mode": "on", "reason": reason})
    with pytest.raises(ValidationError):
        UnquarantinePayload.from_wire({"component": {"kind": "gpu", "identity": GPU}, "reason": reason})
    with pytest.raises(ValidationError):
        QuarantinePayload.from_wire({"component": {"kind": "gpu", "identity": GPU}, "reason": reason})


def test_a_plain_reason_with_unicode_text_is_taken():
    payload = MaintenancePayload.from_wire({"mode": "on", "reason": "BIOS 2.1 → 2.3, Ticket #4711 (Jörg)"})
    assert payload.reason.startswith("BIOS") and payload.requested_by == "control-plane"


@pytest.mark.parametrize("body", [
    {"mode": "maybe", "reason": "x"},
    {"mode": "on"},
    {"mode": "on", "reason": "x", "force": True},
    {"mode": True, "reason": "x"},
    {"mode": "on", "reason": "x", "requested_by": "eve\nroot"},
])
def test_a_maintenance_payload_that_is_not_one_is_refused(body):
    with pytest.raises(ValidationError):
        MaintenancePayload.from_wire(body)


@pytest.mark.parametrize("component", [
    {"kind": "gpu", "identity": DISK},  # a disk identity is not a GPU
    {"kind": "nvme", "identity": GPU},  # a PCI address is not a disk identity
    {"kind": "nvme", "identity": "/dev/nvme3n1"},  # kernel names move on reboot: never an identity
    {"kind": "fabric_vf", "identity": "0000:18:00"},
    {"kind": "slot", "identity": "256"},
    {"kind": "slot", "identity": "-1"},
    {"kind": "slot", "identity": "٣"},  # a digit, but not ASCII
    {"kind": "psu", "identity": "1"},
    {"kind": "gpu", "identity": GPU, "serial": "x"},
    {"kind": "gpu", "identity": ""},
])
def test_an_unknown_or_misnamed_component_is_refused(component):
    with pytest.raises(ValidationError):
        ComponentRef.from_wire(component)


def test_each_kind_takes_its_own_identity():
    for kind, identity in (("gpu", GPU), ("fabric_vf", "0000:19:00.1"), ("nvme", DISK), ("slot", "7")):
        assert ComponentRef.from_wire({"kind": kind, "identity": identity}).identity == identity


def test_fleet_tasks_come_off_the_wire_as_invalid_payload_naming_the_field():
    envelope = TaskEnvelope.from_wire({
        "task_id": "t-1", "type": "slice.unquarantine", "node_id": "node-1", "attempt": 1,
        "deadline": "2030-01-01T00:00:00Z",
        "payload": {"component": {"kind": "nvme", "identity": GPU}, "reason": "fixed"}})
    with pytest.raises(ContractError) as refused:
        task_payload(envelope)
    assert refused.value.code == "invalid_payload" and refused.value.evidence["field"] == "component"
    ok = envelope.model_copy(update={"payload": {"component": {"kind": "nvme", "identity": DISK}, "reason": "fixed"}})
    assert task_payload(ok)[0] is TaskType.unquarantine
