#!/usr/bin/python3
"""Build ``dist/gpuaas-agent_<version>_amd64.deb``: the agent in a self-contained venv under /opt/gpuaas-agent.

Run with Debian's ``/usr/bin/python3`` (the venv links to it, so the package
depends on exactly that interpreter's minor version). Standard library only: it
runs before any venv exists. ``make deb`` calls it; tests/deploy/test_deb.py too.

Why a staging root: the venv is created under ``STAGE/opt/gpuaas-agent`` and the
absolute staging prefix is rewritten to ``/opt/gpuaas-agent`` in the few text
files that carry it (console-script shebangs, activate scripts, pyvenv.cfg);
bytecode is compiled with the staging prefix stripped. The build fails if the
staging path survives anywhere in the tree, so the package never points back
into a build directory.

Dependency wheels (libvirt-python compiles against libvirt-dev) are kept in a
wheel cache (``--wheel-cache``, default /var/cache/gpuaas-agent-ci/wheels) so a
rebuild is offline and fast; the first build fills it from the configured index.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGING = REPO / "packaging"
PREFIX = "/opt/gpuaas-agent"
SYSTEM_PYTHON = "/usr/bin/python3"
DEFAULT_WHEEL_CACHE = Path("/var/cache/gpuaas-agent-ci/wheels")
UNITS = ("gpuaas-agent.service", "gpuaas-slice-network-baseline.service")
PIP_TIMEOUT_S = 1800  # libvirt-python compiles on a 2-core CI machine
STEP_TIMEOUT_S = 600
# A version both PEP 440 and Debian read the same way: 1.2.3 or 1.2.3+local.4
VERSION_RE = re.compile(r"^\d+(\.\d+)*(\+[a-z0-9]+(\.[a-z0-9]+)*)?$")
INIT_VERSION_RE = re.compile(r'^__version__ = "([^"]+)"$', re.M)


class BuildError(RuntimeError):
    """The package could not be built; the message names the step."""


def _run(argv: list[str], *, timeout: float = STEP_TIMEOUT_S, env: dict | None = None) -> None:
    print("+", " ".join(argv), flush=True)
    done = subprocess.run(argv, timeout=timeout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise BuildError(f"{argv[0]} {argv[1] if len(argv) > 1 else ''} exited {done.returncode}:\n"
                         f"{done.stdout.decode(errors='replace')[-4000:]}")


def source_version() -> str:
    match = INIT_VERSION_RE.search((REPO / "gpuaas_agent" / "__init__.py").read_text())
    if not match:
        raise BuildError("gpuaas_agent/__init__.py has no __version__ line")
    return match.group(1)


def _copy_source(dest: Path, version: str) -> Path:
    """The sdist-shaped tree pip builds from; ``version`` replaces __version__ in the copy only."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "gpuaas_agent", dest / "gpuaas_agent",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    init = dest / "gpuaas_agent" / "__init__.py"
    init.write_text(INIT_VERSION_RE.sub(f'__version__ = "{version}"', init.read_text(), count=1))
    return dest


def _build_wheels(src: Path, wheels: Path, cache: Path) -> Path:
    """The agent's wheel into ``wheels``; its dependencies' wheels into ``cache`` (offline when already there)."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run([SYSTEM_PYTHON, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
         timeout=PIP_TIMEOUT_S, env=env)
    (agent_wheel,) = wheels.glob("gpuaas_agent-*.whl")
    cache.mkdir(parents=True, exist_ok=True)
    offline = [SYSTEM_PYTHON, "-m", "pip", "wheel", "-q", "--no-index", "--find-links", str(cache),
               "--find-links", str(wheels), "-w", str(cache), str(agent_wheel)]
    try:
        _run(offline, timeout=PIP_TIMEOUT_S, env=env)
    except BuildError:
        print("wheel cache incomplete: filling it from the configured index", flush=True)
        _run([SYSTEM_PYTHON, "-m", "pip", "wheel", "-q", "--find-links", str(cache), "-w", str(cache),
              str(agent_wheel)], timeout=PIP_TIMEOUT_S, env=env)
    (cache / agent_wheel.name).unlink(missing_ok=True)  # the cache holds dependencies only
    return agent_wheel


def _relocate(root: Path) -> None:
    """Rewrite the staging prefix to /opt/gpuaas-agent in text files; refuse if it is left anywhere."""
    staged = str(root) + PREFIX
    venv = root / PREFIX.lstrip("/")
    for path in [*(venv / "bin").iterdir(), venv / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if staged.encode() in data:
            path.write_bytes(data.replace(staged.encode(), PREFIX.encode()))
    leftovers = []
    for dirpath, _dirs, files in os.walk(venv):
        for name in files:
            path = Path(dirpath, name)
            if not path.is_symlink() and str(root).encode() in path.read_bytes():
                leftovers.append(str(path.relative_to(root)))
    if leftovers:
        raise BuildError(f"staging path {root} left in: {', '.join(leftovers[:10])}")


def _install_venv(root: Path, agent_wheel: Path, cache: Path) -> None:
    venv = root / PREFIX.lstrip("/")
    venv.parent.mkdir(parents=True)
    _run([SYSTEM_PYTHON, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", "--no-index", "--no-compile", "--find-links", str(cache),
          str(agent_wheel)], timeout=PIP_TIMEOUT_S, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    # pip and setuptools are build tools: the running agent never installs anything.
    _run([py, "-m", "pip", "uninstall", "-q", "-y", "pip", "setuptools"])
    for stale in venv.rglob("__pycache__"):
        shutil.rmtree(stale)
    # Hash-checked bytecode: /opt is read-only under ProtectSystem=strict, so the agent could never
    # rewrite a stale .pyc; unchecked-hash ones stay valid whatever mtimes dpkg gives the files.
    _run([SYSTEM_PYTHON, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
          "-s", str(root), "-p", "/", str(venv / "lib")])
    _relocate(root)


def _installed_size_kib(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        if Path(dirpath).name == "DEBIAN" and Path(dirpath).parent == root:
            continue
        for name in files:
            path = Path(dirpath, name)
            total += path.lstat().st_size
    return total // 1024 + 1


def _python_minor() -> str:
    done = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def _lay_out(root: Path, version: str) -> None:
    """Everything beside the venv: units, default config, PATH link, docs, maintainer scripts."""
    units = root / "lib" / "systemd" / "system"
    units.mkdir(parents=True)
    for unit in UNITS:
        shutil.copy2(REPO / "systemd" / unit, units / unit)
        (units / unit).chmod(0o644)
    etc = root / "etc" / "gpuaas-agent"
    etc.mkdir(parents=True)
    shutil.copy2(PACKAGING / "agent.toml", etc / "agent.toml")
    (etc / "agent.toml").chmod(0o644)
    bin_dir = root / "usr" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "gpuaas-agent").symlink_to(f"{PREFIX}/bin/gpuaas-agent")
    doc = root / "usr" / "share" / "doc" / "gpuaas-agent"
    doc.mkdir(parents=True)
    shutil.copy2(PACKAGING / "README.md", doc / "README.md")
    shutil.copy2(REPO / "README.md", root / PREFIX.lstrip("/") / "README.md")  # the unit's Documentation=

    debian = root / "DEBIAN"
    debian.mkdir()
    minor = _python_minor()
    major, low = minor.split(".")
    control = (PACKAGING / "debian" / "control.in").read_text()
    fields = {
        "Version": version,
        "Installed-Size": str(_installed_size_kib(root)),
        "Python": f"python3 (>= {minor}), python3 (<< {major}.{int(low) + 1})",
    }
    lines = []
    for line in control.splitlines():
        key = line.split(":", 1)[0]
        if key in ("Version", "Installed-Size"):
            line = f"{key}: {fields[key]}"
        elif key == "Depends":
            line = line.replace("@PYTHON@", fields["Python"])
        lines.append(line)
    (debian / "control").write_text("\n".join(lines) + "\n")
    shutil.copy2(PACKAGING / "debian" / "conffiles", debian / "conffiles")
    for script in ("postinst", "prerm", "postrm"):
        shutil.copy2(PACKAGING / "debian" / script, debian / script)
        (debian / script).chmod(0o755)


def build(version: str, out_dir: Path, wheel_cache: Path) -> Path:
    if not VERSION_RE.match(version):
        raise BuildError(f"version {version!r} must look like 1.2.3 or 1.2.3+tag.4 (PEP 440 and Debian alike)")
    if not Path(SYSTEM_PYTHON).exists():
        raise BuildError(f"{SYSTEM_PYTHON} is missing: the venv must link to Debian's python3")
    for tool in ("dpkg-deb", "gcc", "pkg-config"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed (build needs dpkg-deb; libvirt-python needs gcc, pkg-config, libvirt-dev; systemd-python libsystemd-dev)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuaas-deb-") as tmp:
        work = Path(tmp)
        src = _copy_source(work / "src", version)
        agent_wheel = _build_wheels(src, work / "wheels", wheel_cache)
        root = work / "root"
        root.mkdir(mode=0o755)
        _install_venv(root, agent_wheel, wheel_cache)
        _lay_out(root, version)
        deb = out_dir / f"gpuaas-agent_{version}_amd64.deb"
        _run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)])
    return deb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=os.environ.get("GPUAAS_DEB_VERSION") or None,
                        help="package version (default: $GPUAAS_DEB_VERSION, else gpuaas_agent.__version__)")
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="output directory (default dist/)")
    parser.add_argument("--wheel-cache", type=Path, default=DEFAULT_WHEEL_CACHE,
                        help=f"dependency wheel cache (default {DEFAULT_WHEEL_CACHE})")
    args = parser.parse_args(argv)
    try:
        deb = build(args.version or source_version(), args.out, args.wheel_cache)
    except (BuildError, subprocess.TimeoutExpired) as exc:
        print(f"build_deb: error: {exc}", file=sys.stderr)
        return 1
    print(deb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
