"""Node-side placement of a slot set: the locality it gets, the constraint that decides, a better set.

Pure: the planned slots and the host's topology report in, a :class:`PlacementReport` out;
:func:`enforce_placement` turns a set that crosses what the profile forbids into a typed
refusal before anything is leased. The control plane chooses the slots; the node says
which constraint decided and, when it has free slots with better locality, which ones.

HGX reality (NVIDIA Fabric Manager): on a node with NVSwitches, GPUs reach each other
over NVLink only inside a fabric partition the Fabric Manager activates (shared-NVSwitch
multitenancy mode). A profile with ``fabric_partitions`` gets its set checked against FM's
partitions (``tasks/fabric_partitions.py``) and the verdict names the partition. Without
it, a multi-GPU guest on such a node gets its GPUs without usable NVLink (peer traffic falls
back to PCIe through the expanders of ``host/vm/guest_topology.py``): a warning on the
placement, and a WARN line of the parity report (``discovery/nvswitch.py``), never silence.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuaas_agent.contract.placement import SATISFIES, Placement, PlacementReport, SetLocality
from gpuaas_agent.contract.plan import PlannedSlot
from gpuaas_agent.contract.topology import Finding, TopologyReport
from gpuaas_agent.errors import AgentError

NVSWITCH_WARNING = "nvswitch_partition_missing"


class PlacementRefused(AgentError):
    """The slot set crosses a locality constraint its runtime profile forbids; nothing was leased."""

    default_code = "placement_violated"


def _gpu_facts(report: TopologyReport, addresses: Sequence[str]) -> tuple[list[int | None], list[list[str]]]:
    gpus = {g.pci_address: g for g in report.gpus}
    found = [gpus.get(a) for a in addresses]
    return [g.numa_node if g else None for g in found], [list(g.pci_path) if g else [] for g in found]


def set_locality(report: TopologyReport, addresses: Sequence[str]) -> tuple[SetLocality, list[int], str | None]:
    """What a set of GPUs achieves: its locality, its NUMA nodes, and the deepest bridge all of them share."""
    nodes, paths = _gpu_facts(report, addresses)
    known_nodes = sorted({n for n in nodes if n is not None})
    if len(addresses) == 1:
        return SetLocality.single, known_nodes, None
    common = set(paths[0]).intersection(*map(set, paths[1:])) if paths and all(paths) else set()
    shared = next((bridge for bridge in reversed(paths[0]) if bridge in common), None) if common else None
    if None in nodes:
        return (SetLocality.same_switch if shared else SetLocality.unknown), known_nodes, shared
    if shared is not None:
        return SetLocality.same_switch, known_nodes, shared
    return (SetLocality.same_numa if len(known_nodes) == 1 else SetLocality.cross_numa), known_nodes, None


def _better_set(report: TopologyReport, planned: list[PlannedSlot], achieved: SetLocality,
                free: Sequence[int]) -> tuple[list[int] | None, SetLocality | None]:
    """Free slots of one NUMA node (the boot slot's node first) when the set crosses nodes; else none."""
    if achieved is not SetLocality.cross_numa or not free:
        return None, None
    by_index = {c.slot_index: c for c in report.candidate_slots}
    size = len(planned)
    nodes = [planned[0].gpu_numa_node] + sorted({c.numa_node for c in report.candidate_slots} - {planned[0].gpu_numa_node},
                                                 key=lambda n: (n is None, n))
    for node in nodes:
        on_node = [i for i in free if i in by_index and by_index[i].numa_node == node]
        if node is not None and len(on_node) >= size:
            return on_node[:size], SetLocality.same_numa
    return None, None


def assess_placement(report: TopologyReport, planned: list[PlannedSlot], required: Placement = Placement.any,
                     free: Sequence[int] = (), fabric_partition: int | None = None) -> PlacementReport:
    """The verdict on ``planned`` (boot slot first) against ``required``; ``free``: this host's free slot indexes.

    ``fabric_partition``: the Fabric Manager partition the set is exactly (already chosen): named in the
    verdict, and the set then has NVLink (no NVSwitch warning).
    """
    achieved, nodes, shared = set_locality(report, [p.gpu_pci_address for p in planned])
    satisfied = achieved in SATISFIES[required]
    if required is Placement.any:
        decided_by = "no constraint: profile placement any"
    elif satisfied:
        decided_by = f"profile placement {required.value}: met ({achieved.value})"
    else:
        decided_by = (f"profile placement {required.value}: the set is {achieved.value}"
                      f" (GPUs on NUMA nodes {nodes or 'unknown'})")
    preferred, preferred_locality = _better_set(report, planned, achieved, free)
    warnings = []
    if fabric_partition is not None:
        decided_by += f"; NVLink through Fabric Manager partition {fabric_partition}"
    elif len(planned) > 1 and report.nvswitches:
        warnings.append(Finding(
            code=NVSWITCH_WARNING,
            detail=(f"{len(report.nvswitches)} NVSwitches on this node and the profile has no fabric_partitions "
                    "(Fabric Manager shared-NVSwitch mode, docs/hgx.md): the guest's GPUs get no usable NVLink"),
            path="/sys/bus/pci/devices"))
    return PlacementReport(required=required, achieved=achieved, satisfied=satisfied, decided_by=decided_by,
                           slot_indexes=[p.slot_index for p in planned], numa_nodes=nodes, shared_switch=shared,
                           preferred_slot_indexes=preferred, preferred_locality=preferred_locality, warnings=warnings,
                           fabric_partition_id=fabric_partition)


def enforce_placement(placement: PlacementReport) -> PlacementReport:
    """Raise ``placement_violated`` (evidence: the whole report) when the set crosses the profile's constraint."""
    if not placement.satisfied:
        raise PlacementRefused(
            f"slots {placement.slot_indexes} are {placement.achieved.value}; {placement.decided_by}",
            evidence={"field": "slots", **placement.model_dump(mode="json")})
    return placement
