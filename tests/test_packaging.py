"""The package list in pyproject.toml names every package directory of gpuaas_agent."""

import tomllib

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


def test_the_deb_lock_pins_every_runtime_dependency_and_theirs():
    """A dependency missing from packaging/requirements.lock is absent from the installed venv (--no-deps)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    lock = {_norm(line.split("==", 1)[0]) for line in (REPO / "packaging/requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith((" ", "#"))}
    wanted, queue = set(), [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())
                             ["project"]["dependencies"]]
    while queue:
        req = queue.pop()
        name = _norm(req.name)
        if name in wanted or name in FROM_DISTRO or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        wanted.add(name)
        queue += [Requirement(r) for r in (metadata.requires(req.name) or [])]
    assert sorted(wanted - lock) == []
