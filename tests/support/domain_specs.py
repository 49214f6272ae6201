"""Domain specs of a recorded H200 host's slots and of the lab's loop-device slot, as provision builds them.

Pinned inputs (the OVMF pair of a Debian host, seed 004's allocation): the domain XML goldens
and the lifecycle, guest-topology and start-guard tests all build from these.
"""

from __future__ import annotations

import functools

from gpuaas_agent.contract.domain import (
    DomainSpec,
    GuestSlot,
    OvmfFirmware,
)
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.discovery.bars import function_bars
from gpuaas_agent.discovery.numa import node_cpulist
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import REPO, fixture_host

H200 = HostRoot.open(fixture_host("h200-slice-after-transition"))
# Seed 004's first active smoke allocation.
ALLOCATION = "23bd713b-6073-4ef7-8a51-2897e902365d"
# What find_ovmf returns on a Debian/Ubuntu host with the ovmf package (pinned: goldens must not follow the CI host).
DEBIAN_OVMF = OvmfFirmware(
    code_path="/usr/share/OVMF/OVMF_CODE_4M.fd",
    vars_template_path="/usr/share/OVMF/OVMF_VARS_4M.fd",
    descriptor="/usr/share/qemu/firmware/60-edk2-x86_64.json",
)


@functools.cache
def candidate_slots() -> tuple:
    """The recorded H200 host's candidate slots as dicts (discovered once)."""
    return tuple(discover(H200).model_dump()["candidate_slots"])


def candidate_slot(index: int) -> dict:
    """Candidate slot ``index`` of the recorded H200 host."""
    return next(s for s in candidate_slots() if s["slot_index"] == index)


def production_spec(slot_index: int, **update) -> DomainSpec:
    """The spec provision builds for slot ``slot_index`` of the recorded H200 host (h200_1g_24c_64g)."""
    slot = candidate_slot(slot_index)
    fields = dict(
        allocation_id=ALLOCATION,
        slot_index=slot_index,
        task_id="task-provision-0001",
        profile=get_profile("h200_1g_24c_64g"),
        gpu_pci_address=slot["gpu_pci_address"],
        fabric_vf_pci_address=slot["fabric_vf_pci_address"],
        nvme_device=slot["nvme_device"],
        nvme_numa_node=slot["numa_node"],
        mac=slot["mac"],
        ovs_bridge=slot["ovs_bridge"],
        seed_iso_path=f"/var/lib/gpuaas/seeds/{ALLOCATION}.iso",
        serial_log_path=f"/var/log/gpuaas-agent/console/{ALLOCATION}-slot{slot_index}.log",
        numa_node=slot["numa_node"],
        numa_cpulist=node_cpulist(H200, slot["numa_node"]),
        firmware=DEBIAN_OVMF,
        agent_version="0.1.0",
        gpu_bars=function_bars(H200, slot["gpu_pci_address"]),
        fabric_vf_bars=function_bars(H200, slot["fabric_vf_pci_address"]),
    )
    fields.update(update)
    return DomainSpec(**fields)


def guest_slot(slot_index: int) -> GuestSlot:
    """Slot ``slot_index`` of the recorded host as a further slot of a multi-GPU domain."""
    spec = production_spec(slot_index)
    return spec.guest_slots()[0]


def multi_spec(slot_indexes: tuple[int, ...], **update) -> DomainSpec:
    """One allocation holding ``slot_indexes`` (the first boots the image)."""
    first, *rest = slot_indexes
    return production_spec(first, extra_slots=[guest_slot(i) for i in rest], **update)


def lab_spec(**update) -> DomainSpec:
    """The spec of the lab's loop-device slot 1 (lab_tcg_1c_512m, no GPU)."""
    fields = dict(
        allocation_id="158ea147-0115-407f-bbd5-1850c32b9517",
        slot_index=1,
        task_id="lab-task-1",
        profile=get_profile("lab_tcg_1c_512m"),
        nvme_device="/dev/disk/by-id/gpuaas-lab-loop-slot1",
        mac="02:00:00:00:01:01",
        ovs_bridge="ovsbr0",
        seed_iso_path="/var/lib/gpuaas/seeds/lab.iso",
        firmware=DEBIAN_OVMF,
        serial_log_path="/var/log/gpuaas/lab-slot1-serial.log",
        agent_version="0.1.0",
    )
    fields.update(update)
    return DomainSpec(**fields)


# The domain XML goldens (tests/golden/domain/<name>.xml) and the spec each pins; Regenerate with
# ``UPDATE_GOLDEN=1 pytest tests/host/vm/test_domain_xml.py``. test_domain_config.py round-trips every one.
GOLDEN_DOMAINS = REPO / "tests" / "golden" / "domain"
GOLDEN_SPECS = {
    "h200-slot0-numa0": lambda: production_spec(0),
    "h200-slot5-numa1": lambda: production_spec(5),
    # Multi-GPU guests of one allocation on the 8xH200 host (issue 20): 1 GPU is h200-slot0-numa0.
    "h200-2gpu-numa0": lambda: multi_spec((0, 1)),
    "h200-4gpu-2numa": lambda: multi_spec((2, 3, 4, 5)),
    "h200-8gpu": lambda: multi_spec(tuple(range(8))),
    "lab-tcg": lab_spec,
}
