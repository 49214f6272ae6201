"""Issue 17 item 5: the package upgraded while its agent clones a slot disk; the new version finishes the provision.

On this machine itself, as the fresh-host lane (test_fresh_host.py) does: the lab's daemons (NATS,
OVS, dnsmasq, libvirtd, loop-device slot disk, TCG guest) need the root namespace and the host's
tools, so the package is installed here, not in a chroot. v1 and v2 are built by the script
``make deb`` runs and installed with ``apt-get``; dpkg runs the package's real maintainer scripts.

What is emulated is systemd as PID 1 (tests/deploy/service_manager.py): the scripts' calls to
``deb-systemd-invoke``/``systemctl`` reach a small service manager that starts the *installed*
unit's ``ExecStartPre=``/``ExecStart=`` (``Type=notify``: started at ``READY=1``) and stops it as
the unit says (``SIGTERM`` to the agent, ``TimeoutStopSec=``, then ``SIGKILL`` for what is left
in the unit's cgroup). The scripts only call systemd when ``/run/systemd/system`` exists, so apt
runs in a private mount namespace where it does (nothing outside that namespace sees it).

The sequence, all from the package's own paths: v1 installed (nothing started), the admin's
config, enable + start (prepare-host, enroll, run); a provision whose clone is throttled (the
unit's cgroup writes the slot disk at 1 MiB/s, lifted once the agent has killed qemu-img) so it
outlasts the drain (``shutdown_grace_s``, 3 s here instead of 60 to keep the test short: the same
code path); ``apt-get install v2`` in the middle of that clone: prerm stops (drains) v1, dpkg
unpacks v2, postinst starts v2. Asserted:

* the stop is the agent's own clean exit (0) well inside ``TimeoutStopSec``, and nothing of the
  unit outlived it (qemu-img was killed by the agent, so no writer from v1 is left on the disk);
* v1 left the task journaled at ``clone started`` (then its hand-back), nothing failed or compensated, no result;
* v2's code opens that state file (``PRAGMA user_version`` is the schema it knows, no migration)
  and reads v1's journal rows;
* v2 resumes the task within seconds of its start (v1 handed the task back at its stop), redoes
  the clone whole and finishes the provision: exactly one result in the result stream, succeeded,
  slot active, the lease held by that allocation and nothing else;
* the slot disk holds the image byte for byte (sha256);
* the journal reads: v1's run up to ``clone started``, then v2's run from ``task started`` on,
  v1's rows unchanged;
* the maintainer scripts' calls: stop while v1's files are on disk, start once v2's are.

Then v2 releases the slice (its seed ISO would otherwise keep the package's seed dir at purge) and
the machine is purged as it began (``clean_machine`` of the fresh-host lane).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from gpuaas_agent.compat import tomllib
from lab.harness import Lab, LabSettings
from tests.deploy.chroot import APT_TIMEOUT_S, run_checked
from tests.deploy.machine import INSTALLED_AGENT, SEED_DIR, STATE_DIR, V2_LOCAL, tree_version
from tests.deploy.service_manager import UNIT, ServiceManager, UnitFile

PROVISION = "slice.vm_provision"
DRAIN_S = 3.0          # shutdown_grace_s for this test: shorter than the throttled clone
THROTTLE_BPS = 1 << 20  # the unit's writes to the slot disk while v1 runs: the image's clone takes ~20 s
WAIT_S = 600.0         # failure bound of every wait below, never a timer
# v2 takes the handed-back task at its first pull; without the hand-back JetStream would redeliver it only
# ack_wait_s (60 s) after v1's last keepalive.
RESUME_BOUND_S = 30.0
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}  # no PYTHONPATH to the tree


@pytest.fixture(scope="module")
def debs(tmp_path_factory, deb_build) -> dict[str, Path]:
    """The tree's own version and a newer one, as test_deb.py installs them (built once a session: ``deb_build``)."""
    out = tmp_path_factory.mktemp("dist")
    version = tree_version()
    return {label: deb_build(ver, out) for label, ver in (("v1", version), ("v2", f"{version}+{V2_LOCAL}"))}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)  # a JSON string or number is a valid TOML one
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(config: dict) -> str:
    """The lab's config as the site's /etc/gpuaas-agent/agent.toml (top-level keys, then one table each)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for name, table in config.items():
        if isinstance(table, dict):
            lines += ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    text = "\n".join(lines) + "\n"
    assert tomllib.loads(text) == config
    return text


def apt_install(deb: Path, manager: ServiceManager) -> subprocess.CompletedProcess:
    """``apt-get install ./deb`` with systemd "running" for the maintainer scripts (a private mount namespace
    where /run/systemd/system exists) and its calls going to ``manager`` (the shims first on dpkg's PATH)."""
    script = ('mount -t tmpfs -o mode=0755,size=1m gpuaas-ci /run/systemd && mkdir /run/systemd/system && '
              'exec "$0" "$@"')
    return run_checked(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                 "apt-get", "install", "-y", "--no-install-recommends", "--allow-downgrades",
                 f"-oDPkg::Path={manager.shim_dir}:/usr/sbin:/usr/bin:/sbin:/bin", str(deb)],
                timeout=APT_TIMEOUT_S, env={**CLEAN_ENV, "DEBIAN_FRONTEND": "noninteractive"})


PF_EXITING = 0x4
SIGKILL_BIT = 1 << (9 - 1)


def _being_killed(pid: int) -> bool:
    """SIGKILL pending or already in exit (a killed qemu-img finishing its in-flight writes), or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    if int(stat.rsplit(")", 1)[1].split()[6]) & PF_EXITING:
        return True
    pending = {k: v.strip() for k, v in (line.split(":", 1) for line in status.splitlines() if ":" in line)}
    return bool((int(pending["SigPnd"], 16) | int(pending["ShdPnd"], 16)) & SIGKILL_BIT)


def lift_throttle_once_killed(manager: ServiceManager, dev: str) -> None:
    """The throttle only makes the clone outlast the drain: once the agent has cancelled it (SIGKILL to
    qemu-img), its in-flight writes finish at full speed, so the stop measures the agent, not the throttle."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        clones = [pid for pid in manager.pids() if _comm(pid) == "qemu-img"]
        if not clones or all(_being_killed(pid) for pid in clones):
            break
        time.sleep(0.02)  # poll step of the deadline wait above
    manager.throttle_writes(dev, 0)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def snapshot(db_path: Path, into: Path, task_id: str) -> dict:
    """A consistent copy of the state file (SQLite backup) and what v1 left in it for ``task_id``."""
    src = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    dst = sqlite3.connect(into)
    try:
        src.backup(dst)
    finally:
        src.close()
    try:
        return {
            "user_version": dst.execute("PRAGMA user_version").fetchone()[0],
            "journal": dst.execute("SELECT seq, step, status, detail, at FROM task_journal WHERE task_id = ? ORDER BY seq",
                                   (task_id,)).fetchall(),
            "results": dst.execute("SELECT COUNT(*) FROM task_result WHERE task_id = ?", (task_id,)).fetchone()[0],
            "leases": dst.execute("SELECT slot_index, allocation_id FROM slot_lease").fetchall(),
            "records": dst.execute("SELECT slot_index, allocation_id, status FROM slot_state").fetchall(),
        }
    finally:
        dst.close()


V2_READS = """
import json, sys
from gpuaas_agent import __version__
from gpuaas_agent.state.store import MIGRATIONS, StateStore
store = StateStore.open(sys.argv[1])
print(json.dumps({"version": __version__, "known_schema": len(MIGRATIONS), "schema": store.schema_version,
                  "journal": [[e.seq, e.step, e.status.value] for e in store.journal_of(sys.argv[2])],
                  "unfinished": store.unfinished_steps(sys.argv[2])}))
"""


def test_an_upgrade_during_a_clone_leaves_it_journaled_and_the_new_version_finishes_the_provision(
        clean_machine, debs, tmp_path):
    timings: dict[str, float] = {}
    started = time.monotonic()
    v1, v2 = (debs[k].name.split("_")[1] for k in ("v1", "v2"))
    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-upgrade-", dir="/var/tmp"))
    lines: list[str] = []
    lab = Lab(LabSettings(workdir=workdir, slots=1, disk_bytes=64 << 20, readiness_timeout_s=300, say=lines.append,
                          agent_binary=INSTALLED_AGENT, use_package_paths=True))
    manager = ServiceManager(workdir / "systemd")
    alloc, task_id = str(uuid.uuid4()), f"upgrade-{uuid.uuid4().hex[:8]}"
    seen: dict = {}

    async def body() -> None:
        mark = time.monotonic()
        await lab.start_services()
        timings["lab services"] = time.monotonic() - mark

        # --- v1 from its package; the site's config; enabled and started as cloud-init would ---------------
        mark = time.monotonic()
        await asyncio.to_thread(apt_install, debs["v1"], manager)
        timings["install v1"] = time.monotonic() - mark
        assert not [c for c in manager.calls if " start " in f" {c} "], manager.calls  # a fresh install starts nothing
        lab._make_keys()
        lab._write_config()
        config = json.loads(lab.config_path.read_text())
        config["shutdown_grace_s"] = DRAIN_S
        Path("/etc/gpuaas-agent/agent.toml").write_text(to_toml(config))
        token = STATE_DIR / "bootstrap-token"
        token.write_text(lab.cp.issue_token() + "\n")
        token.chmod(0o600)
        disk = lab.host.disks[0]
        dev = Path(f"/sys/class/block/{Path(disk.loop).name}/dev").read_text().strip()
        manager.throttle_writes(dev, THROTTLE_BPS)
        manager.enabled = True  # `systemctl enable --now gpuaas-agent.service` (cloud-init's runcmd)
        mark = time.monotonic()
        await asyncio.to_thread(manager.start)
        lab.node_id = json.loads((STATE_DIR / "enrollment.json").read_text())["node_id"]
        slots = await lab.approve_slots()
        assert [s.slot_index for s in slots] == [0]
        timings["v1 start + topology"] = time.monotonic() - mark

        # --- a provision; the upgrade lands in the middle of its clone -----------------------------------
        def on_stopped(record) -> None:
            """Between v1's exit and v2's unpack: what v1 left on disk; then the disk at full speed again."""
            seen["stopped_at"] = time.time()
            seen["snapshot"] = snapshot(STATE_DIR / "state.db", workdir / "v1-state.db", task_id)
            manager.throttle_writes(dev, 0)

        def on_sigterm() -> None:
            threading.Thread(target=lift_throttle_once_killed, args=(manager, dev), name="unthrottle",
                             daemon=True).start()

        manager.on_sigterm.append(on_sigterm)
        manager.on_stopped.append(on_stopped)
        # A qcow2 of the lab image: its clone is qemu-img's (a raw image not yet cached streams instead,
        # docs/images.md), the long-running writer whose cancellation at the stop this test is about.
        qcow2 = lab.image_path.with_name("guest-upgrade.qcow2")
        await asyncio.to_thread(run_checked, ["qemu-img", "convert", "-f", "raw", "-O", "qcow2",
                                              str(lab.image_path), str(qcow2)], env=None)
        image = {"url": f"file://{qcow2}", "sha256": hashlib.sha256(qcow2.read_bytes()).hexdigest()}
        envelope = lab.cp.envelope(lab.node_id, PROVISION, {**lab.provision_payload(slots[0], allocation_id=alloc),
                                                            "image": image, "readiness_timeout_s": 300},
                                   task_id=task_id)
        mark = time.monotonic()
        await lab.cp.enqueue(envelope)
        await lab.cp.wait_for(lambda s: [e for e in s.progress if e.task_id == task_id and e.step == "clone"
                                          and e.status == "progress" and (e.percent or 0) < 100], timeout=WAIT_S)
        timings["provision to clone"] = time.monotonic() - mark
        mark = time.monotonic()
        await asyncio.to_thread(apt_install, debs["v2"], manager)
        timings["upgrade"] = time.monotonic() - mark
        mark = time.monotonic()
        seen["result"] = await lab.cp.wait_result(task_id, timeout=WAIT_S)
        timings["v2 finishes"] = time.monotonic() - mark
        seen["results"] = [r for r in await lab.cp.stored_results() if r.task_id == task_id]
        check(seen, lab, manager, workdir, alloc, task_id, v1, v2)
        mark = time.monotonic()
        release = await lab.task("slice.vm_release", Lab.release_payload(alloc, slots[0], 1), timeout=WAIT_S)
        timings["release by v2"] = time.monotonic() - mark
        assert release.status.value == "succeeded", release.error

    problems: list[str] = ["lab.stop() did not run"]

    async def main() -> None:
        try:
            await body()
        finally:
            await asyncio.to_thread(manager.close)
            problems[:] = await lab.stop()
            # What the release would have removed, when the test failed before it: the purge then leaves none.
            (SEED_DIR / f"{alloc}-slot0.iso").unlink(missing_ok=True)
            if lab.image_path is not None:
                lab.image_path.with_name("guest-upgrade.qcow2").unlink(missing_ok=True)

    ok = False
    try:
        asyncio.run(main())
        ok = True
    finally:
        if ok and not problems:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print("\n".join(lines) + f"\nlogs kept in {workdir}", file=sys.stderr)
    print("upgrade during a clone: " + " ".join(f"{k}={v:.1f}s" for k, v in timings.items())
          + f" total={time.monotonic() - started:.1f}s", file=sys.stderr)
    assert not problems


def check(seen: dict, lab: Lab, manager: ServiceManager, workdir: Path, alloc: str, task_id: str,
          v1: str, v2: str) -> None:
    """Everything the upgrade must have left, read while the lab (and v2) still run."""
    # The stop: prerm's, while v1 was installed; the agent's own clean exit inside TimeoutStopSec, nothing left.
    unit = UnitFile.read()
    assert (unit.type, unit.kill_mode) == ("notify", "mixed")
    calls = [c for c in manager.calls if UNIT in c]
    assert calls[0] == f"deb-systemd-invoke stop {UNIT} version=gpuaas-agent {v1}", manager.calls
    assert calls[-1] == f"deb-systemd-invoke start {UNIT} version=gpuaas-agent {v2}", manager.calls
    [stop] = manager.stops
    assert stop.returncode == 0 and not stop.timed_out, stop
    # qemu-img was killed and reaped by the agent itself before it exited: no writer of the slot disk outlived it.
    assert stop.left_in_cgroup == [], f"outlived the agent's stop (a writer on the slot disk?): {stop}"
    assert DRAIN_S <= stop.seconds < unit.timeout_stop_s, stop

    # What v1 left: the clone journaled as started, nothing failed or undone, no result, the lease kept.
    snap = seen["snapshot"]
    steps = [(row[1], row[2]) for row in snap["journal"]]
    # The stop's hand-back is journaled after the started clone: this start does not count as a crash.
    assert steps[0] == ("task", "started") and steps[-2:] == [("clone", "started"), ("task.handed_back", "succeeded")], steps
    assert not [s for s in steps if s[1] in ("failed", "compensated")], steps
    assert snap["results"] == 0
    assert snap["leases"] == [(0, alloc)] and snap["records"] == [(0, alloc, "provisioning")], snap
    log = manager.log.read_text(errors="replace")
    for event in ("pipeline_interrupted_by_stop", "tasks_cancelled_at_shutdown", "task_handed_back_at_stop"):
        assert f'"event": "{event}"' in log, event

    # v2's code reads v1's state file: the schema version it knows (no migration), every journal row.
    done = run_checked([str(INSTALLED_AGENT.parent / "python"), "-I", "-c", V2_READS, str(workdir / "v1-state.db"), task_id])
    read = json.loads(done.stdout)
    assert read["version"] == v2
    assert read["schema"] == read["known_schema"] == snap["user_version"], read
    assert read["journal"] == [[row[0], row[1], row[2]] for row in snap["journal"]]
    assert read["unfinished"] == ["task", "clone"]

    # v2 finished it: one result, succeeded, the clone redone whole, the slot active.
    assert len(seen["results"]) == 1, seen["results"]
    result = seen["results"][0]
    assert result.status.value == "succeeded", result.error
    assert [(o.status.value, o.health_state.value) for o in result.slot_outcomes] == [("active", "healthy")]
    assert result.output["clone"]["target_is_zero"] is False
    assert "provision_restarted" in log
    assert run_checked([str(INSTALLED_AGENT), "--version"], env=CLEAN_ENV).stdout.strip() == f"gpuaas-agent {v2}"
    assert manager.main is not None and manager.main.poll() is None

    # The journal: v1's rows unchanged, then v2's run from its start; the lease is the allocation's only.
    db = sqlite3.connect(f"file:{STATE_DIR / 'state.db'}?mode=ro", uri=True, timeout=30)
    try:
        final = db.execute("SELECT seq, step, status, detail, at FROM task_journal WHERE task_id = ? ORDER BY seq",
                           (task_id,)).fetchall()
        leases = db.execute("SELECT slot_index, allocation_id FROM slot_lease").fetchall()
        records = db.execute("SELECT slot_index, allocation_id, status FROM slot_state").fetchall()
    finally:
        db.close()
    assert final[:len(snap["journal"])] == snap["journal"]
    after = [(row[1], row[2]) for row in final[len(snap["journal"]):]]
    assert after[0] == ("task", "started") and after[-1] == ("task", "succeeded"), after
    assert after.index(("clone", "started")) < after.index(("clone", "succeeded")), after
    assert not [s for s in after if s[1] in ("failed", "compensated")], after
    assert leases == [(0, alloc)] and records == [(0, alloc, "active")], (leases, records)
    # v1 handed the task back at its stop: v2 took it up at once, not an ack_wait later.
    resumed_after_s = final[len(snap["journal"])][4] - manager.ready_at[-1]
    print(f"v1 stop {stop.seconds:.1f}s; v2 resumed the task {resumed_after_s:.1f}s after its READY=1",
          file=sys.stderr)
    assert resumed_after_s < RESUME_BOUND_S, resumed_after_s

    # The slot disk holds the image, byte for byte.
    size = lab.image_path.stat().st_size
    with open(lab.host.disks[0].loop, "rb") as fh:
        assert hashlib.sha256(fh.read(size)).hexdigest() == lab.image_sha256
