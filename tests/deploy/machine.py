"""This machine as the package's install target: paths the .deb owns, the build command, the session's builds,
a clean-machine fixture.

The fresh-host lane and the upgrade-during-clone test install the real .deb on this
machine (the lab's daemons need the root namespaces, which a chroot does not give);
``clean_machine`` refuses to install over an existing agent and purges what the test
added afterwards. ``deb_build`` builds the package of this tree once per version per session
(five modules install it; the build is the same bytes each time, test_deb_portable proves it).
A pytest plugin (tests/conftest.py), so tests take the fixtures by name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuaas_agent.deploy.userdata import BOOTSTRAP_DIR, DEB_PATH
from tests.conftest import REPO
from tests.deploy.chroot import APT_TIMEOUT_S, run_checked
from tests.support.tiers import starts

BUILD = ["/usr/bin/python3", str(REPO / "packaging" / "build_deb.py")]
INSTALLED_AGENT = Path("/opt/gpuaas-agent/bin/gpuaas-agent")
RELAY_KEY = Path("/var/lib/gpuaas/terminal/id_ed25519")
SEED_DIR = Path("/var/lib/libvirt/images/gpuaas-seeds")
STATE_DIR = Path("/var/lib/gpuaas-agent")
# The local part of the newer version the upgrade tests install over the tree's own (test_deb, the upgrade during a clone).
V2_LOCAL = "ci2"
LEFTOVERS = (BOOTSTRAP_DIR, DEB_PATH.parent, Path("/etc/default/gpuaas-slice-network-baseline"))


def tree_version() -> str:
    """``gpuaas_agent.__version__`` of this tree (what ``build_deb.py`` names the package without ``--version``)."""
    found = re.search(r'^__version__ = "([^"]+)"$', (REPO / "gpuaas_agent" / "__init__.py").read_text(), re.M)
    assert found, "gpuaas_agent/__init__.py names no __version__"
    return found.group(1)


@pytest.fixture(scope="session")
def deb_build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str | None, Path], Path]:
    """``deb_build(version, into) -> Path``: the .deb of this tree at ``version`` (None: the tree's own), copied
    into the directory ``into``.

    Built by ``packaging/build_deb.py`` (what ``make deb`` runs) the first time a version is asked for in the
    session, then copied: each caller has its own file in its own directory, so a module that puts something
    beside its package (a broken .deb, an HTTP root) changes nothing another module sees.
    ``GPUAAS_DEB_VERSION`` is not passed on: the version is always named, so the tree's own version built for
    one module is the same package another module asks for without one.
    """
    if os.geteuid() != 0:
        pytest.fail("the packaging tests need root (debootstrap, chroot, mount, apt)", pytrace=False)
    built: dict[str, Path] = {}
    env = {k: v for k, v in os.environ.items() if k != "GPUAAS_DEB_VERSION"}

    def deb(version: str | None, into: Path) -> Path:
        version = version or tree_version()
        if version not in built:
            out = tmp_path_factory.mktemp("deb-build")
            done = run_checked([*BUILD, "--version", version, "--out", str(out)], timeout=APT_TIMEOUT_S, env=env)
            built[version] = Path(done.stdout.strip().splitlines()[-1])
            assert built[version].name == f"gpuaas-agent_{version}_amd64.deb" and built[version].exists()
        into.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(built[version], into / built[version].name))

    return deb


def installed_packages() -> set[str]:
    """The names of the packages dpkg reports installed."""
    out = run_checked(["dpkg-query", "-W", "-f=${binary:Package} ${db:Status-Status}\n"]).stdout
    return {line.split()[0].split(":")[0] for line in out.splitlines() if line.endswith(" installed")}


@pytest.fixture
@starts("deploy")
def clean_machine() -> Iterator[set[str]]:
    """This machine without the agent; afterwards the package and whatever apt added for it are purged."""
    if os.geteuid() != 0:
        pytest.fail("the fresh-host lane needs root (apt, loop devices, OVS, libvirtd)", pytrace=False)
    before = installed_packages()
    if "gpuaas-agent" in before or STATE_DIR.exists() or INSTALLED_AGENT.exists():
        pytest.fail("gpuaas-agent (or its state dir) is already on this machine: refusing to install over it",
                    pytrace=False)
    yield before
    added = sorted(installed_packages() - before)
    if added:
        run_checked(["apt-get", "purge", "-y", *added], timeout=APT_TIMEOUT_S,
                    env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    for path in LEFTOVERS:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    assert "gpuaas-agent" not in installed_packages()
    # /etc/gpuaas-agent includes the image CA the user-data put there; /var/log/gpuaas-agent the console logs.
    for gone in (STATE_DIR, INSTALLED_AGENT, RELAY_KEY.parent.parent, SEED_DIR, Path("/etc/gpuaas-agent"),
                 Path("/var/log/gpuaas-agent")):
        assert not gone.exists(), f"purge left {gone}"


def cloud_init_runcmd_script(runcmd: list) -> str:
    """The script cloud-init's runcmd module writes for ``runcmd``: its own ``util.shellify``.

    cloud-init is installed from apt for the system python, not into the venv, so it runs there.
    """
    code = "import json, sys\nfrom cloudinit import util\nsys.stdout.write(util.shellify(json.load(sys.stdin)))"
    done = subprocess.run(["/usr/bin/python3", "-c", code], input=json.dumps(runcmd), capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"cloud-init's shellify is not importable by /usr/bin/python3 (apt cloud-init): {done.stderr}")
    return done.stdout
