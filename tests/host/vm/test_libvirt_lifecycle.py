"""The lifecycle driver against libvirt's in-process test driver (``test:///default``).

The test driver keeps its state per process, shared by every connection
(docs/testing.md), and ships a running domain called ``test`` that the agent does
not own: every test uses fresh allocation ids and undefines what it defined.
It rejects ``VIR_DOMAIN_UNDEFINE_NVRAM`` and ``VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN``
with VIR_ERR_INVALID_ARG, which is exactly the fallback these tests prove.
Start evidence comes from the real start guard over a real loop disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid

import libvirt
import pytest

from gpuaas_agent.contract.domain import DomainSpec, DomainSpecError, DomainState, OvmfFirmware
from gpuaas_agent.contract.runtime import DomainType, RuntimeProfile, get_profile
from gpuaas_agent.guards.disk import DiskGuardError, check_disk_writable
from gpuaas_agent.guards.vmstart import check_vm_start
from gpuaas_agent.host.vm.domain_xml import build_domain_xml
from gpuaas_agent.host.vm.libvirt_lifecycle import (
    DomainNotFoundError,
    DomainRefused,
    LibvirtConnectionError,
    LibvirtError,
    LibvirtLifecycle,
)
from gpuaas_agent.hostfs import HostRoot
from tests.support.domain_specs import production_spec

URI = "test:///default"
LIVE = HostRoot.open("/")
FIRMWARE = OvmfFirmware(code_path="/usr/share/OVMF/OVMF_CODE_4M.fd", vars_template_path="/usr/share/OVMF/OVMF_VARS_4M.fd")


def spec(**update) -> DomainSpec:
    fields = dict(
        allocation_id=str(uuid.uuid4()),
        slot_index=2,
        task_id="task-lifecycle",
        profile=get_profile("lab_tcg_1c_512m"),
        nvme_device="/dev/disk/by-id/gpuaas-test-placeholder",
        mac="02:00:00:00:02:02",
        ovs_bridge="ovsbr0",
        seed_iso_path="/var/lib/gpuaas/seeds/t.iso",
        firmware=FIRMWARE,
        agent_version="0.1.0",
    )
    fields.update(update)
    return DomainSpec(**fields)


def run(coro):
    return asyncio.run(coro)


async def _cleanup(lc: LibvirtLifecycle, name: str) -> None:
    """Leave the process-wide test driver as found, whatever the test did."""
    conn = libvirt.open(URI)
    try:
        try:
            dom = conn.lookupByName(name)
        except libvirt.libvirtError:
            return
        if dom.isActive():
            dom.destroy()
        dom.undefine()
    finally:
        conn.close()


@pytest.fixture(autouse=True)
def test_driver():
    """One connection held for the whole test: test:///default forgets every domain when its last
    connection (or last domain handle) goes away, which a real libvirtd never does."""
    conn = libvirt.open(URI)
    yield conn
    conn.close()


@pytest.fixture
def slot_disk(realdev):
    """A real loop disk and the disk guard's evidence for it."""
    disk = realdev.disk(16)
    return disk, check_disk_writable(LIVE, disk.by_id, lease=disk.lease())


def _defined_and_started(s: DomainSpec, evidence_disk) -> tuple:
    async def go():
        async with LibvirtLifecycle(URI) as lc:
            try:
                defined = await lc.define(s)
                pre = check_vm_start(LIVE, s, bridge_exists=True, disk=evidence_disk)
                started = await lc.start(s.domain_name, preconditions=pre)
                again = await lc.start(s.domain_name, preconditions=pre)
                listed = await lc.list_agent_domains()
                by_uuid = await lc.lookup(uuid=started.uuid)
                stopped = await lc.shutdown(s.domain_name, deadline_s=10)
                undefined = await lc.undefine(s.domain_name)
                gone = await lc.lookup(s.domain_name)
                return defined, started, again, listed, by_uuid, stopped, undefined, gone
            finally:
                await _cleanup(lc, s.domain_name)

    return run(go())


def test_full_lifecycle_with_the_test_drivers_nvram_fallback(slot_disk, caplog):
    disk, evidence = slot_disk
    s = spec(nvme_device=disk.by_id)
    caplog.set_level(logging.INFO, logger="gpuaas_agent.host.vm.libvirt_lifecycle")
    defined, started, again, listed, by_uuid, stopped, undefined, gone = _defined_and_started(s, evidence)

    assert defined.action == "created" and defined.domain.state == DomainState.shutoff
    assert defined.domain.metadata == s.metadata() and defined.domain.persistent
    assert started.state == DomainState.running and again.state == DomainState.running
    assert [d.name for d in listed if d.name == s.domain_name] == [s.domain_name]
    assert "test" not in [d.name for d in listed]  # the driver's own domain has no agent metadata
    assert by_uuid.name == s.domain_name
    # The test driver refuses the ACPI flag: plain shutdown() is used and the outcome says so.
    assert stopped.graceful and not stopped.destroyed and "ACPI_POWER_BTN" in stopped.note
    # ... and refuses VIR_DOMAIN_UNDEFINE_NVRAM: plain undefine, reported and logged.
    assert undefined.undefined and not undefined.nvram_removed
    assert undefined.attempts == [f"undefine_nvram:error:{libvirt.VIR_ERR_INVALID_ARG}", "undefine:ok"]
    assert "VIR_DOMAIN_UNDEFINE_NVRAM" in undefined.note
    events = [json.loads(r.getMessage())["event"] for r in caplog.records]
    assert "libvirt_undefine_nvram_unsupported" in events and "libvirt_shutdown_flag_unsupported" in events
    assert gone is None


def test_define_twice_with_the_same_metadata_returns_the_existing_domain():
    s = spec()

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            try:
                return await lc.define(s), await lc.define(s)
            finally:
                await _cleanup(lc, s.domain_name)

    first, second = run(go())
    assert (first.action, second.action) == ("created", "existing")
    assert first.domain.uuid == second.domain.uuid


def test_same_name_with_other_metadata_is_never_overwritten():
    s = spec()
    other = s.model_copy(update={"slot_index": 3, "task_id": "someone-else"})

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            try:
                created = await lc.define(s)
                with pytest.raises(DomainRefused) as err:
                    await lc.define(other)
                return created, err.value, await lc.lookup(s.domain_name)
            finally:
                await _cleanup(lc, s.domain_name)

    created, err, after = run(go())
    assert err.code == "domain_name_conflict"
    assert err.evidence["existing_metadata"]["slot_index"] == 2 and err.evidence["wanted_metadata"]["slot_index"] == 3
    assert after.uuid == created.domain.uuid and after.metadata == s.metadata()


def test_a_foreign_domain_with_our_name_is_neither_overwritten_nor_touched(slot_disk):
    s = spec()
    foreign = build_domain_xml(s).split("<metadata>")[0] + build_domain_xml(s).split("</metadata>")[1]
    _disk, evidence = slot_disk

    async def go():
        conn = libvirt.open(URI)
        conn.defineXML(foreign)  # defined by someone else, without our mark
        conn.close()
        async with LibvirtLifecycle(URI) as lc:
            try:
                errors = []
                with pytest.raises(DomainRefused) as err:
                    await lc.define(s)
                errors.append(err.value.code)
                pre = check_vm_start(LIVE, s.model_copy(update={"nvme_device": evidence.by_id}),
                                     bridge_exists=True, disk=evidence)
                for action in (lambda: lc.start(s.domain_name, preconditions=pre), lambda: lc.undefine(s.domain_name),
                               lambda: lc.shutdown(s.domain_name, deadline_s=1)):
                    with pytest.raises(DomainRefused) as err:
                        await action()
                    errors.append(err.value.code)
                listed = await lc.list_agent_domains()
                return errors, listed, await lc.lookup(s.domain_name)
            finally:
                await _cleanup(lc, s.domain_name)

    errors, listed, still = run(go())
    assert errors == ["domain_name_conflict", "not_agent_domain", "not_agent_domain", "not_agent_domain"]
    assert s.domain_name not in [d.name for d in listed]
    assert still is not None and still.metadata is None


def test_the_drivers_own_test_domain_is_refused():
    async def go():
        async with LibvirtLifecycle(URI) as lc:
            with pytest.raises(DomainRefused) as err:
                await lc.undefine("test")
            return err.value, await lc.state("test")

    err, state = run(go())
    assert err.code == "not_agent_domain" and state == DomainState.running


def test_a_running_domain_is_not_undefined(slot_disk):
    disk, evidence = slot_disk
    s = spec(nvme_device=disk.by_id)

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            try:
                await lc.define(s)
                await lc.start(s.domain_name, preconditions=check_vm_start(LIVE, s, bridge_exists=True, disk=evidence))
                with pytest.raises(DomainRefused) as err:
                    await lc.undefine(s.domain_name)
                return err.value, await lc.state(s.domain_name)
            finally:
                await _cleanup(lc, s.domain_name)

    err, state = run(go())
    assert err.code == "domain_running" and state == DomainState.running


def test_start_evidence_of_another_domain_is_refused(slot_disk):
    disk, evidence = slot_disk
    s = spec(nvme_device=disk.by_id)
    other = spec(nvme_device=disk.by_id)

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            try:
                await lc.define(s)
                with pytest.raises(DomainRefused) as err:
                    await lc.start(s.domain_name, preconditions=check_vm_start(LIVE, other, bridge_exists=True,
                                                                                disk=evidence))
                return err.value, await lc.state(s.domain_name)
            finally:
                await _cleanup(lc, s.domain_name)

    err, state = run(go())
    assert err.code == "start_evidence_mismatch" and state == DomainState.shutoff


def test_wait_for_shutoff_honours_its_deadline_and_deadline_zero_destroys(slot_disk):
    """wait_for_shutoff really waits: a running guest that was not asked to stop is still running at the deadline."""
    disk, evidence = slot_disk
    s = spec(nvme_device=disk.by_id)

    async def go():
        loop = asyncio.get_running_loop()
        async with LibvirtLifecycle(URI) as lc:
            try:
                await lc.define(s)
                await lc.start(s.domain_name, preconditions=check_vm_start(LIVE, s, bridge_exists=True, disk=evidence))
                t0 = loop.time()
                off = await lc.wait_for_shutoff(s.domain_name, 0.3, poll_s=0.05)
                waited = loop.time() - t0
                hard = await lc.shutdown(s.domain_name, deadline_s=0)
                return off, waited, hard, await lc.state(s.domain_name), await lc.shutdown(s.domain_name, deadline_s=5)
            finally:
                await _cleanup(lc, s.domain_name)

    off, waited, hard, state, again = run(go())
    assert off is False and waited >= 0.3
    assert hard.destroyed and not hard.graceful and state == DomainState.shutoff
    assert again.already_off and not again.destroyed


def test_unknown_domains_are_reported_not_guessed():
    name = spec().domain_name

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            with pytest.raises(DomainNotFoundError):
                await lc.state(name)
            return await lc.lookup(name), await lc.lookup(uuid=str(uuid.uuid4())), await lc.undefine(name)

    by_name, by_uuid, undefined = run(go())
    assert by_name is None and by_uuid is None
    assert not undefined.undefined and undefined.note == "domain was already absent"


BIG = RuntimeProfile(name="big_200c", domain_type=DomainType.kvm, vcpus=200, memory_mib=65536, hugepages_1g=True)
ODD = RuntimeProfile(name="odd_mem", domain_type=DomainType.kvm, vcpus=4, memory_mib=66048, hugepages_1g=True)
BAD_SPECS = {
    "hostdev_missing": lambda: spec(profile=get_profile("h200_1g_24c_64g")),
    "vcpus_exceed_numa_node": lambda: production_spec(0, allocation_id=str(uuid.uuid4()), profile=BIG),
    "memory_not_hugepage_multiple": lambda: production_spec(0, allocation_id=str(uuid.uuid4()), profile=ODD),
    "disk_numa_mismatch": lambda: production_spec(0, allocation_id=str(uuid.uuid4()), nvme_numa_node=1),
}


@pytest.mark.parametrize("code", sorted(BAD_SPECS))
def test_bad_spec_is_refused_typed_and_defines_nothing(code):
    s = BAD_SPECS[code]()

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            with pytest.raises(DomainSpecError) as err:
                await lc.define(s)
            return err.value, await lc.lookup(s.domain_name)

    err, found = run(go())
    assert err.code == code and found is None


def test_unreachable_libvirt_is_retried_with_backoff_then_reported(tmp_path, caplog):
    uri = f"qemu+unix:///system?socket={tmp_path}/no-libvirtd.sock"
    caplog.set_level(logging.WARNING, logger="gpuaas_agent.host.vm.libvirt_lifecycle")

    async def go():
        loop = asyncio.get_running_loop()
        async with LibvirtLifecycle(uri, reconnect_attempts=3, backoff_s=0.05) as lc:
            t0 = loop.time()
            with pytest.raises(LibvirtConnectionError) as err:
                await lc.list_agent_domains()
            return err.value, loop.time() - t0

    err, elapsed = run(go())
    assert err.code == "libvirt_unreachable"
    assert len(err.evidence["attempts"]) == 4 and "no-libvirtd.sock" in err.evidence["attempts"][0]["libvirt_message"]
    assert elapsed >= 0.05 + 0.1 + 0.2  # backoff doubled between attempts
    lost = [json.loads(r.getMessage()) for r in caplog.records if "libvirt_connection_lost" in r.getMessage()]
    assert [e["attempt"] for e in lost] == [1, 2, 3]


def test_a_connection_lost_underneath_is_reopened_and_counted():
    s = spec()

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            try:
                await lc.define(s)
                lc._conn.close()  # the daemon went away: the handle this driver holds is now dead
                info = await lc.lookup(s.domain_name)
                return info, lc.reconnects
            finally:
                await _cleanup(lc, s.domain_name)

    info, reconnects = run(go())
    assert info.metadata == s.metadata() and reconnects == 1


def test_blocking_calls_run_off_the_event_loop_thread():
    seen = []

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            await lc._call("probe", lambda conn: seen.append(threading.current_thread().name) or conn.getURI())
            return threading.current_thread().name

    loop_thread = run(go())
    assert seen and seen[0] != loop_thread and seen[0].startswith("libvirt")


def test_a_call_that_does_not_answer_in_time_is_a_typed_timeout():
    release = threading.Event()

    async def go():
        async with LibvirtLifecycle(URI, call_timeout_s=0.2) as lc:
            try:
                with pytest.raises(LibvirtError) as err:
                    # a libvirt call stuck in the daemon, as seen from the worker thread
                    await lc._call("stuck", lambda conn: release.wait(30) and conn.getURI())
                return err.value, lc._conn
            finally:
                release.set()

    err, conn_after = run(go())
    assert err.code == "libvirt_timeout" and err.evidence["timeout_s"] == 0.2
    assert conn_after is None  # the wedged connection is not reused


def test_defined_domain_disks_lists_shut_off_domains_and_excludes_only_the_slots_own(realdev):
    """A shut-off domain of another allocation still owns its disk: the guard refuses it as in_use_by_domain,
    even when the clone names the disk by another by-id alias (compared by major:minor, not path)."""
    disk = realdev.disk(16)
    alias = realdev.by_id_link(f"../../{disk.dev.removeprefix('/dev/')}")
    mine = spec(nvme_device="/dev/disk/by-id/gpuaas-test-mine", slot_index=1)
    same_alloc_other_slot = spec(allocation_id=mine.allocation_id, slot_index=4,
                                 nvme_device="/dev/disk/by-id/gpuaas-test-slot4")
    stranger = spec(nvme_device=disk.by_id)  # another allocation, defined, never started

    async def go():
        async with LibvirtLifecycle(URI) as lc:
            await lc.define(stranger)
            try:
                # Same name for both specs of one allocation: define the other slot's under its own name.
                conn = libvirt.open(URI)
                conn.defineXML(build_domain_xml(same_alloc_other_slot).replace(
                    same_alloc_other_slot.domain_name, "gpuaas-test-other-slot"))
                conn.close()
                return (await lc.defined_domain_disks(exclude_allocation=mine.allocation_id, exclude_slot=1),
                        await lc.defined_domain_disks(exclude_allocation=stranger.allocation_id, exclude_slot=2))
            finally:
                await _cleanup(lc, stranger.domain_name)
                await _cleanup(lc, "gpuaas-test-other-slot")

    others, without_stranger = run(go())
    assert disk.by_id in others and "/dev/disk/by-id/gpuaas-test-slot4" in others
    assert disk.by_id not in without_stranger and "/dev/disk/by-id/gpuaas-test-slot4" in without_stranger
    with pytest.raises(DiskGuardError) as err:
        check_disk_writable(LIVE, alias, lease=disk.lease(), domain_disks=others)
    assert err.value.code == "in_use_by_domain" and err.value.evidence["domain_disk"] == disk.by_id


def test_before_its_first_connection_a_libvirt_without_domains_is_listed_by_virsh_alone(tmp_path):
    """An idle host's listing (host/vm/virsh.py): no domain at all is the answer without opening a connection; any
    domain (the test driver's own ``test``) and the listing is made in-process, which is then the way."""
    empty = tmp_path / "no-domains.xml"
    empty.write_text("<node>\n</node>\n")

    async def listed(lc: LibvirtLifecycle) -> tuple[list[str], bool]:
        async with lc:
            return [d.name for d in await lc.list_agent_domains()], lc.opened

    assert run(listed(LibvirtLifecycle(f"test://{empty}"))) == ([], False)
    mine = spec()
    ours = LibvirtLifecycle(URI)

    async def define_then_list_fresh() -> tuple[list[str], bool]:
        try:
            await ours.define(mine)
            return await listed(LibvirtLifecycle(URI))  # a fresh object: virsh sees "test", so it opens
        finally:
            await _cleanup(ours, mine.domain_name)
            await ours.close()

    assert run(define_then_list_fresh()) == ([mine.domain_name], True)


def test_a_virsh_listing_past_the_call_deadline_is_libvirts_timeout(tmp_path):
    empty = tmp_path / "no-domains.xml"
    empty.write_text("<node>\n</node>\n")

    async def list_with_no_time() -> None:
        async with LibvirtLifecycle(f"test://{empty}", call_timeout_s=0.001) as lc:
            await lc.list_agent_domains()

    with pytest.raises(LibvirtError) as timed_out:
        run(list_with_no_time())
    assert timed_out.value.code == "libvirt_timeout" and timed_out.value.evidence["via"] == "virsh"
