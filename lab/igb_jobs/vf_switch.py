"""Runs INSIDE the igb guest: does the NIC's VF switch keep one VF's frames from another (VLAN, spoofed MAC)?

Both VFs are bound to ``igbvf`` after the PF has set their MAC/VLAN/spoof check (autoprobe off until then,
so each VF driver starts with its administrative MAC). Frames are raw AF_PACKET frames bound to one VF's
netdev: they can only travel through the emulated NIC's internal switch (VMDq loopback), never through the
guest kernel's own stack. No wall-clock window decides "did not arrive": every forbidden frame is followed
by a control frame that the same switch must deliver, and the receiver reads until the control frame is
there (TX is processed in order per queue), so the forbidden one either came before it or never.

Prints one JSON document of every case's outcome; the host-side test asserts.
"""

import json
import os
import socket
import struct
import subprocess
import time

from igb_jobs.guestsys import driver_of, igb_pfs, sysfs
from pyroute2 import IPRoute

ETH_P_ALL = 0x0003
ETHERTYPE = 0x88B5  # IEEE 802 local experimental
MAC0, MAC1 = "02:00:5e:1b:00:10", "02:00:5e:1b:00:11"
SPOOFED = "02:00:5e:1b:00:99"
VLAN_A, VLAN_B = 100, 200
DEADLINE_S = 10.0
RESET_FAILED = "PF still in reset state"  # igbvf's words for a reset the PF did not complete


def write(path, value):
    with open(path, "w") as fh:
        fh.write(value)


def igbvf_netdevs(count):
    """VF PCI address -> netdev, once ``count`` igbvf netdevs are there (or the deadline passed: fewer)."""
    names = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(names) < count and time.monotonic() < deadline:
        for n in os.listdir("/sys/class/net"):
            if driver_of(n) == "igbvf":
                names[os.path.basename(os.path.realpath(f"/sys/class/net/{n}/device"))] = n
        time.sleep(0.1)  # the VF netdevs appear as igbvf probes them
    return names


def dmesg_lines():
    return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).stdout.splitlines()


def igb_lines(lines):
    return [ln for ln in lines if "igb" in ln or "VF" in ln][-60:]


def mac_bytes(mac):
    return bytes(int(x, 16) for x in mac.split(":"))


def frame(dst, src, marker, vlan=None):
    tag = struct.pack("!HH", 0x8100, vlan) if vlan is not None else b""
    body = marker.encode().ljust(46, b"\0")
    return mac_bytes(dst) + mac_bytes(src) + tag + struct.pack("!H", ETHERTYPE) + body


def raw(ifname):
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((ifname, 0))
    return sock


def received_until(sock, control):
    """Markers of our frames read on ``sock`` until ``control`` arrives (or the deadline: control missing)."""
    seen = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            data = sock.recv(2048)
        except TimeoutError:
            break
        off = 12
        if struct.unpack("!H", data[off:off + 2])[0] == 0x8100:
            off += 4
        if struct.unpack("!H", data[off:off + 2])[0] != ETHERTYPE:
            continue
        marker = data[off + 2:].rstrip(b"\0").decode(errors="replace")
        seen.append(marker)
        if marker == control:
            return seen, True
    return seen, False


def main():
    pf = igb_pfs()[0]
    dev = f"/sys/class/net/{pf}/device"
    with IPRoute() as ipr:  # the PF's link first: the VF drivers reset through it
        ipr.link("set", index=ipr.link_lookup(ifname=pf)[0], state="up")
    deadline = time.monotonic() + DEADLINE_S
    while sysfs(f"/sys/class/net/{pf}/carrier") != "1" and time.monotonic() < deadline:
        time.sleep(0.1)  # the emulated PHY's autonegotiation
    write(f"{dev}/sriov_numvfs", "2")
    vf_pci = [os.path.basename(os.path.realpath(f"{dev}/virtfn{i}")) for i in (0, 1)]
    report = {"pf": pf, "vf_pci": vf_pci, "cases": {}}
    with IPRoute() as ipr:
        pfi = ipr.link_lookup(ifname=pf)[0]

        def vf(n, **kw):
            ipr.link("set", index=pfi, vf=dict(vf=n, **kw))

        vf(0, mac=MAC0, vlan=VLAN_A, spoofchk=1, trust=0)
        vf(1, mac=MAC1, vlan=VLAN_A, spoofchk=1, trust=0)
        igbvf_netdevs(2)  # igbvf has probed both VFs
        n = 0
        rx = tx = None

        def case(name, forbidden, control, before_control=None):
            nonlocal n
            n += 1
            bad, good = f"{name}-forbidden-{n}", f"{name}-control-{n}"
            if forbidden is not None:
                tx.send(forbidden(bad))
            if before_control is not None:
                before_control()
            tx.send(control(good))
            seen, control_arrived = received_until(rx, good)
            report["cases"][name] = {"seen": seen, "control_arrived": control_arrived,
                                     "forbidden_arrived": bad in seen}

        # An igbvf reset that meets the PF resetting for the other VF's MAC set logs "PF still in reset state" and
        # can leave the switch not delivering between the two (2 of ~8 runs). Such a bring-up is done again
        # (both VFs rebound, the baseline sent again), at most three in all; each failed one's kernel lines are
        # reported, and the test requires the bring-up the cases use to have a clean log and a baseline that
        # crossed. Every later case carries its own control frame.
        report["failed_bring_ups"] = []
        for bring_up in range(1, 4):
            report["bring_ups"] = bring_up
            log_from = len(dmesg_lines())  # this bring-up's kernel lines are the ones after these
            # igb: a VF's new MAC takes effect when its driver reloads ("Reload the VF driver to make this change
            # effective"): rebind igbvf, then find the netdevs again
            for pci in vf_pci:
                write("/sys/bus/pci/drivers/igbvf/unbind", pci)
                write("/sys/bus/pci/drivers/igbvf/bind", pci)
            names = igbvf_netdevs(2)
            vf0, vf1 = names[vf_pci[0]], names[vf_pci[1]]
            report["vf_netdevs"] = {"vf0": vf0, "vf1": vf1}
            for name in (vf0, vf1):
                ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline and not all(
                    sysfs(f"/sys/class/net/{n}/carrier") == "1" for n in (pf, vf0, vf1)):
                time.sleep(0.1)  # the VFs' link follows the PF's autonegotiation
            report["carrier"] = {n: sysfs(f"/sys/class/net/{n}/carrier") for n in (pf, vf0, vf1)}
            report["vf_macs"] = {n: sysfs(f"/sys/class/net/{n}/address") for n in (vf0, vf1)}
            if rx is not None:
                rx.close()
                tx.close()
            rx, tx = raw(vf0), raw(vf1)
            # 0: the switch delivers VF1 -> VF0 at all (same VLAN, own MAC): without this the rest proves nothing
            case("baseline_same_vlan", None, lambda m: frame(MAC0, MAC1, m))
            lines = igb_lines(dmesg_lines()[log_from:])
            if report["cases"]["baseline_same_vlan"]["control_arrived"] and not any(RESET_FAILED in ln for ln in lines):
                break
            report["failed_bring_ups"].append({"baseline": report["cases"]["baseline_same_vlan"], "kernel_igb_lines": lines})

        # 1: a spoofed source MAC with spoof check on
        case("spoofed_src_mac_spoofchk_on", lambda m: frame(MAC0, SPOOFED, m), lambda m: frame(MAC0, MAC1, m))
        # 2: the same with spoof check off (the control of case 1: the check is what drops it)
        vf(1, spoofchk=0)
        case("spoofed_src_mac_spoofchk_off", lambda m: frame(MAC0, SPOOFED, m), lambda m: frame(MAC0, MAC1, m))
        vf(1, spoofchk=1)
        # 3: VF1 on another port VLAN: its frame to VF0; control sent after VF1 is moved back to VF0's VLAN
        vf(1, vlan=VLAN_B)
        case("other_port_vlan", lambda m: frame(MAC0, MAC1, m), lambda m: frame(MAC0, MAC1, m),
             before_control=lambda: vf(1, vlan=VLAN_A))
        # 4: VF1 on another port VLAN tags its frame with VF0's VLAN itself
        vf(1, vlan=VLAN_B)
        case("self_tagged_with_other_vlan", lambda m: frame(MAC0, MAC1, m, vlan=VLAN_A),
             lambda m: frame(MAC0, MAC1, m), before_control=lambda: vf(1, vlan=VLAN_A))
        (msg,) = ipr.link("get", index=pfi, ext_mask=1)
        report["vf_stats"] = {}
        for info in msg.get_attr("IFLA_VFINFO_LIST").get_attrs("IFLA_VF_INFO"):
            stats = info.get_attr("IFLA_VF_STATS")
            report["vf_stats"][info.get_attr("IFLA_VF_MAC")["vf"]] = dict(stats["attrs"]) if stats else None
    kernel_log = dmesg_lines()
    report["kernel_spoof_lines"] = [ln for ln in kernel_log if "poof" in ln]  # the whole boot's
    report["kernel_igb_lines"] = igb_lines(kernel_log[log_from:])  # since the bring-up the cases used
    print(json.dumps(report, sort_keys=True, default=str))


main()
