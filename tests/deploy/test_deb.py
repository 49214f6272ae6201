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
import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpuaas_agent.deploy.userdata import UserDataInputs, render_userdata
from gpuaas_agent.host.run import run
from tests.conftest import fixture_host
from tests.deploy.chroot import APT_TIMEOUT_S, CACHE, Chroot, bookworm_tarball, distro_root, run_checked
from tests.deploy.machine import V2_LOCAL, cloud_init_runcmd_script, tree_version
from tests.support.controlplane import ControlPlane
from tests.support.nats_server import free_port

APT_ARCHIVES = CACHE / "apt-archives"
FIXTURE = "h200-slice-after-transition"


def assert_prepared(box: Chroot) -> None:
    """What a provision needs exists, created by the package with the modes QEMU, dnsmasq and root need."""
    expected = {"/var/lib/gpuaas-agent": 0o700, "/var/lib/gpuaas-agent/images": 0o700,
                "/var/lib/libvirt/images/gpuaas-seeds": 0o711, "/var/lib/gpuaas-dnsmasq": 0o755,
                "/var/lib/gpuaas/terminal": 0o700, "/var/lib/gpuaas/terminal/id_ed25519": 0o600,
                "/var/lib/gpuaas/terminal/id_ed25519.pub": 0o644, "/var/log/gpuaas-agent/console": 0o700}
    for inside, mode in expected.items():
        st = box.path(inside).stat()
        assert (st.st_mode & 0o777, st.st_uid) == (mode, 0), f"{inside}: {st.st_mode & 0o777:04o} uid {st.st_uid}"
    listed = box.run("ssh-keygen", "-l", "-f", "/var/lib/gpuaas/terminal/id_ed25519").stdout
    assert listed.endswith("(ED25519)\n")
    check = box.run("gpuaas-agent", "prepare-host", "--check", "--config", "/etc/gpuaas-agent/agent.toml")
    assert check.stdout.count("outcome=ok") == 7  # the six above and the console log dir


@pytest.fixture(scope="module")
def debs(tmp_path_factory, deb_build) -> dict[str, Path]:
    """v1 (the source version) and v2 (a newer one) built by the script `make deb` runs (once a session:
    ``deb_build``, tests/deploy/machine.py), in this module's own directory."""
    if os.geteuid() != 0:
        pytest.fail("the packaging test needs root (debootstrap, chroot, mount)", pytrace=False)
    out = tmp_path_factory.mktemp("dist")
    version = tree_version()
    built = {}
    for label, ver in (("v1", version), ("v2", f"{version}+{V2_LOCAL}")):
        started = time.monotonic()
        built[label] = deb_build(ver, out)
        assert built[label].name == f"gpuaas-agent_{ver}_amd64.deb" and built[label].exists()
        print(f"build {label} {ver}: {time.monotonic() - started:.1f}s", file=sys.stderr)
    return built


@pytest.fixture(scope="module")
def chroot() -> Iterator[Chroot]:
    """A clean bookworm root with /proc and the apt archive cache mounted; torn down even on failure."""
    with distro_root(bookworm_tarball(), APT_ARCHIVES) as box:
        yield box


@pytest.fixture(scope="module")
def installed(chroot, debs) -> Chroot:
    # A root without the host tools: plain dpkg refuses and names what is missing, then apt installs them.
    shutil.copy2(debs["v1"], chroot.path(f"/tmp/{debs['v1'].name}"))
    bare = chroot.run("dpkg", "-i", f"/tmp/{debs['v1'].name}", check=False)
    assert bare.returncode != 0
    # The slice-only packages (libvirt daemon, OVS, dnsmasq, QEMU) are Recommends since issue #22: the
    # missing Depends are the distro's python3 and its libvirt/systemd/ovs bindings the venv uses.
    for missing in ("python3", "python3-libvirt", "python3-systemd", "python3-openvswitch"):
        assert f"depends on {missing}" in bare.stderr, bare.stderr
    assert "depends on openvswitch-switch" not in bare.stderr and "depends on libvirt-daemon-system" not in bare.stderr
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
    here = run_checked([sys.executable, "-m", "gpuaas_agent", "discover", "--root", str(fixture_host(FIXTURE))], env=None)
    assert inside.stdout == here.stdout and "gpu_devices=8 " in inside.stdout

    state = box.path("/var/lib/gpuaas-agent").stat()
    assert oct(state.st_mode & 0o777) == "0o700" and state.st_uid == 0
    assert_prepared(box)  # postinst ran prepare-host: the first provision finds its directories and relay key
    # The shipped default config is valid for the agent's own parser (every key commented = defaults).
    box.run("/opt/gpuaas-agent/bin/python", "-c",
            "from gpuaas_agent.config import load_config; load_config('/etc/gpuaas-agent/agent.toml')")
    files = box.run("dpkg", "-L", "gpuaas-agent").stdout.splitlines()
    for expected in ("/lib/systemd/system/gpuaas-agent.service", "/lib/systemd/system/gpuaas-slice-network-baseline.service",
                     "/etc/gpuaas-agent/agent.toml", "/usr/lib/gpuaas-agent/install-venv",
                     "/usr/lib/gpuaas-agent/requirements.lock", "/usr/share/doc/gpuaas-agent/changelog.gz",
                     "/usr/share/doc/gpuaas-agent/copyright"):
        assert expected in files
    # The venv is postinst's, built against this root's python3 (3.11 on Debian 12), not a package file.
    assert not any(f.startswith("/opt/") for f in files)
    assert box.path("/opt/gpuaas-agent/pyvenv.cfg").read_text().startswith("home = /usr/bin\n")
    assert box.path("/opt/gpuaas-agent/.gpuaas-python").read_text().startswith("3.11 ")
    # A baremetal install (--no-install-recommends): no hypervisor, switch or DHCP server came with it.
    for absent in ("libvirt-daemon-system", "qemu-system-x86", "openvswitch-switch", "dnsmasq", "ovmf"):
        status = box.run("dpkg-query", "-W", "-f=${Status}", absent, check=False).stdout
        assert "install ok installed" not in status, absent
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
    # The relay key postinst generated: every slice trusts it, so no upgrade or rollback may touch it.
    for inside in ("/var/lib/gpuaas/terminal/id_ed25519", "/var/lib/gpuaas/terminal/id_ed25519.pub"):
        kept[inside] = (box.path(inside).read_bytes(), box.path(inside).stat().st_mode & 0o777)

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
        assert start.returncode == 2 and "nats_ur" in start.stderr + start.stdout
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


@dataclass
class Bootstrap:
    """One run of the rendered user-data in the chroot, as cloud-init runs it."""

    returncode: int
    output: str
    journal: list[str]          # what `logger -t gpuaas-bootstrap` sent to /dev/log
    systemctl: list[str]        # systemctl calls (recorded: no systemd as PID 1 in a chroot)
    enroll_requests: int


SYSTEMCTL_SHIM = """#!/bin/sh
echo "systemctl $*" >> /tmp/systemctl-calls.log
"""


def _fresh_host(box: Chroot) -> None:
    """A host that never had the agent: purged, no bootstrap leftovers, no downloaded package."""
    box.run("dpkg", "--purge", "gpuaas-agent", timeout=APT_TIMEOUT_S)  # a no-op when never installed
    for leftover in ("/run/gpuaas-agent-bootstrap", "/var/cache/gpuaas-agent", "/var/lib/cloud/instance",
                     "/etc/default/gpuaas-slice-network-baseline", "/tmp/systemctl-calls.log"):
        path = box.path(leftover)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    machine_id = box.path("/etc/machine-id")
    if not machine_id.read_text().strip():  # systemd writes it at first boot
        machine_id.write_text("5f3c0a7e9b2d4c1e8a6f0b3d2c1e4f5a\n")


def _dpkg_status(box: Chroot) -> str:
    return box.run("dpkg-query", "-W", "-f=${db:Status-Abbrev} ${Version}", "gpuaas-agent", check=False).stdout


def _run_user_data(box: Chroot, nats_url: str, make_inputs) -> Bootstrap:
    """cloud-init's modules applied to the chroot: write_files, packages, then runcmd exactly as cloud-init scripts it.

    ``runcmd`` becomes a script through cloud-init's own ``util.shellify`` (what cc_runcmd writes to
    scripts/runcmd, mode 0700) and that script runs in the chroot. /dev/log is a datagram socket here,
    so what ``logger`` sends (the journal on a real host) is read back.
    """

    async def body():
        plane = await ControlPlane.connect(nats_url)
        try:
            await plane.serve_enrollment()
            inputs = make_inputs(plane)
            doc = yaml.safe_load(render_userdata(inputs))
            for entry in doc["write_files"]:  # cloud-init's write_files module
                path = box.path(entry["path"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(entry["content"])
                path.chmod(int(entry["permissions"], 8))
            env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                   "HOME": "/root"}
            await run(["chroot", str(box.root), "apt-get", "install", "-y", "--no-install-recommends", *doc["packages"]],
                      timeout=APT_TIMEOUT_S, env=env)
            script = box.path("/var/lib/cloud/instance/scripts/runcmd")
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(cloud_init_runcmd_script(doc["runcmd"]))
            script.chmod(0o700)
            done = await run(["chroot", str(box.root), "/var/lib/cloud/instance/scripts/runcmd"],
                             timeout=APT_TIMEOUT_S, env=env, check=False)
            return done, len(plane.enroll_requests)
        finally:
            await plane.close()

    shim = box.path("/usr/local/sbin/systemctl")
    shim.write_text(SYSTEMCTL_SHIM)
    shim.chmod(0o755)
    log_socket = box.path("/dev/log")
    log_socket.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal: list[str] = []
    stop = threading.Event()

    def drain() -> None:
        """Read while the script runs: a datagram socket queues only net.unix.max_dgram_qlen (10) messages."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                journal.append(sock.recv(65536).decode(errors="replace"))

    reader = threading.Thread(target=drain, name="dev-log", daemon=True)
    try:
        sock.bind(str(log_socket))
        sock.settimeout(0.2)
        reader.start()
        done, requests = asyncio.run(body())
    finally:
        stop.set()
        if reader.is_alive():
            reader.join(timeout=5)
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # what was queued after the reader's last recv
                journal.append(sock.recv(65536).decode(errors="replace"))
        sock.close()
        log_socket.unlink(missing_ok=True)
        shim.unlink()
    calls = box.path("/tmp/systemctl-calls.log")
    return Bootstrap(returncode=done.returncode, output=done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace"),
                     journal=[line for line in journal if "gpuaas-bootstrap:" in line],
                     systemctl=calls.read_text().splitlines() if calls.exists() else [], enroll_requests=requests)


def _inputs(url: str, deb_bytes: bytes, token: str, nats_url: str, **changes) -> UserDataInputs:
    return UserDataInputs(package_url=url, package_sha256=hashlib.sha256(deb_bytes).hexdigest(),
                          bootstrap_token=token, nats_url=nats_url, **{"insecure": True, **changes})  # lab: plaintext


def test_user_data_as_cloud_init_runs_it_installs_prepares_and_enrolls_in_the_clean_root(installed, debs, package_server,
                                                                                        nats_server):
    """The rendered user-data run the way cloud-init runs it, on a root that never had the agent.

    Enrollment is real: a real nats-server and the test control plane answer `gpuaas.enroll`.
    """
    box = installed
    _fresh_host(box)
    deb = debs["v2"]
    made = {}

    def make(plane):
        made["inputs"] = _inputs(f"{package_server}/{deb.name}", deb.read_bytes(), plane.issue_token(), nats_server.url,
                                 maas_tags=["gpuaas-profile-slice-vm"], baseline_args=["--tmfifo"],
                                 slice={"image_https_hosts": ["images.lab.example"]})
        return made["inputs"]

    started = time.monotonic()
    boot = _run_user_data(box, nats_server.url, make)
    print(f"user-data bootstrap (install, prepare-host, enroll): {time.monotonic() - started:.1f}s", file=sys.stderr)
    assert boot.returncode == 0, boot.output[-4000:]
    version = deb.name.split("_")[1]
    assert box.run("gpuaas-agent", "--version").stdout.strip() == f"gpuaas-agent {version}"
    assert boot.systemctl == ["systemctl enable --now gpuaas-slice-network-baseline.service",
                              "systemctl enable --now gpuaas-agent.service"]
    assert "enrolled node_id=node-" in boot.output and boot.enroll_requests == 1
    assert any("step enroll ok" in line for line in boot.journal) and not box.path("/run/gpuaas-agent-bootstrap/failed").exists()
    # The token was spent and removed, the credentials are root-only, the staged copy is gone.
    assert not box.path("/var/lib/gpuaas-agent/bootstrap-token").exists()
    assert not box.path("/run/gpuaas-agent-bootstrap/bootstrap-token").exists()
    record = box.path("/var/lib/gpuaas-agent/enrollment.json")
    assert record.stat().st_mode & 0o777 == 0o600
    assert box.path("/var/lib/gpuaas-agent").stat().st_mode & 0o777 == 0o700
    config = box.run("/opt/gpuaas-agent/bin/python", "-c",
                     "from gpuaas_agent.config import load_config; print(load_config('/etc/gpuaas-agent/agent.toml').nats_url)")
    assert config.stdout.strip() == made["inputs"].nats_url
    assert box.path("/etc/default/gpuaas-slice-network-baseline").read_text() == "BASELINE_ARGS=--tmfifo\n"
    # What the first provision needs is there, with no hand step (the unit's --check agrees).
    assert_prepared(box)


def test_user_data_stops_at_a_wrong_digest_and_never_installs(installed, debs, package_server, nats_server):
    box = installed
    _fresh_host(box)
    before = _dpkg_status(box)
    deb = debs["v2"]
    boot = _run_user_data(box, nats_server.url, lambda plane: _inputs(
        f"{package_server}/{deb.name}", b"not the package", plane.issue_token(), nats_server.url))
    assert boot.returncode != 0
    assert _dpkg_status(box) == before and not box.path("/opt/gpuaas-agent").exists()
    assert any("step verify-package failed (exit 1)" in line and "did NOT match" in line for line in boot.journal), boot.journal
    assert any("step install-package not run" in line for line in boot.journal)
    assert boot.enroll_requests == 0 and boot.systemctl == []
    assert not box.path("/var/lib/gpuaas-agent/bootstrap-token").exists()
    assert box.path("/run/gpuaas-agent-bootstrap/failed").read_text().startswith("step verify-package failed")


def test_user_data_stops_at_a_failed_install(installed, debs, package_server, nats_server):
    box = installed
    _fresh_host(box)
    before = _dpkg_status(box)
    broken = debs["v2"].parent / "gpuaas-agent_9.9.9_amd64.deb"
    broken.write_bytes(b"!<arch>\nthis is not a debian package\n")
    try:
        boot = _run_user_data(box, nats_server.url, lambda plane: _inputs(
            f"{package_server}/{broken.name}", broken.read_bytes(), plane.issue_token(), nats_server.url))
    finally:
        broken.unlink()
    assert boot.returncode != 0
    assert _dpkg_status(box) == before
    assert any("step verify-package ok" in line for line in boot.journal)
    assert any("step install-package failed" in line for line in boot.journal), boot.journal
    assert any("step enroll not run" in line for line in boot.journal)
    assert boot.enroll_requests == 0 and boot.systemctl == []


def test_user_data_stops_at_a_refused_enrollment_and_never_enables_the_agent(installed, debs, package_server,
                                                                             nats_server):
    box = installed
    _fresh_host(box)
    deb = debs["v2"]
    boot = _run_user_data(box, nats_server.url, lambda plane: _inputs(
        f"{package_server}/{deb.name}", deb.read_bytes(), "a-token-the-control-plane-never-issued", nats_server.url))
    assert boot.returncode != 0
    assert _dpkg_status(box).startswith("ii ")  # installed; only enrollment was refused
    failed = [line for line in boot.journal if "step enroll failed" in line]
    assert failed and "token_invalid" in failed[0], boot.journal
    assert any("step enable-agent not run" in line for line in boot.journal)
    assert boot.enroll_requests == 1 and boot.systemctl == []
    assert not box.path("/var/lib/gpuaas-agent/enrollment.json").exists()
