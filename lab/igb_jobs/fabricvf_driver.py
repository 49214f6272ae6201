"""Runs INSIDE the igb guest: the agent's own fabric VF driver (gpuaas_agent.host.network.fabricvf) on real VFs.

The package is a copy of the checkout's ``gpuaas_agent/`` (lab/igb_guest.py puts it on the path); nothing
of it is changed here. Prints one JSON document: each call's outcome (what it returned, or its error code
and evidence). The host-side test asserts.
"""

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass

from igb_jobs.guestsys import igb_pfs, sysfs
from pyroute2 import IPRoute

from gpuaas_agent.contract.fabricvf import (
    EthernetAttachment,
    FabricIsolation,
    VfSettings,
    derive_vf_identity,
    parked_settings,
    parking_guid,
    tenant_settings,
)
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.fabricvf import FabricVfNetlink, compare_settings, read_eswitch_mode
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.fabricvf import FabricVfPlan, VfTarget, apply_fabric_vfs, park_target, recorded

HOST_KEY = "igb-lab-guest"
IP = "/usr/local/sbin/ip"  # iproute2's, copied in by lab/igb_guest.py (busybox's ip has no -d/-j)
# Two tenants' allocations on this one "slice host": slot 0 / VF 0 and slot 1 / VF 1, each its own VLAN.
TENANTS = (("alloc-a", 0, EthernetAttachment(vlan=101, qos=2, max_rate_mbps=200)),
           ("alloc-b", 1, EthernetAttachment(vlan=202)))


def outcome(fn):
    try:
        value = fn()
    except AgentError as exc:
        return {"ok": False, "code": exc.code, "message": str(exc), "evidence": exc.evidence}
    if isinstance(value, VfSettings):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    return {"ok": True, "value": value}


@dataclass(frozen=True)
class WithoutLinkState(FabricVfNetlink):
    """The agent's driver with the VF link state left out of every set and its comparison: igb has none
    (EOPNOTSUPP, docs/fabric-igb.md), so on igb this is the one value neither set nor shown."""

    def apply(self, pf_netdev, wanted):
        return super().apply(pf_netdev, wanted.model_copy(update={"link_state": None}))


def ip_link(pf):
    """What an operator reads on the host: ``ip -d -j link show dev PF`` (its vfinfo_list)."""
    done = subprocess.run([IP, "-d", "-j", "link", "show", "dev", pf], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return {"ok": False, "rc": done.returncode, "stderr": done.stderr[-2000:]}
    return {"ok": True, "value": json.loads(done.stdout)}


def async_outcome(make):
    return outcome(lambda: asyncio.run(make()))


def two_tenants(pf, pci, store_path="/tmp/two-tenants/state.db"):
    """The agent's own provision step body (``apply_fabric_vfs``: record, apply, read back) for two allocations,
    each on its own VF with its own VLAN; the host's view while both hold; the release park of both
    (``park_target``: park, read back, record parked); the host's view again."""
    store = StateStore.open(store_path)
    thread = as_store_thread(store)
    out = {"provision_full": {}, "provision": {}, "park": {}, "records": {}}
    targets = {}
    for alloc, slot, _ in TENANTS:
        address = os.path.basename(os.path.realpath(f"/sys/class/net/{pf}/device/virtfn{slot}"))
        targets[alloc] = VfTarget(slot_index=slot, vf_pci_address=address, pf_pci_address=pci, pf_netdev=pf,
                                  vf_index=slot, kind="ethernet", identity=derive_vf_identity(HOST_KEY, slot),
                                  parking_guid=parking_guid(HOST_KEY, slot))
    plans = {alloc: FabricVfPlan(FabricIsolation.required, attachment, targets=(targets[alloc],))
             for alloc, _, attachment in TENANTS}
    net, igb = FabricVfNetlink(), WithoutLinkState()
    for alloc, _, _ in TENANTS:  # the unchanged driver: refused typed on igb (no VF link state)
        out["provision_full"][alloc] = async_outcome(lambda a=alloc: apply_fabric_vfs(net, thread, plans[a], a, f"p-{a}"))
    for alloc, _, _ in TENANTS:
        out["provision"][alloc] = async_outcome(lambda a=alloc: apply_fabric_vfs(igb, thread, plans[a], a, f"p-{a}"))
    out["ip_both_applied"] = ip_link(pf)
    out["read_both_applied"] = {str(slot): outcome(lambda v=slot: net.read(pf, v)) for _, slot, _ in TENANTS}
    for alloc, _, _ in TENANTS:
        out["park"][alloc] = async_outcome(lambda a=alloc: park_target(igb, thread, targets[a], a, f"r-{a}"))
    out["ip_both_parked"] = ip_link(pf)
    out["read_both_parked"] = {str(slot): outcome(lambda v=slot: net.read(pf, v)) for _, slot, _ in TENANTS}
    for alloc, target in targets.items():
        out["records"][alloc] = outcome(lambda t=target: asyncio.run(recorded(thread, t.vf_pci_address)))
    out["targets"] = {alloc: t.journal() for alloc, t in targets.items()}
    store.close()
    return out


def main():
    pf = igb_pfs()[0]
    pci = os.path.basename(os.path.realpath(f"/sys/class/net/{pf}/device"))
    with open(f"/sys/class/net/{pf}/device/sriov_numvfs", "w") as fh:
        fh.write("2")
    with IPRoute() as ipr:  # the PF's link up: igb takes a rate cap only with carrier
        ipr.link("set", index=ipr.link_lookup(ifname=pf)[0], state="up")
    deadline = time.monotonic() + 20
    while sysfs(f"/sys/class/net/{pf}/carrier") != "1" and time.monotonic() < deadline:
        time.sleep(0.2)  # carrier comes from the emulated PHY's autonegotiation timer
    net = FabricVfNetlink()
    identity = derive_vf_identity(HOST_KEY, 0)
    attachment = EthernetAttachment(vlan=100, qos=3, max_rate_mbps=100)
    tenant = tenant_settings(0, identity, attachment)
    tenant_no_link_state = tenant.model_copy(update={"link_state": None})
    parked = parked_settings(1, "ethernet", parking_guid(HOST_KEY, 1))
    parked_no_link_state = parked.model_copy(update={"link_state": None})
    other = tenant_settings(1, derive_vf_identity(HOST_KEY, 1), EthernetAttachment(vlan=200))
    report = {"pf": pf, "pf_pci": pci, "identity": identity.model_dump(mode="json"),
              "tenant": tenant.model_dump(mode="json"), "parked": parked.model_dump(mode="json"), "calls": {}}
    calls = report["calls"]
    calls["read_vf0_fresh"] = outcome(lambda: net.read(pf, 0))
    # A VF a previous holder left trusted: does a refused apply leave it so?
    with IPRoute() as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname=pf)[0], vf={"vf": 0, "trust": 1})
    calls["apply_tenant"] = outcome(lambda: net.apply(pf, tenant))
    calls["read_vf0_after_apply_tenant"] = outcome(lambda: net.read(pf, 0))
    calls["apply_tenant_without_link_state"] = outcome(lambda: net.apply(pf, tenant_no_link_state))
    calls["apply_vf1_other_tenant_without_link_state"] = outcome(
        lambda: net.apply(pf, other.model_copy(update={"link_state": None})))
    # drift: someone else sets VF 0's VLAN and spoof check on the PF; the driver's read + compare names it
    with IPRoute() as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname=pf)[0], vf={"vf": 0, "vlan": 300, "spoofchk": 0})
    calls["drift_compare"] = outcome(lambda: compare_settings(tenant_no_link_state, net.read(pf, 0)))
    calls["drift_restore"] = outcome(lambda: net.apply(pf, tenant_no_link_state))
    calls["compare_after_restore"] = outcome(lambda: compare_settings(tenant_no_link_state, net.read(pf, 0)))
    calls["park_vf1"] = outcome(lambda: net.apply(pf, parked))
    calls["park_vf1_without_link_state"] = outcome(lambda: net.apply(pf, parked_no_link_state))
    calls["read_vf0_after_park"] = outcome(lambda: net.read(pf, 0))
    calls["read_vf5_missing"] = outcome(lambda: net.read(pf, 5))
    calls["apply_vf5_missing"] = outcome(lambda: net.apply(pf, tenant_no_link_state.model_copy(update={"vf": 5})))
    calls["eswitch_mode"] = outcome(lambda: [*map(str, read_eswitch_mode(pci))])
    try:
        report["two_tenants"] = two_tenants(pf, pci)
    except Exception as exc:  # the earlier calls' report still goes back; the test names this failure
        report["two_tenants"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(report, sort_keys=True, default=str))


main()
