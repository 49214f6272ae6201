"""Guest telemetry: a bounded pull of each opted-in slot's exporter, relabelled to the slot, drops counted by reason.

Real parts: real HTTP exporters on loopback (asyncio servers, one address per "guest": 127.0.0.2, .3 ... on one
port, as the agent's configuration gives one port and each slot's reservation its own IP), prometheus-client's
parser, the slice telemetry loop. Hostile exporters serve garbage, 100 MB, a slow drip (one byte per second) and
a million series; each pull is cut by its own bound while the good guest's series keep arriving.
"""

from __future__ import annotations

import asyncio
import json
from ipaddress import IPv4Address

from gpuaas_agent.contract.dhcp import Reservation
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.contract.tasks import VmProvisionPayload
from gpuaas_agent.contract.telemetry import GuestPullBounds, SliceTelemetry
from gpuaas_agent.operator.guest_telemetry import (
    GuestPuller,
    GuestTarget,
    GuestTelemetrySource,
    guest_targets,
    parse_exposition,
)
from gpuaas_agent.operator.metrics import AgentMetrics
from gpuaas_agent.operator.telemetry import SliceMetricsCollector, SliceTelemetryLoop
from tests.support.deadline import run_bounded
from tests.support.nats_server import free_port

NODE = "node-guest-telemetry"
GOOD, GARBAGE, HUGE, DRIP, MILLION, WRONG_SLOT = (f"127.0.0.{n}" for n in range(2, 8))
ALLOCS = {ip: f"{n:08x}-0000-4000-8000-00000000000{n}" for n, ip in
          enumerate((GOOD, GARBAGE, HUGE, DRIP, MILLION, WRONG_SLOT), start=1)}
GOOD_BODY = (b"# HELP node_load1 1m load average.\n# TYPE node_load1 gauge\nnode_load1 0.25\n"
             b"# TYPE node_network_receive_bytes_total counter\n"
             b'node_network_receive_bytes_total{device="eth0"} 1234\n'
             b'node_network_receive_bytes_total{device="lo"} 56\n'
             b'# TYPE dcgm_gpu_temp gauge\ndcgm_gpu_temp{gpu="0",slot="7",allocation_id="someone-else"} 41\n'
             b"# TYPE weird gauge\nweird NaN\n")
BOUNDS = GuestPullBounds(max_bytes=1024 * 1024, max_series=1000, timeout_s=2.5, min_interval_s=0)


async def _respond(writer: asyncio.StreamWriter, head: bytes, chunks) -> None:
    try:
        writer.write(head)
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass  # the agent stopped reading: that is the bound at work
    finally:
        writer.close()


def _ok(body_len: int | None = None) -> bytes:
    length = f"Content-Length: {body_len}\r\n" if body_len is not None else ""
    return f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n{length}\r\n".encode()


def _million_series():
    for block in range(1000):
        yield b"".join(b'm{i="%d"} 1\n' % (block * 1000 + i) for i in range(1000))


async def _drip(writer: asyncio.StreamWriter) -> None:
    try:
        writer.write(_ok())
        for byte in b"node_load1 1\n" * 10:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(1.0)  # the hostile guest's pace, not a synchronisation
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def _exporter(ip: str, served: dict[str, int]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        served[ip] = served.get(ip, 0) + 1
        if ip == GOOD:
            await _respond(writer, _ok(len(GOOD_BODY)), [GOOD_BODY])
        elif ip == GARBAGE:
            await _respond(writer, _ok(), [b"\x00\xffthis is { not an exposition ((( 12 x\n" * 100])
        elif ip == HUGE:
            await _respond(writer, _ok(100 * 1024 * 1024), (b"#" * (1024 * 1024) for _ in range(100)))
        elif ip == DRIP:
            await _drip(writer)
        elif ip == MILLION:
            await _respond(writer, _ok(), _million_series())
        else:
            await _respond(writer, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", [])
    return handle


class Exporters:
    """One real HTTP server per guest address, all on one port (the agent's configured exporter port)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.served: dict[str, int] = {}
        self.servers: list[asyncio.Server] = []

    async def __aenter__(self) -> Exporters:
        for ip in ALLOCS:
            self.servers.append(await asyncio.start_server(_exporter(ip, self.served), ip, self.port))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers:
            server.close()
        for server in self.servers:
            await asyncio.wait_for(server.wait_closed(), 5)

    def target(self, ip: str, slot: int = 0) -> GuestTarget:
        return GuestTarget(allocation_id=ALLOCS[ip], slot_index=slot, ip=IPv4Address(ip), port=self.port,
                           path="/metrics")


# -- the parser and relabelling, pure ------------------------------------------------------------------------


def test_a_good_exposition_is_relabelled_to_the_slot_and_drops_are_counted():
    samples, dropped, capped = parse_exposition(GOOD_BODY.decode(), BOUNDS)
    by_name = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert by_name[("node_load1", ())] == 0.25
    assert by_name[("node_network_receive_bytes_total", (("device", "eth0"),))] == 1234
    # The guest's claim to be slot 7 of another allocation is removed; its own gpu label stays.
    assert by_name[("dcgm_gpu_temp", (("gpu", "0"),))] == 41
    assert dict(dropped) == {"label_collision": 1, "non_finite": 1} and not capped


def test_more_series_than_the_cap_keeps_the_first_and_counts_the_rest_once():
    body = "".join(f'm{{i="{i}"}} {i}\n' for i in range(5000))
    samples, dropped, capped = parse_exposition(body, BOUNDS)
    assert capped and len(samples) == BOUNDS.max_series and dropped["series_cap"] == 1
    assert [s.value for s in samples[:3]] == [0, 1, 2]


def _pull_one_body(body: bytes, bounds):
    """One pull of a loopback exporter that answers ``body`` whole; the result and the puller's counters."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await _respond(writer, _ok(len(body)), [body])

    async def run():
        port = free_port()
        server = await asyncio.start_server(handle, "127.0.0.9", port)
        try:
            puller = GuestPuller(bounds)
            target = GuestTarget(allocation_id=ALLOCS[GOOD], slot_index=0, ip=IPv4Address("127.0.0.9"), port=port,
                                 path="/metrics")
            return await puller.pull(target), puller.counters
        finally:
            server.close()
    return run_bounded(run(), 30)


def test_a_body_that_breaks_the_parser_itself_is_malformed_and_counted_not_the_rounds_end():
    """A fuzzed body on which prometheus-client's parser raises IndexError, not its ValueError: still one outcome."""
    body = b'{, =-, 0}e.#a."\n,}.e,",-""}#0 #01'

    result, counters = _pull_one_body(body, BOUNDS)
    assert result.outcome == "malformed" and result.series == [] and "IndexError" in (result.message or "")
    assert counters.dropped == {"malformed": 1}


def test_the_target_is_the_reservation_and_the_configuration_never_the_payload():
    """Only an opted-in (allocation, slot) with a reservation is pulled, at the reserved IP and the configured
    port and path; the provision payload carries a yes/no only."""
    res = [Reservation.from_wire({"allocation_id": ALLOCS[GOOD], "slot_index": 0, "mac": "52:54:00:00:00:01",
                                  "ip": "10.100.0.10", "hostname": "a"}),
           Reservation.from_wire({"allocation_id": ALLOCS[GARBAGE], "slot_index": 1, "mac": "52:54:00:00:00:02",
                                  "ip": "10.100.0.11", "hostname": "b"})]
    targets = guest_targets([(ALLOCS[GOOD], 0), (ALLOCS[GOOD], 1)], res, port=9100, path="/metrics")
    assert [str(t) for t in targets] == ["10.100.0.10:9100/metrics"]
    fields = VmProvisionPayload.model_fields
    assert fields["guest_telemetry"].default is False
    assert not any("exporter" in name or "guest_port" in name for name in fields)


# -- real exporters on loopback --------------------------------------------------------------------------


def test_each_hostile_exporter_is_cut_by_its_own_bound_and_the_good_one_is_read():
    async def body():
        async with Exporters() as ex:
            puller = GuestPuller(BOUNDS)
            results = await puller.pull_all([ex.target(ip) for ip in ALLOCS])
            return {r.target.split(":")[0]: r for r in results}, puller.counters
    by_ip, counters = run_bounded(body(), 60)
    good = by_ip[GOOD]
    assert good.outcome == "ok" and len(good.series) == 4 and good.dropped == {"label_collision": 1, "non_finite": 1}
    assert by_ip[GARBAGE].outcome == "malformed" and by_ip[GARBAGE].series == []
    assert by_ip[GARBAGE].dropped == {"malformed": 1}
    huge = by_ip[HUGE]
    assert huge.outcome == "too_large" and huge.series == []
    assert BOUNDS.max_bytes < huge.bytes_read <= BOUNDS.max_bytes + 2 * 64 * 1024  # stopped at the cap, not 100 MB
    drip = by_ip[DRIP]
    assert drip.outcome == "timeout" and drip.series == [] and drip.bytes_read < 100
    million = by_ip[MILLION]
    assert million.outcome == "too_large" and million.series == []
    assert by_ip[WRONG_SLOT].outcome == "http_error"
    assert counters.pulls == {"ok": 1, "malformed": 1, "too_large": 2, "timeout": 1, "http_error": 1}
    assert counters.dropped["too_large"] == 2 and counters.dropped["malformed"] == 1


def test_a_million_series_under_a_large_byte_cap_is_cut_by_the_series_cap():
    bounds = BOUNDS.model_copy(update={"max_bytes": 64 * 1024 * 1024, "timeout_s": 30.0})

    async def body():
        async with Exporters() as ex:
            return await GuestPuller(bounds).pull(ex.target(MILLION))
    result = run_bounded(body(), 60)
    assert result.outcome == "series_capped" and len(result.series) == bounds.max_series
    assert result.dropped == {"series_cap": 1}


def test_long_labels_that_would_outgrow_the_message_are_dropped_whole():
    """Within max_bytes a guest can pack samples whose labels, as JSON, would not fit a NATS message: none travel."""
    bounds = BOUNDS.model_copy(update={"max_bytes": 4 * 1024 * 1024})
    body = b"".join(b'm{i="%d",pad="%s"} 1\n' % (i, b"x" * 1000) for i in range(900))

    result, counters = _pull_one_body(body, bounds)
    assert result.outcome == "too_large_for_wire" and result.series == []
    assert result.dropped == {"too_large_for_wire": 1} and counters.pulls == {"too_large_for_wire": 1}
    assert len(result.model_dump_json()) < 4096


def test_a_slot_is_never_pulled_more_often_than_the_interval():
    bounds = BOUNDS.model_copy(update={"min_interval_s": 3600.0})

    async def body():
        async with Exporters() as ex:
            puller = GuestPuller(bounds)
            first = await puller.pull(ex.target(GOOD))
            second = await puller.pull(ex.target(GOOD))
            return first, second, dict(ex.served)
    first, second, served = run_bounded(body(), 30)
    assert first.outcome == "ok" and second.outcome == "throttled" and second.series == []
    assert served == {GOOD: 1}  # the guest saw one request, not two


# -- through the slice telemetry loop ----------------------------------------------------------------------


def _lease(ip: str, *, opted: bool = True) -> SlotLease:
    n = list(ALLOCS).index(ip)
    return SlotLease(allocation_id=ALLOCS[ip], slot_index=n, gpu_pci_address=f"0000:{0x18 + n:02x}:00.0",
                     nvme_device=f"/dev/disk/by-id/nvme-eui.{n:032x}", disk_identity=f"nguid:{n:032x}",
                     fabric_vf_pci_address=f"0000:{0x40 + n:02x}:00.1", task_id="t", taken_at=1.0,
                     guest_telemetry=opted)


def _reservation(ip: str) -> Reservation:
    n = list(ALLOCS).index(ip)
    return Reservation.from_wire({"allocation_id": ALLOCS[ip], "slot_index": n, "mac": f"52:54:00:00:00:{n:02x}",
                                  "ip": ip, "hostname": f"g{n}"})


def test_the_good_slice_keeps_flowing_beside_hostile_ones_and_release_leaves_nothing():
    """Every round: the good guest's series on its own allocation's message only; each hostile guest's message
    says its outcome and carries nothing; an allocation that did not opt in is never pulled; after release no
    message, no /metrics series and no remembered pull of it is left."""
    hostile = [GARBAGE, HUGE, DRIP, MILLION]
    leases = [_lease(GOOD), *map(_lease, hostile), _lease(WRONG_SLOT, opted=False)]
    published: list[tuple[str, SliceTelemetry]] = []

    async def publish(subject: str, data: bytes) -> None:
        published.append((subject, SliceTelemetry.from_wire(json.loads(data))))

    async def body():
        async with Exporters() as ex:
            async def held() -> list[SlotLease]:
                return list(leases)

            async def reservations() -> list[Reservation]:
                return [_reservation(ip) for ip in ALLOCS]

            async def stats() -> list:
                return []

            source = GuestTelemetrySource(GuestPuller(BOUNDS), reservations, port=ex.port, path="/metrics")
            loop = SliceTelemetryLoop(NODE, stats, held, publish, interval_s=15.0, guest=source)
            metrics = AgentMetrics()
            metrics.registry.register(SliceMetricsCollector(loop, lambda: {lease.allocation_id for lease in leases}))
            for _ in range(2):
                assert await loop.round() == len(leases)
            scrape = metrics.render().decode()
            leases[:] = [_lease(GOOD)]  # every hostile allocation released
            await loop.round()
            remembered = set(source.puller.last_pull)
            leases[:] = []
            await loop.round()
            return scrape, remembered, set(source.puller.last_pull), dict(ex.served)
    scrape, remembered, after_release, served = run_bounded(body(), 90)
    rounds = [dict(published[i:i + 6]) for i in (0, 6)]
    for messages in rounds:
        good = messages[f"gpuaas.node.{NODE}.telemetry.{ALLOCS[GOOD]}"]
        assert [g.outcome for g in good.guest] == ["ok"] and len(good.guest[0].series) == 4
        assert good.guest_bounds == BOUNDS
        for ip in hostile:
            message = messages[f"gpuaas.node.{NODE}.telemetry.{ALLOCS[ip]}"]
            assert message.guest[0].outcome != "ok" and message.guest[0].series == []
        opted_out = messages[f"gpuaas.node.{NODE}.telemetry.{ALLOCS[WRONG_SLOT]}"]
        assert opted_out.guest == [] and opted_out.guest_bounds is None
    assert WRONG_SLOT not in served  # never asked
    assert 'gpuaas_agent_guest_telemetry_pulls_total{outcome="ok"} 2.0' in scrape
    assert 'gpuaas_agent_guest_telemetry_dropped_total{reason="label_collision"} 2.0' in scrape
    assert 'gpuaas_agent_slice_guest_series{outcome="ok",slot="0"} 4.0' in scrape
    assert "someone-else" not in scrape and "node_load1" not in scrape  # the guest's series are the tenant's only
    assert remembered == {(ALLOCS[GOOD], 0)} and after_release == set()
