"""Reconcile's judgement (``tasks/reconcile.py``): a snapshot of what was read in, findings and repairs out.

The judge is pure, so these tests build the snapshot from the models reconcile reads (store
rows, libvirt's domain list, dnsmasq's files, ovsdb's ports, sysfs drivers) and need no
component at all. Reconcile over real libvirt, OVS, nft and dnsmasq is in
``tests/host/network/test_portflows.py`` and ``tests/tasks/test_power.py``.
"""

from __future__ import annotations

from ipaddress import IPv4Address

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.dhcp import Lease, Reservation
from gpuaas_agent.contract.domain import DomainInfo, DomainMetadata, DomainState
from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
from gpuaas_agent.contract.isolation import GuardState
from gpuaas_agent.contract.naming import domain_name, vnic_name
from gpuaas_agent.contract.ovs import OvsPort
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.vfio import VFIO_DRIVER
from gpuaas_agent.tasks import reconcile
from gpuaas_agent.tasks.isolation import IsolationSnapshot, Reisolate
from gpuaas_agent.tasks.reconcile import HostSnapshot, Judgement, RemovePort, RemoveReservation

A = "0a1b2c3d-0000-4000-8000-000000000001"
B = "0a1b2c3d-0000-4000-8000-000000000002"
GONE = "0a1b2c3d-0000-4000-8000-0000000000ff"  # an allocation this host knows nothing of
NOW = 1_700_000_000.0
GPU, VF = "0000:18:00.0", "0000:19:00.2"
SLICE = SliceConfig()  # 10.100.0.0/24, gateway .1, ovsbr0


def judge(snap: HostSnapshot) -> Judgement:
    return reconcile.judge(snap, SLICE)


def _lease(alloc: str = A, slot: int = 0) -> SlotLease:
    return SlotLease(allocation_id=alloc, slot_index=slot, gpu_pci_address=GPU, fabric_vf_pci_address=VF,
                     nvme_device=f"/dev/disk/by-id/nvme-slot{slot}", disk_identity=f"nguid:00aa{slot:02d}",
                     task_id="t-provision", taken_at=NOW)


def _record(alloc: str = A, slot: int = 0, status: SlotStatus = SlotStatus.active, **detail: object) -> SlotRecord:
    return SlotRecord(slot_index=slot, allocation_id=alloc, status=status, health_state=HealthState.healthy,
                      detail=dict(detail), task_id="t-provision", updated_at=NOW)


def _domain(alloc: str = A, slot: int = 0, state: DomainState = DomainState.running,
            profile: str = "h200_1g_24c_64g") -> DomainInfo:
    return DomainInfo(name=domain_name(alloc), uuid=f"uuid-{alloc}", state=state, persistent=True,
                      metadata=DomainMetadata(allocation_id=alloc, slot_index=slot, task_id="t-provision",
                                              profile=profile, agent_version="test"))


def _reservation(alloc: str = A, slot: int = 0) -> Reservation:
    return Reservation(allocation_id=alloc, slot_index=slot, mac=f"52:54:00:00:00:{slot + 0x10:02x}",
                       ip=IPv4Address(f"10.100.0.{slot + 10}"), hostname=f"slice-{slot}")


def _port(alloc: str = A, slot: int = 0) -> OvsPort:
    return OvsPort(bridge="ovsbr0", name=vnic_name(alloc, slot), iface_id=None, attached_mac=None, vm_uuid=None,
                   allocation_id=alloc, slot_index=slot, ofport=5, interface_error=None,
                   ingress_policing_rate_kbps=0, ingress_policing_burst_kb=0)


def _bound(res: Reservation) -> Lease:
    return Lease(expires=int(NOW) + 3600, mac=res.mac, ip=res.ip)


def _healthy_slice(**changes: object) -> HostSnapshot:
    """Slot 0 of allocation A, active and consistent everywhere; ``changes`` replace parts of it."""
    res = _reservation()
    parts: dict[str, object] = dict(
        leases=(_lease(),), records={0: _record()}, domains=(_domain(),), reservations=(res,), ports=(_port(),),
        dhcp=(_bound(res),), read_at=NOW, pci_drivers={GPU: VFIO_DRIVER, VF: VFIO_DRIVER})
    parts.update(changes)
    return HostSnapshot(**parts)


def _kinds(findings: list[DriftFinding]) -> list[tuple[str, str]]:
    return [(f.kind.value, f.subject) for f in findings]


def test_a_consistent_slice_is_no_finding_and_its_port_is_checked_for_isolation():
    judged = judge(_healthy_slice())
    assert judged.findings == [] and judged.repairs == []
    (active,) = judged.active
    assert (active.port.name, active.mac, active.ip) == (vnic_name(A, 0), "52:54:00:00:00:10", "10.100.0.10")


def test_an_active_slot_without_its_domain_is_an_error_and_nothing_is_repaired():
    judged = judge(_healthy_slice(domains=()))
    assert _kinds(judged.findings) == [("domain_missing", A)]
    assert judged.findings[0].severity is DriftSeverity.error and judged.repairs == []


def test_a_lease_without_domain_in_between_states_is_not_a_finding():
    for status in (SlotStatus.provisioning, SlotStatus.releasing, SlotStatus.cleanup_blocked):
        snap = _healthy_slice(domains=(), records={0: _record(status=status)})
        assert DriftKind.lease_without_domain not in {f.kind for f in judge(snap).findings}
    snap = _healthy_slice(domains=(), records={})
    (finding,) = judge(snap).findings
    assert (finding.kind, finding.detail["slot_status"]) == (DriftKind.lease_without_domain, None)


def test_a_shut_off_domain_is_info_when_the_tenant_stopped_it_and_an_error_when_not():
    off = (_domain(state=DomainState.shutoff),)
    (dead,) = judge(_healthy_slice(domains=off)).findings
    assert (dead.kind, dead.severity, dead.expected) == (DriftKind.domain_shutoff, DriftSeverity.error, "running")
    stop = {"operation": "stop", "task_id": "t-stop", "at": NOW, "changed": True, "succeeded": True, "code": None}
    stopped = _healthy_slice(domains=off, records={0: _record(power_state="stopped", last_power_operation=stop)})
    (held,) = judge(stopped).findings
    assert (held.severity, held.detail["power_state"], held.detail["last_power_operation"]) == (
        DriftSeverity.info, "stopped", stop)


def test_the_reservation_and_dhcp_lease_of_an_active_slot_are_judged_but_not_a_data_slots():
    assert _kinds(judge(_healthy_slice(reservations=(), ports=())).findings) == [("reservation_missing", A)]
    # A data slot of a multi-slot set has no reservation of its own.
    data = _healthy_slice(reservations=(), ports=(), records={0: _record(boot_slot_index=1)})
    assert judge(data).findings == []
    (lost,) = judge(_healthy_slice(dhcp=())).findings
    assert (lost.kind, lost.expected, lost.actual) == (DriftKind.dhcp_lease_missing,
                                                        "52:54:00:00:00:10 holds 10.100.0.10", "missing")
    expired = _healthy_slice(read_at=NOW + 7200)  # judged at the time the lease file was read
    assert _kinds(judge(expired).findings) == [("dhcp_lease_missing", A)]


def test_a_running_passthrough_domain_needs_both_functions_on_vfio():
    judged = judge(_healthy_slice(pci_drivers={GPU: "nvidia", VF: None}))
    assert [(f.kind, f.subject, f.actual) for f in judged.findings] == [
        (DriftKind.driver_not_vfio, GPU, "nvidia"), (DriftKind.driver_not_vfio, VF, "none")]
    # An emulated profile passes nothing through: its functions' drivers are not judged.
    emulated = _healthy_slice(domains=(_domain(profile="lab_tcg_1c_512m"),), pci_drivers={})
    assert judge(emulated).findings == []


def test_the_devices_read_for_a_lease_come_after_its_domain_findings():
    moved = DriftFinding(kind=DriftKind.slot_device_moved, subject="/dev/disk/by-id/nvme-slot0",
                         severity=DriftSeverity.error)
    judged = judge(_healthy_slice(domains=(_domain(state=DomainState.shutoff),), device_findings={0: (moved,)}))
    assert [f.kind for f in judged.findings] == [DriftKind.domain_shutoff, DriftKind.slot_device_moved]


def test_a_cleanup_blocked_slot_is_a_disk_not_wiped_named_by_its_leased_disk():
    snap = _healthy_slice(domains=(), records={0: _record(status=SlotStatus.cleanup_blocked, failed_step="wipe")})
    (finding,) = judge(snap).findings
    assert (finding.kind, finding.subject, finding.detail["failed_step"]) == (
        DriftKind.disk_not_wiped, "/dev/disk/by-id/nvme-slot0", "wipe")
    unleased = _healthy_slice(leases=(), domains=(), reservations=(), ports=(),
                              records={3: _record(slot=3, status=SlotStatus.cleanup_blocked)})
    assert _kinds(judge(unleased).findings) == [("disk_not_wiped", "3")]


def test_orphans_of_an_unknown_allocation_are_reported_with_their_repairs_and_known_ones_are_not():
    snap = _healthy_slice(domains=(_domain(), _domain(B, 1)),
                          reservations=(_reservation(), _reservation(GONE, 2), _reservation(B, 1)),
                          ports=(_port(), _port(GONE, 2), _port(B, 1)))
    judged = judge(snap)
    # B has a domain but no lease: its domain is an orphan, never destroyed; its reservation and port are known.
    assert _kinds(judged.findings) == [("domain_orphan", B), ("reservation_orphan", GONE), ("port_orphan", GONE)]
    assert not any(f.repaired for f in judged.findings)
    assert judged.repairs == [RemoveReservation(1, _reservation(GONE, 2)), RemovePort(2, _port(GONE, 2))]
    assert [judged.findings[r.finding].kind for r in judged.repairs] == [DriftKind.reservation_orphan,
                                                                         DriftKind.port_orphan]


def test_the_snapshot_knows_allocations_by_lease_record_or_domain_and_which_run():
    snap = _healthy_slice(domains=(_domain(), _domain(B, 1, state=DomainState.shutoff)),
                          records={0: _record(), 4: _record(GONE, 4, status=SlotStatus.cleanup_blocked)})
    assert snap.known == {A, B, GONE}
    assert snap.running == {A}


def test_the_active_ports_isolation_is_judged_from_the_same_snapshot():
    assert judge(_healthy_slice()).isolation is None  # nothing read of the bridges: nothing judged
    name = vnic_name(A, 0)
    read = IsolationSnapshot(bridges=("ovsbr0",), flows={"ovsbr0": {}},
                             guard=GuardState(table="gpuaas_slice_guard", present=True, rules_match=True,
                                              guest_ports=[name], elements={"inet": [name]}))
    judged = judge(_healthy_slice(isolation=read))
    assert judged.findings == [] and judged.isolation is not None
    (finding,) = judged.isolation.findings
    assert (finding.kind, finding.subject, finding.detail["port"]) == (DriftKind.flows_missing, A, name)
    assert judged.isolation.repairs == [Reisolate(0, judged.active[0])]


def test_the_isolation_probe_asks_libvirt_only_when_a_lease_or_an_unnamed_port_needs_it():
    needs = reconcile.isolation_needs_domains
    assert not needs((), (), ())  # an idle host: no lease, no record, no port
    assert not needs((), (_record(B, 1, status=SlotStatus.cleanup_blocked),), (_port(B, 1),))  # named by its record
    assert needs((), (), (_port(GONE, 2),))  # only a domain could name this port's allocation
    assert needs((_lease(),), (_record(),), (_port(),))  # a host with a slice reads them as the full pass does


def test_without_a_lease_the_domains_change_no_isolation_finding_where_the_probe_skips_them():
    """The claim the probe's skip rests on, tried to break: an orphan domain (B, no lease), a port B's record names,
    flows and guard elements of B and of an allocation nobody knows: the isolation findings with the domain and
    without it are the same whenever ``isolation_needs_domains`` says the probe may skip it; where it may not (a
    port only the domain names), they differ, which is why it reads them there."""
    known, unknown = vnic_name(B, 1), vnic_name(GONE, 2)
    read = IsolationSnapshot(bridges=("ovsbr0",), flows={"ovsbr0": {}},
                             guard=GuardState(table="gpuaas_slice_guard", present=True, rules_match=True,
                                              guest_ports=[], elements={"inet": [known, unknown]}))

    def isolation(snap: HostSnapshot) -> list[tuple[str, str]]:
        judged = judge(snap).isolation
        assert judged is not None
        return _kinds(judged.findings)

    by_record = dict(leases=(), reservations=(), dhcp=(), isolation=read,
                     records={1: _record(B, 1, status=SlotStatus.cleanup_blocked)}, ports=(_port(B, 1),))
    assert not reconcile.isolation_needs_domains((), by_record["records"].values(), by_record["ports"])
    with_domain = isolation(_healthy_slice(**by_record, domains=(_domain(B, 1),)))
    assert with_domain == isolation(_healthy_slice(**by_record, domains=())) == [("nft_guard_orphan", unknown)]

    by_domain_only = dict(by_record, records={})
    assert reconcile.isolation_needs_domains((), (), by_domain_only["ports"])
    assert (isolation(_healthy_slice(**by_domain_only, domains=(_domain(B, 1),)))
            != isolation(_healthy_slice(**by_domain_only, domains=())))
