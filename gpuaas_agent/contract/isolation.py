"""What isolating one slice port means, as values: the port's identity and reservation, its flow cookie, and readbacks.

A slice's port carries only its own reserved MAC and IP, and guests reach only the
gateway's DHCP/DNS and the NAT uplink (docs/safety.md §9). The host drivers
(``host/network/portflows.py`` for OpenFlow, ``host/network/nftguard.py`` for the host's nftables)
turn a :class:`PortIsolation` into rules and read them back into the records here,
so reconcile can compare what a port's reservation implies with what is installed.

The cookie is the port's identity on the bridge. It is derived from the allocation
and slot exactly like the vNIC name (``gs<slot>-<first 10 hex of the allocation>``):
``0x6773`` ("gs") in the top 16 bits, the slot index in the next 8, the 40 bits of
the allocation prefix below. Every flow we install carries it, so
``del-flows BR cookie=C/-1`` removes exactly one port's flows, a dump filtered by
the tag finds all of ours (and only ours), and a cookie seen on a bridge names its
port after an agent restart without any local state.
"""

from __future__ import annotations

import re
from enum import Enum
from ipaddress import IPv4Address, IPv4Network

from pydantic import Field, model_validator

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.naming import VNIC_PREFIX, vnic_name
from gpuaas_agent.contract.ovs import IfName, Uuid
from gpuaas_agent.contract.types import MacAddress

COOKIE_TAG = int.from_bytes(VNIC_PREFIX.encode(), "big")  # 0x6773, "gs"
COOKIE_TAG_SHIFT = 48
COOKIE_TAG_MASK = 0xFFFF << COOKIE_TAG_SHIFT
COOKIE_ALL_MASK = (1 << 64) - 1
# OpenFlow port numbers a guest port can have: 0 is invalid, 0xff00 and up are reserved (LOCAL is 0xfffe).
MAX_OFPORT = 0xFEFF
_VNIC = re.compile(rf"^{VNIC_PREFIX}([0-9a-f]{{1,2}})-([0-9a-f]{{10}})\Z")

GUARD_TABLE = "gpuaas_slice_guard"
GUARD_SET = "guest_ports"
# The guests whose exporter the host may open (allocations that asked for guest telemetry): their reserved
# IPs, each element's comment naming its port, so unplug removes exactly that port's (host/network/nftguard.py).
EXPORTER_SET = "exporter_guests"


def port_cookie(allocation_id: str, slot_index: int) -> int:
    """The 64-bit OpenFlow cookie of the slot's port (the same identity as its vNIC name)."""
    cookie = cookie_of_port_name(vnic_name(allocation_id, slot_index))
    assert cookie is not None
    return cookie


def cookie_of_port_name(name: str) -> int | None:
    """The cookie of a port called by our vNIC naming, or None for a port that is not ours by name."""
    m = _VNIC.fullmatch(name)
    if m is None:
        return None
    return (COOKIE_TAG << COOKIE_TAG_SHIFT) | (int(m.group(1), 16) << 40) | int(m.group(2), 16)


def port_name_of_cookie(cookie: int) -> str | None:
    """The vNIC name a cookie was derived from, or None when the cookie does not carry our tag."""
    if cookie >> COOKIE_TAG_SHIFT != COOKIE_TAG:
        return None
    return f"{VNIC_PREFIX}{(cookie >> 40) & 0xFF:x}-{cookie & ((1 << 40) - 1):010x}"


class PortIsolation(WireModel):
    """One guest port and what its reservation allows it to say: the input of the flows and the nft guard."""

    bridge: IfName
    port: IfName = Field(description="the vNIC / OVS port name, vnic_name(allocation_id, slot_index)")
    allocation_id: Uuid
    slot_index: int = Field(ge=0, le=255)
    # None: vswitchd has not opened the port yet (libvirt creates the tap at domain start). The port is
    # then closed by MAC alone (nothing from or to its MAC is switched) until its ofport is known.
    ofport: int | None = Field(ge=1, le=MAX_OFPORT, description="the port's OpenFlow number as vswitchd assigned it")
    mac: MacAddress
    ip: IPv4Address

    @model_validator(mode="after")
    def _consistent(self) -> PortIsolation:
        if self.port != vnic_name(self.allocation_id, self.slot_index):
            raise ValueError(f"port {self.port!r} is not the vNIC of allocation {self.allocation_id} "
                             f"slot {self.slot_index}")
        if int(self.mac[:2], 16) & 1:
            raise ValueError(f"mac {self.mac} is not unicast")
        if self.ip.is_unspecified or self.ip.is_multicast or self.ip.is_loopback or self.ip == IPv4Address(
                "255.255.255.255"):
            raise ValueError(f"ip {self.ip} cannot be a guest's address")
        return self

    @property
    def cookie(self) -> int:
        return port_cookie(self.allocation_id, self.slot_index)


class FlowRule(WireModel):
    """One OpenFlow rule in the canonical form ``ovs-ofctl dump-flows --no-stats --no-names`` prints.

    ``match`` is the comma-separated match split into its tokens and sorted, so two rules
    compare equal whatever order a tool printed the fields in.
    """

    cookie: int = Field(ge=0, le=COOKIE_ALL_MASK)
    table: int = Field(default=0, ge=0, le=254)
    priority: int = Field(ge=0, le=65535)
    match: tuple[str, ...]
    actions: str = Field(min_length=1)


class FlowState(str, Enum):
    ok = "ok"
    missing = "missing"  # none of the port's flows is installed
    altered = "altered"  # some are, but the set differs from what the reservation implies


class FlowComparison(WireModel):
    """Installed flows of one port's cookie vs. the flows its reservation implies."""

    port: IfName
    cookie: int
    state: FlowState
    missing: list[FlowRule] = Field(default_factory=list, description="expected, not installed")
    extra: list[FlowRule] = Field(default_factory=list, description="installed under our cookie, not expected")


class GuardSpec(WireModel):
    """The host-side guard: which subnet is the slices', so input from it and from guest taps is filtered,
    and which TCP ports the host itself may open into a guest (output to the subnet is filtered too)."""

    subnet: IPv4Network
    gateway: IPv4Address
    table: str = Field(default=GUARD_TABLE, pattern=r"^[a-z][a-z0-9_]{0,31}$")
    # The agent's own way into every guest: SSH (readiness's banner, the terminal relay).
    agent_ports: tuple[int, ...] = Field(default=(22,), min_length=1, max_length=4)
    # The guest exporter's port, open only towards the guests in the exporter set (None: towards none).
    exporter_port: int | None = Field(default=None, ge=1, le=65535)

    @model_validator(mode="after")
    def _ports(self) -> GuardSpec:
        if any(not 1 <= p <= 65535 for p in self.agent_ports) or list(self.agent_ports) != sorted(set(self.agent_ports)):
            raise ValueError(f"agent_ports {self.agent_ports} must be sorted distinct TCP ports")
        return self

    @model_validator(mode="after")
    def _gateway_in_subnet(self) -> GuardSpec:
        if self.gateway not in self.subnet:
            raise ValueError(f"gateway {self.gateway} is not in {self.subnet}")
        return self


class GuardState(WireModel):
    """What the host's nftables holds of the guard table (read back with ``nft -j``)."""

    table: str
    present: bool
    rules_match: bool = Field(description="chains, hooks, policies and rules are exactly what the spec implies")
    differences: list[str] = Field(default_factory=list, description="which chain or set differs, for the finding")
    guest_ports: list[str] = Field(default_factory=list,
                                   description="ports guarded: in the guest_ports set of every family's table")
    elements: dict[str, list[str]] = Field(default_factory=dict, description="family -> its set's elements")
    exporters: dict[str, str] = Field(default_factory=dict,
                                      description="guest IP -> the port its exporter opening was made for")
