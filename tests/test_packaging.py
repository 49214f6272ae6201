"""The package list in pyproject.toml names every package directory of gpuaas_agent."""

import sys

from gpuaas_agent.compat import tomllib
from tests.conftest import REPO


def test_every_package_directory_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "gpuaas_agent").rglob("__init__.py")
    }
    assert listed == on_disk


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# Imported from the distro's python3-* packages through --system-site-packages (packaging/README.md).
FROM_DISTRO = {"libvirt-python", "systemd-python", "ovs"}
# Ubuntu 22.04, Debian 12, Ubuntu 24.04 (packaging/README.md).
SUPPORTED_PYTHONS = ("3.10", "3.11", "3.12")
# The optional extras the .deb carries (pyproject's [project.optional-dependencies]): `bmc` is the Redfish
# reader of the gpu_bmc check, which a packaged host must be able to run.
DEB_EXTRAS = ("bmc",)


def _deb_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(r for extra in DEB_EXTRAS for r in project["optional-dependencies"][extra])]


def _lock_pins() -> dict[str, str]:
    return {_norm(line.split("==", 1)[0]): line.split("==", 1)[1].split()[0]
            for line in (REPO / "packaging/requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith((" ", "#"))}


def test_the_deb_lock_pins_every_runtime_dependency_and_theirs():
    """A dependency missing from packaging/requirements.lock is absent from the installed venv (--no-deps).

    The .deb's extras count: sushy and its tree (pbr, stevedore, requests...) are walked too.
    """
    from importlib import metadata

    from packaging.requirements import Requirement

    lock = {_norm(line.split("==", 1)[0]) for line in (REPO / "packaging/requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith((" ", "#"))}
    wanted: set[str] = set()
    # Every Python the one .deb supports: a dependency only 3.10 needs (tomli) is locked too.
    for python in SUPPORTED_PYTHONS:
        env = {"extra": "", "python_version": python, "python_full_version": f"{python}.0"}
        queue = [Requirement(r) for r in _deb_requirements()]
        while queue:
            req = queue.pop()
            name = _norm(req.name)
            if name in wanted or name in FROM_DISTRO or (req.marker and not req.marker.evaluate(env)):
                continue
            wanted.add(name)
            try:
                queue += [Requirement(r) for r in (metadata.requires(req.name) or [])]
            except metadata.PackageNotFoundError:  # needed only on another Python (tomli on 3.10): no metadata here
                assert python != f"{sys.version_info[0]}.{sys.version_info[1]}", req.name
    assert sorted(wanted - lock) == []


def test_debian_copyright_names_every_bundled_wheel():
    """Every wheel the .deb ships has a Files stanza in debian/copyright (a wheel without one is unlicensed to ship)."""
    lock = {line.split("==", 1)[0] for line in (REPO / "packaging/requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith((" ", "#"))}
    copyright_text = (REPO / "packaging/debian/copyright").read_text()
    # Wheel file names use the normalised project name with "_" (PEP 427), lower-cased by pip.
    covered = {name for name in lock
               if f"wheels/{name.lower().replace('-', '_')}-*" in copyright_text
               or f"wheels/{name.lower()}-*" in copyright_text}
    assert sorted(lock - covered) == []


def test_the_deb_lock_pins_what_the_packaged_extras_ask_for():
    """The locked release of each extra's requirement satisfies the extra's specifier (sushy>=5.11,<6: 5.11.1)."""
    from packaging.requirements import Requirement

    pins = _lock_pins()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in DEB_EXTRAS:
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            assert _norm(req.name) in pins, f"{req.name} of the {extra} extra is not locked"
            assert req.specifier.contains(pins[_norm(req.name)]), (req, pins[_norm(req.name)])
