"""Records of a slot's OVS port and of the bridge it hangs on, as the OVS driver reports them.

The Interface row's ``external_ids`` are the contract between this agent, libvirt and
anything else on the host (the os-vif convention): ``iface-id``, ``attached-mac``,
``vm-uuid`` and our ownership marks ``gpuaas-allocation`` / ``gpuaas-slot``. A port
carrying ``gpuaas-allocation`` belongs to that allocation; nothing else is ours.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from pydantic import Field

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.naming import vnic_name
from gpuaas_agent.contract.types import UUID_PATTERN, MacAddress

# external_ids keys on the Interface row.
EXT_IFACE_ID = "iface-id"
EXT_ATTACHED_MAC = "attached-mac"
EXT_VM_UUID = "vm-uuid"
EXT_ALLOCATION = "gpuaas-allocation"
EXT_SLOT = "gpuaas-slot"

# A Linux interface name (IFNAMSIZ 16 with the NUL): OVS bridges and ports become netdevs.
IFNAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$"
IfName = Annotated[str, Field(pattern=IFNAME_PATTERN)]
Uuid = Annotated[str, Field(pattern=UUID_PATTERN)]

# Namespace of the deterministic iface-id (uuid5): the same allocation and slot always
# give the same id, so the domain XML's <virtualport><parameters interfaceid=...> and the
# OVS driver agree without sharing state.
IFACE_ID_NAMESPACE = uuid.UUID("6c0f1f7e-5a53-4c8e-9d3e-0a9d4f1b7a21")


def default_iface_id(allocation_id: str, slot_index: int) -> str:
    """The slot vNIC's ``iface-id``: uuid5 over its port name (itself derived from allocation and slot)."""
    return str(uuid.uuid5(IFACE_ID_NAMESPACE, vnic_name(allocation_id, slot_index)))


class OvsPort(WireModel):
    """One agent-owned port as ovsdb holds it (one Interface per Port; libvirt taps are never bonds)."""

    bridge: IfName
    name: IfName
    iface_id: str | None
    attached_mac: MacAddress | None
    vm_uuid: str | None
    allocation_id: Uuid
    slot_index: int | None = Field(ge=0, le=255)
    # None: vswitchd has not assigned one yet; -1: vswitchd could not open the netdev
    # (a tap libvirt has not created yet), and ``interface_error`` says why.
    ofport: int | None
    interface_error: str | None
    # 0 means no policing (the OVS default).
    ingress_policing_rate_kbps: int = Field(ge=0)
    ingress_policing_burst_kb: int = Field(ge=0)


class BridgeEvidence(WireModel):
    """What was seen (or made) of the bridge a slot's port goes on."""

    name: IfName
    # "" is OVS's default (the kernel "system" datapath); "netdev" is the userspace one.
    datapath_type: str
    created: bool
    ports: list[str]
