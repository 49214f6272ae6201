"""Admission of a ``slice.vm_provision``: every refusal that can be decided before a lease is taken.

Seen over the wire (a hostile tenant or a buggy control plane): an IP equal
to the gateway, a 600 kB SSH key, a MAC another slot had reserved were only
refused by the seed and reservation steps, *after* the disk was cloned, so
each left the slot ``cleanup_blocked``. Here they are named functions the
validate step calls before anything is leased or written (docs/safety.md §8),
each raising a typed refusal with a stable code and ``evidence.field``:

* ``invalid_payload``: the guest seed (user, keys, hostname, network) does not validate;
* ``ip_outside_subnet`` / ``ip_reserved``: the private IP is not a guest address of the slice subnet;
* ``allocation_has_slot``: the allocation already holds a lease or a slot record on another slot
  (one slot per allocation until multi-slot allocations exist: the domain name is per allocation);
* ``mac_in_use`` / ``ip_in_use`` / ``hostname_in_use`` / ``slot_reserved``: the dnsmasq hosts file
  already gives them to another slot (:meth:`DnsmasqReservations.check`);
* ``slot_mismatch`` (``guards/slot_binding.py``): the record is not the host's candidate slot.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Interface
from uuid import UUID

from pydantic import ValidationError

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.cloudinit import GuestAddressing, GuestNetwork, GuestUser, SeedSpec
from gpuaas_agent.contract.dhcp import Reservation
from gpuaas_agent.contract.tasks import VmProvisionPayload, invalid_payload
from gpuaas_agent.discovery.slots import PlanConfig
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations, make_reservation
from gpuaas_agent.state.store import StateStore


class AdmissionRefused(AgentError):
    """A provision refused before anything was leased or written; the slot is as it was."""

    default_code = "admission_refused"


def slice_plan_config(cfg: SliceConfig) -> PlanConfig:
    """Discovery's slot planner with this host's subnet, gateway and bridge, so its suggested MAC/IP
    are the ones the control plane approved (and the ones validate compares against)."""
    return PlanConfig(subnet=cfg.subnet, gateway=cfg.gateway, ovs_bridge=cfg.ovs_bridge)


def check_guest_address(private_ip: str, cfg: SliceConfig) -> IPv4Address:
    """The slot's IP must be a guest address of the slice subnet: not network, gateway or broadcast."""
    ip = IPv4Address(private_ip)  # the wire type (IPv4String) already proved it is a dotted quad
    if ip not in cfg.subnet:
        raise AdmissionRefused(f"private_ip {ip} is outside the slice subnet {cfg.subnet}", code="ip_outside_subnet",
                               evidence={"field": "slot.private_ip", "ip": str(ip), "subnet": str(cfg.subnet)})
    roles = {ns: "nameserver" for ns in cfg.nameservers if ns in cfg.subnet}
    roles.update({cfg.subnet.network_address: "network", cfg.subnet.broadcast_address: "broadcast",
                  cfg.gateway: "gateway"})
    if ip in roles:
        raise AdmissionRefused(f"private_ip {ip} is the {roles[ip]} address of {cfg.subnet}", code="ip_reserved",
                               evidence={"field": "slot.private_ip", "ip": str(ip), "role": roles[ip]})
    return ip


def check_one_slot_per_allocation(store: StateStore, allocation_id: str, slot_index: int) -> None:
    """``allocation_has_slot`` when the allocation holds a lease or a slot record on another slot.

    The libvirt domain is named per allocation: a second slot's provision would meet the
    first slot's domain, and before this check its undo destroyed that running VM.
    """
    leases = [lease.slot_index for lease in store.leases_of(allocation_id) if lease.slot_index != slot_index]
    records = [r.slot_index for r in store.slot_states()
               if r.allocation_id == allocation_id and r.slot_index != slot_index]
    if leases or records:
        held = sorted(set(leases) | set(records))
        raise AdmissionRefused(
            f"allocation {allocation_id} already has slot {held[0]}; one slot per allocation "
            f"(slot {slot_index} refused, slot {held[0]} untouched)",
            code="allocation_has_slot",
            evidence={"field": "slot.slot_index", "requested": slot_index, "held_slots": held,
                      "leased_slots": sorted(leases), "recorded_slots": sorted(records)})


def build_seed_spec(payload: VmProvisionPayload, relay_key: str, cfg: SliceConfig) -> SeedSpec:
    """The guest's seed, validated now (keys, names, addresses) rather than after the clone."""
    slot = payload.slot
    try:
        return SeedSpec(
            # The payload's pattern already made the allocation id a UUID's text.
            instance_id=UUID(payload.allocation_id), hostname=payload.hostname,
            user=GuestUser(name=payload.user, ssh_authorized_keys=tuple(payload.ssh_authorized_keys)),
            terminal_relay_key=relay_key,
            network=GuestNetwork(mac=slot.mac, address=IPv4Interface(f"{slot.private_ip}/{cfg.subnet.prefixlen}"),
                                 gateway=cfg.gateway, nameservers=cfg.nameservers,
                                 addressing=GuestAddressing.dhcp4),
            guest_driver_profile=payload.guest_driver_profile)
    except ValidationError as exc:
        raise invalid_payload("guest seed of slice.vm_provision", exc) from None


def check_reservation(reservations: DnsmasqReservations, payload: VmProvisionPayload) -> Reservation:
    """The slot's MAC, IP and hostname are free in dnsmasq's hosts file (or already this slot's).

    Blocking file read: call through ``asyncio.to_thread``. The reservation step
    adds it under the file lock later and checks again (another writer may come between).
    """
    slot = payload.slot
    res = make_reservation(payload.allocation_id, slot.slot_index, slot.mac, slot.private_ip, payload.hostname)
    try:
        reservations.check(res)
    except AgentError as exc:
        field = {"mac_in_use": "slot.mac", "ip_in_use": "slot.private_ip", "hostname_in_use": "hostname",
                 "ip_outside_subnet": "slot.private_ip", "ip_reserved": "slot.private_ip"}.get(exc.code, "slot")
        exc.evidence.setdefault("field", field)
        raise
    return res
