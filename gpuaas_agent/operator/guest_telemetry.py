"""Guest telemetry: a bounded pull of the exporter in a slice's guest, for allocations that ask.

The target is never the payload's: the port and path are the agent's configuration (``guest_exporter_port``,
``guest_exporter_path``), the address the slot's own dnsmasq reservation (the IP its port flows pin), and the
allocation only says yes or no (``VmProvisionPayload.guest_telemetry``, kept on its lease). The host reaches the
guest over the management path the slice isolation already narrows (docs/security.md "Guest telemetry"): the
host's gateway address opens the connection, the guest's answers come back as conntrack ``established``, and
nothing the guest starts reaches a host service.

A guest is untrusted input, so each pull is bounded (:class:`~gpuaas_agent.contract.telemetry.GuestPullBounds`):

- **time**: connect, request and the whole response within ``timeout_s`` (a slow drip is cut there);
- **bytes**: reading stops at ``max_bytes`` (head and body), the connection is closed, nothing is parsed;
- **series**: the parser (prometheus-client's ``text_string_to_metric_families``, lazy) is stopped after
  ``max_series`` samples; the rest is counted once (``series_cap``), never parsed;
- **frequency**: a slot is pulled at most once per ``min_interval_s`` (``throttled`` otherwise).

What is kept is relabelled to the slot: a label the agent owns (``slot``, ``allocation_id``, ``node`` ...) is
removed from the guest's sample (``label_collision``), over-long names and values and non-finite values are
dropped (each a counted reason); a body the parser refuses is dropped whole (``malformed``). Every drop is
counted on ``/metrics`` by reason (``gpuaas_agent_guest_telemetry_dropped_total{reason}``), and the pulls by
outcome: no label carries an allocation or anything the guest wrote, so the operator's cardinality stays bounded.

Nothing per slice outlives the lease: :meth:`GuestPuller.forget_except` drops the last-pull times of every
allocation that no longer holds one, each round.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address

from prometheus_client.parser import text_string_to_metric_families

from gpuaas_agent.compat import timeout
from gpuaas_agent.contract.dhcp import Reservation
from gpuaas_agent.contract.telemetry import (
    GUEST_RESERVED_LABELS,
    MAX_GUEST_LABEL_VALUE,
    MAX_GUEST_LABELS,
    MAX_GUEST_NAME,
    MAX_GUEST_WIRE_BYTES,
    GuestPullBounds,
    GuestPullOutcome,
    GuestSample,
    GuestTelemetry,
)

READ_CHUNK = 64 * 1024
_HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class GuestTarget:
    """Where one slot's exporter is: the reserved IP and the configured port and path."""

    allocation_id: str
    slot_index: int
    ip: IPv4Address
    port: int
    path: str

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}{self.path}"


@dataclass
class _Body:
    outcome: GuestPullOutcome
    data: bytes = b""
    read: int = 0
    message: str | None = None


async def _fetch(target: GuestTarget, bounds: GuestPullBounds, source: IPv4Address | None) -> _Body:
    """GET the target over HTTP/1.0 (no chunking, no keep-alive), at most ``max_bytes`` read, within the deadline."""
    request = (f"GET {target.path} HTTP/1.0\r\nHost: {target.ip}:{target.port}\r\n"
               "Accept: text/plain;version=0.0.4\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n").encode()
    buffer = bytearray()
    writer: asyncio.StreamWriter | None = None
    try:
        async with timeout(bounds.timeout_s):
            try:
                reader, writer = await asyncio.open_connection(
                    str(target.ip), target.port, local_addr=(str(source), 0) if source is not None else None,
                    limit=READ_CHUNK)
                writer.write(request)
                await writer.drain()
                while chunk := await reader.read(READ_CHUNK):
                    buffer += chunk
                    if len(buffer) > bounds.max_bytes:
                        return _Body("too_large", read=len(buffer),
                                     message=f"the exporter sent more than {bounds.max_bytes} bytes")
            except OSError as exc:
                return _Body("unreachable", read=len(buffer), message=f"{type(exc).__name__}: {exc}"[:300])
    except TimeoutError:
        return _Body("timeout", read=len(buffer), message=f"no whole answer within {bounds.timeout_s} s")
    finally:
        if writer is not None:
            writer.close()  # not awaited: a guest that never acknowledges the close cannot hold the pull
    head, sep, body = bytes(buffer).partition(_HEAD_END)
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/"):
        return _Body("malformed", read=len(buffer), message="not an HTTP response")
    if status[1] != b"200":
        return _Body("http_error", read=len(buffer), message=f"HTTP {status[1].decode('ascii', 'replace')[:3]}")
    return _Body("ok", data=body, read=len(buffer))


def parse_exposition(text: str, bounds: GuestPullBounds) -> tuple[list[GuestSample], Counter[str], bool]:
    """The guest's samples relabelled (reserved labels removed), the drops by reason, and whether the cap cut it.

    Raises ``ValueError`` when the parser refuses the body (the caller drops it whole).

    The parser makes a new string for every name, label name and label value of every sample, though an
    exposition repeats a family's name and a handful of label names and values across its samples; the kept
    samples share one string per distinct text (``canon``, this body's only: nothing outlives the parse), so
    the samples a round holds until it publishes cost ~0.7 KiB each instead of ~0.9 (docs/performance.md).
    """
    kept: list[GuestSample] = []
    dropped: Counter[str] = Counter()
    canon: dict[str, str] = {}
    one = canon.setdefault
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if len(kept) >= bounds.max_series:
                dropped["series_cap"] += 1  # counted once: the parser is not asked for the rest
                return kept, dropped, True
            value = float(sample.value)
            if not math.isfinite(value):
                dropped["non_finite"] += 1
                continue
            if len(sample.name) > MAX_GUEST_NAME or len(sample.labels) > MAX_GUEST_LABELS or any(
                    len(k) > MAX_GUEST_NAME or len(v) > MAX_GUEST_LABEL_VALUE for k, v in sample.labels.items()):
                dropped["too_long"] += 1
                continue
            labels = {one(k, k): one(v, v) for k, v in sample.labels.items() if k not in GUEST_RESERVED_LABELS}
            if len(labels) != len(sample.labels):
                dropped["label_collision"] += 1  # the sample stays; the guest's claim to be another slot does not
            kept.append(GuestSample(name=one(sample.name, sample.name), labels=labels, value=value))
    return kept, dropped, False


@dataclass
class GuestPullCounters:
    """For ``/metrics``: pulls by outcome, drops by reason, the bytes read (no per-allocation label)."""

    pulls: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    bytes_read: int = 0


class GuestPuller:
    """Pulls each opted-in slot's exporter within :class:`GuestPullBounds`; remembers only when it last did."""

    def __init__(self, bounds: GuestPullBounds, *, source: IPv4Address | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.bounds, self.source, self.clock, self.wall = bounds, source, clock, wall
        self.last_pull: dict[tuple[str, int], float] = {}
        self.counters = GuestPullCounters()
        # One parse at a time: the parser holds the GIL, so parsing the slots side by side is not faster, and one
        # at a time bounds what a round has in flight to one body's parser objects (docs/performance.md).
        self._parsing = asyncio.Lock()

    def forget_except(self, allocations: Iterable[str]) -> None:
        """Drop what is kept for every allocation not in ``allocations`` (called each round with the leased ones)."""
        keep = set(allocations)
        self.last_pull = {k: v for k, v in self.last_pull.items() if k[0] in keep}

    async def pull(self, target: GuestTarget) -> GuestTelemetry:
        key = (target.allocation_id, target.slot_index)
        now = self.clock()
        last = self.last_pull.get(key)
        if last is not None and now - last < self.bounds.min_interval_s:
            return self._done(target, _Body("throttled", message=f"pulled {now - last:.1f} s ago"), [], Counter(), now)
        self.last_pull[key] = now
        body = await _fetch(target, self.bounds, self.source)
        samples: list[GuestSample] = []
        dropped: Counter[str] = Counter()
        if body.outcome == "ok":
            try:
                async with self._parsing:
                    samples, dropped, capped = await asyncio.to_thread(self._parse, body.data)
            # A third-party parser over bytes a tenant chose: ValueError is its refusal, but a fuzz of it also raised
            # IndexError, so whatever it raises is this body's outcome (typed, counted), never the round's end.
            except Exception as exc:
                dropped = Counter({"malformed": 1})
                body = _Body("malformed", read=body.read, message=f"{type(exc).__name__}: {exc}"[:300])
            else:
                if capped:
                    body = _Body("series_capped", read=body.read,
                                 message=f"more than {self.bounds.max_series} samples: the first kept")
        elif body.outcome in ("too_large", "malformed"):
            dropped[body.outcome] += 1
        return self._done(target, body, samples, dropped, now)

    def _parse(self, data: bytes) -> tuple[list[GuestSample], Counter[str], bool]:
        return parse_exposition(data.decode("utf-8"), self.bounds)

    def _done(self, target: GuestTarget, body: _Body, samples: list[GuestSample], dropped: Counter[str],
              started: float) -> GuestTelemetry:
        result = GuestTelemetry(slot_index=target.slot_index, target=str(target), outcome=body.outcome,
                                pulled_at=self.wall(), duration_s=max(0.0, self.clock() - started),
                                bytes_read=body.read, series=samples, dropped=dict(dropped), message=body.message)
        if samples and len(result.model_dump_json()) > MAX_GUEST_WIRE_BYTES:
            # Long labels within max_bytes could still outgrow the allocation's message: none of it travels.
            dropped["too_large_for_wire"] += 1
            result = result.model_copy(update={
                "outcome": "too_large_for_wire", "series": [], "dropped": dict(dropped),
                "message": f"{len(samples)} samples are more than {MAX_GUEST_WIRE_BYTES} bytes on the wire"})
        self.counters.pulls[result.outcome] += 1
        self.counters.dropped.update(dropped)
        self.counters.bytes_read += body.read
        return result

    async def pull_all(self, targets: list[GuestTarget]) -> list[GuestTelemetry]:
        """Every target at once: a round takes one ``timeout_s`` (plus parsing), not one per slice."""
        return list(await asyncio.gather(*(self.pull(t) for t in targets)))


def guest_targets(opted: Iterable[tuple[str, int]], reservations: Iterable[Reservation], *, port: int,
                  path: str) -> list[GuestTarget]:
    """The exporters to pull: each opted-in (allocation, slot) that has a reservation, at its reserved IP.

    Only the boot slot of an allocation carries the vNIC and so the reservation: a data slot has no target.
    The address is the host's own record (dnsmasq's hosts file, the IP the port flows pin), never the wire's.
    """
    wanted = set(opted)
    return [GuestTarget(allocation_id=r.allocation_id, slot_index=r.slot_index, ip=r.ip, port=port, path=path)
            for r in sorted(reservations, key=lambda r: (r.allocation_id, r.slot_index))
            if (r.allocation_id, r.slot_index) in wanted]


@dataclass
class GuestTelemetrySource:
    """What the slice telemetry loop needs to add guest series: the puller, the reservations, the configured target."""

    puller: GuestPuller
    reservations: Callable[[], Awaitable[list[Reservation]]]
    port: int
    path: str

    async def round(self, opted: Iterable[tuple[str, int]]) -> dict[str, list[GuestTelemetry]]:
        """Pull every opted-in slot's exporter once; the results by allocation."""
        targets = guest_targets(opted, await self.reservations(), port=self.port, path=self.path)
        out: dict[str, list[GuestTelemetry]] = {}
        for target, result in zip(targets, await self.puller.pull_all(targets)):
            out.setdefault(target.allocation_id, []).append(result)
        return out
