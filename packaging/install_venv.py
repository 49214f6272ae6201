#!/usr/bin/python3
"""Build /opt/gpuaas-agent, the agent's venv, on the host that installs the package (postinst runs it).

Why at install time: a venv built on the build machine links that machine's interpreter
(``python3.11``), so the package could only install where the same minor version is.
Built here against the distro's ``/usr/bin/python3`` from the hash-pinned wheels the
package ships (/usr/lib/gpuaas-agent/wheels, one binary wheel per supported ABI), the
one ``.deb`` installs on Ubuntu 22.04 (3.10), Debian 12 (3.11) and Ubuntu 24.04 (3.12).

- ``--system-site-packages``: libvirt, systemd and ovs come from the distro
  (python3-libvirt, python3-systemd, python3-openvswitch); they link libvirt0 and
  libsystemd0 and follow the installed Open vSwitch, so they are never compiled here.
- ``pip install --no-index --no-deps --require-hashes``: nothing is resolved or
  fetched; every wheel must match the lock's sha256. pip runs from its own wheel
  (checked against the lock first) and is not installed into the venv.
- Bytecode compiled with ``--invalidation-mode checked-hash``: /opt is read-only to
  the agent (ProtectSystem=strict), and a checked .pyc is never trusted over its source.
- The previous venv is kept aside until the new one works (``--version`` runs), and
  restored when it does not: a failed upgrade leaves the old agent runnable.

Standard library only; it runs before the venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PREFIX = Path("/opt/gpuaas-agent")
SHARE = Path("/usr/lib/gpuaas-agent")
PYTHON = "/usr/bin/python3"
STAMP = ".gpuaas-python"  # the interpreter version the venv was built for (the python3 trigger compares it)
TIMEOUT_S = 600


class InstallError(RuntimeError):
    """The venv could not be built; the message names the step."""


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                               "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1",
                               "PIP_CONFIG_FILE": os.devnull, "PYTHONDONTWRITEBYTECODE": "1"})
    if done.returncode != 0:
        raise InstallError(f"{' '.join(argv[:4])} exited {done.returncode}: {done.stdout[-2000:]}")
    return done.stdout


def parse_lock(text: str) -> dict[str, tuple[str, set[str]]]:
    """``name -> (requirement, {sha256...})`` from a pip requirements file with ``--hash`` continuation lines.

    The requirement keeps its environment marker (``tomli==2.5.0 ; python_version < "3.11"``):
    pip evaluates it against this host's interpreter.
    """
    entries: dict[str, tuple[str, set[str]]] = {}
    logical = text.replace("\\\n", " ")
    for line in logical.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, _, opts = line.partition(" --")
        hashes = {o.split(":", 1)[1] for o in f"--{opts}".split() if o.startswith("--hash=sha256:")}
        requirement = " ".join(requirement.split())
        entries[requirement.split("==")[0].strip().lower().replace("_", "-")] = (requirement, hashes)
    return entries


def python_version(python: str = PYTHON) -> str:
    return _run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).strip()


def is_current(prefix: Path, share: Path, python: str = PYTHON) -> bool:
    """The venv exists, was built for this interpreter and this package's lock."""
    stamp = prefix / STAMP
    if not stamp.exists() or not (prefix / "bin" / "gpuaas-agent").exists():
        return False
    want = f"{python_version(python)} {hashlib.sha256((share / 'requirements.lock').read_bytes()).hexdigest()}\n"
    return stamp.read_text() == want


def build(prefix: Path = PREFIX, share: Path = SHARE, python: str = PYTHON) -> None:
    lock_bytes = (share / "requirements.lock").read_bytes()
    lock = parse_lock(lock_bytes.decode())
    wheels = share / "wheels"
    if "pip" not in lock:
        raise InstallError(f"{share}/requirements.lock pins no pip")
    pip_pin, pip_hashes = lock.pop("pip")
    pip_wheels = [w for w in wheels.glob("pip-*.whl") if hashlib.sha256(w.read_bytes()).hexdigest() in pip_hashes]
    if not pip_wheels:
        raise InstallError(f"no wheel in {wheels} matches the lock's hash for {pip_pin}")
    version = python_version(python)
    abi = "cp" + version.replace(".", "")
    if not any(abi in w.name for w in wheels.glob("pydantic_core-*.whl")):
        raise InstallError(f"python {version} ({abi}) has no wheels in this package; supported: "
                           + ", ".join(sorted({w.name.split('-')[2] for w in wheels.glob('pydantic_core-*.whl')})))

    old = prefix.with_name(prefix.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if prefix.exists():
        prefix.rename(old)
    try:
        _run([python, "-m", "venv", "--without-pip", "--system-site-packages", str(prefix)])
        with tempfile.NamedTemporaryFile("w", suffix=".lock", dir=prefix, delete=False) as req:
            for pin, hashes in lock.values():
                req.write(pin + "".join(f" --hash=sha256:{h}" for h in sorted(hashes)) + "\n")
        try:
            _run([str(prefix / "bin" / "python"), f"{pip_wheels[0]}/pip", "install", "--quiet", "--no-index",
                  "--no-deps", "--require-hashes", "--no-compile", "--only-binary=:all:", "--find-links",
                  str(wheels), "-r", req.name])
        finally:
            os.unlink(req.name)
        _run([str(prefix / "bin" / "python"), "-m", "compileall", "-q", "-j", "0",
              "--invalidation-mode", "checked-hash", str(prefix / "lib")])
        _run([str(prefix / "bin" / "gpuaas-agent"), "--version"])
        (prefix / STAMP).write_text(f"{version} {hashlib.sha256(lock_bytes).hexdigest()}\n")
    except BaseException:
        shutil.rmtree(prefix, ignore_errors=True)
        if old.exists():
            old.rename(prefix)
        raise
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--if-stale", action="store_true",
                        help="rebuild only when the interpreter or the lock changed (the python3 trigger)")
    args = parser.parse_args(argv)
    try:
        if args.if_stale and is_current(PREFIX, SHARE):
            return 0
        build()
    except (InstallError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"gpuaas-agent: building {PREFIX} failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
