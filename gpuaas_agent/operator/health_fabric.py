"""Fabric Manager restarts found on the health interval: the leases' partitions set active again within one round.

A restarted Fabric Manager (FM) forgets which partitions were active, and in its restart mode
(``FABRIC_MODE_RESTART=1``) it waits only a bounded time for the list to be set again; a guest
whose partition is lost has no NVLink. Nothing tells the agent that FM restarted, so every health
round compares FM's activated list (``fmpm -l``) with the partitions the agent's ``active`` leases
hold: a held partition FM lists inactive means FM lost it, and the round sets the list again
(``tasks/fabric_partitions.restore_after_restart``, read back by ``fmpm -l``) and journals it.

The health loop holds no slot lock, so it restores only allocations no task is changing (every
slot ``active``): a provision between activation and start is left to its own
``fabric_partition_check`` step, and a release that has just deactivated its partition is never
undone. Reconcile's ``fabric_partition_lost`` repair stays the backstop.

The ``fabric_partitions`` check: ``ok`` (every held partition active, or set active again now),
``degraded`` (FM does not answer: running partitions keep their NVLink, nothing can be restored),
``failed`` (FM lost a partition and did not take it back).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from gpuaas_agent.compat import UTC
from gpuaas_agent.contract.fabric import PartitionState
from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.contract.tasks import CheckStatus, HealthCheck
from gpuaas_agent.host.devices.fabricmanager import FabricManager, FabricManagerError
from gpuaas_agent.logs import log_event
from gpuaas_agent.tasks.fabric_partitions import partitions_to_restore, restore_after_restart, settled_allocations

log = logging.getLogger(__name__)
CHECK_NAME = "fabric_partitions"
# The journal the health loop's restores are recorded under (``store.journal_of(JOURNAL_TASK_ID)``).
JOURNAL_TASK_ID = "health-loop"
RESTORE_STEP = "fabric_partition_restore"


def _check(status: CheckStatus, detail: str) -> HealthCheck:
    return HealthCheck(name=CHECK_NAME, status=status, detail=detail[:4000], checked_at=datetime.now(UTC))


async def check_fabric_partitions(fabric: FabricManager, store: Any) -> HealthCheck:
    """One round: FM's activated list against the active leases; a lost partition of a settled slice restored."""
    held = [p for p in await store.partition_leases() if p.state is PartitionState.active]
    if not held:
        return _check("ok", "no active partition lease: Fabric Manager holds nothing for this agent")
    try:
        listed = await fabric.partitions()
    except FabricManagerError as exc:
        return _check("degraded", f"{exc.code}: {exc.message} (held partitions "
                                  f"{sorted(p.partition_id for p in held)} cannot be checked or restored)")
    settled = settled_allocations(await store.slot_states())
    lost = partitions_to_restore(listed, held)
    lost_settled = partitions_to_restore(listed, [p for p in held if p.allocation_id in settled])
    left = sorted(set(lost) - set(lost_settled))
    note = f"; partitions {left} left to the task in flight on their slots" if left else ""
    if not lost_settled:
        return _check("ok", f"held partitions {sorted(p.partition_id for p in held)} active{note}" if not lost
                      else f"Fabric Manager lists no settled slice's partition inactive{note}")
    evidence = {"lost": lost_settled, "held": sorted(p.partition_id for p in held),
                "allocations": sorted(p.allocation_id for p in held if p.partition_id in lost_settled)}
    try:
        restored = await restore_after_restart(fabric, store, listed, settled=settled)
    except FabricManagerError as exc:
        await store.journal(JOURNAL_TASK_ID, RESTORE_STEP, StepStatus.failed,
                            {**evidence, "code": exc.code, "error": exc.message[:500]})
        log_event(log, "fabric_partitions_restore_failed", logging.ERROR, code=exc.code, message=exc.message,
                  partitions=lost_settled)
        return _check("failed", f"Fabric Manager lost partitions {lost_settled} (a restart?) and did not take "
                                f"them back: {exc.code}: {exc.message}{note}")
    await store.journal(JOURNAL_TASK_ID, RESTORE_STEP, StepStatus.succeeded, {**evidence, "restored": restored})
    log_event(log, "fabric_partitions_restored", logging.WARNING, partitions=restored,
              message=f"Fabric Manager lost partitions {restored} (a restart): set active again, read back")
    return _check("ok", f"Fabric Manager lost partitions {restored} (a restart): set active again and read "
                        f"back{note}")


def fabric_probe(fabric: FabricManager, store: Any) -> Callable[[], Awaitable[list[HealthCheck]]]:
    """The health round's ``fabric_partitions`` check (``Reporter.extra_checks``)."""

    async def fabric_partitions() -> list[HealthCheck]:
        return [await check_fabric_partitions(fabric, store)]

    return fabric_partitions
