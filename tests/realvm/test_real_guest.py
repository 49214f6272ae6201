"""The real-guest lane: a lab guest booted by a real libvirtd from a domain the agent's builder made.

Everything is real and started here: virtlogd + libvirtd by hand (no systemd), an
ovsdb-server + ovs-vswitchd with a netdev bridge in the root namespace (libvirt makes
its tap there), dnsmasq in a private namespace on a veth plugged into that bridge, a
loop disk named by ``/dev/disk/by-id``, and the lab guest image built from Debian
packages by ``lab/build_guest_image.py`` (cached under ``/var/cache/gpuaas-agent-lab``).

The slot pipeline is walked with the agent's own code: disk guard -> clone -> seed ISO
-> domain XML (profile ``lab_tcg_1c_512m``: ``type='qemu'``, no hostdevs) -> start guard
-> define/start -> readiness (lease of the reserved IP, SSH banner) -> ACPI shutdown ->
undefine with NVRAM. Then nothing may be left: no domain, no NVRAM file, no QEMU, no
loop device, no by-id link.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from contextlib import ExitStack
from ipaddress import IPv4Address
from pathlib import Path

import libvirt
import pytest

from gpuaas_agent.contract.cloudinit import GuestAddressing, GuestNetwork, GuestUser, SeedSpec
from gpuaas_agent.contract.domain import DomainSpec
from gpuaas_agent.contract.runtime import DomainType, get_profile
from gpuaas_agent.contract.storage import DiskLease
from gpuaas_agent.discovery.ovmf import find_ovmf
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.guards.vmstart import check_vm_start
from gpuaas_agent.host.images.clone import clone_image
from gpuaas_agent.host.network.readiness import wait_for_guest, wait_for_ssh
from gpuaas_agent.host.vm.cloudinit import write_seed_iso
from gpuaas_agent.host.vm.domain_xml import build_domain_xml
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from tests.realvm import load_builder
from tests.support.dnsmasq_fixture import GATEWAY, Dnsmasq, NetLab, run_in_netns
from tests.support.libvirtd_fixture import running_libvirtd
from tests.support.ovsdb_fixture import running_ovs
from tests.support.realdev import RealDevices, require_root

NVRAM_DIR = Path("/var/lib/libvirt/qemu/nvram")
PROFILE = "lab_tcg_1c_512m"
GUEST_IP = IPv4Address("10.100.0.10")
RELAY_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDycr+WYP28NHqowyYs7Wg4kv6keU8P+K/OQKQiKOkbf gpuaas-terminal@lab"
# Under TCG on a busy 2-core CI machine: OVMF ~5 s, kernel + initramfs ~7 s; the deadlines leave room.
BOOT_DEADLINE_S = 180.0
READY_DEADLINE_S = 60.0
SHUTDOWN_DEADLINE_S = 90.0


def _wait(predicate: Callable[[], object], what: str, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _qemu_pids(domain_name: str) -> list[int]:
    """QEMU processes (zombies included) whose command line names this domain."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmdline and f"guest={domain_name}".encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _loop_attached(dev: str, image: Path) -> bool:
    backing = Path(f"/sys/block/{os.path.basename(dev)}/loop/backing_file")
    return backing.exists() and backing.read_text().strip().startswith(str(image))


@pytest.mark.parametrize("addressing", [GuestAddressing.dhcp4, GuestAddressing.static])
def test_lab_guest_boots_from_builder_xml_answers_ssh_and_leaves_nothing_after_acpi_shutdown(
    lab_guest_image, addressing
):
    """dhcp4: the guest leases its reserved IP (sending the seed's hostname); static: it sets the seed's address."""
    require_root()
    builder = load_builder()
    profile = get_profile(PROFILE)
    assert profile.domain_type is DomainType.qemu and not profile.hostdevs and not profile.hugepages_1g

    allocation_id = str(uuid.uuid4())
    mac = "52:54:00:" + ":".join(f"{b:02x}" for b in os.urandom(3))
    hostname = f"lab-{allocation_id[:8]}"
    host = HostRoot.open("/")
    timings: dict[str, float] = {}
    with ExitStack() as stack:
        stack.callback(lambda: print(  # last out: the timings also show when a step failed
            f"\nreal guest timings ({lab_guest_image.kernel_version}, image {lab_guest_image.sha256[:12]}): "
            + " ".join(f"{k}={v:.2f}" for k, v in timings.items())))
        # Files libvirt's qemu user must reach: a 0755 dir of our own (pytest's tmp is 0700).
        workdir = Path(tempfile.mkdtemp(prefix="gpuaas-realvm-", dir="/tmp"))
        stack.callback(shutil.rmtree, workdir, True)
        workdir.chmod(0o755)

        devices = RealDevices(workdir)
        stack.callback(devices.close)
        disk = devices.disk(size_mib=64)
        lease = DiskLease(allocation_id=allocation_id, slot_index=0, nvme_device=disk.by_id,
                          disk_identity=disk.identity)

        # Network: OVS netdev bridge (root netns, where libvirt makes taps) <- veth -> dnsmasq's namespace.
        mark = time.monotonic()
        sw = stack.enter_context(running_ovs(root_netns=True))
        timings["ovs_up_s"] = time.monotonic() - mark
        net = NetLab(tmp=workdir)
        stack.callback(lambda: _assert_clean(net.cleanup()))
        server_ns = net.netns("srv")
        uplink, server_if = f"gsu{net.tag}", f"gsd{net.tag}"
        net.veth(uplink, None, server_if, None)
        net.root_links.remove(server_if)  # it moves into the namespace; deleting the uplink removes it too
        # veths leave UDP/TCP checksums to "hardware"; the userspace datapath never fills them in,
        # so the guest would drop dnsmasq's offers as corrupt. Checksum in software instead.
        _disable_tx_checksum(server_if)
        subprocess.run(["ip", "link", "set", server_if, "netns", server_ns], check=True, timeout=30)
        net.up(None, uplink)
        net.up(server_ns, server_if, address=f"{GATEWAY}/24")
        sw.vsctl("add-port", sw.bridge, uplink)
        dnsmasq = Dnsmasq(netns=server_ns, iface=server_if, workdir=workdir / "dnsmasq")
        dnsmasq.workdir.mkdir()
        dnsmasq.hosts_file.write_text(f"{mac},{GUEST_IP}\n")
        dnsmasq.start()
        net.processes.append(dnsmasq.proc)

        ovs_env = {k: v for k, v in sw.env.items() if k.startswith("OVS_")}
        mark = time.monotonic()
        daemon = stack.enter_context(running_libvirtd(workdir / "libvirtd", extra_env=ovs_env))
        timings["libvirtd_up_s"] = time.monotonic() - mark
        mark = time.monotonic()

        # Clone the guest image onto the slot disk through the agent's guard + qemu-img path.
        clone = asyncio.run(clone_image(host, str(lab_guest_image.path), disk.by_id, lease=lease))
        assert clone.source_format.value == "raw" and clone.by_id == disk.by_id
        timings["clone_s"] = time.monotonic() - mark
        mark = time.monotonic()

        # dropbear's own tools (dropbear-bin): no openssh-client needed on the CI machine.
        key = workdir / "tenant"
        subprocess.run(["dropbearkey", "-t", "ed25519", "-f", str(key)], check=True, timeout=30, capture_output=True)
        tenant_pub = next(line for line in subprocess.run(
            ["dropbearkey", "-y", "-f", str(key)], check=True, timeout=30, capture_output=True, text=True
        ).stdout.splitlines() if line.startswith("ssh-ed25519 "))
        seed_iso = workdir / "seed.iso"
        seed = SeedSpec(
            instance_id=allocation_id,
            hostname=hostname,
            user=GuestUser(name="tenant", ssh_authorized_keys=(tenant_pub,)),
            terminal_relay_key=RELAY_KEY,
            network=GuestNetwork(mac=mac, address=f"{GUEST_IP}/24", gateway=GATEWAY, nameservers=(GATEWAY,),
                                 addressing=addressing),
        )
        asyncio.run(write_seed_iso(seed, seed_iso))
        serial_log = workdir / "serial.log"
        spec = DomainSpec(
            allocation_id=allocation_id,
            slot_index=0,
            task_id="realvm-test",
            profile=profile,
            nvme_device=disk.by_id,
            mac=mac,
            ovs_bridge=sw.bridge,
            seed_iso_path=str(seed_iso),
            firmware=find_ovmf(host),
            serial_log_path=str(serial_log),
            agent_version="test",
        )
        xml = ET.fromstring(build_domain_xml(spec))
        assert xml.get("type") == "qemu" and xml.find("devices/hostdev") is None
        assert xml.find("memoryBacking") is None

        lifecycle = LibvirtLifecycle(daemon.uri)
        stack.callback(lambda: asyncio.run(lifecycle.close()))
        stack.callback(_force_remove, daemon.uri, spec.domain_name)

        disk_evidence = check_disk_writable(host, disk.by_id, lease=lease)
        start_evidence = check_vm_start(host, spec, bridge_exists=lambda b: b in sw.vsctl("list-br").split(),
                                        disk=disk_evidence)
        assert start_evidence.kvm == "not_required"

        timings["guards_s"] = time.monotonic() - mark
        mark = time.monotonic()
        defined = asyncio.run(lifecycle.define(spec))
        timings["define_s"] = time.monotonic() - mark
        assert defined.action == "created"
        conn = daemon.connect()
        stack.callback(conn.close)
        live_xml = ET.fromstring(conn.lookupByName(spec.domain_name).XMLDesc(0))
        nvram = Path(live_xml.findtext("os/nvram") or "")
        assert nvram.parent == NVRAM_DIR, ET.tostring(live_xml.find("os"), encoding="unicode")

        t0 = time.monotonic()
        started = asyncio.run(lifecycle.start(spec.domain_name, preconditions=start_evidence))
        assert started.state.value == "running"
        timings["start_call_s"] = time.monotonic() - t0
        assert nvram.is_file(), "libvirt did not create the per-domain NVRAM from the VARS template"
        assert _qemu_pids(spec.domain_name), "no QEMU process for the running domain"

        marker = builder.BOOT_MARKER
        _wait(lambda: marker in _read(serial_log), f"{marker} on the serial log {serial_log}", BOOT_DEADLINE_S)
        timings["boot_to_marker_s"] = time.monotonic() - t0
        uptime = re.search(rf"{marker} .*uptime=([\d.]+)", _read(serial_log))
        timings["guest_uptime_at_marker_s"] = float(uptime.group(1)) if uptime else -1.0

        async def ready():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + READY_DEADLINE_S
            if addressing is GuestAddressing.static:
                return await wait_for_ssh(GUEST_IP, deadline=deadline)
            return (await wait_for_guest(dnsmasq.lease_file, mac, GUEST_IP, deadline=deadline)).ssh_banner

        try:
            banner = run_in_netns(server_ns, ready, timeout_s=READY_DEADLINE_S + 30)
        except Exception as exc:
            raise AssertionError(
                f"guest not ready: {exc}\n--- serial\n{_read(serial_log)[-4000:]}\n--- dnsmasq\n{dnsmasq.log()[-2000:]}"
                f"\n--- ovs ports\n{sw.vsctl('show')}\n{sw.log_tail(15)}"
                f"\n--- ofctl\n{_ofctl(sw)}"
            ) from exc
        timings["start_to_ssh_s"] = time.monotonic() - t0
        assert banner.startswith("SSH-2.0-dropbear"), banner
        log = _read(serial_log)
        assert f"GPUAAS-LAB-SEED device=/dev/sr0 hostname={hostname} keys=2" in log, log[-3000:]
        if addressing is GuestAddressing.static:
            assert f"GPUAAS-LAB-STATIC iface=eth0 mac={mac} ip={GUEST_IP}/24" in log, log[-3000:]
            assert not dnsmasq.lease_file.read_text().strip(), "a static guest asked for a lease"
        else:
            assert f"GPUAAS-LAB-DHCP iface=eth0 mac={mac} ip={GUEST_IP}/24" in log, log[-3000:]
            # The guest sent the hostname it read from the seed's meta-data in its DHCP request.
            assert f" {mac} {GUEST_IP} {hostname} " in dnsmasq.lease_file.read_text(), dnsmasq.lease_file.read_text()
        # A real login with the tenant's key from the seed's user-data, as the seed's user.
        login = subprocess.run(
            # -yy: accept the guest's new host key without storing it anywhere.
            ["ip", "netns", "exec", server_ns, "dbclient", "-yy", "-i", str(key), f"tenant@{GUEST_IP}",
             "id -un; hostname"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False,
        )
        assert login.returncode == 0 and login.stdout.split() == ["tenant", hostname], login
        timings["start_to_login_s"] = time.monotonic() - t0

        t1 = time.monotonic()
        outcome = asyncio.run(lifecycle.shutdown(spec.domain_name, deadline_s=SHUTDOWN_DEADLINE_S))
        timings["acpi_shutdown_s"] = time.monotonic() - t1
        assert outcome.graceful and not outcome.destroyed and not outcome.already_off, outcome
        dom = conn.lookupByName(spec.domain_name)
        state, reason = dom.state()
        assert (state, reason) == (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_SHUTDOWN)
        assert "GPUAAS-LAB-GUEST-POWEROFF" in _read(serial_log)

        undefined = asyncio.run(lifecycle.undefine(spec.domain_name))
        assert undefined.undefined and undefined.nvram_removed, undefined
        assert undefined.attempts == ["undefine_nvram:ok"]

        with pytest.raises(libvirt.libvirtError) as missing:
            conn.lookupByName(spec.domain_name)
        assert missing.value.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN
        assert not nvram.exists(), f"NVRAM {nvram} left behind"
        assert not [p for p in NVRAM_DIR.iterdir() if spec.domain_name in p.name]
        _wait(lambda: not _qemu_pids(spec.domain_name), "the domain's QEMU process to be gone", 30)
        assert not sw.vsctl("list-ports", sw.bridge).split().count(spec.vnic_name), "tap port left on the bridge"

        devices.close()
        assert not _loop_attached(disk.dev, disk.image), f"{disk.dev} still attached to {disk.image}"
        assert not os.path.lexists(disk.by_id), f"{disk.by_id} left behind"

    assert timings["boot_to_marker_s"] < BOOT_DEADLINE_S


def _disable_tx_checksum(ifname: str) -> None:
    """``ethtool -K IF tx off`` without ethtool: the SIOCETHTOOL ioctl with ETHTOOL_STXCSUM."""
    siocethtool, ethtool_stxcsum = 0x8946, 0x17
    value = struct.pack("II", ethtool_stxcsum, 0)
    buf = ctypes.create_string_buffer(value)
    ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(buf))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock.fileno(), siocethtool, ifreq)


def _ofctl(sw) -> str:
    out = subprocess.run(["ovs-ofctl", "dump-ports", f"unix:{sw.rundir}/{sw.bridge}.mgmt"], env=sw.env,
                         capture_output=True, text=True, timeout=20, check=False)
    return out.stdout + out.stderr


def _assert_clean(problems: list[str]) -> None:
    assert not problems, problems


def _force_remove(uri: str, name: str) -> None:
    """Teardown after a failed test: destroy and undefine (with NVRAM) whatever is left of the domain."""
    try:
        conn = libvirt.open(uri)
    except libvirt.libvirtError:
        return  # libvirtd already gone: nothing to ask
    try:
        dom = conn.lookupByName(name)
    except libvirt.libvirtError:
        conn.close()
        return
    try:
        if dom.isActive():
            dom.destroy()
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
    finally:
        conn.close()
