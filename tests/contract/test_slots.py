"""Room for fractional GPUs: slots carry a sharing mechanism and a parent, and only whole devices are accepted."""

import json

import pytest

from gpuaas_agent.contract.slots import ApprovedSlot
from gpuaas_agent.contract.tasks import TaskType, parse_task, task_payload
from gpuaas_agent.contract.topology import CandidateSlot, SharingMechanism
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import ContractError
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import HOSTS
from tests.support.wire_samples import ALLOC, SLOT


def _release(slot: dict) -> bytes:
    return json.dumps({
        "schema_version": "gpuaas.agent/v1", "task_id": "t-1", "type": "slice.vm_release", "node_id": "node-1",
        "attempt": 1, "deadline": "2026-11-22T18:00:00Z", "payload": {"allocation_id": ALLOC, "slot": slot},
    }).encode()


def test_a_slot_without_the_new_fields_is_a_whole_device_with_no_parent():
    slot = ApprovedSlot.model_validate(SLOT)
    assert slot.sharing_mechanism is SharingMechanism.exclusive_device and slot.parent_slot_id is None


def test_an_explicit_exclusive_device_is_accepted():
    _, payload = task_payload(parse_task(_release(dict(SLOT, sharing_mechanism="exclusive_device",
                                                       parent_slot_id=None))))
    assert payload.slot.sharing_mechanism is SharingMechanism.exclusive_device


@pytest.mark.parametrize("mechanism", ["mig", "vgpu"])
def test_a_known_but_unimplemented_mechanism_is_an_invalid_payload_naming_the_field(mechanism):
    with pytest.raises(ContractError) as err:
        task_payload(parse_task(_release(dict(SLOT, sharing_mechanism=mechanism))))
    assert err.value.code == "invalid_payload"
    (error,) = err.value.evidence["errors"]
    assert error["loc"] == ("slot", "sharing_mechanism") and error["type"] == "sharing_mechanism_not_implemented"
    assert mechanism in error["msg"]
    json.dumps(err.value.evidence)  # the evidence goes into a result on the wire: plain JSON only


def test_an_unknown_mechanism_is_an_invalid_payload():
    with pytest.raises(ContractError) as err:
        task_payload(parse_task(_release(dict(SLOT, sharing_mechanism="time_slicing"))))
    assert err.value.code == "invalid_payload"
    assert err.value.evidence["errors"][0]["loc"] == ("slot", "sharing_mechanism")


def test_a_child_slot_with_a_parent_is_an_invalid_payload_naming_the_field():
    with pytest.raises(ContractError) as err:
        task_payload(parse_task(_release(dict(SLOT, parent_slot_id="s-0"))))
    assert err.value.code == "invalid_payload"
    (error,) = err.value.evidence["errors"]
    assert error["loc"] == ("slot", "parent_slot_id") and error["type"] == "parent_slot_not_implemented"
    json.dumps(err.value.evidence)


def test_a_plan_with_a_mig_slot_is_refused_too():
    envelope = json.loads(_release(SLOT))
    envelope.update(type=TaskType.plan.value, payload={"allocation_id": ALLOC, "approved_slot_ids": ["s-0"],
                                                       "slots": [dict(SLOT, sharing_mechanism="mig")]})
    with pytest.raises(ContractError) as err:
        task_payload(parse_task(json.dumps(envelope).encode()))
    assert err.value.evidence["errors"][0]["loc"] == ("slots", 0, "sharing_mechanism")


def test_discovery_emits_whole_device_candidate_slots():
    report = discover(HostRoot.open(HOSTS / "h200-slice-after-transition"))
    assert report.candidate_slots
    assert {c.sharing_mechanism for c in report.candidate_slots} == {SharingMechanism.exclusive_device}
    assert {c.parent_slot_id for c in report.candidate_slots} == {None}
    dumped = report.model_dump(mode="json")["candidate_slots"][0]
    assert dumped["sharing_mechanism"] == "exclusive_device" and dumped["parent_slot_id"] is None


def test_a_candidate_slot_claiming_mig_does_not_parse():
    candidate = discover(HostRoot.open(HOSTS / "h200-slice-after-transition")).candidate_slots[0]
    data = candidate.model_dump(mode="json")
    with pytest.raises(ValueError, match="sharing_mechanism"):
        CandidateSlot.model_validate(dict(data, sharing_mechanism="mig"))
    with pytest.raises(ValueError, match="parent_slot_id"):
        CandidateSlot.model_validate(dict(data, parent_slot_id="0"))
