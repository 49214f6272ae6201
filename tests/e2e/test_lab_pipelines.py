"""End to end over the wire: a real agent process provisioning real TCG guests in the lab-in-a-box.

Each test uses its own slot of the 8-slot host, so they do not depend on each other's order.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import time
import uuid

import libvirt

from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations, make_reservation
from gpuaas_agent.host.network.ovs import OvsDriver
from tests.support.lab_tasks import approved_slot_in, libvirt_domains, only_slot_outcome, run_lab_task

ZERO_MIB = bytes(1 << 20)


def _disk_head(lab, index) -> bytes:
    disk = next(d for d in lab[0].host.disks if d.slot_index == index)
    with open(disk.loop, "rb") as fh:
        return fh.read(1 << 20)


def test_happy_path_provision_then_release_with_cleanup_proof(lab):
    slot = approved_slot_in(lab, 0)
    payload = lab[0].provision_payload(slot)
    result = run_lab_task(lab, "slice.vm_provision", payload)
    assert result.status.value == "succeeded", result.error
    out = result.output
    assert out["vm"] == domain_name(payload["allocation_id"])
    assert out["mac"] == slot.mac and out["expected_ip"] == slot.private_ip == out["actual_ip"]
    assert out["lease_state"] == "bound" and out["ssh_ready"] is True and out["ssh_banner"].startswith("SSH-2.0-")
    outcome = only_slot_outcome(result)
    assert (outcome.status.value, outcome.health_state.value) == ("active", "healthy")
    assert outcome.health_detail["readiness"]["lease"]["actual_ip"] == slot.private_ip
    assert libvirt_domains()[out["vm"]] is True
    assert _disk_head(lab, 0) != ZERO_MIB  # the guest image really is on the slot disk

    # A second provision of the same allocation is refused while the first is active; nothing changes.
    again = run_lab_task(lab, "slice.vm_provision", payload)
    assert again.status.value == "failed" and again.error.code == "already_provisioned"
    assert libvirt_domains()[out["vm"]] is True

    released = run_lab_task(lab, "slice.vm_release", lab[0].release_payload(payload["allocation_id"], slot))
    assert released.status.value == "succeeded", released.error
    proof = released.output["cleanup_proof"]
    assert proof["domain"]["shutdown"]["graceful"] is True  # the guest powered off on ACPI
    assert proof["domain"]["undefine"]["nvram_removed"] is True
    # The port was there when the release looked; libvirt unplugs it itself when the domain stops,
    # so the agent's unplug may find nothing left to do. Either way no port of the allocation remains.
    assert released.output["found"]["ports"] == [vnic_name(payload["allocation_id"], 0)]
    with OvsDriver(lab[0].ovs_remote) as ovs:
        assert [p for p in ovs.list_agent_ports() if p.allocation_id == payload["allocation_id"]] == []
    assert proof["reservation"]["removed"]
    assert proof["wipe"]["verified"] is True and proof["wipe"]["signatures_found"] == []
    # The catalog default (auto), resolved at validate and kept in the lease: a loop disk is no NVMe
    # namespace, so Write Zeroes, whose guarantee covers every byte.
    assert proof["wipe"]["policy"] == "zeroout" and proof["wipe"]["guarantee"] == "write_zeroes"
    assert (only_slot_outcome(released).status.value, only_slot_outcome(released).health_state.value) == ("available", "healthy")
    assert out["vm"] not in libvirt_domains()
    assert _disk_head(lab, 0) == ZERO_MIB


def test_readiness_timeout_leaves_the_slot_cleanup_blocked_until_a_release(lab):
    lab_, _ = lab
    slot = approved_slot_in(lab, 1)
    payload = {**lab_.provision_payload(slot), "readiness_timeout_s": 20}
    dnsmasq = lab_.procs["dnsmasq"]
    os.kill(dnsmasq.pid, signal.SIGSTOP)  # the guest boots but nobody answers its DHCP
    try:
        result = run_lab_task(lab, "slice.vm_provision", payload)
    finally:
        os.kill(dnsmasq.pid, signal.SIGCONT)
    assert result.status.value == "failed"
    assert result.error.code == "lease_timeout"
    assert result.error.evidence["failed_step"] == "readiness" and result.error.evidence["disk_touched"] is True
    outcome = only_slot_outcome(result)
    assert (outcome.status.value, outcome.health_state.value) == ("cleanup_blocked", "failed")
    # Network and domain were undone; the lease and the dirty disk stay.
    assert domain_name(payload["allocation_id"]) not in libvirt_domains()
    assert _disk_head(lab, 1) != ZERO_MIB

    # A new allocation cannot take the blocked slot.
    other = run_lab_task(lab, "slice.vm_provision", lab_.provision_payload(slot))
    assert other.status.value == "failed" and other.error.code == "slot_cleanup_blocked"
    assert only_slot_outcome(other).status.value == "cleanup_blocked"

    released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], slot))
    assert released.status.value == "succeeded", released.error
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True
    assert only_slot_outcome(released).status.value == "available"
    assert _disk_head(lab, 1) == ZERO_MIB


def test_image_url_outside_the_allow_list_is_refused_and_nothing_is_read(lab):
    """The reproduced attack: another slot's disk, the agent's credentials, /dev/zero as the image."""
    lab_, _ = lab
    slot = approved_slot_in(lab, 2)
    before = _disk_head(lab, 2)
    other_disk = next(d for d in lab_.host.disks if d.slot_index == 0)
    for url, rule in ((f"file://{other_disk.by_id}", "forbidden_path"), ("file:///dev/zero", "forbidden_path"),
                      (f"file://{lab_.work / 'state/enrollment.json'}", "forbidden_path"),
                      (f"file://{lab_.image_path.parent}/../state/enrollment.json", "forbidden_path"),
                      (f"file://{lab_.work / 'keys/relay'}", "outside_image_dir")):
        payload = lab_.provision_payload(slot)
        payload["image"]["url"] = url
        result = run_lab_task(lab, "slice.vm_provision", payload)
        assert result.status.value == "failed" and result.error.code == "image_url_refused", (url, result.error)
        assert (result.error.evidence["url"], result.error.evidence["rule"]) == (url, rule)
        assert result.error.evidence["failed_step"] == "image" and result.error.evidence["disk_touched"] is False
        assert only_slot_outcome(result).health_detail["lease_released"] is True
    assert _disk_head(lab, 2) == before
    cache = lab_.work / "images" / "sha256"
    names = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert all(n == lab_.image_sha256 or n == f"{lab_.image_sha256}.verified.json" for n in names), names


def test_image_digest_mismatch_of_a_streamed_image_blocks_the_slot_until_a_release_wipes_it(lab):
    """A raw image not yet cached streams onto the disk while it is hashed (docs/images.md): a digest that
    does not match is found at the last byte, with the disk written. The slot is then cleanup_blocked with
    its lease kept, never offered, until a release wipes and proves the disk; nothing reaches the cache."""
    lab_, _ = lab
    slot = approved_slot_in(lab, 2)
    payload = lab_.provision_payload(slot, sha256="0" * 64)
    result = run_lab_task(lab, "slice.vm_provision", payload)
    assert result.status.value == "failed" and result.error.code == "digest_mismatch"
    assert result.error.evidence["failed_step"] == "clone" and result.error.evidence["disk_touched"] is True
    outcome = only_slot_outcome(result)
    assert outcome.status.value == "cleanup_blocked"
    released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], slot))
    assert released.status.value == "succeeded", released.error
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True
    assert _disk_head(lab, 2) == ZERO_MIB
    # Freed by the verified wipe: another allocation provisions the slot right away.
    retry = lab_.provision_payload(slot)
    ok = run_lab_task(lab, "slice.vm_provision", retry)
    assert ok.status.value == "succeeded", ok.error
    released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(retry["allocation_id"], slot))
    assert released.status.value == "succeeded", released.error


def test_release_after_agent_restart(lab):
    lab_, _ = lab
    slot = approved_slot_in(lab, 3)
    payload = lab_.provision_payload(slot)
    result = run_lab_task(lab, "slice.vm_provision", payload)
    assert result.status.value == "succeeded", result.error
    assert lab_.stop_agent() == 0  # SIGTERM: drains and exits cleanly
    lab_.start_agent()
    released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], slot))
    assert released.status.value == "succeeded", released.error
    assert released.output["found"]["domain"]["name"] == result.output["vm"]
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True


def test_release_of_an_unknown_allocation_succeeds_and_wipes_nothing(lab):
    lab_, _ = lab
    slot = approved_slot_in(lab, 5)
    before = _disk_head(lab, 5)
    released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(str(uuid.uuid4()), slot))
    assert released.status.value == "succeeded", released.error
    assert released.output["already_gone"] is True
    assert "skipped" in released.output["cleanup_proof"]["wipe"]
    assert released.slot_outcomes == []
    assert _disk_head(lab, 5) == before


def test_reconcile_after_a_reservation_and_a_domain_were_removed_by_hand(lab):
    lab_, _ = lab
    slot = approved_slot_in(lab, 4)
    payload = lab_.provision_payload(slot)
    result = run_lab_task(lab, "slice.vm_provision", payload)
    assert result.status.value == "succeeded", result.error
    alloc = payload["allocation_id"]
    name = result.output["vm"]
    # By hand: virsh-like destroy + undefine, and the hosts-file line deleted.
    conn = libvirt.open("qemu:///system")
    try:
        dom = conn.lookupByName(name)
        dom.destroy()
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
    finally:
        conn.close()
    d = lab_.work / "dnsmasq"
    hosts = d / "hosts"
    hosts.write_text("".join(line for line in hosts.read_text().splitlines(keepends=True) if alloc not in line))
    # An orphan reservation of an allocation this host never had: the one repair reconcile may do.
    orphan = str(uuid.uuid4())
    net = lab_.settings.subnet
    DnsmasqReservations(hosts, net, ipaddress.IPv4Address(lab_.gateway)).add(
        make_reservation(orphan, 9, "02:00:00:00:09:09", str(net.network_address + 250), "orphan"))

    report = run_lab_task(lab, "slice.reconcile", {"repair": True}, timeout=120)
    assert report.status.value == "succeeded", report.error
    kinds = {(f["kind"], f["subject"]): f for f in report.output["findings"]}
    assert ("domain_missing", alloc) in kinds and kinds[("domain_missing", alloc)]["repaired"] is False
    assert ("reservation_missing", alloc) in kinds and kinds[("reservation_missing", alloc)]["repaired"] is False
    assert kinds[("reservation_orphan", orphan)]["repaired"] is True
    assert orphan not in hosts.read_text()
    # Never a destroy, a lease release or a wipe on its own: the slot's disk still holds the image.
    assert _disk_head(lab, 4) != ZERO_MIB

    released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(alloc, slot))
    assert released.status.value == "succeeded", released.error
    assert released.output["found"]["domain"] is None
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True


def test_reconcile_reports_an_active_slice_without_a_dhcp_lease(lab):
    lab_, _ = lab
    slot = approved_slot_in(lab, 6)
    payload = lab_.provision_payload(slot)
    result = run_lab_task(lab, "slice.vm_provision", payload)
    assert result.status.value == "succeeded", result.error
    alloc = payload["allocation_id"]
    clean = run_lab_task(lab, "slice.reconcile", {"repair": False}, timeout=120)
    assert [f for f in clean.output["findings"] if f["subject"] == alloc] == []
    leases = lab_.work / "dnsmasq" / "leases"
    leases.write_text("".join(line for line in leases.read_text().splitlines(keepends=True) if slot.mac not in line))
    report = run_lab_task(lab, "slice.reconcile", {"repair": True}, timeout=120)
    found = [f for f in report.output["findings"] if f["subject"] == alloc]
    assert [(f["kind"], f["repaired"]) for f in found] == [("dhcp_lease_missing", False)]
    assert found[0]["actual"] == "missing"
    released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(alloc, slot))
    assert released.status.value == "succeeded", released.error


def test_eight_concurrent_provisions_on_the_eight_slot_host(lab):
    lab_, runner = lab
    slots = [approved_slot_in(lab, i) for i in range(8)]
    payloads = [lab_.provision_payload(s) for s in slots]

    async def all_of_them():
        started = time.monotonic()
        results = await asyncio.gather(*(lab_.task("slice.vm_provision", p, timeout=1200) for p in payloads))
        return results, time.monotonic() - started

    results, took = runner.run(all_of_them(), timeout=1300)
    try:
        failed = [(r.task_id, r.error) for r in results if r.status.value != "succeeded"]
        assert not failed
        ips = sorted(r.output["actual_ip"] for r in results)
        assert ips == sorted(s.private_ip for s in slots)
        # They ran side by side (behaviour, not a timer): every provision had started before any had finished.
        events = lab_.cp.seen.progress
        ids = {r.task_id for r in results}
        starts = [min(e.at for e in events if e.task_id == i and e.step == "validate" and e.status == "started")
                  for i in ids]
        ends = [max(e.at for e in events if e.task_id == i and e.step == "readiness" and e.status == "succeeded")
                for i in ids]
        assert max(starts) < min(ends)
    finally:
        for p, s in zip(payloads, slots):
            run_lab_task(lab, "slice.vm_release", lab_.release_payload(p["allocation_id"], s), timeout=600)
    assert not any(n.startswith("gpuaas-slice-") for n in libvirt_domains())
