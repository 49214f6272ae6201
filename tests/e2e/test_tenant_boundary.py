"""A hostile tenant (or a buggy control plane) over the wire: no task crosses a tenant boundary.

Tenant B holds a running slice on one slot of the lab. Every case below is a task an attacker
could send: an image URL that reads B's disk, the agent's credentials or ``/dev/zero``; B's disk
under another name; a slot whose index, MAC, IP or devices do not belong together; a second slot
for B's allocation; tenant input that used to be checked only after the clone. For each the test
asserts the typed refusal and that the host is untouched: the bytes of every slot disk, the OVS
ports, the dnsmasq hosts file, the libvirt domains, the agent's leases and slot records, and the
image cache are what they were before, and B's VM still runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import uuid

import pytest

from gpuaas_agent.host.network.ovs import OvsDriver

B_SLOT = 7  # tenant B's slot; the attacks use the others


def _task(lab, task_type, payload, timeout=600):
    lab_, runner = lab
    return runner.run(lab_.task(task_type, payload, timeout=timeout), timeout=timeout + 30)


def _slot(lab, index):
    lab_, runner = lab
    if not lab_.approved:
        runner.run(lab_.approve_slots(), timeout=120)
    return next(s for s in lab_.approved if s.slot_index == index)


def _hash_device(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        for chunk in iter(lambda: fh.read(4 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _store_rows(lab_) -> dict:
    db = lab_.work / "state/state.db"
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        leases = conn.execute("SELECT slot_index, allocation_id FROM slot_lease ORDER BY slot_index").fetchall()
        records = conn.execute("SELECT slot_index, allocation_id, status FROM slot_state ORDER BY slot_index").fetchall()
    finally:
        conn.close()
    return {"leases": leases, "slot_records": records}


def _cache_listing(lab_) -> list[tuple[str, int]]:
    root = lab_.work / "images"
    if not root.exists():
        return []
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def snapshot(lab_) -> dict:
    """Everything a task could have changed on the host, in a form two calls can compare."""
    with OvsDriver(lab_.ovs_remote) as ovs:
        ports = sorted((p.name, p.allocation_id, p.slot_index) for p in ovs.list_agent_ports())
    return {
        "disks": {d.slot_index: _hash_device(d.loop) for d in lab_.host.disks},
        "ports": ports,
        "dnsmasq_hosts": (lab_.work / "dnsmasq/hosts").read_text(),
        "domains": lab_.domains(),
        "store": _store_rows(lab_),
        "image_cache": _cache_listing(lab_),
    }


@pytest.fixture(scope="module")
def tenant_b(lab):
    """Tenant B's running slice on ``B_SLOT``; released when the module is done."""
    lab_, _ = lab
    slot = _slot(lab, B_SLOT)
    payload = lab_.provision_payload(slot)
    result = _task(lab, "slice.vm_provision", payload, timeout=900)
    assert result.status.value == "succeeded", result.error
    yield {"allocation_id": payload["allocation_id"], "slot": slot, "vm": result.output["vm"],
           "hostname": payload["hostname"], "payload": payload}
    released = _task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], slot))
    assert released.status.value == "succeeded", released.error


@pytest.fixture(scope="module")
def report(lab):
    """The agent's own topology report (aliases of every disk come from it)."""
    result = _task(lab, "slice.topology_discover",
                   {"subnet": str(lab[0].settings.subnet), "ovs_bridge": lab[0].bridge}, timeout=120)
    assert result.status.value == "succeeded", result.error
    return result.output.get("report", result.output)


def _aliases(report, by_id: str) -> list[str]:
    disk = next(d for d in report["nvme_devices"] if by_id in [d["by_id"], *d["by_id_links"]])
    return [name for name in [disk["by_id"], *disk["by_id_links"]] if name != by_id]


def refused(lab, tenant_b, task_type: str, payload: dict, code: str, *, field: str | None = None):
    """Send the task; it must fail with ``code`` (naming ``field``) and leave the host exactly as it was."""
    lab_, _ = lab
    before = snapshot(lab_)
    result = _task(lab, task_type, payload)
    assert result.status.value == "failed", result
    assert result.error.code == code, result.error
    assert "\n" not in result.error.message and len(result.error.message) < 400, result.error.message
    if field is not None:
        assert field in json.dumps(result.error.evidence), result.error
    # Nothing was leased or written, so no slot is blocked and no lease stayed.
    assert all(o.status.value != "cleanup_blocked" for o in result.slot_outcomes), result.slot_outcomes
    after = snapshot(lab_)
    for part in before:
        assert after[part] == before[part], f"{part} changed by a refused {task_type} ({code})"
    assert lab_.domains()[tenant_b["vm"]] == "running"
    return result


def refused_after_its_own_disk(lab, tenant_b, payload: dict, code: str, index: int = 0):
    """A raw image streams onto the slot disk while it is hashed (docs/images.md): one found bad at its end
    was written to the attacker's own disk. The task fails with ``code``, that slot alone is cleanup_blocked
    until the attacker's own release wipes it, and then the host is exactly as before: the attack cost the
    attacker a wipe, and no neighbour anything."""
    lab_, _ = lab
    before = snapshot(lab_)
    result = _task(lab, "slice.vm_provision", payload)
    assert result.status.value == "failed", result
    assert result.error.code == code, result.error
    assert [(o.slot_index, o.status.value) for o in result.slot_outcomes] == [(index, "cleanup_blocked")]
    assert lab_.domains()[tenant_b["vm"]] == "running"
    released = _task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], _slot(lab, index)))
    assert released.status.value == "succeeded", released.error
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True
    after = snapshot(lab_)
    for part in before:
        assert after[part] == before[part], f"{part} differs after the attacker's {code} and its release"
    return result


def attacker(lab, index: int, **slot_changes) -> dict:
    """A new allocation's provision payload for slot ``index``, with fields of the slot changed."""
    slot = _slot(lab, index)
    payload = lab[0].provision_payload(slot.model_copy(update=slot_changes) if slot_changes else slot)
    return payload


def with_image(payload: dict, url: str, sha256: str | None = None, **extra) -> dict:
    return {**payload, "image": {"url": url, "sha256": sha256 or payload["image"]["sha256"], **extra}}


# -- images: only from where the config allows -------------------------------------------------

def test_an_image_url_naming_another_tenants_disk_is_refused(lab, tenant_b):
    b_disk = tenant_b["slot"].nvme_device
    assert os.path.islink(b_disk)  # the real link QEMU opens for B
    refused(lab, tenant_b, "slice.vm_provision", with_image(attacker(lab, 0), f"file://{b_disk}"),
            "image_url_refused")


def test_an_image_url_naming_the_agents_credentials_is_refused(lab, tenant_b):
    creds = lab[0].work / "state/enrollment.json"
    assert creds.exists()
    refused(lab, tenant_b, "slice.vm_provision", with_image(attacker(lab, 0), f"file://{creds}"),
            "image_url_refused")


def test_an_image_url_naming_dev_zero_is_refused(lab, tenant_b):
    refused(lab, tenant_b, "slice.vm_provision", with_image(attacker(lab, 0), "file:///dev/zero"),
            "image_url_refused")


def test_a_symlink_or_traversal_out_of_the_image_dir_is_refused(lab, tenant_b):
    image_dir = lab[0].image_path.parent
    link = image_dir / f"innocent-{uuid.uuid4().hex[:8]}.img"
    link.symlink_to(tenant_b["slot"].nvme_device)
    try:
        refused(lab, tenant_b, "slice.vm_provision", with_image(attacker(lab, 0), f"file://{link}"),
                "image_url_refused")
    finally:
        link.unlink()
    escape = f"file://{image_dir}/../../state/enrollment.json"
    refused(lab, tenant_b, "slice.vm_provision", with_image(attacker(lab, 0), escape), "image_url_refused")
    encoded = f"file://{image_dir}/%2e%2e/%2e%2e/state/enrollment.json"
    refused(lab, tenant_b, "slice.vm_provision", with_image(attacker(lab, 0), encoded), "image_url_refused")


def test_a_digest_mismatch_does_not_reveal_the_digest_of_what_was_read(lab, tenant_b):
    lab_, _ = lab
    payload = with_image(attacker(lab, 0), f"file://{lab_.image_path}", "1" * 64)
    result = refused_after_its_own_disk(lab, tenant_b, payload, "digest_mismatch")
    assert lab_.image_sha256 not in result.model_dump_json()
    assert "actual_sha256" not in json.dumps(result.error.evidence)


def test_a_download_larger_than_its_declared_size_is_refused_and_leaves_no_partial(lab, tenant_b):
    lab_, _ = lab
    blob = lab_.image_path.parent / f"oversized-{uuid.uuid4().hex[:8]}.img"
    data = os.urandom(2 << 20)
    blob.write_bytes(data)
    try:
        payload = with_image(attacker(lab, 0), f"file://{blob}", hashlib.sha256(data).hexdigest(),
                             size_bytes=1 << 20)
        # The source announces its size (a file's, a Content-Length): refused before the disk is touched.
        refused(lab, tenant_b, "slice.vm_provision", payload, "too_large")
    finally:
        blob.unlink()


# -- a disk is what it is, not what it is called ---------------------------------------------------

def test_another_tenants_disk_under_another_name_is_refused(lab, tenant_b, report):
    b_disk = tenant_b["slot"].nvme_device
    aliases = _aliases(report, b_disk)
    assert aliases, "the recorded host names every NVMe namespace more than once"
    for alias in aliases:
        # B's own slot under another disk name: the slot is B's.
        refused(lab, tenant_b, "slice.vm_provision", attacker(lab, B_SLOT, nvme_device=alias), "slot_busy")
        # Another slot carrying B's disk under another name: not that slot's disk.
        refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 0, nvme_device=alias), "slot_mismatch",
                field="nvme_device")


def test_a_release_naming_another_tenants_slot_touches_nothing(lab, tenant_b, report):
    lab_, _ = lab
    before = snapshot(lab_)
    # Another allocation's release of B's slot: refused, nothing stopped, nothing wiped.
    result = _task(lab, "slice.vm_release", lab_.release_payload(str(uuid.uuid4()), tenant_b["slot"]))
    assert result.status.value in ("failed", "succeeded"), result
    if result.status.value == "succeeded":
        assert result.output.get("already_gone") is True, result.output
    else:
        assert result.error.code in ("slot_leased_by_other", "lease_conflict", "slot_busy"), result.error
    assert snapshot(lab_) == before
    assert lab_.domains()[tenant_b["vm"]] == "running"


# -- the approved slot is the only truth -----------------------------------------------------------

def test_a_slot_index_that_does_not_belong_to_its_devices_is_refused(lab, tenant_b):
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 2, slot_index=99), "slot_mismatch",
            field="slot_index")
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 2, slot_index=3), "slot_mismatch")


def test_a_slot_index_sent_as_a_string_is_refused_at_the_edge(lab, tenant_b):
    payload = attacker(lab, 2)
    payload["slot"] = {**payload["slot"], "slot_index": "2"}
    refused(lab, tenant_b, "slice.vm_provision", payload, "invalid_payload", field="slot_index")


def test_another_slots_mac_gpu_vf_or_ip_is_refused(lab, tenant_b):
    b = tenant_b["slot"]
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 1, mac=b.mac), "slot_mismatch", field="mac")
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 1, gpu_pci_address=b.gpu_pci_address),
            "slot_mismatch", field="gpu_pci_address")
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 1, fabric_vf_pci_address=b.fabric_vf_pci_address),
            "slot_mismatch", field="fabric_vf_pci_address")
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 1, private_ip=b.private_ip), "slot_mismatch",
            field="private_ip")


def test_an_ip_that_is_the_gateway_or_outside_the_subnet_is_refused_before_the_disk(lab, tenant_b):
    lab_, _ = lab
    net = lab_.settings.subnet
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 1, private_ip=lab_.gateway), "ip_reserved",
            field="private_ip")
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 1, private_ip=str(net.broadcast_address)),
            "ip_reserved", field="private_ip")
    refused(lab, tenant_b, "slice.vm_provision", attacker(lab, 1, private_ip="192.0.2.10"), "ip_outside_subnet",
            field="private_ip")
    payload = attacker(lab, 1)
    payload["slot"] = {**payload["slot"], "private_ip": f"{payload['slot']['private_ip']}\n"}
    refused(lab, tenant_b, "slice.vm_provision", payload, "invalid_payload", field="private_ip")


# -- undo touches only what this task created ------------------------------------------------------

def test_a_second_slot_for_an_allocation_that_holds_one_is_refused_and_its_vm_keeps_running(lab, tenant_b):
    payload = attacker(lab, 1)
    payload["allocation_id"] = tenant_b["allocation_id"]
    refused(lab, tenant_b, "slice.vm_provision", payload, "allocation_has_slot")


# -- tenant input is checked before anything is leased or written ----------------------------------

def test_hostile_ssh_keys_are_refused_at_the_edge(lab, tenant_b):
    good = lab[0].tenant_key
    kind, blob = good.split()[:2]
    for bad in (
        f"{kind} {blob}" + " x" * 300_000,  # 600 kB
        f"{kind} {blob} comment\nssh-ed25519 {blob} injected",  # a second line
        f"ssh-dss {blob}",  # unknown / mismatched type
        f"{kind} not-base64!!",
        "",
    ):
        payload = {**attacker(lab, 1), "ssh_authorized_keys": [bad]}
        refused(lab, tenant_b, "slice.vm_provision", payload, "invalid_payload", field="ssh_authorized_keys")
    payload = {**attacker(lab, 1), "ssh_authorized_keys": [good] * 33}
    refused(lab, tenant_b, "slice.vm_provision", payload, "invalid_payload", field="ssh_authorized_keys")


def test_hostile_user_and_host_names_are_refused(lab, tenant_b):
    for field, value in (("hostname", "ok-name\n"), ("hostname", "a" * 64), ("user", "root\n"),
                         ("user", "te;nant"), ("hostname", "../x")):
        payload = {**attacker(lab, 1), field: value}
        refused(lab, tenant_b, "slice.vm_provision", payload, "invalid_payload", field=field)
    payload = {**attacker(lab, 1), "hostname": tenant_b["hostname"]}
    refused(lab, tenant_b, "slice.vm_provision", payload, "hostname_in_use", field="hostname")


def test_an_unknown_runtime_profile_is_refused(lab, tenant_b):
    payload = {**attacker(lab, 1), "runtime_profile": "h200_everything_free"}
    refused(lab, tenant_b, "slice.vm_provision", payload, "unknown_profile", field="runtime_profile")


def test_after_every_attack_a_clean_provision_of_an_attacked_slot_still_works(lab, tenant_b):
    """The refusals left nothing behind: slot 1, attacked above, provisions and releases normally."""
    lab_, _ = lab
    slot = _slot(lab, 1)
    payload = lab_.provision_payload(slot)
    result = _task(lab, "slice.vm_provision", payload, timeout=900)
    assert result.status.value == "succeeded", result.error
    assert lab_.domains()[tenant_b["vm"]] == "running"
    released = _task(lab, "slice.vm_release", lab_.release_payload(payload["allocation_id"], slot))
    assert released.status.value == "succeeded", released.error
    assert released.output["cleanup_proof"]["wipe"]["verified"] is True
