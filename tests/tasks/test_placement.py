"""Placement of a slot set on the recorded 8xH200 host: which constraint decides, a better set, the HGX warning."""

from __future__ import annotations

import functools
import uuid

import pytest

from gpuaas_agent.contract.placement import Placement, SetLocality
from gpuaas_agent.contract.slots import SlotStatus
from gpuaas_agent.contract.tasks import PlanPayload
from gpuaas_agent.discovery.nvswitch import check_nvswitch_partition
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.tasks.placement import NVSWITCH_WARNING, PlacementRefused
from gpuaas_agent.tasks.plan import plan_bundle
from tests.conftest import fixture_host
from tests.support.provision_inputs import approved_slot

ALLOCATION = str(uuid.uuid4())


@functools.cache
def topology_of(name: str = "h200-slice-after-transition"):
    return discover(HostRoot.open(fixture_host(name)))


def plan_payload(indexes, profile=None) -> PlanPayload:
    slots = [approved_slot(topology_of(), i, status=SlotStatus.available) for i in indexes]
    return PlanPayload(allocation_id=ALLOCATION, approved_slot_ids=[s.slot_id for s in slots], slots=slots,
                       runtime_profile=profile)


def test_the_h200_fixture_reports_its_four_nvswitches():
    switches = topology_of().nvswitches
    assert [s.pci_address for s in switches] == ["0000:ca:00.0", "0000:cb:00.0", "0000:cc:00.0", "0000:cd:00.0"]
    assert {s.class_code for s in switches} == {"0x068000"} and all(s.pci_address not in
                                                                      {g.pci_address for g in topology_of().gpus}
                                                                      for s in switches)
    check = check_nvswitch_partition(topology_of())
    assert check.status.value == "WARN" and "Fabric Manager" in check.remediation
    assert check_nvswitch_partition(topology_of("dev-box-no-gpu")).status.value == "PASS"


def test_a_set_on_one_numa_node_is_same_numa_and_satisfies_a_same_numa_profile():
    plan = plan_bundle(plan_payload([0, 1, 2, 3]), topology_of(), placement=Placement.same_numa)
    assert plan.placement.achieved is SetLocality.same_numa and plan.placement.satisfied
    assert plan.placement.numa_nodes == [0]
    assert plan.placement.decided_by == "profile placement same_numa: met (same_numa)"


def test_a_set_across_numa_nodes_is_refused_by_a_same_numa_profile_naming_the_constraint():
    with pytest.raises(PlacementRefused) as err:
        plan_bundle(plan_payload([3, 4]), topology_of(), placement=Placement.same_numa)
    assert err.value.code == "placement_violated"
    assert err.value.evidence["decided_by"] == (
        "profile placement same_numa: the set is cross_numa (GPUs on NUMA nodes [0, 1])")
    assert err.value.evidence["numa_nodes"] == [0, 1]


def test_same_switch_is_refused_for_gpus_on_separate_switches():
    with pytest.raises(PlacementRefused) as err:
        plan_bundle(plan_payload([0, 1]), topology_of(), placement=Placement.same_switch)
    assert err.value.evidence["achieved"] == "same_numa" and "same_switch" in err.value.evidence["decided_by"]


def test_a_cross_numa_set_under_any_is_allowed_and_the_report_prefers_a_free_one_node_set():
    plan = plan_bundle(plan_payload([3, 4]), topology_of(), placement=Placement.any, free_slots=list(range(8)))
    placement = plan.placement
    assert placement.satisfied and placement.achieved is SetLocality.cross_numa
    assert placement.decided_by == "no constraint: profile placement any"
    assert placement.preferred_slot_indexes == [0, 1] and placement.preferred_locality is SetLocality.same_numa
    assert [w.code for w in placement.warnings] == [NVSWITCH_WARNING]


def test_an_eight_gpu_set_has_no_better_set_and_one_slot_has_no_placement():
    plan = plan_bundle(plan_payload(range(8)), topology_of(), free_slots=list(range(8)))
    assert plan.placement.achieved is SetLocality.cross_numa and plan.placement.preferred_slot_indexes is None
    assert plan_bundle(plan_payload([0]), topology_of()).placement is None


def test_the_numa_profile_carries_the_same_numa_constraint():
    from gpuaas_agent.contract.runtime import get_profile

    assert get_profile("h200_1g_24c_64g_numa").placement is Placement.same_numa
    assert get_profile("h200_1g_24c_64g").placement is Placement.any
