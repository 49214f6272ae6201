"""Maintenance toggled around a provision: refused cleanly before the lease, or the run goes on unaffected.

Real pieces: loop disks behind the recorded 8xH200 host (lab/loophost.py), the real pipeline, the SQLite
store (maintenance written through a second connection, as `gpuaas-agent maintenance on` does from its own
process), and for the run that passes validate the prepared host (OVS, dnsmasq, relay key).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gpuaas_agent.contract.fleet import MaintenancePayload
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.state.store import StateStore
from gpuaas_agent.tasks.maintenance import set_maintenance
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.provision import provision
from tests.support.provision_inputs import approved_slot_of_host, provision_payload, slice_drivers_for, task_ctx
from tests.tasks.conftest import provision_failure, slice_loop_host

MiB = 1 << 20


@pytest.fixture
def loop_host(tmp_path):
    with slice_loop_host(tmp_path / "host", disk_bytes=64 * MiB) as host:
        yield host


def _maintenance(path, mode: str) -> None:
    """Toggle maintenance through its own connection to the state file (another process, for the agent)."""
    other = StateStore.open(path)
    try:
        set_maintenance(other, MaintenancePayload(mode=mode, reason=f"test {mode}", requested_by="local:test"),
                        f"cli-{mode}")
    finally:
        other.close()


def test_a_provision_in_maintenance_is_refused_before_the_lease_with_the_slot_clean(loop_host, tmp_path):
    db = tmp_path / "state.db"
    store = StateStore.open(db)
    _maintenance(db, "on")
    payload = provision_payload(approved_slot_of_host(loop_host, 0))
    before = open(loop_host.disks[0].loop, "rb").read(MiB)
    ctx = task_ctx(store, "t-maint")
    failure = provision_failure(slice_drivers_for(loop_host, tmp_path), payload, ctx)
    assert (failure.failed_step, failure.code, failure.disk_touched) == ("validate", "host_in_maintenance", False)
    assert failure.evidence["maintenance"]["reason"] == "test on"
    assert store.leases() == [] and store.slot_states() == []
    assert [o.status.value for o in ctx.slot_outcomes] == ["reserved"]
    assert open(loop_host.disks[0].loop, "rb").read(MiB) == before
    store.close()


def test_maintenance_turned_on_while_a_provision_runs_does_not_cut_it_and_refuses_the_next(loop_host, tmp_path,
                                                                                          prepared_host):
    """Past its check the run is the tenant's: it goes on to its own end (here the image cannot be fetched, so
    it fails there and undoes itself whole), never stopped half-way by maintenance. The next one is refused."""
    db = tmp_path / "state.db"
    store = StateStore.open(db)
    payload = provision_payload(approved_slot_of_host(loop_host, 0, ovs_bridge=prepared_host.bridge))
    ctx = task_ctx(store, "t-during")
    toggled: list[str] = []

    def on_progress(step, status, percent):
        if step == "validate" and status == "succeeded" and not toggled:
            _maintenance(db, "on")  # the operator, between validate and the next step
            toggled.append(step)

    ctx.on_progress = on_progress
    failure = provision_failure(slice_drivers_for(loop_host, tmp_path, prepared_host), payload, ctx)
    assert toggled == ["validate"]
    assert failure.failed_step == "image" and failure.code != "host_in_maintenance", failure
    journal = [(e.step, e.status) for e in store.journal_of("t-during")]
    assert ("validate", StepStatus.succeeded) in journal and ("image", StepStatus.started) in journal
    assert ("validate", StepStatus.compensated) in journal  # undone by its own failure, whole
    assert store.leases() == [] and store.slot_states() == [] and not failure.disk_touched

    next_one = provision_failure(slice_drivers_for(loop_host, tmp_path, prepared_host),
                                 provision_payload(approved_slot_of_host(loop_host, 0, ovs_bridge=prepared_host.bridge),
                                                   alloc=str(uuid.uuid4())), task_ctx(store, "t-next"))
    assert (next_one.failed_step, next_one.code) == ("validate", "host_in_maintenance")
    assert store.leases() == []
    store.close()


def test_a_refused_provision_raises_no_half_state_when_maintenance_races_the_check(loop_host, tmp_path):
    """Maintenance written while validate waits on the store: the check sees it (refused) or not (goes on);
    the outcome is one of the two, each clean."""
    db = tmp_path / "state.db"
    store = StateStore.open(db)

    async def race():
        sh = slice_drivers_for(loop_host, tmp_path)
        ctx = task_ctx(store, "t-race")
        try:
            run = asyncio.create_task(provision(sh, provision_payload(approved_slot_of_host(loop_host, 0)), ctx))
            await asyncio.to_thread(_maintenance, db, "on")
            with pytest.raises(PipelineFailed) as info:
                await run
            return info.value
        finally:
            await sh.close()

    failure = asyncio.run(race())
    # Without a prepared host a run that passed the maintenance check is refused by a host precondition: either
    # way in validate, before the lease, nothing leased or recorded.
    assert failure.failed_step == "validate" and not failure.disk_touched
    assert store.leases() == [] and store.slot_states() == []
    store.close()
