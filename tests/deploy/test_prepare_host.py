"""`gpuaas-agent prepare-host`: what a provision needs exists after it, from the config's paths; bad input writes nothing.

Real files, real ``ssh-keygen``, a real read-only bind mount for the sandbox check.
Every refusal is checked to be one line on stderr, exit 1, and the tree unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO


def _cli(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuaas_agent", "prepare-host", "--config", str(config), *extra],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: type, mode, owner and content (files), to prove nothing changed."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            st = path.lstat()
            data = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, data)
    return out


@pytest.fixture
def site() -> Iterator[dict]:
    """A host layout under a root others can search (pytest's tmp is 0700); ``write(**slice_changes)`` writes its config."""
    tmp_path = Path(tempfile.mkdtemp(prefix="gpuaas-prepare-", dir="/var/tmp"))
    tmp_path.chmod(0o755)
    root = tmp_path / "host"
    root.mkdir(mode=0o755)
    paths = {
        "state_dir": root / "var/lib/gpuaas-agent",
        "seed_dir": root / "var/lib/libvirt/images/gpuaas-seeds",
        "dnsmasq_hosts_file": root / "var/lib/gpuaas-dnsmasq/hosts",
        "terminal_relay_key_file": root / "var/lib/gpuaas/terminal/id_ed25519.pub",
        "console_log_dir": root / "var/log/gpuaas-agent/console",
    }

    def write(**changes) -> Path:
        config = {"state_dir": str(changes.pop("state_dir", paths["state_dir"])),
                  "slice": {k: str(v) for k, v in paths.items() if k != "state_dir"}}
        config["slice"].update({k: str(v) for k, v in changes.items()})
        path = tmp_path / "agent.json"
        path.write_text(json.dumps(config))
        return path

    try:
        yield {"root": root, "paths": paths, "write": write, "tmp": tmp_path}
    finally:
        shutil.rmtree(tmp_path)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_prepare_host_creates_every_directory_and_the_relay_key_with_their_modes(site):
    p = site["paths"]
    done = _cli(site["write"]())
    assert done.returncode == 0, done.stderr
    assert _mode(p["state_dir"]) == 0o700 and _mode(p["state_dir"] / "images") == 0o700
    assert _mode(p["console_log_dir"]) == 0o700  # tenants' consoles: root only
    assert _mode(p["seed_dir"]) == 0o711  # QEMU (libvirt-qemu/qemu) may search it, not list it
    assert _mode(p["dnsmasq_hosts_file"].parent) == 0o755
    key_dir = p["terminal_relay_key_file"].parent
    assert _mode(key_dir) == 0o700 and _mode(key_dir.parent) == 0o755
    private = key_dir / "id_ed25519"
    assert _mode(private) == 0o600 and private.stat().st_uid == 0 and _mode(p["terminal_relay_key_file"]) == 0o644
    # ssh-keygen itself agrees it is an ed25519 key and that the .pub belongs to it.
    listed = subprocess.run(["ssh-keygen", "-l", "-f", str(private)], capture_output=True, text=True, check=True).stdout
    assert listed.endswith("(ED25519)\n")
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(private)], capture_output=True, text=True, check=True).stdout
    assert derived.split()[:2] == p["terminal_relay_key_file"].read_text().split()[:2]
    fingerprint = listed.split()[1]
    assert f"item=terminal_relay_key path={p['terminal_relay_key_file']} outcome=generated type=ssh-ed25519 " \
           f"fingerprint={fingerprint}" in done.stdout
    assert f"item=seed_dir path={p['seed_dir']} outcome=created mode=0711" in done.stdout


def test_a_second_run_changes_nothing_and_check_passes(site):
    config = site["write"]()
    assert _cli(config).returncode == 0
    before = _snapshot(site["root"])
    again = _cli(config)
    assert again.returncode == 0 and "outcome=generated" not in again.stdout and "outcome=created" not in again.stdout
    assert _snapshot(site["root"]) == before
    check = _cli(config, "--check")
    assert check.returncode == 0, check.stderr
    assert check.stdout.count("outcome=ok") == 7
    assert _snapshot(site["root"]) == before


def test_an_existing_key_is_kept_and_a_missing_pub_is_derived_from_it(site):
    pub = site["paths"]["terminal_relay_key_file"]
    pub.parent.mkdir(parents=True, mode=0o700)
    private = pub.with_suffix("")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "site-key", "-f", str(private)], check=True)
    pub.unlink()
    key_bytes = private.read_bytes()
    done = _cli(site["write"]())
    assert done.returncode == 0, done.stderr
    assert "outcome=public_written" in done.stdout
    assert private.read_bytes() == key_bytes and _mode(private) == 0o600
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(private)], capture_output=True, text=True, check=True).stdout
    assert pub.read_text() == derived.strip() + "\n" and pub.read_text().endswith(" site-key\n")


def test_the_state_dir_is_tightened_to_0700_and_other_existing_dirs_keep_their_mode(site):
    p = site["paths"]
    p["state_dir"].mkdir(parents=True, mode=0o755)
    p["state_dir"].chmod(0o755)
    p["seed_dir"].mkdir(parents=True)
    p["seed_dir"].chmod(0o755)
    done = _cli(site["write"]())
    assert done.returncode == 0, done.stderr
    assert _mode(p["state_dir"]) == 0o700 and "item=state_dir" in done.stdout and "outcome=mode_fixed" in done.stdout
    assert _mode(p["seed_dir"]) == 0o755


def _refused(site, config: Path, code: str, *extra: str) -> str:
    before = _snapshot(site["tmp"])
    done = _cli(config, *extra)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"gpuaas-agent: error: {code}: "), done.stderr
    assert _snapshot(site["tmp"]) == before, "a refused prepare-host wrote something"
    assert done.stdout == ""
    return done.stderr


@pytest.mark.parametrize("key,bad", [
    ("seed_dir", "/proc/gpuaas-seeds"),
    ("seed_dir", "/sys/kernel/gpuaas"),
    ("dnsmasq_hosts_file", "/dev/shm/gpuaas/hosts"),
    ("state_dir", "/proc/self/cwd"),
    ("seed_dir", "relative/seeds"),
    ("seed_dir", "/var/lib/../../proc/x"),
    ("terminal_relay_key_file", "/id_ed25519.pub"),
])
def test_a_path_the_package_does_not_manage_is_refused_and_nothing_is_written(site, key, bad):
    message = _refused(site, site["write"](**{key: bad}), "host_path_refused")
    assert key in message


def test_a_symlink_into_proc_is_refused(site):
    link = site["tmp"] / "sneaky"
    link.symlink_to("/proc/self")
    message = _refused(site, site["write"](seed_dir=link / "seeds"), "host_path_refused")
    assert "seed_dir" in message


def test_an_ancestor_qemu_cannot_search_is_named(site):
    """Seed 004: /var/lib/libvirt was 0700 and QEMU could not open its files."""
    libvirt = site["root"] / "var/lib/libvirt"
    libvirt.mkdir(parents=True)
    libvirt.chmod(0o700)
    message = _refused(site, site["write"](), "host_path_unreachable")
    assert f"{libvirt} is mode 0700" in message


def test_a_file_where_a_directory_belongs_is_refused(site):
    seeds = site["paths"]["seed_dir"]
    seeds.parent.mkdir(parents=True)
    seeds.write_text("not a dir\n")
    _refused(site, site["write"](), "host_path_not_directory")


def _key_dir(site) -> Path:
    pub = site["paths"]["terminal_relay_key_file"]
    pub.parent.mkdir(parents=True, mode=0o700)
    return pub.parent


def _keygen(path: Path, *args: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-N", "", "-f", str(path), *args], check=True, capture_output=True)


def _private_file(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def test_a_relay_key_with_wrong_permissions_is_refused_untouched(site):
    d = _key_dir(site)
    _keygen(d / "id_ed25519", "-t", "ed25519")
    (d / "id_ed25519").chmod(0o640)
    message = _refused(site, site["write"](), "relay_key_insecure")
    assert "mode 0640" in message and _mode(d / "id_ed25519") == 0o640


@pytest.mark.parametrize("make,code,named", [
    (lambda d: (d / "id_ed25519").mkdir(), "relay_key_unreadable", "not a regular file"),
    (lambda d: _private_file(d / "id_ed25519", b"garbage\n"), "relay_key_invalid", "not a usable ed25519 key"),
    (lambda d: _keygen(d / "id_ed25519", "-t", "ecdsa"), "relay_key_invalid", "ecdsa-sha2-nistp256 key"),
    (lambda d: subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(d / "id_ed25519")],
                              check=True), "relay_key_invalid", "passphrase-protected"),
    (lambda d: (d / "id_ed25519").symlink_to("/etc/hostname"), "relay_key_insecure", "symlink"),
    (lambda d: _keygen(d / "other", "-t", "ed25519") or (d / "other.pub").rename(d / "id_ed25519.pub"),
     "relay_key_incomplete", "without its private key"),
    (lambda d: _keygen(d / "id_ed25519", "-t", "ed25519") or _keygen(d / "other", "-t", "ed25519")
     or (d / "other.pub").replace(d / "id_ed25519.pub"), "relay_key_mismatch", "does not match"),
])
def test_an_unusable_relay_key_is_refused_untouched(site, make, code, named):
    make(_key_dir(site))
    message = _refused(site, site["write"](), code)
    assert named in message


def test_a_relay_key_file_that_is_not_a_pub_is_refused(site):
    message = _refused(site, site["write"](terminal_relay_key_file=site["root"] / "keys/id_ed25519"),
                       "relay_key_path_invalid")
    assert ".pub" in message


def test_check_names_what_is_missing_without_creating_it(site):
    _refused(site, site["write"](), "host_path_missing", "--check")


def test_check_names_a_directory_the_sandbox_keeps_read_only(site):
    """The unit's ProtectSystem=strict makes a path outside ReadWritePaths= read-only; --check says so."""
    config = site["write"]()
    assert _cli(config).returncode == 0
    seeds = site["paths"]["seed_dir"]
    subprocess.run(["mount", "--bind", str(seeds), str(seeds)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(seeds)], check=True)
        message = _refused(site, config, "host_path_read_only", "--check")
        assert "seed_dir" in message and "ReadWritePaths=" in message
    finally:
        subprocess.run(["umount", str(seeds)], check=True)
