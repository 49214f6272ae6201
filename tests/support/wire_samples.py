"""Sample wire values as the control plane sends them: an approved slot record (dict) and its allocation id.

Seed 004's first smoke allocation on slot 0 of the recorded H200 host; the contract tests
parse task messages and slot records built from these.
"""

SLOT = {  # an approved, active slot record, as JSON gives it
    "slot_id": "s-0", "slot_index": 0, "gpu_pci_address": "0000:18:00.0",
    "nvme_device": "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331",
    "storage_identity_kind": "nvme_eui_by_id", "fabric_vf_pci_address": "0000:19:00.1",
    "fabric_claim_mode": "per_slot_vf", "mac": "02:fd:b6:48:63:fd", "private_ip": "10.100.0.10",
    "ovs_bridge": "ovsbr0", "numa_node": 0, "status": "active",
}
ALLOC = "23bd713b-6073-4ef7-8a51-2897e902365d"
