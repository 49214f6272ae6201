"""Task messages from the wire: validated before anything happens, junk refused with a code."""

import json

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.enrollment import EnrollRequest
from gpuaas_agent.contract.tasks import TaskType, VmReleasePayload, parse_task, task_payload
from gpuaas_agent.errors import ContractError
from tests.support.wire_samples import ALLOC, SLOT


def _envelope(**over):
    message = {
        "schema_version": "gpuaas.agent/v1", "task_id": "t-1", "type": "slice.vm_release", "node_id": "node-1",
        "attempt": 1, "deadline": "2026-11-22T18:00:00Z", "payload": {"allocation_id": ALLOC, "slot": SLOT},
    }
    message.update(over)
    return json.dumps(message).encode()


def test_a_valid_task_gives_its_typed_payload():
    task_type, payload = task_payload(parse_task(_envelope()))
    assert task_type is TaskType.vm_release and isinstance(payload, VmReleasePayload)
    assert payload.slot.nvme_device.startswith("/dev/disk/by-id/") and payload.graceful_timeout_s == 120


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"{}", _envelope(surprise=1), _envelope(schema_version="gpuaas.agent/v0"), _envelope(attempt=0)],
)
def test_junk_and_unknown_fields_are_invalid_messages(raw):
    with pytest.raises(ContractError) as err:
        parse_task(raw)
    assert err.value.code == "invalid_message"


def test_unknown_type_is_unsupported_not_a_crash():
    with pytest.raises(ContractError) as err:
        task_payload(parse_task(_envelope(type="slice.teleport")))
    assert err.value.code == "unsupported_task" and "slice.vm_provision" in err.value.evidence["supported"]


def test_payload_with_a_kernel_disk_name_is_refused():
    bad = dict(SLOT, nvme_device="/dev/nvme4n1")
    with pytest.raises(ContractError) as err:
        task_payload(parse_task(_envelope(payload={"allocation_id": ALLOC, "slot": bad})))
    assert err.value.code == "invalid_payload"
    assert err.value.evidence["errors"][0]["loc"] == ("slot", "nvme_device")


def test_the_enrollment_request_has_no_field_for_a_token_or_a_seed():
    """Contract v2: the token is proven (token_id + token_proof), the node's key travels as its public half only."""
    fields = set(EnrollRequest.model_fields)
    assert not fields & {"bootstrap_token", "token", "seed", "password", "creds", "private_key"}
    assert {"token_id", "server_nonce", "token_proof", "node_public_key"} <= fields
    with pytest.raises(ValidationError):  # what a v1 agent sends is refused, not half-read
        EnrollRequest.model_validate_json(json.dumps({"bootstrap_token": "t" * 32, "machine_id": "1" * 32,
                                                      "hostname": "j22u05", "agent_version": "0.1.0",
                                                      "reply_public_key": "A" * 43}))


# -- slice.vm_provision: the tenant's input is refused at the edge, one line naming the field ------------------

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIG81KbW458JUOjDcJx4OcOIor8JRkPZz7IlijLFZsgC tenant@laptop"


def _provision(**over):
    payload = {"allocation_id": ALLOC, "slot": dict(SLOT, status="reserved"),
               "image": {"url": "https://images.example/x.qcow2", "sha256": "0" * 64},
               "hostname": "gpu-box", "user": "tenant", "ssh_authorized_keys": [ED25519]}
    payload.update(over)
    return parse_task(_envelope(type="slice.vm_provision", payload=payload))


def _invalid(**over) -> ContractError:
    with pytest.raises(ContractError) as err:
        task_payload(_provision(**over))
    assert err.value.code == "invalid_payload"
    assert "\n" not in err.value.message and len(err.value.message) < 400, err.value.message
    assert err.value.message.startswith(f"payload of slice.vm_provision: {err.value.evidence['field']}: ")
    return err.value


def test_a_valid_provision_payload_is_accepted():
    assert task_payload(_provision())[1].ssh_authorized_keys == [ED25519]


@pytest.mark.parametrize("over, field", [
    ({"hostname": "gpu-box\n"}, "hostname"),
    ({"user": "tenant\n"}, "user"),
    ({"user": "root"}, "user"),
    ({"ssh_authorized_keys": ["ssh-ed25519 " + "A" * 600_000]}, "ssh_authorized_keys.0"),
    ({"ssh_authorized_keys": [ED25519 + "\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIG81KbW458JUOjDcJx4OcOIor8JRkPZz7IlijLFZsgC x"]},
     "ssh_authorized_keys.0"),
    ({"ssh_authorized_keys": ["ssh-dss AAAAB3NzaC1kc3MAAACBAP"]}, "ssh_authorized_keys.0"),
    ({"ssh_authorized_keys": ["ssh-ed25519 not*base64"]}, "ssh_authorized_keys.0"),
    ({"ssh_authorized_keys": [ED25519] * 33}, "ssh_authorized_keys"),
    ({"ssh_authorized_keys": []}, "ssh_authorized_keys"),
    ({"slot": dict(SLOT, status="reserved", private_ip="10.100.0.10\n")}, "slot.private_ip"),
    ({"slot": dict(SLOT, status="reserved", slot_index="2")}, "slot.slot_index"),
    ({"slot": dict(SLOT, status="reserved", slot_index=True)}, "slot.slot_index"),
    ({"allocation_id": ALLOC + "\n"}, "allocation_id"),
])
def test_tenant_input_is_invalid_payload_naming_the_field(over, field):
    err = _invalid(**over)
    assert err.evidence["field"] == field


def test_the_key_errors_say_why_in_one_line():
    assert "more than one line" in _invalid(ssh_authorized_keys=[ED25519 + "\nx"]).message or \
        "single line" in _invalid(ssh_authorized_keys=[ED25519 + "\nx"]).message
    assert "longer than 8192" in _invalid(ssh_authorized_keys=["ssh-ed25519 " + "A" * 600_000]).message
    assert "type must be one of" in _invalid(ssh_authorized_keys=["ssh-dss AAAA"]).message


def test_every_contract_pattern_refuses_a_trailing_newline():
    """Python's ``$`` matches before a trailing newline; pydantic's (Rust) regex does not. Prove it per type."""
    from pydantic import TypeAdapter

    from gpuaas_agent.contract.types import ByIdPath, DiskIdentity, IPv4String, KernelName, MacAddress, PciAddress

    good = {ByIdPath: "/dev/disk/by-id/nvme-eui.01", MacAddress: "02:00:00:00:00:01", PciAddress: "0000:18:00.0",
            KernelName: "nvme0n1", IPv4String: "10.0.0.1", DiskIdentity: "nguid:01"}
    for kind, value in good.items():
        adapter = TypeAdapter(kind)
        assert adapter.validate_python(value) == value
        with pytest.raises(ValueError):
            adapter.validate_python(value + "\n")
