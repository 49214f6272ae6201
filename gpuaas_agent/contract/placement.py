"""Placement of a multi-slot allocation on one node: what a profile requires and what a slot set gets.

GPUs that share a PCIe switch talk peer-to-peer without crossing the CPU; GPUs on one
NUMA node cross one root complex; a set spanning NUMA nodes crosses the socket
interconnect (NCCL's SYS path) unless NVLink carries the traffic. A runtime profile
names the weakest locality it accepts; the node-side check reports the locality a
set achieves, which constraint decided, and a better set when this host has one free.
"""

from __future__ import annotations

from pydantic import Field

from gpuaas_agent.contract.base import WireEnum, WireModel
from gpuaas_agent.contract.topology import Finding


class Placement(WireEnum):
    """A profile's requirement, strongest first: every GPU of the set behind one switch, on one node, or anywhere."""

    same_switch = "same_switch"
    same_numa = "same_numa"
    any = "any"


class SetLocality(WireEnum):
    """What a set achieves: one GPU, one shared switch, one NUMA node, several nodes, or not known."""

    single = "single"
    same_switch = "same_switch"
    same_numa = "same_numa"
    cross_numa = "cross_numa"
    unknown = "unknown"


# Which achieved localities satisfy a requirement.
SATISFIES: dict[Placement, frozenset[SetLocality]] = {
    Placement.same_switch: frozenset({SetLocality.single, SetLocality.same_switch}),
    Placement.same_numa: frozenset({SetLocality.single, SetLocality.same_switch, SetLocality.same_numa}),
    Placement.any: frozenset(SetLocality),
}


class PlacementReport(WireModel):
    """The verdict on one slot set; ``decided_by`` names the constraint that decided it."""

    required: Placement
    achieved: SetLocality
    satisfied: bool
    decided_by: str = Field(description="the constraint that decided: e.g. 'profile placement same_numa'")
    slot_indexes: list[int]
    numa_nodes: list[int]
    shared_switch: str | None = Field(default=None, description="the PCIe bridge every GPU of the set sits behind")
    # A set of the same size with better locality among this host's free slots, when there is one.
    preferred_slot_indexes: list[int] | None = None
    preferred_locality: SetLocality | None = None
    warnings: list[Finding] = Field(default_factory=list)
    # The Fabric Manager partition the set is exactly (profiles with fabric_partitions, NVSwitch hosts only).
    fabric_partition_id: int | None = Field(default=None, ge=0, lt=64)
