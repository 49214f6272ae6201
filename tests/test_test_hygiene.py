"""How the tests are laid out: public names only, fixtures as plugins, one test module per source module.

* A test module imports no ``_private`` name from another module (the package, ``lab`` or
  another test module), and no helper from another ``test_*`` module: what tests share lives
  in ``tests/support/`` (or a fixture module) under a public, documented name.
* No ``noqa: F401``/``F811`` to import a fixture: shared fixtures are pytest plugins
  (``pytest_plugins`` in tests/conftest.py) or live in a conftest.
* ``tests/<room>/test_<module>[_<what>].py`` exists for every ``gpuaas_agent/<room>/<module>.py``
  (``tests/test_<module>[_<what>].py`` for a top-level module; a sub-room is mirrored the same way,
  ``tests/host/network/test_ovs.py`` for ``gpuaas_agent/host/network/ovs.py``), or :data:`NO_MIRROR`
  says where the module's behaviour is tested instead and why it has no module of its own.

The scan reads the sources (``ast`` and text); it imports nothing.
"""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

TESTS = REPO / "tests"
PACKAGE = REPO / "gpuaas_agent"

# The one exception to the first two rules: other branches were editing these files when the
# shared helpers moved to tests/support/ (test_deb's _run and _mounts_under, its imported
# nats_server fixture); the merge finishes them. Nothing else may be added here.
LEGACY: tuple[str, ...] = ()
# A public helper imported from another test module, left only where another branch edits the importer now.
TEST_MODULE_IMPORTS = {"tests/control/test_transport.py": "IDENTITY of tests/control/test_enroll.py (h19 edits test_transport)"}

_NOQA_FIXTURE = re.compile(r"#\s*noqa:[^#\n]*\b(F401|F811)\b")

# module (room/name, "top/name" for gpuaas_agent/name.py) -> (why it has no mirror, where it is tested)
NO_MIRROR: dict[str, tuple[str, tuple[str, ...]]] = {
    # contract: wire and disk models. Their strictness is tested for all of them at once; what each
    # model means is tested where it is produced or consumed.
    "contract/base": ("WireModel/WireEnum: the strictness every model test relies on",
                      ("tests/contract/test_tasks.py", "tests/contract/test_schemas.py")),
    "contract/cloudinit": ("the seed ISO's spec, built and read back by the host driver", ("tests/host/vm/test_cloudinit.py",)),
    "contract/codescan": ("the package scan behind the error-code checks", ("tests/contract/test_errorcodes.py",)),
    "contract/dhcp": ("reservation models of the dnsmasq driver", ("tests/host/network/test_dnsmasq.py",)),
    "contract/domain": ("domain spec and state models", ("tests/host/vm/test_domain_xml.py",
                                                          "tests/host/vm/test_libvirt_lifecycle.py")),
    "contract/drift": ("drift findings and reports", ("tests/discovery/test_drift.py", "tests/control/test_uevent_watch.py")),
    "contract/egress": ("egress targets and proofs", ("tests/host/network/test_egress_readiness.py",)),
    "contract/enrollment": ("enrollment and credential models", ("tests/control/test_enroll.py",
                                                                  "tests/control/test_transport.py")),
    "contract/fixture": ("the recording manifest", ("tests/discovery/test_record.py",)),
    "contract/images": ("image cache markers and formats", ("tests/host/images/test_cache.py",)),
    "contract/isolation": ("port isolation: flows, cookies, the nft guard spec", ("tests/host/network/test_portflows.py",
                                                                                 "tests/host/network/test_nftguard.py")),
    "contract/nvmewipe": ("wipe policies and proofs", ("tests/host/storage/test_nvmewipe.py", "tests/host/storage/test_wipepolicy.py")),
    "contract/handover": ("the handover policy a lease carries", ("tests/state/test_store.py", "tests/host/storage/test_wipepolicy.py",
                                                                  "tests/tasks/test_release_gpu_handover.py")),
    "contract/gpuhandover": ("the GPU handover's result models", ("tests/host/devices/test_gpuhandover.py",
                                                                   "tests/tasks/test_release_gpu_handover.py")),
    "contract/firmware": ("firmware inventory, baseline and change models", ("tests/discovery/test_firmware.py",
                                                                              "tests/tasks/test_release_gpu_handover.py")),
    "contract/ovs": ("OVS port and bridge models", ("tests/host/network/test_ovs.py",)),
    "contract/parity": ("parity checks and reports", ("tests/tasks/test_preflight.py", "tests/test_parity_cli.py")),
    "contract/placement": ("NUMA/PCIe placement models", ("tests/tasks/test_placement.py",)),
    "contract/plan": ("the bundle plan a slice.plan task answers", ("tests/tasks/test_plan.py",)),
    "contract/runtime": ("runtime profiles", ("tests/guards/test_preconditions.py", "tests/host/vm/test_domain_xml.py")),
    "contract/state": ("leases, slot records, journal rows", ("tests/state/test_store.py",)),
    "contract/bmc": ("the BMC's per-GPU verdicts, judged and read in", ("tests/operator/test_bmc.py",)),
    "contract/fabric": ("Fabric Manager partitions and their leases", ("tests/host/devices/test_fabricmanager.py",
                                                                        "tests/tasks/test_fabric_partitions.py")),
    "contract/storage": ("disk leases and cleanup proofs", ("tests/host/storage/test_blockwipe.py", "tests/guards/test_disk.py")),
    "contract/terminal": ("terminal frames and windows", ("tests/tasks/test_terminal.py",)),
    "contract/topology": ("the discovery report", ("tests/discovery/test_fixture_hosts.py", "tests/contract/test_slots.py")),
    "contract/types": ("the shared identifier shapes", ("tests/contract/test_shared_patterns.py",)),
    "contract/vfio": ("vfio binding evidence", ("tests/host/devices/test_vfio.py",)),
    # control
    "control/connection": ("the bounded connect and its backoff; its tests are named after what they do",
                           ("tests/control/test_connect.py",)),
    "control/rotation": ("credential rotation, tested over the real transport it rotates",
                         ("tests/control/test_transport.py",)),
    "operator/redfish": ("the sushy reader, run against a real Redfish server", ("tests/operator/test_bmc.py",)),
    # deploy
    "deploy/netbaseline": ("network-baseline, converged on a real OVS and netns", ("tests/deploy/test_baseline.py",)),
    "deploy/relaykey": ("the relay key, made by prepare-host and used by the terminal relay",
                        ("tests/deploy/test_prepare_host.py", "tests/tasks/test_terminal.py")),
    # discovery: the readers behind discover(), tested through the reports of every fixture host
    "discovery/fabric": ("fabric VF reader behind discover()", ("tests/discovery/test_fixture_hosts.py",
                                                                 "tests/discovery/test_traps.py")),
    "discovery/gpu": ("GPU reader behind discover()", ("tests/discovery/test_fixture_hosts.py",
                                                       "tests/discovery/test_traps.py")),
    "discovery/identity": ("host identity for enrollment", ("tests/control/test_enroll.py",)),
    "discovery/nvme": ("NVMe reader behind discover() (VMD domains, multipath heads, aliases)",
                       ("tests/discovery/test_vmd.py", "tests/discovery/test_fixture_hosts.py",
                        "tests/discovery/test_traps.py")),
    "discovery/nvswitch": ("the nvswitch_partition parity check", ("tests/tasks/test_preflight.py",)),
    "discovery/pci": ("PCI reader behind discover()", ("tests/discovery/test_fixture_hosts.py",
                                                       "tests/contract/test_shared_patterns.py")),
    "discovery/prereqs": ("the parity checks, run by preflight and the parity command",
                          ("tests/tasks/test_preflight.py", "tests/test_parity_cli.py")),
    "discovery/report": ("discover() itself", ("tests/discovery/test_fixture_hosts.py", "tests/discovery/test_traps.py")),
    "discovery/slots": ("the slot planner", ("tests/discovery/test_planner.py", "tests/discovery/test_suggestions.py")),
    "discovery/sysread": ("bounded sysfs reads", ("tests/discovery/test_bars.py", "tests/discovery/test_traps.py")),
    # guards
    "guards/vfio": ("called inside the vfio driver, tested through it", ("tests/host/devices/test_vfio.py",)),
    "control/admission": ("the worker's admission", ("tests/control/test_worker_admission.py",)),
    "control/consumer": ("the node's consumer shape, created by the control plane",
                         ("tests/control/test_permissions.py", "tests/control/test_worker_pull_heartbeat.py")),
    "guards/gpureset": ("the reset choice under the GPU handover", ("tests/host/devices/test_gpuhandover.py",
                                                                     "tests/guards/test_preconditions.py")),
    # host
    "host/devices/gpuadmin": ("NVIDIA's tool as the GPU handover runs it", ("tests/host/devices/test_gpuhandover.py",)),
    "host/images/stream": ("the one-pass pump under the streamed clone", ("tests/host/images/test_streamclone.py",)),
    "host/images/httpfetch": ("the https source of the image cache", ("tests/host/images/test_cache_http.py",)),
    "host/images/source": ("the image source allow-list", ("tests/host/images/test_cache.py", "tests/host/images/test_cache_http.py")),
    "host/storage/nvmecaps": ("NVMe capabilities behind the wipe policy", ("tests/host/storage/test_nvmewipe.py",
                                                                    "tests/host/storage/test_wipepolicy.py")),
    # The wipe methods (host/storage/wipemethods/): the table's own tests, then each method through the policy's.
    **{f"host/storage/wipemethods/{name}": (f"the {what}, run through wipepolicy.wipe_slot_disk", (
        "tests/host/storage/test_wipemethods.py", *where)) for name, what, where in (
        ("base", "interface every wipe method module offers", ()),
        ("blocks", "block wipe and read-back proof discard and zeroout share", (
            "tests/host/storage/test_wipepolicy.py", "tests/host/storage/test_wipe_lying_device.py")),
        ("discard", "discard method", ("tests/host/storage/test_wipepolicy.py",
                                       "tests/host/storage/test_wipe_lying_device.py")),
        ("zeroout", "zeroout method", ("tests/host/storage/test_wipepolicy.py", "tests/host/storage/test_blockwipe.py")),
        ("nvme", "NVMe methods' shared check, erase and proof", ("tests/host/storage/test_wipepolicy.py",
                                                                  "tests/host/storage/test_nvme_guest.py")),
        ("nvme_format", "Format NVM method", ("tests/host/storage/test_wipepolicy.py",
                                              "tests/host/storage/test_nvme_guest.py")),
        ("nvme_sanitize", "Sanitize method", ("tests/host/storage/test_wipepolicy.py",
                                              "tests/host/storage/test_nvmewipe.py")))},
    "tasks/context": ("the handlers' TaskContext protocol and Handler type, checked by mypy --strict",
                      ("tests/test_static_checks.py", "tests/control/test_worker.py")),
    "tasks/firmware_check": ("the release's firmware step and its re-check", ("tests/tasks/test_release_gpu_handover.py",)),
    "host/network/ovsdb_idl": ("the OVS IDL adapter under the OVS driver", ("tests/host/network/test_ovs.py",)),
    "host/vm/sshrelay": ("the SSH PTY of the terminal relay", ("tests/tasks/test_terminal.py",)),
    # operator
    "operator/daemonstatus": ("the daemon's status file, read by `status`", ("tests/operator/test_cli_conventions.py",
                                                                            "tests/operator/test_daemon_observability.py")),
    "operator/metrics": ("/metrics of a running daemon", ("tests/operator/test_daemon_observability.py",)),
    "operator/reporter": ("heartbeats of a running daemon", ("tests/operator/test_daemon_observability.py",)),
    "operator/status": ("`gpuaas-agent status`", ("tests/operator/test_cli_conventions.py",)),
    # state
    # tasks
    "tasks/crashpoint": ("the crash harness's kill points", ("tests/crash/test_crash_matrix.py",)),
    "tasks/domain_start": ("the guarded start of provision, power and boot recovery",
                           ("tests/tasks/test_power.py", "tests/tasks/test_boot_recovery.py")),
    "tasks/drivers": ("the drivers every slice task test builds", ("tests/tasks/test_provision_admission.py",
                                                                   "tests/host/network/test_portflows.py")),
    "tasks/release_set": ("the release of a multi-slot set", ("tests/tasks/test_provision_multislot.py",)),
    "tasks/terminal_session": ("one session's flow control, tested with the relay",
                               ("tests/tasks/test_terminal.py",)),
    "tasks/topology": ("the topology_discover handler, run by the worker", ("tests/control/test_worker.py",)),
    # top level
    "top/__main__": ("`python -m gpuaas_agent`", ("tests/test_cli.py",)),
    "top/config": ("tested beside the daemon that reads it; another branch edits that module now",
                   ("tests/control/test_config.py",)),
    "top/daemon": ("the daemon as a process: the module runs itself as the gated agent under test "
                   "(`python -m tests.control.test_daemon`), so it stays where its argv names it",
                   ("tests/control/test_daemon.py", "tests/control/test_daemon_boot.py")),
    "top/errors": ("the typed errors and their codes", ("tests/contract/test_errorcodes.py",)),
    "top/exitcodes": ("the exit code of every error code", ("tests/operator/test_cli_conventions.py",)),
}


def _test_files() -> list:
    return sorted(p for p in TESTS.rglob("*.py") if not str(p.relative_to(REPO)).startswith(LEGACY))


def _rel(path) -> str:
    return str(path.relative_to(REPO))


def test_no_test_imports_a_private_name_or_a_helper_of_another_test_module():
    found = []
    for path in _test_files():
        for node in ast.walk(ast.parse(path.read_text(), _rel(path))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.split(".")[0] not in ("gpuaas_agent", "lab", "tests"):
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private:
                found.append(f"{_rel(path)}:{node.lineno} {node.module} {private}")
            if node.module.split(".")[-1].startswith("test_") and _rel(path) not in TEST_MODULE_IMPORTS:
                found.append(f"{_rel(path)}:{node.lineno} imports from the test module {node.module}")
    assert not found, "move shared helpers to tests/support/ under public names: " + "; ".join(found)


def test_no_fixture_is_imported_under_a_noqa():
    found = [f"{_rel(path)}:{n}" for path in _test_files()
             for n, line in enumerate(path.read_text().splitlines(), 1) if _NOQA_FIXTURE.search(line)]
    assert not found, "a shared fixture is a pytest plugin (tests/conftest.py pytest_plugins): " + ", ".join(found)


def test_the_scans_see_what_they_forbid():
    assert _NOQA_FIXTURE.search("from tests.x import fx  # noqa" + ": F401  (fixture)")
    assert _NOQA_FIXTURE.search("def test_a(fx):  # noqa" + ": F811")
    assert not _NOQA_FIXTURE.search("x = 1  # noqa: E501")


def _source_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            continue
        names.append(f"top/{path.stem}" if len(rel.parts) == 1 else "/".join(rel.with_suffix("").parts))
    return names


def _mirror(module: str) -> list:
    *rooms, name = module.split("/")
    where = TESTS if rooms == ["top"] else TESTS.joinpath(*rooms)
    # test_<name>.py or test_<name>_<what>.py: test_streamclone.py is no mirror of stream.py
    return sorted([*where.glob(f"test_{name}.py"), *where.glob(f"test_{name}_*.py")])


def test_every_source_module_has_its_test_module_or_says_where_it_is_tested():
    modules = _source_modules()
    unmirrored = [m for m in modules if not _mirror(m) and m not in NO_MIRROR]
    assert not unmirrored, ("add tests/<room>/test_<module>.py, or a NO_MIRROR entry naming the tests that cover "
                            f"the module: {unmirrored}")
    stale = sorted(m for m in NO_MIRROR if m not in modules or _mirror(m))
    assert not stale, f"NO_MIRROR entries for modules that are gone or now have a test module: {stale}"
    missing = sorted(f"{m}: {p}" for m, (_, paths) in NO_MIRROR.items() for p in paths if not (REPO / p).is_file())
    assert not missing, f"NO_MIRROR names test modules that do not exist: {missing}"
