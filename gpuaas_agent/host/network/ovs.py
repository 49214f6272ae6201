"""The slot's OVS port, driven through ovsdb with the ``ovs`` Python IDL (never by parsing ``ovs-vsctl``).

Why the IDL: transactions are atomic and carry ``verify`` prerequisites, so a
read-check-write (is this port ours? which bridge is it on?) cannot race with
libvirt or an operator; a concurrent change makes the commit come back
``TRY_AGAIN`` and the whole decision is taken again on fresh data.

libvirt interplay. Slice domains use ``<interface type='bridge'><virtualport
type='openvswitch'>`` with ``<target dev=PORT>``. At domain start libvirt runs
``ovs-vsctl -- --if-exists del-port PORT -- add-port BR PORT -- set Interface PORT
external-ids:attached-mac=.. iface-id=.. vm-id=.. iface-status=active``: the
port is re-created and the ``external_ids`` written before the start are gone.
The provisioning pipeline therefore calls :meth:`OvsDriver.add_vm_port` again after
the start; it merges our keys into the port libvirt made (keeping libvirt's
``vm-id``/``iface-status``) instead of adding a second one.

Every public method blocks (the IDL is a poll loop): async callers use
``asyncio.to_thread``. One driver serialises its callers with a lock; the IDL
itself is not thread-safe.

The transaction plumbing (schema fetch, sync, bounded TRY_AGAIN retries,
deadlines, waiting for vswitchd) is the thin adapter host/network/ovsdb_idl.py; this
module is policy only. Why not ovsdbapp: measured with
bench/bench_ovsdb.py — ovsdbapp 3.0's backend shares one connection per class
(a second driver for another remote talks to the first server), its schema fetch
has no deadline (blocked > 8 s on a silent server), it retries TRY_AGAIN without
bound and logs a vswitchd that did not apply a change as success, and it runs a
thread per connection; keeping our guarantees on it would mean overriding its
transaction loop, i.e. the same code in a second place. See ovsdb_idl.py.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from gpuaas_agent.contract.naming import VNIC_PREFIX, vnic_name
from gpuaas_agent.contract.ovs import (
    EXT_ALLOCATION,
    EXT_ATTACHED_MAC,
    EXT_IFACE_ID,
    EXT_SLOT,
    EXT_VM_UUID,
    IFNAME_PATTERN,
    BridgeEvidence,
    OvsPort,
    default_iface_id,
)
from gpuaas_agent.contract.types import DATAPATH_TYPE_RE, MAC_RE, UUID_RE
from gpuaas_agent.errors import ContractError, GuardError
from gpuaas_agent.host.network.ovsdb_idl import COMMIT_ATTEMPTS, IdlSession, OvsError, Txn
from gpuaas_agent.logs import log_event

__all__ = ["COMMIT_ATTEMPTS", "DEFAULT_REMOTE", "OvsDriver", "OvsError", "OvsInputError", "OvsRefused"]

log = logging.getLogger(__name__)

DEFAULT_REMOTE = "unix:/var/run/openvswitch/db.sock"
# Interface types a VM port may have: libvirt's taps (""), or a netdev OVS opens itself.
VM_PORT_TYPES = ("", "system", "tap")
MAX_POLICING = 2**31 - 1

_COLUMNS = {
    "Open_vSwitch": ["bridges", "next_cfg", "cur_cfg"],
    "Bridge": ["name", "ports", "datapath_type"],
    "Port": ["name", "interfaces"],
    "Interface": ["name", "type", "external_ids", "ofport", "error", "ingress_policing_rate", "ingress_policing_burst"],
}
_IFNAME = re.compile(IFNAME_PATTERN)
_UUID = UUID_RE
_MAC = MAC_RE
_DATAPATH_TYPE = DATAPATH_TYPE_RE
_VNIC = re.compile(rf"^{VNIC_PREFIX}[0-9a-f]{{1,2}}-[0-9a-f]{{10}}\Z")


class OvsRefused(GuardError):
    """The host's OVS state forbids the change; nothing was changed.

    Codes: ``ovs_bridge_missing``, ``ovs_bridge_datapath_mismatch``,
    ``ovs_port_on_other_bridge``, ``ovs_port_owned_by_other_allocation``,
    ``ovs_port_not_owned``, ``ovs_port_mac_conflict``, ``ovs_port_not_simple``,
    ``ovs_port_type_conflict``, ``ovs_interface_conflict``.
    """

    default_code = "ovs_refused"


class OvsInputError(ContractError):
    """An argument is malformed (name, MAC, UUID, policing); checked before ovsdb is touched."""

    default_code = "ovs_invalid_input"


def _bad(field: str, value: Any, rule: str) -> OvsInputError:
    return OvsInputError(f"{field}={value!r}: {rule}", evidence={"field": field, "value": value, "rule": rule})


def _check_ifname(field: str, value: Any) -> str:
    if not isinstance(value, str) or not _IFNAME.fullmatch(value):
        raise _bad(field, value, f"an interface name matching {IFNAME_PATTERN} (at most 15 bytes)")
    return value


def _check_uuid(field: str, value: Any) -> str:
    if not isinstance(value, str) or not _UUID.fullmatch(value):
        raise _bad(field, value, "a lower-case UUID")
    return value


def _check_mac(value: Any) -> str:
    if not isinstance(value, str) or not _MAC.fullmatch(value):
        raise _bad("mac", value, "a lower-case colon MAC such as 52:54:00:12:34:56")
    if int(value[:2], 16) & 1:
        raise _bad("mac", value, "a unicast MAC (the multicast bit of the first octet is set)")
    return value


def _check_policing(rate: Any, burst: Any) -> tuple[int, int]:
    """(rate, burst) to write: (0, 0) means no policing; a burst needs a rate."""
    if rate is None:
        if burst is not None:
            raise _bad("ingress_policing_burst_kb", burst, "a burst needs ingress_policing_rate_kbps")
        return 0, 0
    for field, value, low in (("ingress_policing_rate_kbps", rate, 1), ("ingress_policing_burst_kb", burst, 0)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_POLICING:
            raise _bad(field, value, f"an integer in {low}..{MAX_POLICING}")
    return rate, burst or 0


def _one(value: Any) -> Any:
    """An optional ovsdb column reads as a list of zero or one element."""
    return value[0] if value else None


class OvsDriver:
    """Bridges and VM ports on one ovsdb; blocking (call through ``asyncio.to_thread``)."""

    def __init__(self, remote: str = DEFAULT_REMOTE, *, timeout_s: float = 10.0) -> None:
        self.remote = remote
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        # Test seam: called with the attempt number after a transaction is built and
        # before it is committed (tests change the db there to force TRY_AGAIN).
        self._before_commit: Callable[[int], None] | None = None
        self._db = IdlSession(remote, _COLUMNS, timeout_s=timeout_s)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> OvsDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bridges -----------------------------------------------------------------------

    def bridge_exists(self, name: str) -> bool:
        _check_ifname("bridge", name)
        with self._lock:
            self._db.sync(self._db.deadline())
            return name in self._bridges()

    def ensure_bridge(self, name: str, *, create: bool = False, datapath_type: str | None = None) -> BridgeEvidence:
        """The bridge's evidence; a missing bridge is a blocker unless ``create`` is asked for.

        A production host's ``ovsbr0`` carries the slice subnet: creating an empty one
        silently would hide a broken host behind a VM without network.
        """
        _check_ifname("bridge", name)
        if datapath_type is not None and not _DATAPATH_TYPE.fullmatch(datapath_type):
            raise _bad("datapath_type", datapath_type, "an OVS datapath type such as netdev or system")
        with self._lock:
            deadline = self._db.deadline()

            def build(txn: Txn) -> bool:
                bridges = self._bridges()
                found = bridges.get(name)
                if found is not None:
                    have = found.datapath_type or "system"
                    if datapath_type is not None and have != (datapath_type or "system"):
                        raise OvsRefused(
                            f"bridge {name} has datapath_type {found.datapath_type!r}, not {datapath_type!r}",
                            code="ovs_bridge_datapath_mismatch",
                            evidence={"bridge": name, "datapath_type": found.datapath_type, "wanted": datapath_type},
                        )
                    return False
                if not create:
                    raise OvsRefused(
                        f"OVS bridge {name} does not exist on {self.remote}",
                        code="ovs_bridge_missing",
                        evidence={"bridge": name, "bridges": sorted(bridges), "remote": self.remote},
                    )
                if self._port(name) is not None or self._interfaces_named(name):
                    raise OvsRefused(
                        f"{name} is already a port of another bridge",
                        code="ovs_interface_conflict",
                        evidence={"bridge": name, "bridges": sorted(bridges)},
                    )
                root = self._db.root()
                root.verify("bridges")
                iface = self._db.insert(txn, "Interface")
                iface.name = name
                iface.type = "internal"
                port = self._db.insert(txn, "Port")
                port.name = name
                port.interfaces = [iface.uuid]
                br = self._db.insert(txn, "Bridge")
                br.name = name
                br.ports = [port.uuid]
                if datapath_type is not None:
                    br.datapath_type = datapath_type
                root.addvalue("bridges", br.uuid)
                return True

            created = self._db.transact(build, what=f"ensure bridge {name}", deadline=deadline, before_commit=self._before_commit)
            if created:
                log_event(log, "ovs_bridge_created", bridge=name, datapath_type=datapath_type, remote=self.remote)
            br = self._bridges()[name]
            return BridgeEvidence(
                name=name,
                datapath_type=br.datapath_type,
                created=created,
                ports=sorted(p.name for p in br.ports),
            )

    # -- VM ports ----------------------------------------------------------------------

    def add_vm_port(
        self,
        bridge: str,
        port_name: str,
        *,
        mac: str,
        vm_uuid: str,
        allocation_id: str,
        slot_index: int,
        iface_id: str | None = None,
        ingress_policing_rate_kbps: int | None = None,
        ingress_policing_burst_kb: int | None = None,
    ) -> OvsPort:
        """Put the slot's port on ``bridge`` with our ``external_ids``; idempotent.

        A port of that name already on ``bridge`` (ours from before, or re-created by
        libvirt at domain start) gets our keys merged in: other keys stay, no second
        port is made. Refused, nothing changed: the port on another bridge, marked
        for another allocation, attached to another MAC, or not a plain tap.
        Policing ``None`` clears it (0 is OVS's "off").
        """
        _check_ifname("bridge", bridge)
        _check_ifname("port_name", port_name)
        _check_uuid("allocation_id", allocation_id)
        if isinstance(slot_index, bool) or not isinstance(slot_index, int) or not 0 <= slot_index <= 0xFF:
            raise _bad("slot_index", slot_index, "an integer in 0..255")
        expected_name = vnic_name(allocation_id, slot_index)
        if port_name != expected_name:
            raise _bad("port_name", port_name, f"the slot's vNIC name {expected_name} (contract.naming.vnic_name)")
        _check_mac(mac)
        _check_uuid("vm_uuid", vm_uuid)
        iface_id = _check_uuid("iface_id", iface_id) if iface_id is not None else default_iface_id(allocation_id, slot_index)
        rate, burst = _check_policing(ingress_policing_rate_kbps, ingress_policing_burst_kb)
        wanted = {
            EXT_IFACE_ID: iface_id,
            EXT_ATTACHED_MAC: mac,
            EXT_VM_UUID: vm_uuid,
            EXT_ALLOCATION: allocation_id,
            EXT_SLOT: str(slot_index),
        }
        with self._lock:
            deadline = self._db.deadline()
            outcome: dict[str, Any] = {}

            def build(txn: Txn) -> bool:
                bridges = self._bridges()
                br = self._require_bridge(bridge, bridges)
                for row in bridges.values():
                    row.verify("ports")  # a port added or moved meanwhile makes the commit TRY_AGAIN
                port = self._port(port_name)
                if port is None:
                    if self._interfaces_named(port_name):
                        raise OvsRefused(
                            f"an Interface {port_name} exists inside another port",
                            code="ovs_interface_conflict",
                            evidence={"port": port_name, "bridge": bridge},
                        )
                    iface = self._db.insert(txn, "Interface")
                    iface.name = port_name
                    iface.external_ids = wanted
                    iface.ingress_policing_rate = rate
                    iface.ingress_policing_burst = burst
                    row = self._db.insert(txn, "Port")
                    row.name = port_name
                    row.interfaces = [iface.uuid]
                    br.addvalue("ports", row.uuid)
                    outcome["action"] = "added"
                    return True
                iface = self._check_owned_port(bridge, br, bridges, port, allocation_id)
                ext = dict(iface.external_ids)
                seen_mac = ext.get(EXT_ATTACHED_MAC)
                if seen_mac is not None and seen_mac.lower() != mac:
                    raise OvsRefused(
                        f"port {port_name} is attached to MAC {seen_mac}, not {mac}",
                        code="ovs_port_mac_conflict",
                        evidence={"port": port_name, "attached_mac": seen_mac, "mac": mac},
                    )
                iface.verify("type")
                if iface.type not in VM_PORT_TYPES:
                    raise OvsRefused(
                        f"port {port_name} is of type {iface.type!r}, not a VM tap",
                        code="ovs_port_type_conflict",
                        evidence={"port": port_name, "type": iface.type},
                    )
                changed = []
                for key, value in wanted.items():
                    if ext.get(key) != value:
                        iface.setkey("external_ids", key, value)
                        changed.append(key)
                for column, limit in (("ingress_policing_rate", rate), ("ingress_policing_burst", burst)):
                    iface.verify(column)
                    if getattr(iface, column) != limit:
                        setattr(iface, column, limit)
                        changed.append(column)
                outcome["action"] = "merged" if changed else "unchanged"
                outcome["changed"] = changed
                return bool(changed)

            self._db.transact(build, what=f"add port {port_name} to {bridge}", deadline=deadline, before_commit=self._before_commit)
            if outcome["action"] != "unchanged":
                log_event(
                    log, f"ovs_port_{outcome['action']}", bridge=bridge, port=port_name,
                    allocation=allocation_id, changed=outcome.get("changed"),
                )
            record = self._record(bridge, port_name)
            if record is None:  # committed, then gone: someone deleted it right after
                raise OvsError(
                    f"port {port_name} vanished from {bridge} right after it was written",
                    code="ovs_commit_failed",
                    evidence={"bridge": bridge, "port": port_name, "remote": self.remote},
                )
            return record

    def remove_vm_port(self, bridge: str, port_name: str, *, allocation_id: str | None = None) -> bool:
        """Remove the slot's port; False when it was already gone (idempotent).

        Only agent ports are removed: the Interface marked with ``allocation_id`` (any
        allocation when it is None), or an unmarked port whose name is a slot vNIC name
        (libvirt re-created it and our marks were not re-asserted yet) — of that
        allocation when one is given. An uplink such as ``eth0`` is never touched.
        """
        _check_ifname("bridge", bridge)
        _check_ifname("port_name", port_name)
        if allocation_id is not None:
            _check_uuid("allocation_id", allocation_id)
        with self._lock:
            deadline = self._db.deadline()

            def build(txn: Txn) -> bool:
                bridges = self._bridges()
                for row in bridges.values():
                    row.verify("ports")
                port = self._port(port_name)
                if port is None:
                    return False
                br = bridges.get(bridge)
                iface = self._check_owned_port(bridge, br, bridges, port, allocation_id, removing=True)
                assert br is not None  # _check_owned_port refuses a missing bridge
                br.delvalue("ports", port.uuid)
                iface.delete()
                port.delete()
                return True

            removed = self._db.transact(build, what=f"remove port {port_name} from {bridge}", deadline=deadline, before_commit=self._before_commit)
            if removed:
                log_event(log, "ovs_port_removed", bridge=bridge, port=port_name, allocation=allocation_id)
            return removed

    def list_agent_ports(self, bridge: str | None = None) -> list[OvsPort]:
        """Ports whose Interface carries ``gpuaas-allocation``, on one bridge or all, sorted by name.

        A marked port whose values do not parse (edited by hand) is logged as
        ``ovs_port_unparsable`` and left out rather than guessed at.
        """
        if bridge is not None:
            _check_ifname("bridge", bridge)
        with self._lock:
            self._db.sync(self._db.deadline())
            found = []
            for br_name, br in sorted(self._bridges().items()):
                if bridge is not None and br_name != bridge:
                    continue
                for port in br.ports:
                    for iface in port.interfaces:
                        if EXT_ALLOCATION not in iface.external_ids:
                            continue
                        try:
                            found.append(_port_record(br_name, port, iface))
                        except ValidationError as exc:
                            log_event(
                                log, "ovs_port_unparsable", logging.WARNING, bridge=br_name, port=port.name,
                                external_ids=dict(iface.external_ids), error=str(exc),
                            )
            return sorted(found, key=lambda p: (p.bridge, p.name))

    # -- reading the replica -----------------------------------------------------------

    def _rows(self, table: str) -> list[Any]:
        return self._db.rows(table)

    def _bridges(self) -> dict[str, Any]:
        return {row.name: row for row in self._rows("Bridge")}

    def _port(self, name: str) -> Any | None:
        return next((row for row in self._rows("Port") if row.name == name), None)

    def _interfaces_named(self, name: str) -> list[Any]:
        return [row for row in self._rows("Interface") if row.name == name]

    def _require_bridge(self, name: str, bridges: dict[str, Any]) -> Any:
        br = bridges.get(name)
        if br is None:
            raise OvsRefused(
                f"OVS bridge {name} does not exist on {self.remote}",
                code="ovs_bridge_missing",
                evidence={"bridge": name, "bridges": sorted(bridges), "remote": self.remote},
            )
        return br

    def _check_owned_port(
        self,
        bridge: str,
        br: Any | None,
        bridges: dict[str, Any],
        port: Any,
        allocation_id: str | None,
        *,
        removing: bool = False,
    ) -> Any:
        """The port's single Interface once it is proven to be on ``bridge`` and not someone else's."""
        name = port.name
        holder = next((b_name for b_name, b in bridges.items() if any(p.uuid == port.uuid for p in b.ports)), None)
        if br is None or holder != bridge:
            raise OvsRefused(
                f"port {name} is on bridge {holder}, not {bridge}",
                code="ovs_port_on_other_bridge",
                evidence={"port": name, "bridge": holder, "wanted_bridge": bridge},
            )
        interfaces = list(port.interfaces)
        if len(interfaces) != 1 or interfaces[0].name != name:
            raise OvsRefused(
                f"port {name} has interfaces {[i.name for i in interfaces]}, not the single tap {name}",
                code="ovs_port_not_simple",
                evidence={"port": name, "interfaces": [i.name for i in interfaces]},
            )
        iface = interfaces[0]
        iface.verify("external_ids")
        owner = iface.external_ids.get(EXT_ALLOCATION)
        if owner is not None and allocation_id is not None and owner != allocation_id:
            raise OvsRefused(
                f"port {name} belongs to allocation {owner}, not {allocation_id}",
                code="ovs_port_owned_by_other_allocation",
                evidence={"port": name, "owner": owner, "allocation_id": allocation_id},
            )
        if removing and owner is None:
            ours = bool(_VNIC.fullmatch(name)) and (
                allocation_id is None or name.endswith("-" + allocation_id.replace("-", "")[:10])
            )
            if not ours:
                raise OvsRefused(
                    f"port {name} carries no {EXT_ALLOCATION} mark and is not this slot's vNIC name",
                    code="ovs_port_not_owned",
                    evidence={"port": name, "bridge": bridge, "allocation_id": allocation_id},
                )
        return iface

    def _record(self, bridge: str, port_name: str) -> OvsPort | None:
        br = self._bridges().get(bridge)
        port = self._port(port_name)
        if br is None or port is None or not port.interfaces:
            return None
        return _port_record(bridge, port, port.interfaces[0])


def _port_record(bridge: str, port: Any, iface: Any) -> OvsPort:
    ext = iface.external_ids
    slot = ext.get(EXT_SLOT)
    return OvsPort(
        bridge=bridge,
        name=port.name,
        iface_id=ext.get(EXT_IFACE_ID),
        attached_mac=ext.get(EXT_ATTACHED_MAC),
        vm_uuid=ext.get(EXT_VM_UUID),
        allocation_id=ext.get(EXT_ALLOCATION),
        slot_index=int(slot) if slot is not None and slot.isdigit() else None,
        ofport=_one(iface.ofport),
        interface_error=_one(iface.error),
        ingress_policing_rate_kbps=iface.ingress_policing_rate,
        ingress_policing_burst_kb=iface.ingress_policing_burst,
    )
