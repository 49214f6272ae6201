"""The fresh-host lane (docs/safety.md §11): package + cloud-init user-data, then the first provision succeeds.

On this machine itself (the lab's daemons need the root namespace): the ``.deb`` is
built by ``packaging/build_deb.py`` and installed by the rendered user-data, run the
way cloud-init runs it (its ``write_files``, then its own ``util.shellify`` script of
``runcmd``): download over HTTP, sha256, ``apt-get install``, config, token,
``prepare-host``, enroll against the lab's control plane (real nats-server).
Every ``[slice]`` setting is an input of the render: the lab's bridge, ovsdb, dnsmasq
files, and the image source, a real HTTPS server whose certificate is signed by a CA of
its own, given to the render as PEM (``image_ca_pem``). The node then runs with the
``/etc/gpuaas-agent/agent.toml`` cloud-init installed, as written (the lab adds only
the top-level keys of its recorded host: ``host_root`` and timers), and the guest image
comes over that HTTPS server: nothing is edited by hand.
``systemctl`` is recorded, not run (no systemd as PID 1): the lab then starts the
node as the unit would, with the *installed* ``/opt/gpuaas-agent/bin/gpuaas-agent``:
``prepare-host``, ``prepare-host --check``, ``enroll`` (already enrolled: a no-op),
``run``. State dir, seed-ISO dir and terminal relay key are the package defaults, which
nothing but the package created. Then: topology, preflight,
a real TCG guest provisioned to ``succeeded`` (lease + SSH), an SSH login into it
with the package's relay key (seed 004's terminal path), release.

Cleanup, also on failure: the lab stops, the package is purged and every package
apt pulled in for it is purged again, so the machine ends as it began. A machine
that already has gpuaas-agent installed or its state dir fails the test untouched.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from gpuaas_agent.compat import tomllib
from gpuaas_agent.deploy.sliceinputs import IMAGE_CA_PATH
from gpuaas_agent.deploy.userdata import CONFIG_PATH, UserDataInputs, render_userdata
from lab.harness import Lab, LabSettings
from tests.deploy.chroot import APT_TIMEOUT_S
from tests.deploy.machine import INSTALLED_AGENT, RELAY_KEY, SEED_DIR, STATE_DIR, cloud_init_runcmd_script
from tests.support.image_server import issue_server_cert, make_ca, start_https_server

SYSTEMCTL_SHIM = """#!/bin/sh
echo "systemctl $*" >> "$(dirname "$0")/calls.log"
"""


def test_a_host_made_by_the_package_and_user_data_provisions_on_the_first_try(clean_machine, deb_build, tmp_path):
    timings: dict[str, float] = {}
    started = time.monotonic()
    out = tmp_path / "dist"
    deb = deb_build(None, out)  # the session's build of this tree (tests/deploy/machine.py), in its own directory
    timings["build"] = time.monotonic() - started

    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-fresh-", dir="/var/tmp"))
    lines: list[str] = []
    lab = Lab(LabSettings(workdir=workdir, slots=1, readiness_timeout_s=300, say=lines.append,
                          agent_binary=INSTALLED_AGENT, use_package_paths=True, installed_config=CONFIG_PATH))
    server = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "0",
                               "--directory", str(out)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL, text=True)

    image_server: list[subprocess.Popen] = []

    async def body() -> dict:
        mark = time.monotonic()
        await lab.start_services()
        timings["lab services"] = time.monotonic() - mark

        # --- the image source: HTTPS with a CA of its own, over the lab's guest image --------------
        ca = make_ca(workdir / "image-ca")
        cert, key = issue_server_cert(ca, workdir / "image-tls")
        proc, image_port = start_https_server(lab.image_path.parent, cert, key, workdir / "image-port")
        image_server.append(proc)
        image_host = f"127.0.0.1:{image_port}"
        slice_table = {k: v for k, v in lab.slice_settings().items() if k != "image_file_dir"}
        slice_table["image_https_hosts"] = [image_host]

        # --- the user-data, as cloud-init runs it ------------------------------------------------
        port_line = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (...)"
        port = int(port_line.split(" port ")[1].split()[0])
        inputs = UserDataInputs(package_url=f"http://127.0.0.1:{port}/{deb.name}",
                                package_sha256=hashlib.sha256(deb.read_bytes()).hexdigest(),
                                bootstrap_token=lab.cp.issue_token(), nats_url=lab.nats_url, insecure=True,
                                maas_tags=["gpuaas-profile-slice-vm"], slice=slice_table,
                                image_ca_pem=ca[0].read_text())
        doc = yaml.safe_load(render_userdata(inputs))
        for entry in doc["write_files"]:
            path = Path(entry["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(entry["content"])
            path.chmod(int(entry["permissions"], 8))
        shims = workdir / "shims"
        shims.mkdir()
        (shims / "systemctl").write_text(SYSTEMCTL_SHIM)
        (shims / "systemctl").chmod(0o755)
        script = workdir / "runcmd"
        script.write_text(cloud_init_runcmd_script(doc["runcmd"]))
        script.chmod(0o700)
        mark = time.monotonic()
        env = {**os.environ, "PATH": f"{shims}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "DEBIAN_FRONTEND": "noninteractive"}
        done = await asyncio.to_thread(subprocess.run, [str(script)], capture_output=True, text=True,
                                       timeout=APT_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
        timings["user-data"] = time.monotonic() - mark
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        assert (shims / "calls.log").read_text().splitlines() == [
            "systemctl enable --now gpuaas-slice-network-baseline.service", "systemctl enable --now gpuaas-agent.service"]
        assert "enrolled node_id=" in done.stdout

        # The config cloud-init installed names the HTTPS source and the CA it installed; no file:// source.
        installed = tomllib.loads(CONFIG_PATH.read_text())["slice"]
        assert installed["image_https_hosts"] == [image_host] and "image_file_dir" not in installed
        assert installed["image_ca_bundle"] == str(IMAGE_CA_PATH) and IMAGE_CA_PATH.read_text() == ca[0].read_text()

        # Made by the package, nothing else: the lab never touched these paths.
        for path, mode in ((STATE_DIR, 0o700), (SEED_DIR, 0o711), (RELAY_KEY.parent, 0o700), (RELAY_KEY, 0o600)):
            assert path.stat().st_mode & 0o777 == mode, path
        relay_before = RELAY_KEY.read_bytes()

        # --- the node, as the unit starts it (prepare-host, --check, enroll, run) -----------------
        mark = time.monotonic()
        await lab.start_node()
        timings["node start"] = time.monotonic() - mark
        assert RELAY_KEY.read_bytes() == relay_before  # ExecStartPre's prepare-host kept the key

        mark = time.monotonic()
        slots = await lab.approve_slots()
        assert slots, "no complete slot on the lab host"
        # The recorded host's network is not the lab's: FAIL lines are expected (docs/testing.md); the task must answer.
        preflight = await lab.task("slice.preflight", {}, timeout=120)
        assert preflight.output.get("lines"), (preflight.status, preflight.error)
        payload = lab.provision_payload(slots[0])
        payload["image"]["url"] = f"https://{image_host}/files/{lab.image_path.name}"
        assert json.loads(lab.config_path.read_text())["slice"] == installed  # the node runs with it as written
        result = await lab.task("slice.vm_provision", payload, timeout=600)
        timings["provision"] = time.monotonic() - mark
        assert result.status.value == "succeeded", result.error
        output = result.output
        seeds = sorted(p.name for p in SEED_DIR.iterdir())
        assert seeds == [f"{payload['allocation_id']}-slot{slots[0].slot_index}.iso"]

        # Seed 004's terminal relay: the package's key logs into the slice it provisioned.
        ip = slots[0].private_ip
        login = await asyncio.to_thread(
            subprocess.run, ["ssh", "-i", str(RELAY_KEY), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                             "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=20", f"tenant@{ip}",
                             "echo relay-ok $(hostname)"],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert login.returncode == 0 and login.stdout.strip() == f"relay-ok lab-slice-{slots[0].slot_index}", login.stderr

        mark = time.monotonic()
        release = await lab.task("slice.vm_release", Lab.release_payload(payload["allocation_id"], slots[0], 10),
                                 timeout=600)
        timings["release"] = time.monotonic() - mark
        assert release.status.value == "succeeded", release.error
        assert list(SEED_DIR.iterdir()) == []
        return output

    problems: list[str] = ["lab.stop() did not run"]

    async def main() -> dict:
        try:
            return await body()
        finally:
            problems[:] = await lab.stop()  # in the loop that owns the control plane's NATS connection

    ok = False
    try:
        output = asyncio.run(main())
        ok = True
    finally:
        server.terminate()
        server.wait(timeout=10)
        for proc in image_server:
            proc.kill()
            proc.wait(timeout=10)
        if ok and not problems:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print("\n".join(lines) + f"\nlogs kept in {workdir}", file=sys.stderr)
    total = time.monotonic() - started
    print("fresh-host lane: " + " ".join(f"{k}={v:.1f}s" for k, v in timings.items()) + f" total={total:.1f}s",
          file=sys.stderr)
    print(json.dumps({k: output.get(k) for k in ("vm", "actual_ip", "lease_state", "ssh_banner")}, default=str),
          file=sys.stderr)
    assert not problems
