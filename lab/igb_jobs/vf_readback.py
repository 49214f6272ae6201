"""Runs INSIDE the igb guest (lab/igb_guest.py): two VFs on the igb PF set and read back through pyroute2.

Prints one JSON document: every step's outcome (``ok`` or the kernel's errno), the raw IFLA_VFINFO_LIST
after each stage as pyroute2 decodes it, and the provenance (kernel, PCI ids). Nothing here asserts:
the host-side test does, so a refusal of the kernel is evidence, not a crash.
"""

import errno
import json
import os
import time

from igb_jobs.guestsys import driver_of, igb_pfs, sysfs
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

RTEXT_FILTER_VF = 1
VF0 = {"mac": "02:00:5e:1b:00:10", "vlan": 100, "qos": 3}
VF1_VLAN = 200
PARK = {"mac": "00:00:00:00:00:00", "vlan": 4094, "qos": 0}
RATE_MBPS = 100


def plain(value, name=None):
    """pyroute2's decoded nla as JSON: field dicts without the header, nested attrs as [name, value] pairs."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "header":
                if name == "UNKNOWN":  # an attribute pyroute2 cannot decode: keep its type number
                    out["type"] = item.get("type")
                continue
            if key == "attrs":
                out["attrs"] = [[attr[0], plain(attr[1], attr[0])] for attr in item]
            else:
                out[key] = plain(item)
        return out
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def vfinfo(ipr, index):
    (msg,) = ipr.link("get", index=index, ext_mask=RTEXT_FILTER_VF)
    vflist = msg.get_attr("IFLA_VFINFO_LIST")
    return [] if vflist is None else [plain(vf)["attrs"] for vf in vflist.get_attrs("IFLA_VF_INFO")]


def main():
    pfs = igb_pfs()
    pf = pfs[0]
    pci = f"/sys/class/net/{pf}/device"
    report = {
        "pf": pf,
        "provenance": {
            "kernel": os.uname().release,
            "proc_version": sysfs("/proc/version"),
            "pf_pci_id": f"{sysfs(pci + '/vendor')}:{sysfs(pci + '/device')}",
            "sriov_totalvfs": int(sysfs(pci + "/sriov_totalvfs")),
        },
        "steps": [],
        "readback": {},
    }
    steps = report["steps"]

    def step(name, ipr, index, vf):
        request = json.loads(json.dumps(vf))  # pyroute2 pops keys out of the dict it is given
        try:
            ipr.link("set", index=index, vf=vf)
            steps.append({"step": name, "request": request, "ok": True})
        except NetlinkError as exc:
            steps.append({"step": name, "request": request, "ok": False, "errno": exc.code,
                          "error": errno.errorcode.get(exc.code, str(exc.code))})

    with open(pci + "/sriov_numvfs", "w") as fh:
        fh.write("2")
    report["vfs"] = {}
    for n in sorted(os.listdir("/sys/class/net")):
        if driver_of(n) == "igbvf":
            report["vfs"][n] = f"{sysfs(f'/sys/class/net/{n}/device/vendor')}:{sysfs(f'/sys/class/net/{n}/device/device')}"
    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname=pf)[0]
        report["readback"]["after_sriov_numvfs"] = vfinfo(ipr, index)
        # VF 0: a tenant's attachment, one attribute per request so each answer is the kernel's own
        step("vf0.mac", ipr, index, {"vf": 0, "mac": VF0["mac"]})
        step("vf0.vlan_qos", ipr, index, {"vf": 0, "vlan": {"vlan": VF0["vlan"], "qos": VF0["qos"]}})
        step("vf0.spoofchk_on", ipr, index, {"vf": 0, "spoofchk": 1})
        step("vf0.trust_off", ipr, index, {"vf": 0, "trust": 0})
        step("vf0.link_state_auto", ipr, index, {"vf": 0, "link_state": 0})
        # The rate cap needs the PF's link up (igb refuses it with EINVAL on a link that is down).
        ipr.link("set", index=index, state="up")
        deadline = time.monotonic() + 20
        while sysfs(f"/sys/class/net/{pf}/carrier") != "1" and time.monotonic() < deadline:
            time.sleep(0.2)  # carrier comes from the emulated PHY's autonegotiation timer
        report["pf_carrier"] = sysfs(f"/sys/class/net/{pf}/carrier")
        step("vf0.rate", ipr, index, {"vf": 0, "rate": {"min_tx_rate": 0, "max_tx_rate": RATE_MBPS}})
        report["readback"]["vf0_applied"] = vfinfo(ipr, index)
        # VF 1: another tenant's VLAN, then parked
        step("vf1.vlan", ipr, index, {"vf": 1, "vlan": {"vlan": VF1_VLAN, "qos": 0}})
        step("vf1.mac", ipr, index, {"vf": 1, "mac": "02:00:5e:1b:00:11"})
        report["readback"]["vf1_applied"] = vfinfo(ipr, index)
        step("vf1.park.link_state_disable", ipr, index, {"vf": 1, "link_state": 2})
        step("vf1.park.vlan", ipr, index, {"vf": 1, "vlan": {"vlan": PARK["vlan"], "qos": PARK["qos"]}})
        step("vf1.park.mac_zero", ipr, index, {"vf": 1, "mac": PARK["mac"]})
        step("vf1.park.rate_off", ipr, index, {"vf": 1, "rate": {"min_tx_rate": 0, "max_tx_rate": 0}})
        report["readback"]["vf1_parked"] = vfinfo(ipr, index)
        # Out of range: the kernel's answer for a VF that does not exist
        step("vf7.mac_out_of_range", ipr, index, {"vf": 7, "mac": VF0["mac"]})
    print(json.dumps(report, sort_keys=True))


main()
