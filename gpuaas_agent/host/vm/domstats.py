"""libvirt's bulk domain stats record (``virConnectGetAllDomainStats``), parsed into plain values.

Pure: the record is the flat dict libvirt returns per domain (``"block.0.rd.bytes": 1234``), parsed
here without a connection, so a recorded dict (fixtures/libvirt/) and a live call go through the same
code. The call itself is :meth:`~gpuaas_agent.host.vm.libvirt_lifecycle.LibvirtLifecycle.all_domain_stats`:
one call per interval for every domain of the host, however many slices run.

Field names are libvirt's (docs of ``virConnectGetAllDomainStats``: groups ``state``, ``cpu-total``,
``balloon``, ``vcpu``, ``interface``, ``block``). A hypervisor that does not report a group (libvirt's
test driver reports ``state`` only) leaves its fields ``None``, never 0. Values of the wrong type (a
record is the hypervisor's, not ours to trust blindly) are treated as not reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuaas_agent.contract.domain import DomainState

# virDomainState by value (libvirt-domain.h, stable ABI): 0 nostate .. 7 pmsuspended.
_STATES: tuple[DomainState, ...] = (
    DomainState.nostate, DomainState.running, DomainState.blocked, DomainState.paused, DomainState.shutdown,
    DomainState.shutoff, DomainState.crashed, DomainState.pmsuspended,
)
# A record names at most this many disks/NICs/vCPUs we read (libvirt's own limits are far above what a slice
# has; a record claiming more is read up to the bound, not iterated blindly).
MAX_DEVICES = 64
MAX_VCPUS = 1024
MAX_NAME = 64  # a device name or path longer than this is not one the agent gave: not reported


@dataclass(frozen=True)
class BlockStats:
    """``block.<n>.*``: one disk of the domain."""

    name: str  # the guest-side target (vda)
    path: str | None  # the host-side source (/dev/disk/by-id/...)
    rd_bytes: int | None = None
    rd_reqs: int | None = None
    wr_bytes: int | None = None
    wr_reqs: int | None = None


@dataclass(frozen=True)
class NetStats:
    """``net.<n>.*``: one interface of the domain, by its host-side name (the tap)."""

    name: str
    rx_bytes: int | None = None
    rx_pkts: int | None = None
    rx_drop: int | None = None
    tx_bytes: int | None = None
    tx_pkts: int | None = None
    tx_drop: int | None = None


@dataclass(frozen=True)
class DomainStats:
    """One domain's record, parsed."""

    name: str
    state: DomainState
    cpu_time_ns: int | None = None
    vcpu_time_ns: int | None = None  # the sum of ``vcpu.<n>.time`` over the vCPUs reported
    vcpus: int | None = None
    balloon_current_kib: int | None = None
    balloon_maximum_kib: int | None = None
    balloon_rss_kib: int | None = None
    blocks: tuple[BlockStats, ...] = ()
    nets: tuple[NetStats, ...] = ()
    groups: frozenset[str] = field(default_factory=frozenset)  # the groups the record carried (state, block ...)


def _int(record: Mapping[str, Any], key: str) -> int | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _str(record: Mapping[str, Any], key: str, bound: int = MAX_NAME) -> str | None:
    value = record.get(key)
    return value if isinstance(value, str) and 0 < len(value) <= bound else None


def _count(record: Mapping[str, Any], key: str, bound: int) -> int:
    return min(_int(record, key) or 0, bound)


def _vcpu_time(record: Mapping[str, Any]) -> int | None:
    times = [t for n in range(_count(record, "vcpu.maximum", MAX_VCPUS)) if (t := _int(record, f"vcpu.{n}.time")) is not None]
    return sum(times) if times else None


def parse_domain_stats(name: str, record: Mapping[str, Any]) -> DomainStats:
    """One ``(domain, record)`` pair of ``getAllDomainStats``; missing or malformed fields are ``None``."""
    state_value = _int(record, "state.state")
    state = _STATES[state_value] if state_value is not None and state_value < len(_STATES) else DomainState.nostate
    blocks = []
    for n in range(_count(record, "block.count", MAX_DEVICES)):
        target = _str(record, f"block.{n}.name")
        if target is None:
            continue
        p = f"block.{n}."
        blocks.append(BlockStats(name=target, path=_str(record, p + "path", 4096), rd_bytes=_int(record, p + "rd.bytes"),
                                 rd_reqs=_int(record, p + "rd.reqs"), wr_bytes=_int(record, p + "wr.bytes"),
                                 wr_reqs=_int(record, p + "wr.reqs")))
    nets = []
    for n in range(_count(record, "net.count", MAX_DEVICES)):
        ifname = _str(record, f"net.{n}.name")
        if ifname is None:
            continue
        p = f"net.{n}."
        nets.append(NetStats(name=ifname, rx_bytes=_int(record, p + "rx.bytes"), rx_pkts=_int(record, p + "rx.pkts"),
                             rx_drop=_int(record, p + "rx.drop"), tx_bytes=_int(record, p + "tx.bytes"),
                             tx_pkts=_int(record, p + "tx.pkts"), tx_drop=_int(record, p + "tx.drop")))
    groups = frozenset(key.split(".", 1)[0] for key in record)
    return DomainStats(name=name, state=state, cpu_time_ns=_int(record, "cpu.time"), vcpu_time_ns=_vcpu_time(record),
                       vcpus=_int(record, "vcpu.current"), balloon_current_kib=_int(record, "balloon.current"),
                       balloon_maximum_kib=_int(record, "balloon.maximum"), balloon_rss_kib=_int(record, "balloon.rss"),
                       blocks=tuple(blocks), nets=tuple(nets), groups=groups)


def parse_all(records: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, DomainStats]:
    """Every domain of one bulk call, by name."""
    return {name: parse_domain_stats(name, record) for name, record in records}
