"""The slot's power line on its own: who runs, who waits, who is superseded, and that a cancel leaks no turn."""

from __future__ import annotations

import asyncio

import pytest

from gpuaas_agent.tasks.power_line import MAX_POWER_TASKS_PER_SLOT, PowerLine, PowerSuperseded


async def _hold(line: PowerLine, slot: int, task_id: str, op: str, release: asyncio.Event, ran: list) -> str:
    async with line.turn(slot, task_id, op):
        ran.append(task_id)
        await release.wait()
    return task_id


async def _settle() -> None:
    for _ in range(5):  # a few loop turns: every task created so far reached its first wait
        await asyncio.sleep(0)


def test_the_newest_request_waits_and_earlier_waiters_are_superseded():
    async def scenario():
        line, release, ran = PowerLine(), asyncio.Event(), []
        running = asyncio.create_task(_hold(line, 0, "t1", "reboot", release, ran))
        await _settle()
        waiters = [asyncio.create_task(_hold(line, 0, f"t{i}", op, release, ran))
                   for i, op in ((2, "stop"), (3, "start"), (4, "reset"))]
        await _settle()
        assert line.tasks_of(0) == {"running": "t1", "waiting": "t4"} and line.count() == 2
        for task, by in zip(waiters[:2], ("t3", "t4")):
            with pytest.raises(PowerSuperseded) as info:
                await task
            assert info.value.evidence["superseded_by"] == by
        other = asyncio.create_task(_hold(line, 1, "u1", "reboot", release, ran))  # another slot: not in this line
        await _settle()
        assert line.tasks_of(1)["running"] == "u1"
        release.set()
        assert await running == "t1" and await waiters[2] == "t4" and await other == "u1"
        assert ran == ["t1", "u1", "t4"]
        assert line.tasks_of(0) == line.tasks_of(1) == {"running": None, "waiting": None} and line.count() == 0

    asyncio.run(scenario())


def test_a_repeat_of_the_running_operation_is_answered_at_once_not_queued():
    async def scenario():
        line, release, ran = PowerLine(), asyncio.Event(), []
        running = asyncio.create_task(_hold(line, 0, "t1", "reboot", release, ran))
        await _settle()
        with pytest.raises(PowerSuperseded) as info:
            async with line.turn(0, "t2", "reboot"):
                pytest.fail("a repeat of the running operation must not run")
        assert info.value.code == "superseded" and info.value.evidence["running"] == {"task_id": "t1",
                                                                                       "operation": "reboot"}
        assert line.tasks_of(0) == {"running": "t1", "waiting": None}
        release.set()
        await running
        assert MAX_POWER_TASKS_PER_SLOT == 2

    asyncio.run(scenario())


def test_a_waiter_cancelled_at_its_deadline_leaves_the_line():
    async def scenario():
        line, release, ran = PowerLine(), asyncio.Event(), []
        running = asyncio.create_task(_hold(line, 0, "t1", "reboot", release, ran))
        await _settle()
        waiter = asyncio.create_task(_hold(line, 0, "t2", "stop", release, ran))
        await _settle()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert line.tasks_of(0) == {"running": "t1", "waiting": None}
        release.set()
        await running
        assert ran == ["t1"] and line.tasks_of(0) == {"running": None, "waiting": None}

    asyncio.run(scenario())


def test_a_turn_handed_to_a_waiter_cancelled_at_that_moment_is_not_kept():
    """The running operation ends and hands its turn over in the same loop turn as the waiter's cancel."""
    async def scenario():
        line, release, ran = PowerLine(), asyncio.Event(), []
        release.set()
        async with line.turn(0, "t1", "reboot"):
            waiter = asyncio.create_task(_hold(line, 0, "t2", "stop", release, ran))
            await _settle()
            assert line.tasks_of(0) == {"running": "t1", "waiting": "t2"}
        # t1 left and handed its turn to t2 in this same loop turn; t2 has not resumed yet.
        assert line.tasks_of(0)["running"] == "t2"
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert ran == [] and line.tasks_of(0) == {"running": None, "waiting": None}
        async with line.turn(0, "t3", "stop"):  # the slot is free again at once
            assert line.tasks_of(0)["running"] == "t3"

    asyncio.run(scenario())
