"""DHCP through a real OVS userspace (``datapath_type=netdev``) bridge: the guest still gets exactly its reserved IP.

Topology: namespace A (dnsmasq, 10.100.0.1/24) -- veth -- [OVS netdev bridge in the
switch's own namespace] -- veth -- namespace B (the guest's MAC). The bridge ports are the
veth ends inside the switch namespace; ovs-vswitchd moves every frame in userspace.

Found here (OVS 3.1, Debian 12 kernel): with the veth's default TX checksum offload, dnsmasq's
DHCPOFFERs do cross the bridge (OVS learns the server's MAC, dnsmasq logs DISCOVER/OFFER three
times) but udhcpc discards them: vswitchd re-sends each frame through a raw socket, which loses
the kernel's "checksum not yet computed" mark, so the UDP checksum arrives wrong. With TX
checksum offload off on dnsmasq's interface the exchange completes and the reserved IP is leased.
"""

from __future__ import annotations

import subprocess

from gpuaas_agent.contract.dhcp import LeaseState
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations, lease_status, make_reservation
from tests.support.dnsmasq_fixture import (
    GATEWAY,
    SUBNET,
    DhcpLab,
    Dnsmasq,
    NetLab,
    disable_tx_checksum,
    net_dnsmasq_start,
)
from tests.support.ovsdb_fixture import OvsSwitch

A1 = "1111aaaa-2222-4333-8444-555555555555"
A2 = "2222bbbb-3333-4444-8555-666666666666"


def _lab_through_ovs(net: NetLab, sw: OvsSwitch) -> DhcpLab:
    server, client = net.netns("a"), net.netns("b")
    assert sw.netns is not None
    for port, inner, ns in (("pdns", "hostside", server), ("pguest", "guestside", client)):
        net.veth(port, sw.netns, inner, ns)
        sw.ip("link", "set", port, "up")
        sw.vsctl("add-port", sw.bridge, port)
    net.up(server, "hostside", address=f"{GATEWAY}/{SUBNET.prefixlen}")
    net.up(client, "guestside")
    disable_tx_checksum(server, "hostside")  # see the module docstring
    dnsmasq = Dnsmasq(netns=server, iface="hostside", workdir=net.tmp / "dnsmasq")
    net_dnsmasq_start(net, dnsmasq)
    return DhcpLab(net=net, server=server, client=client, server_if="hostside", client_if="guestside",
                   dnsmasq=dnsmasq)


def test_reserved_mac_gets_exactly_its_ip_through_the_ovs_netdev_bridge(net_lab: NetLab, ovs_switch: OvsSwitch):
    lab = _lab_through_ovs(net_lab, ovs_switch)
    dns = lab.dnsmasq
    d = DnsmasqReservations(dns.hosts_file, dns.subnet, dns.gateway, dns.pid_file)
    mine = make_reservation(A1, 0, "52:54:00:12:34:56", "10.100.0.10", "slice-a")
    d.add(make_reservation(A2, 1, "52:54:00:12:34:57", "10.100.0.11", "slice-b"))
    d.add(mine)
    before = dns.reads()
    d.reload()
    dns.wait_reread(before)

    lab.set_client_mac(mine.mac)
    assert lab.lease() == "10.100.0.10", dns.log()[-3000:] + ovs_switch.log_tail()
    assert lease_status(dns.lease_file, mine.mac, mine.ip).lease_state == LeaseState.bound
    # the frames really crossed the bridge: OVS learned both MACs on their ports
    fdb = _fdb(ovs_switch)
    assert mine.mac in fdb, fdb

    lab.set_client_mac("52:54:00:12:34:99")  # nobody reserved it: nothing, through the bridge too
    assert lab.lease(tries=2) is None


def _fdb(sw: OvsSwitch) -> str:
    out = subprocess.run(["ovs-appctl", "-t", str(sw.rundir / "ovs-vswitchd.ctl"), "fdb/show", sw.bridge],
                         env=sw.env, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    return out.stdout
