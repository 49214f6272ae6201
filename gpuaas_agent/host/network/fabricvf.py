"""A slot's fabric VF on its PF, through netlink: apply the allocation's settings, read them back, park it.

The VF itself is bound to vfio-pci and passed through; what isolates it from the other tenants' VFs
lives on the PF (the NIC's embedded switch in legacy mode): the administrative MAC, the port VLAN (+
QoS), spoof check, trust, the VF's link state, its transmit cap, and for InfiniBand the node and port
GUID the subnet manager binds into the tenant's partition (docs/fabric.md). Every value is set with
one RTM_SETLINK on the PF (pyroute2; no ``ip`` text parsing) and read back from the PF's
IFLA_VFINFO_LIST: a value the kernel does not hold is ``fabric_vf_mismatch``, and the domain does
not start.

The pure half (:func:`settings_from_vfinfo`, :func:`compare_settings`, :func:`vf_requests`,
:func:`parse_eswitch_json`) works on decoded answers and is tested on recorded ones; the netlink half
(:class:`FabricVfNetlink`) only sends and receives.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpuaas_agent.contract.fabricvf import EswitchMode, VfLinkState, VfMismatch, VfSettings
from gpuaas_agent.contract.telemetry import FabricVfCounters
from gpuaas_agent.contract.types import GUID_RE, MAC_RE
from gpuaas_agent.errors import HostError
from gpuaas_agent.host.run import run_sync

# IFLA_VF_LINK_STATE_* of linux/if_link.h.
LINK_STATES = {0: VfLinkState.auto, 1: VfLinkState.enable, 2: VfLinkState.disable}
LINK_STATE_VALUES = {state: value for value, state in LINK_STATES.items()}
RTEXT_FILTER_VF = 1  # IFLA_EXT_MASK bit that makes the kernel include IFLA_VFINFO_LIST
DEVLINK_TIMEOUT_S = 10.0
# The GUID the kernel reports for a VF that has none: all zeroes (the default of mlx5's VFs).
NO_GUID = "00:00:00:00:00:00:00:00"


class FabricVfError(HostError):
    default_code = "fabric_vf_failed"


# -- pure: requests, answers, comparison ---------------------------------------------------------------


def vf_requests(wanted: VfSettings) -> list[dict[str, Any]]:
    """The ``vf=`` arguments of pyroute2's ``link("set")`` for ``wanted``, one setting each, closing ones first.

    The kernel applies a request's VF attributes in its own fixed order (MAC, VLAN, rate, spoof check, link
    state, trust, GUIDs) and stops at the first it refuses: on a PF without VF link state (igb, seen on a real
    kernel: ``docs/fabric-igb.md``) one request left the new tenant's MAC and VLAN on a VF whose trust was
    still on from the previous holder. So each setting is its own request, in the order that fails safe:
    trust off and spoof check on first, then the identity (MAC, VLAN, rate, GUIDs), and the link state last
    when it opens the link (``auto``/``enable``) or first when it closes it (``disable``, the park).
    """
    vf = wanted.vf
    closing: list[dict[str, Any]] = []
    identity: list[dict[str, Any]] = []
    if wanted.trust is not None:
        closing.append({"vf": vf, "trust": int(wanted.trust)})
    if wanted.spoofchk is not None:
        closing.append({"vf": vf, "spoofchk": int(wanted.spoofchk)})
    if wanted.mac is not None:
        identity.append({"vf": vf, "mac": wanted.mac})
    if wanted.vlan is not None:
        identity.append({"vf": vf, "vlan": {"vlan": wanted.vlan, "qos": wanted.qos or 0}})
    if wanted.max_tx_rate_mbps is not None:
        identity.append({"vf": vf, "rate": {"min_tx_rate": 0, "max_tx_rate": wanted.max_tx_rate_mbps}})
    if wanted.node_guid is not None:
        identity.append({"vf": vf, "ib_node_guid": wanted.node_guid})
    if wanted.port_guid is not None:
        identity.append({"vf": vf, "ib_port_guid": wanted.port_guid})
    if wanted.link_state is None:
        return closing + identity
    link = {"vf": vf, "link_state": LINK_STATE_VALUES[wanted.link_state]}
    if wanted.link_state is VfLinkState.disable:
        return [link, *closing, *identity]
    return [*closing, *identity, link]


def _field(vfinfo: Any, attr: str, key: str) -> Any:
    nla = vfinfo.get_attr(attr)
    return None if nla is None else nla.get(key)


def _guid(value: Any) -> str | None:
    return value if isinstance(value, str) and GUID_RE.match(value) else None


def settings_from_vfinfo(vfinfo: Any) -> VfSettings:
    """One IFLA_VF_INFO of a decoded RTM_NEWLINK (pyroute2's nla) as :class:`VfSettings`.

    An attribute the driver does not report stays None (e.g. no GUIDs on an Ethernet PF, no trust on an
    old driver); :func:`compare_settings` then reports it as not proven.
    """
    vf = _field(vfinfo, "IFLA_VF_MAC", "vf")
    if vf is None:
        raise ValueError("IFLA_VF_INFO without IFLA_VF_MAC: no VF index")
    mac = _field(vfinfo, "IFLA_VF_MAC", "mac")
    vlan = qos = None
    if (vlan_nla := vfinfo.get_attr("IFLA_VF_VLAN")) is not None:
        vlan, qos = vlan_nla.get("vlan"), vlan_nla.get("qos")
    spoofchk = _field(vfinfo, "IFLA_VF_SPOOFCHK", "spoofchk")
    trust = _field(vfinfo, "IFLA_VF_TRUST", "trust")
    link_state = _field(vfinfo, "IFLA_VF_LINK_STATE", "link_state")
    rate = _field(vfinfo, "IFLA_VF_RATE", "max_tx_rate")
    # The kernel reports u32 -1 for "not supported" in spoofchk/trust of drivers that do not keep them.
    return VfSettings(
        vf=int(vf),
        mac=mac if isinstance(mac, str) and MAC_RE.match(mac) else None,
        vlan=vlan, qos=qos if qos is None or qos <= 7 else None,
        spoofchk=None if spoofchk in (None, 0xFFFFFFFF) else bool(spoofchk),
        trust=None if trust in (None, 0xFFFFFFFF) else bool(trust),
        link_state=LINK_STATES.get(link_state) if link_state is not None else None,
        max_tx_rate_mbps=rate,
        node_guid=_guid(_field(vfinfo, "IFLA_VF_IB_NODE_GUID", "ib_node_guid")),
        port_guid=_guid(_field(vfinfo, "IFLA_VF_IB_PORT_GUID", "ib_port_guid")),
    )


def vfs_of_link(msg: Any) -> dict[int, VfSettings]:
    """Every VF a PF's RTM_NEWLINK (asked with RTEXT_FILTER_VF) reports, by index."""
    vflist = msg.get_attr("IFLA_VFINFO_LIST")
    if vflist is None:
        return {}
    out = {}
    for vfinfo in vflist.get_attrs("IFLA_VF_INFO"):
        settings = settings_from_vfinfo(vfinfo)
        out[settings.vf] = settings
    return out


COMPARED = ("mac", "vlan", "qos", "spoofchk", "trust", "link_state", "max_tx_rate_mbps", "node_guid", "port_guid")


# The PF drivers whose ndo_get_vf_stats fills IFLA_VF_STATS. For any other the kernel still sends the nest,
# all zeroes (rtnl_fill_vfinfo zeroes it before asking the driver): igb, for one, implements no VF counters.
VF_STATS_DRIVERS = frozenset({"mlx5_core"})
_VF_STATS = (("rx_packets", "IFLA_VF_STATS_RX_PACKETS"), ("tx_packets", "IFLA_VF_STATS_TX_PACKETS"),
             ("rx_bytes", "IFLA_VF_STATS_RX_BYTES"), ("tx_bytes", "IFLA_VF_STATS_TX_BYTES"),
             ("rx_drops", "IFLA_VF_STATS_RX_DROPPED"), ("tx_drops", "IFLA_VF_STATS_TX_DROPPED"))


def vf_stats_of_link(msg: Any) -> dict[int, dict[str, int | None]]:
    """VF index -> its IFLA_VF_STATS counters, for each IFLA_VF_INFO that carries the nest (absent: not listed)."""
    vflist = msg.get_attr("IFLA_VFINFO_LIST")
    out: dict[int, dict[str, int | None]] = {}
    if vflist is None:
        return out
    for vfinfo in vflist.get_attrs("IFLA_VF_INFO"):
        vf = _field(vfinfo, "IFLA_VF_MAC", "vf")
        stats = vfinfo.get_attr("IFLA_VF_STATS")
        if vf is None or stats is None:
            continue
        counters: dict[str, int | None] = {}
        for name, attr in _VF_STATS:
            value = stats.get_attr(attr)
            counters[name] = int(value) if isinstance(value, int) and value >= 0 else None
        out[int(vf)] = counters
    return out


def vf_counters(vf_pci_address: str, pf_netdev: str, vf_index: int,
                stats: dict[int, dict[str, int | None]], pf_driver: str | None) -> FabricVfCounters | None:
    """The VF's counters when its PF's driver fills them and the PF listed them; None: unknown."""
    if pf_driver not in VF_STATS_DRIVERS or vf_index not in stats:
        return None
    return FabricVfCounters(vf_pci_address=vf_pci_address, pf_netdev=pf_netdev, vf_index=vf_index,
                            **stats[vf_index])


def compare_settings(wanted: VfSettings, observed: VfSettings) -> list[VfMismatch]:
    """Every value ``wanted`` names that ``observed`` does not hold (a value the kernel did not report
    is a mismatch too: it is not proven)."""
    out = []
    for name in COMPARED:
        want = getattr(wanted, name)
        if want is None:
            continue
        found = getattr(observed, name)
        if found != want:
            out.append(VfMismatch(field=name, wanted=_text(want), found="not reported" if found is None else _text(found)))
    return out


def _text(value: Any) -> str:
    return value.value if isinstance(value, VfLinkState) else str(value).lower() if isinstance(value, bool) else str(value)


def parse_eswitch_json(text: str, pf_pci_address: str) -> EswitchMode:
    """``devlink -j dev eswitch show pci/<pf>``: ``{"dev": {"pci/0000:..": {"mode": "legacy", ...}}}``."""
    try:
        doc = json.loads(text)
        mode = doc["dev"][f"pci/{pf_pci_address}"]["mode"]
    except (ValueError, KeyError, TypeError):
        return EswitchMode.unknown
    try:
        return EswitchMode(mode)
    except ValueError:
        return EswitchMode.unknown


# -- the host: devlink, netlink --------------------------------------------------------------------------


def read_eswitch_mode(pf_pci_address: str) -> tuple[EswitchMode, str]:
    """The PF's eswitch mode from ``devlink -j dev eswitch show pci/<pf>`` (argv, timeout), with what was
    read; ``unknown`` when devlink is missing or the device has no eswitch (never assumed ``legacy``)."""
    argv = ["devlink", "-j", "dev", "eswitch", "show", f"pci/{pf_pci_address}"]
    try:
        done = run_sync(argv, timeout=DEVLINK_TIMEOUT_S, check=False)
    except (HostError, OSError) as exc:
        return EswitchMode.unknown, f"{' '.join(argv)}: {getattr(exc, 'message', None) or exc}"
    stdout = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        return EswitchMode.unknown, f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode('utf-8', 'replace').strip()[:200]}"
    mode = parse_eswitch_json(stdout, pf_pci_address)
    return mode, f"{' '.join(argv)}: {stdout.strip()[:200]}"


@dataclass(frozen=True)
class FabricVfNetlink:
    """The PF's VFs through rtnetlink. ``netns``: a named network namespace (tests); None: the agent's own.

    ``eswitch`` reads a PF's eswitch mode (:func:`read_eswitch_mode`: devlink); a host with no devlink
    answer reads ``unknown``, which ``required`` isolation refuses.
    """

    netns: str | None = None
    eswitch: Callable[[str], tuple[EswitchMode, str]] = field(default=read_eswitch_mode)

    @contextmanager
    def _ipr(self) -> Iterator[Any]:  # pyroute2's IPRoute: the library is untyped
        from pyroute2 import IPRoute

        # flags=0: never create the namespace (pyroute2's default O_CREAT would).
        try:
            ipr = IPRoute(netns=self.netns, flags=0) if self.netns is not None else IPRoute()
        except OSError as exc:
            raise FabricVfError(f"cannot open netlink{f' in netns {self.netns}' if self.netns else ''}: {exc}",
                                code="fabric_vf_failed", evidence={"netns": self.netns}) from None
        try:
            yield ipr
        finally:
            ipr.close()

    def _index(self, ipr: Any, pf_netdev: str) -> int:
        found = ipr.link_lookup(ifname=pf_netdev)
        if not found:
            raise FabricVfError(f"PF netdev {pf_netdev} does not exist", code="fabric_vf_missing",
                                evidence={"pf_netdev": pf_netdev, "netns": self.netns})
        return int(found[0])

    def _vfs(self, ipr: Any, index: int) -> tuple[int, dict[int, VfSettings]]:
        (msg,) = ipr.link("get", index=index, ext_mask=RTEXT_FILTER_VF)
        return int(msg.get_attr("IFLA_NUM_VF") or 0), vfs_of_link(msg)

    def stats(self, pf_netdev: str) -> dict[int, dict[str, int | None]]:
        """The PF's VFs' IFLA_VF_STATS (:func:`vf_stats_of_link`); raises :class:`FabricVfError`."""
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with self._ipr() as ipr:
                (msg,) = ipr.link("get", index=self._index(ipr, pf_netdev), ext_mask=RTEXT_FILTER_VF)
        except NetlinkError as exc:
            raise self._netlink_error(exc, pf_netdev, -1, "read the counters of") from None
        return vf_stats_of_link(msg)

    def read(self, pf_netdev: str, vf: int) -> VfSettings:
        """The VF's settings as the PF reports them; ``fabric_vf_missing`` when it has no such VF."""
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with self._ipr() as ipr:
                num_vf, vfs = self._vfs(ipr, self._index(ipr, pf_netdev))
        except NetlinkError as exc:
            raise self._netlink_error(exc, pf_netdev, vf, "read") from None
        if vf not in vfs:
            raise FabricVfError(f"PF {pf_netdev} reports {num_vf} VF(s), not VF {vf}", code="fabric_vf_missing",
                                evidence={"pf_netdev": pf_netdev, "vf": vf, "num_vf": num_vf, "netns": self.netns})
        return vfs[vf]

    def apply(self, pf_netdev: str, wanted: VfSettings) -> VfSettings:
        """Set ``wanted`` on the PF's VF, read it back, and return what the kernel holds.

        ``fabric_vf_unsupported``: the PF's driver takes no such setting (EOPNOTSUPP; a switchdev PF);
        ``fabric_vf_mismatch``: the kernel accepted the request but holds something else.
        """
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with self._ipr() as ipr:
                index = self._index(ipr, pf_netdev)
                for request in vf_requests(wanted):  # one at a time, closing first: a refusal stops at a safe VF
                    ipr.link("set", index=index, vf=request)
        except NetlinkError as exc:
            raise self._netlink_error(exc, pf_netdev, wanted.vf, "set") from None
        observed = self.read(pf_netdev, wanted.vf)
        mismatches = compare_settings(wanted, observed)
        if mismatches:
            raise FabricVfError(
                f"VF {wanted.vf} of {pf_netdev} does not hold what was set: "
                + ", ".join(f"{m.field} {m.found} (wanted {m.wanted})" for m in mismatches),
                code="fabric_vf_mismatch",
                evidence={"pf_netdev": pf_netdev, "vf": wanted.vf, "mismatches": [m.model_dump() for m in mismatches],
                          "wanted": wanted.model_dump(mode="json"), "observed": observed.model_dump(mode="json")})
        return observed

    def _netlink_error(self, exc: Any, pf_netdev: str, vf: int, what: str) -> FabricVfError:
        code = exc.code if isinstance(getattr(exc, "code", None), int) else 0
        evidence = {"pf_netdev": pf_netdev, "vf": vf, "errno": errno.errorcode.get(code, str(code)), "netns": self.netns}
        if code == errno.EOPNOTSUPP:
            return FabricVfError(f"PF {pf_netdev} cannot {what} VF {vf} settings (EOPNOTSUPP: its driver takes none, "
                                 "or its eswitch is in switchdev mode)", code="fabric_vf_unsupported", evidence=evidence)
        if code in (errno.EINVAL, errno.ENODEV, errno.ERANGE) and what == "set":
            return FabricVfError(f"PF {pf_netdev} refused the settings of VF {vf}: {exc}", code="fabric_vf_unsupported",
                                 evidence=evidence)
        return FabricVfError(f"netlink {what} of VF {vf} on {pf_netdev} failed: {exc}", code="fabric_vf_failed",
                             evidence=evidence)
