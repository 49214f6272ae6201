"""The lab refuses to start on a subnet this machine already routes (a killed run's bridge), and says which device."""

from __future__ import annotations

import json
import subprocess
from ipaddress import IPv4Network

from lab.subnet import subnet_routed_elsewhere

LAB = IPv4Network("10.231.0.0/24")


def test_a_stale_bridge_holding_the_gateway_is_named():
    routes = [{"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
              {"dst": "192.0.2.0/24", "dev": "eth0", "protocol": "kernel", "scope": "link"},
              {"dst": "10.231.0.0/24", "dev": "gpuaas-br-1a2b", "protocol": "kernel", "scope": "link"}]
    assert subnet_routed_elsewhere(routes, LAB) == ["10.231.0.0/24 dev gpuaas-br-1a2b"]


def test_a_wider_or_narrower_route_over_the_subnet_counts_and_unrelated_ones_do_not():
    routes = [{"dst": "10.0.0.0/8", "dev": "wg0"}, {"dst": "10.231.0.7", "dev": "tap9"},
              {"dst": "10.232.0.0/24", "dev": "br1"}, {"dst": "fd00::/64", "dev": "eth0"}, {"dst": "default", "dev": "x"}]
    assert subnet_routed_elsewhere(routes, LAB) == ["10.0.0.0/8 dev wg0", "10.231.0.7 dev tap9"]


def test_this_machines_real_route_table_parses():
    """``ip -j route show`` on this kernel: every entry is read; the lab's subnet must be free before a lab starts."""
    out = subprocess.run(["ip", "-j", "route", "show", "table", "main"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    routes = json.loads(out or "[]")
    assert isinstance(routes, list)
    free = IPv4Network("198.51.100.0/24")  # TEST-NET-2: routed nowhere on a test machine
    assert subnet_routed_elsewhere(routes, free) == []
