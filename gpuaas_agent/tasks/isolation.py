"""Isolate a slice's port on plug and release it on unplug: the two calls the pipelines make (DESIGN.md §4.9).

:func:`isolate_port` installs the port's OpenFlow rules (``host/portflows.py``) and puts
its vNIC in the host's nft guard (``host/nftguard.py``); :func:`unisolate_port` removes
exactly those. Both are idempotent, so provision calls ``isolate_port`` once the port
exists and again after the domain start (libvirt re-creates the port, and its ofport
may change), and reconcile calls it to repair a port whose rules drifted.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import TYPE_CHECKING

from gpuaas_agent.contract.isolation import GuardSpec, PortIsolation, cookie_of_port_name
from gpuaas_agent.contract.ovs import OvsPort
from gpuaas_agent.host.nftguard import NftGuard
from gpuaas_agent.host.portflows import IsolationInputError, PortFlows, ovs_rundir, port_isolation

if TYPE_CHECKING:
    from gpuaas_agent.tasks.slicehost import SliceHost


def port_flows(sh: "SliceHost") -> PortFlows:
    """The OpenFlow driver of the host's vswitchd (its sockets sit beside the ovsdb socket)."""
    return PortFlows(ovs_rundir(sh.slice.ovsdb_remote))


def nft_guard(sh: "SliceHost") -> NftGuard:
    return NftGuard(GuardSpec(subnet=sh.slice.subnet, gateway=sh.slice.gateway))


def isolation_of(sh: "SliceHost", port: OvsPort, *, mac: str, ip: str | IPv4Address) -> PortIsolation:
    """What the port's reservation implies; :class:`IsolationInputError` for a port or address that cannot be a guest's."""
    address = IPv4Address(str(ip)) if _is_ipv4(ip) else None
    if address is None or address not in sh.slice.subnet or address in (
            sh.slice.gateway, sh.slice.subnet.network_address, sh.slice.subnet.broadcast_address):
        raise IsolationInputError(
            f"ip {ip} is not a guest address of {sh.slice.subnet} (gateway {sh.slice.gateway})",
            evidence={"port": port.name, "ip": str(ip), "subnet": str(sh.slice.subnet),
                      "gateway": str(sh.slice.gateway)})
    if port.slot_index is None:
        raise IsolationInputError(f"port {port.name} carries no slot index", evidence={"port": port.name})
    # ofport -1: vswitchd could not open the tap yet (the domain is not started); the MAC is closed meanwhile.
    ofport = port.ofport if port.ofport is not None and port.ofport > 0 else None
    return port_isolation(bridge=port.bridge, port=port.name, allocation_id=port.allocation_id,
                          slot_index=port.slot_index, ofport=ofport, mac=mac, ip=address)


async def isolate_port(sh: "SliceHost", port: OvsPort, *, mac: str, ip: str | IPv4Address) -> dict:
    """Install the port's flows (one bundle) and add its vNIC to the nft guard; returns the evidence.

    Refuses with ``port_isolation_conflict`` (nothing written) when another port's flows
    hold the same MAC, IP or ofport.
    """
    iso = isolation_of(sh, port, mac=mac, ip=ip)
    rules = await port_flows(sh).install(iso)
    guard = await nft_guard(sh).add_port(port.name)
    return {"cookie": f"{iso.cookie:#x}", "ofport": iso.ofport, "flows": len(rules), "nft_table": guard.table,
            "nft_guarded": port.name in guard.guest_ports}


async def unisolate_port(sh: "SliceHost", bridge: str, port_name: str) -> dict:
    """Remove the port's flows (by its cookie only) and its nft set element; idempotent."""
    cookie = cookie_of_port_name(port_name)
    if cookie is None:  # not a vNIC name of ours: we never installed anything for it
        return {"flows_removed": 0, "nft_removed": False}
    removed = await port_flows(sh).remove(bridge, cookie)
    unguarded = await nft_guard(sh).remove_port(port_name)
    return {"flows_removed": len(removed), "nft_removed": unguarded}


def _is_ipv4(value: object) -> bool:
    try:
        IPv4Address(str(value))
    except ValueError:
        return False
    return True
