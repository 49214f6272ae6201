"""The slice's network on the host: the OVS port and its pinning flows, the nft guard, DHCP, readiness probes.

A guest's traffic passes three layers the agent owns: its OVS port (``ovs.py`` over the IDL adapter
``ovsdb_idl.py``) with the OpenFlow rules that pin it to its reserved MAC/IP (``portflows.py``), the
nftables table that filters what it may send the host itself (``nftguard.py``), and its DHCP
reservation (``dnsmasq.py``). The readiness probes read the guest through that network: its lease
and SSH banner (``readiness.py``), its egress through the NAT from conntrack (``egress_readiness.py``).
"""
