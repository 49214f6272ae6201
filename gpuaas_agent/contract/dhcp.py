"""DHCP records: a slot's reservation (MAC -> private IP -> hostname), a dnsmasq lease, and what readiness saw.

A reservation carries its allocation and slot so it can be traced back to its
owner after an agent restart (the hosts file line records both). A lease status
is the evidence behind the safety rule "a VM is active only after its expected
MAC holds the expected IP" (docs/safety.md §5).
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Annotated

from pydantic import Field, StringConstraints

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.egress import EgressEvidence
from gpuaas_agent.contract.types import UUID_PATTERN, MacAddress

# One DNS label (RFC 1123): 1-63 letters, digits and hyphens, no hyphen at either end.
DNS_LABEL_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"  # no look-around: pydantic's regex engine
DnsLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN)]


class Reservation(WireModel):
    """One slot's fixed DHCP address: dnsmasq answers ``mac`` with ``ip`` and ``hostname``, and nobody else."""

    allocation_id: Annotated[str, Field(pattern=UUID_PATTERN)]
    slot_index: Annotated[int, Field(ge=0, le=255)]
    mac: MacAddress
    ip: IPv4Address
    hostname: DnsLabel


class Lease(WireModel):
    """One line of dnsmasq's lease file; ``expires`` is a Unix time, 0 for an infinite lease."""

    expires: Annotated[int, Field(ge=0)]
    mac: MacAddress
    ip: IPv4Address
    hostname: str | None = None
    client_id: str | None = None


class LeaseState(WireEnum):
    bound = "bound"  # the MAC holds the expected IP on an unexpired lease
    missing = "missing"  # no lease at all for the MAC
    wrong_ip = "wrong_ip"  # the MAC holds another address
    expired = "expired"  # the MAC's lease on the expected IP ran out


class LeaseStatus(WireModel):
    """What the lease file says about one expected MAC/IP pair, with the evidence that decided it."""

    mac: MacAddress
    expected_ip: IPv4Address
    actual_ip: IPv4Address | None = None
    lease_state: LeaseState
    expires: int | None = None  # of the lease that decided the state; 0 = infinite
    # A different MAC holding the expected IP on an unexpired lease: usually a stale guest.
    conflicting_mac: MacAddress | None = None


class HostsFileJunk(WireModel):
    """A line of the agent's dnsmasq hosts file that is not a well-formed reservation: kept verbatim, reported."""

    line_number: Annotated[int, Field(ge=1)]
    text: str
    reason: str


class GuestReadiness(WireModel):
    """The proof that a guest is reachable (docs/safety.md §5): its lease, then the SSH banner on its address."""

    lease: LeaseStatus
    ssh_port: Annotated[int, Field(ge=1, le=65535)]
    ssh_banner: Annotated[str, StringConstraints(pattern=r"^SSH-2\.0-")]
    # Only when the runtime profile asks for it (readiness_egress): the guest's NAT'd connection beyond the host.
    egress: EgressEvidence | None = None
