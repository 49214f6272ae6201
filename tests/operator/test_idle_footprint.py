"""What an idle daemon carries: modules only a task needs are not imported with the daemon (bench/bench_idle.py
measures the footprint; this pins the structure that keeps it down, never a time or a size)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, fixture_host

FIXTURE = fixture_host("h200-slice-after-transition")

# Only a provision builds a seed ISO (pycdlib, PyYAML); only a live host with a GPU driver asks NVML; only a
# host with a [bmc] table reads a BMC (sushy, and the requests it brings); only an open terminal speaks SSH
# (asyncssh); only a cache hit under another URL reads ranges with httpx (and its CLI's click and pygments).
NOT_AT_IMPORT = ("pycdlib", "yaml", "pynvml", "sushy", "requests", "asyncssh", "httpx", "click", "pygments",
                 # Only enrollment and a credentials rotation seal or open (X25519, AEAD, HKDF); a connecting daemon
                 # signs its nonce with Ed25519 alone, through the libcrypto ssl maps (cryptography not at all).
                 "cryptography", "gpuaas_agent.control.sealed", "gpuaas_agent.control.tokenproof",
                 "cryptography.hazmat.primitives.asymmetric.x25519", "cryptography.hazmat.primitives.ciphers.aead",
                 "cryptography.hazmat.primitives.serialization", "bcrypt")
# A task handler's module is imported by the row's first task (tasks/registry.py OnFirstTask), not by the daemon
# nor by building the worker's handlers from the registry: the pipelines an idle host may never run.
HANDLER_MODULES = tuple(f"gpuaas_agent.tasks.{m}" for m in (
    "provision", "release", "release_set", "terminal", "console_log", "topology", "preflight", "plan"))
# Imported where a slot, a domain, a partition or a quarantine re-check needs them, not by the modules an idle host
# runs (the daemon, its boot recovery, health round, isolation probe and reconcile): the domain XML model (with
# xml.etree), an active slot's rebind, guarded start and power plan, the provision guards and GPU reset checks, the
# firmware re-check, preflight's readers and the GPU admin tool.
SLOT_ONLY = ("gpuaas_agent.host.vm.domain_config", "gpuaas_agent.host.vm.domain_xml", "xml.etree.ElementTree",
             "gpuaas_agent.host.devices.vfio", "gpuaas_agent.tasks.domain_start", "gpuaas_agent.tasks.power",
             "gpuaas_agent.guards.preconditions", "gpuaas_agent.guards.gpureset", "gpuaas_agent.tasks.firmware_check",
             "gpuaas_agent.discovery.prereqs", "gpuaas_agent.host.devices.gpuadmin")


def test_importing_the_daemon_does_not_import_what_only_a_task_or_a_gpu_host_needs():
    code = ("import json, sys, gpuaas_agent.daemon; "
            f"print(json.dumps([m for m in {NOT_AT_IMPORT!r} if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_signing_the_connect_nonce_does_not_load_cryptography():
    """Every (re)connect signs the server's nonce: through ``_ssl``'s libcrypto, so cryptography's Rust binding
    (~8.8 MiB RSS, a second OpenSSL) never enters a connected daemon."""
    code = ("import json, sys, gpuaas_agent.daemon\n"
            "from gpuaas_agent.control.nkeyseed import new_user_seed, sign_nonce\n"
            "assert len(sign_nonce(new_user_seed(), 'nonce')) == 88\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('cryptography', 'nacl', 'nkeys'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def _imported_after(code: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {modules!r} if m in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_the_daemon_does_not_import_the_task_handlers_modules():
    assert _imported_after("import gpuaas_agent.daemon", (*HANDLER_MODULES, *SLOT_ONLY)) == []


def test_the_slot_only_modules_are_imported_by_the_code_that_uses_them(tmp_path):
    """The other side of :data:`SLOT_ONLY`: reading a domain's devices from its XML and asking for the GPU admin tool
    import what they need (a deferred import that never ran would fail here, not on a host's first slot)."""
    domain = ("<domain type='kvm'><name>d</name><devices><disk type='block' device='disk'><source dev='/dev/x'/>"
              "<target dev='vda' bus='virtio'/></disk></devices></domain>")
    read_xml = ("import gpuaas_agent.daemon\n"
                "from gpuaas_agent.host.vm.libvirt_lifecycle import parse_domain_devices\n"
                f"assert parse_domain_devices('d', {domain!r}).block_disks == ['/dev/x']\n")
    assert _imported_after(read_xml, SLOT_ONLY) == ["gpuaas_agent.host.vm.domain_config", "xml.etree.ElementTree"]
    config = {"state_dir": str(tmp_path / "state"), "host_root": str(tmp_path),
              "slice": {"libvirt_uri": "test:///default", "gpu_admin_tool": str(tmp_path / "no-such-tool")}}
    admin_tool = ("from gpuaas_agent.config import AgentConfig\n"
                  "from gpuaas_agent.errors import AgentError\n"
                  "from gpuaas_agent.tasks.drivers import SliceDrivers\n"
                  f"drivers = SliceDrivers.from_config(AgentConfig.model_validate({config!r}))\n"
                  "try:\n"
                  "    drivers.gpu_admin()\n"
                  "except AgentError as exc:\n"
                  "    assert exc.code == 'gpu_handover_tool_missing', exc.code\n")
    imported = _imported_after(admin_tool, SLOT_ONLY)
    assert {"gpuaas_agent.guards.gpureset", "gpuaas_agent.host.devices.gpuadmin"} <= set(imported), imported


def test_building_the_daemons_handlers_imports_no_handler_module_until_its_first_task(tmp_path):
    """The daemon's object graph as it builds it at start (its slice drivers from the config, every registry row's
    handler and recovery) imports none of the handler modules; resolving a row (its first task) imports its own."""
    config = {"state_dir": str(tmp_path / "state"), "host_root": str(tmp_path),
              "slice": {"libvirt_uri": "test:///default"}}
    build = ("from gpuaas_agent.config import AgentConfig\n"
             "from gpuaas_agent.contract.tasks import TaskType\n"
             "from gpuaas_agent.daemon import SliceHost\n"
             f"config = AgentConfig.model_validate({config!r})\n"
             "built = SliceHost.from_config(config).tasks(config)\n"
             "assert set(built.handlers) == set(TaskType) and built.recoveries\n")
    assert _imported_after(build, (*HANDLER_MODULES, *NOT_AT_IMPORT)) == []
    first_provision = build + "built.handlers[TaskType.vm_provision].resolve()\n"
    imported = _imported_after(first_provision, HANDLER_MODULES)
    assert "gpuaas_agent.tasks.provision" in imported and "gpuaas_agent.tasks.terminal" not in imported, imported


# What an idle slice host runs that once loaded libvirt-python (~11 MiB RSS): the health round's libvirtd check, the
# port isolation probe (each health and network-watch round) and the timer reconcile's domain listing.
IDLE_LIBVIRT_USES = """
import asyncio, json, sys
from pathlib import Path
from gpuaas_agent.config import AgentConfig
from gpuaas_agent.contract.drift import DriftTrigger
from gpuaas_agent.daemon import SliceHost
from gpuaas_agent.operator.health import CheckThreads, HealthSettings, libvirtd_check
from gpuaas_agent.state.aio import StoreThread
from gpuaas_agent.tasks.reconcile import reconcile

config = AgentConfig.model_validate(json.loads(sys.argv[1]))
host = SliceHost.from_config(config)

async def idle_rounds():
    state = StoreThread.open(config.state_db)
    try:
        (probe,) = [p for p in host.health_probes(state)]  # port_isolation (no Fabric Manager configured)
        isolation = [c.status for c in await probe()]
        full = await reconcile(host.drivers, state, repair=False, trigger=DriftTrigger.timer)
        return isolation, [f.kind.value for f in full.findings]
    finally:
        await host.aclose()
        await state.aclose()

check = asyncio.run(libvirtd_check(HealthSettings.from_config(config), threads=CheckThreads()))
isolation, findings = asyncio.run(idle_rounds())
print(json.dumps({"libvirtd": [check.status, check.detail], "isolation": isolation, "findings": findings,
                  "libvirt_loaded": "libvirt" in sys.modules or "libvirtmod" in sys.modules,
                  "slot_only": [m for m in json.loads(sys.argv[2]) if m in sys.modules]}))
"""


def _idle_rounds(tmp_path, ovs_switch, uri: str) -> dict:
    config = {"state_dir": str(tmp_path / "state"), "host_root": str(FIXTURE),
              "slice": {"libvirt_uri": uri, "ovsdb_remote": ovs_switch.remote,
                        "dnsmasq_hosts_file": str(tmp_path / "hosts"), "dnsmasq_lease_file": str(tmp_path / "leases"),
                        "console_log_dir": str(tmp_path / "console")}}
    # In a network namespace of its own: the reconcile also reads the host's nft guard tables, and a lab or another
    # test's tables in the root namespace are not this test's question (they once made it report guard findings).
    proc = subprocess.run(["unshare", "--net", sys.executable, "-c", IDLE_LIBVIRT_USES, json.dumps(config),
                           json.dumps(SLOT_ONLY)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_an_idle_host_without_a_domain_answers_health_and_reconcile_without_loading_libvirt(tmp_path, ovs_switch):
    """No slot leased and no domain: the libvirtd check (a virsh child), the port isolation probe (libvirt not
    asked) and a whole read-only reconcile (virsh lists no domain) give their answers, and libvirt-python is never
    imported. The same rounds on a libvirt holding a domain (``test:///default`` has one) do load it: the check
    can fail."""
    empty = tmp_path / "no-domains.xml"
    empty.write_text("<node>\n</node>\n")  # the test driver with no domain at all: an idle slice host's libvirtd
    idle = _idle_rounds(tmp_path, ovs_switch, f"test://{empty}")
    assert idle["libvirtd"][0] == "ok" and idle["libvirtd"][1].startswith(f"test://{empty} answers (libvirt ")
    assert idle["isolation"] == ["ok"] and idle["findings"] == []
    assert idle["libvirt_loaded"] is False
    assert idle["slot_only"] == []  # nor the code only a slot runs (the XML model, the guards, the re-checks)
    with_domain = _idle_rounds(tmp_path, ovs_switch, "test:///default")
    assert (with_domain["isolation"], with_domain["findings"]) == (["ok"], [])  # "test" is not an agent domain
    assert with_domain["libvirt_loaded"] is True


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


def test_the_image_cache_makes_its_tls_context_on_the_first_download_not_at_start(tmp_path):
    """Building the daemon's slice drivers loads no CA store (the system's ~140 CAs: ~0.3-0.7 MiB of OpenSSL heap);
    the first use makes the one context the config asks for (tests/host/images/test_cache_http.py fetches with it)."""
    config = {"state_dir": str(tmp_path / "state"), "host_root": str(tmp_path), "slice": {"libvirt_uri": "test:///default"}}
    code = ("import gc, json, ssl\n"
            "from gpuaas_agent.config import AgentConfig\n"
            "from gpuaas_agent.daemon import SliceHost\n"
            f"host = SliceHost.from_config(AgentConfig.model_validate({config!r}))\n"
            "def contexts():\n"
            "    return sum(isinstance(o, ssl.SSLContext) for o in gc.get_objects())\n"
            "before = contexts()\n"
            "stats = host.drivers.images.ssl_context.cert_store_stats()\n"
            "print(json.dumps([before, contexts(), stats['x509_ca'] > 0, host.drivers.images.ssl_context is host.drivers.images.ssl_context]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [0, 1, True, True]
