"""The slot's fabric VF in the provision and release pipelines (docs/fabric.md, docs/safety.md §15).

- validate (:func:`check_fabric_vfs`): under ``[slice] fabric_isolation = "required"`` a profile that passes
  a fabric VF through needs the payload's ``fabric_attachment`` and a PF that can take it (its netdev
  reports the VF over netlink, its eswitch is ``legacy``): otherwise the provision is refused before
  any lease is taken or device touched (``fabric_attachment_missing``, ``fabric_attachment_kind_mismatch``,
  ``fabric_pf_cannot_apply``);
- the ``fabric_vf`` provision step (:func:`apply_fabric_vfs`) records that the VF is the allocation's,
  applies the attachment with the slot's identity and reads it back; its undo parks the VF;
- the ``fabric_vf_park`` release step (:func:`park_slot_vf`) parks a VF the agent applied, reads it back
  and only then lets the release go on; a VF that does not park is ``cleanup_blocked`` and quarantined
  (``fabric_vf_not_parked``), re-checked by :func:`recheck_fabric_vf`.

The record of an applied VF is the store's meta key ``fabric_vf:<VF address>`` (written before the first
netlink set), so a release after a crash at any point parks it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuaas_agent.contract.drift import DriftFinding, DriftKind, DriftSeverity
from gpuaas_agent.contract.fabricvf import (
    EswitchMode,
    FabricAttachment,
    FabricIsolation,
    FabricLinkKind,
    FabricVfIdentity,
    VfSettings,
    derive_vf_identity,
    parked_settings,
    parking_guid,
    tenant_settings,
)
from gpuaas_agent.contract.fleet import ComponentKind, QuarantineRecord, RecheckVerdict
from gpuaas_agent.contract.parity import ParityCheck, ParityStatus
from gpuaas_agent.contract.runtime import RuntimeProfile
from gpuaas_agent.contract.slots import ApprovedSlot
from gpuaas_agent.contract.topology import FabricDevice, TopologyReport
from gpuaas_agent.discovery.identity import identity_key
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import AgentError
from gpuaas_agent.host.network.fabricvf import FabricVfError, FabricVfNetlink, compare_settings, read_eswitch_mode
from gpuaas_agent.hostfs import HostRoot
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.state.store import StateStore

if TYPE_CHECKING:  # annotations only: the step functions run where the slice drivers' libraries are not (the igb guest)
    from gpuaas_agent.tasks.drivers import SliceDrivers


class FabricIsolationRefused(AgentError):
    """A provision refused before anything was touched: the slot's fabric VF cannot be isolated."""

    default_code = "fabric_pf_cannot_apply"


@dataclass(frozen=True)
class VfTarget:
    """Where one slot's VF is set: its PF's netdev and the VF's index there, and the slot's identity."""

    slot_index: int
    vf_pci_address: str
    pf_pci_address: str
    pf_netdev: str
    vf_index: int
    kind: FabricLinkKind
    identity: FabricVfIdentity
    parking_guid: str

    def journal(self) -> dict[str, Any]:
        return {"slot_index": self.slot_index, "vf": self.vf_pci_address, "pf": self.pf_pci_address,
                "pf_netdev": self.pf_netdev, "vf_index": self.vf_index, "kind": self.kind,
                "identity": self.identity.model_dump(mode="json")}


def link_kind(pf: FabricDevice) -> FabricLinkKind:
    """InfiniBand when the PF's port says so (or its class is 0x0207), else Ethernet (RoCE included)."""
    if (pf.link_layer or "").lower() == "infiniband" or pf.kind == "infiniband":
        return "infiniband"
    return "ethernet"


def locate_vf(report: TopologyReport, slot_index: int, vf_pci_address: str) -> VfTarget | str:
    """The slot's VF on its PF, or why the host cannot name it (a sentence for the refusal)."""
    devices = {d.pci_address: d for d in report.fabric_devices}
    vf = devices.get(vf_pci_address)
    if vf is None or not vf.is_vf or vf.physfn is None:
        return f"{vf_pci_address} is not a fabric VF of this host"
    pf = devices.get(vf.physfn)
    if pf is None:
        return f"the PF {vf.physfn} of VF {vf_pci_address} is not a fabric function of this host"
    if pf.netdev is None:
        return f"the PF {pf.pci_address} of VF {vf_pci_address} has no netdev to set VF policy on"
    if vf_pci_address not in pf.virtfns:
        return f"the PF {pf.pci_address} does not list VF {vf_pci_address} among its virtfn links"
    host_key = identity_key(report.host)
    # The kernel numbers a PF's VFs virtfn0..N-1 with no gaps: discovery lists them in that order.
    return VfTarget(slot_index=slot_index, vf_pci_address=vf_pci_address, pf_pci_address=pf.pci_address,
                    pf_netdev=pf.netdev, vf_index=pf.virtfns.index(vf_pci_address), kind=link_kind(pf),
                    identity=derive_vf_identity(host_key, slot_index), parking_guid=parking_guid(host_key, slot_index))


@dataclass(frozen=True)
class FabricVfPlan:
    """What validate decided for the allocation's fabric VFs: the targets to apply, or why none."""

    isolation: FabricIsolation
    attachment: FabricAttachment | None
    targets: tuple[VfTarget, ...] = ()
    skipped: str | None = None
    evidence: tuple[dict[str, Any], ...] = ()

    def journal(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"isolation": self.isolation.value, "skipped": self.skipped}
        return {"isolation": self.isolation.value, "targets": [t.journal() for t in self.targets],
                "evidence": list(self.evidence)}


def _refuse(code: str, message: str, **evidence: Any) -> FabricIsolationRefused:
    return FabricIsolationRefused(message, code=code, evidence={"fabric_isolation": "required", **evidence})


def check_fabric_vfs(isolation: FabricIsolation, profile: RuntimeProfile, attachment: FabricAttachment | None,
                     report: TopologyReport, slots: list[ApprovedSlot], netlink: FabricVfNetlink) -> FabricVfPlan:
    """Validate's fabric check (blocking: netlink and devlink reads; call it off the loop). Reads only."""
    if not profile.hostdevs:
        return FabricVfPlan(isolation, attachment, skipped=f"profile {profile.name} passes no fabric VF through")
    if isolation is FabricIsolation.single_tenant:
        return FabricVfPlan(isolation, attachment,
                            skipped="fabric_isolation = single_tenant: the operator runs one tenant per host; nothing applied")
    if isolation is FabricIsolation.dpu_enforced:
        return FabricVfPlan(isolation, attachment,
                            skipped="fabric_isolation = dpu_enforced: the DPU's switch enforces the attachment; the host sets nothing")
    if attachment is None:
        raise _refuse("fabric_attachment_missing",
                      "the provision carries no fabric_attachment (VLAN or partition key) for a profile that passes "
                      "a fabric VF through, and fabric_isolation is required: refused, nothing touched",
                      missing="fabric_attachment", slots=[s.slot_index for s in slots])
    targets, evidence = [], []
    for slot in slots:
        found = locate_vf(report, slot.slot_index, slot.fabric_vf_pci_address)
        if isinstance(found, str):
            raise _refuse("fabric_pf_cannot_apply", f"slot {slot.slot_index}: {found}: refused, nothing touched",
                          slot_index=slot.slot_index, vf=slot.fabric_vf_pci_address, missing="pf_netdev_or_vf_index")
        if found.kind != attachment.kind:
            raise _refuse("fabric_attachment_kind_mismatch",
                          f"slot {slot.slot_index}: the attachment is {attachment.kind} but the VF's PF "
                          f"{found.pf_pci_address} is {found.kind}: refused, nothing touched",
                          slot_index=slot.slot_index, attachment_kind=attachment.kind, pf_kind=found.kind)
        try:
            current = netlink.read(found.pf_netdev, found.vf_index)
        except FabricVfError as exc:
            raise _refuse("fabric_pf_cannot_apply",
                          f"slot {slot.slot_index}: the PF {found.pf_netdev} cannot apply the attachment: {exc.message}",
                          slot_index=slot.slot_index, vf=found.vf_pci_address, missing="vf_on_pf_netdev",
                          cause=exc.code, cause_evidence=exc.evidence) from None
        mode, how = netlink.eswitch(found.pf_pci_address)
        if mode is not EswitchMode.legacy:
            raise _refuse("fabric_pf_cannot_apply",
                          f"slot {slot.slot_index}: the PF {found.pf_pci_address}'s eswitch is {mode.value}, not legacy: "
                          "the host cannot prove VF policy there (a DPU or switchdev enforces it: declare "
                          "fabric_isolation = \"dpu_enforced\" if it does)",
                          slot_index=slot.slot_index, pf=found.pf_pci_address, eswitch_mode=mode.value, read=how,
                          missing="legacy_eswitch")
        targets.append(found)
        evidence.append({"slot_index": slot.slot_index, "eswitch_mode": mode.value,
                         "current": current.model_dump(mode="json")})
    return FabricVfPlan(isolation, attachment, targets=tuple(targets), evidence=tuple(evidence))


RECORD_INDEX = "fabric_vf:index"  # meta key: the JSON list of every VF address with a record


def record_key(vf_pci_address: str) -> str:
    """The store's meta key recording the VF's tenancy (``applied``) or its parking (``parked``), with the
    settings it must hold (``wanted``): what reconcile compares."""
    return f"fabric_vf:{vf_pci_address}"


def _write_record(store: StateStore, address: str, value: str) -> None:
    """On the store thread: the record and the index in one go (the thread serialises writers)."""
    known = set(json.loads(store.meta(RECORD_INDEX) or "[]"))
    if address not in known:
        store.set_meta(RECORD_INDEX, json.dumps(sorted(known | {address})))
    store.set_meta(record_key(address), value)


async def _record(store: StoreThread, target: VfTarget, state: str, allocation_id: str, task_id: str,
                  wanted: VfSettings) -> None:
    value = json.dumps({"state": state, "allocation_id": allocation_id, "task_id": task_id, "at": time.time(),
                        "pf_netdev": target.pf_netdev, "vf_index": target.vf_index, "kind": target.kind,
                        "parking_guid": target.parking_guid, "wanted": wanted.model_dump(mode="json")})
    await store.run(_write_record, target.vf_pci_address, value)


async def recorded(store: StoreThread, vf_pci_address: str) -> dict[str, Any] | None:
    raw = await store.run(lambda s: s.meta(record_key(vf_pci_address)))
    if not raw:
        return None
    value: dict[str, Any] = json.loads(raw)
    return value


async def apply_fabric_vfs(netlink: FabricVfNetlink, store: StoreThread, plan: FabricVfPlan, allocation_id: str,
                           task_id: str) -> dict[str, Any]:
    """Apply the attachment to every target VF and read it back (``fabric_vf_mismatch`` on any difference).

    The store records the VF as ``applied`` before the first set: a crash after it is parked by the undo or
    by the next release."""
    if plan.skipped is not None or plan.attachment is None:
        return plan.journal()
    applied = []
    for target in plan.targets:
        wanted = tenant_settings(target.vf_index, target.identity, plan.attachment)
        await _record(store, target, "applied", allocation_id, task_id, wanted)
        observed = await asyncio.to_thread(netlink.apply, target.pf_netdev, wanted)
        applied.append({**target.journal(), "observed": observed.model_dump(mode="json")})
    return {"isolation": plan.isolation.value, "applied": applied}


async def park_target(netlink: FabricVfNetlink, store: StoreThread, target: VfTarget, allocation_id: str,
                      task_id: str) -> dict[str, Any]:
    """Park one VF (link disabled, parking VLAN, no MAC, parking GUID), read it back, record it ``parked``."""
    wanted = parked_settings(target.vf_index, target.kind, target.parking_guid)
    observed = await asyncio.to_thread(netlink.apply, target.pf_netdev, wanted)
    await _record(store, target, "parked", allocation_id, task_id, wanted)
    return {**target.journal(), "parked": observed.model_dump(mode="json")}


async def targets_of(drivers: SliceDrivers, slots: list[ApprovedSlot]) -> list[VfTarget | str]:
    """Each slot's VF target, located again from discovery (an undo or a release in a later process)."""
    report = await asyncio.to_thread(discover, drivers.discovered_root())
    return [locate_vf(report, s.slot_index, s.fabric_vf_pci_address) for s in slots]


async def park_recorded(drivers: SliceDrivers, store: StoreThread, slots: list[ApprovedSlot], allocation_id: str,
                        task_id: str) -> dict[str, Any]:
    """Park every slot's VF the store records as ``applied`` (by this allocation or, after a crash, by none
    other: a VF is only ever one allocation's). Nothing recorded: nothing applied, nothing to park."""
    wanted = [(s, rec) for s in slots if (rec := await recorded(store, s.fabric_vf_pci_address)) is not None
              and rec.get("state") == "applied"]
    if not wanted:
        return {"parked": [], "skipped": "no VF of these slots carries an applied attachment"}
    parked = []
    for (slot, _), target in zip(wanted, await targets_of(drivers, [s for s, _ in wanted])):
        if isinstance(target, str):
            raise FabricVfError(f"slot {slot.slot_index}: cannot park its VF: {target}", code="fabric_vf_missing",
                                evidence={"slot_index": slot.slot_index, "vf": slot.fabric_vf_pci_address,
                                          "address": slot.fabric_vf_pci_address})
        try:
            parked.append(await park_target(drivers.fabric_vf, store, target, allocation_id, task_id))
        except FabricVfError as exc:
            raise FabricVfError(f"slot {slot.slot_index}: VF {target.vf_pci_address} did not park: {exc.message}",
                                code=exc.code, evidence={**exc.evidence, "address": target.vf_pci_address,
                                                         "slot_index": slot.slot_index}) from None
    return {"parked": parked}


def _slot_of_vf(report: TopologyReport, record: QuarantineRecord) -> int | None:
    """The slot whose fabric VF the record names: the record's own slot index, else the candidate slot that
    lists the VF (the parking GUID is the slot's: a guessed slot would compare another slot's GUID)."""
    if record.slot_index is not None:
        return record.slot_index
    return next((c.slot_index for c in report.candidate_slots if c.fabric_vf_pci_address == record.identity), None)


async def recheck_parked(drivers: SliceDrivers, record: QuarantineRecord) -> RecheckVerdict:
    """A quarantined fabric VF returns only when its PF, read now (after the quarantine), reports it parked.

    Read only, and only the kernel is believed: not the quarantine's evidence, not the store's record of the
    VF (``parked`` there is what the agent meant to set, not what the PF holds), not the operator's reason.
    The VF is located again from discovery, its slot's parking settings (link disabled; Ethernet: VLAN 4094,
    MAC zero, spoof check on, trust off; InfiniBand: the slot's parking GUID) are compared with what the PF
    reports, and the verdict carries the read and its time (``read_at`` after ``quarantined_at``)."""
    check = "fabric_vf_parked"
    since = record.quarantined_at.timestamp()
    base: dict[str, Any] = {"vf": record.identity, "quarantined_at": record.quarantined_at.isoformat()}
    if record.kind is not ComponentKind.fabric_vf:
        return RecheckVerdict(check=check, passed=False, evidence=base,
                              detail=f"a {record.kind.value} is not a fabric VF: nothing to read parked")
    report = await asyncio.to_thread(discover, drivers.discovered_root())
    slot_index = _slot_of_vf(report, record)
    if slot_index is None:
        return RecheckVerdict(check=check, passed=False, evidence=base,
                              detail=f"no slot of this host names VF {record.identity}: its parking settings are unknown")
    target = locate_vf(report, slot_index, record.identity)
    if isinstance(target, str):
        return RecheckVerdict(check=check, passed=False, evidence={**base, "slot_index": slot_index}, detail=target)
    wanted = parked_settings(target.vf_index, target.kind, target.parking_guid)
    where = {**base, "slot_index": slot_index, "pf_netdev": target.pf_netdev, "vf_index": target.vf_index,
             "kind": target.kind, "wanted": wanted.model_dump(mode="json")}
    try:
        observed = await asyncio.to_thread(drivers.fabric_vf.read, target.pf_netdev, target.vf_index)
    except FabricVfError as exc:
        return RecheckVerdict(check=check, passed=False, evidence={**where, "error": {"code": exc.code, **exc.evidence}},
                              detail=f"{exc.code}: {exc.message}")
    read_at = time.time()
    mismatches = compare_settings(wanted, observed)
    evidence = {**where, "observed": observed.model_dump(mode="json"), "read_at": read_at,
                "mismatches": [m.model_dump() for m in mismatches]}
    if read_at <= since:  # a clock that went back: this read cannot be shown to be after the quarantine
        return RecheckVerdict(check=check, passed=False, evidence=evidence,
                              detail=f"the PF was read at {read_at:.3f}, not after the quarantine at {since:.3f}")
    if mismatches:
        return RecheckVerdict(check=check, passed=False, evidence=evidence,
                              detail=f"VF {target.vf_index} of {target.pf_netdev} is not parked: "
                                     + ", ".join(f"{m.field} {m.found} (wanted {m.wanted})" for m in mismatches))
    return RecheckVerdict(check=check, passed=True, evidence=evidence,
                          detail=f"VF {target.vf_index} of {target.pf_netdev} reads parked")


# -- parity: what the host can prove about its fabric VFs' isolation ------------------------------------------

HOST_PROVES = "per VF on a legacy eswitch: MAC, VLAN+QoS, spoof check, trust, link state, rate cap, IB GUIDs (read back)"
FABRIC_PROVES = "the partition key's membership (UFM binds the GUIDs), the uplink's VLAN trunking, the DPU's own switch"


def fabric_isolation_check(host: HostRoot, isolation: FabricIsolation, report: TopologyReport,
                           eswitch: Callable[[str], tuple[EswitchMode, str]] = read_eswitch_mode) -> ParityCheck:
    """``fabric_isolation``: the PFs of the candidate slots' VFs and whether the host can isolate them.

    ``required``: PASS only when every such PF's eswitch reads ``legacy`` on this live host; FAIL when one does
    not (a provision of a passthrough profile would be refused); a recording cannot be asked (WARN).
    ``single_tenant``: WARN (nothing is applied: two tenants on this host would share the fabric).
    ``dpu_enforced``: WARN naming what the host can and cannot prove (never PASS: docs/safety.md §7).
    """
    pfs = sorted({c.fabric_pf_pci_address for c in report.candidate_slots if c.fabric_pf_pci_address})
    if isolation is FabricIsolation.single_tenant:
        return ParityCheck(status=ParityStatus.WARN, check="fabric_isolation", hard=False,
                           detail="single_tenant: no VLAN, GUID, spoof check or trust is set on the fabric VFs; "
                                  "two tenants on this host would reach each other on the fabric",
                           remediation="run one tenant per host, or set [slice] fabric_isolation = \"required\"",
                           evidence=f"pfs={','.join(pfs) or 'none'}")
    modes = {pf: eswitch(pf) if host.is_live else (EswitchMode.unknown, "a recording: devlink cannot be asked")
             for pf in pfs}
    ev = " | ".join(f"{pf}={mode.value} ({how})" for pf, (mode, how) in modes.items()) or "no candidate slot has a fabric PF"
    if isolation is FabricIsolation.dpu_enforced:
        return ParityCheck(status=ParityStatus.WARN, check="fabric_isolation", hard=False,
                           detail=f"dpu_enforced: the host sets nothing on the VFs and cannot prove the isolation; "
                                  f"the host proves only the eswitch modes ({ev}); the DPU must enforce "
                                  f"{HOST_PROVES.split(': ', 1)[1]}, and the fabric {FABRIC_PROVES}",
                           remediation="prove the DPU's per-VF policy on the DPU (its own checks), or use a legacy "
                                       "eswitch with fabric_isolation = \"required\"", evidence=ev)
    if not host.is_live:
        return ParityCheck(status=ParityStatus.WARN, check="fabric_isolation", hard=True,
                           detail="not provable from a recording: the PFs' eswitch modes (devlink)",
                           remediation="run parity on the live host", evidence=ev)
    bad = {pf: mode for pf, (mode, _) in modes.items() if mode is not EswitchMode.legacy}
    if bad or not pfs:
        return ParityCheck(status=ParityStatus.FAIL, check="fabric_isolation", hard=True,
                           detail=("required: the host cannot apply VF policy on "
                                   + (", ".join(f"{pf} (eswitch {m.value})" for pf, m in bad.items()) or "any PF")
                                   + ": provisions of passthrough profiles are refused (fabric_pf_cannot_apply)"),
                           remediation="put the PF's eswitch in legacy mode (devlink dev eswitch set pci/<pf> mode "
                                       "legacy), or declare fabric_isolation = \"dpu_enforced\" where the DPU enforces it",
                           evidence=ev)
    return ParityCheck(status=ParityStatus.PASS, check="fabric_isolation", hard=True,
                       detail=f"required: {len(pfs)} PF(s) with a legacy eswitch; the host proves {HOST_PROVES}; "
                              f"only the fabric proves {FABRIC_PROVES}", evidence=ev)


# -- reconcile: every VF the agent set, against what its PF holds now ----------------------------------------


async def reconcile_findings(netlink: FabricVfNetlink, store: StoreThread, leased: set[tuple[str, str]], *,
                             repair: bool) -> list[DriftFinding]:
    """Every recorded VF's settings on its PF against what the agent set (``wanted`` of its record).

    ``leased``: (allocation, VF address) of the store's leases. A difference is ``fabric_vf_drift``; with
    ``repair`` the agent sets the record's settings again and reads them back: an active lease's attachment
    restored, a parked VF parked again. An ``applied`` VF no lease holds any more is parked (no tenant holds it).
    """
    index = json.loads(await store.run(lambda s: s.meta(RECORD_INDEX)) or "[]")
    findings = []
    for address in index:
        rec = await recorded(store, address)
        if rec is None or "wanted" not in rec:
            continue
        wanted = VfSettings.model_validate(rec["wanted"])
        pf_netdev, kind = str(rec["pf_netdev"]), rec.get("kind", "ethernet")
        orphan = rec["state"] == "applied" and (rec["allocation_id"], address) not in leased
        if orphan:
            wanted = parked_settings(wanted.vf, "infiniband" if kind == "infiniband" else "ethernet",
                                     str(rec["parking_guid"]))
        try:
            observed = await asyncio.to_thread(netlink.read, pf_netdev, wanted.vf)
        except FabricVfError as exc:
            findings.append(DriftFinding(kind=DriftKind.fabric_vf_unreadable, subject=address,
                                         severity=DriftSeverity.error, expected=rec["state"], actual=exc.code,
                                         detail={"pf_netdev": pf_netdev, "vf": wanted.vf, "message": exc.message,
                                                 "allocation_id": rec["allocation_id"]}))
            continue
        mismatches = compare_settings(wanted, observed)
        if not mismatches and not orphan:
            continue
        detail: dict[str, Any] = {"pf_netdev": pf_netdev, "vf": wanted.vf, "allocation_id": rec["allocation_id"],
                                  "state": "applied_without_lease" if orphan else rec["state"],
                                  "mismatches": [m.model_dump() for m in mismatches]}
        repaired = False
        if repair:
            try:
                await asyncio.to_thread(netlink.apply, pf_netdev, wanted)
                repaired = True
                if orphan:
                    value = json.dumps({**rec, "state": "parked", "at": time.time(), "wanted": wanted.model_dump(mode="json")})
                    await store.run(_write_record, address, value)
            except FabricVfError as exc:
                detail["repair_failed"] = {"code": exc.code, "message": exc.message}
        findings.append(DriftFinding(
            kind=DriftKind.fabric_vf_drift, subject=address, severity=DriftSeverity.error, repaired=repaired,
            expected=", ".join(f"{m.field}={m.wanted}" for m in mismatches) or "parked",
            actual=", ".join(f"{m.field}={m.found}" for m in mismatches) or "applied, no lease", detail=detail))
    return findings


def recorded_pf_netdevs(store: StateStore) -> frozenset[str]:
    """On the store thread: the PF netdev of every VF with a record, the links :func:`reconcile_findings` reads
    (a change of a VF's settings is announced as its PF's RTM_NEWLINK: the network watch wakes on those,
    operator/netwatch.py)."""
    raws = [store.meta(record_key(address)) for address in json.loads(store.meta(RECORD_INDEX) or "[]")]
    records = [json.loads(raw) for raw in raws if raw]
    return frozenset(str(rec["pf_netdev"]) for rec in records if "pf_netdev" in rec)


async def restore_applied(netlink: FabricVfNetlink, store: StoreThread, vf_addresses: list[str],
                          allocation_id: str) -> list[dict[str, Any]]:
    """Set again, and read back, what the store records as applied to these VFs for ``allocation_id``: a host
    reboot (or a PF driver reload) resets a PF's VF settings, so boot recovery calls this before it starts an
    active slice's domain again. A VF without such a record is left alone (nothing was applied to it)."""
    restored = []
    for address in vf_addresses:
        rec = await recorded(store, address)
        if rec is None or rec.get("state") != "applied" or rec.get("allocation_id") != allocation_id or "wanted" not in rec:
            continue
        wanted = VfSettings.model_validate(rec["wanted"])
        observed = await asyncio.to_thread(netlink.apply, str(rec["pf_netdev"]), wanted)
        restored.append({"vf": address, "pf_netdev": rec["pf_netdev"], "observed": observed.model_dump(mode="json")})
    return restored
