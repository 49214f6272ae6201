"""NVMe capability parsing and method choice over recorded/synthetic nvme-cli answers (fixtures/nvme/).

The H200 slot drive cannot exist here: its nvme-cli answers are replayed from
fixtures by a runner that serves them per argv and records every command it was
asked to run, so "nothing was sent" is checked on the commands themselves.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from gpuaas_agent.contract.nvmewipe import (
    FormatErase,
    NvmeEraseAction,
    SanitizeAction,
    WipeMethod,
    WipePolicy,
)
from gpuaas_agent.host.run import Completed
from gpuaas_agent.host.storage.nvmecaps import (
    NvmeCapsError,
    device_identities,
    normalize_identity,
    parse_capabilities,
    parse_id_ctrl,
    parse_sanitize_log,
)
from gpuaas_agent.host.storage.nvmewipe import (
    NvmeEraseError,
    WipeRefused,
    build_argv,
    check_scope,
    choose_action,
    nvme_erase,
    plan_nvme_erase,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "nvme"
MICRON = "h200-slot0-micron-7450.synth"
QEMU = "qemu-7.2-emulated"
SLOT0_NGUID = "nguid:000000000000000100a075244a103331"  # the synthetic H200 host's slot 0 (lab/synth_host.py)
SLOT1_NGUID = "nguid:000000000000000100a075244a10dcab"
DEV = "/dev/nvme3n1"
BY_ID = "/dev/disk/by-id/nvme-eui.000000000000000100a075244a103331"


def _doc(name: str, file: str) -> dict:
    return json.loads((FIXTURES / name / file).read_text())


def _answers(name: str) -> dict[str, dict]:
    return {cmd: _doc(name, f"{cmd}.json") for cmd in ("id-ctrl", "id-ns", "ns-descs", "list-ns")}


def _caps(name: str, list_ns_all: dict | None = None, **changes):
    """The fixture's answers; ``list-ns --all`` answers like ``list-ns`` (no detached namespace) unless given."""
    answers = _answers(name)
    for cmd, update in changes.items():
        answers[cmd.replace("_", "-")].update(update)
    return parse_capabilities(answers["id-ctrl"], answers["id-ns"], 1, descs=answers["ns-descs"],
                              list_ns=answers["list-ns"], list_ns_all=list_ns_all or answers["list-ns"])


class ReplayRunner:
    """Answers nvme-cli read commands from a fixture; erase commands succeed and are recorded."""

    def __init__(self, name: str, sanitize_logs: list[dict] | None = None, **changes) -> None:
        self.answers = _answers(name)
        for cmd, update in changes.items():
            self.answers[cmd.replace("_", "-")].update(update)
        self.sanitize_logs = list(sanitize_logs or [])
        self.calls: list[list[str]] = []

    async def __call__(self, argv, *, timeout, check=True, **_):
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        if argv[1] == "list-ns" and "--all" in argv and "list-ns-all" in self.answers:
            out = json.dumps(self.answers["list-ns-all"]).encode()
        elif argv[1] in self.answers:
            out = json.dumps(self.answers[argv[1]]).encode()
        elif argv[1] == "sanitize-log":
            out = json.dumps(self.sanitize_logs.pop(0)).encode()
        else:
            out = b""
        return Completed(argv=tuple(argv), returncode=0, stdout=out, stderr=b"")

    def erases(self) -> list[list[str]]:
        return [c for c in self.calls if c[1] in ("format", "sanitize")]


def test_recorded_and_synthetic_answers_parse_into_the_capability_model():
    micron, qemu = _caps(MICRON), _caps(QEMU)
    assert (micron.controller.serial, micron.controller.model) == ("23174A103331", "Micron_7450_MTFDKCC3T8TFS")
    assert micron.controller.format_crypto_erase and micron.controller.sanitize_crypto_erase
    assert micron.controller.sanitize_block_erase and not micron.controller.sanitize_overwrite
    assert micron.namespace.deallocated_reads_zero and micron.namespace.nsze * micron.namespace.lba_bytes == 7501476528 * 512
    assert qemu.controller.format_supported and not qemu.controller.format_crypto_erase and qemu.controller.sanicap == 0
    assert qemu.namespace.uuid == "6c616267-6e76-6d65-0000-000000000001" and qemu.namespace.nguid is None


def test_controller_identity_covers_every_spelling_the_lease_can_hold():
    assert SLOT0_NGUID in device_identities(_caps(MICRON))
    # sysfs spells an EUI-64 with spaces and the disk identity joins them with "_"
    assert normalize_identity("eui:6c_61_62_67_6e_76_6d_01") in device_identities(_caps(QEMU))
    # the kernel's fallback wwid (QEMU: namespace ids ignored by quirk), exactly as the guest's sysfs showed it
    assert ("wwid:nvme.1b36-4750554141534c41424e564d4530303031-51454d55204e564d65204374726c-00000001"
            in device_identities(_caps(QEMU)))


def test_an_answer_missing_a_capability_field_is_a_typed_error_not_a_guess():
    doc = _doc(QEMU, "id-ctrl.json")
    del doc["sanicap"]
    with pytest.raises(NvmeCapsError) as err:
        parse_id_ctrl(doc)
    assert err.value.code == "nvme_caps_unreadable" and err.value.evidence["field"] == "sanicap"
    with pytest.raises(NvmeCapsError):
        parse_id_ctrl({**_doc(QEMU, "id-ctrl.json"), "fna": "crypto"})


@pytest.mark.parametrize(("name", "policy", "action"), [
    (MICRON, WipePolicy(method=WipeMethod.nvme_format), NvmeEraseAction.format_crypto),
    (MICRON, WipePolicy(method=WipeMethod.nvme_format, format_erase=FormatErase.user_data),
     NvmeEraseAction.format_user_data),
    (QEMU, WipePolicy(method=WipeMethod.nvme_format), NvmeEraseAction.format_user_data),
    (MICRON, WipePolicy(method=WipeMethod.nvme_sanitize), NvmeEraseAction.sanitize_crypto_erase),
    (MICRON, WipePolicy(method=WipeMethod.nvme_sanitize, sanitize_action=SanitizeAction.block_erase),
     NvmeEraseAction.sanitize_block_erase),
])  # fmt: skip
def test_method_is_chosen_from_the_reported_capability(name, policy, action):
    assert choose_action(policy, _caps(name)) is action


@pytest.mark.parametrize(("name", "policy", "reason"), [
    (QEMU, WipePolicy(method=WipeMethod.nvme_sanitize), "SANICAP 0x0"),
    (QEMU, WipePolicy(method=WipeMethod.nvme_format, format_erase=FormatErase.crypto), "FNA bit 2"),
    (MICRON, WipePolicy(method=WipeMethod.nvme_sanitize, sanitize_action=SanitizeAction.overwrite), "overwrite"),
])  # fmt: skip
def test_a_method_the_device_does_not_report_is_refused_with_the_capability_evidence(name, policy, reason):
    with pytest.raises(WipeRefused) as refused:
        choose_action(policy, _caps(name))
    assert refused.value.code == "wipe_method_unsupported" and reason in refused.value.evidence["reason"]
    assert "sanicap" in refused.value.evidence["capabilities"]["controller"]


def test_format_without_the_format_command_is_refused():
    with pytest.raises(WipeRefused, match="OACS bit 1"):
        choose_action(WipePolicy(method=WipeMethod.nvme_format), _caps(QEMU, id_ctrl={"oacs": 0x8}))


def test_sanitize_on_a_controller_with_another_namespace_is_refused_as_beyond_the_lease():
    caps = _caps(MICRON, list_ns={"nsid_list": [{"nsid": 1}, {"nsid": 2}]})
    with pytest.raises(WipeRefused) as refused:
        check_scope(NvmeEraseAction.sanitize_crypto_erase, caps)
    assert refused.value.code == "wipe_scope_exceeds_lease" and refused.value.evidence["active_nsids"] == [1, 2]
    # A per-namespace format (FNA bits 0 and 1 clear) reaches only the leased namespace.
    check_scope(NvmeEraseAction.format_crypto, caps)
    with pytest.raises(WipeRefused, match="every namespace"):
        check_scope(NvmeEraseAction.format_crypto, _caps(MICRON, id_ctrl={"fna": 0x6},
                                                         list_ns={"nsid_list": [{"nsid": 1}, {"nsid": 2}]}))
    with pytest.raises(WipeRefused, match="whole NVM subsystem"):
        check_scope(NvmeEraseAction.sanitize_block_erase, _caps(MICRON, id_ctrl={"cmic": 0x2}))


def test_a_detached_namespace_is_beyond_the_lease_for_any_erase_that_reaches_every_namespace():
    """list-ns shows attached namespaces only; a sanitize (or an all-namespace format) erases detached ones too."""
    detached = {"nsid_list": [{"nsid": 1}, {"nsid": 3}]}
    caps = _caps(MICRON, list_ns_all=detached)
    assert caps.active_nsids == [1] and caps.allocated_nsids == [1, 3]
    with pytest.raises(WipeRefused) as refused:
        check_scope(NvmeEraseAction.sanitize_crypto_erase, caps)
    assert refused.value.code == "wipe_scope_exceeds_lease"
    assert refused.value.evidence["beyond_lease"] == ["detached namespace 3"]
    assert "detached namespace 3" in refused.value.message
    with pytest.raises(WipeRefused, match="detached namespace 3"):
        check_scope(NvmeEraseAction.format_crypto, _caps(MICRON, list_ns_all=detached, id_ctrl={"fna": 0x6}))
    check_scope(NvmeEraseAction.format_crypto, caps)  # a per-namespace format leaves namespace 3 alone


def test_a_controller_that_cannot_list_its_allocated_namespaces_is_refused_a_subsystem_wide_erase():
    answers = _answers(MICRON)
    caps = parse_capabilities(answers["id-ctrl"], answers["id-ns"], 1, descs=answers["ns-descs"],
                              list_ns=answers["list-ns"], list_ns_all=None)
    with pytest.raises(WipeRefused) as refused:
        check_scope(NvmeEraseAction.sanitize_block_erase, caps)
    assert refused.value.evidence["allocated_nsids"] is None
    assert "did not list" in refused.value.evidence["beyond_lease"][0]


def test_a_planned_sanitize_on_a_subsystem_with_a_detached_namespace_sends_nothing():
    runner = ReplayRunner(MICRON)
    runner.answers["list-ns-all"] = {"nsid_list": [{"nsid": 1}, {"nsid": 2}]}
    with pytest.raises(WipeRefused) as refused:
        asyncio.run(nvme_erase(DEV, nsid=1, lease_identity=SLOT0_NGUID, by_id=BY_ID, runner=runner,
                               policy=WipePolicy(method=WipeMethod.nvme_sanitize)))
    assert refused.value.code == "wipe_scope_exceeds_lease" and runner.erases() == []


def test_auto_resolves_to_a_crypto_erase_only_where_erased_blocks_read_zero_and_the_scope_allows():
    from gpuaas_agent.host.storage.wipepolicy import AUTO_CANDIDATES, STRICTEST_CANDIDATES, choose_from_capabilities

    caps = _caps(MICRON)
    assert caps.namespace.deallocated_reads_zero
    policy, zeros, evidence = choose_from_capabilities(caps, AUTO_CANDIDATES, require_zeros=True)
    assert policy.method is WipeMethod.nvme_sanitize and policy.sanitize_action is SanitizeAction.crypto_erase
    assert zeros and evidence["action"] == "sanitize_crypto_erase"
    # Another namespace on the subsystem: no sanitize (subsystem-wide); the per-namespace crypto format remains.
    shared = _caps(MICRON, list_ns={"nsid_list": [{"nsid": 1}, {"nsid": 2}]})
    policy, zeros, evidence = choose_from_capabilities(shared, AUTO_CANDIDATES, require_zeros=True)
    assert policy.method is WipeMethod.nvme_format and policy.format_erase is FormatErase.crypto
    assert evidence["not_chosen"][0]["code"] == "wipe_scope_exceeds_lease"
    # Erased blocks not promised to read zero: no crypto erase (it would need a whole read); Write Zeroes.
    noisy = _caps(MICRON, id_ns={"dlfeat": 0})
    policy, zeros, evidence = choose_from_capabilities(noisy, AUTO_CANDIDATES, require_zeros=True)
    assert policy.method is WipeMethod.zeroout and zeros
    assert {r["code"] for r in evidence["not_chosen"]} == {"zeroes_not_guaranteed"}
    # QEMU's controller: no sanitize, no crypto format: Write Zeroes.
    assert choose_from_capabilities(_caps(QEMU), AUTO_CANDIDATES, require_zeros=True)[0].method is \
        WipeMethod.zeroout
    # A lease from before handover policies takes the strictest: Sanitize block erase where offered.
    strict, zeros, _ = choose_from_capabilities(noisy, STRICTEST_CANDIDATES, require_zeros=False)
    assert strict.sanitize_action is SanitizeAction.block_erase and not zeros  # proved by a whole-device read
    assert choose_from_capabilities(_caps(QEMU), STRICTEST_CANDIDATES, require_zeros=False)[0].format_erase is \
        FormatErase.user_data


def test_argv_keeps_the_lba_format_and_names_the_namespace():
    caps = _caps(MICRON)
    policy = WipePolicy(method=WipeMethod.nvme_format, timeout_s=600)
    assert build_argv(NvmeEraseAction.format_crypto, DEV, caps, policy) == [
        "nvme", "format", DEV, "--namespace-id=1", "--lbaf=0", "--ses=2", "--timeout=600000", "--force"]
    assert build_argv(NvmeEraseAction.sanitize_overwrite, DEV, caps, policy) == [
        "nvme", "sanitize", DEV, "--sanact=3", "--owpass=1", "--ovrpat=0"]


def test_a_leased_identity_the_controller_does_not_answer_to_is_refused_before_any_erase():
    runner = ReplayRunner(MICRON)
    with pytest.raises(WipeRefused) as refused:
        asyncio.run(nvme_erase(DEV, nsid=1, lease_identity=SLOT1_NGUID, by_id=BY_ID, runner=runner,
                               policy=WipePolicy(method=WipeMethod.nvme_sanitize)))
    assert refused.value.code == "wipe_identity_mismatch"
    assert SLOT1_NGUID in refused.value.message and SLOT0_NGUID in refused.value.message
    assert refused.value.evidence["device_identities"][0] == SLOT0_NGUID
    assert runner.erases() == []


def test_sanitize_is_polled_through_the_status_log_until_it_completes():
    logs = [_doc(MICRON, "sanitize-log-running.json"), _doc(MICRON, "sanitize-log-done.json")]
    runner = ReplayRunner(MICRON, sanitize_logs=logs)
    evidence = asyncio.run(nvme_erase(DEV, nsid=1, lease_identity=SLOT0_NGUID, by_id=BY_ID, runner=runner,
                                      policy=WipePolicy(method=WipeMethod.nvme_sanitize)))
    assert runner.erases() == [["nvme", "sanitize", DEV, "--sanact=4"]]
    assert evidence.action is NvmeEraseAction.sanitize_crypto_erase and evidence.status_polls == 2
    assert evidence.estimated_s == 4 and evidence.final_status.status == 1
    assert evidence.zeros_guaranteed and evidence.device_identity == SLOT0_NGUID


def test_a_failed_sanitize_in_the_status_log_is_a_wipe_failure():
    failed = copy.deepcopy(_doc(MICRON, "sanitize-log-done.json"))
    failed["nvme0n1"]["sstat"]["status"] = "(3) Sanitize failed."
    runner = ReplayRunner(MICRON, sanitize_logs=[failed])
    with pytest.raises(NvmeEraseError) as err:
        asyncio.run(nvme_erase(DEV, nsid=1, lease_identity=SLOT0_NGUID, by_id=BY_ID, runner=runner,
                               policy=WipePolicy(method=WipeMethod.nvme_sanitize)))
    assert err.value.code == "wipe_failed" and err.value.evidence["status"]["status"] == 3


def test_sanitize_still_running_at_the_deadline_times_out():
    running = _doc(MICRON, "sanitize-log-running.json")
    runner = ReplayRunner(MICRON, sanitize_logs=[running] * 10)
    ticks = iter(range(0, 10000, 1000))
    with pytest.raises(NvmeEraseError) as err:
        asyncio.run(nvme_erase(DEV, nsid=1, lease_identity=SLOT0_NGUID, by_id=BY_ID, runner=runner,
                               clock=lambda: next(ticks),
                               policy=WipePolicy(method=WipeMethod.nvme_sanitize, timeout_s=1500)))
    assert err.value.code == "wipe_timeout"


def test_sanitize_log_without_an_estimate_reports_none():
    status = parse_sanitize_log(_doc(MICRON, "sanitize-log-running.json"), estimate_key="time_over_write")
    assert status.estimated_s is None and status.status == 2 and status.sprog == 21845


def test_a_completed_sanitize_log_describing_another_action_is_not_taken_as_ours():
    done = _doc(MICRON, "sanitize-log-done.json")  # records SANACT 4 (crypto erase) in cdw10_info
    runner = ReplayRunner(MICRON, sanitize_logs=[done])
    with pytest.raises(NvmeEraseError, match="describes sanitize action 4, not 2"):
        asyncio.run(nvme_erase(DEV, nsid=1, lease_identity=SLOT0_NGUID, by_id=BY_ID, runner=runner,
                               policy=WipePolicy(method=WipeMethod.nvme_sanitize,
                                                 sanitize_action=SanitizeAction.block_erase)))
    assert runner.erases() == [["nvme", "sanitize", DEV, "--sanact=2"]]


def test_planning_an_erase_reads_the_device_and_sends_no_erase():
    runner = ReplayRunner(MICRON)
    caps, matched, action, argv = asyncio.run(plan_nvme_erase(
        DEV, nsid=1, lease_identity=SLOT0_NGUID, by_id=BY_ID, runner=runner,
        policy=WipePolicy(method=WipeMethod.nvme_format)))
    assert action is NvmeEraseAction.format_crypto and argv[:2] == ["nvme", "format"] and matched == SLOT0_NGUID
    assert runner.erases() == [] and [c[1] for c in runner.calls] == ["id-ctrl", "id-ns", "ns-descs", "list-ns",
                                                                      "list-ns"]
    assert "--all" in runner.calls[-1]  # allocated namespaces, attached or not: the scope check's input
