"""Task messages from the wire: validated before anything happens, junk refused with a code."""

import json

import pytest

from gpuaas_agent.contract.enrollment import EnrollRequest
from gpuaas_agent.contract.tasks import TaskType, VmReleasePayload, parse_task, task_payload
from gpuaas_agent.errors import ContractError

SLOT = {
    "slot_id": "s-0", "slot_index": 0, "gpu_pci_address": "0000:18:00.0",
    "nvme_device": "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331",
    "storage_identity_kind": "nvme_eui_by_id", "fabric_vf_pci_address": "0000:19:00.1",
    "fabric_claim_mode": "per_slot_vf", "mac": "02:fd:b6:48:63:fd", "private_ip": "10.100.0.10",
    "ovs_bridge": "ovsbr0", "numa_node": 0, "status": "active",
}
ALLOC = "23bd713b-6073-4ef7-8a51-2897e902365d"


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


def test_bootstrap_token_stays_out_of_repr_but_reaches_the_wire():
    req = EnrollRequest(bootstrap_token="t" * 32, machine_id="1" * 32, hostname="j22u05", agent_version="0.1.0")
    assert "tttt" not in repr(req)
    assert json.loads(req.model_dump_json())["bootstrap_token"] == "t" * 32
