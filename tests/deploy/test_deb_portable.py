"""One .deb for Debian 12, Ubuntu 22.04 and 24.04: reproducible, hash-pinned, lintian clean, no build paths (issue #22).

- Two builds of the same tree are byte-identical (SOURCE_DATE_EPOCH, no bytecode shipped).
- Nothing in the package names the build machine: no staging or repository path in any
  file or in any member of the agent's wheel, and every ELF object inside the shipped
  wheels has no RUNPATH/RPATH outside ``$ORIGIN`` (``readelf -d``).
- ``lintian`` reports nothing but the justified overrides.
- Real ``debootstrap --variant=minbase`` roots of Ubuntu 24.04 (``noble``, python 3.12)
  and Ubuntu 22.04 (``jammy``, python 3.10), one parametrized test (tests/deploy/chroot.py:
  bookworm's debootstrap has no script named after them, so the ``gutsy`` script every
  Ubuntu release uses is named; the Ubuntu archive key is tests/deploy/keys/, taken from
  ubuntu-keyring 2023.11.28.1), each take the same .deb with ``apt-get install
  --no-install-recommends``: postinst builds the venv against that release's python3,
  which imports the distro's libvirt/systemd/ovs bindings and *every module of the agent*
  (what catches a 3.11-only import on 22.04; tests/test_compat.py keeps the
  runtime-only APIs out), ``--version`` and ``discover`` run, and no hypervisor, switch or
  DHCP server came along. Debian 12 is tests/deploy/test_deb.py. The Ubuntu roots are
  cached as tarballs beside the bookworm one.
"""

from __future__ import annotations

import json
import os
import pkgutil
import re
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

import gpuaas_agent
from tests.conftest import REPO, fixture_host
from tests.deploy.chroot import APT_TIMEOUT_S, CACHE, CMD_TIMEOUT_S, distro_root, run_checked, ubuntu_tarball
from tests.deploy.machine import BUILD, tree_version
from tests.support.redfish_server import PCI, started_server

FIXTURE = "h200-slice-after-transition"
SLICE_ONLY = ("libvirt-daemon-system", "qemu-system-x86", "openvswitch-switch", "dnsmasq", "ovmf", "nvme-cli")


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory, deb_build) -> tuple[Path, Path]:
    """The session's build of this tree (``deb_build``, tests/deploy/machine.py: what the other modules install)
    and a second build of the same tree made here, each in its own directory."""
    if os.geteuid() != 0:
        pytest.fail("the packaging test needs root (debootstrap, chroot, mount)", pytrace=False)
    first = deb_build(None, tmp_path_factory.mktemp("dist-a"))
    out = tmp_path_factory.mktemp("dist-b")
    done = run_checked([*BUILD, "--version", tree_version(), "--out", str(out)], timeout=APT_TIMEOUT_S)
    return first, Path(done.stdout.strip().splitlines()[-1])


def test_two_builds_of_one_tree_are_byte_identical(two_builds):
    a, b = two_builds
    assert a.name == b.name
    assert a.read_bytes() == b.read_bytes(), "the .deb differs between two builds of the same tree"


def test_package_carries_no_build_machine_path_and_no_foreign_runpath(two_builds, tmp_path):
    deb = two_builds[0]
    root = tmp_path / "x"
    run_checked(["dpkg-deb", "-R", str(deb), str(root)])
    members = run_checked(["dpkg-deb", "-c", str(deb)]).stdout
    assert ".pyc" not in members and " ./opt/" not in members  # no bytecode; the venv is postinst's
    assert "./usr/share/doc/gpuaas-agent/changelog.gz" in members and "./usr/share/doc/gpuaas-agent/copyright" in members
    md5 = (root / "DEBIAN" / "md5sums").read_text()
    assert "usr/lib/gpuaas-agent/install-venv" in md5 and "lib/systemd/system/gpuaas-agent.service" in md5
    # The checkout, the build's staging directory, root's home: where a build machine's paths would show.
    forbidden = [str(REPO).encode(), b"/tmp/gpuaas-deb-", b"/work/", b"/root/"]
    blobs: dict[str, bytes] = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            blobs[str(path.relative_to(root))] = path.read_bytes()
    (agent_wheel,) = [p for p in root.rglob("gpuaas_agent-*.whl")]
    with zipfile.ZipFile(agent_wheel) as whl:
        for info in whl.infolist():
            blobs[f"{agent_wheel.name}!{info.filename}"] = whl.read(info)
            assert info.date_time == (2026, 11, 24, 0, 0, 0), info  # SOURCE_DATE_EPOCH from the changelog
    leaks = [name for name, data in blobs.items() if any(f in data for f in forbidden)]
    assert not leaks, f"build-machine paths in: {leaks}"

    # Every ELF object the venv will load from the shipped wheels: no RUNPATH/RPATH outside $ORIGIN.
    elves = 0
    extract = tmp_path / "elf"
    for wheel in root.rglob("*.whl"):
        with zipfile.ZipFile(wheel) as whl:
            for name in whl.namelist():
                if name.endswith(".so") or ".so." in name:
                    target = Path(whl.extract(name, extract))
                    dynamic = run_checked(["readelf", "-d", str(target)]).stdout
                    elves += 1
                    for line in dynamic.splitlines():
                        if "(RUNPATH)" in line or "(RPATH)" in line:
                            paths = re.search(r"\[(.*)\]", line).group(1).split(":")
                            assert all(p.startswith("$ORIGIN") for p in paths), f"{wheel.name}!{name}: {line}"
                    strings = run_checked(["strings", str(target)]).stdout
                    assert str(REPO) not in strings
    assert elves >= 6  # pydantic_core and PyYAML (cffi too), for cp310, cp311 and cp312


def test_lintian_reports_nothing_but_the_justified_overrides(two_builds):
    if shutil.which("lintian") is None:
        pytest.fail("lintian is not installed (scripts/apt-packages.txt lists it)")
    done = run_checked(["lintian", "--tag-display-limit", "0", "-I", "-E", str(two_builds[0])], check=False,
                       timeout=CMD_TIMEOUT_S)
    tags = [line for line in done.stdout.splitlines() if re.match(r"^[EWIPX]: ", line)]
    assert tags == [] and done.returncode == 0, done.stdout + done.stderr
    overrides = (REPO / "packaging" / "debian" / "lintian-overrides").read_text()
    for line in overrides.splitlines():
        if line and not line.startswith("#"):
            # Each override is preceded by a comment that says why.
            previous = overrides.splitlines()[overrides.splitlines().index(line) - 1]
            assert previous.startswith("#") or previous.startswith("gpuaas-agent:"), line


def test_control_names_the_supported_pythons_and_keeps_slice_packages_recommended(two_builds):
    deb = two_builds[0]
    depends = run_checked(["dpkg-deb", "-f", str(deb), "Depends"]).stdout
    recommends = run_checked(["dpkg-deb", "-f", str(deb), "Recommends"]).stdout
    # 3.10 (Ubuntu 22.04), 3.11 (Debian 12) and 3.12 (Ubuntu 24.04) have wheels; 3.13 has none yet.
    assert "python3 (>= 3.10), python3 (<< 3.13)" in depends
    for pkg in SLICE_ONLY:
        assert pkg not in depends and pkg in recommends, pkg


# Every module of the package, imported by the installed venv's python: what a 3.11-only import
# (tomllib, datetime.UTC, enum.StrEnum, typing.Self...) or a dependency missing on that python breaks.
# Modules of an optional extra the .deb does not lock (pyproject's [project.optional-dependencies]): each may
# fail to import only for want of that extra's package, by name. None today: the `bmc` extra (sushy, for
# operator/redfish.py) is locked, so a packaged host can read its BMC.
OPTIONAL_EXTRAS: dict[str, tuple[str, ...]] = {}
IMPORT_EVERY_MODULE = """
import importlib, pkgutil, gpuaas_agent
optional = '__OPTIONAL__'
names = [m.name for m in pkgutil.walk_packages(gpuaas_agent.__path__, "gpuaas_agent.") if m.name != "gpuaas_agent.__main__"]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in optional.get(name, ()):
            failed.append(f"{name}: {exc!r}")
    except Exception as exc:
        failed.append(f"{name}: {exc!r}")
print(len(names), gpuaas_agent.__file__)
print("\\n".join(failed))
""".replace("'__OPTIONAL__'", repr(OPTIONAL_EXTRAS))


READ_BMC = """
import json, sys
from gpuaas_agent.config import BmcConfig
from gpuaas_agent.operator import bmc
import sushy
config = BmcConfig(**json.loads(sys.argv[1]))
reading = bmc.read_bmc_verdicts(config)
print(json.dumps({"sushy": sushy.__file__, "error": reading.error,
                  "gpus": {v.gpu_id: v.status for v in reading.gpus},
                  "nvswitches": {v.switch_id: v.status for v in reading.nvswitches},
                  "check": bmc.bmc_check(config).status}))
"""


def _packaged_venv_reads_the_bmc(box, tmp_path: Path) -> None:
    (tmp_path / "bmc").mkdir()
    server = started_server(tmp_path / "bmc")
    try:
        inside = box.path("/tmp/bmc")
        inside.mkdir()
        for name, src in (("cert.pem", server.cert), ("bmc.json", server.creds)):
            shutil.copyfile(src, inside / name)
        (inside / "bmc.json").chmod(0o600)
        config = {"url": f"https://127.0.0.1:{server.port}", "credentials_file": "/tmp/bmc/bmc.json",
                  "ca_file": "/tmp/bmc/cert.pem", "gpu_pci_addresses": PCI, "request_timeout_s": 5.0}
        answer = json.loads(box.run("/opt/gpuaas-agent/bin/python", "-c", READ_BMC, json.dumps(config)).stdout)
    finally:
        server.stop()
    assert answer["sushy"].startswith("/opt/gpuaas-agent/lib/python"), answer
    assert answer["error"] is None, answer
    assert answer["gpus"] == dict.fromkeys(PCI, "ok") and answer["check"] == "ok", answer
    assert answer["nvswitches"] == {f"NVSwitch_{n}": "ok" for n in range(4)}, answer
    assert "Authorization: Basic " in server.requests_seen()


def _source_modules() -> int:
    return sum(1 for m in pkgutil.walk_packages(gpuaas_agent.__path__, "gpuaas_agent.") if m.name != "gpuaas_agent.__main__")


@pytest.mark.parametrize(("codename", "version_id", "python"), [("jammy", "22.04", "3.10"), ("noble", "24.04", "3.12")],
                         ids=["ubuntu-22.04", "ubuntu-24.04"])
def test_the_same_deb_installs_imports_every_module_and_runs_on_ubuntu_without_slice_packages(two_builds, codename,
                                                                                            version_id, python,
                                                                                            tmp_path):
    deb = two_builds[0]
    with distro_root(ubuntu_tarball(codename), CACHE / f"apt-archives-{codename}") as box:
        assert box.path("/etc/os-release").read_text().count(f'VERSION_ID="{version_id}"') == 1
        box.apt_install(deb)
        version = deb.name.split("_")[1]
        assert box.run("gpuaas-agent", "--version").stdout.strip() == f"gpuaas-agent {version}"
        assert box.path("/opt/gpuaas-agent/.gpuaas-python").read_text().startswith(f"{python} ")
        imported = box.run("/opt/gpuaas-agent/bin/python", "-c", IMPORT_EVERY_MODULE).stdout.split("\n", 1)
        count, agent_file = imported[0].split()
        assert imported[1].strip() == "", imported[1]
        assert int(count) == _source_modules() and agent_file.startswith(f"/opt/gpuaas-agent/lib/python{python}/")
        # The 3.10-only locked wheels (python_version markers) are installed on 3.10 and nowhere else.
        backports = box.run("/opt/gpuaas-agent/bin/python", "-c",
                            "import importlib.util as u; print([n for n in ('tomli', 'exceptiongroup') if u.find_spec(n)])")
        assert backports.stdout.strip() == ("['tomli', 'exceptiongroup']" if python == "3.10" else "[]")
        assert box.path("/opt/gpuaas-agent/pyvenv.cfg").read_text().startswith("home = /usr/bin\n")
        # The gpu_bmc check of the packaged venv reads a real Redfish server (sushy-static, on this machine: the
        # chroot shares its network) with the locked sushy: 8 GPUs and 4 NVSwitches judged ok, basic auth sent.
        _packaged_venv_reads_the_bmc(box, tmp_path)
        # The distro's compiled bindings are the ones the venv imports (never built on the host).
        where = box.run("/opt/gpuaas-agent/bin/python", "-c",
                        "import libvirt, systemd.journal, ovs, pydantic_core, gpuaas_agent.host.images.cache; "
                        "print(libvirt.__file__, systemd.journal.__file__, ovs.__file__, pydantic_core.__file__)")
        libvirt_file, journal_file, ovs_file, core_file = where.stdout.split()
        assert libvirt_file.startswith("/usr/lib/python3/dist-packages/")
        assert journal_file.startswith("/usr/lib/python3/dist-packages/")
        assert ovs_file.startswith("/usr/lib/python3/dist-packages/")
        assert core_file.startswith(f"/opt/gpuaas-agent/lib/python{python}/site-packages/")
        # Bytecode compiled at install time, checked against its source on every import.
        flags = box.run("/opt/gpuaas-agent/bin/python", "-c",
                        "import importlib.util, gpuaas_agent.cli as m; "
                        "data = open(importlib.util.cache_from_source(m.__file__), 'rb').read(16); "
                        "print(int.from_bytes(data[4:8], 'little'))").stdout.strip()
        assert flags == "3"  # PEP 552: hash-based, check_source
        shutil.copytree(fixture_host(FIXTURE), box.path(f"/tmp/{FIXTURE}"), symlinks=True)
        inside = box.run("gpuaas-agent", "discover", "--root", f"/tmp/{FIXTURE}")
        here = run_checked([sys.executable, "-m", "gpuaas_agent", "discover", "--root", str(fixture_host(FIXTURE))])
        assert inside.stdout == here.stdout and "gpu_devices=8 " in inside.stdout
        for absent in SLICE_ONLY:
            status = box.run("dpkg-query", "-W", "-f=${Status}", absent, check=False).stdout
            assert "install ok installed" not in status, absent
            # ...but a slice host's plain `apt-get install` finds every one of them on this release.
            assert box.run("apt-cache", "show", "--no-all-versions", absent).stdout.startswith("Package: ")
        # The python3 file trigger: a venv built for another interpreter (what a 3.10/3.11 -> 3.12 distribution
        # upgrade leaves) is rebuilt by postinst `triggered`; a current one is left alone.
        stamp = box.path("/opt/gpuaas-agent/.gpuaas-python")
        current = stamp.read_text()
        before = box.path("/opt/gpuaas-agent/bin/python").lstat().st_ino
        box.run("dpkg-trigger", "--no-await", "/usr/bin/python3")
        box.run("dpkg", "--triggers-only", "--pending")
        assert box.path("/opt/gpuaas-agent/bin/python").lstat().st_ino == before and stamp.read_text() == current
        stamp.write_text("3.11 " + current.split()[1] + "\n")
        box.run("dpkg-trigger", "--no-await", "/usr/bin/python3")
        box.run("dpkg", "--triggers-only", "--pending")
        assert stamp.read_text() == current
        assert box.path("/opt/gpuaas-agent/bin/python").lstat().st_ino != before  # a new venv
        assert box.run("gpuaas-agent", "--version").stdout.strip() == f"gpuaas-agent {version}"
        # Remove takes the venv postinst built with it.
        box.run("apt-get", "remove", "-y", "gpuaas-agent", timeout=APT_TIMEOUT_S)
        assert not box.path("/opt/gpuaas-agent").exists()
