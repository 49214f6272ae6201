"""The NVMe wipe commands against a real NVMe controller: QEMU's, inside a TCG lab guest (lab/nvme_guest.py).

One guest boot for the module. The agent's ``nvme_erase`` runs on this host and
sends its nvme-cli argv into the guest over SSH; the guest's kernel passes them
to QEMU's emulated controller, and this host reads the controller's backing file
to see what the erase did. QEMU 7.2 (Debian 12) implements Format NVM (user-data
erase; no crypto erase: FNA=0) but no Sanitize (SANICAP=0, the sanitize log page
is an invalid field): the sanitize tests pin that down, and the sanitize
polling is exercised over recorded log pages in test_nvmewipe.py instead.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from gpuaas_agent.contract.nvmewipe import FormatErase, NvmeEraseAction, WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import WipeProof
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.storage.nvmecaps import parse_capabilities, read_capabilities
from gpuaas_agent.host.storage.nvmewipe import WipeRefused, nvme_erase
from gpuaas_agent.host.storage.wipemethods.nvme import prove_erased
from gpuaas_agent.hostfs import HostRoot
from lab import nvme_guest
from tests.support.realdev import LoopDisk, RealDevices, require_root, sh

REPO = Path(__file__).resolve().parents[3]
RECORDED = REPO / "fixtures" / "nvme" / "qemu-7.2-emulated"
DEV = "/dev/nvme0n1"
BY_ID = "/dev/disk/by-id/nvme-QEMU_NVMe_Ctrl_GPUAASLABNVME0001"
PATTERN = b"tenant data \xa5" * 4096  # non-zero everywhere
LIVE = HostRoot.open("/")


class Lab:
    def __init__(self, guest, loop, conn) -> None:
        self.guest, self.loop, self.conn = guest, loop, conn
        self.run = nvme_guest.guest_runner(conn)

    def call(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, 300))

    def sh(self, *argv: str):
        return self.call(self.run(list(argv), timeout=120, check=False))

    def backing_is_pattern(self) -> bool:
        with open(self.guest.backing, "rb") as fh:
            return all(fh.read(len(PATTERN)) == PATTERN for _ in range(os.path.getsize(self.guest.backing) // len(PATTERN)))

    def backing_is_zero(self) -> bool:
        zero = bytes(1 << 20)
        with open(self.guest.backing, "rb") as fh:
            while chunk := fh.read(1 << 20):
                if chunk != zero[: len(chunk)]:
                    return False
        return True


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    require_root()
    work = tmp_path_factory.mktemp("nvme-guest")
    guest = nvme_guest.boot_nvme_guest(work, backing_mib=16)
    loop = asyncio.new_event_loop()
    conn = None
    try:
        # The tenant's data, written before boot through the backing file: the erase must remove it.
        with open(guest.backing, "r+b") as fh:
            for _ in range((16 << 20) // len(PATTERN)):
                fh.write(PATTERN)
        conn = loop.run_until_complete(nvme_guest.connect(guest))
        yield Lab(guest, loop, conn)
    finally:
        if conn is not None:
            conn.close()
            loop.run_until_complete(conn.wait_closed())
        guest.stop()
        loop.close()


def _lease_identity(lab: Lab) -> str:
    """What the agent's discovery would put in the lease for this namespace (sysfs wwid: QEMU's ids are ignored)."""
    done = lab.sh("cat", "/sys/block/nvme0n1/wwid")
    assert done.returncode == 0, done.stderr
    return "wwid:" + done.stdout.decode().strip()


def test_live_controller_answers_parse_to_the_recorded_capabilities(lab):
    live = lab.call(read_capabilities(DEV, 1, runner=lab.run))
    recorded = parse_capabilities(*(json.loads((RECORDED / n).read_text()) for n in ("id-ctrl.json", "id-ns.json")), 1,
                                  descs=json.loads((RECORDED / "ns-descs.json").read_text()),
                                  list_ns=json.loads((RECORDED / "list-ns.json").read_text()))
    assert live.controller.serial == nvme_guest.SERIAL and live.namespace.uuid == nvme_guest.NS_UUID
    for field in ("oacs", "fna", "sanicap", "cmic"):
        assert getattr(live.controller, field) == getattr(recorded.controller, field), field
    assert live.controller.format_supported and not live.controller.format_crypto_erase
    assert live.namespace.deallocated_reads_zero and live.active_nsids == [1]
    # list-ns --all (allocated namespaces, attached or not): the scope check's input. One namespace here.
    assert live.allocated_nsids == [1]


def test_sanitize_is_refused_as_unsupported_by_qemus_controller_and_nothing_is_sent(lab):
    with pytest.raises(WipeRefused) as refused:
        lab.call(nvme_erase(DEV, nsid=1, lease_identity=_lease_identity(lab), by_id=BY_ID, runner=lab.run,
                            policy=WipePolicy(method=WipeMethod.nvme_sanitize)))
    assert refused.value.code == "wipe_method_unsupported"
    assert refused.value.evidence["capabilities"]["controller"]["sanicap"] == 0
    # What QEMU 7.2 does with Sanitize when asked anyway: no status log, and the command is rejected.
    assert lab.sh("nvme", "sanitize-log", DEV, "--output-format=json").returncode != 0
    assert lab.sh("nvme", "sanitize", DEV, "--sanact=2").returncode != 0
    assert lab.backing_is_pattern()


def test_format_of_a_namespace_that_is_not_the_leased_one_is_refused_and_nothing_is_sent(lab):
    with pytest.raises(WipeRefused) as refused:
        lab.call(nvme_erase(DEV, nsid=1, lease_identity="nguid:000000000000000100a075244a103331", by_id=BY_ID,
                            runner=lab.run, policy=WipePolicy(method=WipeMethod.nvme_format)))
    assert refused.value.code == "wipe_identity_mismatch"
    assert refused.value.evidence["lease_identity"] == "nguid:000000000000000100a075244a103331"
    assert refused.value.evidence["serial"] == nvme_guest.SERIAL
    with pytest.raises(WipeRefused) as crypto:
        lab.call(nvme_erase(DEV, nsid=1, lease_identity=_lease_identity(lab), by_id=BY_ID, runner=lab.run,
                            policy=WipePolicy(method=WipeMethod.nvme_format, format_erase=FormatErase.crypto)))
    assert crypto.value.code == "wipe_method_unsupported" and "FNA bit 2" in crypto.value.message
    assert lab.backing_is_pattern()


def test_format_user_data_erase_runs_the_built_argv_on_the_controller_and_the_backing_file_reads_zero(lab, tmp_path):
    assert lab.backing_is_pattern()
    evidence = lab.call(nvme_erase(DEV, nsid=1, lease_identity=_lease_identity(lab), by_id=BY_ID, runner=lab.run,
                                   policy=WipePolicy(method=WipeMethod.nvme_format)))
    assert evidence.action is NvmeEraseAction.format_user_data
    assert evidence.argv[:3] == ["nvme", "format", DEV] and "--ses=1" in evidence.argv and "--lbaf=0" in evidence.argv
    assert evidence.zeros_guaranteed  # DLFEAT=1
    assert evidence.device_identity.startswith("wwid:nvme.1b36-")
    assert lab.backing_is_zero()
    # The guest sees the same: its namespace is still there, same size, reading zeroes.
    head = lab.sh("sh", "-c", "dd if=/dev/nvme0n1 bs=4096 count=256 2>/dev/null | od -An -tx1 | sort -u")
    assert head.stdout.split() == [b"00"] * 16 or set(head.stdout.split()) == {b"00", b"*"}
    # The agent's proof over what the controller left (the backing file as a read-only loop disk on this
    # host): verified, naming the method and the real controller's capability evidence.
    devices = RealDevices(tmp_path)
    try:
        dev = sh("losetup", "--find", "--show", "--read-only", str(lab.guest.backing)).strip()
        devices._push(f"losetup -d {dev}", lambda: sh("losetup", "-d", dev))
        disk = LoopDisk(image=lab.guest.backing, dev=dev, by_id=devices.by_id_link(f"../../{os.path.basename(dev)}"))
        checked = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
        proof = lab.call(prove_erased(LIVE, checked, dev, method=WipeMethod.nvme_format, nvme=evidence,
                                         policy=WipePolicy(method=WipeMethod.nvme_format), samples=8))
    finally:
        devices.close()
    assert proof.verified and proof.method is WipeMethod.nvme_format and not proof.zeroed_after
    assert proof.nvme.capabilities.controller.serial == nvme_guest.SERIAL and proof.whole_device is None
    assert WipeProof.model_validate_json(proof.model_dump_json()) == proof
