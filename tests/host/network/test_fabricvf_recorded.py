"""The InfiniBand GUID path against a real mlx5 answer: the bytes the kernel sends, in the layout its uapi defines.

igb models no GUIDs, so the agent's GUID reading and writing cannot meet a real driver in the lab. What can be
held to a real answer is the byte order: ``fixtures/fabric/mlx5-ib-vf-guids.iproute2.txt`` records iproute2 on a
Mellanox IB PF after ``ip link set ib4 vf 0 node_guid 22:44:33:00:33:11:00:33`` (provenance in the file). Here the
RTM_NEWLINK is built byte by byte as the kernel's ``rtnl_fill_vfinfo`` writes it (``struct ifla_vf_guid { __u32
vf; __u64 guid; }``, host order, little-endian on x86-64 and arm64), with that recording's values; the agent must
read the GUIDs iproute2 printed, and its own request for those GUIDs must carry the number iproute2's
``get_guid`` sends. A GUID written byte-reversed would bind the wrong port into the tenant's partition.

The Ethernet side (``fixtures/fabric/mlx5-eth-vfs.iproute2.txt``, a ConnectX-5 PF from OpenStack neutron's guide):
the VF a tenant holds (MAC, VLAN, spoof check on, trust off) and idle ones, with link state ``auto`` and
``enable``; with the IB recording's ``disable`` every IFLA_VF_LINK_STATE value is read from a recorded answer.
igb cannot set a VF's link state at all (EOPNOTSUPP, docs/fabric-igb.md), so these are the link-state paths'
only real answers.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from gpuaas_agent.contract.fabricvf import (
    EswitchMode,
    FabricIsolation,
    InfinibandAttachment,
    VfLinkState,
    VfSettings,
    parked_settings,
)
from gpuaas_agent.contract.parity import ParityStatus
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.host.network.fabricvf import (
    FabricVfNetlink,
    compare_settings,
    parse_eswitch_json,
    read_eswitch_mode,
    vf_requests,
    vfs_of_link,
)
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.tasks.fabricvf import FabricIsolationRefused, check_fabric_vfs, fabric_isolation_check
from tests.support.provision_inputs import approved_slot, topology_of

RECORDING = Path(__file__).resolve().parents[3] / "fixtures" / "fabric" / "mlx5-ib-vf-guids.iproute2.txt"
ETH_RECORDING = Path(__file__).resolve().parents[3] / "fixtures" / "fabric" / "mlx5-eth-vfs.iproute2.txt"

# include/uapi/linux/if_link.h
IFLA_IFNAME, IFLA_VFINFO_LIST, IFLA_NUM_VF = 3, 22, 30
IFLA_VF_INFO = 1
IFLA_VF_MAC, IFLA_VF_VLAN, IFLA_VF_SPOOFCHK, IFLA_VF_LINK_STATE, IFLA_VF_RATE, IFLA_VF_TRUST = 1, 2, 4, 5, 6, 9
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


def _recorded_eth_pfs() -> dict[str, list[dict]]:
    """PF address -> its VF lines as iproute2 printed them (``vf N MAC m[, vlan V], spoof checking x, link-state
    s[, trust t]``), from the Ethernet recording."""
    pfs: dict[str, list[dict]] = {}
    current: list[dict] = []
    for line in ETH_RECORDING.read_text().splitlines():
        if line.startswith("link/ether "):
            current = pfs.setdefault(line.split()[1], [])
        elif line.startswith("vf "):
            vlan = re.search(r", vlan (\d+)", line)
            trust = re.search(r"trust (on|off)", line)
            current.append({"vf": int(line.split()[1]), "mac": re.search(r"MAC ([0-9a-f:]{17})", line).group(1),
                            "vlan": int(vlan.group(1)) if vlan else 0,
                            "spoofchk": re.search(r"spoof checking (on|off)", line).group(1),
                            "link_state": re.search(r"link-state (\w+)", line).group(1),
                            "trust": trust.group(1) if trust else None})
    return pfs


def _kernel_eth_newlink(vfs: list[dict]) -> bytes:
    """The RTM_NEWLINK an Ethernet PF answers with for ``vfs``, each IFLA_VF_INFO in rtnl_fill_vfinfo's order.

    iproute2 prints no rate when it is 0 and no trust when the kernel reports none: both are sent as the kernel
    does for such a VF (IFLA_VF_RATE always, zeroes; IFLA_VF_TRUST as u32 -1, "not supported").
    """
    on = {"on": 1, "off": 0, None: 0xFFFFFFFF}
    infos = b""
    for vf in vfs:
        n = vf["vf"]
        info = b"".join([
            _nla(IFLA_VF_MAC, struct.pack("=I32s", n, bytes.fromhex(vf["mac"].replace(":", "")))),
            _nla(IFLA_VF_VLAN, struct.pack("=III", n, vf["vlan"], 0)),
            _nla(IFLA_VF_RATE, struct.pack("=III", n, 0, 0)),
            _nla(IFLA_VF_SPOOFCHK, struct.pack("=II", n, on[vf["spoofchk"]])),
            _nla(IFLA_VF_LINK_STATE, struct.pack("=II", n, LINK_STATE[vf["link_state"]])),
            _nla(IFLA_VF_TRUST, struct.pack("=II", n, on[vf["trust"]])),
            _nla(IFLA_VF_VLAN_LIST, _nla(IFLA_VF_VLAN_INFO, struct.pack("=III", n, vf["vlan"], 0)
                                         + struct.pack(">H2x", ETH_P_8021Q))),
        ])
        infos += _nla(IFLA_VF_INFO, info)
    attrs = (_nla(IFLA_IFNAME, b"enp3s0f0\0") + _nla(IFLA_NUM_VF, struct.pack("=I", len(vfs)))
             + _nla(IFLA_VFINFO_LIST, infos))
    body = struct.pack("=BxHiII", 0, 1, 6, 0, 0) + attrs  # struct ifinfomsg: AF_UNSPEC, ARPHRD_ETHER, ifindex 6
    return struct.pack("=IHHII", 16 + len(body), RTM_NEWLINK, 0, 1, 0) + body


def _observed(vfs: list[dict]) -> dict:
    msg = ifinfmsg(_kernel_eth_newlink(vfs))
    msg.decode()
    return vfs_of_link(msg)


HELD_PF, FRESH_PF = "ec:0d:9a:46:9e:84", "a0:36:9f:8f:3f:b8"


def test_the_agent_reads_an_mlx5_tenant_vf_as_recorded_mac_vlan_spoofchk_trust_link_state():
    observed = _observed(_recorded_eth_pfs()[HELD_PF])
    assert sorted(observed) == [0, 1, 2, 3]
    held = observed[3]
    assert (held.mac, held.vlan, held.qos, held.spoofchk, held.trust, held.link_state, held.max_tx_rate_mbps) == (
        "fa:16:3e:b9:b8:ce", 57, 0, True, False, VfLinkState.enable, 0)
    for idle in (observed[0], observed[1], observed[2]):
        assert (idle.mac, idle.vlan, idle.spoofchk, idle.trust, idle.link_state) == (
            "00:00:00:00:00:00", 0, False, False, VfLinkState.enable)


def test_a_recorded_vf_forced_to_link_enable_is_named_drift_from_the_tenants_auto():
    """What neutron left on the held VF is everything the agent wants but the link state: named, nothing else."""
    held = _observed(_recorded_eth_pfs()[HELD_PF])[3]
    wanted = VfSettings(vf=3, mac="fa:16:3e:b9:b8:ce", vlan=57, qos=0, spoofchk=True, trust=False,
                        link_state=VfLinkState.auto, max_tx_rate_mbps=0)
    assert [(m.field, m.wanted, m.found) for m in compare_settings(wanted, held)] == [("link_state", "auto", "enable")]
    assert compare_settings(wanted.model_copy(update={"link_state": VfLinkState.enable}), held) == []


def test_recorded_link_states_auto_and_disable_read_back_and_only_disable_counts_as_parked():
    fresh = _observed(_recorded_eth_pfs()[FRESH_PF])
    assert {vf.link_state for vf in fresh.values()} == {VfLinkState.auto}
    assert {vf.trust for vf in fresh.values()} == {None}, "an old iproute2/driver printed no trust: not reported"
    msg = ifinfmsg(_kernel_newlink(0, _recorded_vf()))
    msg.decode()
    ib_parked = vfs_of_link(msg)[0]
    assert ib_parked.link_state is VfLinkState.disable
    park = VfSettings(vf=0, link_state=VfLinkState.disable)
    assert compare_settings(park, ib_parked) == []
    assert [(m.field, m.found) for m in compare_settings(park, fresh[0])] == [("link_state", "auto")]


def test_an_idle_recorded_mlx5_vf_is_not_parked_and_the_agent_names_each_value():
    """A VF as the driver leaves it after sriov_numvfs (no VLAN, spoof check off, link enable) is not a parked
    VF: the agent must name the VLAN, spoof check and link state before it hands the slot over."""
    idle = _observed(_recorded_eth_pfs()[HELD_PF])[0]
    named = {m.field: m.found for m in compare_settings(parked_settings(0, "ethernet", "00:00:00:00:00:00:00:00"), idle)}
    assert named == {"vlan": "0", "spoofchk": "false", "link_state": "enable"}


# -- a BlueField-3 in DPU mode: the eswitch the host cannot read (fixtures/fabric/bf3-dpu-eswitch.devlink.txt) -----

BF3_RECORDING = Path(__file__).resolve().parents[3] / "fixtures" / "fabric" / "bf3-dpu-eswitch.devlink.txt"
GPU_PROFILE = get_profile("h200_1g_24c_64g")  # passes the GPU and its fabric VF through
IB = InfinibandAttachment(pkey="0x0012")


@dataclass(frozen=True)
class RecordedEswitchPf(FabricVfNetlink):
    """A PF that reports the slot's VF (this machine's kernel has none) and whose eswitch answers as ``eswitch``."""

    def read(self, pf_netdev: str, vf: int) -> VfSettings:
        return VfSettings(vf=vf, link_state=VfLinkState.auto)


def _bf3_answers() -> dict[str, dict[str, str]]:
    """side (``host``/``dpu``) -> the recorded devlink argv, the stream it answered on and the text."""
    out = {}
    for line in BF3_RECORDING.read_text().splitlines():
        if line and not line.startswith("#"):
            side, argv, stream, text = line.split("\t")
            out[side] = {"argv": argv, "stream": stream, "text": text,
                         "pf": argv.rsplit(" ", 1)[1].removeprefix("pci/")}
    return out


def _devlink_replaying(bin_dir: Path, answer: dict[str, str], stdout: str = "") -> None:
    """A ``devlink`` in ``bin_dir`` that gives the recorded answer for the recorded device only (with the agent's
    ``-j``: a kernel refusal is the same error either way); any other call fails loudly (exit 99)."""
    argv = answer["argv"].replace("devlink dev", "devlink -j dev").split(" ", 1)[1]
    err, code = (answer["text"], 1) if answer["stream"] == "stderr" else ("", 0)
    script = bin_dir / "devlink"
    script.write_text("#!/bin/sh\n"
                      f"[ \"$*\" = '{argv}' ] || {{ echo \"unrecorded devlink call: $*\" >&2; exit 99; }}\n"
                      + (f"printf '%s\\n' '{stdout}'\n" if stdout else "")
                      + (f"printf '%s\\n' '{err}' >&2\n" if err else "") + f"exit {code}\n")
    script.chmod(0o755)


def _devlink_json(text: str) -> str:
    """The recorded text line as ``devlink -j`` prints the same answer: iproute2's devlink prints each eswitch
    attribute with one ``print_string(PRINT_ANY, name, " name %s", value)``, so the text's ``name value`` pairs
    are the JSON's keys and values under ``{"dev": {"pci/<pf>": ...}}``."""
    handle, rest = text.split(": ", 1)
    words = rest.split()
    return json.dumps({"dev": {handle: dict(zip(words[::2], words[1::2]))}}, separators=(",", ":"))


def test_the_bf3_hosts_eswitch_answer_reads_unknown_never_legacy(tmp_path, monkeypatch):
    """On the x86 host of a BlueField-3 in DPU mode devlink's eswitch show is refused (EOPNOTSUPP: the DPU's Arm owns
    the eswitch). The agent's own reader, run against that recorded answer, reads ``unknown`` and keeps the
    kernel's words as its evidence."""
    host = _bf3_answers()["host"]
    _devlink_replaying(tmp_path, host)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    mode, how = read_eswitch_mode(host["pf"])
    assert mode is EswitchMode.unknown
    assert "Operation not supported" in how and host["pf"] in how


def test_the_bf3_hosts_answer_fails_required_isolation_and_dpu_enforced_names_it(tmp_path, monkeypatch):
    """Item 6 on the recorded answer: under ``required`` the host cannot prove VF policy, so parity FAILs and a
    passthrough provision is refused before anything is touched; ``dpu_enforced`` is a WARN that names the mode the
    host read (unknown) and what it cannot prove. The recorded host's PF stands for the slot PF of a recorded
    H200 host (the report's), which is all these checks read of it."""
    host = _bf3_answers()["host"]
    _devlink_replaying(tmp_path, host)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    report = topology_of()

    def answered_as_the_bf3_host(pf: str) -> tuple[EswitchMode, str]:
        return read_eswitch_mode(host["pf"])

    required = fabric_isolation_check(HostRoot.open(Path("/")), FabricIsolation.required, report,
                                      answered_as_the_bf3_host)
    assert (required.status, required.hard) == (ParityStatus.FAIL, True)
    assert "eswitch unknown" in required.detail and "Operation not supported" in required.evidence
    dpu = fabric_isolation_check(HostRoot.open(Path("/")), FabricIsolation.dpu_enforced, report,
                                 answered_as_the_bf3_host)
    assert dpu.status is ParityStatus.WARN and "cannot prove" in dpu.detail and "=unknown" in dpu.detail
    pf = RecordedEswitchPf(eswitch=answered_as_the_bf3_host)
    with pytest.raises(FabricIsolationRefused) as info:
        check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, IB, report, [approved_slot(report, 0)], pf)
    assert info.value.code == "fabric_pf_cannot_apply"
    assert (info.value.evidence["eswitch_mode"], info.value.evidence["missing"]) == ("unknown", "legacy_eswitch")


def test_the_dpus_own_answer_reads_switchdev(tmp_path, monkeypatch):
    """On the DPU's Arm side the same PF's eswitch is ``switchdev``: as ``devlink -j`` prints it, the agent's parser
    and reader name it switchdev, which ``required`` refuses and ``dpu_enforced`` reports."""
    dpu = _bf3_answers()["dpu"]
    as_json = _devlink_json(dpu["text"])
    assert parse_eswitch_json(as_json, dpu["pf"]) is EswitchMode.switchdev
    _devlink_replaying(tmp_path, dpu, stdout=as_json)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert read_eswitch_mode(dpu["pf"])[0] is EswitchMode.switchdev
