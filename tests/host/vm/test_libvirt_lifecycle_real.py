"""The lifecycle driver against a real libvirtd + QEMU (TCG), for what the test driver cannot show.

- A guest that ignores the ACPI power button (OVMF with an empty disk sits in its
  boot manager: there is no OS to act on the button) is destroyed at the deadline.
- A UEFI domain that has run owns an NVRAM file; a plain ``undefine()`` fails on it
  (seed 004 left shut-off domains that way), the driver's NVRAM undefine removes both.
- libvirtd going away and coming back is survived: the next call reconnects and counts it.

The domain is the builder's lab domain minus its OVS interface (the OVS lane is
tested elsewhere), on a real loop disk, so the XML libvirt accepts here is the builder's.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import libvirt
import pytest

from gpuaas_agent.contract.domain import DomainSpec, DomainState
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.discovery.ovmf import find_ovmf
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.guards.vmstart import check_vm_start
from gpuaas_agent.host.vm.domain_xml import build_domain
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.hostfs import HostRoot
from tests.support.libvirtd_fixture import running_libvirtd

LIVE = HostRoot.open("/")
DEADLINE_S = 4.0


def _force_remove(uri: str, name: str) -> None:
    conn = libvirt.open(uri)
    try:
        dom = conn.lookupByName(name)
        if dom.isActive():
            dom.destroy()
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
    except libvirt.libvirtError:
        pass  # already gone: nothing to clean
    finally:
        conn.close()


def _domain_without_nic(spec: DomainSpec) -> str:
    root = build_domain(spec)
    devices = root.find("devices")
    devices.remove(devices.find("interface"))
    return ET.tostring(root, encoding="unicode")


@pytest.fixture
def qemu_readable_dir():
    """A directory the ``libvirt-qemu`` user can traverse (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="gpuaas-lifecycle-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_acpi_ignored_then_destroyed_and_nvram_undefine_on_real_libvirtd(realdev, tmp_path, qemu_readable_dir):
    disk = realdev.disk(16)
    seed = qemu_readable_dir / "seed.iso"
    seed.write_bytes(b"\0" * 2048 * 16)  # a raw cdrom image; its content does not matter to firmware that never boots
    spec = DomainSpec(
        allocation_id=str(uuid.uuid4()), slot_index=0, task_id="real-lifecycle",
        profile=get_profile("lab_tcg_1c_512m"), nvme_device=disk.by_id, mac="02:00:00:00:09:09",
        ovs_bridge="ovsbr0", seed_iso_path=str(seed), firmware=find_ovmf(LIVE), agent_version="test",
    )
    evidence = check_vm_start(LIVE, spec, bridge_exists=True,
                              disk=check_disk_writable(LIVE, disk.by_id, lease=disk.lease()))

    with running_libvirtd(tmp_path / "libvirtd") as daemon:
        conn = daemon.connect()
        try:
            conn.defineXMLFlags(_domain_without_nic(spec), libvirt.VIR_DOMAIN_DEFINE_VALIDATE)

            async def go():
                async with LibvirtLifecycle(daemon.uri) as lc:
                    listed = [d.name for d in await lc.list_agent_domains()]
                    started = await lc.start(spec.domain_name, preconditions=evidence)
                    nvram = Path(ET.fromstring(conn.lookupByName(spec.domain_name).XMLDesc(0)).findtext("os/nvram"))
                    stopped = await lc.shutdown(spec.domain_name, deadline_s=DEADLINE_S, poll_s=0.2)
                    with pytest.raises(libvirt.libvirtError) as plain:
                        conn.lookupByName(spec.domain_name).undefine()  # what the seed's release path did first
                    undefined = await lc.undefine(spec.domain_name)
                    return listed, started, nvram, stopped, plain.value, undefined, await lc.lookup(spec.domain_name)

            listed, started, nvram, stopped, plain, undefined, gone = asyncio.run(go())
        finally:
            _force_remove(daemon.uri, spec.domain_name)
            conn.close()
        log_tail = daemon.log_tail()

    assert spec.domain_name in listed
    assert started.state == DomainState.running, log_tail
    assert stopped.destroyed and not stopped.graceful and stopped.note is None, stopped
    assert stopped.waited_s >= DEADLINE_S
    assert "nvram" in str(plain).lower(), plain
    assert undefined.undefined and undefined.nvram_removed and undefined.attempts == ["undefine_nvram:ok"]
    assert gone is None and not nvram.exists(), f"NVRAM {nvram} left behind"


def test_libvirtd_restart_is_survived_with_a_counted_reconnect(tmp_path):
    lc = LibvirtLifecycle("qemu:///system", reconnect_attempts=3, backoff_s=0.1)
    try:
        with running_libvirtd(tmp_path / "first"):
            # A lookup opens the in-process connection (a listing on a libvirtd with no domain would ask virsh
            # and open none: host/vm/virsh.py); the listing after the restart then goes through that connection.
            before = asyncio.run(lc.lookup("gpuaas-no-such-domain"))
            assert lc.opened
        with running_libvirtd(tmp_path / "second"):
            after = asyncio.run(lc.list_agent_domains())
    finally:
        asyncio.run(lc.close())
    assert before is None and isinstance(after, list)
    assert lc.reconnects == 1
