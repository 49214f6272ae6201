#!/usr/bin/python3
"""Build ``dist/gpuaas-agent_<version>_amd64.deb``: one package for Debian 12, Ubuntu 22.04 and 24.04.

Run with ``/usr/bin/python3`` (standard library only: it runs before any venv
exists). ``make deb`` calls it; tests/deploy/test_deb*.py too.

What the package carries is data, never a built environment: the agent's own wheel
and the dependency wheels pinned by ``packaging/requirements.lock`` (sha256 per file,
binary wheels for cp310, cp311 and cp312), in /usr/lib/gpuaas-agent/wheels. postinst runs
/usr/lib/gpuaas-agent/install-venv (packaging/install_venv.py), which builds
/opt/gpuaas-agent against the host's own ``/usr/bin/python3`` with
``pip install --no-index --no-deps --require-hashes``. So nothing in the package
links or names the build machine (the test checks with readelf and strings), and
the same bytes install on either distro.

Reproducible: every timestamp (files, wheel zip entries, the changelog) is
``SOURCE_DATE_EPOCH`` (default: the date of the newest packaging/debian/changelog
entry); owners are root; no bytecode is shipped; two builds of one tree are
byte-identical (tests/deploy/test_deb_portable.py builds twice and compares).

Dependency wheels are downloaded with ``--require-hashes`` into a cache
(``--wheel-cache``, default /var/cache/gpuaas-agent-ci/pypi-wheels) so a rebuild is
offline; the first build fills it from the configured index.
"""

from __future__ import annotations

import argparse
import email.utils
import gzip
import hashlib
import io
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
SHARE = "/usr/lib/gpuaas-agent"
LIBEXEC = "/usr/lib/gpuaas-agent"
DOC = "/usr/share/doc/gpuaas-agent"
SYSTEM_PYTHON = "/usr/bin/python3"
DEFAULT_WHEEL_CACHE = Path("/var/cache/gpuaas-agent-ci/pypi-wheels")
UNITS = ("gpuaas-agent.service", "gpuaas-slice-network-baseline.service")
# Alert rules (with their promtool tests) and the Grafana dashboard, as monitoring mixins ship (docs/alerts.md).
MONITORING = ("gpuaas-agent-alerts.yml", "gpuaas-agent-alerts.test.yml", "gpuaas-agent-dashboard.json")
MONITORING_DIR = "/usr/share/gpuaas-agent/monitoring"
# The ABIs the package ships binary wheels for (Ubuntu 22.04: 3.10, Debian 12: 3.11, Ubuntu 24.04: 3.12).
ABIS = ("3.10", "3.11", "3.12")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
PIP_TIMEOUT_S = 900
STEP_TIMEOUT_S = 600
# A version both PEP 440 and Debian read the same way: 1.2.3 or 1.2.3+local.4
VERSION_RE = re.compile(r"^\d+(\.\d+)*(\+[a-z0-9]+(\.[a-z0-9]+)*)?$")
INIT_VERSION_RE = re.compile(r'^__version__ = "([^"]+)"$', re.M)
CHANGELOG_HEAD_RE = re.compile(r"^gpuaas-agent \(([^)]+)\) ")
CHANGELOG_TRAILER_RE = re.compile(r"^ -- (.+?)  (.+)$", re.M)


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


def _copy_source(dest: Path, version: str, epoch: int) -> Path:
    """The sdist-shaped tree pip builds from; ``version`` replaces __version__ in the copy only."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "gpuaas_agent", dest / "gpuaas_agent",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    init = dest / "gpuaas_agent" / "__init__.py"
    init.write_text(INIT_VERSION_RE.sub(f'__version__ = "{version}"', init.read_text(), count=1))
    _clamp(dest, epoch)
    return dest


def _clamp(root: Path, epoch: int) -> None:
    """Every mtime is SOURCE_DATE_EPOCH: tar members and wheel zip entries carry them."""
    for dirpath, dirs, files in os.walk(root):
        for name in [*files, *dirs]:
            os.utime(Path(dirpath, name), (epoch, epoch), follow_symlinks=False)
    os.utime(root, (epoch, epoch))


def _pip_env(epoch: int) -> dict:
    return dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", SOURCE_DATE_EPOCH=str(epoch), PYTHONHASHSEED="0")


def _build_agent_wheel(src: Path, wheels: Path, epoch: int) -> Path:
    _run([SYSTEM_PYTHON, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
         timeout=PIP_TIMEOUT_S, env=_pip_env(epoch))
    (agent_wheel,) = wheels.glob("gpuaas_agent-*.whl")
    # Build-directory leftovers (egg-info) never reach the package; the wheel is all that is used.
    return agent_wheel


def _without_markers(lock: Path, dest: Path) -> Path:
    """The lock with its ``; python_version ...`` markers dropped, for ``pip download``.

    pip download evaluates a marker against the interpreter it runs on, not ``--python-version``,
    so ``tomli ; python_version < "3.11"`` would never be fetched by a 3.11 build machine. The
    package ships every locked wheel; postinst's pip evaluates the markers on the host.
    """
    lines = []
    for line in lock.read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")) and ";" in line:
            line = line.split(";", 1)[0].rstrip() + " \\"
        lines.append(line)
    dest.write_text("\n".join(lines) + "\n")
    return dest


def _download_locked(lock: Path, dest: Path, cache: Path, epoch: int) -> list[Path]:
    """The lock's wheels for every ABI, hash-checked by pip, into ``dest`` (from ``cache`` when there)."""
    cache.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    lock = _without_markers(lock, dest.parent / "download.lock")
    for abi in ABIS:
        tag = abi.replace(".", "")
        common = ["--no-deps", "--require-hashes", "--only-binary=:all:", "--implementation", "cp",
                  "--python-version", abi, "--abi", f"cp{tag}", *(f"--platform={p}" for p in PLATFORMS),
                  "-r", str(lock)]
        offline = [SYSTEM_PYTHON, "-m", "pip", "download", "-q", "--no-index", "--find-links", str(cache),
                   "-d", str(dest), *common]
        try:
            _run(offline, timeout=PIP_TIMEOUT_S, env=_pip_env(epoch))
        except BuildError:
            print(f"wheel cache incomplete for cp{tag}: filling it from the configured index", flush=True)
            _run([SYSTEM_PYTHON, "-m", "pip", "download", "-q", "-d", str(cache), *common],
                 timeout=PIP_TIMEOUT_S, env=_pip_env(epoch))
            _run(offline, timeout=PIP_TIMEOUT_S, env=_pip_env(epoch))
    return sorted(dest.glob("*.whl"))


def _changelog(version: str) -> tuple[str, int]:
    """packaging/debian/changelog, with an entry for ``version`` on top when it is not the newest one.

    Returns the text and SOURCE_DATE_EPOCH (the environment's, else the newest entry's date).
    """
    text = (PACKAGING / "debian" / "changelog").read_text()
    head = CHANGELOG_HEAD_RE.match(text)
    trailer = CHANGELOG_TRAILER_RE.search(text)
    if not head or not trailer:
        raise BuildError("packaging/debian/changelog: the first entry has no 'gpuaas-agent (VERSION)' line or trailer")
    env_epoch = os.environ.get("SOURCE_DATE_EPOCH")
    epoch = int(env_epoch) if env_epoch else int(email.utils.parsedate_to_datetime(trailer.group(2)).timestamp())
    if head.group(1) != version:
        date = email.utils.formatdate(epoch, usegmt=False).replace("-0000", "+0000")
        text = (f"gpuaas-agent ({version}) unstable; urgency=medium\n\n"
                f"  * Build of {version} from the tree of {head.group(1)}.\n\n"
                f" -- {trailer.group(1)}  {date}\n\n") + text
    return text, epoch


def _gzip_n(data: bytes, epoch: int) -> bytes:
    """gzip -9n: no name, mtime fixed (Debian policy 12.7 and reproducibility)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=epoch) as gz:
        gz.write(data)
    return buf.getvalue()


def _installed_size_kib(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        if Path(dirpath).name == "DEBIAN" and Path(dirpath).parent == root:
            continue
        for name in files:
            path = Path(dirpath, name)
            total += path.lstat().st_size
    return total // 1024 + 1


def _install(src: Path, dest: Path, mode: int) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    dest.chmod(mode)


def _lay_out(root: Path, version: str, agent_wheel: Path, wheels: list[Path], changelog: str, epoch: int) -> None:
    """Wheels and lock, the venv builder, units, default config, PATH link, docs, maintainer scripts."""
    share = root / SHARE.lstrip("/")
    for wheel in [*wheels, agent_wheel]:
        _install(wheel, share / "wheels" / wheel.name, 0o644)
    agent_hash = hashlib.sha256(agent_wheel.read_bytes()).hexdigest()
    lock = (PACKAGING / "requirements.lock").read_text()
    lock += f"# The agent itself, built with this package.\ngpuaas-agent=={version} \\\n    --hash=sha256:{agent_hash}\n"
    (share / "requirements.lock").write_text(lock)
    (share / "requirements.lock").chmod(0o644)
    _install(PACKAGING / "install_venv.py", root / LIBEXEC.lstrip("/") / "install-venv", 0o755)

    units = root / "lib" / "systemd" / "system"
    for unit in UNITS:
        _install(REPO / "systemd" / unit, units / unit, 0o644)
    _install(PACKAGING / "agent.toml", root / "etc" / "gpuaas-agent" / "agent.toml", 0o644)
    for name in MONITORING:
        _install(PACKAGING / "monitoring" / name, root / MONITORING_DIR.lstrip("/") / name, 0o644)
    bin_dir = root / "usr" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "gpuaas-agent").symlink_to(f"{PREFIX}/bin/gpuaas-agent")
    doc = root / DOC.lstrip("/")
    _install(PACKAGING / "README.md", doc / "README.md", 0o644)
    _install(REPO / "README.md", doc / "README.agent.md", 0o644)  # the agent unit's Documentation=
    _install(PACKAGING / "debian" / "copyright", doc / "copyright", 0o644)
    man = root / "usr" / "share" / "man" / "man8" / "gpuaas-agent.8.gz"
    man.parent.mkdir(parents=True)
    man.write_bytes(_gzip_n((PACKAGING / "gpuaas-agent.8").read_bytes(), epoch))
    man.chmod(0o644)
    # A native package (no Debian revision): policy 12.7 names its changelog changelog.gz.
    (doc / "changelog.gz").write_bytes(_gzip_n(changelog.encode(), epoch))
    (doc / "changelog.gz").chmod(0o644)
    overrides = root / "usr" / "share" / "lintian" / "overrides" / "gpuaas-agent"
    _install(PACKAGING / "debian" / "lintian-overrides", overrides, 0o644)

    debian = root / "DEBIAN"
    debian.mkdir()
    control = (PACKAGING / "debian" / "control.in").read_text()
    lines = []
    for line in control.splitlines():
        key = line.split(":", 1)[0]
        if key == "Version":
            line = f"Version: {version}"
        elif key == "Installed-Size":
            line = f"Installed-Size: {_installed_size_kib(root)}"
        lines.append(line)
    # control.in keeps one relation a line (merge-friendly); a binary control file wants them folded into one.
    text = re.sub(r",\n (?=\S)", ", ", "\n".join(lines) + "\n")
    (debian / "control").write_text(text)
    _install(PACKAGING / "debian" / "conffiles", debian / "conffiles", 0o644)
    _install(PACKAGING / "debian" / "triggers", debian / "triggers", 0o644)
    for script in ("postinst", "prerm", "postrm"):
        _install(PACKAGING / "debian" / script, debian / script, 0o755)
    sums = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        if Path(dirpath) == debian:
            continue
        for name in sorted(files):
            path = Path(dirpath, name)
            if path.is_symlink():
                continue
            sums.append(f"{hashlib.md5(path.read_bytes()).hexdigest()}  {path.relative_to(root)}\n")
    (debian / "md5sums").write_text("".join(sums))
    (debian / "md5sums").chmod(0o644)


def build(version: str, out_dir: Path, wheel_cache: Path) -> Path:
    if not VERSION_RE.match(version):
        raise BuildError(f"version {version!r} must look like 1.2.3 or 1.2.3+tag.4 (PEP 440 and Debian alike)")
    for tool in ("dpkg-deb",):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed")
    changelog, epoch = _changelog(version)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuaas-deb-") as tmp:
        work = Path(tmp)
        src = _copy_source(work / "src", version, epoch)
        agent_wheel = _build_agent_wheel(src, work / "agent", epoch)
        wheels = _download_locked(PACKAGING / "requirements.lock", work / "wheels", wheel_cache, epoch)
        root = work / "root"
        root.mkdir(mode=0o755)
        _lay_out(root, version, agent_wheel, wheels, changelog, epoch)
        for dirpath, dirs, _files in os.walk(root):
            for name in dirs:
                Path(dirpath, name).chmod(0o755)
        _clamp(root, epoch)
        deb = out_dir / f"gpuaas-agent_{version}_amd64.deb"
        # gzip, not xz: the payload is wheels (zip files already), so xz saved 3 % of 27 MB for 40 s of one core
        # a build (packaging/README.md); every dpkg reads gzip.
        _run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)],
             env=dict(os.environ, SOURCE_DATE_EPOCH=str(epoch)))
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
