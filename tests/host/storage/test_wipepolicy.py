"""Wipe policies on real loop disks: the method a profile names, refusals before any write, and the proof."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from gpuaas_agent.config import ConfigError, load_config
from gpuaas_agent.contract.nvmewipe import NvmeEraseAction, NvmeEraseEvidence, WipeMethod, WipePolicy
from gpuaas_agent.contract.runtime import PROFILES
from gpuaas_agent.contract.storage import ProofGuarantee, WipeProof
from gpuaas_agent.guards.disk import check_disk_writable
from gpuaas_agent.host.images.clone import target_is_zero
from gpuaas_agent.host.storage.nvmecaps import parse_capabilities
from gpuaas_agent.host.storage.nvmewipe import WipeRefused
from gpuaas_agent.host.storage.wipemethods.nvme import prove_erased
from gpuaas_agent.host.storage.wipepolicy import (
    check_wipe_policy,
    policy_for_profile,
    read_whole_device,
    resolve_handover,
    wipe_slot_disk,
)
from gpuaas_agent.hostfs import HostRoot
from tests.support.realdev import MiB, read_bytes, sh, write_bytes

LIVE = HostRoot.open("/")
MICRON = Path(__file__).resolve().parents[3] / "fixtures" / "nvme" / "h200-slot0-micron-7450.synth"


def _used_disk(realdev, size_mib: int = 32):
    disk = realdev.disk(size_mib, partitions_mib=[size_mib // 2])
    realdev.mkfs_ext4(disk.partitions[0])
    write_bytes(disk.dev, size_mib * MiB - 4096, b"\x5a" * 4096)
    return disk


def _crypto_erase_evidence(zeros_guaranteed: bool) -> NvmeEraseEvidence:
    docs = [json.loads((MICRON / f).read_text()) for f in ("id-ctrl.json", "id-ns.json", "ns-descs.json", "list-ns.json")]
    caps = parse_capabilities(docs[0], docs[1], 1, descs=docs[2], list_ns=docs[3])
    return NvmeEraseEvidence(action=NvmeEraseAction.format_crypto, argv=["nvme", "format"], capabilities=caps,
                             lease_identity="nguid:x", device_identity="nguid:x", zeros_guaranteed=zeros_guaranteed,
                             duration_s=1.0)


def test_zeroout_policy_writes_zeroes_and_the_proof_names_the_policy(realdev):
    disk = _used_disk(realdev)
    proof = asyncio.run(wipe_slot_disk(WipePolicy(method=WipeMethod.zeroout), LIVE, disk.by_id,
                                       lease=disk.lease(), samples=4, seed=3))
    assert proof.verified and proof.method is WipeMethod.zeroout and proof.policy is WipeMethod.zeroout
    assert proof.signatures_found == [] and proof.nvme is None and proof.whole_device is None
    assert read_bytes(disk.dev, 32 * MiB - 4096, 4096) == bytes(4096)
    assert WipeProof.model_validate_json(proof.model_dump_json()) == proof


def test_default_policy_on_a_disk_that_is_no_nvme_namespace_resolves_to_write_zeroes(realdev):
    disk = _used_disk(realdev)
    proof = asyncio.run(wipe_slot_disk(WipePolicy(), LIVE, disk.by_id, lease=disk.lease(), samples=4))
    assert proof.verified and proof.policy is WipeMethod.zeroout and proof.method is WipeMethod.zeroout
    assert proof.guarantee is ProofGuarantee.write_zeroes and proof.covers_every_byte


def test_opt_in_discard_is_proved_by_reading_every_byte(realdev):
    disk = _used_disk(realdev)
    proof = asyncio.run(wipe_slot_disk(WipePolicy(method=WipeMethod.discard), LIVE, disk.by_id,
                                       lease=disk.lease(), samples=4))
    assert proof.verified and proof.policy is WipeMethod.discard
    assert proof.guarantee is ProofGuarantee.whole_device_read
    assert proof.whole_device is not None and proof.whole_device.all_zero
    assert proof.whole_device.bytes_read == 32 * MiB


def test_the_lease_handover_is_resolved_once_with_its_evidence_and_gpu_state(realdev):
    disk = _used_disk(realdev)
    handover, evidence = asyncio.run(resolve_handover(PROFILES["h200_1g_24c_64g"], {}, LIVE, disk.by_id,
                                                      lease=disk.lease(), clock=lambda: 7.0))
    assert handover.wipe.method is WipeMethod.zeroout and handover.zeros_guaranteed
    assert handover.gpu == PROFILES["h200_1g_24c_64g"].gpu_handover and handover.fixed_at == 7.0
    assert "not an NVMe namespace" in evidence["reason"]
    lab, _ = asyncio.run(resolve_handover(PROFILES["lab_tcg_1c_512m"], {}, LIVE, disk.by_id, lease=disk.lease()))
    assert lab.gpu is None  # the lab profile passes no GPU through: nothing to reset
    # A host override that opts into discard is kept, and says zeroes are not guaranteed (whole read at release).
    opted, _ = asyncio.run(resolve_handover(PROFILES["lab_tcg_1c_512m"],
                                            {"lab_tcg_1c_512m": WipePolicy(method=WipeMethod.discard)},
                                            LIVE, disk.by_id, lease=disk.lease()))
    assert opted.wipe.method is WipeMethod.discard and not opted.zeros_guaranteed
    assert read_bytes(disk.dev, 32 * MiB - 4096, 4096) == b"\x5a" * 4096  # resolving writes nothing


@pytest.mark.parametrize("method", [WipeMethod.nvme_format, WipeMethod.nvme_sanitize])
def test_nvme_method_on_a_disk_that_is_not_an_nvme_namespace_is_refused_with_nothing_written(realdev, method):
    disk = _used_disk(realdev)
    with pytest.raises(WipeRefused) as refused:
        asyncio.run(wipe_slot_disk(WipePolicy(method=method), LIVE, disk.by_id, lease=disk.lease()))
    assert refused.value.code == "wipe_method_unsupported"
    assert refused.value.evidence["disk"]["by_id"] == disk.by_id and "nsid" in refused.value.evidence["reason"]
    assert "ext4" in sh("blkid", "-p", disk.partitions[0])
    assert read_bytes(disk.dev, 32 * MiB - 4096, 4096) == b"\x5a" * 4096


def test_erase_that_leaves_ciphertext_is_read_whole_then_zeroed_and_proved(realdev):
    disk = realdev.disk(16)
    write_bytes(disk.dev, 0, os.urandom(16 * MiB))  # what a crypto erase leaves: noise, no signature
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    proof = asyncio.run(prove_erased(LIVE, evidence, disk.dev, method=WipeMethod.nvme_format,
                                     policy=WipePolicy(method=WipeMethod.nvme_format),
                                     nvme=_crypto_erase_evidence(zeros_guaranteed=False), samples=4))
    assert proof.verified and proof.zeroed_after and proof.method is WipeMethod.zeroout
    assert proof.guarantee is ProofGuarantee.write_zeroes
    assert proof.whole_device is not None and not proof.whole_device.all_zero
    assert proof.whole_device.first_nonzero_offset is not None and proof.whole_device.first_nonzero_offset < 64
    assert proof.nvme.action is NvmeEraseAction.format_crypto and proof.policy is WipeMethod.nvme_format
    assert read_whole_device(disk.dev, 16 * MiB).all_zero


def test_erase_without_a_zero_promise_that_did_read_zero_is_proved_by_the_whole_device_read(realdev):
    disk = realdev.disk(16)
    evidence = check_disk_writable(LIVE, disk.by_id, lease=disk.lease())
    proof = asyncio.run(prove_erased(LIVE, evidence, disk.dev, method=WipeMethod.nvme_sanitize,
                                     policy=WipePolicy(method=WipeMethod.nvme_sanitize),
                                     nvme=_crypto_erase_evidence(zeros_guaranteed=False), samples=4))
    assert proof.verified and not proof.zeroed_after and proof.method is WipeMethod.nvme_sanitize
    assert proof.whole_device.all_zero and proof.whole_device.bytes_read == 16 * MiB
    assert proof.guarantee is ProofGuarantee.whole_device_read and target_is_zero(proof, evidence)


def test_a_proof_from_before_wipe_policies_still_parses():
    old = {"by_id": "/dev/disk/by-id/nvme-eui.0001", "kernel_name": "nvme0n1", "dev": "259:1", "method": "discard",
           "bytes": 4096, "seed": 1, "samples": [], "signatures_found": [], "partitions_left": [], "duration_s": 0.1,
           "verified": True}
    proof = WipeProof.from_wire(old)
    assert proof.policy is None and proof.nvme is None and not proof.zeroed_after
    # It claims only its samples: a clone after it writes every zero, never --target-is-zero.
    assert proof.guarantee is ProofGuarantee.sampled and not proof.covers_every_byte


def test_profile_policy_comes_from_the_catalog_unless_the_host_overrides_it():
    assert all(p.wipe_policy == WipePolicy() for p in PROFILES.values())  # auto: resolved from the device
    assert WipePolicy().method is WipeMethod.auto
    sanitize = WipePolicy(method=WipeMethod.nvme_sanitize)
    assert policy_for_profile("h200_1g_24c_64g", {"h200_1g_24c_64g": sanitize}) == sanitize
    assert policy_for_profile("lab_tcg_1c_512m", {"h200_1g_24c_64g": sanitize}) == WipePolicy()


def test_config_takes_wipe_policies_per_known_profile_and_refuses_unknown_ones(tmp_path):
    good = tmp_path / "agent.toml"
    good.write_text('[slice.wipe_policies.h200_1g_24c_64g]\nmethod = "nvme_format"\nformat_erase = "crypto"\n')
    config = load_config(good)
    assert config.slice.wipe_policies["h200_1g_24c_64g"].method is WipeMethod.nvme_format
    bad = tmp_path / "bad.toml"
    bad.write_text('[slice.wipe_policies.no_such_profile]\nmethod = "zeroout"\n')
    with pytest.raises(ConfigError, match="no_such_profile"):
        load_config(bad)
    worse = tmp_path / "worse.toml"
    worse.write_text('[slice.wipe_policies.h200_1g_24c_64g]\nmethod = "shred"\n')
    with pytest.raises(ConfigError):
        load_config(worse)


def test_validate_can_prove_a_policy_before_the_tenant_writes_and_refuses_an_impossible_one(realdev):
    disk = _used_disk(realdev)
    assert asyncio.run(check_wipe_policy(WipePolicy(), LIVE, disk.by_id, lease=disk.lease())) == {
        "policy": "auto", "zeros_guaranteed": True}
    with pytest.raises(WipeRefused) as refused:
        asyncio.run(check_wipe_policy(WipePolicy(method=WipeMethod.nvme_sanitize), LIVE, disk.by_id,
                                      lease=disk.lease()))
    assert refused.value.code == "wipe_method_unsupported"
    assert read_bytes(disk.dev, 32 * MiB - 4096, 4096) == b"\x5a" * 4096
