"""Isolate a slice's port on plug and release it on unplug: the two calls the pipelines make (docs/safety.md §9).

:func:`isolate_port` installs the port's OpenFlow rules (``host/network/portflows.py``) and puts
its vNIC in the host's nft guard (``host/network/nftguard.py``); :func:`unisolate_port` removes
exactly those. Both are idempotent, so provision calls ``isolate_port`` once the port
exists and again after the domain start (libvirt re-creates the port, and its ofport
may change), and reconcile calls it to repair a port whose rules drifted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence, Set
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any, Protocol

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
from gpuaas_agent.contract.isolation import (
    FlowRule,
    FlowState,
    GuardSpec,
    GuardState,
    PortIsolation,
    cookie_of_port_name,
    port_name_of_cookie,
)
from gpuaas_agent.contract.ovs import OvsPort
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.nftguard import NftGuard
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.host.network.portflows import (
    IsolationInputError,
    PortFlows,
    compare_flows,
    expected_flows,
    ovs_rundir,
    port_isolation,
)


class PortHost(Protocol):
    """What isolation needs of the slice drivers (``tasks/drivers.py``, which calls :func:`unisolate_port`
    from its ``unplug``): the slice's network settings and an ovsdb connection."""

    slice: SliceConfig
    # The guest exporter's port (``guest_exporter_port``): what the host may open into an opted-in guest.
    guest_exporter_port: int | None

    def ovs(self) -> AbstractAsyncContextManager[OvsDriver]: ...


def port_flows(drivers: PortHost) -> PortFlows:
    """The OpenFlow driver of the host's vswitchd (its sockets sit beside the ovsdb socket)."""
    return PortFlows(ovs_rundir(drivers.slice.ovsdb_remote))


def guard_spec(drivers: PortHost) -> GuardSpec:
    """The guard of the slice subnet: SSH (readiness on 22, the terminal's port) and the exporter port are the
    host's only ways into a guest."""
    return GuardSpec(subnet=drivers.slice.subnet, gateway=drivers.slice.gateway,
                     agent_ports=tuple(sorted({22, drivers.slice.terminal.ssh_port})),
                     exporter_port=drivers.guest_exporter_port)


def nft_guard(drivers: PortHost) -> NftGuard:
    return NftGuard(guard_spec(drivers))


def isolation_of(slice_config: SliceConfig, port: OvsPort, *, mac: str, ip: str | IPv4Address) -> PortIsolation:
    """What the port's reservation implies, in the slice's subnet (pure).

    :class:`IsolationInputError` for a port or address that cannot be a guest's.
    """
    subnet, gateway = slice_config.subnet, slice_config.gateway
    address = IPv4Address(str(ip)) if _is_ipv4(ip) else None
    if address is None or address not in subnet or address in (
            gateway, subnet.network_address, subnet.broadcast_address):
        raise IsolationInputError(
            f"ip {ip} is not a guest address of {subnet} (gateway {gateway})",
            evidence={"port": port.name, "ip": str(ip), "subnet": str(subnet), "gateway": str(gateway)})
    if port.slot_index is None:
        raise IsolationInputError(f"port {port.name} carries no slot index", evidence={"port": port.name})
    # ofport -1: vswitchd could not open the tap yet (the domain is not started); the MAC is closed meanwhile.
    ofport = port.ofport if port.ofport is not None and port.ofport > 0 else None
    return port_isolation(bridge=port.bridge, port=port.name, allocation_id=port.allocation_id,
                          slot_index=port.slot_index, ofport=ofport, mac=mac, ip=address)


async def isolate_port(drivers: PortHost, port: OvsPort, *, mac: str, ip: str | IPv4Address,
                       guest_telemetry: bool = False) -> dict[str, Any]:
    """Install the port's flows (one bundle) and add its vNIC to the nft guard; returns the evidence.

    ``guest_telemetry``: the allocation opted in, so the host may open the guest's exporter port
    (and nothing more); otherwise any such opening of the port is closed.

    Refuses with ``port_isolation_conflict`` (nothing written) when another port's flows
    hold the same MAC, IP or ofport.
    """
    iso = isolation_of(drivers.slice, port, mac=mac, ip=ip)
    rules = await port_flows(drivers).install(iso)
    exporter = iso.ip if guest_telemetry and drivers.guest_exporter_port is not None else None
    guard = await nft_guard(drivers).add_port(port.name, exporter=exporter)
    return {"cookie": f"{iso.cookie:#x}", "ofport": iso.ofport, "flows": len(rules), "nft_table": guard.table,
            "nft_guarded": port.name in guard.guest_ports,
            "exporter_open": guard.exporters.get(str(iso.ip)) == port.name}


OFPORT_WAIT_S = 10.0


async def opened_port(drivers: PortHost, port: OvsPort, *, within_s: float = OFPORT_WAIT_S) -> OvsPort:
    """The port as ovsdb shows it once vswitchd has opened its tap (``ofport`` set), or as it is after ``within_s``.

    Why: libvirt creates the tap at domain start and vswitchd opens it a moment later. Isolating
    the port before that installs only the MAC rules (the guest's DHCP offers are dropped until the
    in_port rules arrive), and reconcile repairs only *active* ports: a slow vswitchd left a
    provisioning guest without a lease. ``ofport=-1`` (vswitchd could not open it) ends the wait.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    current = port
    while current.ofport is None and loop.time() < deadline:
        await asyncio.sleep(0.2)  # poll step of a deadline wait (vswitchd writes ofport asynchronously)
        async with drivers.ovs() as ovs:
            found = [p for p in await asyncio.to_thread(ovs.list_agent_ports, port.bridge) if p.name == port.name]
        if found:
            current = found[0]
    return current


async def unisolate_port(drivers: PortHost, bridge: str, port_name: str) -> dict[str, Any]:
    """Remove the port's flows (by its cookie only) and its nft set element; idempotent."""
    cookie = cookie_of_port_name(port_name)
    if cookie is None:  # not a vNIC name of ours: we never installed anything for it
        return {"flows_removed": 0, "nft_removed": False}
    removed = await port_flows(drivers).remove(bridge, cookie)
    unguarded = await nft_guard(drivers).remove_port(port_name)
    return {"flows_removed": len(removed), "nft_removed": unguarded}


def _is_ipv4(value: object) -> bool:
    try:
        IPv4Address(str(value))
    except ValueError:
        return False
    return True


# -- reconcile: the isolation an active slot implies vs. what the bridge and nftables hold -----------------


@dataclass(frozen=True)
class ActivePort:
    """An active slot's port and the reservation its rules follow."""

    port: OvsPort
    mac: str
    ip: str
    guest_telemetry: bool = False  # the lease's opt-in: the host may open the guest's exporter port


@dataclass(frozen=True)
class IsolationSnapshot:
    """What the bridges and the nft guard hold, read once before anything is judged or repaired."""

    bridges: tuple[str, ...]  # the bridges that exist: the configured one and every agent port's
    flows: Mapping[str, Mapping[int, list[FlowRule]]]  # per existing bridge: our rules by port cookie
    guard: GuardState


async def read_isolation(drivers: PortHost, ports: Sequence[OvsPort]) -> IsolationSnapshot:
    """Read which bridges exist, the agent's rules on each (by port cookie) and the nft guard."""
    bridges = sorted({drivers.slice.ovs_bridge, *(p.bridge for p in ports)})
    async with drivers.ovs() as ovs:
        present = [b for b in bridges if await asyncio.to_thread(ovs.bridge_exists, b)]
    flows = port_flows(drivers)
    return IsolationSnapshot(bridges=tuple(present), flows={b: await flows.ours(b) for b in present},
                             guard=await nft_guard(drivers).read())


@dataclass(frozen=True)
class RemoveFlows:
    """Delete the rules under a cookie no port of a known allocation owns; ``finding``: its index."""

    finding: int
    bridge: str
    cookie: int


@dataclass(frozen=True)
class Reisolate:
    """Reinstall an active port's rules (they only ever close the port again); ``finding``: its index."""

    finding: int
    entry: ActivePort


@dataclass(frozen=True)
class RepairGuard:
    """Rewrite the guard table with ``names`` and ``exporters`` (``replace``), or add the missing ``names``
    to its set."""

    replace: bool
    names: tuple[str, ...]
    exporters: tuple[tuple[str, str], ...] = ()  # (port, guest IP) the replaced table opens


@dataclass(frozen=True)
class RepairExporters:
    """Close exporter openings nobody granted (``close``: guest IPs), open the granted ones that are
    missing (``open``: port, guest IP)."""

    close: tuple[str, ...]
    open: tuple[tuple[str, str], ...]


IsolationRepair = RemoveFlows | Reisolate | RepairGuard | RepairExporters


@dataclass(frozen=True)
class IsolationJudgement:
    """The isolation findings in report order (none repaired yet) and the repairs they allow."""

    findings: list[DriftFinding]
    repairs: list[IsolationRepair]
    kept: frozenset[str]  # the ports of known allocations: what the guard may keep
    exporters: tuple[tuple[str, str], ...] = ()  # (port, guest IP) whose exporter the host may open


def judge_isolation(slice_config: SliceConfig, snap: IsolationSnapshot, *, ports: Sequence[OvsPort],
                    active: Sequence[ActivePort], known: Set[str],
                    exporter_port: int | None = None, leased: Sequence[ActivePort] | None = None) -> IsolationJudgement:
    """Findings for flows and the nft guard, and the repairs that restore them (pure).

    ``ports``: every agent port in ovsdb; ``known``: allocations this host still knows
    (lease, slot record or domain). Rules or guard elements of a port that is not a
    port of a known allocation are orphans. Repairs never loosen anything: they
    restore the rules a reservation implies or delete rules nobody owns.
    ``exporter_port``: the guest exporter's port (None: no guest's may be opened); the host
    may open it towards exactly the opted-in active slots' IPs. ``leased``: every leased slot's port and
    reservation, active or still provisioning (default: ``active``): an opening of an opted-in lease whose
    provision is still running is its provision's, not an orphan; only active slots' missing openings are
    reopened.
    """
    findings: list[DriftFinding] = []
    repairs: list[IsolationRepair] = []
    kept = frozenset(p.name for p in ports if p.allocation_id in known)

    for bridge in snap.bridges:
        for cookie, rules in sorted(snap.flows[bridge].items()):
            name = port_name_of_cookie(cookie)
            if name in kept:
                continue
            repairs.append(RemoveFlows(len(findings), bridge, cookie))
            findings.append(_finding(DriftKind.flows_orphan, name or f"{cookie:#x}", DriftSeverity.warn,
                                     expected="no flows (no such port)", actual=f"{len(rules)} rules on {bridge}",
                                     cookie=f"{cookie:#x}", bridge=bridge))

    for entry in active:
        port = entry.port
        try:
            iso = isolation_of(slice_config, port, mac=entry.mac, ip=entry.ip)
        except AgentError as exc:
            findings.append(_finding(DriftKind.flows_missing, port.allocation_id, DriftSeverity.error,
                                     expected="flows of the port's reservation", actual=exc.code,
                                     port=port.name, error=exc.message))
            continue
        if port.bridge not in snap.bridges:
            continue  # the bridge itself is gone: the port's own findings say so
        seen = compare_flows(iso, snap.flows[port.bridge].get(iso.cookie, []))
        if seen.state is FlowState.ok:
            continue
        kind = DriftKind.flows_missing if seen.state is FlowState.missing else DriftKind.flows_altered
        repairs.append(Reisolate(len(findings), entry))
        findings.append(_finding(
            kind, port.allocation_id, DriftSeverity.error, expected=f"{len(expected_flows(iso))} rules",
            actual=f"{len(seen.missing)} missing, {len(seen.extra)} extra", port=port.name,
            cookie=f"{iso.cookie:#x}", ofport=iso.ofport, slot_index=port.slot_index,
            missing=[r.model_dump(mode="json") for r in seen.missing][:20],
            extra=[r.model_dump(mode="json") for r in seen.extra][:20], repair_error=None))

    state = snap.guard
    wanted = {entry.port.name: entry.port.allocation_id for entry in active}
    listed = sorted({n for names in state.elements.values() for n in names})
    orphans = [name for name in listed if name not in kept]
    unguarded = sorted(set(wanted) - set(state.guest_ports))
    if wanted and not state.present:
        findings.append(_finding(DriftKind.nft_guard_missing, state.table, DriftSeverity.error,
                                 expected=f"table inet {state.table}", actual="absent", ports=sorted(wanted)))
    elif state.present and not state.rules_match:
        findings.append(_finding(DriftKind.nft_guard_altered, state.table, DriftSeverity.error,
                                 expected="the guard's chains and rules", actual="; ".join(state.differences)))
    for name in unguarded:
        if state.present:
            findings.append(_finding(DriftKind.nft_guard_missing, wanted[name], DriftSeverity.error,
                                     expected=f"{name} in the guard's set", actual="absent", port=name))
    for name in orphans:
        findings.append(_finding(DriftKind.nft_guard_orphan, name, DriftSeverity.warn,
                                 expected="not in the guard's set (no such port)", actual="in the set", port=name))
    # The exporter openings: exactly the opted-in active ports' IPs, each under its own port's name.
    granted = {entry.ip: entry.port.name for entry in active if entry.guest_telemetry} if exporter_port else {}
    allowed = {entry.ip: entry.port.name for entry in (active if leased is None else leased)
               if entry.guest_telemetry} if exporter_port else {}
    ungranted = sorted(ip for ip, name in state.exporters.items() if allowed.get(ip) != name)
    closed = sorted(ip for ip in granted if state.exporters.get(ip) != granted[ip] and state.present)
    for ip in ungranted:
        findings.append(_finding(DriftKind.nft_guard_orphan, state.exporters[ip] or ip, DriftSeverity.error,
                                 expected="no exporter opening (not an opted-in active slot's)",
                                 actual=f"the host may open {ip}:{exporter_port}", exporter=ip,
                                 port=state.exporters[ip] or None))
    for ip in closed:
        findings.append(_finding(DriftKind.nft_guard_missing, wanted.get(granted[ip], granted[ip]), DriftSeverity.warn,
                                 expected=f"the host may open {ip}:{exporter_port} (guest telemetry)",
                                 actual="closed", exporter=ip, port=granted[ip]))
    needs_table = (wanted and not state.present) or (state.present and not state.rules_match)
    if needs_table or orphans:
        keep = [n for n in listed if n in kept]
        repairs.append(RepairGuard(replace=True, names=tuple(dict.fromkeys([*keep, *wanted])),
                                   exporters=tuple(sorted((name, ip) for ip, name in allowed.items()
                                                          if ip in granted or state.exporters.get(ip) == name))))
    else:
        if unguarded:
            repairs.append(RepairGuard(replace=False, names=tuple(unguarded)))
        if ungranted or closed:
            repairs.append(RepairExporters(close=tuple(ungranted),
                                           open=tuple((granted[ip], ip) for ip in closed)))
    return IsolationJudgement(findings=findings, repairs=repairs, kept=kept,
                              exporters=tuple(sorted((name, ip) for ip, name in granted.items())))


async def repair_isolation(drivers: PortHost, judgement: IsolationJudgement) -> list[DriftFinding]:
    """Apply the judgement's repairs in order; returns its findings with ``repaired`` (and a reinstall's
    ``repair_error``) set. The guard's findings count as repaired by what the guard holds afterwards."""
    findings = list(judgement.findings)
    flows, guard = port_flows(drivers), nft_guard(drivers)
    exporters = {name: IPv4Address(ip) for name, ip in judgement.exporters}
    guard_repaired = False
    for fix in judgement.repairs:
        if isinstance(fix, RemoveFlows):
            done = bool(await flows.remove(fix.bridge, fix.cookie))
            findings[fix.finding] = findings[fix.finding].model_copy(update={"repaired": done})
        elif isinstance(fix, Reisolate):
            done, error = False, None
            try:
                await isolate_port(drivers, fix.entry.port, mac=fix.entry.mac, ip=fix.entry.ip)
                done = True
            except AgentError as exc:  # a conflict with another port's rules: reported, never forced
                error = {"code": exc.code, "message": exc.message, "evidence": exc.evidence}
            finding = findings[fix.finding]
            findings[fix.finding] = finding.model_copy(
                update={"repaired": done, "detail": {**finding.detail, "repair_error": error}})
        elif isinstance(fix, RepairExporters):
            if fix.close:
                await guard.close_exporters(fix.close)
            for name, ip in fix.open:
                await guard.add_port(name, exporter=IPv4Address(ip))
            guard_repaired = True
        else:
            if fix.replace:
                await guard.replace(list(fix.names), {name: IPv4Address(ip) for name, ip in fix.exporters})
            else:
                for name in fix.names:
                    await guard.add_port(name, exporter=exporters.get(name))
            guard_repaired = True
    if guard_repaired:
        after = await guard.read()
        findings = [f.model_copy(update={"repaired": _guard_repaired(f, after, set(judgement.kept))})
                    if f.kind in _GUARD_KINDS else f for f in findings]
    return findings


_GUARD_KINDS = (DriftKind.nft_guard_missing, DriftKind.nft_guard_altered, DriftKind.nft_guard_orphan)


def _guard_repaired(finding: DriftFinding, after: GuardState, kept: set[str]) -> bool:
    if not (after.present and after.rules_match):
        return False
    port = finding.detail.get("port")
    if (exporter := finding.detail.get("exporter")) is not None:
        opened = after.exporters.get(exporter)
        return opened is None if finding.kind is DriftKind.nft_guard_orphan else opened == port
    if finding.kind is DriftKind.nft_guard_orphan:
        return all(port not in names for names in after.elements.values())
    if port is not None:
        return port in after.guest_ports
    return all(p in after.guest_ports for p in finding.detail.get("ports", []))


def _finding(kind: DriftKind, subject: str, severity: DriftSeverity, *, expected: str | None = None,
             actual: str | None = None, repaired: bool = False, **detail: Any) -> DriftFinding:
    return DriftFinding(kind=kind, subject=subject, severity=severity, expected=expected, actual=actual,
                        repaired=repaired, detail=detail)
