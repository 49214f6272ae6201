"""Driving the lab-in-a-box from a test: its approved slots, one task over NATS to its result, libvirt's domains.

``lab`` is tests/e2e's (lab, runner) fixture: the runner runs coroutines on the lab's loop thread.
Used by the e2e modules (pipelines, power, terminal).
"""

from __future__ import annotations

import libvirt


def approved_slot_in(lab, index):
    """The lab's approved record of slot ``index`` (the slots are approved on first use)."""
    lab_, runner = lab
    if not lab_.approved:
        runner.run(lab_.approve_slots(), timeout=120)
    return next(s for s in lab_.approved if s.slot_index == index)


def run_lab_task(lab, task_type, payload, timeout=900, **kw):
    """Enqueue one task for the lab's agent and wait for its result (``timeout`` s, plus 30 s for the runner)."""
    lab_, runner = lab
    return runner.run(lab_.task(task_type, payload, timeout=timeout, **kw), timeout=timeout + 30)


def libvirt_domains():
    """Every domain of qemu:///system, name -> active."""
    conn = libvirt.open("qemu:///system")
    try:
        return {d.name(): bool(d.isActive()) for d in conn.listAllDomains()}
    finally:
        conn.close()


def only_slot_outcome(result):
    """The one slot outcome of a single-slot task's result."""
    assert len(result.slot_outcomes) == 1, result
    return result.slot_outcomes[0]
