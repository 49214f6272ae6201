"""The table of wipe methods: one module per method a policy can run, checked against the contract's one enum.

A method the contract names without a module, a module under a name the contract does not have,
or a module registered under another method's name must fail loudly (at import, where the table
is built), never fall through to some other way of wiping.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.nvmewipe import POLICY_ONLY, PROOF_ONLY, RUNNABLE, WipeMethod, WipePolicy
from gpuaas_agent.contract.storage import WipeProof
from gpuaas_agent.guards.disk import DiskGuardError
from gpuaas_agent.host.run import run
from gpuaas_agent.host.storage.wipemethods import (
    WIPE_METHODS,
    WipeMethodTableError,
    checked_table,
    discard,
    nvme_format,
    nvme_sanitize,
    wipe_method,
    zeroout,
)
from gpuaas_agent.host.storage.wipepolicy import wipe_slot_disk
from gpuaas_agent.hostfs import HostRoot
from tests.support.realdev import MiB, read_bytes

LIVE = HostRoot.open("/")

# The values the control plane sends in a policy, and the agent has written in proofs, before one enum.
POLICY_WIRE = {"auto", "discard", "zeroout", "nvme_format", "nvme_sanitize"}
PROOF_WIRE = {"discard", "zeroout", "zero_fill", "nvme_format", "nvme_sanitize"}


def _proof(method: str, policy: str | None = None) -> dict[str, object]:
    return {"by_id": "/dev/disk/by-id/nvme-eui.0000000000000001", "kernel_name": "nvme0n1", "dev": "259:0",
            "method": method, "bytes": 1 << 20, "seed": 1, "samples": [], "signatures_found": [],
            "partitions_left": [], "duration_s": 0.1, "verified": True, "policy": policy}


def test_every_method_a_policy_can_run_has_exactly_one_module_that_says_it_is_that_method():
    assert set(WIPE_METHODS) == RUNNABLE
    assert {m: module.METHOD for m, module in WIPE_METHODS.items()} == {m: m for m in RUNNABLE}
    assert RUNNABLE == set(WipeMethod) - POLICY_ONLY - PROOF_ONLY
    for method in RUNNABLE:
        assert wipe_method(method) is WIPE_METHODS[method]


def test_a_method_missing_from_the_table_fails_loudly():
    table = {WipeMethod.discard: discard, WipeMethod.zeroout: zeroout, WipeMethod.nvme_format: nvme_format}
    with pytest.raises(WipeMethodTableError, match="nvme_sanitize: a method a policy can name has no module"):
        checked_table(table)


def test_a_table_entry_the_contract_enum_does_not_have_fails_loudly():
    shred = SimpleNamespace(METHOD="shred")
    with pytest.raises(WipeMethodTableError, match="'shred': not a method a policy can run"):
        checked_table({**WIPE_METHODS, "shred": shred})
    # zero_fill is in the enum, but only as what a proof records: no policy runs it, so no module may claim it.
    with pytest.raises(WipeMethodTableError, match="zero_fill.*not a method a policy can run"):
        checked_table({**WIPE_METHODS, WipeMethod.zero_fill: zeroout})
    with pytest.raises(WipeMethodTableError, match="auto.*not a method a policy can run"):
        checked_table({**WIPE_METHODS, WipeMethod.auto: zeroout})


def test_a_module_registered_under_another_methods_name_fails_loudly():
    with pytest.raises(WipeMethodTableError, match="nvme_sanitize: registered to a module that is nvme_format"):
        checked_table({**WIPE_METHODS, WipeMethod.nvme_sanitize: nvme_format})
    assert nvme_sanitize.METHOD is WipeMethod.nvme_sanitize


@pytest.mark.parametrize("method", sorted(POLICY_ONLY | PROOF_ONLY, key=lambda m: m.value))
def test_a_method_no_module_runs_is_refused_by_name_not_wiped_some_other_way(method):
    with pytest.raises(WipeMethodTableError, match=repr(method.value)):
        wipe_method(method)


def test_one_enum_keeps_the_wire_values_policies_and_proofs_already_carry():
    assert {m.value for m in WipeMethod} == POLICY_WIRE | PROOF_WIRE
    for value in POLICY_WIRE:
        assert WipePolicy.from_wire({"method": value}).method.value == value
        assert WipeProof.from_wire(_proof("zeroout", policy=value)).policy is WipeMethod(value)
    for value in PROOF_WIRE:
        assert WipeProof.from_wire(_proof(value)).method is WipeMethod(value)


def test_a_policy_naming_how_a_zeroout_ran_and_a_proof_naming_an_unresolved_method_are_refused():
    with pytest.raises(ValidationError, match="zero_fill is how a zeroout ran"):
        WipePolicy.from_wire({"method": "zero_fill"})
    with pytest.raises(ValidationError, match="zero_fill is how a zeroout ran"):
        WipeProof.from_wire(_proof("zeroout", policy="zero_fill"))
    with pytest.raises(ValidationError, match="auto is resolved before a wipe runs"):
        WipeProof.from_wire(_proof("auto"))
    schema = WipePolicy.model_json_schema()
    assert schema["properties"]["method"]["not"] == {"enum": ["zero_fill"]}
    assert WipeProof.model_json_schema()["properties"]["method"]["not"] == {"enum": ["auto"]}


@pytest.mark.parametrize("method", sorted(WIPE_METHODS, key=lambda m: m.value))
def test_every_method_gets_the_disk_only_through_the_guard(realdev, method):
    """A disk with a mounted child is refused before any method runs a command (each new method included)."""
    disk = realdev.disk(32, partitions_mib=[16])
    realdev.mkfs_ext4(disk.partitions[0])
    realdev.mount(disk.partitions[0])
    before = read_bytes(disk.dev, 0, MiB)
    sent: list[list[str]] = []

    async def recording(argv, **kwargs):
        sent.append(list(argv))
        return await run(argv, **kwargs)

    with pytest.raises(DiskGuardError) as refused:
        asyncio.run(wipe_slot_disk(WipePolicy(method=method), LIVE, disk.by_id, lease=disk.lease(),
                                   runner=recording))
    assert refused.value.code == "mounted_child" and sent == []
    assert read_bytes(disk.dev, 0, MiB) == before
