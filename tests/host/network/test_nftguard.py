"""The agent's nft guard tables against the real nftables of a private network namespace (the "host")."""

from __future__ import annotations

import json
from ipaddress import IPv4Address, IPv4Network

import pytest

from gpuaas_agent.contract.isolation import GuardSpec
from gpuaas_agent.host.network.nftguard import NftGuard, NftGuardInputError, ensure_document
from tests.support.dnsmasq_fixture import NetLab, run_in_netns, sh

SPEC = GuardSpec(subnet=IPv4Network("10.100.0.0/24"), gateway=IPv4Address("10.100.0.1"))
FOREIGN = ("add table inet foreign { set s { type ifname; elements = { \"gs0-1111aaaa22\" }; }; "
           "chain input { type filter hook input priority 0; policy accept; iifname @s accept; }; }")


@pytest.fixture
def host(net_lab: NetLab) -> str:
    ns = net_lab.netns("nft")
    sh("ip", "netns", "exec", ns, "nft", FOREIGN)
    return ns


def nft(ns: str, *args: str) -> str:
    return sh("ip", "netns", "exec", ns, "nft", *args).stdout


def guard(ns: str, method: str, *args):
    g = NftGuard(SPEC)
    return run_in_netns(ns, lambda: getattr(g, method)(*args))


def test_adding_ports_builds_both_tables_idempotently_and_leaves_foreign_tables_alone(host: str):
    foreign = nft(host, "-j", "list", "table", "inet", "foreign")
    assert not guard(host, "read").present
    guard(host, "add_port", "gs0-1111aaaa22")
    first = nft(host, "list", "ruleset")
    state = guard(host, "add_port", "gs0-1111aaaa22")
    assert nft(host, "list", "ruleset") == first
    state = guard(host, "add_port", "gs1-2222bbbb33")
    assert state.present and state.rules_match and state.guest_ports == ["gs0-1111aaaa22", "gs1-2222bbbb33"]
    assert state.elements == {"inet": state.guest_ports, "arp": state.guest_ports}
    assert nft(host, "-j", "list", "table", "inet", "foreign") == foreign


def test_a_tampered_rule_is_reported_and_the_next_add_restores_the_rules(host: str):
    guard(host, "add_port", "gs0-1111aaaa22")
    nft(host, "insert", "rule", "inet", "gpuaas_slice_guard", "guest_input", "tcp", "dport", "8080", "accept")
    state = guard(host, "read")
    assert not state.rules_match and state.differences == ["inet chain guest_input rules differ"]
    state = guard(host, "add_port", "gs1-2222bbbb33")
    assert state.rules_match and state.guest_ports == ["gs0-1111aaaa22", "gs1-2222bbbb33"]


def test_a_table_that_cannot_be_corrected_in_place_is_swapped_whole_keeping_its_ports(host: str):
    guard(host, "add_port", "gs0-1111aaaa22")
    # an input chain moved to another priority: "add chain" with ours fails, so the table is replaced
    nft(host, "delete", "chain", "inet", "gpuaas_slice_guard", "input")
    nft(host, "add", "chain", "inet", "gpuaas_slice_guard", "input",
        "{ type filter hook input priority 10; policy accept; }")
    assert "inet chain input is" in guard(host, "read").differences[0]
    state = guard(host, "add_port", "gs1-2222bbbb33")
    assert state.rules_match and state.guest_ports == ["gs0-1111aaaa22", "gs1-2222bbbb33"]


def test_removing_a_port_removes_only_its_elements_and_is_idempotent(host: str):
    guard(host, "add_port", "gs0-1111aaaa22")
    guard(host, "add_port", "gs1-2222bbbb33")
    assert guard(host, "remove_port", "gs0-1111aaaa22") is True
    assert guard(host, "remove_port", "gs0-1111aaaa22") is False
    state = guard(host, "read")
    assert state.rules_match and state.guest_ports == ["gs1-2222bbbb33"]
    assert json.loads(nft(host, "-j", "list", "set", "inet", "foreign", "s"))["nftables"][1]["set"]["elem"] == [
        "gs0-1111aaaa22"]


def test_replace_sets_exactly_the_given_ports(host: str):
    guard(host, "add_port", "gs0-1111aaaa22")
    state = guard(host, "replace", ["gs2-3333cccc44"])
    assert state.rules_match and state.guest_ports == ["gs2-3333cccc44"]


def test_a_name_that_is_not_an_interface_is_refused_before_nft_runs():
    with pytest.raises(NftGuardInputError):
        ensure_document(SPEC, ['x" ; flush ruleset'])


NARROW = GuardSpec(subnet=IPv4Network("10.100.0.0/24"), gateway=IPv4Address("10.100.0.1"), agent_ports=(22, 2222),
                   exporter_port=9100)


def narrow(ns: str, method: str, *args, **kwargs):
    g = NftGuard(NARROW)
    return run_in_netns(ns, lambda: getattr(g, method)(*args, **kwargs))


def test_the_exporter_opening_comes_and_goes_with_the_port_and_reads_back_as_the_spec(host: str):
    a, b = "gs0-1111aaaa22", "gs1-2222bbbb33"
    ip_a, ip_b = IPv4Address("10.100.0.10"), IPv4Address("10.100.0.11")
    state = narrow(host, "add_port", a, exporter=ip_a)
    state = narrow(host, "add_port", b)  # B's allocation did not opt in
    assert state.rules_match, state.differences
    assert state.exporters == {str(ip_a): a} and state.guest_ports == [a, b]
    assert "ip daddr @exporter_guests tcp dport 9100 accept" in nft(host, "list", "chain", "inet",
                                                                     "gpuaas_slice_guard", "host_output")
    # re-isolating A after its opt-in is gone (a lease without it) closes the opening; another IP replaces it
    assert narrow(host, "add_port", a).exporters == {}
    assert narrow(host, "add_port", a, exporter=ip_b).exporters == {str(ip_b): a}
    assert narrow(host, "add_port", a, exporter=ip_a).exporters == {str(ip_a): a}
    # unplug closes it with the port; B's membership untouched
    assert narrow(host, "remove_port", a) is True
    state = narrow(host, "read")
    assert state.exporters == {} and state.guest_ports == [b] and state.rules_match
    # repair: the table swapped whole with exactly the granted openings; a hand-made one is found and closed
    state = narrow(host, "replace", [a, b], {a: ip_a})
    assert state.rules_match and state.exporters == {str(ip_a): a}
    nft(host, "add", "element", "inet", "gpuaas_slice_guard", "exporter_guests", "{ 10.100.0.11 }")
    assert narrow(host, "read").exporters == {str(ip_a): a, str(ip_b): ""}
    assert narrow(host, "close_exporters", [str(ip_b)]).exporters == {str(ip_a): a}
    # a spec with other ports reads the table as altered (reconcile rewrites it)
    assert guard(host, "read").differences == ["inet chain host_output rules differ"]
