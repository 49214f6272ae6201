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
