"""What an idle daemon carries: modules only a task needs are not imported with the daemon (bench/bench_idle.py
measures the footprint; this pins the structure that keeps it down, never a time or a size)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

# Only a provision builds a seed ISO (pycdlib, PyYAML); only a live host with a GPU driver asks NVML; only a
# host with a [bmc] table reads a BMC (sushy, and the requests it brings); only an open terminal speaks SSH
# (asyncssh); only a cache hit under another URL reads ranges with httpx (and its CLI's click and pygments).
NOT_AT_IMPORT = ("pycdlib", "yaml", "pynvml", "sushy", "requests", "asyncssh", "httpx", "click", "pygments")


def test_importing_the_daemon_does_not_import_what_only_a_task_or_a_gpu_host_needs():
    code = ("import json, sys, gpuaas_agent.daemon; "
            f"print(json.dumps([m for m in {NOT_AT_IMPORT!r} if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_importing_the_daemon_builds_no_wire_model_validator_until_one_is_used():
    """contract/base.py's ``defer_build``: the ~180 wire models cost their validators only when first used."""
    code = ("import json, gpuaas_agent.daemon\n"
            "from gpuaas_agent.contract.base import WireModel\n"
            "from gpuaas_agent.contract.state import SlotLease\n"
            "def subs(c):\n"
            "    for s in c.__subclasses__():\n"
            "        yield s\n"
            "        yield from subs(s)\n"
            "models = list(subs(WireModel))\n"
            "built = [m.__name__ for m in models if m.__pydantic_complete__]\n"
            "before = SlotLease.__pydantic_complete__\n"
            "try:\n"
            "    SlotLease.model_validate({'allocation_id': 'nope'})\n"
            "except ValueError:\n"
            "    pass\n"
            "print(json.dumps([len(models), built, before, SlotLease.__pydantic_complete__]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    count, built, lease_before, lease_after = json.loads(proc.stdout)
    assert count > 100 and len(built) <= 5, built  # the few a module validates at import (a default instance)
    assert (lease_before, lease_after) == (False, True)  # built on the first validation, which still refuses


def test_a_seed_iso_still_builds_with_its_imports_deferred():
    from gpuaas_agent.host.vm.cloudinit import build_seed_iso

    iso = build_seed_iso({"meta-data": b"instance-id: i-1\n", "user-data": b"#cloud-config\n"})
    assert iso[0x8001:0x8006] == b"CD001"  # the primary volume descriptor's identifier


def test_the_status_file_is_replaced_atomically_without_an_fsync_per_heartbeat(tmp_path, monkeypatch):
    import os
    from datetime import datetime

    from gpuaas_agent.compat import UTC
    from gpuaas_agent.operator.daemonstatus import DaemonStatus, read_status, status_path, write_status

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    now = datetime.now(UTC)
    for state in ("healthy", "degraded"):
        write_status(tmp_path, DaemonStatus(node_id="node-test", agent_version="0.1.0", pid=1, started_at=now,
                                            written_at=now, heartbeat_interval_s=15, nats_state="connected",
                                            health_state=state))
    assert read_status(tmp_path).health_state == "degraded" and synced == []
    assert os.stat(status_path(tmp_path)).st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [status_path(tmp_path).name]  # no temp file left behind
