"""Readiness waits: lease then SSH, each with a deadline, progress, cancellation and a typed timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpuaas_agent.contract.dhcp import LeaseState
from gpuaas_agent.host.network.dnsmasq import DnsmasqReservations, make_reservation
from gpuaas_agent.host.network.readiness import (
    ReadinessTimeout,
    stale_lease_expires,
    wait_for_guest,
    wait_for_lease,
    wait_for_ssh,
)
from tests.support.dnsmasq_fixture import DhcpLab, run_in_netns

ALLOC = "1111aaaa-2222-4333-8444-555555555555"
MAC = "52:54:00:12:34:56"
IP = "10.100.0.10"
CANCEL_WITHIN_S = 2.0


def _deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


class Recorder:
    """A progress callback that remembers events and lets a test await the first one."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.first = asyncio.Event()

    async def __call__(self, event: str, fields: dict) -> None:
        self.events.append((event, fields))
        self.first.set()


async def _cancel_promptly(task: asyncio.Task, started: asyncio.Event) -> float:
    await asyncio.wait_for(started.wait(), 10)
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, CANCEL_WITHIN_S)
    return time.monotonic() - t0


# -- lease -----------------------------------------------------------------------------------------------------


def test_the_lease_the_slots_last_guest_left_is_never_taken_for_the_new_one(tmp_path):
    """A slot keeps its MAC and IP from tenant to tenant and dnsmasq keeps a released guest's lease until it
    expires: only a lease written after the domain started (a later expiry) counts."""
    leases = tmp_path / "leases"
    old = int(time.time()) + 600
    leases.write_text(f"{old} {MAC} {IP} * *\n")
    stale = stale_lease_expires(leases, MAC, IP)
    assert stale == old

    async def stale_only():
        with pytest.raises(ReadinessTimeout) as exc:
            await wait_for_lease(leases, MAC, IP, deadline=_deadline(0.3), poll_s=0.05, stale_expires=stale)
        return exc.value

    err = asyncio.run(stale_only())
    assert err.code == "lease_timeout" and err.evidence["stale_expires"] == old
    assert "from before the domain started" in err.message

    async def renewed():
        rec = Recorder()
        waiter = asyncio.create_task(wait_for_lease(leases, MAC, IP, deadline=_deadline(30), poll_s=0.05,
                                                    progress=rec, stale_expires=stale))
        await asyncio.wait_for(rec.first.wait(), 10)  # it has read the stale lease ...
        assert rec.events[0][1]["stale_expires"] == old
        assert not waiter.done()  # ... and goes on waiting
        leases.write_text(f"{old + 5} {MAC} {IP} * *\n")  # the new guest's DHCP exchange
        return await asyncio.wait_for(waiter, 10)

    status = asyncio.run(renewed())
    assert status.lease_state is LeaseState.bound and status.expires == old + 5
    # Without a lease before the start (a fresh slot) any bound lease counts, as before.
    assert stale_lease_expires(tmp_path / "absent", MAC, IP) is None



def test_lease_wait_times_out_naming_the_last_state_seen(tmp_path):
    leases = tmp_path / "leases"
    leases.write_text(f"{int(time.time()) + 600} {MAC} 10.100.0.77 * *\n")

    async def main():
        rec = Recorder()
        with pytest.raises(ReadinessTimeout) as exc:
            await wait_for_lease(leases, MAC, IP, deadline=_deadline(0.3), progress=rec, poll_s=0.05)
        return exc.value, rec

    err, rec = asyncio.run(main())
    assert err.code == "lease_timeout"
    assert err.evidence["last_status"]["lease_state"] == "wrong_ip"
    assert err.evidence["last_status"]["actual_ip"] == "10.100.0.77"
    assert err.evidence["missing"] == f"bound lease of {IP} for {MAC}"
    assert 0.25 <= err.evidence["waited_s"] < 5
    # progress on change only: one observation, however many polls
    assert [e for e, _ in rec.events] == ["lease_wait"]


def test_lease_wait_with_no_lease_file_times_out_as_missing(tmp_path):
    async def main():
        with pytest.raises(ReadinessTimeout) as exc:
            await wait_for_lease(tmp_path / "absent", MAC, IP, deadline=_deadline(0.1), poll_s=0.05)
        return exc.value

    assert asyncio.run(main()).evidence["last_status"]["lease_state"] == "missing"


def test_lease_wait_is_cancelled_promptly(tmp_path):
    async def main():
        rec = Recorder()
        task = asyncio.create_task(wait_for_lease(tmp_path / "absent", MAC, IP, deadline=_deadline(600),
                                                  progress=rec, poll_s=30))
        return await _cancel_promptly(task, rec.first)

    assert asyncio.run(main()) < CANCEL_WITHIN_S


def _reserve_for_the_client(lab: DhcpLab) -> None:
    """The slice's reservation written, dnsmasq reloaded and rereading it, the client given the slice's MAC."""
    dns = lab.dnsmasq
    d = DnsmasqReservations(dns.hosts_file, dns.subnet, dns.gateway, dns.pid_file)
    d.add(make_reservation(ALLOC, 0, MAC, IP, "slice-a"))
    before = dns.reads()
    d.reload()
    dns.wait_reread(before)
    lab.set_client_mac(MAC)


def test_lease_wait_ends_when_real_dnsmasq_leases_the_reserved_ip(dhcp_lab: DhcpLab):
    lab, dns = dhcp_lab, dhcp_lab.dnsmasq
    _reserve_for_the_client(lab)

    async def main():
        rec = Recorder()
        waiter = asyncio.create_task(wait_for_lease(dns.lease_file, MAC, IP, deadline=_deadline(30), progress=rec,
                                                    poll_s=0.05))
        await asyncio.wait_for(rec.first.wait(), 10)  # the wait saw "missing" before the guest asked
        leased = await asyncio.to_thread(lab.lease)
        return leased, await waiter, rec

    leased, status, rec = asyncio.run(main())
    assert leased == IP
    assert status.lease_state == LeaseState.bound and str(status.actual_ip) == IP
    assert [f["status"]["lease_state"] for _, f in rec.events] == ["missing", "bound"]


# -- SSH -------------------------------------------------------------------------------------------------------


async def _server(payload: bytes | None):
    """A local TCP server that sends ``payload`` (or nothing, holding the connection open) to each client."""
    held: list[asyncio.StreamWriter] = []
    accepted = asyncio.Event()

    async def handle(reader, writer):
        accepted.set()
        if payload is not None:
            writer.write(payload)
            await writer.drain()
            writer.close()
        else:
            held.append(writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], held, accepted


def test_banner_after_other_lines_is_accepted():
    async def main():
        server, port, _, _ = await _server(b"welcome to the lab\r\nSSH-2.0-TestServer_1.0\r\n")
        async with server:
            return await wait_for_ssh("127.0.0.1", port, deadline=_deadline(10), poll_s=0.05)

    assert asyncio.run(main()) == "SSH-2.0-TestServer_1.0"


@pytest.mark.parametrize("payload,error", [(b"SSH-1.5-Ancient\r\n", "not SSH-2.0"),
                                           (b"HTTP/1.0 400 Bad Request\r\n", "connection closed before a banner"),
                                           (None, "connected, no banner")])
def test_a_port_that_is_not_ssh_2_times_out_with_what_it_said(payload, error):
    async def main():
        server, port, held, _ = await _server(payload)
        async with server:
            rec = Recorder()
            with pytest.raises(ReadinessTimeout) as exc:
                await wait_for_ssh("127.0.0.1", port, deadline=_deadline(0.6), progress=rec, poll_s=0.05,
                                   attempt_timeout_s=0.2)
            for w in held:
                w.close()
            return exc.value, rec

    err, rec = asyncio.run(main())
    assert err.code == "ssh_timeout"
    assert error in err.evidence["last_error"]
    assert err.evidence["attempts"] >= 2
    assert rec.events and rec.events[0][0] == "ssh_wait"


def test_ssh_wait_on_a_silent_connection_is_cancelled_promptly():
    async def main():
        server, port, held, accepted = await _server(None)
        async with server:
            task = asyncio.create_task(wait_for_ssh("127.0.0.1", port, deadline=_deadline(600),
                                                    attempt_timeout_s=300))
            # accepted: the wait is now blocked reading a banner that never comes
            took = await _cancel_promptly(task, accepted)
            for w in held:
                w.close()
            return took

    assert asyncio.run(main()) < CANCEL_WITHIN_S


def test_ssh_wait_on_a_closed_port_is_cancelled_promptly():
    async def main():
        server, port, _, _ = await _server(b"")
        server.close()
        await server.wait_closed()  # nothing listens on port now
        rec = Recorder()
        task = asyncio.create_task(wait_for_ssh("127.0.0.1", port, deadline=_deadline(600), progress=rec, poll_s=30))
        took = await _cancel_promptly(task, rec.first)
        return took, rec

    took, rec = asyncio.run(main())
    assert took < CANCEL_WITHIN_S
    assert "ConnectionRefusedError" in rec.events[0][1]["error"]


# -- the whole guest story with real dnsmasq and dropbear --------------------------------------------------------


def _guest_takes_its_lease(lab: DhcpLab) -> None:
    _reserve_for_the_client(lab)
    assert lab.lease() == IP
    lab.net.up(lab.client, lab.client_if, address=f"{IP}/24")  # what the guest's DHCP client does with it


def test_guest_is_ready_when_its_lease_is_bound_and_dropbear_answers(dhcp_lab: DhcpLab):
    _guest_takes_its_lease(dhcp_lab)
    dropbear = dhcp_lab.dropbear(IP)
    lease_file = dhcp_lab.dnsmasq.lease_file

    async def from_host():
        events: list[str] = []
        ready = await wait_for_guest(lease_file, MAC, IP, deadline=_deadline(30), poll_s=0.1,
                                     progress=lambda event, fields: events.append(event))
        return ready, events

    ready, events = run_in_netns(dhcp_lab.server, from_host)  # the agent's side of the bridge
    assert ready.ssh_banner.startswith("SSH-2.0-dropbear")
    assert ready.lease.lease_state == LeaseState.bound and str(ready.lease.actual_ip) == IP
    assert events[0] == "lease_wait"
    assert dropbear.poll() is None


def test_ssh_timeout_when_the_guest_address_answers_but_nothing_listens(dhcp_lab: DhcpLab):
    _guest_takes_its_lease(dhcp_lab)

    async def from_host():
        with pytest.raises(ReadinessTimeout) as exc:
            await wait_for_ssh(IP, 22, deadline=_deadline(1.0), poll_s=0.1)
        return exc.value

    err = run_in_netns(dhcp_lab.server, from_host)
    assert err.code == "ssh_timeout"
    assert "ConnectionRefusedError" in err.evidence["last_error"]
    assert err.evidence["missing"] == f"SSH-2.0- banner on {IP}:22"

