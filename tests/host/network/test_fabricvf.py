"""The fabric VF driver: requests, answers and their comparison (pure), and the real kernel's refusals.

The pure half is tested on netlink messages encoded and decoded by pyroute2 itself (the bytes the kernel
sends for IFLA_VFINFO_LIST, built here: no public recording of a ConnectX-7 / BlueField-3 netlink dump
was found, docs/fabric.md says so). The netlink half runs against this machine's kernel in a network
namespace the test creates: a netdev with no VFs (a bridge named like the recorded host's IB PF; this
kernel has no dummy driver) answers as a PF without SR-IOV does, and those answers must become the typed
``fabric_vf_missing`` / ``fabric_vf_unsupported``, never a pass.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from gpuaas_agent.contract.fabricvf import (
    EswitchMode,
    EthernetAttachment,
    FabricVfIdentity,
    InfinibandAttachment,
    VfLinkState,
    VfSettings,
    parked_settings,
    tenant_settings,
)
from gpuaas_agent.host.network.fabricvf import (
    FabricVfError,
    FabricVfNetlink,
    compare_settings,
    parse_eswitch_json,
    read_eswitch_mode,
    vf_counters,
    vf_requests,
    vf_stats_of_link,
    vfs_of_link,
)
from tests.support.realdev import require_root

IDENTITY = FabricVfIdentity(mac="02:11:22:33:44:55", node_guid="02:00:00:00:00:00:00:01",
                            port_guid="02:00:00:00:00:00:00:02")


def _newlink(*vfs: list[tuple[str, dict]], num_vf: int | None = None) -> ifinfmsg:
    """An RTM_NEWLINK of a PF with these IFLA_VF_INFO entries, through pyroute2's encoder and decoder."""
    msg = ifinfmsg()
    msg["family"] = 0
    attrs: list = [("IFLA_IFNAME", "enp232s0f0np0"), ("IFLA_NUM_VF", num_vf if num_vf is not None else len(vfs))]
    if vfs:
        attrs.append(("IFLA_VFINFO_LIST", {"attrs": [("IFLA_VF_INFO", {"attrs": vf}) for vf in vfs]}))
    msg["attrs"] = attrs
    msg.encode()
    decoded = ifinfmsg(msg.data)
    decoded.decode()
    return decoded


def _vf(n: int, *, mac="02:11:22:33:44:55", vlan=100, qos=3, rate=25000, spoofchk=1, trust=0, link_state=0,
        node_guid: str | None = None) -> list[tuple[str, dict]]:
    vf = [("IFLA_VF_MAC", {"vf": n, "mac": mac}), ("IFLA_VF_VLAN", {"vf": n, "vlan": vlan, "qos": qos}),
          ("IFLA_VF_RATE", {"vf": n, "min_tx_rate": 0, "max_tx_rate": rate}),
          ("IFLA_VF_SPOOFCHK", {"vf": n, "spoofchk": spoofchk}), ("IFLA_VF_LINK_STATE", {"vf": n, "link_state": link_state}),
          ("IFLA_VF_TRUST", {"vf": n, "trust": trust})]
    if node_guid is not None:
        vf += [("IFLA_VF_IB_NODE_GUID", {"vf": n, "ib_node_guid": node_guid}),
               ("IFLA_VF_IB_PORT_GUID", {"vf": n, "ib_port_guid": node_guid})]
    return vf


def test_the_answer_of_a_pf_is_read_per_vf():
    vfs = vfs_of_link(_newlink(_vf(0), _vf(1, mac="00:00:00:00:00:00", vlan=4094, qos=0, rate=0, link_state=2)))
    assert vfs[0] == VfSettings(vf=0, mac="02:11:22:33:44:55", vlan=100, qos=3, spoofchk=True, trust=False,
                                link_state=VfLinkState.auto, max_tx_rate_mbps=25000)
    assert vfs[1].link_state is VfLinkState.disable and vfs[1].vlan == 4094


def test_a_pf_without_vfs_reports_none():
    assert vfs_of_link(_newlink(num_vf=0)) == {}


def test_what_a_driver_does_not_keep_is_not_reported_and_not_proven():
    # u32 -1: the kernel's "this driver does not report it" for spoof check and trust.
    observed = vfs_of_link(_newlink(_vf(0, spoofchk=0xFFFFFFFF, trust=0xFFFFFFFF)))[0]
    assert observed.spoofchk is None and observed.trust is None
    wanted = tenant_settings(0, IDENTITY, EthernetAttachment(vlan=100, qos=3, max_rate_mbps=25000))
    found = {m.field: m.found for m in compare_settings(wanted, observed)}
    assert found == {"spoofchk": "not reported", "trust": "not reported"}


def test_guids_read_back_for_infiniband():
    observed = vfs_of_link(_newlink(_vf(0, node_guid="02:00:00:00:00:00:00:01")))[0]
    assert observed.node_guid == observed.port_guid == "02:00:00:00:00:00:00:01"
    wanted = tenant_settings(0, IDENTITY, InfinibandAttachment(pkey="0x0012"))
    assert [(m.field, m.found) for m in compare_settings(wanted, observed)] == [("port_guid", "02:00:00:00:00:00:00:01")]


@pytest.mark.parametrize("drift, field", [
    ({"vlan": 200}, "vlan"), ({"mac": "02:11:22:33:44:56"}, "mac"), ({"spoofchk": 0}, "spoofchk"),
    ({"trust": 1}, "trust"), ({"link_state": 1}, "link_state"), ({"qos": 0}, "qos"), ({"rate": 0}, "max_tx_rate_mbps")])
def test_every_value_that_differs_is_a_mismatch(drift, field):
    wanted = tenant_settings(0, IDENTITY, EthernetAttachment(vlan=100, qos=3, max_rate_mbps=25000))
    assert compare_settings(wanted, vfs_of_link(_newlink(_vf(0)))[0]) == []
    mismatches = compare_settings(wanted, vfs_of_link(_newlink(_vf(0, **drift)))[0])
    assert [m.field for m in mismatches] == [field]


def test_requests_name_exactly_the_wanted_values_one_each_closing_settings_first():
    eth = vf_requests(tenant_settings(3, IDENTITY, EthernetAttachment(vlan=100, qos=3, max_rate_mbps=25000)))
    # Trust off and spoof check on before the tenant's identity; the link opened last.
    assert eth == [{"vf": 3, "trust": 0}, {"vf": 3, "spoofchk": 1}, {"vf": 3, "mac": IDENTITY.mac},
                   {"vf": 3, "vlan": {"vlan": 100, "qos": 3}}, {"vf": 3, "rate": {"min_tx_rate": 0, "max_tx_rate": 25000}},
                   {"vf": 3, "link_state": 0}]
    ib = vf_requests(parked_settings(3, "infiniband", "02:aa:00:00:00:00:00:01"))
    # A park closes the link first, before anything else is asked of the PF.
    assert ib == [{"vf": 3, "link_state": 2}, {"vf": 3, "ib_node_guid": "02:aa:00:00:00:00:00:01"},
                  {"vf": 3, "ib_port_guid": "02:aa:00:00:00:00:00:01"}]


@pytest.mark.parametrize("text, mode", [
    ('{"dev":{"pci/0000:e8:00.0":{"mode":"legacy","inline-mode":"none","encap-mode":"basic"}}}', EswitchMode.legacy),
    ('{"dev":{"pci/0000:e8:00.0":{"mode":"switchdev","inline-mode":"none","encap-mode":"basic"}}}', EswitchMode.switchdev),
    ('{"dev":{"pci/0000:e8:00.1":{"mode":"legacy"}}}', EswitchMode.unknown),  # another PF's answer
    ('{"dev":{"pci/0000:e8:00.0":{"mode":"offload"}}}', EswitchMode.unknown),
    # A mode newer kernels add (Documentation/networking/devlink/devlink-eswitch-attr.rst): not legacy, not proven.
    ('{"dev":{"pci/0000:e8:00.0":{"mode":"switchdev_inactive"}}}', EswitchMode.unknown),
    ("kernel answers: Operation not supported", EswitchMode.unknown), ("", EswitchMode.unknown)])
def test_eswitch_mode_is_read_never_assumed(text, mode):
    assert parse_eswitch_json(text, "0000:e8:00.0") is mode


def test_a_pf_this_machine_lacks_has_an_unknown_eswitch():
    mode, how = read_eswitch_mode("0000:e8:00.0")
    assert mode is EswitchMode.unknown and "devlink" in how


MLX5_STATS = {"IFLA_VF_STATS_RX_PACKETS": 1200, "IFLA_VF_STATS_TX_PACKETS": 900, "IFLA_VF_STATS_RX_BYTES": 1_500_000,
              "IFLA_VF_STATS_TX_BYTES": 700_000, "IFLA_VF_STATS_BROADCAST": 3, "IFLA_VF_STATS_MULTICAST": 4,
              "IFLA_VF_STATS_RX_DROPPED": 5, "IFLA_VF_STATS_TX_DROPPED": 6}


def _with_stats(vf: list[tuple[str, dict]], stats: dict[str, int]) -> list[tuple[str, dict]]:
    return [*vf, ("IFLA_VF_STATS", {"attrs": list(stats.items())})]


def test_vf_counters_are_read_from_the_pfs_answer_per_vf_and_a_missing_counter_stays_unknown():
    """IFLA_VF_STATS as a PF's driver fills it (mlx5: ndo_get_vf_stats); a kernel before 5.8 sends no drop counters."""
    older = {k: v for k, v in MLX5_STATS.items() if "DROPPED" not in k}
    stats = vf_stats_of_link(_newlink(_with_stats(_vf(0), MLX5_STATS), _with_stats(_vf(1), older), _vf(2)))
    assert stats[0] == {"rx_packets": 1200, "tx_packets": 900, "rx_bytes": 1_500_000, "tx_bytes": 700_000,
                        "rx_drops": 5, "tx_drops": 6}
    assert (stats[1]["rx_bytes"], stats[1]["rx_drops"], stats[1]["tx_drops"]) == (1_500_000, None, None)
    assert 2 not in stats  # no IFLA_VF_STATS nest: not listed, so unknown
    counters = vf_counters("0000:19:00.1", "ibp25s0", 0, stats, "mlx5_core")
    assert counters is not None and (counters.rx_bytes, counters.tx_packets, counters.rx_drops) == (1_500_000, 900, 5)
    assert vf_counters("0000:19:00.2", "ibp25s0", 2, stats, "mlx5_core") is None
    assert vf_stats_of_link(_newlink()) == {}


def test_an_igb_pfs_zeroes_are_never_taken_for_counts():
    """The kernel sends an IFLA_VF_STATS nest for every VF, zeroed before it asks the driver: igb implements no
    ndo_get_vf_stats, so its VFs read all zeroes however much they carried. Only a PF driver that fills them
    counts; any other reads unknown (None), never 0."""
    zeroes = {k: 0 for k in MLX5_STATS}
    stats = vf_stats_of_link(_newlink(_with_stats(_vf(0), zeroes)))
    assert stats[0]["rx_bytes"] == 0
    assert vf_counters("0000:03:10.0", "enp3s0", 0, stats, "igb") is None
    assert vf_counters("0000:03:10.0", "enp3s0", 0, stats, None) is None


# -- the real kernel ------------------------------------------------------------------------------------


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, timeout=30, capture_output=True)


@pytest.fixture(scope="module")
def pf_netns():
    """A namespace with a netdev named like the recorded host's IB PF, that has no VFs."""
    require_root()
    name = f"gpuaas-fvf-{uuid.uuid4().hex[:8]}"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "add", "ibp25s0", "type", "bridge")
        yield name
    finally:
        _ip("netns", "del", name)


def test_a_pf_without_sr_iov_is_refused_as_missing_vf(pf_netns):
    with pytest.raises(FabricVfError) as info:
        FabricVfNetlink(netns=pf_netns).read("ibp25s0", 0)
    assert info.value.code == "fabric_vf_missing" and info.value.evidence["num_vf"] == 0


def test_the_kernels_eopnotsupp_is_the_typed_unsupported(pf_netns):
    wanted = tenant_settings(0, IDENTITY, EthernetAttachment(vlan=100))
    with pytest.raises(FabricVfError) as info:
        FabricVfNetlink(netns=pf_netns).apply("ibp25s0", wanted)
    assert info.value.code == "fabric_vf_unsupported"
    assert info.value.evidence["errno"] in ("EOPNOTSUPP", "ENOTSUP")


def test_parking_on_a_pf_without_vfs_fails_loudly(pf_netns):
    with pytest.raises(FabricVfError) as info:
        FabricVfNetlink(netns=pf_netns).apply("ibp25s0", parked_settings(0, "ethernet", "02:aa:00:00:00:00:00:01"))
    assert info.value.code == "fabric_vf_unsupported"


def test_a_missing_pf_netdev_is_named(pf_netns):
    with pytest.raises(FabricVfError) as info:
        FabricVfNetlink(netns=pf_netns).read("ibp59s0", 0)
    assert info.value.code == "fabric_vf_missing" and info.value.evidence["pf_netdev"] == "ibp59s0"


def test_a_missing_namespace_is_a_typed_failure_and_is_not_created():
    name = f"gpuaas-fvf-absent-{uuid.uuid4().hex[:6]}"
    with pytest.raises(FabricVfError) as info:
        FabricVfNetlink(netns=name).read("ibp25s0", 0)
    assert info.value.code == "fabric_vf_failed"
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.find(name) < 0


def test_the_real_kernel_lists_no_vf_counters_for_a_pf_without_vfs(pf_netns):
    """The stats read on this machine's kernel: the same RTM_GETLINK the counters take, answered for a netdev
    without SR-IOV: nothing listed, so every VF of it reads unknown; a missing PF is the typed refusal."""
    assert FabricVfNetlink(netns=pf_netns).stats("ibp25s0") == {}
    with pytest.raises(FabricVfError) as info:
        FabricVfNetlink(netns=pf_netns).stats("ibp59s0")
    assert info.value.code == "fabric_vf_missing"
