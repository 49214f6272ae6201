"""Fabric VF isolation in the pipelines: refused before any lease when it cannot be applied, recorded before it is.

Real pieces: the recorded 8xH200 host's discovery (its IB PFs and VFs), this machine's kernel in a network
namespace the test creates (a netdev named like the host's PF, with no VFs: the answer of a PF that cannot
take VF settings), the real provision pipeline on loop disks and the SQLite store. Where an answer needs a
VF this machine cannot have (a PF that reports one, an eswitch mode), :class:`RecordedPf` answers with
netlink bytes encoded by pyroute2 (tests/host/network/test_fabricvf.py): GPUs, VFIO and BF3 are the one
place the house allows a stand-in.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from gpuaas_agent.config import AgentConfig, SliceConfig
from gpuaas_agent.contract.fabricvf import (
    EswitchMode,
    EthernetAttachment,
    FabricIsolation,
    InfinibandAttachment,
    VfLinkState,
    VfSettings,
    derive_vf_identity,
    parked_settings,
)
from gpuaas_agent.contract.fleet import ComponentKind, ComponentRef, UnquarantinePayload
from gpuaas_agent.contract.parity import ParityStatus
from gpuaas_agent.contract.runtime import get_profile
from gpuaas_agent.contract.state import SlotLease
from gpuaas_agent.discovery.identity import identity_key
from gpuaas_agent.host.network.fabricvf import FabricVfError, FabricVfNetlink, vfs_of_link
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.aio import as_store_thread
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.fabricvf import (
    FabricIsolationRefused,
    apply_fabric_vfs,
    check_fabric_vfs,
    fabric_isolation_check,
    locate_vf,
    park_recorded,
    reconcile_findings,
    record_key,
    recorded,
    restore_applied,
)
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.plan import plan_bundle
from gpuaas_agent.tasks.quarantine import QuarantineRefused, quarantine_component, unquarantine_handler
from gpuaas_agent.tasks.recheck import RecheckContext, recheck_fabric_vf
from gpuaas_agent.tasks.release import ReleaseRun, quarantine_failed_component
from tests.conftest import fixture_host
from tests.support.provision_inputs import (
    approved_slot,
    approved_slot_of_host,
    plan_payload,
    provision_payload,
    slice_drivers_for,
    task_ctx,
    topology_of,
)
from tests.support.realdev import require_root
from tests.tasks.conftest import provision_failure, slice_loop_host

MiB = 1 << 20
GPU_PROFILE = get_profile("h200_1g_24c_64g")  # passes the GPU and its fabric VF through
IB = InfinibandAttachment(pkey="0x0012")


@dataclass(frozen=True)
class RecordedPf(FabricVfNetlink):
    """A PF that reports ``vfs`` (and, through ``eswitch``, a mode): a ConnectX-7's answers, where this machine has none."""

    vfs: tuple[VfSettings, ...] = ()

    def read(self, pf_netdev: str, vf: int) -> VfSettings:
        for settings in self.vfs:
            if settings.vf == vf:
                return settings
        raise FabricVfError(f"PF {pf_netdev} reports no VF {vf}", code="fabric_vf_missing", evidence={"vf": vf})


def _eswitch(mode: EswitchMode):
    return lambda pf: (mode, f"recorded: {mode.value}")


@pytest.fixture(scope="module")
def report():
    return topology_of()


@pytest.fixture(scope="module")
def pf_netns():
    """A namespace where the recorded host's first IB PF netdev exists and has no VFs (this machine's kernel)."""
    require_root()
    name = f"gpuaas-fvt-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "ibp25s0", "type", "bridge"], check=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True, timeout=30)


def test_plan_reports_each_slots_vf_identity_and_echoes_the_attachment(report):
    slot = approved_slot(report, 0)
    plan = plan_bundle(plan_payload(slot).model_copy(update={"fabric_attachment": IB}), report)
    assert plan.slots[0].fabric_vf_identity == derive_vf_identity(identity_key(report.host), 0)
    assert plan.slots[0].fabric_vf_identity == report.candidate_slots[0].fabric_vf_identity
    assert plan.fabric_attachment == IB


def test_the_slots_vf_is_located_on_its_pf(report):
    target = locate_vf(report, 0, report.candidate_slots[0].fabric_vf_pci_address)
    assert not isinstance(target, str)
    assert (target.pf_netdev, target.vf_index, target.kind) == ("ibp25s0", 0, "infiniband")
    assert "not a fabric VF" in locate_vf(report, 0, report.candidate_slots[0].gpu_pci_address)


def test_required_without_attachment_is_refused_naming_what_is_missing(report):
    with pytest.raises(FabricIsolationRefused) as info:
        check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, None, report, [approved_slot(report, 0)], RecordedPf())
    assert info.value.code == "fabric_attachment_missing" and info.value.evidence["missing"] == "fabric_attachment"


@pytest.mark.parametrize("isolation", [FabricIsolation.single_tenant, FabricIsolation.dpu_enforced])
def test_operator_declared_isolation_applies_nothing_and_says_why(report, isolation):
    plan = check_fabric_vfs(isolation, GPU_PROFILE, None, report, [approved_slot(report, 0)], RecordedPf())
    assert plan.targets == () and isolation.value in plan.skipped


def test_a_profile_without_passthrough_needs_no_attachment(report):
    plan = check_fabric_vfs(FabricIsolation.required, get_profile("lab_tcg_1c_512m"), None, report,
                            [approved_slot(report, 0)], RecordedPf())
    assert plan.targets == () and "passes no fabric VF" in plan.skipped


def test_an_ethernet_attachment_for_an_infiniband_pf_is_refused(report):
    with pytest.raises(FabricIsolationRefused) as info:
        check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, EthernetAttachment(vlan=10), report,
                         [approved_slot(report, 0)], RecordedPf(vfs=(VfSettings(vf=0),)))
    assert info.value.code == "fabric_attachment_kind_mismatch"


def test_the_real_kernels_pf_without_vfs_is_pf_cannot_apply(report, pf_netns):
    with pytest.raises(FabricIsolationRefused) as info:
        check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, IB, report, [approved_slot(report, 0)],
                         FabricVfNetlink(netns=pf_netns, eswitch=_eswitch(EswitchMode.legacy)))
    assert info.value.code == "fabric_pf_cannot_apply"
    assert (info.value.evidence["missing"], info.value.evidence["cause"]) == ("vf_on_pf_netdev", "fabric_vf_missing")


@pytest.mark.parametrize("mode", [EswitchMode.switchdev, EswitchMode.unknown])
def test_an_eswitch_not_proven_legacy_is_refused_under_required(report, mode):
    pf = RecordedPf(vfs=(VfSettings(vf=0, link_state=VfLinkState.auto),), eswitch=_eswitch(mode))
    with pytest.raises(FabricIsolationRefused) as info:
        check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, IB, report, [approved_slot(report, 0)], pf)
    assert info.value.code == "fabric_pf_cannot_apply" and info.value.evidence["eswitch_mode"] == mode.value
    assert "dpu_enforced" in info.value.message


def test_a_legacy_pf_that_reports_the_vf_is_planned(report):
    pf = RecordedPf(vfs=(VfSettings(vf=0, link_state=VfLinkState.disable),), eswitch=_eswitch(EswitchMode.legacy))
    plan = check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, IB, report, [approved_slot(report, 0)], pf)
    assert [(t.pf_netdev, t.vf_index) for t in plan.targets] == [("ibp25s0", 0)]
    assert plan.journal()["targets"][0]["identity"] == report.candidate_slots[0].fabric_vf_identity.model_dump()


def test_the_vf_is_recorded_as_the_allocations_before_the_kernel_is_asked(report, pf_netns, tmp_path):
    """A crash after the netlink set must find the record: the undo and the next release park what it names."""
    pf = FabricVfNetlink(netns=pf_netns)
    plan = check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, IB, report, [approved_slot(report, 0)],
                            RecordedPf(vfs=(VfSettings(vf=0),), eswitch=_eswitch(EswitchMode.legacy)))
    store = StateStore.open(tmp_path / "state.db")
    alloc = str(uuid.uuid4())
    with pytest.raises(FabricVfError) as info:  # the real kernel refuses the set: a PF without VF ops
        asyncio.run(apply_fabric_vfs(pf, as_store_thread(store), plan, alloc, "t-1"))
    assert info.value.code == "fabric_vf_unsupported"
    record = asyncio.run(recorded(as_store_thread(store), report.candidate_slots[0].fabric_vf_pci_address))
    assert record is not None and (record["state"], record["allocation_id"]) == ("applied", alloc)
    store.close()


# -- the real pipeline: refused in validate, nothing leased, the disk untouched --------------------------------


@pytest.fixture
def loop_host(tmp_path):
    with slice_loop_host(tmp_path / "host", disk_bytes=64 * MiB) as host:
        yield host


def _refused(loop_host, tmp_path, payload, config_update=None):
    sh = slice_drivers_for(loop_host, tmp_path)
    if config_update:
        sh.slice = SliceConfig(**{**sh.slice.model_dump(), **config_update})
    store = StateStore.open(tmp_path / "state.db")
    ctx = task_ctx(store, f"t-{uuid.uuid4().hex[:8]}")
    disk = loop_host.disks[payload.slot.slot_index].loop
    before = open(disk, "rb").read(MiB)
    failure = provision_failure(sh, payload, ctx)
    assert failure.failed_step == "validate" and failure.disk_touched is False, failure
    assert store.leases() == [], "nothing leased"
    assert store.slot_state(payload.slot.slot_index) is None, "no slot record"
    assert open(disk, "rb").read(MiB) == before
    store.close()
    return failure


def test_provision_without_attachment_is_refused_before_any_lease(loop_host, tmp_path):
    payload = provision_payload(approved_slot_of_host(loop_host, 0), runtime_profile="h200_1g_24c_64g")
    failure = _refused(loop_host, tmp_path, payload)
    assert failure.code == "fabric_attachment_missing" and "fabric_attachment" in failure.message


def test_provision_on_a_host_whose_pf_cannot_apply_is_refused_before_any_lease(loop_host, tmp_path):
    # This machine has no PF named ibp25s0 in its own namespace: the host's netlink cannot reach the VF.
    payload = provision_payload(approved_slot_of_host(loop_host, 0), runtime_profile="h200_1g_24c_64g",
                                fabric_attachment=IB)
    failure = _refused(loop_host, tmp_path, payload)
    assert failure.code == "fabric_pf_cannot_apply" and failure.evidence["cause"] == "fabric_vf_missing"


# -- parity: what the host can prove ----------------------------------------------------------------------------


def test_parity_warns_for_single_tenant_whatever_the_host(report):
    check = fabric_isolation_check(HostRoot.open(Path("/")), FabricIsolation.single_tenant, report,
                                   _eswitch(EswitchMode.legacy))
    assert (check.status, check.hard) == (ParityStatus.WARN, False) and "reach each other" in check.detail


def test_parity_for_dpu_enforced_names_what_the_host_cannot_prove(report):
    check = fabric_isolation_check(HostRoot.open(Path("/")), FabricIsolation.dpu_enforced, report,
                                   _eswitch(EswitchMode.switchdev))
    assert check.status is ParityStatus.WARN
    assert "cannot prove" in check.detail and "switchdev" in check.detail and "spoof check" in check.detail


@pytest.mark.parametrize("mode, status", [(EswitchMode.legacy, ParityStatus.PASS), (EswitchMode.switchdev, ParityStatus.FAIL),
                                          (EswitchMode.unknown, ParityStatus.FAIL)])
def test_parity_under_required_passes_only_a_proven_legacy_eswitch(report, mode, status):
    check = fabric_isolation_check(HostRoot.open(Path("/")), FabricIsolation.required, report, _eswitch(mode))
    assert check.status is status and check.hard
    assert "0000:19:00.0" in check.evidence


def test_parity_on_a_recording_is_not_a_pass(report):
    check = fabric_isolation_check(HostRoot.open(fixture_host("h200-slice-after-transition")), FabricIsolation.required,
                                   report, _eswitch(EswitchMode.legacy))
    assert check.status is ParityStatus.WARN and "recording" in check.detail


# -- release: park, or cleanup_blocked and quarantine --------------------------------------------------------


def test_release_parks_nothing_no_attachment_reached(report, tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    sh = slice_drivers_for(SimpleNamespace(root=fixture_host("h200-slice-after-transition")), tmp_path)
    out = asyncio.run(park_recorded(sh, as_store_thread(store), [approved_slot(report, 0)], str(uuid.uuid4()), "t-r"))
    assert out["parked"] == [] and "no VF" in out["skipped"]
    store.close()


def test_a_vf_that_does_not_park_is_quarantined_until_its_pf_reads_it_parked(report, pf_netns, tmp_path):
    """The real kernel refuses the parking set (a PF without VF ops): the release step fails typed, the VF is
    quarantined fabric_vf_not_parked, and its re-check reads the PF and does not pass."""
    store = StateStore.open(tmp_path / "state.db")
    thread = as_store_thread(store)
    slot = approved_slot(report, 0)
    alloc = str(uuid.uuid4())
    sh = slice_drivers_for(SimpleNamespace(root=fixture_host("h200-slice-after-transition")), tmp_path)
    sh.fabric_vf = FabricVfNetlink(netns=pf_netns)
    lease = store.take_lease(SlotLease(allocation_id=alloc, slot_index=0, gpu_pci_address=slot.gpu_pci_address,
                                       nvme_device=slot.nvme_device, disk_identity="eui:0001",
                                       fabric_vf_pci_address=slot.fabric_vf_pci_address, task_id="t-p",
                                       taken_at=time.time()))
    plan = check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, IB, report, [slot],
                            RecordedPf(vfs=(VfSettings(vf=0),), eswitch=_eswitch(EswitchMode.legacy)))
    with pytest.raises(FabricVfError):
        asyncio.run(apply_fabric_vfs(sh.fabric_vf, thread, plan, alloc, "t-p"))
    with pytest.raises(FabricVfError) as info:
        asyncio.run(park_recorded(sh, thread, [slot], alloc, "t-r"))
    assert info.value.code == "fabric_vf_unsupported" and info.value.evidence["address"] == slot.fabric_vf_pci_address
    assert asyncio.run(recorded(thread, slot.fabric_vf_pci_address))["state"] == "applied"  # still owed a park

    run = ReleaseRun(drivers=sh, payload=None, task_id="t-r", ctx=task_ctx(store, "t-r"), holders=(lease,), record=None)
    failure = PipelineFailed(info.value, failed_step="fabric_vf_park", disk_touched=False, cancelled=False,
                             compensations=[], steps_done=["find", "shutdown", "undefine"])
    asyncio.run(quarantine_failed_component(run, failure))
    [record] = store.quarantined()
    assert (record.kind.value, record.identity, record.reason.value) == (
        "fabric_vf", slot.fabric_vf_pci_address, "fabric_vf_not_parked")
    verdict = asyncio.run(recheck_fabric_vf(RecheckContext(host_root=sh.host_root, drivers=sh, store=store), record))
    assert not verdict.passed and verdict.check == "fabric_vf_parked"
    assert "reports 0 VF" in verdict.detail
    store.close()


# -- slice.unquarantine: only the PF's own answer, read after the quarantine, returns a VF ----------------------


@dataclass(frozen=True)
class EncodedPf(FabricVfNetlink):
    """A PF whose answer is an RTM_NEWLINK encoded and decoded by pyroute2 (a ConnectX-7's IFLA_VFINFO_LIST,
    where this machine has none): the driver's own parser reads it."""

    vfinfo: tuple[tuple[tuple[str, dict], ...], ...] = ()

    def read(self, pf_netdev: str, vf: int) -> VfSettings:
        msg = ifinfmsg()
        msg["family"] = 0
        msg["attrs"] = [("IFLA_IFNAME", pf_netdev), ("IFLA_NUM_VF", len(self.vfinfo)),
                        ("IFLA_VFINFO_LIST", {"attrs": [("IFLA_VF_INFO", {"attrs": list(v)}) for v in self.vfinfo]})]
        msg.encode()
        decoded = ifinfmsg(msg.data)
        decoded.decode()
        return vfs_of_link(decoded)[vf]


def _ib_vfinfo(vf: int, *, link_state: int, guid: str) -> tuple[tuple[str, dict], ...]:
    return (("IFLA_VF_MAC", {"vf": vf, "mac": "00:00:00:00:00:00"}),
            ("IFLA_VF_LINK_STATE", {"vf": vf, "link_state": link_state}),
            ("IFLA_VF_IB_NODE_GUID", {"vf": vf, "ib_node_guid": guid}),
            ("IFLA_VF_IB_PORT_GUID", {"vf": vf, "ib_port_guid": guid}))


def test_unquarantine_returns_a_vf_only_when_its_pf_reads_it_parked_after_the_quarantine(report, pf_netns, tmp_path):
    """slice.unquarantine of ``fabric_vf_not_parked``: the claims around it (the quarantine's evidence, the
    store's record, the operator's reason, extra payload fields) say parked; only the PF's answer is believed."""
    store = StateStore.open(tmp_path / "state.db")
    slot = report.candidate_slots[1]
    address = slot.fabric_vf_pci_address
    target = locate_vf(report, 1, address)
    assert not isinstance(target, str)
    parked = parked_settings(target.vf_index, target.kind, target.parking_guid)
    # Hostile: every claim the agent does not read from the kernel says the VF is parked.
    claim = {"observed": parked.model_dump(mode="json"), "parked": True}
    record = asyncio.run(quarantine_component(store, "fabric_vf", address, "fabric_vf_not_parked", claim, "t-r"))
    assert record.slot_index is None  # the re-check finds the slot (its parking GUID) from discovery, never slot 0's
    store.set_meta(record_key(address), json.dumps({"state": "parked", "allocation_id": "a", "wanted": claim["observed"]}))
    ref = ComponentRef(kind=ComponentKind.fabric_vf, identity=address)
    with pytest.raises(ValidationError):  # a payload cannot carry its own verdict
        UnquarantinePayload.model_validate({"component": ref.model_dump(mode="json"), "reason": "parked by hand",
                                            "recheck": {"check": "fabric_vf_parked", "passed": True, "detail": "x"}})
    payload = UnquarantinePayload(component=ref, reason="VF parked by hand, checked")
    sh = slice_drivers_for(SimpleNamespace(root=fixture_host("h200-slice-after-transition")), tmp_path)
    config = AgentConfig(host_root=sh.host_root, state_dir=tmp_path / "state")

    def unquarantine(pf: FabricVfNetlink) -> dict:
        sh.fabric_vf = pf
        return asyncio.run(unquarantine_handler(config, sh)(payload, task_ctx(store, f"t-{uuid.uuid4().hex[:6]}")))

    # The real kernel: slot 1's PF netdev exists and reports no VF.
    subprocess.run(["ip", "-n", pf_netns, "link", "add", target.pf_netdev, "type", "bridge"], check=True, timeout=30)
    try:
        with pytest.raises(QuarantineRefused) as missing:
            unquarantine(FabricVfNetlink(netns=pf_netns))
    finally:
        subprocess.run(["ip", "-n", pf_netns, "link", "del", target.pf_netdev], check=True, timeout=30)
    verdict = missing.value.evidence["verdict"]
    assert missing.value.code == "recheck_failed" and verdict["evidence"]["error"]["code"] == "fabric_vf_missing"
    assert "reports 0 VF" in missing.value.message and [r.identity for r in store.quarantined()] == [address]
    # A PF that still reads the last tenant's attachment (link up, its port GUID): named field by field.
    tenant = _ib_vfinfo(target.vf_index, link_state=0, guid=target.identity.port_guid)
    with pytest.raises(QuarantineRefused) as still:
        unquarantine(EncodedPf(vfinfo=(tenant,)))
    found = {m["field"]: m["found"] for m in still.value.evidence["verdict"]["evidence"]["mismatches"]}
    assert found == {"link_state": "auto", "node_guid": target.identity.port_guid, "port_guid": target.identity.port_guid}
    assert "not parked" in still.value.message and [r.identity for r in store.quarantined()] == [address]
    # Another slot's parking GUID is not this slot's park.
    other = locate_vf(report, 0, report.candidate_slots[0].fabric_vf_pci_address)
    with pytest.raises(QuarantineRefused):
        unquarantine(EncodedPf(vfinfo=(_ib_vfinfo(target.vf_index, link_state=2, guid=other.parking_guid),)))
    # Parked on the PF, read now: returned, with the read and its time as the evidence.
    done = unquarantine(EncodedPf(vfinfo=(_ib_vfinfo(target.vf_index, link_state=2, guid=target.parking_guid),)))
    evidence = done["recheck"]["evidence"]
    assert done["recheck"]["passed"] and evidence["mismatches"] == [] and evidence["slot_index"] == 1
    assert evidence["read_at"] > record.quarantined_at.timestamp()
    assert evidence["observed"]["port_guid"] == target.parking_guid and store.quarantined() == []
    store.close()


# -- reconcile: what the PF holds against what the agent set ---------------------------------------------------


@dataclass(frozen=True)
class SettablePf(FabricVfNetlink):
    """A PF whose VFs keep what is set (a ConnectX-7's legacy eswitch, where this machine has none)."""

    held: dict = field(default_factory=dict)

    def read(self, pf_netdev: str, vf: int) -> VfSettings:
        return self.held[vf]

    def apply(self, pf_netdev: str, wanted: VfSettings) -> VfSettings:
        current = self.held.get(wanted.vf, VfSettings(vf=wanted.vf))
        self.held[wanted.vf] = current.model_copy(update={k: v for k, v in wanted.model_dump().items() if v is not None})
        return self.held[wanted.vf]


def _applied(report, tmp_path, attachment):
    store = StateStore.open(tmp_path / "state.db")
    slot = approved_slot(report, 0)
    pf = SettablePf(held={0: VfSettings(vf=0, link_state=VfLinkState.disable)}, eswitch=_eswitch(EswitchMode.legacy))
    plan = check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, attachment, report, [slot], pf)
    alloc = str(uuid.uuid4())
    asyncio.run(apply_fabric_vfs(pf, as_store_thread(store), plan, alloc, "t-p"))
    return store, pf, slot, alloc


def test_drift_of_an_active_vf_is_typed_and_restored(report, tmp_path):
    store, pf, slot, alloc = _applied(report, tmp_path, IB)
    thread, leased = as_store_thread(store), {(alloc, slot.fabric_vf_pci_address)}
    assert asyncio.run(reconcile_findings(pf, thread, leased, repair=True)) == []  # as set: nothing to say
    identity = report.candidate_slots[0].fabric_vf_identity
    assert pf.held[0].port_guid == identity.port_guid and pf.held[0].link_state is VfLinkState.auto
    pf.held[0] = pf.held[0].model_copy(update={"port_guid": "02:00:00:00:00:00:00:99"})  # someone else's GUID
    [seen] = asyncio.run(reconcile_findings(pf, thread, leased, repair=False))
    assert (seen.kind.value, seen.subject, seen.repaired) == ("fabric_vf_drift", slot.fabric_vf_pci_address, False)
    assert seen.detail["mismatches"][0]["field"] == "port_guid" and pf.held[0].port_guid != identity.port_guid
    [fixed] = asyncio.run(reconcile_findings(pf, thread, leased, repair=True))
    assert fixed.repaired and pf.held[0].port_guid == identity.port_guid
    store.close()


def test_an_applied_vf_no_lease_holds_is_parked_by_reconcile(report, tmp_path):
    store, pf, slot, alloc = _applied(report, tmp_path, IB)
    thread = as_store_thread(store)
    [orphan] = asyncio.run(reconcile_findings(pf, thread, set(), repair=True))
    assert orphan.detail["state"] == "applied_without_lease" and orphan.repaired
    identity = report.candidate_slots[0].fabric_vf_identity
    assert pf.held[0].link_state is VfLinkState.disable and pf.held[0].port_guid not in (None, identity.port_guid)
    assert asyncio.run(recorded(thread, slot.fabric_vf_pci_address))["state"] == "parked"
    pf.held[0] = pf.held[0].model_copy(update={"link_state": VfLinkState.auto})  # a parked VF brought up again
    [repark] = asyncio.run(reconcile_findings(pf, thread, set(), repair=True))
    assert repark.detail["state"] == "parked" and repark.repaired and pf.held[0].link_state is VfLinkState.disable
    assert asyncio.run(reconcile_findings(pf, thread, set(), repair=True)) == []
    store.close()


def test_a_recorded_vf_the_real_pf_does_not_report_is_unreadable_drift(report, pf_netns, tmp_path):
    store = StateStore.open(tmp_path / "state.db")
    thread = as_store_thread(store)
    slot, alloc = approved_slot(report, 0), str(uuid.uuid4())
    plan = check_fabric_vfs(FabricIsolation.required, GPU_PROFILE, IB, report, [slot],
                            RecordedPf(vfs=(VfSettings(vf=0),), eswitch=_eswitch(EswitchMode.legacy)))
    with pytest.raises(FabricVfError):
        asyncio.run(apply_fabric_vfs(FabricVfNetlink(netns=pf_netns), thread, plan, alloc, "t-p"))
    [finding] = asyncio.run(reconcile_findings(FabricVfNetlink(netns=pf_netns), thread,
                                               {(alloc, slot.fabric_vf_pci_address)}, repair=True))
    assert (finding.kind.value, finding.actual) == ("fabric_vf_unreadable", "fabric_vf_missing")
    store.close()


def test_after_a_reboot_reset_the_pf_the_recorded_attachment_is_set_again(report, tmp_path):
    """Boot recovery's step before a guarded start (tasks/boot_recovery.py): the PF forgot the VF's settings."""
    store, pf, slot, alloc = _applied(report, tmp_path, IB)
    before = pf.held[0]
    zero = "00:00:00:00:00:00:00:00"  # what an mlx5 VF's GUIDs read after a boot
    pf.held[0] = VfSettings(vf=0, link_state=VfLinkState.auto, node_guid=zero, port_guid=zero)
    thread = as_store_thread(store)
    assert asyncio.run(restore_applied(pf, thread, [slot.fabric_vf_pci_address], "another-allocation")) == []
    [restored] = asyncio.run(restore_applied(pf, thread, [slot.fabric_vf_pci_address], alloc))
    assert pf.held[0] == before
    assert restored["observed"]["port_guid"] == report.candidate_slots[0].fabric_vf_identity.port_guid
    store.close()
