"""A slot's fabric VF: the allocation's attachment, the identity the agent derives, what the kernel reports back.

Every slot hands its tenant a ConnectX-7 / BlueField-3 virtual function for GPUDirect RDMA
(docs/safety.md §15, docs/fabric.md). Without per-allocation settings two tenants' VFs share the
NIC's embedded switch (Ethernet: any MAC, any VLAN) or the subnet manager's default partition
(InfiniBand). The exchange with the control plane (docs/contract.md, "Fabric VF"):

1. discovery and ``slice.plan`` report each slot's :class:`FabricVfIdentity` (VF MAC, IB node and
   port GUID), derived here from the host identity and the slot index: the same on every run;
2. the control plane binds the GUIDs into the tenant's partition through its fabric manager (UFM)
   *before* it sends the provision;
3. the provision carries the :data:`FabricAttachment` (Ethernet VLAN + QoS + rate cap, or the
   InfiniBand partition key); the agent applies it with the identity to the VF, reads every value
   back and only then starts the domain; release parks the VF (:func:`parked_settings`).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import Field, field_validator

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.types import Guid, MacAddress

# VLAN 4095 is reserved by 802.1Q and the kernel refuses it (IFLA_VF_VLAN: vlan > 4095 is EINVAL and mlx5
# refuses 4095): the agent parks a released VF on 4094, so no tenant attachment may name 4094.
PARKING_VLAN = 4094
TENANT_VLAN_MAX = PARKING_VLAN - 1
# The default partition (0x7fff limited, 0xffff full): every port of the subnet is in it. A tenant bound to
# it shares it with everyone, so it is no tenant's partition.
DEFAULT_PKEY = 0x7FFF
# The MAC a parked VF gets: none (the kernel and mlx5 take all-zero as "no administrative MAC").
PARKING_MAC = "00:00:00:00:00:00"


class FabricIsolation(WireEnum):
    """Who keeps one tenant's fabric VF from another's (``[slice] fabric_isolation``, docs/fabric.md)."""

    required = "required"  # the agent applies and proves the attachment; a host that cannot refuses the provision
    single_tenant = "single_tenant"  # the operator's choice: one tenant per host, nothing applied (parity WARN)
    dpu_enforced = "dpu_enforced"  # the DPU's own switch enforces it (BF3 DPU mode / switchdev); host applies nothing


class EthernetAttachment(WireModel):
    """An Ethernet / RoCE VF: the allocation's VLAN (the VF's port VLAN; the guest sends untagged), an
    optional 802.1p priority and an optional transmit cap."""

    kind: Literal["ethernet"] = "ethernet"
    vlan: int = Field(ge=1, le=TENANT_VLAN_MAX, description=f"1..{TENANT_VLAN_MAX}; {PARKING_VLAN} is the parking VLAN")
    qos: int | None = Field(default=None, ge=0, le=7, description="802.1p priority of the port VLAN; None: 0")
    max_rate_mbps: int | None = Field(default=None, ge=1, le=1_600_000, description="VF transmit cap; None: uncapped")


class PkeyMembership(WireEnum):
    """The membership bit of the partition key the control plane bound the slot's GUIDs with."""

    full = "full"
    limited = "limited"


class InfinibandAttachment(WireModel):
    """An InfiniBand VF: the partition the control plane has bound the slot's GUIDs into (via UFM)."""

    kind: Literal["infiniband"] = "infiniband"
    pkey: str = Field(pattern=r"^0x[0-7][0-9a-f]{3}$",
                      description="15-bit partition key 0x0001..0x7ffe, lower-case hex, without the membership bit")
    membership: PkeyMembership = PkeyMembership.full

    @field_validator("pkey")
    @classmethod
    def _tenant_pkey(cls, value: str) -> str:
        number = int(value, 16)
        if not 0x0001 <= number <= DEFAULT_PKEY:
            raise ValueError("a partition key is 15 bits, 0x0001..0x7fff (the membership bit is `membership`)")
        if number == DEFAULT_PKEY:
            raise ValueError("0x7fff is the default partition every port is in: it isolates no tenant")
        return value

    @property
    def pkey_with_membership(self) -> int:
        """The 16-bit key as the subnet manager writes it (bit 15: full member)."""
        return int(self.pkey, 16) | (0x8000 if self.membership is PkeyMembership.full else 0)


FabricAttachment = Annotated[EthernetAttachment | InfinibandAttachment, Field(discriminator="kind")]


class FabricVfIdentity(WireModel):
    """A slot's fabric identity, derived from the host and slot (:func:`derive_vf_identity`), reported in
    discovery and in ``slice.plan`` so the control plane binds the GUIDs before the provision."""

    mac: MacAddress = Field(description="the VF's MAC: locally administered unicast")
    node_guid: Guid = Field(description="the VF's IB node GUID (IFLA_VF_IB_NODE_GUID)")
    port_guid: Guid = Field(description="the VF's IB port GUID (IFLA_VF_IB_PORT_GUID): what the partition binds")


def _octets(label: str, host_key: str, slot_index: int, count: int) -> bytes:
    raw = bytearray(hashlib.sha256(f"{label}/{host_key}/{slot_index}".encode()).digest()[:count])
    raw[0] = (raw[0] & 0xFC) | 0x02  # locally administered (bit 1), unicast / individual (bit 0 clear)
    return bytes(raw)


def _colon(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def derive_vf_identity(host_key: str, slot_index: int) -> FabricVfIdentity:
    """The slot's VF MAC and GUIDs: SHA-256 of ``gpuaas-fabric-vf-{mac,node-guid,port-guid}/<host key>/<slot>``,
    first 6 (MAC) or 8 (GUID, EUI-64) octets, first octet with the locally-administered bit set and the
    group bit clear. ``host_key`` is the discovery identity key (machine-id, else DMI product UUID, else
    hostname): stable across reboots and renames, different per host."""
    return FabricVfIdentity(mac=_colon(_octets("gpuaas-fabric-vf-mac", host_key, slot_index, 6)),
                            node_guid=_colon(_octets("gpuaas-fabric-vf-node-guid", host_key, slot_index, 8)),
                            port_guid=_colon(_octets("gpuaas-fabric-vf-port-guid", host_key, slot_index, 8)))


def parking_guid(host_key: str, slot_index: int) -> str:
    """The GUID a parked VF carries (node and port): never reported, so never bound into any partition."""
    return _colon(_octets("gpuaas-fabric-vf-parked-guid", host_key, slot_index, 8))


class VfLinkState(WireEnum):
    """IFLA_VF_LINK_STATE: ``auto`` follows the PF's link, ``disable`` keeps the VF down whatever the guest does."""

    auto = "auto"
    enable = "enable"
    disable = "disable"


class EswitchMode(WireEnum):
    """The PF's embedded switch (devlink ``eswitch show``): ``legacy`` takes per-VF settings on the PF;
    ``switchdev`` (and a BlueField-3 in DPU mode) enforces policy on representors / the DPU's own switch."""

    legacy = "legacy"
    switchdev = "switchdev"
    unknown = "unknown"


class VfSettings(WireModel):
    """One VF's settings as the PF holds them (wanted, or read back from IFLA_VFINFO_LIST).

    ``None``: the kernel did not report the value (a driver without GUIDs, a PF without rate limits);
    a wanted ``None`` is not compared.
    """

    vf: int = Field(ge=0, le=4095)
    mac: MacAddress | None = None
    vlan: int | None = Field(default=None, ge=0, le=4095)
    qos: int | None = Field(default=None, ge=0, le=7)
    spoofchk: bool | None = None
    trust: bool | None = None
    link_state: VfLinkState | None = None
    max_tx_rate_mbps: int | None = Field(default=None, ge=0)
    node_guid: Guid | None = None
    port_guid: Guid | None = None


class VfMismatch(WireModel):
    """One value the kernel holds that is not the wanted one."""

    field: str
    wanted: str
    found: str


FabricLinkKind = Literal["ethernet", "infiniband"]


def tenant_settings(vf: int, identity: FabricVfIdentity, attachment: FabricAttachment) -> VfSettings:
    """What the VF must hold while the allocation runs (docs/safety.md §15).

    Ethernet / RoCE: the identity's MAC, the attachment's VLAN + QoS and rate cap, spoof check on, trust
    off, link state auto. InfiniBand (an IPoIB PF takes no MAC, VLAN, spoof check or trust per VF): the
    identity's node and port GUID (what the control plane bound into the partition), link state auto.
    """
    if isinstance(attachment, EthernetAttachment):
        return VfSettings(vf=vf, mac=identity.mac, vlan=attachment.vlan, qos=attachment.qos or 0, spoofchk=True,
                          trust=False, link_state=VfLinkState.auto, max_tx_rate_mbps=attachment.max_rate_mbps or 0)
    return VfSettings(vf=vf, link_state=VfLinkState.auto, node_guid=identity.node_guid, port_guid=identity.port_guid)


def parked_settings(vf: int, kind: FabricLinkKind, guid: str) -> VfSettings:
    """A released VF, before the next tenant: link disabled, and for Ethernet the parking VLAN, no MAC, spoof
    check on, trust off, no rate cap; for InfiniBand the slot's parking GUID (:func:`parking_guid`), which
    no partition holds."""
    if kind == "ethernet":
        return VfSettings(vf=vf, mac=PARKING_MAC, vlan=PARKING_VLAN, qos=0, spoofchk=True, trust=False,
                          link_state=VfLinkState.disable, max_tx_rate_mbps=0)
    return VfSettings(vf=vf, link_state=VfLinkState.disable, node_guid=guid, port_guid=guid)
