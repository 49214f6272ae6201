"""Drift reports on ``gpuaas.node.<node>.drift``: what changed on the host since the agent last looked.

A report is sent when a kernel event (a disk, PCI function or link appearing,
vanishing or changing driver), the reconcile timer or a task made the agent
look again and found the host no longer matches what it saw before. Subjects
are stable identities (PCI address, ``/dev/disk/by-id`` path, allocation id);
kernel names only ever appear as advisory detail (docs/safety.md §2).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from gpuaas_agent.contract.base import SCHEMA_VERSION, SchemaVersion, WireEnum, WireModel
from gpuaas_agent.contract.tasks import NODE_ID_PATTERN


class DriftKind(WireEnum):
    """What drifted. Topology kinds come from comparing two discoveries; reconcile kinds from host vs. leases."""

    # topology (discovery before vs. after)
    gpu_vanished = "gpu_vanished"
    gpu_appeared = "gpu_appeared"
    gpu_driver_changed = "gpu_driver_changed"
    nvme_vanished = "nvme_vanished"
    nvme_appeared = "nvme_appeared"
    nvme_renamed = "nvme_renamed"  # kernel name moved: advisory, the by-id identity is unchanged
    nvme_in_use_changed = "nvme_in_use_changed"
    fabric_vf_vanished = "fabric_vf_vanished"
    fabric_vf_appeared = "fabric_vf_appeared"
    fabric_vf_driver_changed = "fabric_vf_driver_changed"
    fabric_pf_vanished = "fabric_pf_vanished"
    fabric_pf_appeared = "fabric_pf_appeared"
    fabric_pf_driver_changed = "fabric_pf_driver_changed"
    link_vanished = "link_vanished"
    link_appeared = "link_appeared"
    # reconcile (host vs. the agent's leases and reservations)
    domain_missing = "domain_missing"
    domain_orphan = "domain_orphan"
    port_orphan = "port_orphan"
    reservation_orphan = "reservation_orphan"
    reservation_missing = "reservation_missing"
    dhcp_lease_missing = "dhcp_lease_missing"  # an active slot's MAC holds no live lease on its IP
    lease_without_domain = "lease_without_domain"
    driver_not_vfio = "driver_not_vfio"
    disk_not_wiped = "disk_not_wiped"
    # port isolation (docs/safety.md §9): the flows and nft guard an active slot's reservation implies
    flows_missing = "flows_missing"  # none of the port's OpenFlow rules is installed (e.g. vswitchd restarted)
    flows_altered = "flows_altered"  # some are, but rules are missing, extra or changed
    flows_orphan = "flows_orphan"  # rules under our cookie for a port that no longer exists
    nft_guard_missing = "nft_guard_missing"  # the guard table is absent, or an active port's tap is not in its set
    nft_guard_altered = "nft_guard_altered"  # the guard table's chains or rules differ from the spec
    nft_guard_orphan = "nft_guard_orphan"  # the guard's set names a port that no longer exists
    # slice network watch (operator/netwatch.py): a check of the slice network changed verdict
    slice_network_degraded = "slice_network_degraded"  # subject: the check (slice_nat, dnsmasq, ...)
    slice_network_restored = "slice_network_restored"
    # a held slot's devices vs. the live host (tasks/slot_topology.py; reconcile and boot recovery)
    slot_device_missing = "slot_device_missing"  # the leased GPU/VF address or by-id disk is gone
    slot_device_moved = "slot_device_moved"  # by-id names another disk, other hostdevs, GPU on another NUMA node
    domain_shutoff = "domain_shutoff"  # an active slot's domain is shut off (info when the tenant stopped it)
    # boot recovery (tasks/boot_recovery.py): what the agent could not restore after a host reboot
    slot_rebind_failed = "slot_rebind_failed"  # a leased GPU/VF could not be put back on vfio-pci
    boot_restart_refused = "boot_restart_refused"  # the guarded start of an active slice refused after boot
    boot_restart_held = "boot_restart_held"  # not restarted by policy (on_host_boot) or the tenant's stop
    boot_restarted = "boot_restarted"  # restarted after the boot (info: what recovery did)
    # NVIDIA Fabric Manager partitions of NVSwitch hosts (tasks/fabric_partitions.py)
    fabric_partition_without_domain = "fabric_partition_without_domain"  # active, held, no running domain
    fabric_partition_without_lease = "fabric_partition_without_lease"  # active, held by nothing of ours
    fabric_partition_lost = "fabric_partition_lost"  # a running slice's partition is inactive (FM restarted)
    fabric_manager_unavailable = "fabric_manager_unavailable"  # FM did not answer reconcile's partition list
    # A slot's fabric VF (tasks/fabricvf.py, docs/fabric.md): the PF holds other settings than the agent set
    fabric_vf_drift = "fabric_vf_drift"  # an applied VF's MAC/VLAN/spoof check/trust/GUID, or a parked VF, differs
    fabric_vf_unreadable = "fabric_vf_unreadable"  # the PF did not report a VF the agent set


class DriftSeverity(WireEnum):
    info = "info"  # advisory: nothing a slot depends on changed
    warn = "warn"  # needs a look: a slot may be affected
    error = "error"  # a slot's device is gone or unusable


class DriftTrigger(WireEnum):
    uevent = "uevent"
    timer = "timer"
    task = "task"
    netlink = "netlink"  # a link, address, route, forwarding or nftables change
    boot = "boot"  # the first start of the agent after the host rebooted (boot_id changed)


class DriftFinding(WireModel):
    kind: DriftKind
    subject: str = Field(min_length=1, description="stable identity: PCI address, /dev/disk/by-id path, link name, allocation id")
    expected: str | None = Field(default=None, description="what was there before / what the agent expects")
    actual: str | None = Field(default=None, description="what is there now")
    severity: DriftSeverity
    repaired: bool = False
    detail: dict[str, Any] = Field(default_factory=dict)


class Uevent(WireModel):
    """One kernel/udev event as the agent saw it (the fields that say which device and what happened)."""

    action: Literal["add", "remove", "change", "bind", "unbind", "move"]
    subsystem: str
    name: str = Field(description="last component of devpath: loop0p1, 0000:18:00.0, eth0")
    devpath: str
    devname: str | None = None
    devtype: str | None = None
    driver: str | None = None
    old_devpath: str | None = Field(default=None, description="move events only")
    seqnum: int | None = None
    synthetic: bool = Field(default=False, description="written to a sysfs uevent file, not caused by the device")


class DriftReport(WireModel):
    """Published on ``gpuaas.node.<node>.drift``."""

    schema_version: SchemaVersion = SCHEMA_VERSION
    node_id: str | None = Field(default=None, pattern=NODE_ID_PATTERN)
    trigger: DriftTrigger
    findings: list[DriftFinding]
    at: datetime
    events: list[Uevent] = Field(default_factory=list, description="the uevents that triggered it (capped)")
    events_dropped: int = Field(default=0, ge=0, description="events not listed: over the cap or refused by a full queue")
