"""The .deb built by `make deb` installs into a clean Debian 12 root, runs, upgrades keeping state, rolls back.

A real ``debootstrap --variant=minbase bookworm`` root (cached as a tarball in
/var/cache/gpuaas-agent-ci, with apt's downloaded packages, so reruns take
about a minute), a real ``apt-get install ./gpuaas-agent_<v>_amd64.deb`` that
has to resolve every ``Depends:`` from the Debian mirror the host uses, and the
installed console script run inside the chroot. ``policy-rc.d`` keeps package
scripts from starting services; /proc and the apt cache are mounted for the
test and unmounted even when it fails.

Lifecycle covered: plain ``dpkg -i`` on a root without the host tools names what
is missing; apt install of v1; ``--version`` and ``discover --root <fixture>``
from the installed package; upgrade to v2 and rollback to v1 keeping config,
credentials, state and token byte-identical; an invalid config key named at
install time; the maintainer scripts' systemd calls (stop before unpack, start
after, nothing started on a fresh install; recorded by a PATH shim since there
is no systemd as PID 1); and the rendered cloud-init user-data run step by step
in the chroot: package over HTTP, sha256 check, token 0600, real enrollment
against a real nats-server.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpuaas_agent.host.run import run
from gpuaas_agent.userdata import UserDataInputs, render_userdata
from tests.conftest import REPO, fixture_host
from tests.control.conftest import free_port, nats_server  # noqa: F401  (pytest fixture)
from tests.controlplane import ControlPlane

CACHE = Path("/var/cache/gpuaas-agent-ci")
BASE_TARBALL = CACHE / "bookworm-minbase.tar"
APT_ARCHIVES = CACHE / "apt-archives"
BUILD = ["/usr/bin/python3", str(REPO / "packaging" / "build_deb.py")]
FIXTURE = "h200-slice-after-transition"
DEBOOTSTRAP_TIMEOUT_S = 1200
APT_TIMEOUT_S = 1800
CMD_TIMEOUT_S = 300


def _run(argv: list[str], *, timeout: float = CMD_TIMEOUT_S, env: dict | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}")
    return done


def host_mirror() -> str:
    """The Debian mirror this host's apt uses for bookworm (deb822 sources first, then sources.list)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for para in sources.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in para.splitlines() if ":" in line and not line.startswith("#"))
            fields = {k.strip(): v.split() for k, v in fields.items()}
            if "deb" in fields.get("Types", []) and "bookworm" in fields.get("Suites", []) and fields.get("URIs"):
                return fields["URIs"][0]
    listed = Path("/etc/apt/sources.list")
    if listed.exists():
        for line in listed.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
                return parts[1]
    pytest.fail("no bookworm mirror in the host's apt sources: cannot debootstrap a clean Debian 12 root")


def _base_tarball() -> Path:
    """A pristine minbase bookworm root as a tarball; built once, reused by every later run."""
    if BASE_TARBALL.exists():
        return BASE_TARBALL
    if shutil.which("debootstrap") is None:
        pytest.fail("debootstrap is not installed (scripts/apt-packages.txt lists it)")
    CACHE.mkdir(parents=True, exist_ok=True)
    work = CACHE / f"debootstrap-{os.getpid()}"
    try:
        _run(["debootstrap", "--variant=minbase", "bookworm", str(work), host_mirror()], timeout=DEBOOTSTRAP_TIMEOUT_S)
        tmp = BASE_TARBALL.with_suffix(".tmp")
        _run(["tar", "-C", str(work), "--numeric-owner", "-cf", str(tmp), "."], timeout=CMD_TIMEOUT_S)
        tmp.rename(BASE_TARBALL)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return BASE_TARBALL


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve())
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            mounts.append(point)
    return mounts


@dataclass
class Chroot:
    root: Path

    def run(self, *argv: str, timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
               "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
        return _run(["chroot", str(self.root), *argv], timeout=timeout, env=env, check=check)

    def apt_install(self, deb: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        inside = Path("/tmp") / deb.name
        shutil.copy2(deb, self.root / inside.relative_to("/"))
        return self.run("apt-get", "install", "-y", "--no-install-recommends", *extra, str(inside),
                        timeout=APT_TIMEOUT_S, check=check)

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> dict[str, Path]:
    """v1 (the source version) and v2 (a newer one) built by the script `make deb` runs."""
    if os.geteuid() != 0:
        pytest.fail("the packaging test needs root (debootstrap, chroot, mount)", pytrace=False)
    out = tmp_path_factory.mktemp("dist")
    version = re.search(r'__version__ = "([^"]+)"', (REPO / "gpuaas_agent" / "__init__.py").read_text()).group(1)
    built = {}
    for label, ver in (("v1", version), ("v2", f"{version}+ci2")):
        started = time.monotonic()
        done = _run([*BUILD, "--version", ver, "--out", str(out)], timeout=APT_TIMEOUT_S)
        built[label] = Path(done.stdout.strip().splitlines()[-1])
        assert built[label].name == f"gpuaas-agent_{ver}_amd64.deb" and built[label].exists()
        print(f"build {label} {ver}: {time.monotonic() - started:.1f}s", file=sys.stderr)
    return built


@pytest.fixture(scope="module")
def chroot(tmp_path_factory) -> Iterator[Chroot]:
    """A clean bookworm root with /proc and the apt archive cache mounted; torn down even on failure."""
    root = tmp_path_factory.mktemp("bookworm") / "root"
    root.mkdir()
    _run(["tar", "-C", str(root), "--numeric-owner", "-xf", str(_base_tarball())], timeout=CMD_TIMEOUT_S)
    # Nothing a package installs may start here (no systemd, and not the host's services).
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf")
    APT_ARCHIVES.mkdir(parents=True, exist_ok=True)
    (APT_ARCHIVES / "partial").mkdir(exist_ok=True)
    mounted: list[Path] = []
    try:
        _run(["mount", "-t", "proc", "proc", str(root / "proc")])
        mounted.append(root / "proc")
        _run(["mount", "--bind", str(APT_ARCHIVES), str(root / "var/cache/apt/archives")])
        mounted.append(root / "var/cache/apt/archives")
        box = Chroot(root)
        box.run("apt-get", "update", timeout=APT_TIMEOUT_S)
        yield box
    finally:
        for point in reversed(mounted):
            if _run(["umount", str(point)], check=False).returncode != 0:
                _run(["umount", "-l", str(point)], check=False)
        left = _mounts_under(root)
        # Never rm -rf through a mount that is still there (the apt cache is a bind mount).
        assert not left, f"mounts left under the chroot: {left}"
        shutil.rmtree(root.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(chroot, debs) -> Chroot:
    # A root without the host tools: plain dpkg refuses and names what is missing, then apt installs them.
    shutil.copy2(debs["v1"], chroot.path(f"/tmp/{debs['v1'].name}"))
    bare = chroot.run("dpkg", "-i", f"/tmp/{debs['v1'].name}", check=False)
    assert bare.returncode != 0
    for missing in ("openvswitch-switch", "dnsmasq", "qemu-utils", "libvirt-daemon-system"):
        assert f"depends on {missing}" in bare.stderr, bare.stderr
    chroot.run("dpkg", "--remove", "gpuaas-agent")
    started = time.monotonic()
    chroot.apt_install(debs["v1"])
    print(f"install v1 with dependencies: {time.monotonic() - started:.1f}s", file=sys.stderr)
    return chroot


def test_installed_package_runs_version_and_discover(installed, debs):
    box = installed
    version = debs["v1"].name.split("_")[1]
    assert box.run("gpuaas-agent", "--version").stdout.strip() == f"gpuaas-agent {version}"
    assert os.readlink(box.path("/usr/bin/gpuaas-agent")) == "/opt/gpuaas-agent/bin/gpuaas-agent"

    # discover over a recorded host, from the installed package, matches the source tree's answer.
    shutil.copytree(fixture_host(FIXTURE), box.path(f"/tmp/{FIXTURE}"), symlinks=True)
    inside = box.run("gpuaas-agent", "discover", "--root", f"/tmp/{FIXTURE}")
    here = _run([sys.executable, "-m", "gpuaas_agent", "discover", "--root", str(fixture_host(FIXTURE))], env=None)
    assert inside.stdout == here.stdout and "gpu_devices=8 " in inside.stdout

    state = box.path("/var/lib/gpuaas-agent").stat()
    assert oct(state.st_mode & 0o777) == "0o700" and state.st_uid == 0
    # The shipped default config is valid for the agent's own parser (every key commented = defaults).
    box.run("/opt/gpuaas-agent/bin/python", "-c",
            "from gpuaas_agent.config import load_config; load_config('/etc/gpuaas-agent/agent.toml')")
    files = box.run("dpkg", "-L", "gpuaas-agent").stdout.splitlines()
    for expected in ("/lib/systemd/system/gpuaas-agent.service", "/lib/systemd/system/gpuaas-slice-network-baseline.service",
                     "/etc/gpuaas-agent/agent.toml", "/opt/gpuaas-agent/bin/gpuaas-agent"):
        assert expected in files
    assert box.run("dpkg-query", "-W", "-f=${Conffiles}", "gpuaas-agent").stdout.strip().startswith("/etc/gpuaas-agent/agent.toml")
    # No file of the package points back into the build's staging directory.
    assert box.run("head", "-n1", "/opt/gpuaas-agent/bin/gpuaas-agent").stdout.strip() == "#!/opt/gpuaas-agent/bin/python"


def test_upgrade_keeps_config_credentials_and_state_and_rollback_works(installed, debs):
    box = installed
    config = box.path("/etc/gpuaas-agent/agent.toml")
    config.write_text('nats_url = "nats://10.177.36.10:4222"\n')  # the site's edit of the conffile
    kept = {
        "/etc/gpuaas-agent/agent.toml": (config.read_bytes(), 0o644),
        "/var/lib/gpuaas-agent/enrollment.json": (b'{"node_id": "n-1", "creds": "secret"}\n', 0o600),
        "/var/lib/gpuaas-agent/state.db": (b"SQLite format 3\x00not really\n", 0o600),
        "/var/lib/gpuaas-agent/bootstrap-token": (b"token-not-yet-used\n", 0o600),
    }
    for inside, (data, mode) in kept.items():
        box.path(inside).write_bytes(data)
        box.path(inside).chmod(mode)

    def assert_kept(when: str) -> None:
        for inside, (data, mode) in kept.items():
            path = box.path(inside)
            assert path.read_bytes() == data, f"{inside} changed by {when}"
            assert path.stat().st_mode & 0o777 == mode, f"{inside} mode changed by {when}"
        assert box.path("/var/lib/gpuaas-agent").stat().st_mode & 0o777 == 0o700

    v1 = debs["v1"].name.split("_")[1]
    v2 = debs["v2"].name.split("_")[1]
    started = time.monotonic()
    box.apt_install(debs["v2"])  # no --force-conf*: an edited conffile must not need an answer
    print(f"upgrade to v2: {time.monotonic() - started:.1f}s", file=sys.stderr)
    assert box.run("gpuaas-agent", "--version").stdout.strip() == f"gpuaas-agent {v2}"
    assert box.run("dpkg-query", "-W", "-f=${Version}", "gpuaas-agent").stdout == v2
    assert_kept("the upgrade")

    box.apt_install(debs["v1"], "--allow-downgrades")
    assert box.run("gpuaas-agent", "--version").stdout.strip() == f"gpuaas-agent {v1}"
    assert_kept("the rollback")


def test_install_names_an_invalid_config_key_and_still_installs(installed, debs):
    """A config with an unknown key: the install says which key, the agent would refuse it at start."""
    box = installed
    config = box.path("/etc/gpuaas-agent/agent.toml")
    original = config.read_bytes()
    config.write_text('nats_ur = "nats://10.177.36.10:4222"\n')
    try:
        done = box.apt_install(debs["v2"], "--allow-downgrades")
        assert "unknown key 'nats_ur'" in done.stderr + done.stdout
        assert "/etc/gpuaas-agent/agent.toml is invalid" in done.stderr + done.stdout
        start = box.run("gpuaas-agent", "run", "--config", "/etc/gpuaas-agent/agent.toml", check=False)
        assert start.returncode == 1 and "nats_ur" in start.stderr + start.stdout
    finally:
        config.write_bytes(original)


SHIM = """#!/bin/sh
# Records a systemd call of a maintainer script and which agent version is on disk at that moment.
echo "$(basename "$0") $* version=$(/opt/gpuaas-agent/bin/gpuaas-agent --version 2>/dev/null)" >> /tmp/systemd-calls.log
"""


def test_maintainer_scripts_drain_before_unpack_start_after_and_never_start_a_fresh_install(installed, debs):
    """With systemd "running" (/run/systemd/system), the scripts' systemd calls are recorded by a shim.

    No systemd as PID 1 here, so deb-systemd-invoke/systemctl are replaced (on PATH, not on disk)
    by a recorder: it proves the order dpkg runs them in against which version's files are present.
    """
    box = installed
    shims = [box.path(f"/usr/local/sbin/{name}") for name in ("deb-systemd-invoke", "systemctl")]
    marker = box.path("/run/systemd/system")
    log = box.path("/tmp/systemd-calls.log")
    old = box.run("dpkg-query", "-W", "-f=${Version}", "gpuaas-agent").stdout
    new_label = "v2" if old == debs["v1"].name.split("_")[1] else "v1"
    new = debs[new_label].name.split("_")[1]
    try:
        marker.mkdir(parents=True)
        for shim in shims:
            shim.write_text(SHIM)
            shim.chmod(0o755)
        # apt runs dpkg with its own PATH (DPkg::Path); put the recorders first on it.
        dpkg_path = "-oDPkg::Path=/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
        box.apt_install(debs[new_label], "--allow-downgrades", dpkg_path)
        calls = log.read_text().splitlines()
        assert calls[0] == f"deb-systemd-invoke stop gpuaas-agent.service version=gpuaas-agent {old}"
        assert f"deb-systemd-invoke start gpuaas-agent.service version=gpuaas-agent {new}" in calls
        assert calls.index(f"systemctl --system daemon-reload version=gpuaas-agent {new}") < len(calls) - 1

        # Purge forgets everything; a fresh install then starts nothing (cloud-init enables the agent).
        box.run("apt-get", "purge", "-y", dpkg_path, "gpuaas-agent", timeout=APT_TIMEOUT_S)
        assert not box.path("/var/lib/gpuaas-agent").exists() and not box.path("/etc/gpuaas-agent/agent.toml").exists()
        log.unlink()
        box.apt_install(debs["v1"], dpkg_path)
        calls = log.read_text().splitlines()
        assert not [c for c in calls if c.startswith("deb-systemd-invoke start")], calls
        assert box.path("/var/lib/gpuaas-agent").stat().st_mode & 0o777 == 0o700
    finally:
        for shim in shims:
            shim.unlink(missing_ok=True)
        if marker.exists():
            marker.rmdir()
        log.unlink(missing_ok=True)


@pytest.fixture
def package_server(debs) -> Iterator[str]:
    """The built packages over HTTP on 127.0.0.1 (the chroot shares this network namespace)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                             "--directory", str(debs["v2"].parent)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("http.server did not come up") from None
                time.sleep(0.05)  # readiness poll with a deadline
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_user_data_installs_verifies_writes_token_and_enrolls_in_the_clean_root(installed, debs, package_server,
                                                                                nats_server):  # noqa: F811
    """The rendered user-data, step by step in the chroot, as cloud-init would run it on a fresh host.

    write_files and packages are applied as cloud-init's modules do; every runcmd argv runs in the chroot
    in order, except `systemctl` (no systemd as PID 1 here; the units are covered by test_units.py).
    Enrollment is real: a real nats-server and the test control plane answer `gpuaas.enroll`.
    """
    box = installed
    box.run("apt-get", "purge", "-y", "gpuaas-agent", timeout=APT_TIMEOUT_S)  # a host that never had it
    machine_id = box.path("/etc/machine-id")
    if not machine_id.read_text().strip():  # systemd writes it at first boot
        machine_id.write_text("5f3c0a7e9b2d4c1e8a6f0b3d2c1e4f5a\n")
    deb = debs["v2"]

    async def body():
        plane = await ControlPlane.connect(nats_server.url)
        try:
            await plane.serve_enrollment()
            inputs = UserDataInputs(package_url=f"{package_server}/{deb.name}",
                                    package_sha256=hashlib.sha256(deb.read_bytes()).hexdigest(),
                                    bootstrap_token=plane.issue_token(), nats_url=nats_server.url,
                                    maas_tags=["gpuaas-profile-slice-vm"], baseline_args=["--tmfifo"])
            doc = yaml.safe_load(render_userdata(inputs))
            for entry in doc["write_files"]:  # cloud-init's write_files module
                path = box.path(entry["path"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(entry["content"])
                path.chmod(int(entry["permissions"], 8))
            env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
            await run(["chroot", str(box.root), "apt-get", "install", "-y", "--no-install-recommends", *doc["packages"]],
                      timeout=APT_TIMEOUT_S, env=env)
            skipped, outputs = [], []
            for argv in doc["runcmd"]:
                if argv[0] == "systemctl":
                    skipped.append(argv)
                    continue
                done = await run(["chroot", str(box.root), *argv], timeout=APT_TIMEOUT_S, env=env, check=False)
                assert done.returncode == 0, f"{argv}: {done.stderr.decode()[-3000:]}"
                outputs.append(done.stdout.decode())
            return inputs, skipped, outputs, plane.enroll_requests
        finally:
            await plane.close()

    inputs, skipped, outputs, requests = asyncio.run(body())
    version = deb.name.split("_")[1]
    assert box.run("gpuaas-agent", "--version").stdout.strip() == f"gpuaas-agent {version}"
    assert skipped == [["systemctl", "enable", "--now", "gpuaas-slice-network-baseline.service"],
                       ["systemctl", "enable", "--now", "gpuaas-agent.service"]]
    assert outputs[-1].startswith("enrolled node_id=node-") and len(requests) == 1
    # The token was spent and removed, the credentials are root-only, the staged copy is gone.
    assert not box.path("/var/lib/gpuaas-agent/bootstrap-token").exists()
    assert not box.path("/run/gpuaas-agent-bootstrap/bootstrap-token").exists()
    record = box.path("/var/lib/gpuaas-agent/enrollment.json")
    assert record.stat().st_mode & 0o777 == 0o600
    assert box.path("/var/lib/gpuaas-agent").stat().st_mode & 0o777 == 0o700
    config = box.run("/opt/gpuaas-agent/bin/python", "-c",
                     "from gpuaas_agent.config import load_config; print(load_config('/etc/gpuaas-agent/agent.toml').nats_url)")
    assert config.stdout.strip() == inputs.nats_url
    assert box.path("/etc/default/gpuaas-slice-network-baseline").read_text() == "BASELINE_ARGS=--tmfifo\n"
