"""Egress proof of a slice: the guest reached a target beyond the host's NAT.

A slice whose ``MASQUERADE`` rule vanished (seed 004, 2026-04-24) still leases its
address and answers SSH on the private bridge, so lease + banner say nothing about
the internet. When the runtime profile asks for it (``readiness_egress``), the seed
makes the guest's first boot connect to :class:`EgressTarget` (the host's configured
target beyond the NAT), and readiness waits until the host kernel's connection
tracking shows that connection *source-NATed and answered*: evidence the host reads
itself (``host/network/egress_readiness.py``), which the guest cannot forge (the port flows pin its
source address). Imports nothing of ours but the contract base.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Annotated

from pydantic import Field, Strict

from gpuaas_agent.contract.base import WireModel

LAX = Strict(False)
EGRESS_PROBE_TAG = "gpuaas-egress-probe"  # argv[0] of the seed's probe command: guests may look for it


class EgressTarget(WireModel):
    """A TCP service beyond the NAT that the guest connects to once at first boot (a host-configured value)."""

    ip: Annotated[IPv4Address, LAX]
    port: int = Field(ge=1, le=65535)


class EgressConnection(WireModel):
    """One tracked connection from the guest to the target, as conntrack shows it."""

    src: str
    sport: int
    dst: str
    dport: int
    status: list[str] = Field(description="conntrack status bits set (SEEN_REPLY, SRC_NAT_DONE, ...)")
    nat_source: str | None = Field(description="the address the reply goes to: the NAT'd source, or the guest's own")
    source_nat: bool
    answered: bool


class EgressEvidence(WireModel):
    """What readiness proved: the guest's connection to ``target`` left source-NATed and was answered."""

    target: EgressTarget
    guest_ip: str
    connection: EgressConnection
    tracked: int = Field(ge=0, description="connections from the guest to the target seen while waiting")
