"""The slice terminal relay over the wire into a real TCG guest of the lab-in-a-box (dropbear, slot 6).

The gateway's side is played on the lab's control-plane connection: it subscribes to the
session's ``.out`` subject, opens the session with ``slice.terminal_open``, types on ``.in``
and reads the guest's real PTY (busybox ``sh`` under dropbear, logged in as the allocation's
user with the node's relay key that provision put in its ``authorized_keys``).
"""

from __future__ import annotations

import base64
import re
import sqlite3
import uuid

from tests.support.lab_tasks import approved_slot_in, run_lab_task
from tests.support.terminal_gateway import Gateway

SLOT = 6


def _audit_row(lab_, session_id: str) -> dict | None:
    conn = sqlite3.connect(f"file:{lab_.work / 'state/state.db'}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        row = conn.execute("SELECT * FROM terminal_session WHERE session_id = ?", (session_id,)).fetchone()
    finally:
        conn.close()
    return dict(row) if row else None


def test_a_gateway_opens_a_pty_in_a_real_guest_runs_a_command_resizes_and_closes(lab):
    lab_, runner = lab
    slot = approved_slot_in(lab, SLOT)
    payload = lab_.provision_payload(slot)
    alloc = payload["allocation_id"]
    provisioned = run_lab_task(lab, "slice.vm_provision", payload)
    assert provisioned.status.value == "succeeded", provisioned.error
    sid = str(uuid.uuid4())
    base = {"allocation_id": alloc, "slot_index": SLOT, "user": payload["user"], "requested_by": "e2e@lab",
            "capacity_shape": "gpu_slice", "target_host": slot.private_ip, "target_port": 22}

    async def session():
        gw = await Gateway(lab_.cp.nc, sid, node=lab_.node_id).start()
        try:
            opened = await lab_.task("slice.terminal_open", {**base, "session_id": sid, "cols": 80, "rows": 24},
                                     timeout=120)
            assert opened.status.value == "succeeded", opened.error
            assert opened.output["host_key_pinned"] == "first_use"
            assert opened.output["target_host"] == slot.private_ip
            # A computed marker: only the shell's output has it (the PTY's echo of the command does not).
            await gw.send(b"echo TERM-MARK-$((6*7))\n")
            await gw.wait(lambda g: b"TERM-MARK-42" in g.output, timeout=120)
            await gw.send(b"stty size\n")
            await gw.wait(lambda g: re.search(rb"\n24 80\r?\n", bytes(g.output)), timeout=120)
            resized = await lab_.task("slice.terminal_resize", {"session_id": sid, "allocation_id": alloc,
                                                                "cols": 132, "rows": 40}, timeout=120)
            assert resized.status.value == "succeeded", resized.error
            await gw.send(b"stty size\n")
            await gw.wait(lambda g: re.search(rb"\n40 132\r?\n", bytes(g.output)), timeout=120)
            typed = await lab_.task("slice.terminal_data", {"session_id": sid, "allocation_id": alloc,
                                                            "data": base64.b64encode(b"id -un\n").decode()},
                                    timeout=120)
            assert typed.status.value == "succeeded", typed.error
            await gw.wait(lambda g: re.search(rb"\ntenant\r?\n", bytes(g.output)), timeout=120)
            closed = await lab_.task("slice.terminal_close", {"session_id": sid, "allocation_id": alloc},
                                     timeout=120)
            assert closed.status.value == "succeeded", closed.error
            final = await gw.wait_closed(timeout=60)
            return closed.output, final, len(gw.output)
        finally:
            await gw.sub.unsubscribe()

    async def refusals():
        inactive = await lab_.task("slice.terminal_open", {**base, "session_id": str(uuid.uuid4()),
                                                          "allocation_id": str(uuid.uuid4())}, timeout=120)
        foreign = await lab_.task("slice.terminal_open", {**base, "session_id": str(uuid.uuid4()),
                                                         "target_host": lab_.gateway}, timeout=120)
        return inactive, foreign

    try:
        audit, final, received = runner.run(session(), timeout=900)
        assert final.closed.reason.value == "client_closed"
        assert audit["close_reason"] == "client_closed" and audit["bytes_out"] == received > 0
        assert audit["bytes_in"] == len(b"echo TERM-MARK-$((6*7))\nstty size\nstty size\nid -un\n")
        row = _audit_row(lab_, sid)
        assert row is not None and row["close_reason"] == "client_closed" and row["closed_at"] >= row["opened_at"]
        assert (row["allocation_id"], row["requested_by"], row["login_user"], row["target_host"]) == (
            alloc, "e2e@lab", "tenant", slot.private_ip)

        inactive, foreign = runner.run(refusals(), timeout=300)
        assert inactive.status.value == "failed" and inactive.error.code == "not_this_allocation", inactive.error
        assert foreign.status.value == "failed" and foreign.error.code == "target_not_slice_ip", foreign.error
        assert foreign.error.evidence["reserved_ip"] == slot.private_ip
    finally:
        released = run_lab_task(lab, "slice.vm_release", lab_.release_payload(alloc, slot))
        assert released.status.value == "succeeded", released.error
