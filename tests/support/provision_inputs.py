"""The inputs of a plan or a provision as the control plane would send them, made from a discovered host.

An approved slot is made from discovery's candidate (what an operator approves); the payloads,
the slice drivers pointed at a test host, and the task context the handlers get (journal and
progress on a real state store) are what the task tests of tests/tasks and tests/control share.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.slots import ApprovedSlot, SlotStatus
from gpuaas_agent.contract.tasks import PlanPayload, TaskEnvelope, VmProvisionPayload
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from tests.conftest import fixture_host

TENANT_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKq5Vd2K8mJ5yVtQ1N0d0m2dQ6Gq6x7o0cXbq3b8s9aF tenant"
LIBVIRT_TEST_URI = "test:///default"  # libvirt's in-process test driver: domains without a hypervisor
PLAN_ALLOCATION_ID = "23bd713b-6073-4ef7-8a51-2897e902365d"


@dataclass
class TaskCtx:
    """What a handler gets from the worker: the store (journal), the envelope, and a progress callback."""

    store: StateStore
    envelope: TaskEnvelope
    node_id: str = "node-1"
    resumed_steps: list = field(default_factory=list)
    slot_outcomes: list = field(default_factory=list)
    on_progress: object = None

    async def progress(self, step, status, *, percent=None, detail=None):
        if self.on_progress is not None:
            self.on_progress(step, status, percent)


def task_ctx(store: StateStore, task_id: str) -> TaskCtx:
    """The context of a ``slice.vm_provision`` task ``task_id`` (a redelivery: attempt 2) on ``store``."""
    envelope = TaskEnvelope(task_id=task_id, type="slice.vm_provision", node_id="node-1", attempt=2,
                            deadline=datetime.now(UTC) + timedelta(minutes=10), payload={})
    return TaskCtx(store=store, envelope=envelope)


def topology_of(name: str = "h200-slice-after-transition") -> TopologyReport:
    """Discovery's report of a fixture host."""
    return discover(HostRoot.open(fixture_host(name)))


def approved_slot(report: TopologyReport, index: int, **over) -> ApprovedSlot:
    """An operator-approved record made from the candidate, as the control plane stores it."""
    c = report.candidate_slots[index]
    fields = dict(slot_id=f"s-{index}", slot_index=index, gpu_pci_address=c.gpu_pci_address,
                  nvme_device=c.nvme_device, storage_identity_kind=c.storage_identity_kind,
                  fabric_vf_pci_address=c.fabric_vf_pci_address, fabric_claim_mode=c.fabric_claim_mode,
                  mac=c.mac, private_ip=c.private_ip, ovs_bridge=c.ovs_bridge, numa_node=c.numa_node,
                  status="reserved")
    fields.update(over)
    return ApprovedSlot(**fields)


def approved_slot_of_host(host, index: int, **over) -> ApprovedSlot:
    """The approved record of slot ``index`` of a loop-device host (``lab.loophost``), on bridge ovsbr0."""
    c = discover(HostRoot.open(host.root)).candidate_slots[index]
    fields = dict(slot_id=f"s-{index}", slot_index=index, gpu_pci_address=c.gpu_pci_address,
                  nvme_device=c.nvme_device, storage_identity_kind=c.storage_identity_kind,
                  fabric_vf_pci_address=c.fabric_vf_pci_address, fabric_claim_mode=c.fabric_claim_mode, mac=c.mac,
                  private_ip=c.private_ip, ovs_bridge="ovsbr0", numa_node=c.numa_node, status=SlotStatus.reserved)
    fields.update(over)
    return ApprovedSlot(**fields)


def plan_payload(*slots: ApprovedSlot, ids=None, alloc: str = PLAN_ALLOCATION_ID) -> PlanPayload:
    """A ``slice.plan`` payload approving ``slots`` (or only ``ids`` of them)."""
    return PlanPayload(allocation_id=alloc, approved_slot_ids=ids or [s.slot_id for s in slots], slots=list(slots))


def provision_payload(slot: ApprovedSlot, alloc: str | None = None, **over) -> VmProvisionPayload:
    """A ``slice.vm_provision`` payload for ``slot`` (a fresh allocation unless ``alloc``); ``over`` replaces fields."""
    fields = dict(allocation_id=alloc or str(uuid.uuid4()), slot=slot,
                  image={"url": "file:///nonexistent", "sha256": "0" * 64},
                  runtime_profile="lab_tcg_1c_512m", hostname="tenant-vm", user="tenant",
                  ssh_authorized_keys=[TENANT_KEY])
    fields.update(over)
    return VmProvisionPayload(**fields)


def slice_drivers_for(host, tmp_path, prepared=None) -> SliceDrivers:
    """Drivers over a test host; refusals before validate's host preconditions need no prepared host, a run past
    them does (``prepared``: tests.tasks.conftest's ``prepared_host``)."""
    if prepared is not None:
        config = SliceConfig(**prepared.slice_config())
    else:
        relay = tmp_path / "relay.pub"
        relay.write_text(TENANT_KEY + "\n")
        config = SliceConfig(allow_emulated_domains=True, terminal_relay_key_file=relay,
                             dnsmasq_hosts_file=tmp_path / "hosts", seed_dir=tmp_path / "seeds")
    return SliceDrivers(host_root=host.root, slice=config, images=ImageCache(tmp_path / "cache"),
                        libvirt=LibvirtLifecycle(LIBVIRT_TEST_URI))
