"""Reconcile's isolation judgement (``tasks/isolation.py``): what the bridges and the guard hold in, findings out.

:func:`judge_isolation` is pure, so these tests give it the rules and the guard state as
``ovs-ofctl`` and ``nft`` would have returned them (the rules a reservation implies are
:func:`expected_flows`, the same function the installer writes). Installing, removing and
repairing them on a real bridge and real nftables is in ``tests/host/network/test_portflows.py``.
"""

from __future__ import annotations

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.drift import DriftKind
from gpuaas_agent.contract.isolation import FlowRule, GuardState, cookie_of_port_name
from gpuaas_agent.contract.naming import vnic_name
from gpuaas_agent.contract.ovs import OvsPort
from gpuaas_agent.host.network.portflows import expected_flows
from gpuaas_agent.tasks.isolation import (
    ActivePort,
    IsolationSnapshot,
    Reisolate,
    RemoveFlows,
    RepairExporters,
    RepairGuard,
    isolation_of,
    judge_isolation,
)

SLICE = SliceConfig()  # 10.100.0.0/24, gateway .1, ovsbr0
A = "0a1b2c3d-0000-4000-8000-000000000001"
GONE = "0a1b2c3d-0000-4000-8000-0000000000ff"
BRIDGE = "ovsbr0"
TABLE = "gpuaas_slice_guard"


def _port(alloc: str = A, slot: int = 0) -> OvsPort:
    return OvsPort(bridge=BRIDGE, name=vnic_name(alloc, slot), iface_id=None, attached_mac=None, vm_uuid=None,
                   allocation_id=alloc, slot_index=slot, ofport=5, interface_error=None,
                   ingress_policing_rate_kbps=0, ingress_policing_burst_kb=0)


ACTIVE = ActivePort(port=_port(), mac="52:54:00:00:00:10", ip="10.100.0.10")
RULES = expected_flows(isolation_of(SLICE, ACTIVE.port, mac=ACTIVE.mac, ip=ACTIVE.ip))
COOKIE = RULES[0].cookie


def _guard(*ports: str, present: bool = True, rules_match: bool = True) -> GuardState:
    return GuardState(table=TABLE, present=present, rules_match=rules_match, guest_ports=list(ports),
                      elements={"inet": list(ports)} if present else {})


def _snapshot(flows: dict[int, list[FlowRule]] | None = None, guard: GuardState | None = None,
              bridges: tuple[str, ...] = (BRIDGE,)) -> IsolationSnapshot:
    return IsolationSnapshot(bridges=bridges, flows={b: dict({COOKIE: RULES} if flows is None else flows)
                                                     for b in bridges},
                             guard=guard if guard is not None else _guard(ACTIVE.port.name))


def _judge(snap: IsolationSnapshot, *, active: tuple[ActivePort, ...] = (ACTIVE,),
           ports: tuple[OvsPort, ...] = (ACTIVE.port,), known: frozenset[str] = frozenset({A})):
    return judge_isolation(SLICE, snap, ports=ports, active=active, known=known)


def test_an_isolated_active_port_is_no_finding():
    judged = _judge(_snapshot())
    assert judged.findings == [] and judged.repairs == []
    assert judged.kept == {ACTIVE.port.name}


def test_missing_and_altered_rules_are_errors_whose_repair_reinstalls_them():
    missing = _judge(_snapshot(flows={}))
    (finding,) = missing.findings
    assert (finding.kind, finding.subject, finding.repaired) == (DriftKind.flows_missing, A, False)
    assert finding.detail["repair_error"] is None and len(finding.detail["missing"]) == len(RULES)
    assert missing.repairs == [Reisolate(0, ACTIVE)]
    extra = RULES[0].model_copy(update={"priority": RULES[0].priority + 1})
    (altered,) = _judge(_snapshot(flows={COOKIE: [*RULES[1:], extra]})).findings
    assert (altered.kind, altered.actual) == (DriftKind.flows_altered, "1 missing, 1 extra")


def test_rules_of_a_port_no_known_allocation_owns_are_orphans_removed_by_cookie():
    orphan_name = vnic_name(GONE, 2)
    orphan_cookie = cookie_of_port_name(orphan_name)
    assert orphan_cookie is not None
    orphan_rules = [r.model_copy(update={"cookie": orphan_cookie}) for r in RULES]
    judged = _judge(_snapshot(flows={COOKIE: RULES, orphan_cookie: orphan_rules}),
                    ports=(ACTIVE.port, _port(GONE, 2)))
    (finding,) = judged.findings
    assert (finding.kind, finding.subject, finding.detail["bridge"]) == (DriftKind.flows_orphan, orphan_name, BRIDGE)
    assert judged.repairs == [RemoveFlows(0, BRIDGE, orphan_cookie)]


def test_a_port_whose_address_is_not_a_guest_one_is_reported_and_never_repaired():
    outside = ActivePort(port=ACTIVE.port, mac=ACTIVE.mac, ip="10.100.0.1")  # the gateway
    judged = _judge(_snapshot(), active=(outside,))
    (finding,) = judged.findings
    assert (finding.kind, finding.actual) == (DriftKind.flows_missing, "port_isolation_invalid_input")
    assert not any(isinstance(r, Reisolate) for r in judged.repairs)


def test_a_gone_bridge_leaves_its_ports_to_their_own_findings():
    judged = _judge(_snapshot(bridges=()))
    assert [f.kind for f in judged.findings] == []


def test_the_guard_table_missing_or_altered_is_rewritten_whole_and_a_missing_port_is_added():
    absent = _judge(_snapshot(guard=_guard(present=False)))
    assert [(f.kind, f.subject) for f in absent.findings] == [(DriftKind.nft_guard_missing, TABLE)]
    assert absent.repairs == [RepairGuard(replace=True, names=(ACTIVE.port.name,))]
    altered = _judge(_snapshot(guard=_guard(ACTIVE.port.name, rules_match=False).model_copy(
        update={"differences": ["chain forward"]})))
    assert [(f.kind, f.actual) for f in altered.findings] == [(DriftKind.nft_guard_altered, "chain forward")]
    assert altered.repairs == [RepairGuard(replace=True, names=(ACTIVE.port.name,))]
    unguarded = _judge(_snapshot(guard=_guard()))
    assert [(f.kind, f.subject) for f in unguarded.findings] == [(DriftKind.nft_guard_missing, A)]
    assert unguarded.repairs == [RepairGuard(replace=False, names=(ACTIVE.port.name,))]


def test_a_guard_element_of_no_known_port_is_an_orphan_and_the_guard_keeps_only_known_ports():
    stray = vnic_name(GONE, 3)
    judged = _judge(_snapshot(guard=_guard(ACTIVE.port.name, stray)))
    assert [(f.kind, f.subject) for f in judged.findings] == [(DriftKind.nft_guard_orphan, stray)]
    assert judged.repairs == [RepairGuard(replace=True, names=(ACTIVE.port.name,))]


EXPORTER_PORT = 9100
OPTED = ActivePort(port=ACTIVE.port, mac=ACTIVE.mac, ip=ACTIVE.ip, guest_telemetry=True)


def _opened(exporters: dict[str, str]) -> GuardState:
    return _guard(ACTIVE.port.name).model_copy(update={"exporters": exporters})


def test_the_exporter_opening_is_exactly_the_opted_in_slots_ip_under_its_own_port():
    """The narrow path compared by reconcile: an opt-in slot's opening missing is reopened (telemetry stops,
    a warning); an opening nobody granted (opt-out slot, a stale IP, another port's name) is closed (an error:
    the host's path into a guest is wider than the allocation asked)."""
    name = ACTIVE.port.name
    assert _judge(_snapshot(guard=_opened({})), active=(OPTED,)).findings == []  # no exporter port: none to open
    ok = judge_isolation(SLICE, _snapshot(guard=_opened({ACTIVE.ip: name})), ports=(ACTIVE.port,), active=(OPTED,),
                         known=frozenset({A}), exporter_port=EXPORTER_PORT)
    assert ok.findings == [] and ok.repairs == [] and ok.exporters == ((name, ACTIVE.ip),)

    closed = judge_isolation(SLICE, _snapshot(guard=_opened({})), ports=(ACTIVE.port,), active=(OPTED,),
                             known=frozenset({A}), exporter_port=EXPORTER_PORT)
    assert [(f.kind, f.subject, f.severity.value) for f in closed.findings] == [
        (DriftKind.nft_guard_missing, A, "warn")]
    assert closed.repairs == [RepairExporters(close=(), open=((name, ACTIVE.ip),))]

    for opened in ({ACTIVE.ip: name}, {"10.100.0.99": name}, {ACTIVE.ip: vnic_name(GONE, 3)}, {ACTIVE.ip: ""}):
        wide = judge_isolation(SLICE, _snapshot(guard=_opened(opened)), ports=(ACTIVE.port,), active=(ACTIVE,),
                               known=frozenset({A}), exporter_port=EXPORTER_PORT)
        assert [(f.kind, f.severity.value) for f in wide.findings] == [(DriftKind.nft_guard_orphan, "error")], opened
        assert wide.repairs == [RepairExporters(close=tuple(opened), open=())]


def test_an_opted_in_slot_still_provisioning_keeps_the_opening_its_provision_made():
    """Found in the lab: reconcile (the network watch's repair, woken by the new taps) ran while three provisions
    were still going and closed the exporter opening each had made at its plug, as if nobody had granted it;
    the host could not reach the guest's exporter until a later reconcile reopened it. A leased slot that is
    not active yet keeps its own opening; an opening of a lease that did not opt in is still closed."""
    name = ACTIVE.port.name
    opened = _snapshot(guard=_opened({ACTIVE.ip: name}))
    provisioning = judge_isolation(SLICE, opened, ports=(ACTIVE.port,), active=(), known=frozenset({A}),
                                   exporter_port=EXPORTER_PORT, leased=(OPTED,))
    assert provisioning.findings == [] and provisioning.repairs == []
    not_opted = judge_isolation(SLICE, opened, ports=(ACTIVE.port,), active=(), known=frozenset({A}),
                                exporter_port=EXPORTER_PORT, leased=(ACTIVE,))
    assert [(f.kind, f.severity.value) for f in not_opted.findings] == [(DriftKind.nft_guard_orphan, "error")]
    assert not_opted.repairs == [RepairExporters(close=(ACTIVE.ip,), open=())]
    # Nothing is opened for a slot still provisioning: its provision opens it (and its undo closes it).
    closed = judge_isolation(SLICE, _snapshot(guard=_opened({})), ports=(ACTIVE.port,), active=(),
                             known=frozenset({A}), exporter_port=EXPORTER_PORT, leased=(OPTED,))
    assert closed.findings == [] and closed.repairs == []


def test_a_replaced_guard_table_opens_exactly_the_granted_exporters():
    judged = judge_isolation(SLICE, _snapshot(guard=_guard(present=False)), ports=(ACTIVE.port,), active=(OPTED,),
                             known=frozenset({A}), exporter_port=EXPORTER_PORT)
    assert judged.repairs == [RepairGuard(replace=True, names=(ACTIVE.port.name,),
                                          exporters=((ACTIVE.port.name, ACTIVE.ip),))]
