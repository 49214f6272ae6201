"""The uevent monitor against events the running kernel really emits.

What this machine can cause, and how:

* block add/remove: a GPT partition on a loop disk, added and removed with
  ``partx`` (loop devices themselves are pre-created here: ``losetup`` only
  emits ``change`` on the existing ``loopN``);
* net add/move/remove: a veth pair in the root namespace with unique names,
  renamed (``move``) and deleted. Links made inside another network namespace
  send their uevents to that namespace only (checked below), so they are made
  in the root namespace;
* pci bind/unbind/change: there is no PCI device here that may be unbound for
  real (the VM's own virtio functions carry its disk and network), so these are
  *synthetic* kernel uevents: the action written to the device's sysfs
  ``uevent`` file. The kernel sends them like real ones and marks them with
  ``SYNTH_UUID``; no driver changes.

All tests need root (netlink, losetup, ip link) and fail without it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from gpuaas_agent.contract.drift import Uevent
from gpuaas_agent.host.devices.uevents import (
    UeventMonitor,
    UeventSource,
    choose_source,
    parse_uevent,
    udevd_running,
)
from tests.support.realdev import require_root, sh

DEADLINE_S = 20.0
PCI_DEVICES = Path("/sys/bus/pci/devices")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _wait_events(monitor: UeventMonitor, want, seen: list[Uevent], timeout: float = DEADLINE_S) -> list[Uevent]:
    """Read events into ``seen`` until ``want(seen)`` holds; fail after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not want(seen):
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            pytest.fail(f"expected events not seen within {timeout}s; saw {[(e.action, e.name) for e in seen][-30:]}")
        try:
            event = await monitor.next_event(timeout=left)
        except TimeoutError:
            continue
        if event is not None:
            seen.append(event)
    return seen


def _link_name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"  # <= 15 chars, unique per run


def _del_link(name: str) -> None:
    if Path(f"/sys/class/net/{name}").exists():
        sh("ip", "link", "del", name, check=False)


def _open_fds() -> set[str]:
    return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")}


# -- source choice ---------------------------------------------------------------------


def test_no_udevd_socket_means_kernel_source(tmp_path):
    assert udevd_running(str(tmp_path / "control")) is False
    assert choose_source(str(tmp_path / "control")) == UeventSource.kernel


def test_listening_control_socket_means_udev_source(tmp_path):
    path = tmp_path / "control"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(path))
    server.listen(1)
    try:
        assert choose_source(str(path)) == UeventSource.udev
    finally:
        server.close()


def test_stale_control_socket_or_plain_file_means_kernel_source(tmp_path):
    stale = tmp_path / "stale"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(stale))  # bound, never listening: what a udevd that died leaves behind
    sock.close()
    assert stale.exists() and choose_source(str(stale)) == UeventSource.kernel
    plain = tmp_path / "plain"
    plain.write_text("")
    assert choose_source(str(plain)) == UeventSource.kernel


def test_monitor_logs_and_uses_the_source_it_chose(tmp_path, caplog):
    require_root()

    async def body():
        with caplog.at_level("INFO", logger="gpuaas_agent.host.devices.uevents"):
            async with UeventMonitor(control_socket=str(tmp_path / "absent")) as monitor:
                assert monitor.source == UeventSource.kernel
        assert any('"uevent_monitor_started"' in r.getMessage() and '"source": "kernel"' in r.getMessage()
                   for r in caplog.records)

    _run(body())


def test_parse_uevent_ignores_unwatched_actions_and_reads_move_and_synthetic_fields():
    assert parse_uevent({"ACTION": "online", "DEVPATH": "/devices/system/cpu/cpu1", "SUBSYSTEM": "cpu"}) is None
    event = parse_uevent({"ACTION": "move", "DEVPATH": "/devices/virtual/net/b", "DEVPATH_OLD": "/devices/virtual/net/a",
                          "SUBSYSTEM": "net", "SEQNUM": "42", "SYNTH_UUID": "0"})
    assert (event.name, event.old_devpath, event.seqnum, event.synthetic) == ("b", "/devices/virtual/net/a", 42, True)


# -- real kernel events ------------------------------------------------------------------


def test_partition_add_and_remove_on_a_loop_disk_are_seen(realdev):
    async def body():
        async with UeventMonitor() as monitor:
            disk = await asyncio.to_thread(realdev.disk, 16, partitions_mib=[4], link=False)
            part = os.path.basename(disk.partitions[0])
            seen: list[Uevent] = []
            await _wait_events(monitor, lambda s: any(e.name == part and e.action == "add" for e in s), seen)
            await asyncio.to_thread(sh, "partx", "-d", disk.dev)
            await _wait_events(monitor, lambda s: any(e.name == part and e.action == "remove" for e in s), seen)
        add = next(e for e in seen if e.name == part and e.action == "add")
        assert (add.subsystem, add.devtype, add.devname, add.synthetic) == ("block", "partition", f"/dev/{part}", False)

    _run(body())


def test_link_add_rename_and_delete_are_seen_as_add_move_remove():
    require_root()
    a, b, renamed = _link_name("uea"), _link_name("ueb"), _link_name("uem")

    async def body():
        async with UeventMonitor() as monitor:
            seen: list[Uevent] = []
            await asyncio.to_thread(sh, "ip", "link", "add", a, "type", "veth", "peer", "name", b)
            await asyncio.to_thread(sh, "ip", "link", "set", a, "name", renamed)
            await asyncio.to_thread(sh, "ip", "link", "del", renamed)
            await _wait_events(monitor, lambda s: {(e.action, e.name) for e in s} >= {
                ("add", a), ("add", b), ("move", renamed), ("remove", renamed), ("remove", b)}, seen)
        move = next(e for e in seen if e.action == "move")
        assert (move.subsystem, move.old_devpath) == ("net", f"/devices/virtual/net/{a}")

    try:
        _run(body())
    finally:
        for name in (a, b, renamed):
            _del_link(name)


def test_links_made_in_another_network_namespace_send_no_uevent_to_the_root_namespace():
    require_root()
    ns, inner_a, inner_b, marker_a, marker_b = (_link_name("uens"), _link_name("uei"), _link_name("uej"),
                                               _link_name("uek"), _link_name("uel"))

    async def body():
        async with UeventMonitor() as monitor:
            await asyncio.to_thread(sh, "ip", "netns", "add", ns)
            await asyncio.to_thread(sh, "ip", "-n", ns, "link", "add", inner_a, "type", "veth", "peer", "name", inner_b)
            # Uevents are delivered in order: once the later root-namespace marker is here,
            # the namespace's events would have been here too.
            await asyncio.to_thread(sh, "ip", "link", "add", marker_a, "type", "veth", "peer", "name", marker_b)
            seen = await _wait_events(monitor, lambda s: any(e.name == marker_a for e in s), [])
        assert not {inner_a, inner_b} & {e.name for e in seen}

    try:
        _run(body())
    finally:
        _del_link(marker_a)
        sh("ip", "netns", "del", ns, check=False)


def _pci_device_for_synthetic_events() -> Path:
    devices = sorted(PCI_DEVICES.iterdir()) if PCI_DEVICES.is_dir() else []
    if not devices:
        pytest.fail("no PCI device in /sys/bus/pci/devices: cannot emit pci uevents on this machine")
    unbound = [d for d in devices if not (d / "driver").exists()]
    return (unbound or devices)[0]


def test_pci_bind_unbind_and_change_uevents_are_seen():
    """Synthetic (see the module docstring): the kernel's own event path, no driver is touched."""
    require_root()
    device = _pci_device_for_synthetic_events()

    async def body():
        async with UeventMonitor() as monitor:
            for action in ("bind", "unbind", "change"):
                (device / "uevent").write_text(action)
            seen = await _wait_events(monitor, lambda s: {e.action for e in s if e.name == device.name} >= {
                "bind", "unbind", "change"}, [])
        ours = [e for e in seen if e.name == device.name]
        assert all(e.subsystem == "pci" and e.synthetic for e in ours)

    _run(body())


def test_events_of_unwatched_subsystems_are_filtered_out():
    require_root()
    a, b = _link_name("uef"), _link_name("ueg")

    async def body():
        async with UeventMonitor(subsystems=("block",)) as monitor:
            await asyncio.to_thread(sh, "ip", "link", "add", a, "type", "veth", "peer", "name", b)
            await asyncio.to_thread(sh, "ip", "link", "del", a)
            # a block event after the net ones: when it arrives, the net events have been filtered, not delayed
            loop0 = next(iter(sorted(Path("/sys/class/block").glob("loop*"))), None)
            if loop0 is None:
                pytest.fail("no loop block device to emit a block uevent from")
            (loop0 / "uevent").write_text("change")
            seen = await _wait_events(monitor, lambda s: any(e.name == loop0.name for e in s), [])
        assert {e.subsystem for e in seen} == {"block"}

    try:
        _run(body())
    finally:
        _del_link(a)


def test_a_burst_of_events_is_one_trigger_and_a_quiet_gap_starts_the_next():
    require_root()
    names = [_link_name("ueh") for _ in range(6)]
    pairs = list(zip(names[::2], names[1::2]))

    async def body():
        async with UeventMonitor(subsystems=("net",)) as monitor:
            bursts = monitor.bursts(debounce_s=1.0, max_burst_s=10.0)
            batch = "".join(f"link add {x} type veth peer name {y}\n" for x, y in pairs).encode()
            from gpuaas_agent.host.run import run

            await run(["ip", "-batch", "-"], stdin=batch, timeout=30)  # six add events in one quick go
            added = await _next_burst_with(bursts, names[0])
            assert set(names) <= {e.name for e in added.events}
            assert {f"net:{n}" for n in names} <= set(added.devices)
            await run(["ip", "-batch", "-"], stdin="".join(f"link del {x}\n" for x, _ in pairs).encode(), timeout=30)
            removed = await _next_burst_with(bursts, names[0])
            assert {(e.action, e.name) for e in removed.events if e.name in names} == {("remove", n) for n in names}
            await bursts.aclose()

    try:
        _run(body())
    finally:
        for name in names:
            _del_link(name)


def test_socket_overflow_is_reported_and_the_monitor_keeps_reading():
    """ENOBUFS (the kernel dropped events for us) makes a trigger that says so; the monitor goes on."""
    require_root()
    names = [_link_name("uev") for _ in range(12)]
    later_a, later_b = _link_name("uew"), _link_name("uex")

    async def body():
        # The smallest buffer the kernel allows, and a loop that does not read while 24 events arrive.
        async with UeventMonitor(subsystems=("net",), receive_buffer_bytes=4096) as monitor:
            batch = "".join(f"link add {n} type veth peer name {n}p\n" for n in names)
            subprocess.run(["ip", "-batch", "-"], input=batch.encode(), timeout=30, check=True)
            bursts = monitor.bursts(debounce_s=0.5, max_burst_s=10.0)
            first = await asyncio.wait_for(anext(bursts), DEADLINE_S)
            assert first.overflowed and len(first.events) < 2 * len(names)
            await asyncio.to_thread(sh, "ip", "link", "add", later_a, "type", "veth", "peer", "name", later_b)
            # The monitor goes on reading after the overflow: the next link's event arrives. (With a 4 KiB
            # buffer, other net events on the machine may overflow it again; that is reported, not lost.)
            later = await _next_burst_with(bursts, later_a)
            assert later_a in {e.name for e in later.events}
            await bursts.aclose()

    try:
        _run(body())
    finally:
        for name in (*names, later_a):
            _del_link(name)


async def _next_burst_with(bursts, name: str):
    """The first burst naming ``name`` (other tests on this machine make events too)."""
    while True:
        burst = await asyncio.wait_for(anext(bursts), DEADLINE_S)
        if any(e.name == name for e in burst.events):
            return burst


def test_close_releases_the_netlink_socket():
    require_root()

    async def body():
        before = _open_fds()
        monitor = UeventMonitor().start()
        assert _open_fds() - before, "the monitor opened no socket"
        monitor.close()
        assert _open_fds() == before

    _run(body())
