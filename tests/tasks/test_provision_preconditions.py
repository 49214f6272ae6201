"""Each host precondition of a provision, broken one at a time, is a refusal in validate (docs/safety.md §8).

The host is prepared as the package leaves it (``prepared_host``: a real OVS bridge owning the
gateway, a real dnsmasq reading the agent's hosts file, a seed dir QEMU can reach, a relay key);
the slot disk is a real loop device behind the recorded 8xH200 host. For every case the real
provision pipeline runs, fails in ``validate`` with the precondition's code, releases the lease,
leaves no slot record, and the slot disk's bytes are the same (sha256 of the whole disk).
"""

from __future__ import annotations

import hashlib
import subprocess
import uuid

import pytest

from gpuaas_agent.config import SliceConfig
from gpuaas_agent.contract.tasks import VmProvisionPayload
from gpuaas_agent.host.images.cache import ImageCache
from gpuaas_agent.host.vm.libvirt_lifecycle import LibvirtLifecycle
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.drivers import SliceDrivers
from tests.support.provision_inputs import TENANT_KEY, approved_slot_of_host, task_ctx
from tests.tasks.conftest import GATEWAY, PreparedHost, provision_failure, slice_loop_host

MiB = 1 << 20


@pytest.fixture
def loop_host(tmp_path):
    with slice_loop_host(tmp_path / "host", disk_bytes=32 * MiB) as host:
        yield host


def _disk_sha256(path: str) -> str:
    with open(path, "rb", buffering=0) as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _relay_key_world_readable(h: PreparedHost) -> dict:
    (h.relay_key.with_suffix("")).chmod(0o644)
    return {}


def _relay_key_not_ed25519(h: PreparedHost) -> dict:
    h.relay_key.write_text("ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 relay\n")
    return {}


def _seed_dir_missing(h: PreparedHost) -> dict:
    (h.work / "seeds").rmdir()
    return {}


def _seed_dir_behind_a_private_dir(h: PreparedHost) -> dict:
    private = h.work / "private"
    private.mkdir(mode=0o700)
    (private / "seeds").mkdir(mode=0o755)
    return {"seed_dir": private / "seeds"}


def _dnsmasq_stopped(h: PreparedHost) -> dict:
    h.stop_dnsmasq()
    return {}


def _dnsmasq_reads_another_hosts_file(h: PreparedHost) -> dict:
    elsewhere = h.work / "elsewhere-hosts"
    elsewhere.touch()
    return {"dnsmasq_hosts_file": elsewhere}


def _gateway_not_on_the_bridge(h: PreparedHost) -> dict:
    subprocess.run(["ip", "addr", "del", str(GATEWAY), "dev", h.bridge], check=True, capture_output=True,
                   timeout=30)
    return {}


def _wipe_policy_the_disk_cannot_carry_out(h: PreparedHost) -> dict:
    # The profile's release would nvme-format the disk: a loop device has no NVMe controller to ask.
    return {"wipe_policies": {"lab_tcg_1c_512m": {"method": "nvme_format"}}}


def _no_room_for_the_image(h: PreparedHost) -> dict:
    return {"image_size_bytes": 1 << 50}  # a declared 1 PiB image cannot fit in the cache


CASES = [
    (_relay_key_world_readable, "relay_key_permissions"),
    (_relay_key_not_ed25519, "relay_key_invalid"),
    (_seed_dir_missing, "seed_dir_missing"),
    (_seed_dir_behind_a_private_dir, "seed_dir_unreadable_by_qemu"),
    (_dnsmasq_stopped, "dnsmasq_not_running"),
    (_dnsmasq_reads_another_hosts_file, "dnsmasq_not_reading_hosts"),
    (_gateway_not_on_the_bridge, "bridge_gateway_missing"),
    (_no_room_for_the_image, "cache_space_insufficient"),
    (_wipe_policy_the_disk_cannot_carry_out, "nvme_caps_unreadable"),
]


@pytest.mark.parametrize("breakage,code", CASES, ids=[c[1] for c in CASES])
def test_a_broken_host_precondition_refuses_in_validate_with_the_disk_untouched(
        loop_host, tmp_path, prepared_host, breakage, code):
    over = breakage(prepared_host)
    size = over.pop("image_size_bytes", None)
    sh = SliceDrivers(host_root=loop_host.root, slice=SliceConfig(**prepared_host.slice_config(**over)),
                   images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle("test:///default"))
    store = StateStore.open(tmp_path / "state.db")
    image = {"url": "file:///nonexistent", "sha256": "0" * 64, **({"size_bytes": size} if size else {})}
    payload = VmProvisionPayload.from_wire({
        "allocation_id": str(uuid.uuid4()),
        "slot": approved_slot_of_host(loop_host, 0, ovs_bridge=prepared_host.bridge).model_dump(mode="json"),
        "image": image, "runtime_profile": "lab_tcg_1c_512m", "hostname": "tenant-vm", "user": "tenant",
        "ssh_authorized_keys": [TENANT_KEY]})
    ctx = task_ctx(store, f"t-{code}")
    disk = loop_host.disks[0].loop
    before = _disk_sha256(disk)

    failure = provision_failure(sh, payload, ctx)
    assert (failure.failed_step, failure.code) == ("validate", code), failure
    assert failure.disk_touched is False and "\n" not in failure.message
    assert failure.evidence, "a refusal names the evidence it read"
    assert store.leases() == [] and store.slot_state(0) is None
    assert [o.status.value for o in ctx.slot_outcomes] == ["reserved"]
    assert _disk_sha256(disk) == before
    store.close()


def test_a_prepared_host_passes_validate_and_takes_the_lease(loop_host, tmp_path, prepared_host):
    """The control case: the same host, nothing broken, gets past validate (the run stops at the image)."""
    sh = SliceDrivers(host_root=loop_host.root, slice=SliceConfig(**prepared_host.slice_config()),
                   images=ImageCache(tmp_path / "cache"), libvirt=LibvirtLifecycle("test:///default"))
    store = StateStore.open(tmp_path / "state.db")
    payload = VmProvisionPayload.from_wire({
        "allocation_id": str(uuid.uuid4()),
        "slot": approved_slot_of_host(loop_host, 0, ovs_bridge=prepared_host.bridge).model_dump(mode="json"),
        "image": {"url": "file:///nonexistent", "sha256": "0" * 64}, "runtime_profile": "lab_tcg_1c_512m",
        "hostname": "tenant-vm", "user": "tenant", "ssh_authorized_keys": [TENANT_KEY]})
    ctx = task_ctx(store, "t-control")

    failed = provision_failure(sh, payload, ctx)
    assert failed.failed_step == "image", failed  # validate (preconditions included) passed
    store.close()
