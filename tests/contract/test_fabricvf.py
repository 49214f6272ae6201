"""The fabric VF contract: the attachment the control plane sends, the identity the agent derives, the settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.fabricvf import (
    PARKING_MAC,
    PARKING_VLAN,
    EthernetAttachment,
    FabricVfIdentity,
    InfinibandAttachment,
    VfLinkState,
    derive_vf_identity,
    parked_settings,
    parking_guid,
    tenant_settings,
)
from gpuaas_agent.contract.tasks import PlanPayload, VmProvisionPayload


def _octet0(text: str) -> int:
    return int(text.split(":")[0], 16)


def test_identity_is_the_same_on_every_run_and_differs_per_slot_and_host():
    first = derive_vf_identity("machine-a", 3)
    assert derive_vf_identity("machine-a", 3) == first
    others = [derive_vf_identity("machine-a", i) for i in range(8) if i != 3] + [derive_vf_identity("machine-b", 3)]
    assert all(o.mac != first.mac and o.node_guid != first.node_guid and o.port_guid != first.port_guid for o in others)
    assert first.node_guid != first.port_guid


@pytest.mark.parametrize("slot", range(16))
def test_identity_is_locally_administered_unicast(slot):
    identity = derive_vf_identity("f3c7e0b2d1a94c8e9b7a6d5c4e3f2a1b", slot)
    for value in (identity.mac, identity.node_guid, identity.port_guid):
        assert _octet0(value) & 0x02, f"{value}: locally administered bit"
        assert not _octet0(value) & 0x01, f"{value}: group (multicast) bit"
    assert parking_guid("f3c7e0b2d1a94c8e9b7a6d5c4e3f2a1b", slot) not in (identity.node_guid, identity.port_guid)


@pytest.mark.parametrize("bad", [{"vlan": 0}, {"vlan": PARKING_VLAN}, {"vlan": 4095}, {"vlan": 10, "qos": 8},
                                 {"vlan": 10, "max_rate_mbps": 0}, {"vlan": 10, "mac": "02:00:00:00:00:01"},
                                 {"vlan": "10"}])
def test_ethernet_attachment_refuses_parking_vlan_and_out_of_range(bad):
    with pytest.raises(ValidationError):
        EthernetAttachment.from_wire({"kind": "ethernet", **bad})


@pytest.mark.parametrize("pkey", ["0x0000", "0x7fff", "0x8001", "0xffff", "0x12", "8001", "0X0012", "0x00A1"])
def test_infiniband_attachment_refuses_default_partition_and_bad_keys(pkey):
    with pytest.raises(ValidationError):
        InfinibandAttachment.from_wire({"kind": "infiniband", "pkey": pkey})


def test_infiniband_membership_bit_is_the_top_bit():
    assert InfinibandAttachment.from_wire({"kind": "infiniband", "pkey": "0x0012"}).pkey_with_membership == 0x8012
    limited = InfinibandAttachment.from_wire({"kind": "infiniband", "pkey": "0x0012", "membership": "limited"})
    assert limited.pkey_with_membership == 0x0012


def test_provision_and_plan_payloads_carry_the_attachment_by_kind():
    slot = {"slot_id": "s-0", "slot_index": 0, "gpu_pci_address": "0000:18:00.0",
            "nvme_device": "/dev/disk/by-id/nvme-eui.0001", "storage_identity_kind": "nvme_eui_by_id",
            "fabric_vf_pci_address": "0000:19:00.1", "fabric_claim_mode": "per_slot_vf", "mac": "02:00:00:00:00:01",
            "private_ip": "10.100.0.10", "ovs_bridge": "ovsbr0", "status": "reserved"}
    payload = VmProvisionPayload.from_wire({
        "allocation_id": "23bd713b-6073-4ef7-8a51-2897e902365d", "slot": slot,
        "image": {"url": "file:///x", "sha256": "0" * 64}, "hostname": "vm", "user": "tenant",
        "ssh_authorized_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKq5Vd2K8mJ5yVtQ1N0d0m2dQ6Gq6x7o0cXbq3b8s9aF t"],
        "fabric_attachment": {"kind": "infiniband", "pkey": "0x0012"}})
    assert isinstance(payload.fabric_attachment, InfinibandAttachment)
    plan = PlanPayload.from_wire({"allocation_id": "23bd713b-6073-4ef7-8a51-2897e902365d", "approved_slot_ids": ["s-0"],
                                  "slots": [slot], "fabric_attachment": {"kind": "ethernet", "vlan": 100, "qos": 3}})
    assert plan.fabric_attachment == EthernetAttachment(vlan=100, qos=3)
    with pytest.raises(ValidationError):
        PlanPayload.from_wire({"allocation_id": "23bd713b-6073-4ef7-8a51-2897e902365d", "approved_slot_ids": ["s-0"],
                               "slots": [slot], "fabric_attachment": {"kind": "roce", "vlan": 100}})


def test_tenant_settings_pin_identity_spoofchk_on_trust_off_link_auto():
    identity = FabricVfIdentity(mac="02:11:22:33:44:55", node_guid="02:00:00:00:00:00:00:01",
                                port_guid="02:00:00:00:00:00:00:02")
    eth = tenant_settings(4, identity, EthernetAttachment(vlan=100, qos=5, max_rate_mbps=25000))
    assert (eth.vf, eth.mac, eth.vlan, eth.qos, eth.spoofchk, eth.trust, eth.link_state, eth.max_tx_rate_mbps) == (
        4, identity.mac, 100, 5, True, False, VfLinkState.auto, 25000)
    assert eth.node_guid is None
    uncapped = tenant_settings(4, identity, EthernetAttachment(vlan=100))
    assert (uncapped.qos, uncapped.max_tx_rate_mbps) == (0, 0)  # an earlier tenant's priority or cap is cleared
    ib = tenant_settings(4, identity, InfinibandAttachment(pkey="0x0012"))
    assert (ib.node_guid, ib.port_guid, ib.link_state, ib.mac, ib.vlan) == (
        identity.node_guid, identity.port_guid, VfLinkState.auto, None, None)


def test_parked_settings_disable_the_link_and_leave_no_tenant_identity():
    eth = parked_settings(2, "ethernet", "02:aa:00:00:00:00:00:01")
    assert (eth.link_state, eth.vlan, eth.mac, eth.spoofchk, eth.trust, eth.max_tx_rate_mbps) == (
        VfLinkState.disable, PARKING_VLAN, PARKING_MAC, True, False, 0)
    ib = parked_settings(2, "infiniband", "02:aa:00:00:00:00:00:01")
    assert (ib.link_state, ib.node_guid, ib.port_guid) == (VfLinkState.disable,) + ("02:aa:00:00:00:00:00:01",) * 2
