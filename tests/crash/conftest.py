"""One lab for the crash harness (its own: the harness kills the agent and restarts the services under it).

A one-slot lab with small slot disks, so every kill point is cheap: the harness runs
dozens of provisions and releases on slot 0, one after the other.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.harness import Lab, LabSettings
from tests.e2e.conftest import LoopThread
from tests.support.tiers import starts


@pytest.fixture(scope="package")
@starts("lab")
def crash_lab() -> Iterator[tuple[Lab, LoopThread]]:
    if os.geteuid() != 0:
        pytest.fail("the crash harness needs root (loop devices, OVS, dnsmasq, libvirtd)", pytrace=False)
    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-crash-", dir="/var/tmp"))
    lab = Lab(LabSettings(workdir=workdir, slots=1, disk_bytes=64 << 20, readiness_timeout_s=120,
                          say=lambda line: None))
    runner = LoopThread()
    try:
        runner.run(lab.start(), timeout=900)
        runner.run(lab.approve_slots(), timeout=120)
        lab.stop_agent()
        # A short drain, so a SIGTERM during a clone interrupts it (an upgrade never waits for a clone).
        config = json.loads(lab.config_path.read_text())
        config["shutdown_grace_s"] = 1.0
        # A killed agent acks nothing: JetStream redelivers after ack_wait. Short, so each point is cheap
        # (keepalives every second keep a running task from being redelivered meanwhile).
        config["ack_wait_s"] = 2.0
        config["keepalive_interval_s"] = 1.0
        lab.config_path.write_text(json.dumps(config, indent=2) + "\n")
        runner.run(lab.sync_consumer(), timeout=60)  # the consumer is the control plane's: it applies ack_wait
        yield lab, runner
    finally:
        problems = runner.run(lab.stop(), timeout=300)
        runner.close()
        if problems:
            pytest.fail(f"lab teardown left things behind: {problems}; logs in {workdir}", pytrace=False)
        shutil.rmtree(workdir, ignore_errors=True)
