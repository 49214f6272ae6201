"""The OVS driver against a real ovsdb-server and ovs-vswitchd (netdev bridge) started per test.

The real ``ovs-vsctl`` plays libvirt and the operator here; the driver itself speaks
only OVSDB through the IDL.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from gpuaas_agent.contract.naming import vnic_name
from gpuaas_agent.contract.ovs import (
    EXT_ALLOCATION,
    EXT_ATTACHED_MAC,
    EXT_IFACE_ID,
    EXT_SLOT,
    EXT_VM_UUID,
    BridgeEvidence,
    OvsPort,
    default_iface_id,
)
from gpuaas_agent.errors import ContractError, GuardError, HostError
from gpuaas_agent.host.network.ovs import COMMIT_ATTEMPTS, OvsDriver, OvsError, OvsInputError, OvsRefused
from tests.support.ovsdb_fixture import OvsSwitch

MAC = "52:54:00:12:34:56"


@pytest.fixture
def driver(ovs_switch: OvsSwitch):
    with OvsDriver(ovs_switch.remote, timeout_s=10.0) as d:
        yield d


def new_slot(slot_index: int = 3) -> dict:
    allocation_id = str(uuid.uuid4())
    return {
        "allocation_id": allocation_id,
        "slot_index": slot_index,
        "port_name": vnic_name(allocation_id, slot_index),
        "vm_uuid": str(uuid.uuid4()),
        "mac": MAC,
    }


def add(driver: OvsDriver, bridge: str, slot: dict, **extra) -> OvsPort:
    return driver.add_vm_port(
        bridge, slot["port_name"], mac=slot["mac"], vm_uuid=slot["vm_uuid"],
        allocation_id=slot["allocation_id"], slot_index=slot["slot_index"], **extra,
    )


def iface_column(sw: OvsSwitch, name: str, column: str):
    """One Interface column as ovs-vsctl's JSON gives it (maps become dicts)."""
    out = json.loads(sw.vsctl("--format=json", f"--columns={column}", "list", "Interface", name))
    value = out["data"][0][0]
    if isinstance(value, list) and value[0] == "map":
        return dict(value[1])
    return value


def ports_of(sw: OvsSwitch, bridge: str) -> list[str]:
    return sw.vsctl("list-ports", bridge).split()


def db_snapshot(sw: OvsSwitch) -> str:
    """What the driver could have changed (not statistics, which vswitchd updates on its own)."""
    return "\n".join([
        sw.vsctl("list-br"),
        sw.vsctl("--columns=name,ports,datapath_type", "list", "Bridge"),
        sw.vsctl("--columns=name,interfaces", "list", "Port"),
        sw.vsctl("--columns=name,type,external_ids,ingress_policing_rate,ingress_policing_burst", "list", "Interface"),
    ])


# -- the fixture itself ----------------------------------------------------------------


def test_fixture_runs_a_netdev_bridge_on_private_sockets(ovs_switch: OvsSwitch, driver: OvsDriver):
    assert ovs_switch.remote == f"unix:{ovs_switch.rundir}/db.sock"
    assert ovs_switch.env["OVS_RUNDIR"] == str(ovs_switch.rundir)
    assert len(ovs_switch.bridge) <= 15
    assert ovs_switch.vsctl("get", "Bridge", ovs_switch.bridge, "datapath_type").strip() == "netdev"
    evidence = driver.ensure_bridge(ovs_switch.bridge, datapath_type="netdev")
    assert evidence == BridgeEvidence(name=ovs_switch.bridge, datapath_type="netdev", created=False, ports=[ovs_switch.bridge])
    print(f"ovs fixture startup {ovs_switch.startup_s:.3f}s")


def test_root_netns_switch_attaches_a_veth_of_the_root_namespace(ovs_switch_root_netns: OvsSwitch):
    """The variant libvirt needs (its taps live in the root namespace)."""
    sw = ovs_switch_root_netns
    assert sw.netns is None
    slot = new_slot(slot_index=2)
    sw.veth(slot["port_name"], "peer" + uuid.uuid4().hex[:6])
    with OvsDriver(sw.remote) as d:
        port = add(d, sw.bridge, slot)
    assert port.ofport is not None and port.ofport >= 1


# -- bridges ---------------------------------------------------------------------------


def test_missing_bridge_is_a_blocker_and_is_not_created(ovs_switch: OvsSwitch, driver: OvsDriver):
    assert driver.bridge_exists(ovs_switch.bridge)
    assert not driver.bridge_exists("ovsbr0")
    with pytest.raises(OvsRefused) as info:
        driver.ensure_bridge("ovsbr0")
    assert info.value.code == "ovs_bridge_missing"
    assert info.value.evidence["bridges"] == [ovs_switch.bridge]
    assert info.value.evidence["remote"] == ovs_switch.remote
    assert ovs_switch.vsctl("list-br").split() == [ovs_switch.bridge]


def test_ensure_bridge_creates_only_when_asked_and_once(ovs_switch: OvsSwitch, driver: OvsDriver):
    name = "gst" + uuid.uuid4().hex[:8]
    first = driver.ensure_bridge(name, create=True, datapath_type="netdev")
    assert first == BridgeEvidence(name=name, datapath_type="netdev", created=True, ports=[name])
    # vswitchd really opened it (the driver waited for cur_cfg): the local port has OFPP_LOCAL.
    assert iface_column(ovs_switch, name, "ofport") == 65534
    again = driver.ensure_bridge(name, create=True, datapath_type="netdev")
    assert again.created is False
    assert sorted(ovs_switch.vsctl("list-br").split()) == sorted([ovs_switch.bridge, name])
    with pytest.raises(OvsRefused) as info:
        driver.ensure_bridge(name, datapath_type="system")
    assert info.value.code == "ovs_bridge_datapath_mismatch"
    ovs_switch.vsctl("add-port", ovs_switch.bridge, "uplink0")
    before = db_snapshot(ovs_switch)
    with pytest.raises(OvsRefused) as info:
        driver.ensure_bridge("uplink0", create=True)
    assert info.value.code == "ovs_interface_conflict"
    assert db_snapshot(ovs_switch) == before


# -- adding ports ----------------------------------------------------------------------


def test_add_vm_port_writes_external_ids_and_is_idempotent(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot = new_slot()
    port = add(driver, ovs_switch.bridge, slot)
    again = add(driver, ovs_switch.bridge, slot)
    assert ports_of(ovs_switch, ovs_switch.bridge) == [slot["port_name"]]
    ids = iface_column(ovs_switch, slot["port_name"], "external_ids")
    assert ids == {
        EXT_IFACE_ID: default_iface_id(slot["allocation_id"], slot["slot_index"]),
        EXT_ATTACHED_MAC: MAC,
        EXT_VM_UUID: slot["vm_uuid"],
        EXT_ALLOCATION: slot["allocation_id"],
        EXT_SLOT: "3",
    }
    assert port.allocation_id == slot["allocation_id"] and port.slot_index == 3
    # No tap yet (libvirt makes it at domain start): vswitchd reports it could not open it.
    assert port.ofport == -1 and "No such device" in (port.interface_error or "")
    assert again.model_dump(exclude={"interface_error"}) == port.model_dump(exclude={"interface_error"})


def test_veth_port_gets_a_real_ofport_on_the_netdev_bridge(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot = new_slot(slot_index=0)
    ovs_switch.veth(slot["port_name"], "peer" + uuid.uuid4().hex[:6])
    port = add(driver, ovs_switch.bridge, slot)
    assert port.ofport is not None and port.ofport >= 1
    assert port.interface_error is None
    assert iface_column(ovs_switch, slot["port_name"], "ofport") == port.ofport


@pytest.mark.parametrize(
    "libvirt_add",
    [
        # What the brief saw libvirt run at domain start: the port is deleted and re-added.
        ["--", "--if-exists", "del-port", "{port}", "--", "add-port", "{bridge}", "{port}"],
        # Older libvirt: --may-exist keeps the row, but still overwrites iface-id.
        ["--", "--may-exist", "add-port", "{bridge}", "{port}"],
    ],
    ids=["del-port-add-port", "may-exist"],
)
def test_add_vm_port_restores_ids_after_libvirt_recreates_the_port(
    ovs_switch: OvsSwitch, driver: OvsDriver, libvirt_add: list[str]
):
    slot = new_slot(slot_index=1)
    name, bridge = slot["port_name"], ovs_switch.bridge
    add(driver, bridge, slot, ingress_policing_rate_kbps=10_000, ingress_policing_burst_kb=1_000)
    # Domain start: libvirt creates the tap (a veth stands in for it), then runs ovs-vsctl.
    ovs_switch.veth(name, "peer" + uuid.uuid4().hex[:6])
    libvirt_iface_id = str(uuid.uuid4())
    ovs_switch.vsctl(
        *[arg.format(port=name, bridge=bridge) for arg in libvirt_add],
        "--", "set", "Interface", name, f'external-ids:attached-mac="{MAC}"',
        "--", "set", "Interface", name, f'external-ids:iface-id="{libvirt_iface_id}"',
        "--", "set", "Interface", name, f'external-ids:vm-id="{slot["vm_uuid"]}"',
        "--", "set", "Interface", name, "external-ids:iface-status=active",
    )
    seen = iface_column(ovs_switch, name, "external_ids")
    assert seen[EXT_IFACE_ID] == libvirt_iface_id
    if "del-port" in libvirt_add:
        assert EXT_ALLOCATION not in seen  # our marks are gone until we re-assert them
        assert driver.list_agent_ports(bridge) == []

    port = add(driver, bridge, slot, ingress_policing_rate_kbps=10_000, ingress_policing_burst_kb=1_000)

    assert ports_of(ovs_switch, bridge) == [name]
    assert len(json.loads(ovs_switch.vsctl("--format=json", "--columns=name", "find", "Port", f"name={name}"))["data"]) == 1
    ids = iface_column(ovs_switch, name, "external_ids")
    assert ids[EXT_ALLOCATION] == slot["allocation_id"]
    assert ids[EXT_IFACE_ID] == default_iface_id(slot["allocation_id"], 1)
    assert ids[EXT_VM_UUID] == slot["vm_uuid"]
    assert ids["vm-id"] == slot["vm_uuid"] and ids["iface-status"] == "active"  # libvirt's keys are kept
    assert iface_column(ovs_switch, name, "ingress_policing_rate") == 10_000
    assert port.ofport is not None and port.ofport >= 1
    assert driver.list_agent_ports(bridge) == [port]


def test_ingress_policing_is_set_changed_and_cleared(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot = new_slot()
    name = slot["port_name"]
    port = add(driver, ovs_switch.bridge, slot, ingress_policing_rate_kbps=25_000_000, ingress_policing_burst_kb=2_500_000)
    assert (port.ingress_policing_rate_kbps, port.ingress_policing_burst_kb) == (25_000_000, 2_500_000)
    assert iface_column(ovs_switch, name, "ingress_policing_rate") == 25_000_000
    assert iface_column(ovs_switch, name, "ingress_policing_burst") == 2_500_000
    port = add(driver, ovs_switch.bridge, slot, ingress_policing_rate_kbps=1_000)
    assert (port.ingress_policing_rate_kbps, port.ingress_policing_burst_kb) == (1_000, 0)
    port = add(driver, ovs_switch.bridge, slot)
    assert (port.ingress_policing_rate_kbps, port.ingress_policing_burst_kb) == (0, 0)
    assert iface_column(ovs_switch, name, "ingress_policing_rate") == 0
    assert iface_column(ovs_switch, name, "ingress_policing_burst") == 0


def test_list_agent_ports_ignores_ports_without_our_mark(ovs_switch: OvsSwitch, driver: OvsDriver):
    other = "gso" + uuid.uuid4().hex[:8]
    ovs_switch.vsctl("add-br", other, "--", "set", "Bridge", other, "datapath_type=netdev")
    ovs_switch.vsctl("add-port", ovs_switch.bridge, "uplink0")
    ovs_switch.vsctl("add-port", ovs_switch.bridge, "tapx", "--", "set", "Interface", "tapx", "external-ids:iface-id=abc")
    a, b = new_slot(0), new_slot(1)
    port_a = add(driver, ovs_switch.bridge, a)
    port_b = add(driver, other, b)
    assert driver.list_agent_ports(ovs_switch.bridge) == [port_a]
    assert driver.list_agent_ports(other) == [port_b]
    assert {p.name for p in driver.list_agent_ports()} == {a["port_name"], b["port_name"]}


# -- refusals --------------------------------------------------------------------------

GOOD = new_slot()


@pytest.mark.parametrize(
    "change",
    [
        {"mac": "52:54:00:12:34"},
        {"mac": "52:54:00:12:34:5G"},
        {"mac": "52:54:00:AB:CD:EF"},
        {"mac": "01:00:5e:00:00:01"},  # multicast
        {"port_name": "gs3-0123456789ab"},  # 16 bytes
        {"port_name": "vnet0"},
        {"port_name": "eth0"},  # a valid name, but not this slot's vNIC
        {"bridge": "a-bridge-name-too-long"},
        {"bridge": "br/0"},
        {"allocation_id": "not-a-uuid"},
        {"vm_uuid": "ABCDEF00-0000-0000-0000-000000000000"},
        {"iface_id": "x"},
        {"slot_index": 256},
        {"ingress_policing_burst_kb": 100},  # burst without rate
        {"ingress_policing_rate_kbps": 0},
        {"ingress_policing_rate_kbps": -5},
        {"ingress_policing_rate_kbps": 2**40},
    ],
)
def test_bad_input_is_refused_with_nothing_changed(ovs_switch: OvsSwitch, driver: OvsDriver, change: dict):
    args = {"bridge": ovs_switch.bridge, **{k: v for k, v in GOOD.items()}, **change}
    before = db_snapshot(ovs_switch)
    with pytest.raises(OvsInputError) as info:
        driver.add_vm_port(args.pop("bridge"), args.pop("port_name"), **args)
    assert isinstance(info.value, ContractError)
    assert info.value.code == "ovs_invalid_input"
    assert info.value.evidence["field"] in {*change, "port_name"}
    assert db_snapshot(ovs_switch) == before


def test_port_on_another_bridge_is_refused(ovs_switch: OvsSwitch, driver: OvsDriver):
    other = "gso" + uuid.uuid4().hex[:8]
    slot = new_slot()
    ovs_switch.vsctl("add-br", other, "--", "set", "Bridge", other, "datapath_type=netdev")
    ovs_switch.vsctl("add-port", other, slot["port_name"])
    before = db_snapshot(ovs_switch)
    with pytest.raises(OvsRefused) as info:
        add(driver, ovs_switch.bridge, slot)
    assert info.value.code == "ovs_port_on_other_bridge"
    assert info.value.evidence["bridge"] == other
    with pytest.raises(OvsRefused):
        driver.remove_vm_port(ovs_switch.bridge, slot["port_name"])
    assert db_snapshot(ovs_switch) == before


def test_port_of_another_allocation_is_neither_merged_nor_removed(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot = new_slot()
    add(driver, ovs_switch.bridge, slot)
    stranger = str(uuid.uuid4())
    ovs_switch.vsctl("set", "Interface", slot["port_name"], f"external-ids:{EXT_ALLOCATION}={stranger}")
    before = db_snapshot(ovs_switch)
    with pytest.raises(OvsRefused) as info:
        add(driver, ovs_switch.bridge, slot)
    assert isinstance(info.value, GuardError)
    assert info.value.code == "ovs_port_owned_by_other_allocation"
    assert info.value.evidence["owner"] == stranger
    with pytest.raises(OvsRefused) as info:
        driver.remove_vm_port(ovs_switch.bridge, slot["port_name"], allocation_id=slot["allocation_id"])
    assert info.value.code == "ovs_port_owned_by_other_allocation"
    assert db_snapshot(ovs_switch) == before


def test_port_attached_to_another_mac_is_refused(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot = new_slot()
    ovs_switch.vsctl("add-port", ovs_switch.bridge, slot["port_name"], "--",
                     "set", "Interface", slot["port_name"], 'external-ids:attached-mac="52:54:00:99:99:99"')
    before = db_snapshot(ovs_switch)
    with pytest.raises(OvsRefused) as info:
        add(driver, ovs_switch.bridge, slot)
    assert info.value.code == "ovs_port_mac_conflict"
    assert db_snapshot(ovs_switch) == before


# -- removing ports --------------------------------------------------------------------


def test_remove_vm_port_is_idempotent(ovs_switch: OvsSwitch, driver: OvsDriver):
    keep, gone = new_slot(0), new_slot(1)
    add(driver, ovs_switch.bridge, keep)
    add(driver, ovs_switch.bridge, gone)
    assert driver.remove_vm_port(ovs_switch.bridge, gone["port_name"], allocation_id=gone["allocation_id"]) is True
    assert driver.remove_vm_port(ovs_switch.bridge, gone["port_name"], allocation_id=gone["allocation_id"]) is False
    assert ports_of(ovs_switch, ovs_switch.bridge) == [keep["port_name"]]
    assert ovs_switch.vsctl("--if-exists", "get", "Interface", gone["port_name"], "name").strip() == ""
    assert [p.name for p in driver.list_agent_ports()] == [keep["port_name"]]


def test_remove_takes_an_unmarked_slot_vnic_but_never_a_foreign_port(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot, other = new_slot(), new_slot()
    # libvirt re-created the slot's port and our marks were not re-asserted yet.
    ovs_switch.vsctl("add-port", ovs_switch.bridge, slot["port_name"])
    ovs_switch.vsctl("add-port", ovs_switch.bridge, "uplink0")
    with pytest.raises(OvsRefused) as info:
        driver.remove_vm_port(ovs_switch.bridge, "uplink0")
    assert info.value.code == "ovs_port_not_owned"
    with pytest.raises(OvsRefused) as info:
        driver.remove_vm_port(ovs_switch.bridge, slot["port_name"], allocation_id=other["allocation_id"])
    assert info.value.code == "ovs_port_not_owned"
    assert sorted(ports_of(ovs_switch, ovs_switch.bridge)) == sorted([slot["port_name"], "uplink0"])
    assert driver.remove_vm_port(ovs_switch.bridge, slot["port_name"], allocation_id=slot["allocation_id"]) is True
    assert ports_of(ovs_switch, ovs_switch.bridge) == ["uplink0"]


# -- transactions, concurrency, failures -----------------------------------------------


def test_try_again_is_resynced_and_retried(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot = new_slot()
    add(driver, ovs_switch.bridge, slot)
    ovs_switch.vsctl("remove", "Interface", slot["port_name"], "external_ids", EXT_VM_UUID)
    attempts = []

    def meanwhile(attempt: int) -> None:
        attempts.append(attempt)
        if attempt == 1:  # another client writes between our read and our commit
            ovs_switch.vsctl("set", "Interface", slot["port_name"], "external-ids:operator=note")

    driver._before_commit = meanwhile
    port = add(driver, ovs_switch.bridge, slot)
    assert attempts == [1, 2]
    ids = iface_column(ovs_switch, slot["port_name"], "external_ids")
    assert ids["operator"] == "note" and ids[EXT_VM_UUID] == slot["vm_uuid"]
    assert port.vm_uuid == slot["vm_uuid"]


def test_endless_try_again_gives_up_with_a_typed_error(ovs_switch: OvsSwitch, driver: OvsDriver):
    slot = new_slot()
    add(driver, ovs_switch.bridge, slot)
    ovs_switch.vsctl("remove", "Interface", slot["port_name"], "external_ids", EXT_VM_UUID)
    driver._before_commit = lambda attempt: ovs_switch.vsctl(
        "set", "Interface", slot["port_name"], f"external-ids:operator={attempt}"
    )
    with pytest.raises(OvsError) as info:
        add(driver, ovs_switch.bridge, slot)
    assert info.value.code == "ovs_commit_retries_exhausted"
    ids = iface_column(ovs_switch, slot["port_name"], "external_ids")
    assert EXT_VM_UUID not in ids and ids["operator"] == str(COMMIT_ATTEMPTS)


def test_concurrent_async_callers_get_one_port_each(ovs_switch: OvsSwitch, driver: OvsDriver):
    slots = [new_slot(i) for i in range(4)]

    async def provision_all():
        return await asyncio.gather(*(
            asyncio.to_thread(add, driver, ovs_switch.bridge, slot) for slot in slots + slots
        ))

    ports = asyncio.run(provision_all())
    assert sorted(ports_of(ovs_switch, ovs_switch.bridge)) == sorted(s["port_name"] for s in slots)
    assert {p.name for p in ports} == {s["port_name"] for s in slots}


def test_unreachable_ovsdb_is_a_typed_error_naming_the_remote(ovs_switch: OvsSwitch, tmp_path):
    remote = f"unix:{tmp_path}/no-such.sock"
    with pytest.raises(OvsError) as info:
        OvsDriver(remote, timeout_s=1.0)
    assert isinstance(info.value, HostError)
    assert info.value.code == "ovsdb_unreachable" and info.value.evidence["remote"] == remote
    with OvsDriver(ovs_switch.remote, timeout_s=1.0) as d:
        ovs_switch.kill_ovsdb_server()
        with pytest.raises(OvsError) as info:
            d.list_agent_ports()
        assert info.value.code == "ovsdb_unreachable"
        assert info.value.evidence["remote"] == ovs_switch.remote


def test_change_not_applied_by_a_dead_vswitchd_is_reported(ovs_switch: OvsSwitch):
    with OvsDriver(ovs_switch.remote, timeout_s=1.5) as d:
        ovs_switch.kill_vswitchd()
        with pytest.raises(OvsError) as info:
            add(d, ovs_switch.bridge, new_slot())
        assert info.value.code == "ovs_vswitchd_timeout"
