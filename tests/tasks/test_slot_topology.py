"""A held slot's devices against the live host (``tasks/slot_topology.py``), over recorded 8xH200 sysfs trees.

The lease is taken from real discovery of the after-transition host; the "live" host is
either the same host after its recorded reboot (every NVMe kernel name moved, by-id names
kept) or a copy of it broken the way hardware breaks: a GPU gone from the bus, a by-id
link now naming another disk, a by-id link gone.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from gpuaas_agent.contract.domain import DomainDevices
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.tasks.slot_topology import slot_topology_findings
from tests.conftest import fixture_host

AFTER = "h200-slice-after-transition"
REBOOTED = "h200-slice-after-reboot"


@pytest.fixture(scope="module")
def leases() -> list[SlotLease]:
    report = discover(HostRoot.open(fixture_host(AFTER)))
    identities = {d.by_id: d.disk_identity for d in report.nvme_devices}
    out = []
    for slot in report.candidate_slots[:2]:
        out.append(SlotLease(allocation_id=str(uuid.uuid4()), slot_index=slot.slot_index,
                             gpu_pci_address=slot.gpu_pci_address, nvme_device=slot.nvme_device,
                             disk_identity=identities[slot.nvme_device],
                             fabric_vf_pci_address=slot.fabric_vf_pci_address, task_id="t-plan", taken_at=time.time()))
    return out


def _kinds(findings) -> list[tuple[str, str, str]]:
    return sorted((f.kind.value, f.subject, f.detail.get("device") or f.detail.get("field")) for f in findings)


def test_a_reboot_that_renamed_every_nvme_is_no_finding(leases):
    host = HostRoot.open(fixture_host(REBOOTED))
    for lease in leases:
        assert slot_topology_findings(host, lease) == []


def test_a_gpu_gone_from_the_bus_and_a_by_id_link_gone_are_missing_devices(leases, host_copy):
    root = host_copy(AFTER)
    lease = leases[0]
    os.unlink(root / f"sys/bus/pci/devices/{lease.gpu_pci_address}")
    os.unlink(root / lease.nvme_device.lstrip("/"))
    findings = slot_topology_findings(HostRoot.open(root), lease)
    assert _kinds(findings) == sorted([("slot_device_missing", lease.gpu_pci_address, "gpu"),
                                       ("slot_device_missing", lease.nvme_device, "nvme")])
    disk = next(f for f in findings if f.subject == lease.nvme_device)
    assert disk.severity.value == "error" and disk.detail["code"] == "missing"
    assert disk.expected == lease.disk_identity and disk.detail["allocation_id"] == lease.allocation_id
    assert slot_topology_findings(HostRoot.open(root), leases[1]) == []  # the other slot is untouched


def test_a_by_id_link_naming_another_disk_is_a_moved_device_with_both_identities(leases, host_copy):
    """Slot 0's by-id name now resolves to slot 1's namespace (a swapped or replaced drive): never the same disk."""
    root = host_copy(AFTER)
    first, second = leases
    link = root / first.nvme_device.lstrip("/")
    target = os.readlink(root / second.nvme_device.lstrip("/"))
    os.unlink(link)
    os.symlink(target, link)
    (finding,) = slot_topology_findings(HostRoot.open(root), first)
    assert (finding.kind.value, finding.subject, finding.severity.value) == (
        "slot_device_moved", first.nvme_device, "error")
    assert finding.expected == first.disk_identity and finding.actual == second.disk_identity
    assert finding.detail["live_identity"] == second.disk_identity


def test_domain_devices_other_than_the_lease_and_a_gpu_on_another_numa_node_are_moved(leases):
    lease = leases[0]
    host = HostRoot.open(fixture_host(AFTER))
    numa = int(host.read_attr(f"/sys/bus/pci/devices/{lease.gpu_pci_address}/numa_node"))
    same = DomainDevices(name="gpuaas-x", domain_type="kvm", block_disks=[lease.nvme_device],
                         hostdevs=[lease.gpu_pci_address, lease.fabric_vf_pci_address], interfaces=[],
                         numa_nodeset=str(numa))
    assert slot_topology_findings(host, lease, same) == []
    # A lab profile passes nothing through: a domain without hostdevs matches it.
    assert slot_topology_findings(host, lease, same.model_copy(update={"hostdevs": []}), hostdevs=False) == []

    moved = same.model_copy(update={"hostdevs": [leases[1].gpu_pci_address, lease.fabric_vf_pci_address],
                                    "numa_nodeset": str(1 - numa)})
    findings = slot_topology_findings(host, lease, moved)
    assert _kinds(findings) == sorted([("slot_device_moved", lease.allocation_id, "hostdevs"),
                                       ("slot_device_moved", lease.gpu_pci_address, "gpu")])
    numa_finding = next(f for f in findings if f.subject == lease.gpu_pci_address)
    assert (numa_finding.expected, numa_finding.actual) == (f"numa_node {1 - numa}", f"numa_node {numa}")
