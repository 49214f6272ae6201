"""Console capture on a real TCG guest of the lab-in-a-box (slot 4): what the guest printed on its serial console.

The lab's guest writes its boot and power-off markers to its serial console (lab/guest/rc.*);
libvirt (virtlogd) writes them to the allocation's log; ``slice.console_log`` reads it back while
the VM runs, after the VM is powered off, and after the slice is released. Another allocation's
task naming the slot is refused. The test releases its slice whatever happens.
"""

from __future__ import annotations

import uuid

from lab.build_guest_image import BOOT_MARKER
from tests.support.lab_tasks import approved_slot_in, run_lab_task

SLOT = 4


def _console(lab, alloc: str, tail_kib: int = 64):
    return run_lab_task(lab, "slice.console_log", {"allocation_id": alloc, "slot_index": SLOT, "tail_kib": tail_kib},
                        timeout=120)


def test_a_real_guests_serial_console_is_captured_and_outlives_the_vm(lab):
    lab_, _ = lab
    slot = approved_slot_in(lab, SLOT)
    payload = lab_.provision_payload(slot)
    alloc = payload["allocation_id"]
    provisioned = run_lab_task(lab, "slice.vm_provision", payload)
    assert provisioned.status.value == "succeeded", provisioned.error
    released = None
    try:
        running = _console(lab, alloc)
        assert running.status.value == "succeeded", running.error
        assert BOOT_MARKER in running.output["text"]
        assert running.output["path"] == str(lab_.work / "console" / f"{alloc}-slot{SLOT}.log")

        # Another allocation naming the slot: refused, and nothing of the log in the answer.
        other = _console(lab, str(uuid.uuid4()))
        assert other.status.value == "failed" and other.error.code == "not_this_allocation"
        assert BOOT_MARKER not in str(other.error)

        stopped = run_lab_task(lab, "slice.vm_power", {"allocation_id": alloc, "slot_index": SLOT, "operation": "stop",
                                                       "graceful_timeout_s": 60}, timeout=600)
        assert stopped.status.value == "succeeded", stopped.error
        dead = _console(lab, alloc, tail_kib=1)
        assert dead.status.value == "succeeded" and "GPUAAS-LAB-GUEST-POWEROFF" in dead.output["text"]
        assert dead.output["returned_bytes"] <= 1024
    finally:
        released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(alloc, slot, 10), timeout=600)
    assert released.status.value == "succeeded", released.error
    after = _console(lab, alloc)
    assert after.status.value == "succeeded" and BOOT_MARKER in after.output["text"]
