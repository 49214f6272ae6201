"""Builds a slice VM's cloud-init NoCloud seed ISO (``cidata``) from a validated :class:`SeedSpec`.

Pure core, thin shell: :func:`render_seed_files` turns the spec into the three
YAML documents (PyYAML ``safe_dump``, never templates), :func:`build_seed_iso`
packs them into ISO 9660 + Joliet + Rock Ridge bytes with pycdlib (pure Python,
no external tool), and :func:`write_seed_iso` writes those bytes atomically and
returns a :class:`SeedIso` record. The same spec always gives the same bytes,
so a retried provision can compare digests instead of guessing.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import io
import time
from pathlib import Path
from time import struct_time
from typing import Any, cast

# pycdlib and PyYAML are imported where a seed is built, not with the module: the daemon imports
# this through the task registry, and an idle daemon never builds a seed (bench/bench_idle.py).
from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.contract.cloudinit import (
    SEED_VOLUME_LABEL,
    GuestAddressing,
    GuestDriverProfile,
    SeedFile,
    SeedIso,
    SeedSpec,
    SudoPolicy,
)
from gpuaas_agent.contract.egress import EGRESS_PROBE_TAG, EgressTarget
from gpuaas_agent.errors import HostError

# Every timestamp inside the ISO: 2000-01-01T00:00:00Z. A constant, not "now", so
# that the bytes depend on the spec only (idempotent provisioning, comparable digests).
SEED_ISO_EPOCH = 946684800
SEED_ISO_FILE_MODE = 0o100444  # Rock Ridge: regular file, r--r--r--

# name in the seed -> ISO 9660 level-3 name (upper case, no '-'); Joliet and Rock
# Ridge carry the real lower-case names, which is what the guest's kernel shows.
_ISO_NAMES = {
    "meta-data": "META_DATA.;1",
    "network-config": "NETWORK_CONFIG.;1",
    "user-data": "USER_DATA.;1",
}

_SUDO_RULES = {SudoPolicy.none: None, SudoPolicy.nopasswd_all: "ALL=(ALL) NOPASSWD:ALL"}

_APT_ENV = ["env", "DEBIAN_FRONTEND=noninteractive"]
_APT_LOCK = ["-o", "DPkg::Lock::Timeout=600"]  # first boot races unattended-upgrades for the dpkg lock

# What each guest driver profile adds to user-data (seed 004: the package set that made
# `nvidia-smi` and `ibv_devinfo -l` work in allocation 158ea147). Kernel headers and
# modules-extra must match the *running* kernel, which only the guest knows, hence the
# one constant `sh -c`; they go in before the driver so DKMS builds against them.
_DRIVER_PROFILES: dict[GuestDriverProfile, dict[str, Any]] = {
    GuestDriverProfile.nvidia_570_server_rdma: {
        "package_update": True,
        "packages": ["rdma-core", "ibverbs-utils", "infiniband-diags"],
        "runcmd": [
            [
                "sh",
                "-c",
                f"exec {' '.join(_APT_ENV)} apt-get {' '.join(_APT_LOCK)} install -y "
                '"linux-headers-$(uname -r)" "linux-modules-extra-$(uname -r)"',
            ],
            [*_APT_ENV, "apt-get", *_APT_LOCK, "install", "-y", "nvidia-driver-570-server", "nvidia-utils-570-server"],
        ],
        "power_state": {
            "mode": "reboot",
            "condition": True,
            "delay": "now",
            "message": "gpuaas: rebooting to load the guest NVIDIA and RDMA drivers",
        },
    },
}


# ---------------------------------------------------------------------------
# Pure: spec -> YAML documents
# ---------------------------------------------------------------------------


def _dump(document: dict[str, Any]) -> str:
    import yaml

    # width: never fold a long scalar (an ssh-rsa key) over lines, keep files diff-able.
    return cast(str, yaml.safe_dump(document, sort_keys=False, default_flow_style=False, allow_unicode=False, width=1 << 16))


def _user_data(spec: SeedSpec) -> dict[str, Any]:
    keys: list[str] = []
    for line in (*spec.user.ssh_authorized_keys, spec.terminal_relay_key):
        material = line.split(" ")[:2]  # the same key twice (other comment) is one key
        if all(k.split(" ")[:2] != material for k in keys):
            keys.append(line)
    user: dict[str, Any] = {"name": spec.user.name, "shell": spec.user.shell.value, "lock_passwd": True}
    if (rule := _SUDO_RULES[spec.user.sudo]) is not None:
        user["sudo"] = rule
    user["ssh_authorized_keys"] = keys
    document: dict[str, Any] = {
        "hostname": spec.hostname,
        "preserve_hostname": False,
        "manage_etc_hosts": True,
        # Only our user: no `default` entry, so the image's default account is not created.
        "users": [user],
        "disable_root": True,
        "ssh_pwauth": False,
    }
    if spec.guest_driver_profile is not None:
        document.update(copy.deepcopy(_DRIVER_PROFILES[spec.guest_driver_profile]))  # never share the table
    if spec.egress_probe is not None:
        document["runcmd"] = [egress_probe_command(spec.egress_probe), *document.get("runcmd", [])]
    return document


# The egress probe: first boot connects to the target beyond the NAT, retrying in the background
# (a NAT repaired later still lets readiness see it), with nc or bash's /dev/tcp, whichever the image has.
# Readiness reads the proof from the host's conntrack (host/network/egress_readiness.py), never from the guest.
EGRESS_PROBE_SCRIPT = (
    '( i=0; while [ "$i" -lt 120 ]; do i=$((i+1)); '
    'if command -v nc >/dev/null 2>&1 && nc -w 3 "$1" "$2" </dev/null >/dev/null 2>&1; then exit 0; fi; '
    'if command -v bash >/dev/null 2>&1 && timeout 3 bash -c \'exec 3<>/dev/tcp/$0/$1\' "$1" "$2" 2>/dev/null; '
    'then exit 0; fi; sleep 5; done ) >/dev/null 2>&1 &'
)


def egress_probe_command(target: EgressTarget) -> list[str]:
    """The runcmd entry (argv form: cloud-init execs it, no shell quoting of our values)."""
    return ["sh", "-c", EGRESS_PROBE_SCRIPT, EGRESS_PROBE_TAG, str(target.ip), str(target.port)]


def _network_config(spec: SeedSpec) -> dict[str, Any]:
    net = spec.network
    nic: dict[str, Any] = {"match": {"macaddress": net.mac}}
    if net.addressing is GuestAddressing.static:
        nic["dhcp4"] = False
        nic["addresses"] = [net.address.with_prefixlen]
        nic["routes"] = [{"to": "0.0.0.0/0", "via": str(net.gateway)}]
        nic["nameservers"] = {"addresses": [str(ip) for ip in net.nameservers]}
    else:
        nic["dhcp4"] = True
    return {"version": 2, "ethernets": {"slice0": nic}}


def render_seed_files(spec: SeedSpec) -> dict[str, bytes]:
    """The seed's files, by name: ``meta-data``, ``network-config``, ``user-data``."""
    meta = {"instance-id": str(spec.instance_id), "local-hostname": spec.hostname}
    return {
        "meta-data": _dump(meta).encode(),
        "network-config": _dump(_network_config(spec)).encode(),
        "user-data": ("#cloud-config\n" + _dump(_user_data(spec))).encode(),
    }


# ---------------------------------------------------------------------------
# Pure: files -> ISO bytes
# ---------------------------------------------------------------------------


class _PinnedClock:
    """Stands in for the ``time`` module inside pycdlib: "now" is SEED_ISO_EPOCH, in UTC.

    pycdlib stamps volume descriptors, directory records and Rock Ridge entries
    with ``time.time()`` and ``time.localtime()`` and has no parameter for it
    (clalancette/pycdlib#113). The agent is pycdlib's only user in its process and
    always wants pinned dates, so the pin is installed once and never removed:
    no window in which a concurrent build sees a real clock.
    """

    def time(self) -> float:
        return float(SEED_ISO_EPOCH)

    def localtime(self, secs: float | None = None) -> struct_time:  # time: the method, in this class
        return time.gmtime(SEED_ISO_EPOCH if secs is None else secs)  # offset 0 whatever TZ says

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _pycdlib_modules_with_clock() -> tuple[Any, ...]:
    import pycdlib.dates
    import pycdlib.headervd
    import pycdlib.pycdlib
    import pycdlib.utils

    return (pycdlib.pycdlib, pycdlib.headervd, pycdlib.dates, pycdlib.utils)


def _pin_pycdlib_clock() -> None:
    import pycdlib

    for module in _pycdlib_modules_with_clock():
        current = getattr(module, "time", None)
        if isinstance(current, _PinnedClock):
            continue
        if current is not time:  # pycdlib changed how it reads the clock: fail, don't go non-deterministic
            raise HostError(
                f"cannot pin the clock of {module.__name__}: pycdlib changed its internals",
                code="seed_iso_build_failed",
                evidence={"module": module.__name__, "pycdlib": getattr(pycdlib, "__version__", "unknown")},
            )
        module.time = _PinnedClock()


def build_seed_iso(files: dict[str, bytes]) -> bytes:
    """ISO 9660 (level 3) + Joliet + Rock Ridge image with volume label ``cidata``."""
    import pycdlib

    _pin_pycdlib_clock()
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, vol_ident=SEED_VOLUME_LABEL, joliet=3, rock_ridge="1.09")
    try:
        for name in sorted(files):
            data = files[name]
            iso.add_fp(
                io.BytesIO(data),
                len(data),
                iso_path="/" + _ISO_NAMES[name],
                rr_name=name,
                joliet_path="/" + name,
                file_mode=SEED_ISO_FILE_MODE,
            )
        out = io.BytesIO()
        iso.write_fp(out)
    finally:
        iso.close()
    return out.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _build_and_write(spec: SeedSpec, dest: Path) -> SeedIso:
    files = render_seed_files(spec)
    image = build_seed_iso(files)
    try:
        write_atomic(dest, image, mode=0o644)  # qemu reads it; it holds public keys only
    except OSError as exc:
        raise HostError(
            f"cannot write seed ISO {dest}: {exc.strerror or exc}",
            code="seed_iso_write_failed",
            evidence={"path": str(dest), "errno": exc.errno},
        ) from exc
    return SeedIso(
        path=str(dest),
        size=len(image),
        sha256=_sha256(image),
        # the ignore: the names are the seed's own three (meta-data, user-data, network-config); the model checks them
        files=tuple(SeedFile(name=name, size=len(data), sha256=_sha256(data))  # type: ignore[arg-type]
                    for name, data in sorted(files.items())),
    )


async def write_seed_iso(spec: SeedSpec, dest: Path) -> SeedIso:
    """Build the seed ISO for ``spec`` and put it at ``dest`` atomically.

    ``spec`` is validated again first (a ``model_construct``-ed spec is not
    trusted), so nothing is written for an input that does not validate.
    Building and writing happen in a worker thread (pycdlib and fsync block).
    """
    spec = SeedSpec.model_validate(spec.model_dump())
    dest = Path(dest)
    if not dest.is_absolute():
        raise HostError(
            f"seed ISO path must be absolute: {dest}", code="seed_iso_write_failed", evidence={"path": str(dest)}
        )
    return await asyncio.to_thread(_build_and_write, spec, dest)
