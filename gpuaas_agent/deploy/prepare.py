"""``gpuaas-agent prepare-host``: every directory and key a provision needs, from the config, before the first task.

docs/safety.md §11: a host made by the ``.deb`` and the cloud-init user-data
provisions on the first try. The paths come from the agent's config (the
``[slice]`` keys and ``state_dir``), never from a list baked into the package,
so a site that moves one still gets it created. The package's ``postinst``
runs this with the installed config; the unit runs it again as
``ExecStartPre=+`` (outside the sandbox) so a config edited later is honoured,
then ``prepare-host --check`` inside the sandbox proves the agent can write
what it must (a path outside the unit's ``ReadWritePaths=`` is named there,
not at the first provision).

Two phases: every path is checked first (absolute, not under /dev, /proc or
/sys, a directory when it exists, reachable by the users that must read it,
the relay key usable), and only then is anything created, so bad input
changes nothing. Existing directories keep their owner and mode, except the
state dir, which holds credentials and is always made 0700 (as the package
always did). Existing keys are never touched (``relaykey.py``).

Who reads what (why the modes):

- ``state_dir`` (0700 root): SQLite state, enrollment credentials, bootstrap token.
- ``image_cache_dir`` (0700 root): verified images; only the agent's own
  ``qemu-img`` reads them (the clone goes to the slot's raw disk, which libvirt
  hands to QEMU).
- ``seed_dir`` (0711 root): QEMU opens each slice's seed ISO (written 0644,
  public keys and hostnames only). QEMU runs as ``libvirt-qemu`` on
  Debian/Ubuntu and ``qemu`` on Fedora/RHEL; with ``dynamic_ownership`` libvirt
  relabels the ISO *file* for the domain, never its directories, so that user
  needs search (x) permission on the directory and on every ancestor, and no
  more: 0711 lets it open a known name without listing other allocations' seeds
  (the same mode Debian gives ``/var/lib/libvirt/images``). Under AppArmor the
  default ``/var/lib/libvirt/images/gpuaas-seeds`` is inside what
  ``virt-aa-helper`` already grants a domain's disks. Seed 004 had
  ``/var/lib/libvirt`` at 0700 and the guest could not start: an ancestor
  without search permission for others is refused here, by name.
- the dnsmasq hosts file's directory (0755 root): dnsmasq re-reads the file
  (0644) after dropping to its own user.
- the relay key's directory (0700 root): the private key is root's; the agent
  reads the ``.pub`` as root.
- ``console_log_dir`` (0700 root): the slices' serial consoles, written by
  virtlogd (root); a tenant's boot output may hold secrets.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuaas_agent.config import AgentConfig
from gpuaas_agent.deploy import relaykey, sysfswrites
from gpuaas_agent.errors import AgentError
from gpuaas_agent.hostfs import HostRoot

# Kernel and device filesystems: a config naming a path there is a mistake (or an attack), never a directory to make.
FORBIDDEN_ROOTS = (Path("/dev"), Path("/proc"), Path("/sys"))
ANCESTOR_MODE = 0o755  # missing parents (e.g. /var/lib/gpuaas): traversable, like the rest of /var/lib


class PrepareError(AgentError):
    """A path the config names cannot be prepared; nothing was written."""

    default_code = "host_path_refused"


@dataclass(frozen=True)
class DirSpec:
    item: str          # the config key the path comes from
    path: Path
    mode: int
    others_reach: bool  # a non-root user (QEMU, dnsmasq) must traverse every ancestor
    agent_writes: bool  # the agent writes here at run time (checked writable in --check)
    force_mode: bool = False  # made ``mode`` even when it exists (the state dir holds credentials)


def host_dirs(config: AgentConfig) -> list[DirSpec]:
    s = config.slice
    return [
        DirSpec("state_dir", config.state_dir, 0o700, others_reach=False, agent_writes=True, force_mode=True),
        DirSpec("image_cache_dir", config.image_cache_dir, 0o700, others_reach=False, agent_writes=True),
        DirSpec("seed_dir", s.seed_dir, 0o711, others_reach=True, agent_writes=True),
        DirSpec("dnsmasq_hosts_file", s.dnsmasq_hosts_file.parent, 0o755, others_reach=True, agent_writes=True),
        DirSpec("terminal_relay_key_file", s.terminal_relay_key_file.parent, 0o700, others_reach=False,
                agent_writes=False),
        # virtlogd (root) writes the slices' consoles; the agent reads, trims and deletes them.
        DirSpec("console_log_dir", s.console_log_dir, 0o700, others_reach=False, agent_writes=True),
    ]


def _line(item: str, path: Path, outcome: str, **extra: str) -> str:
    tail = "".join(f" {k}={v}" for k, v in extra.items())
    return f"GPUAAS_PREPARE_HOST item={item} path={path} outcome={outcome}{tail}"


def _check_shape(spec: DirSpec) -> None:
    """Absolute, no ``..``, not a kernel filesystem (also after following links), a directory if it exists."""
    path, ev = spec.path, {"item": spec.item, "path": str(spec.path)}
    if not path.is_absolute() or ".." in path.parts:
        raise PrepareError(f"{spec.item} {path} must be an absolute path without '..'", evidence=ev)
    resolved = path.resolve()
    for candidate in (path, resolved):
        if candidate == Path("/") or any(candidate == r or r in candidate.parents for r in FORBIDDEN_ROOTS):
            raise PrepareError(f"{spec.item} {path} is not a directory the agent manages (under /, /dev, /proc or /sys)",
                               evidence={**ev, "resolved": str(resolved)})
    if os.path.lexists(path) and not path.is_dir():
        raise PrepareError(f"{spec.item} {path} exists and is not a directory", code="host_path_not_directory",
                           evidence=ev)


def _check_reach(spec: DirSpec) -> None:
    """Every existing directory down to the path lets others search it (QEMU, dnsmasq are not root)."""
    if not spec.others_reach:
        return
    resolved = spec.path.resolve()
    for directory in [*reversed(resolved.parents), resolved]:
        try:
            st = directory.stat()
        except FileNotFoundError:
            break  # created below with search permission for others
        if not st.st_mode & stat.S_IXOTH:
            raise PrepareError(
                f"{spec.item} {spec.path} cannot be reached by QEMU/dnsmasq: {directory} is mode "
                f"{stat.S_IMODE(st.st_mode):04o} (others need search permission, o+x)", code="host_path_unreachable",
                evidence={"item": spec.item, "path": str(spec.path), "blocking": str(directory),
                          "mode": f"{stat.S_IMODE(st.st_mode):04o}"})


def _check_not_writable_by_others(spec: DirSpec) -> None:
    """A directory the agent trusts (key, state, seeds) that anyone could write into is refused, not used."""
    try:
        st = spec.path.stat()
    except FileNotFoundError:
        return
    if st.st_mode & 0o022 and not spec.force_mode:
        raise PrepareError(f"{spec.item} {spec.path} is mode {stat.S_IMODE(st.st_mode):04o}: writable by group or others",
                           code="host_path_insecure",
                           evidence={"item": spec.item, "path": str(spec.path), "mode": f"{stat.S_IMODE(st.st_mode):04o}"})


def _check_conflicts(specs: list[DirSpec]) -> None:
    seen: dict[Path, DirSpec] = {}
    for spec in specs:
        other = seen.setdefault(spec.path, spec)
        if other is not spec and other.mode != spec.mode:
            raise PrepareError(f"{spec.item} and {other.item} name the same directory {spec.path} but need modes "
                               f"{spec.mode:04o} and {other.mode:04o}", code="host_path_conflict",
                               evidence={"path": str(spec.path), "items": [other.item, spec.item]})


def _make_dir(spec: DirSpec) -> str:
    if spec.path.is_dir():
        mode = stat.S_IMODE(spec.path.stat().st_mode)
        if spec.force_mode and mode != spec.mode:
            os.chmod(spec.path, spec.mode)
            return "mode_fixed"
        return "unchanged"
    missing = [p for p in [*reversed(spec.path.parents), spec.path] if not p.exists()]
    for directory in missing:
        mode = spec.mode if directory == spec.path else ANCESTOR_MODE
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # made meanwhile (another prepare-host): checked below like any existing one
        os.chmod(directory, mode)  # mkdir's mode is filtered by the umask (the unit's is 0077)
    return "created"


async def prepare_host(config: AgentConfig, *, check_only: bool = False, sysfs_dropin: Path | None = None) -> list[str]:
    """Create (or with ``check_only`` only verify) what a provision needs; one line per item.

    ``sysfs_dropin``: also write the unit drop-in that opens the sysfs files the agent writes
    (deploy/sysfswrites.py); with ``check_only``, report each of those files' writability here
    instead (a line per file, never fatal: a device added since the drop-in was loaded costs
    its slot, which preflight's ``sysfs_writable`` refuses, not the whole node).

    Raises :class:`PrepareError` or :class:`relaykey.RelayKeyError` before writing anything.
    """
    specs = host_dirs(config)
    for spec in specs:
        _check_shape(spec)
    _check_conflicts(specs)
    for spec in specs:
        _check_reach(spec)
        _check_not_writable_by_others(spec)
    key_file = config.slice.terminal_relay_key_file
    found = relaykey.inspect(key_file)  # refuses a key it must not use before anything is created
    sysfs, refused = _sysfs_write_set(config) if sysfs_dropin is not None else (None, [])
    if check_only:
        return _verify(specs, found, key_file) + (sysfswrites.check_lines(sysfs, refused) if sysfs is not None else [])

    lines, done = [], set()
    for spec in specs:
        if spec.path in done:
            continue
        done.add(spec.path)
        try:
            outcome = _make_dir(spec)
        except OSError as exc:
            raise PrepareError(f"cannot create {spec.item} {spec.path}: {exc.strerror}", code="host_path_write_failed",
                               evidence={"item": spec.item, "path": str(spec.path), "errno": exc.errno}) from None
        lines.append(_line(spec.item, spec.path, outcome, mode=f"{stat.S_IMODE(spec.path.stat().st_mode):04o}"))
    outcome, key = await relaykey.ensure(key_file)
    lines.append(_line("terminal_relay_key", key_file, outcome, type=relaykey.KEY_TYPE, fingerprint=key.fingerprint))
    if sysfs_dropin is not None and sysfs is not None:
        text = sysfswrites.render_dropin(sysfs, host_root=str(config.host_root), refused=refused)
        try:
            outcome = sysfswrites.write_dropin(sysfs_dropin, text)
        except OSError as exc:
            raise PrepareError(f"cannot write the sysfs drop-in {sysfs_dropin}: {exc.strerror}",
                               code="host_path_write_failed",
                               evidence={"item": "sysfs_dropin", "path": str(sysfs_dropin), "errno": exc.errno}) from None
        lines.append(_line("sysfs_dropin", sysfs_dropin, outcome, paths=str(len(sysfs)),
                           refused=",".join(r.item for r in refused) or "none"))
    return lines


def _sysfs_write_set(config: AgentConfig) -> tuple[list[sysfswrites.WritablePath], list[sysfswrites.RefusedPath]]:
    try:
        return sysfswrites.host_write_plan(HostRoot.open(config.host_root))
    except OSError as exc:
        raise PrepareError(f"cannot read the PCI devices under {config.host_root}: {exc.strerror or exc}",
                           code="host_path_refused", evidence={"host_root": str(config.host_root)}) from None


def _verify(specs: list[DirSpec], found: relaykey.Inspection, key_file: Path) -> list[str]:
    """``--check``: everything exists, and what the agent writes is writable from where this runs (the unit's sandbox)."""
    lines = []
    for spec in specs:
        ev = {"item": spec.item, "path": str(spec.path)}
        if not spec.path.is_dir():
            raise PrepareError(f"{spec.item} {spec.path} does not exist: run gpuaas-agent prepare-host",
                               code="host_path_missing", evidence=ev)
        mode = stat.S_IMODE(spec.path.stat().st_mode)
        if spec.force_mode and mode != spec.mode:
            raise PrepareError(f"{spec.item} {spec.path} is mode {mode:04o}, not {spec.mode:04o}: run gpuaas-agent "
                               "prepare-host", code="host_path_mode", evidence={**ev, "mode": f"{mode:04o}"})
        if spec.agent_writes and not os.access(spec.path, os.W_OK):
            raise PrepareError(f"{spec.item} {spec.path} is not writable here (read-only under the unit's "
                               "ProtectSystem=strict? add it to ReadWritePaths= in a drop-in of gpuaas-agent.service)",
                               code="host_path_read_only", evidence=ev)
        lines.append(_line(spec.item, spec.path, "ok", mode=f"{mode:04o}"))
    if found.key is None or not found.public_ok:
        raise PrepareError(f"terminal relay key {key_file} is missing: run gpuaas-agent prepare-host",
                           code="relay_key_missing", evidence={"path": str(key_file)})
    lines.append(_line("terminal_relay_key", key_file, "ok", type=relaykey.KEY_TYPE, fingerprint=found.key.fingerprint))
    return lines
