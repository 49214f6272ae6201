"""``slice.vm_power`` over the wire on a real TCG guest of the lab-in-a-box (slot 5).

Slot 5 is otherwise used only by test_lab_pipelines' release of an unknown allocation
(which leaves it untouched) and the eight-concurrent test (which needs it free again:
this test releases its slice whatever happens).
"""

from __future__ import annotations

import asyncio

from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.host.network.readiness import wait_for_ssh
from tests.support.lab_tasks import approved_slot_in, libvirt_domains, only_slot_outcome, run_lab_task

SLOT = 5


def _banner(lab, ip: str, within_s: float = 300) -> str:
    async def ssh() -> str:
        return await wait_for_ssh(ip, deadline=asyncio.get_running_loop().time() + within_s)

    return lab[1].run(ssh(), timeout=within_s + 30)


def _power(lab, alloc: str, operation: str, **extra):
    return run_lab_task(lab, "slice.vm_power", {"allocation_id": alloc, "slot_index": SLOT, "operation": operation,
                                         "graceful_timeout_s": 60, **extra}, timeout=600)


def test_a_tenant_stops_starts_and_resets_a_real_guest(lab):
    lab_, _ = lab
    slot = approved_slot_in(lab, SLOT)
    payload = lab_.provision_payload(slot)
    alloc = payload["allocation_id"]
    vm = domain_name(alloc)
    provisioned = run_lab_task(lab, "slice.vm_provision", payload)
    assert provisioned.status.value == "succeeded", provisioned.error
    try:
        stopped = _power(lab, alloc, "stop")
        assert stopped.status.value == "succeeded", stopped.error
        assert stopped.output["state"] == "shutoff" and stopped.output["power_state"] == "stopped"
        assert stopped.output["steps"]["shutdown"]["graceful"] is True  # the guest powered off on ACPI
        assert libvirt_domains()[vm] is False
        outcome = only_slot_outcome(stopped)
        assert (outcome.status.value, outcome.health_detail["power_state"]) == ("active", "stopped")

        again = _power(lab, alloc, "stop")
        assert again.status.value == "succeeded" and again.output["changed"] is False

        started = _power(lab, alloc, "start")
        assert started.status.value == "succeeded", started.error
        assert started.output["state"] == "running" and libvirt_domains()[vm] is True
        assert "disk_guard_passed" in started.output["steps"]["start"]["preconditions"]["checks_passed"]
        assert _banner(lab, slot.private_ip).startswith("SSH-2.0-")
        # libvirt re-created the port at start; the agent's ids are back on it.
        with OvsDriver(lab_.ovs_remote) as ovs:
            ports = [p for p in ovs.list_agent_ports() if p.allocation_id == alloc]
        assert [(p.name, p.slot_index, p.attached_mac) for p in ports] == [(vnic_name(alloc, SLOT), SLOT, slot.mac)]

        reset = _power(lab, alloc, "reset")
        assert reset.status.value == "succeeded", reset.error
        assert reset.output["done"] == ["reset"] and libvirt_domains()[vm] is True
        assert _banner(lab, slot.private_ip).startswith("SSH-2.0-")  # the guest came back after a hard reset

        # Another allocation cannot touch the slice.
        other = run_lab_task(lab, "slice.vm_power", {"allocation_id": "00000000-0000-4000-8000-000000000005",
                                               "slot_index": SLOT, "operation": "stop"}, timeout=120)
        assert other.status.value == "failed" and other.error.code == "not_this_allocation"
        assert libvirt_domains()[vm] is True
    finally:
        released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(alloc, slot))
        assert released.status.value == "succeeded", released.error
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True
    assert vm not in libvirt_domains()
