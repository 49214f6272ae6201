"""The terminal relay's refusals, flow control, timeouts and audit, against real pieces.

Real: ``nats-server`` (one per module), the SQLite store, libvirt's test driver holding the
slice's domain as provision defines it, the agent's dnsmasq hosts file with the slot's
reservation, the relay key made by ``deploy/relaykey.py``, and an SSH server (asyncssh) on
the slot's reserved address: the subnet is ``127.77.0.0/24``, so the guest address
``127.77.0.10`` is a loopback address of this machine. The SSH server runs a tiny shell
(``READY``, ``size``, ``flood N``, ``hold``, ``exit``, echo) so the tests can see what
reached the guest and make it print as fast as it can. The real guest (dropbear, a real
PTY, ``stty size``) is ``tests/e2e/test_lab_terminal.py``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import signal
import time
import urllib.request
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import asyncssh
import libvirt
import nats
import pytest

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import SliceConfig, TerminalConfig
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.domain import DomainSpec, OvmfFirmware
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.slots import HealthState, SlotStatus
from gpuaas_agent.contract.state import SlotLease, SlotRecord
from gpuaas_agent.contract.tasks import TaskEnvelope, task_payload
from gpuaas_agent.control.taskpolicy import TaskRun
from gpuaas_agent.deploy import relaykey
from gpuaas_agent.errors import AgentError, ContractError
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.network.dnsmasq import make_reservation
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from gpuaas_agent.tasks.terminal import relay_of, terminal_handler
from tests.support.nats_server import NatsServer, free_port, nats_server_binary
from tests.support.terminal_gateway import Gateway as _Gateway

URI = "test:///default"
SUBNET, GATEWAY, GUEST_IP = "127.77.0.0/24", "127.77.0.1", "127.77.0.10"
ALLOC = "3f1d2c4b-5a69-4788-9abc-def012345678"
NODE = "node-term"
USER = "tenant"
FIRMWARE = OvmfFirmware(code_path="/usr/share/OVMF/OVMF_CODE_4M.fd",
                        vars_template_path="/usr/share/OVMF/OVMF_VARS_4M.fd")
DEADLINE_S = 60.0  # a failure bound for every wait below, never a timer


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    binary = nats_server_binary("the terminal relay tests need a real server")
    d = tmp_path_factory.mktemp("nats")
    server = NatsServer(binary, d / "store", d / "nats.log")
    (d / "store").mkdir()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def relay_key(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("relaykey")
    d.chmod(0o700)
    public = d / "id_ed25519.pub"
    asyncio.run(relaykey.ensure(public))
    return public


@pytest.fixture(scope="module")
def slice_domain():
    """The slice's domain in libvirt's test driver (running), as provision defines it; held for the module."""
    conn = libvirt.open(URI)
    spec = DomainSpec(allocation_id=ALLOC, slot_index=0, task_id="t-provision",
                      profile=get_profile("lab_tcg_1c_512m"), nvme_device="/dev/disk/by-id/nvme-eui.term0",
                      mac="02:00:00:77:00:10", ovs_bridge="br-term", seed_iso_path="/tmp/term-seed.iso",
                      firmware=FIRMWARE, agent_version="0.1.0")

    async def define():
        lifecycle = LibvirtLifecycle(URI)
        try:
            await lifecycle.define(spec)
        finally:
            await lifecycle.close()

    asyncio.run(define())
    conn.lookupByName(spec.domain_name).create()
    yield spec
    dom = conn.lookupByName(spec.domain_name)
    if dom.isActive():
        dom.destroy()
    dom.undefine()
    conn.close()


# -- the "guest": an SSH server on the reserved address ---------------------------------------------


@dataclass
class Guest:
    port: int
    host_key: asyncssh.SSHKey
    connections: int = 0
    shells: int = 0
    flood_written: int = 0
    sizes: list = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)
    release_hold: asyncio.Event = field(default_factory=asyncio.Event)
    holding: asyncio.Event = field(default_factory=asyncio.Event)  # the shell stopped reading ("hold")
    auth_gate: asyncio.Event | None = None  # set: the SSH handshake waits for it in the key check
    authenticating: asyncio.Event = field(default_factory=asyncio.Event)


async def _shell(guest: Guest, process: asyncssh.SSHServerProcess) -> None:
    out = process.stdout
    guest.shells += 1
    out.write(b"READY\n")
    try:
        while True:
            try:
                line = await process.stdin.readline()
            except asyncssh.TerminalSizeChanged:
                continue
            if not line:
                break
            guest.received.extend(line)
            cmd = line.strip()
            if cmd == b"size":
                cols, rows, _, _ = process.get_terminal_size()
                guest.sizes.append((rows, cols))
                out.write(f"SIZE {rows} {cols}\n".encode())
            elif cmd.startswith(b"flood "):
                left = int(cmd.split()[1])
                while left:
                    chunk = min(4096, left)
                    out.write(b"x" * chunk)
                    await out.drain()  # blocks when the relay stops reading: the guest feels the back-pressure
                    guest.flood_written += chunk
                    left -= chunk
                out.write(b"FLOOD-DONE\n")
            elif cmd == b"hold":
                guest.holding.set()
                await guest.release_hold.wait()  # stop reading stdin until released
            elif cmd == b"exit":
                process.exit(3)
                return
            else:
                out.write(b"ECHO " + cmd + b"\n")
            await out.drain()
    except (asyncssh.BreakReceived, BrokenPipeError, ConnectionError):
        pass
    process.exit(0)


@asynccontextmanager
async def guest_server(relay_public: Path, *, port: int | None = None, host_key: asyncssh.SSHKey | None = None,
                       window: int = 2 << 20, auth_gate: asyncio.Event | None = None):
    guest = Guest(port=port or free_port(), host_key=host_key or asyncssh.generate_private_key("ssh-ed25519"),
                  auth_gate=auth_gate)
    authorized = asyncssh.import_authorized_keys(relay_public.read_text())

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn):
            guest.connections += 1

        def begin_auth(self, username):
            return True

        def public_key_auth_supported(self):
            return True

        async def validate_public_key(self, username, key):
            guest.authenticating.set()
            if guest.auth_gate is not None:
                await guest.auth_gate.wait()  # a guest slow to answer: the relay is still connecting
            return username == USER and authorized.validate(key, "127.0.0.1", "127.0.0.1") is not None

    server = await asyncssh.listen(GUEST_IP, guest.port, server_factory=Server, server_host_keys=[guest.host_key],
                                   process_factory=lambda p: _shell(guest, p), encoding=None, line_editor=False,
                                   window=window, config=None)
    try:
        yield guest
    finally:
        server.close()
        await server.wait_closed()


# -- the agent's side ----------------------------------------------------------------------------------


def make_slice_host(tmp: Path, relay_public: Path, port: int, **terminal) -> SliceDrivers:
    cfg = SliceConfig(subnet=SUBNET, gateway=GATEWAY, dnsmasq_hosts_file=tmp / "dnsmasq-hosts",
                      dnsmasq_pid_file=tmp / "dnsmasq.pid", terminal_relay_key_file=relay_public,
                      terminal=TerminalConfig(ssh_port=port, **terminal))
    sh = SliceDrivers(host_root=tmp, slice=cfg, images=ImageCache(tmp / "cache"), libvirt=LibvirtLifecycle(URI))
    if not cfg.dnsmasq_hosts_file.exists():
        sh.reservations().add(make_reservation(ALLOC, 0, "02:00:00:77:00:10", GUEST_IP, "slice-0"))
    return sh


def active_store(path: Path, status: SlotStatus = SlotStatus.active) -> StateStore:
    store = StateStore.open(path)
    store.take_lease(SlotLease(allocation_id=ALLOC, slot_index=0, gpu_pci_address="0000:18:00.0",
                               nvme_device="/dev/disk/by-id/nvme-eui.term0", disk_identity="eui:term0",
                               fabric_vf_pci_address="0000:19:00.1", task_id="t-provision", taken_at=time.time()))
    store.set_slot_state(SlotRecord(slot_index=0, allocation_id=ALLOC, status=status, health_state=HealthState.healthy,
                                    detail={}, task_id="t-provision", updated_at=time.time()))
    return store


@dataclass
class Agent:
    sh: SliceDrivers
    store: StateStore
    nc: nats.aio.client.Client

    async def task(self, task_type: str, payload: dict) -> dict:
        """Validate the payload as the worker does, then run the registry's handler."""
        envelope = TaskEnvelope(task_id=f"t-{uuid.uuid4().hex[:8]}", type=task_type, node_id=NODE, attempt=1,
                                deadline=datetime.now(UTC) + timedelta(minutes=5), payload=payload)
        _, model = task_payload(envelope)
        ctx = TaskRun(envelope=envelope, node_id=NODE, store=self.store, resumed_steps=[], _nc=self.nc)
        operation = task_type.rsplit("_", 1)[1]
        return await terminal_handler(self.sh, operation)(model, ctx)


@asynccontextmanager
async def agent(tmp: Path, nats_url: str, relay_public: Path, port: int, *, store: StateStore | None = None,
                **terminal):
    sh = make_slice_host(tmp, relay_public, port, **terminal)
    store = store or active_store(tmp / "state.db")
    nc = await nats.connect(nats_url, connect_timeout=5)
    try:
        yield Agent(sh=sh, store=store, nc=nc)
    finally:
        await sh.close()
        await nc.close()
        store.close()


def gateway(nc, session_id: str, *, auto_ack: bool = True) -> _Gateway:
    return _Gateway(nc, session_id, node=NODE, auto_ack=auto_ack)


def open_payload(session_id: str | None = None, **over) -> dict:
    return {"session_id": session_id or str(uuid.uuid4()), "allocation_id": ALLOC, "slot_index": 0, "user": USER,
            "requested_by": "alice@example.com", "cols": 80, "rows": 24, **over}


async def opened_session(a: Agent) -> tuple[str, _Gateway]:
    """A new session opened through ``a`` with a gateway attached, once the guest's shell said READY."""
    sid = str(uuid.uuid4())
    gw = await gateway(a.nc, sid).start()
    await a.task("slice.terminal_open", open_payload(sid))
    await gw.wait_for_output(b"READY\n")
    return sid, gw


async def refused(a: Agent, task_type: str, payload: dict) -> AgentError:
    with pytest.raises(AgentError) as caught:
        await a.task(task_type, payload)
    return caught.value


# -- tests -------------------------------------------------------------------------------------------


def test_a_session_relays_both_ways_resizes_and_its_close_is_audited(tmp_path, nats_url, relay_key, slice_domain,
                                                                    caplog):
    caplog.set_level(logging.INFO, logger="gpuaas_agent.tasks.terminal")

    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port) as a:
            sid = str(uuid.uuid4())
            gw = await gateway(a.nc, sid).start()
            opened = await a.task("slice.terminal_open", open_payload(sid, target_host=GUEST_IP))
            assert (opened["target_host"], opened["target_port"]) == (GUEST_IP, guest.port)
            assert opened["host_key_pinned"] == "first_use"
            assert opened["host_key_fingerprint"] == guest.host_key.get_fingerprint("sha256")
            assert opened["subject_out"] == subjects.terminal_out(NODE, sid)
            await gw.wait_for_output(b"READY\n")
            await gw.send(b"size\n")
            await gw.wait_for_output(b"SIZE 24 80")
            resized = await a.task("slice.terminal_resize",
                                   {"session_id": sid, "allocation_id": ALLOC, "cols": 132, "rows": 40})
            assert resized == {"session_id": sid, "cols": 132, "rows": 40}
            await gw.send(b"size\n")
            await gw.wait_for_output(b"SIZE 40 132")
            data = await a.task("slice.terminal_data", {"session_id": sid, "allocation_id": ALLOC,
                                                        "data": base64.b64encode(b"hello\n").decode()})
            assert data["bytes_written"] == 6
            await gw.wait_for_output(b"ECHO hello")
            # Input frames are acknowledged once written (ack_in counts .in data only).
            await gw.wait(lambda g: g.frames[-1].ack_in == len(b"size\nsize\n"))

            audit = await a.task("slice.terminal_close", {"session_id": sid, "allocation_id": ALLOC})
            final = await gw.wait_closed()
            assert final.closed.reason.value == "client_closed"
            assert audit["close_reason"] == "client_closed" and audit["closed_at"] >= audit["opened_at"]
            assert (audit["requested_by"], audit["user"], audit["target_host"]) == ("alice@example.com", USER, GUEST_IP)
            assert audit["bytes_in"] == len(b"size\nsize\nhello\n") == final.closed.totals.bytes_in
            assert audit["bytes_out"] == len(gw.output) == final.closed.totals.bytes_out > 0
            assert a.store.terminal_session(sid).close_reason.value == "client_closed"
            # Closing again answers the same record; the session's tasks now say it is closed.
            again = await a.task("slice.terminal_close", {"session_id": sid, "allocation_id": ALLOC})
            assert again == audit
            gone = await refused(a, "slice.terminal_resize",
                                 {"session_id": sid, "allocation_id": ALLOC, "cols": 10, "rows": 10})
            assert gone.code == "session_closed"
            # The guest got exactly what the gateway sent, in order.
            assert bytes(guest.received) == b"size\nsize\nhello\n"
            return sid, audit

    sid, audit = asyncio.run(scenario())
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpuaas_agent.tasks.terminal"]
    opened = next(e for e in events if e["event"] == "terminal_opened")
    closed = next(e for e in events if e["event"] == "terminal_closed")
    assert (opened["session_id"], opened["requested_by"], opened["host_key_pinned"]) == (
        sid, "alice@example.com", "first_use")
    assert (closed["session_id"], closed["reason"], closed["bytes_in"], closed["bytes_out"]) == (
        sid, "client_closed", audit["bytes_in"], audit["bytes_out"])


def test_refusals_open_no_connection(tmp_path, nats_url, relay_key, slice_domain):
    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                           max_sessions_per_slice=2) as a:
            other = str(uuid.uuid4())
            cases = [
                ({"allocation_id": other}, "not_this_allocation"),
                ({"target_host": "127.77.0.11"}, "target_not_slice_ip"),
                ({"target_host": "10.0.0.1"}, "target_not_slice_ip"),
                ({"target_host": GATEWAY}, "target_not_slice_ip"),
                ({"target_port": 2222 if guest.port != 2222 else 2223}, "target_port_refused"),
            ]
            for over, code in cases:
                error = await refused(a, "slice.terminal_open", open_payload(**over))
                assert error.code == code, (over, error)
            error = await refused(a, "slice.terminal_open", open_payload(target_host="127.77.0.99"))
            assert error.evidence == {"target_host": "127.77.0.99", "reserved_ip": GUEST_IP, "slot_index": 0}
            # Shell injection and option injection never get past the contract (invalid_payload, field user).
            for user in ("root; rm -rf /", "$(id)", "-oProxyCommand=nc evil 22", "root", "a b", "`id`", "u\nv",
                         "x" * 40, "Tenant"):
                error = await refused(a, "slice.terminal_open", open_payload(user=user))
                assert isinstance(error, ContractError) and error.code == "invalid_payload", user
                assert error.evidence["field"] == "user"
            for bad in ({"target_host": "127.77.0.10; id"}, {"session_id": "../../x"}, {"term": "xterm;id"},
                        {"requested_by": "a b"}, {"capacity_shape": "baremetal"}, {"cols": "80"}, {"extra": 1}):
                error = await refused(a, "slice.terminal_open", open_payload(**bad))
                assert error.code == "invalid_payload", bad
            assert guest.connections == 0, "a refusal never opens a connection"

            # At most K per slice; a session id once.
            first = await a.task("slice.terminal_open", open_payload())
            await a.task("slice.terminal_open", open_payload())
            error = await refused(a, "slice.terminal_open", open_payload())
            assert error.code == "too_many_sessions" and error.evidence["max_sessions_per_slice"] == 2
            error = await refused(a, "slice.terminal_open", open_payload(first["session_id"]))
            assert error.code == "session_exists"
            assert guest.connections == 2
            # Another allocation cannot reach the session by its id.
            error = await refused(a, "slice.terminal_data", {"session_id": first["session_id"], "allocation_id": other,
                                                             "data": "aGk="})
            assert error.code == "session_not_found"
            error = await refused(a, "slice.terminal_close", {"session_id": first["session_id"], "allocation_id": other})
            assert error.code == "session_not_found"
            big = base64.b64encode(b"z" * (a.sh.slice.terminal.max_frame_bytes + 1)).decode()
            error = await refused(a, "slice.terminal_data", {"session_id": first["session_id"], "allocation_id": ALLOC,
                                                             "data": big})
            assert error.code == "terminal_data_too_large"
            assert first["session_id"] in relay_of(a.sh).sessions

        # A stopped slice, and a node at its session limit.
        conn = libvirt.open(URI)
        try:
            conn.lookupByName(slice_domain.domain_name).destroy()
            async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                               store=active_store(tmp_path / "stopped.db")) as a:
                error = await refused(a, "slice.terminal_open", open_payload())
                assert (error.code, error.evidence["state"]) == ("slice_not_running", "shutoff")
                assert guest.connections == 0
        finally:
            conn.lookupByName(slice_domain.domain_name).create()
            conn.close()
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port, max_sessions=1,
                                                           store=active_store(tmp_path / "full.db")) as a:
            await a.task("slice.terminal_open", open_payload())
            error = await refused(a, "slice.terminal_open", open_payload())
            assert error.code == "terminal_capacity" and error.evidence == {"sessions": 1, "max_sessions": 1}

        # A slot in cleanup_blocked, and a slot this host does not hold for the allocation.
        for status, code in ((SlotStatus.cleanup_blocked, "slot_cleanup_blocked"),
                             (SlotStatus.releasing, "slot_not_active")):
            store = active_store(tmp_path / f"{status.value}.db", status)
            async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                               store=store) as a:
                error = await refused(a, "slice.terminal_open", open_payload())
                assert error.code == code
                assert guest.connections == 0
                assert a.store.terminal_sessions() == []

    asyncio.run(scenario())


def test_a_changed_host_key_is_refused_naming_both_fingerprints(tmp_path, nats_url, relay_key, slice_domain):
    async def scenario():
        async with agent(tmp_path, nats_url, relay_key, free_port()) as a:
            port = a.sh.slice.terminal.ssh_port
            async with guest_server(relay_key, port=port) as first:
                opened = await a.task("slice.terminal_open", open_payload())
                assert opened["host_key_pinned"] == "first_use"
                await a.task("slice.terminal_close", {"session_id": opened["session_id"], "allocation_id": ALLOC})
            async with guest_server(relay_key, port=port, host_key=first.host_key):
                again = await a.task("slice.terminal_open", open_payload())
                assert again["host_key_pinned"] == "matched"
                await a.task("slice.terminal_close", {"session_id": again["session_id"], "allocation_id": ALLOC})
            async with guest_server(relay_key, port=port) as impostor:
                error = await refused(a, "slice.terminal_open", open_payload())
                assert error.code == "host_key_changed"
                assert error.evidence["pinned_fingerprint"] == first.host_key.get_fingerprint("sha256")
                assert error.evidence["offered_fingerprint"] == impostor.host_key.get_fingerprint("sha256")
                assert len(a.store.terminal_sessions()) == 2  # the refused one was never opened

    asyncio.run(scenario())


def test_output_waits_for_the_gateways_credit_and_the_guest_blocks(tmp_path, nats_url, relay_key, slice_domain):
    window, frame, ssh_window, flood = 16 << 10, 4 << 10, 16 << 10, 1 << 20

    async def scenario():
        async with guest_server(relay_key) as guest, agent(
                tmp_path, nats_url, relay_key, guest.port, output_window_bytes=window, max_frame_bytes=frame,
                input_window_bytes=frame, ssh_window_bytes=ssh_window) as a:
            sid = str(uuid.uuid4())
            gw = await gateway(a.nc, sid, auto_ack=False).start()
            await a.task("slice.terminal_open", open_payload(sid))
            await gw.wait_for_output(b"READY\n")
            await gw.send(b"flood %d\n" % flood)
            # Without acknowledgements the agent publishes exactly one window, in frames of at most max_frame_bytes.
            await gw.wait(lambda g: len(g.output) >= window)
            session = relay_of(a.sh).sessions[sid].session
            # Round trips through the agent (not a timer) before looking again, and the gateway caught up.
            for _ in range(2):
                await a.task("slice.terminal_resize", {"session_id": sid, "allocation_id": ALLOC, "cols": 100,
                                                       "rows": 30})
                await gw.wait(lambda g: len(g.output) == session.counters.out_sent)
            # (the gateway acknowledged READY with its flood command: one window beyond that)
            assert session.counters.out_sent - session.counters.out_acked == window
            assert len(gw.output) == session.counters.out_sent == len(b"READY\n") + window
            assert max(len(f.raw) for f in gw.frames) <= frame
            # The guest is blocked in its own write: what it wrote is bounded by the credit, the relay's SSH
            # window and its own SSH server's send buffer (asyncssh's 64 KiB high-water mark), not by the
            # megabyte it wants to write.
            assert guest.flood_written <= window + ssh_window + (64 << 10) + 2 * 4096, guest.flood_written
            # Credit comes back: the rest arrives, every byte in order.
            gw.auto_ack = True
            await gw.send(b"")
            await gw.wait_for_output(b"FLOOD-DONE\n", timeout=120)
            assert gw.output.count(b"x") == flood
            sent = 0
            for f in gw.frames:  # never more than a window outstanding against what the gateway had acked
                sent += len(f.raw)
            assert sent == len(gw.output)
            await a.task("slice.terminal_close", {"session_id": sid, "allocation_id": ALLOC})
            assert a.store.terminal_session(sid).bytes_out == len(gw.output)

    asyncio.run(scenario())


def test_a_gateway_ignoring_the_input_window_is_closed(tmp_path, nats_url, relay_key, slice_domain):
    async def scenario():
        # The guest stops reading its stdin ("hold") and its SSH window is small: input piles up unacknowledged.
        async with guest_server(relay_key, window=4096) as guest, agent(
                tmp_path, nats_url, relay_key, guest.port, input_window_bytes=8192, max_frame_bytes=4096) as a:
            sid, gw = await opened_session(a)
            await gw.send(b"hold\n")
            for _ in range(64):  # 256 KiB without waiting for ack_in: far beyond the 8 KiB window
                await gw.send(b"y" * 4096)
            final = await gw.wait_closed()
            assert final.closed.reason.value == "input_window_exceeded", final.closed
            guest.release_hold.set()
            row = await _audit_closed(a, sid)
            assert row.close_reason.value == "input_window_exceeded"
            assert row.bytes_in <= 8192 + 4096 + len(b"hold\n")  # what reached the guest stayed bounded too

    asyncio.run(scenario())


def test_out_of_order_or_malformed_input_closes_the_session(tmp_path, nats_url, relay_key, slice_domain):
    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port) as a:
            cases = [
                (lambda gw: gw.send(b"a\n", seq=2), "input_out_of_order"),  # frame 1 lost (or injected later)
                (lambda gw: gw.send(b"", ack_out=10 ** 9), "protocol_error"),  # acks bytes never sent
                (lambda gw: gw.nc.publish(subjects.terminal_in(NODE, gw.session_id), b'{"seq": 1}'), "protocol_error"),
            ]
            for act, reason in cases:
                sid = str(uuid.uuid4())
                gw = await gateway(a.nc, sid, auto_ack=False).start()
                await a.task("slice.terminal_open", open_payload(sid))
                await gw.wait_for_output(b"READY\n")
                await act(gw)
                final = await gw.wait_closed(timeout=20)
                assert final.closed.reason.value == reason, final.closed
                assert (await _audit_closed(a, sid)).close_reason.value == reason
            assert guest.received == b""  # nothing of a bad stream reached the guest

    asyncio.run(scenario())


def test_idle_exit_and_a_released_slot_end_sessions_with_their_reason(tmp_path, nats_url, relay_key, slice_domain):
    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                           idle_timeout_s=1.0, recheck_interval_s=0.2) as a:
            # The shell exits: remote_closed with its exit status.
            sid, gw = await opened_session(a)
            await gw.send(b"exit\n")
            final = await gw.wait_closed()
            assert (final.closed.reason.value, final.closed.exit_status) == ("remote_closed", 3)

            # No byte either way: idle_timeout (acks alone are not activity).
            sid = str(uuid.uuid4())
            gw = await gateway(a.nc, sid).start()
            await a.task("slice.terminal_open", open_payload(sid))
            final = await gw.wait_closed()
            assert final.closed.reason.value == "idle_timeout"

            # The slot leaves active for the allocation (a release began): allocation_inactive.
            sid, gw = await opened_session(a)
            record = a.store.slot_state(0)
            a.store.set_slot_state(record.model_copy(update={"status": SlotStatus.releasing}))
            final = await gw.wait_closed()
            assert final.closed.reason.value == "allocation_inactive"
            assert "slot_not_active" in final.closed.detail
            reasons = [r.close_reason.value for r in a.store.terminal_sessions()]
            assert reasons == ["remote_closed", "idle_timeout", "allocation_inactive"]

        # However busy, a session ends at max_session_s.
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                           store=active_store(tmp_path / "absolute.db"),
                                                           max_session_s=1.0, idle_timeout_s=60.0) as a:
            sid = str(uuid.uuid4())
            gw = gateway(a.nc, sid)
            await gw.start()
            await a.task("slice.terminal_open", open_payload(sid))
            await gw.send(b"flood 100000000\n")  # the guest prints without pause: never idle
            final = await gw.wait_closed()
            assert final.closed.reason.value == "absolute_timeout"
            assert final.closed.totals.bytes_out > 0

    asyncio.run(scenario())


def test_sessions_left_open_by_a_dead_agent_are_closed_as_agent_restarted(tmp_path, nats_url, relay_key,
                                                                          slice_domain):
    async def scenario():
        async with guest_server(relay_key) as guest:
            async with agent(tmp_path, nats_url, relay_key, guest.port) as a:
                opened = await a.task("slice.terminal_open", open_payload())
                relay_of(a.sh).sessions.clear()  # the agent "dies": nothing in memory closes it
                orphan = opened["session_id"]
                assert a.store.terminal_session(orphan).closed_at is None
            store = StateStore.open(tmp_path / "state.db")
            gateway_nc = await nats.connect(nats_url, connect_timeout=5)
            async with agent(tmp_path, nats_url, relay_key, guest.port, store=store) as b:
                live = str(uuid.uuid4())
                gw = await gateway(gateway_nc, live).start()
                await b.task("slice.terminal_open", open_payload(live))
                row = b.store.terminal_session(orphan)
                assert row.close_reason.value == "agent_restarted" and row.closed_at is not None
            # A clean shutdown (SliceDrivers.close) ends the live session: the gateway is told, the store says why.
            final = await gw.wait_closed()
            await gateway_nc.close()
            assert final.closed.reason.value == "agent_shutdown"
            store = StateStore.open(tmp_path / "state.db")
            try:
                assert store.terminal_session(live).close_reason.value == "agent_shutdown"
            finally:
                store.close()

    asyncio.run(scenario())


async def _audit_closed(a: Agent, sid: str):
    """The audit row once the close callback wrote it (it runs right after the last frame)."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while (row := a.store.terminal_session(sid)) is None or row.closed_at is None:
        assert asyncio.get_running_loop().time() < deadline, f"session {sid} never closed in the store"
        await asyncio.sleep(0.02)  # poll step of a deadline wait
    return row


def test_a_release_closes_the_slots_sessions_at_once_and_no_others(tmp_path, nats_url, relay_key, slice_domain):
    """Release's shutdown step ends the slot's terminals itself; it does not wait for the periodic recheck."""
    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                           recheck_interval_s=3600.0) as a:
            sid, gw = await opened_session(a)
            assert await a.sh.close_slot_terminals("another-allocation", 0) == 0
            assert await a.sh.close_slot_terminals(ALLOC, 1) == 0
            assert a.store.terminal_session(sid).closed_at is None
            assert await a.sh.close_slot_terminals(ALLOC, 0) == 1
            final = await gw.wait_closed()
            assert final.closed.reason.value == "allocation_inactive"
            assert (await _audit_closed(a, sid)).close_reason.value == "allocation_inactive"

    asyncio.run(scenario())


# -- fairness and a closed lifecycle: input bounded in bytes and time, open ordered with release, no leaks ------


async def _until(condition, what: str) -> None:
    """Wait for ``condition()``; the deadline is a failure bound, never a timer."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)  # poll step of a deadline wait


def _data(sid: str, raw: bytes) -> dict:
    return {"session_id": sid, "allocation_id": ALLOC, "data": base64.b64encode(raw).decode()}


def _line(i: int, size: int) -> bytes:
    return (b"%06d" % i).ljust(size - 1, b"f") + b"\n"


async def _block_input(a: Agent, sid: str, frame: int) -> tuple[list[bytes], bytes, asyncio.Task]:
    """Data tasks of one ``frame`` each until one waits on a guest that stopped reading; returns what was
    taken, the blocked task's bytes and the blocked task."""
    session = relay_of(a.sh).sessions[sid].session
    taken: list[bytes] = []
    for i in range(1000):
        raw = _line(i, frame)
        task = asyncio.create_task(a.task("slice.terminal_data", _data(sid, raw)))
        await _until(lambda task=task: task.done() or session.input_blocked, "the data task is written or blocked")
        if not task.done():
            return taken, raw, task
        assert task.result()["bytes_written"] == len(raw)
        taken.append(raw)
    raise AssertionError("the guest never stopped taking input")


def test_a_cancelled_data_task_is_never_typed_and_queued_input_is_bounded_in_bytes(tmp_path, nats_url, relay_key,
                                                                                slice_domain):
    """A guest that stops reading: data tasks queue up to max_pending_input_bytes, one more is refused at once;
    the queued tasks cancelled at their deadline leave nothing behind, and once the guest reads again it gets
    exactly the bytes of the tasks that succeeded."""
    frame = 4096

    async def scenario():
        async with guest_server(relay_key, window=4096) as guest, agent(
                tmp_path, nats_url, relay_key, guest.port, max_frame_bytes=frame, input_window_bytes=2 * frame,
                max_pending_input_bytes=2 * frame, input_wait_s=600.0) as a:
            sid, gw = await opened_session(a)
            await a.task("slice.terminal_data", _data(sid, b"hold\n"))
            await _until(guest.holding.is_set, "the guest stops reading")
            taken, blocked_raw, blocked = await _block_input(a, sid, frame)
            session = relay_of(a.sh).sessions[sid].session
            queued_raw = b"QUEUED-NEVER-TYPED\n"
            queued = asyncio.create_task(a.task("slice.terminal_data", _data(sid, queued_raw)))
            await _until(lambda: session.pending_input_bytes == len(blocked_raw) + len(queued_raw), "both queued")
            full = await refused(a, "slice.terminal_data", _data(sid, b"z" * frame))
            assert full.code == "terminal_input_full"
            assert full.evidence["pending_bytes"] == len(blocked_raw) + len(queued_raw)
            assert full.evidence["max_pending_input_bytes"] == 2 * frame
            for task in (blocked, queued):  # the worker cancels a task at its deadline
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert session.pending_input_bytes == 0
            guest.release_hold.set()
            done = await a.task("slice.terminal_data", _data(sid, b"after\n"))
            assert done["bytes_written"] == len(b"after\n")
            await gw.wait_for_output(b"ECHO after\n", timeout=120)
            assert bytes(guest.received) == b"hold\n" + b"".join(taken) + b"after\n"
            assert blocked_raw not in guest.received and b"QUEUED" not in guest.received

    asyncio.run(scenario())


def test_a_guest_that_never_reads_fails_a_data_task_fast_and_drops_its_bytes(tmp_path, nats_url, relay_key,
                                                                          slice_domain):
    frame = 4096

    async def scenario():
        async with guest_server(relay_key, window=4096) as guest, agent(
                tmp_path, nats_url, relay_key, guest.port, max_frame_bytes=frame, input_wait_s=0.5) as a:
            sid, gw = await opened_session(a)
            await a.task("slice.terminal_data", _data(sid, b"hold\n"))
            await _until(guest.holding.is_set, "the guest stops reading")
            taken, blocked_raw, blocked = await _block_input(a, sid, frame)
            with pytest.raises(AgentError) as stalled:
                await blocked  # bounded by input_wait_s, not by the session's 900 s idle timeout
            assert stalled.value.code == "terminal_input_stalled" and stalled.value.evidence["input_wait_s"] == 0.5
            session = relay_of(a.sh).sessions[sid].session
            assert session.pending_input_bytes == 0 and sid in relay_of(a.sh).sessions  # the session lives on
            guest.release_hold.set()
            await a.task("slice.terminal_data", _data(sid, b"after\n"))
            await gw.wait_for_output(b"ECHO after\n", timeout=120)
            assert bytes(guest.received) == b"hold\n" + b"".join(taken) + b"after\n"

    asyncio.run(scenario())


def test_a_release_closes_a_session_still_connecting_and_open_waits_for_the_release(tmp_path, nats_url, relay_key,
                                                                                  slice_domain):
    async def scenario():
        gate = asyncio.Event()
        async with guest_server(relay_key, auth_gate=gate) as guest, agent(tmp_path, nats_url, relay_key,
                                                                           guest.port) as a:
            relay = relay_of(a.sh)
            # (1) The release's shutdown step runs while the open is still connecting: the session is closed too.
            sid = str(uuid.uuid4())
            opening = asyncio.create_task(a.task("slice.terminal_open", open_payload(sid)))
            await _until(guest.authenticating.is_set, "the relay is connecting")
            assert sid in relay._opening
            async with a.sh.slot_lock(0):  # as release.py holds it
                assert await a.sh.close_slot_terminals(ALLOC, 0) == 1
                gate.set()  # the guest answers now; the open must not register into the slot being released
            with pytest.raises(AgentError) as closed:
                await opening
            assert closed.value.code == "session_closed"
            assert relay.sessions == {} and relay._opening == {} and a.store.terminal_session(sid) is None

            # (2) A release that took the slot while the open connected: the open waits for it, then is refused.
            gate.clear()
            guest.authenticating.clear()
            shells = guest.shells
            sid = str(uuid.uuid4())
            opening = asyncio.create_task(a.task("slice.terminal_open", open_payload(sid)))
            await _until(guest.authenticating.is_set, "the relay is connecting")
            async with a.sh.slot_lock(0):
                record = a.store.slot_state(0)
                a.store.set_slot_state(record.model_copy(update={"status": SlotStatus.releasing}))
                gate.set()
                await _until(lambda: guest.shells == shells + 1, "the relay's PTY is up; the open now waits for the lock")
            with pytest.raises(AgentError) as refused_open:
                await opening
            assert refused_open.value.code == "slot_not_active"
            assert relay.sessions == {} and relay._opening == {} and a.store.terminal_session(sid) is None

    asyncio.run(scenario())


def test_an_open_waits_for_a_busy_slot_only_so_long(tmp_path, nats_url, relay_key, slice_domain):
    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                           connect_timeout_s=0.3) as a:
            async with a.sh.slot_lock(0):  # a power operation or a release holds the slot
                error = await refused(a, "slice.terminal_open", open_payload())
            assert error.code == "terminal_slot_busy" and error.evidence["waited_s"] == 0.3
            assert guest.connections == 0 and relay_of(a.sh)._opening == {}
            assert not a.sh.slot_lock(0).locked()
            opened = await a.task("slice.terminal_open", open_payload())  # the slot free again: it opens
            assert opened["session_id"] in relay_of(a.sh).sessions

    asyncio.run(scenario())


def _subscriptions(server: NatsServer) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/connz?subs=1", timeout=10) as reply:
        return [sub for conn in json.load(reply)["connections"] for sub in conn.get("subscriptions_list", [])]


def test_an_open_cancelled_while_its_session_subscribes_leaves_nothing_registered(tmp_path, relay_key, slice_domain):
    """The task's deadline cancels the open inside session.start(): the session is closed and audited, its place
    freed (the node's one session slot opens again) and its subscription gone."""
    server = NatsServer(nats_server_binary("the relay restart test needs a real server"), tmp_path / "nats-store",
                        tmp_path / "nats.log")
    (tmp_path / "nats-store").mkdir()
    server.start()

    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, server.url, relay_key, guest.port,
                                                           max_sessions=1) as a:
            relay = relay_of(a.sh)
            sid = str(uuid.uuid4())
            server.proc.send_signal(signal.SIGSTOP)  # the server stops answering: start() waits in its flush
            try:
                opening = asyncio.create_task(a.task("slice.terminal_open", open_payload(sid)))
                await _until(lambda: sid in relay.sessions, "the open registered its session and starts it")
                opening.cancel()
            finally:
                server.proc.send_signal(signal.SIGCONT)
            with pytest.raises(asyncio.CancelledError):
                await opening
            await _until(lambda: sid not in relay.sessions, "the session is unregistered")
            assert relay._opening == {}
            row = await _audit_closed(a, sid)
            assert row.close_reason.value == "connection_lost" and "cancelled" in row.close_detail
            subject = subjects.terminal_in(NODE, sid)
            deadline = asyncio.get_running_loop().time() + DEADLINE_S
            while subject in await asyncio.to_thread(_subscriptions, server):
                assert asyncio.get_running_loop().time() < deadline, "the session's subscription was left behind"
                await asyncio.sleep(0.05)  # poll step of a deadline wait
            opened = await a.task("slice.terminal_open", open_payload())  # the one session slot is free again
            assert opened["session_id"] in relay.sessions

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_watchdog_whose_recheck_raises_closes_its_session_with_the_reason(tmp_path, nats_url, relay_key,
                                                                          slice_domain, caplog):
    caplog.set_level(logging.INFO, logger="gpuaas_agent.tasks.terminal_session")

    async def scenario():
        async with guest_server(relay_key) as guest, agent(tmp_path, nats_url, relay_key, guest.port,
                                                           recheck_interval_s=0.2, idle_timeout_s=3600.0) as a:
            sid, gw = await opened_session(a)
            a.store.close()  # the store is gone under the session: its recheck raises
            final = await gw.wait_closed()
            assert final.closed.reason.value == "watchdog_failed", final.closed
            assert "periodic check failed" in final.closed.detail
            await _until(lambda: sid not in relay_of(a.sh).sessions, "the session is unregistered")

    asyncio.run(scenario())
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpuaas_agent.tasks.terminal_session"]
    failed = [e for e in events if e["event"] == "terminal_watchdog_failed"]
    assert failed and failed[0]["error"]
