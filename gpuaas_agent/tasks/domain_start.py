"""Starting a slot's domain the one guarded way, shared by provision's ``start`` step and ``slice.vm_power``.

A start is the moment a guest gets the GPU, the VF and the raw disk, so every
start goes through the same sequence, whoever asks for it:

1. the PCI functions the profile passes through are still isolated (every member
   of their IOMMU groups approved, on vfio-pci, or a bridge: docs/safety.md §3) — for a
   multi-slot allocation every slot's GPU and VF, not only the boot slot's;
2. the disk guard, with the slot's :class:`DiskLease` and the block disks of every
   *other* running domain (§4.1) — and the same guard for every data disk of the
   allocation, each under its own slot's lease;
3. the start guard: ``/dev/kvm``, the OVS bridge, hugepages on the node, devices on
   vfio-pci, the disk evidence (§4.4);
4. ``LibvirtLifecycle.start`` with that evidence;
5. the agent's ``external_ids`` put back on the OVS port: libvirt re-creates the port
   at every start with only its own ids, and reconcile and release find a slice's
   port by ours;
6. the port's isolation rules re-installed for the tap's (possibly new) ofport
   (docs/safety.md §9): a restarted guest is never switched NORMAL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuaas_agent.contract.domain import StartTarget
from gpuaas_agent.contract.ovs import OvsPort
from gpuaas_agent.contract.runtime import IngressPolicing
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.storage import DiskLease
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.guards.vfio import check_vfio_bindable
from gpuaas_agent.guards.vmstart import check_vm_start
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.isolation import isolate_port, opened_port


@dataclass(frozen=True)
class SlicePort:
    """The slot's vNIC as the agent owns it on OVS: name, MAC and reserved IP, owner ids, policing."""

    bridge: str
    vnic: str
    mac: str
    ip: str
    allocation_id: str
    slot_index: int
    policing: IngressPolicing | None = None
    guest_telemetry: bool = False  # the allocation opted in: the host may open the guest's exporter port


async def put_port(ovs: OvsDriver, port: SlicePort, vm_uuid: str) -> OvsPort:
    """Our port with our external_ids (idempotent): before define, and again after libvirt re-created it at start."""
    return await asyncio.to_thread(
        ovs.add_vm_port, port.bridge, port.vnic, mac=port.mac, vm_uuid=vm_uuid,
        allocation_id=port.allocation_id, slot_index=port.slot_index, iface_id=port.allocation_id,
        ingress_policing_rate_kbps=port.policing.rate_kbps if port.policing else None,
        ingress_policing_burst_kb=port.policing.burst_kb if port.policing else None)


async def guarded_start(drivers: SliceDrivers, target: StartTarget, *, disk_lease: DiskLease, port: SlicePort,
                        data_slots: Sequence[SlotLease] = ()) -> dict[str, Any]:
    """Run the guards of a start, start the domain, put the port's ids back; returns the evidence.

    ``data_slots``: the allocation's other leased slots (a multi-GPU domain): their GPUs/VFs and data
    disks are guarded exactly like the boot slot's before the domain gets them.

    A running domain is returned as it is by the lifecycle driver (after the guards held).
    Raises the first guard's typed refusal with nothing started.
    """
    name = target.domain_name
    groups: list[dict[str, Any]] = []
    if target.profile.hostdevs:
        approved = [a for a in (target.gpu_pci_address, target.fabric_vf_pci_address,
                                *(f for s in data_slots for f in (s.gpu_pci_address, s.fabric_vf_pci_address)))
                    if a is not None]
        for address in approved:
            bindable = await asyncio.to_thread(check_vfio_bindable, drivers.discovered_root().fresh(), address, approved)
            groups.append(bindable.model_dump(mode="json"))
    # Every defined domain's disks but this allocation's own domain (it holds the boot and the data disks).
    others = await drivers.libvirt.defined_domain_disks(exclude_allocation=disk_lease.allocation_id,
                                                        exclude_slot=disk_lease.slot_index)
    disk = await asyncio.to_thread(check_disk_writable, drivers.discovered_root(), target.nvme_device, lease=disk_lease,
                                   domain_disks=others)
    data_disks: list[dict[str, Any]] = []
    for held in data_slots:  # each data disk under its own slot's lease, never another domain's disk
        data_disks.append((await asyncio.to_thread(
            check_disk_writable, drivers.discovered_root(), held.nvme_device,
            lease=DiskLease(allocation_id=held.allocation_id, slot_index=held.slot_index,
                            nvme_device=held.nvme_device, disk_identity=held.disk_identity),
            domain_disks=others)).model_dump(mode="json"))
    async with drivers.ovs() as ovs:
        evidence = await asyncio.to_thread(
            check_vm_start, drivers.discovered_root() if target.profile.hostdevs else drivers.local_root(), target,
            bridge_exists=await asyncio.to_thread(ovs.bridge_exists, target.ovs_bridge), disk=disk)
        info = await drivers.libvirt.start(name, preconditions=evidence)
        # libvirt re-creates the port at start with only its own external_ids: put ours back.
        ovs_port = await put_port(ovs, port, info.uuid)
    ovs_port = await opened_port(drivers, ovs_port)  # the tap's ofport, so the in_port rules go in now
    isolation = await isolate_port(drivers, ovs_port, mac=port.mac, ip=port.ip, guest_telemetry=port.guest_telemetry)
    out: dict[str, Any] = {"state": info.state.value, "uuid": info.uuid, "preconditions": evidence.model_dump(mode="json"),
           "ofport": ovs_port.ofport, "isolation": isolation}
    if groups:
        out["iommu_groups"] = groups
    if data_disks:
        out["data_disks"] = data_disks
    return out
