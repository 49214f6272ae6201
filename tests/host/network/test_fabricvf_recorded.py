"""The InfiniBand GUID path against a real mlx5 answer: the bytes the kernel sends, in the layout its uapi defines.

igb models no GUIDs, so the agent's GUID reading and writing cannot meet a real driver in the lab. What can be
held to a real answer is the byte order: ``fixtures/fabric/mlx5-ib-vf-guids.iproute2.txt`` records iproute2 on a
Mellanox IB PF after ``ip link set ib4 vf 0 node_guid 22:44:33:00:33:11:00:33`` (provenance in the file). Here the
RTM_NEWLINK is built byte by byte as the kernel's ``rtnl_fill_vfinfo`` writes it (``struct ifla_vf_guid { __u32
vf; __u64 guid; }``, host order, little-endian on x86-64 and arm64), with that recording's values; the agent must
read the GUIDs iproute2 printed, and its own request for those GUIDs must carry the number iproute2's
``get_guid`` sends. A GUID written byte-reversed would bind the wrong port into the tenant's partition.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from gpuaas_agent.contract.fabricvf import VfLinkState, VfSettings
from gpuaas_agent.host.network.fabricvf import compare_settings, vf_requests, vfs_of_link

RECORDING = Path(__file__).resolve().parents[3] / "fixtures" / "fabric" / "mlx5-ib-vf-guids.iproute2.txt"

# include/uapi/linux/if_link.h
IFLA_IFNAME, IFLA_VFINFO_LIST, IFLA_NUM_VF = 3, 22, 30
IFLA_VF_INFO = 1
IFLA_VF_MAC, IFLA_VF_VLAN, IFLA_VF_SPOOFCHK, IFLA_VF_LINK_STATE, IFLA_VF_TRUST = 1, 2, 4, 5, 9
IFLA_VF_IB_NODE_GUID, IFLA_VF_IB_PORT_GUID, IFLA_VF_VLAN_LIST, IFLA_VF_VLAN_INFO = 10, 11, 12, 1
ETH_P_8021Q = 0x8100
LINK_STATE = {"auto": 0, "enable": 1, "disable": 2}
RTM_NEWLINK = 16


def _recorded_vf() -> dict:
    line = next(line for line in RECORDING.read_text().splitlines() if line.startswith("vf 0 "))
    address = re.search(r"link/infiniband ([0-9a-f:]{59}) ", line).group(1)
    return {"address": bytes.fromhex(address.replace(":", "")),
            "node_guid": re.search(r"NODE_GUID ([0-9a-f:]{23})", line).group(1),
            "port_guid": re.search(r"PORT_GUID ([0-9a-f:]{23})", line).group(1),
            "spoofchk": re.search(r"spoof checking (on|off)", line).group(1),
            "link_state": re.search(r"link-state (\w+)", line).group(1),
            "trust": re.search(r"trust (on|off)", line).group(1)}


def _nla(kind: int, payload: bytes) -> bytes:
    header = struct.pack("=HH", 4 + len(payload), kind)
    return header + payload + b"\0" * (-len(payload) % 4)


def _attr(data: bytes, kind: int) -> bytes:
    """The payload of the first attribute of ``kind`` in a run of netlink attributes (nested flags masked)."""
    offset = 0
    while offset + 4 <= len(data):
        length, found = struct.unpack_from("=HH", data, offset)
        if found & 0x3FFF == kind:
            return data[offset + 4:offset + length]
        offset += (length + 3) & ~3
    raise AssertionError(f"attribute {kind} not in the request")


def _guid_number(text: str) -> int:
    return int(text.replace(":", ""), 16)  # iproute2's get_guid: the first printed byte is the most significant


def _kernel_newlink(vf: int, recorded: dict) -> bytes:
    """The RTM_NEWLINK an IB PF answers with, attribute by attribute as rtnl_fill_vfinfo writes them."""
    on = {"on": 1, "off": 0}
    info = b"".join([
        _nla(IFLA_VF_MAC, struct.pack("=I32s", vf, recorded["address"])),  # an IB VF: its 20-byte IPoIB address
        _nla(IFLA_VF_VLAN, struct.pack("=III", vf, 0, 0)),
        _nla(IFLA_VF_SPOOFCHK, struct.pack("=II", vf, on[recorded["spoofchk"]])),
        _nla(IFLA_VF_LINK_STATE, struct.pack("=II", vf, LINK_STATE[recorded["link_state"]])),
        _nla(IFLA_VF_TRUST, struct.pack("=II", vf, on[recorded["trust"]])),
        _nla(IFLA_VF_IB_NODE_GUID, struct.pack("=I4xQ", vf, _guid_number(recorded["node_guid"]))),
        _nla(IFLA_VF_IB_PORT_GUID, struct.pack("=I4xQ", vf, _guid_number(recorded["port_guid"]))),
        # struct ifla_vf_vlan_info { __u32 vf; __u32 vlan; __u32 qos; __be16 vlan_proto; }: always after the GUIDs
        _nla(IFLA_VF_VLAN_LIST, _nla(IFLA_VF_VLAN_INFO, struct.pack("=III", vf, 0, 0) + struct.pack(">H2x", ETH_P_8021Q))),
    ])
    attrs = (_nla(IFLA_IFNAME, b"ib4\0") + _nla(IFLA_NUM_VF, struct.pack("=I", 1))
             + _nla(IFLA_VFINFO_LIST, _nla(IFLA_VF_INFO, info)))
    body = struct.pack("=BxHiII", 0, 32, 7, 0, 0) + attrs  # struct ifinfomsg: AF_UNSPEC, ARPHRD_INFINIBAND, ifindex 7
    return struct.pack("=IHHII", 16 + len(body), RTM_NEWLINK, 0, 1, 0) + body


def test_struct_ifla_vf_guid_is_sixteen_bytes_with_the_guid_at_offset_eight():
    assert struct.calcsize("=I4xQ") == 16
    assert struct.pack("=I4xQ", 0, 1)[8:] == struct.pack("=Q", 1)


def test_the_agent_reads_the_guids_the_recording_printed_from_the_kernels_bytes():
    recorded = _recorded_vf()
    msg = ifinfmsg(_kernel_newlink(0, recorded))
    msg.decode()
    observed = vfs_of_link(msg)[0]
    assert observed.node_guid == recorded["node_guid"] == "22:44:33:00:33:11:00:33"
    assert observed.port_guid == recorded["port_guid"] == "10:21:33:12:00:11:22:10"
    assert observed.link_state is VfLinkState.disable and observed.trust is False and observed.spoofchk is False
    # What the agent proves of an IB VF is its GUIDs and link state; the IPoIB address is the driver's, never compared.
    wanted = VfSettings(vf=0, link_state=VfLinkState.disable, node_guid=recorded["node_guid"],
                        port_guid=recorded["port_guid"])
    assert compare_settings(wanted, observed) == []
    moved = wanted.model_copy(update={"port_guid": "10:22:33:12:00:11:22:10"})
    assert [(m.field, m.found) for m in compare_settings(moved, observed)] == [("port_guid", recorded["port_guid"])]


def test_the_agents_guid_request_carries_the_number_iproute2_sends():
    recorded = _recorded_vf()
    wanted = VfSettings(vf=0, node_guid=recorded["node_guid"], port_guid=recorded["port_guid"])
    requests = [r for r in vf_requests(wanted) if "ib_node_guid" in r or "ib_port_guid" in r]
    assert len(requests) == 2
    for request in requests:
        msg = ifinfmsg()
        msg["attrs"] = [("IFLA_VFINFO_LIST", {"attrs": [("IFLA_VF_INFO", {"attrs": [
            ("IFLA_VF_IB_NODE_GUID" if "ib_node_guid" in request else "IFLA_VF_IB_PORT_GUID", dict(request))]})]})]
        msg.encode()
        kind = IFLA_VF_IB_NODE_GUID if "ib_node_guid" in request else IFLA_VF_IB_PORT_GUID
        text = recorded["node_guid"] if kind == IFLA_VF_IB_NODE_GUID else recorded["port_guid"]
        vf_info = _attr(_attr(bytes(msg.data)[32:], IFLA_VFINFO_LIST), IFLA_VF_INFO)
        payload = _attr(vf_info, kind)
        assert len(payload) >= 16, "the kernel's nla_policy needs a whole struct ifla_vf_guid"
        vf, number = struct.unpack_from("=I4xQ", payload)
        assert (vf, number) == (0, _guid_number(text)), f"{text} must travel as {_guid_number(text):#018x}"
