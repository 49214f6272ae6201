"""Readiness proves egress: the guest's connection to a target beyond the NAT, read from the host's conntrack.

Why conntrack and not the guest's word: the guest is the tenant's, and what it prints
on its console is the tenant's. The host kernel's connection tracking says, for the
connection the guest's first boot opens to :class:`~gpuaas_agent.contract.egress.EgressTarget`
(the seed's probe, ``host/vm/cloudinit.py``), whether it was source-NATed
(``SRC_NAT_DONE``: a ``MASQUERADE``/``SNAT`` rule matched) and whether the target
answered (``SEEN_REPLY``). The port flows pin the guest to its own source address, so
a tracked connection from that address is the guest's. Read through netlink (pyroute2's
``Conntrack``), never a subprocess.

A missing NAT rule shows up as a tracked connection without ``SRC_NAT_DONE`` and
without a reply (the target has no route back to the private subnet): the typed
error names exactly that.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.egress import EgressConnection, EgressEvidence, EgressTarget
from gpuaas_agent.contract.runtime import RuntimeProfile
from gpuaas_agent.errors import HostError

# include/uapi/linux/netfilter/nf_conntrack_common.h
IPS_BITS = {0x1: "EXPECTED", 0x2: "SEEN_REPLY", 0x4: "ASSURED", 0x8: "CONFIRMED", 0x10: "SRC_NAT",
            0x20: "DST_NAT", 0x80: "SRC_NAT_DONE", 0x100: "DST_NAT_DONE", 0x200: "DYING"}
IPS_SEEN_REPLY, IPS_SRC_NAT_DONE = 0x2, 0x80
MAX_LISTED = 8


class EgressUnproven(HostError):
    """Readiness could not prove egress. Codes: ``readiness_egress_unproven`` (the deadline passed without
    an answered, source-NATed connection; evidence: what conntrack showed), ``readiness_egress_unconfigured``
    (the profile asks for it, the host names no target)."""

    default_code = "readiness_egress_unproven"


@dataclass(frozen=True)
class Tracked:
    """One conntrack entry, the fields egress needs."""

    proto: int
    src: str
    sport: int
    dst: str
    dport: int
    reply_dst: str | None
    status: int


def read_conntrack() -> list[Tracked]:
    """Every IPv4 TCP entry of this network namespace's conntrack table (blocking netlink dump)."""
    from pyroute2 import Conntrack

    out = []
    try:
        with Conntrack() as ct:
            for entry in ct.dump_entries():
                orig, reply = entry.tuple_orig, entry.tuple_reply
                if orig is None or orig.proto != socket.IPPROTO_TCP:
                    continue
                out.append(Tracked(proto=orig.proto, src=str(orig.saddr), sport=int(orig.sport or 0),
                                   dst=str(orig.daddr), dport=int(orig.dport or 0),
                                   reply_dst=str(reply.daddr) if reply is not None and reply.daddr else None,
                                   status=int(entry.status or 0)))
    except OSError as exc:
        raise HostError(f"cannot read the conntrack table: {exc}", code="conntrack_unreadable",
                        evidence={"errno": exc.errno, "error": str(exc)}) from None
    return out


def connection(entry: Tracked) -> EgressConnection:
    return EgressConnection(
        src=entry.src, sport=entry.sport, dst=entry.dst, dport=entry.dport,
        status=[name for bit, name in sorted(IPS_BITS.items()) if entry.status & bit],
        nat_source=entry.reply_dst, source_nat=bool(entry.status & IPS_SRC_NAT_DONE) and entry.reply_dst != entry.src,
        answered=bool(entry.status & IPS_SEEN_REPLY))


def judge(entries: Iterable[Tracked], guest_ip: str, target: EgressTarget) -> tuple[EgressConnection | None,
                                                                                     list[EgressConnection]]:
    """(the first connection that proves egress or None, every guest→target connection seen)."""
    seen = [connection(e) for e in entries
            if e.src == guest_ip and e.dst == str(target.ip) and e.dport == target.port]
    proof = next((c for c in seen if c.source_nat and c.answered), None)
    return proof, seen


def _why(seen: list[EgressConnection]) -> str:
    if not seen:
        return "no connection from the guest to the target was tracked (the guest never tried, or its traffic " \
               "never reached the host's routing)"
    if not any(c.source_nat for c in seen):
        return "the guest's connection left without source NAT (no MASQUERADE/SNAT rule matched it)"
    return "the guest's connection was source-NATed but the target never answered"


async def wait_for_egress(guest_ip: IPv4Address | str, target: EgressTarget, *, deadline: float,
                          poll_s: float = 1.0, reader: Callable[[], list[Tracked]] = read_conntrack) -> EgressEvidence:
    """Poll conntrack until the guest's connection to ``target`` is source-NATed and answered.

    ``deadline`` is loop time (as in ``host/network/readiness.py``). Raises :class:`EgressUnproven`
    with the connections seen when the deadline passes.
    """
    loop = asyncio.get_running_loop()
    guest = str(guest_ip)
    tracked: dict[tuple[Any, ...], EgressConnection] = {}
    while True:
        proof, seen = judge(await asyncio.to_thread(reader), guest, target)
        for c in seen:
            tracked[(c.src, c.sport)] = c
        if proof is not None:
            return EgressEvidence(target=target, guest_ip=guest, connection=proof, tracked=len(tracked))
        if loop.time() >= deadline:
            listed = list(tracked.values())[-MAX_LISTED:]
            raise EgressUnproven(
                f"guest {guest} did not reach {target.ip}:{target.port} through the NAT: {_why(listed)}",
                evidence={"guest_ip": guest, "target": target.model_dump(mode="json"), "reason": _why(listed),
                          "tracked": [c.model_dump(mode="json") for c in listed], "tracked_count": len(tracked)})
        await asyncio.sleep(min(poll_s, max(0.0, deadline - loop.time())))  # poll step of a deadline wait


def egress_target(profile: RuntimeProfile, cfg: SliceConfig) -> EgressTarget | None:
    """The target readiness must prove for ``profile`` on this host, None when the profile does not ask.

    Refuses (``readiness_egress_unconfigured``) a profile that asks on a host that names no target:
    such a slice could never be proven, so it is refused before anything is leased.
    """
    if not getattr(profile, "readiness_egress", False):
        return None
    if cfg.readiness_egress_target is None:
        raise EgressUnproven(
            f"runtime profile {profile.name} asks readiness to prove egress; this host's "
            "slice.readiness_egress_target is not set", code="readiness_egress_unconfigured",
            evidence={"profile": profile.name, "config": "slice.readiness_egress_target"})
    return cfg.readiness_egress_target
