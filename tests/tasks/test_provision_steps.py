"""The provision pipeline is a declared sequence of named steps, and bound steps keep the runner's semantics."""

import inspect
from dataclasses import dataclass

import pytest

from gpuaas_agent.contract.state import StepStatus
from gpuaas_agent.tasks.pipeline import PipelineFailed, StepDef, Undo, bind_steps, run_pipeline
from gpuaas_agent.tasks.provision import PROVISION_STEPS
from tests.support.pipeline_ctx import sync

# The order docs/operations.md's task table states for slice.vm_provision, with the Fabric Manager partition around
# start (docs/hgx.md: nothing to do on a host without a leased partition) and the fabric VF's attachment before define
# (docs/fabric.md).
DOCUMENTED = ["validate", "bind_vfio", "image", "data_disks", "clone", "seed", "ovs_port", "reservation", "fabric_vf",
              "define",
              "fabric_partition", "start", "fabric_partition_check", "readiness"]
# Steps that change the host (state store, sysfs, cache pins, disk, files, OVS, dnsmasq, libvirt, Fabric Manager).
WRITES = {"validate", "bind_vfio", "image", "clone", "seed", "ovs_port", "reservation", "fabric_vf", "define",
          "fabric_partition", "start"}


def test_provision_steps_are_the_documented_names_in_order():
    assert [s.name for s in PROVISION_STEPS] == DOCUMENTED
    assert [s.name for s in PROVISION_STEPS if s.touches_disk] == ["clone"]


def test_every_provision_step_that_writes_has_an_undo_or_says_why_not():
    for step in PROVISION_STEPS:
        assert (step.compensate is None) == (step.no_compensation is not None), step.name
        if step.name in WRITES and step.compensate is None:
            assert len(step.no_compensation) > 20, step.name  # a reason, not a placeholder
    undone = {s.name for s in PROVISION_STEPS if s.compensate is not None}
    assert undone == {"validate", "image", "seed", "ovs_port", "reservation", "fabric_vf", "define", "fabric_partition",
                      "start"}


def test_every_provision_step_takes_only_earlier_outputs_and_its_signature_matches():
    names = [s.name for s in PROVISION_STEPS]
    for index, step in enumerate(PROVISION_STEPS):
        assert set(step.takes) <= set(names[:index]), step.name
        params = list(inspect.signature(step.run).parameters)
        assert len(params) == 1 + len(step.takes), (step.name, params)
        if step.compensate is not None:
            assert len(inspect.signature(step.compensate).parameters) == 2, step.name


def test_a_step_taking_a_later_output_is_refused_at_bind_time():
    async def noop(run, *outputs):
        return None

    with pytest.raises(ValueError, match="takes"):
        bind_steps((StepDef("a", noop, takes=("b",)), StepDef("b", noop)), object())


@dataclass(frozen=True)
class Out:
    value: int

    def journal(self):
        return {"value": self.value}


@sync
async def test_bound_steps_hand_typed_outputs_forward_and_undo_sees_disk_touched(journal_ctx):
    seen: list = []

    async def first(run):
        return Out(run["base"])

    async def second(run, a: Out):
        seen.append(("second", a))
        return Out(a.value + 1)

    async def writes_disk(run, b: Out):
        raise RuntimeError("half written")

    async def undo_first(run, undo: Undo):
        seen.append(("undo_first", undo.output("first"), undo.output("second"), undo.output("disk"),
                     undo.disk_touched))
        return {"undone": "first"}

    defs = (StepDef("first", first, undo_first), StepDef("second", second, takes=("first",)),
            StepDef("disk", writes_disk, takes=("second",), touches_disk=True))
    with pytest.raises(PipelineFailed) as info:
        await run_pipeline(journal_ctx, bind_steps(defs, {"base": 41}))
    assert seen[0] == ("second", Out(41))
    assert seen[1] == ("undo_first", Out(41), Out(42), None, True)
    assert info.value.disk_touched and info.value.failed_step == "disk"
    assert info.value.evidence["compensations"] == [{"step": "first", "ok": True, "undone": "first",
                                                     "duration_s": info.value.evidence["compensations"][0]["duration_s"]}]
    assert [(e.step, e.status) for e in journal_ctx.store.journal_of("t-1")][:4] == [
        ("first", StepStatus.started), ("first", StepStatus.succeeded),
        ("second", StepStatus.started), ("second", StepStatus.succeeded)]
    # The journal detail of a step is its typed output as JSON (plus the runner's duration).
    details = [e.detail for e in journal_ctx.store.journal_of("t-1") if e.step == "second" and e.status is StepStatus.succeeded]
    assert details[0]["value"] == 42
