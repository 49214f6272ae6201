"""MAC and private-IP suggestions: deterministic, in range, never the gateway."""

import ipaddress

from gpuaas_agent.discovery.slots import PlanConfig, suggest_ips, suggest_mac


def test_ips_start_at_dot_ten_and_skip_gateway():
    assert suggest_ips(PlanConfig(), 3) == ["10.100.0.10", "10.100.0.11", "10.100.0.12"]


def test_ips_never_network_gateway_or_broadcast_and_run_out_cleanly():
    config = PlanConfig(subnet=ipaddress.IPv4Network("192.168.7.0/29"), first_host_offset=1)
    ips = suggest_ips(config, 8)
    assert ips[:5] == ["192.168.7.2", "192.168.7.3", "192.168.7.4", "192.168.7.5", "192.168.7.6"]
    assert ips[5:] == [None, None, None]


def test_custom_gateway_is_excluded():
    config = PlanConfig(gateway=ipaddress.IPv4Address("10.100.0.11"))
    assert suggest_ips(config, 2) == ["10.100.0.10", "10.100.0.12"]


def test_mac_is_locally_administered_unicast_and_deterministic():
    mac = suggest_mac("host-a", 0, set())
    first = int(mac.split(":")[0], 16)
    assert first & 0b10 and not first & 0b01
    assert mac == suggest_mac("host-a", 0, set())
    assert mac != suggest_mac("host-b", 0, set())
    assert mac != suggest_mac("host-a", 1, set())


def test_mac_collision_is_resolved_deterministically():
    mac = suggest_mac("host-a", 0, set())
    other = suggest_mac("host-a", 0, {mac})
    assert other != mac and other == suggest_mac("host-a", 0, {mac})
