"""Every precondition of a provision's later steps, proven before the slot disk is touched (docs/safety.md §8).

A host problem found at ``start`` comes after ``clone`` has written the slot
disk: the slot can then only go ``cleanup_blocked`` until a release wipes it,
although nothing was wrong with the slot. So the validate step proves, with
the host as it is now, what bind, clone, seed, port, reservation, define and
start will need:

========================  =======================  ==================================================
step                      precondition             refusal codes
========================  =======================  ==================================================
start                     ``/dev/kvm`` usable      ``kvm_missing``, ``kvm_unusable`` (kvm profiles)
start                     1 GiB pages on the node  ``hugepages_unknown``, ``hugepages_insufficient``
bind_vfio                 IOMMU group viable       the vfio guard's codes (``iommu_group_not_isolated`` ...)
release's gpu_handover    GPU admin tool, a reset  ``gpu_handover_tool_missing``, ``gpu_reset_path_missing``,
                          path for GPU and VF      ``gpu_memory_clear_unprovable`` (guards/gpureset.py)
image                     cache space              ``cache_space_insufficient`` (size known)
seed                      seed dir                 ``seed_dir_missing``, ``seed_dir_not_writable``,
                                                   ``seed_dir_unreadable_by_qemu``
seed                      terminal relay key       ``relay_key_missing``, ``relay_key_invalid``,
                                                   ``relay_key_permissions``
define                    OVMF pair                ``ovmf_missing``
ovs_port                  bridge + gateway         ``ovs_bridge_missing``, ``bridge_gateway_missing``
reservation / readiness   dnsmasq reads our file   ``dnsmasq_not_running``, ``dnsmasq_not_reading_hosts``,
                                                   ``dnsmasq_pid_file_mismatch``, ``dnsmasq_unproven``
========================  =======================  ==================================================

The KVM and hugepage checks are the ones ``guards/vmstart.py`` repeats right
before ``start`` (pages can be taken by another slice in between); the seed
dir, KVM, OVMF and dnsmasq readers are the ones parity uses: one check each,
wherever it is asked. Pure reads; blocking (sysfs, /proc, netlink): call
:func:`check_provision_preconditions` through ``asyncio.to_thread``.
"""

from __future__ import annotations

import base64
import binascii
import os
import posixpath
import shutil
import stat
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.domain import OvmfFirmware
from gpuaas_agent.contract.gpuhandover import GpuHandoverReadiness
from gpuaas_agent.contract.parity import DnsmasqEvidence
from gpuaas_agent.contract.runtime import HUGEPAGE_1G_MIB, DomainType, RuntimeProfile
from gpuaas_agent.contract.vfio import VfioGuardEvidence
from gpuaas_agent.discovery.netevidence import NetTarget, judge_dnsmasq, read_bridge_addresses, read_dnsmasq_evidence
from gpuaas_agent.discovery.numa import HUGEPAGES_1G_DIR, free_hugepages_1g
from gpuaas_agent.discovery.ovmf import OvmfNotFoundError, find_ovmf
from gpuaas_agent.errors import GuardError
from gpuaas_agent.guards.gpureset import GpuHandoverRefused, check_gpu_handover_ready
from gpuaas_agent.guards.vfio import VfioGuardError, check_vfio_bindable
from gpuaas_agent.hostfs import HostRoot

if TYPE_CHECKING:
    from gpuaas_agent.config import SliceConfig

KVM_DEVICE = "/dev/kvm"
QEMU_CONF = "/etc/libvirt/qemu.conf"
# libvirt's default QEMU user: Debian/Ubuntu build it as libvirt-qemu, Fedora/RHEL/SUSE as qemu.
QEMU_USERS = ("libvirt-qemu", "qemu")
PASSWD, GROUP = "/etc/passwd", "/etc/group"
ED25519 = "ssh-ed25519"

# Evidence that the slot's OVS bridge exists: a boolean already proven, or a check to call with the bridge name
# (e.g. the OVS driver's ``bridge_exists``), so the guard does not depend on how OVS is reached.
BridgeCheck = bool | Callable[[str], bool]


class PreconditionRefused(GuardError):
    """A provision was refused in validate: a later step could not succeed on this host; nothing was changed."""

    default_code = "provision_precondition_failed"


def _refuse(refusal: type[GuardError], code: str, message: str, /, **evidence: Any) -> GuardError:
    return refusal(message, code=code, evidence=evidence)


# -- shared with guards/vmstart.py and discovery/prereqs.py (parity) ----------------------------------


def check_kvm(host: HostRoot, refusal: type[GuardError] = PreconditionRefused) -> str:
    """``/dev/kvm`` is a character device this process can open read-write (on the live host); ``"usable"``."""
    if not host.exists(KVM_DEVICE):
        raise _refuse(refusal, "kvm_missing", f"{KVM_DEVICE} does not exist (KVM module not loaded or virtualisation off)",
                      path=KVM_DEVICE, root=str(host.root))
    real = str(host.real(host.resolve(KVM_DEVICE)))
    mode = os.stat(real).st_mode
    # A recording cannot keep device nodes in git: there a regular placeholder file stands for one.
    acceptable = stat.S_ISCHR(mode) or (not host.is_live and stat.S_ISREG(mode))
    if not acceptable:
        raise _refuse(refusal, "kvm_unusable", f"{KVM_DEVICE} is not a character device", path=KVM_DEVICE,
                      mode=oct(mode), root=str(host.root))
    # On the live host it must also be openable by this process (it is root-only on CI machines).
    if host.is_live and not os.access(real, os.R_OK | os.W_OK):
        raise _refuse(refusal, "kvm_unusable", f"{KVM_DEVICE} is not readable and writable by uid {os.getuid()}",
                      path=KVM_DEVICE, mode=oct(mode), uid=os.getuid())
    return "usable"


def hugepages_needed(profile: RuntimeProfile) -> int:
    """1 GiB pages one domain of ``profile`` takes (0 when it does not ask for hugepages)."""
    return -(-profile.memory_mib // HUGEPAGE_1G_MIB) if profile.hugepages_1g else 0


def check_hugepages(host: HostRoot, profile: RuntimeProfile, numa_node: int | None,
                    refusal: type[GuardError] = PreconditionRefused, /, **base: Any) -> tuple[int, int | None]:
    """(needed, free) 1 GiB pages on the slot's node; refused when the profile needs more than are free.

    Per node, never summed: the domain's memory is bound to the GPU's node (numatune strict).
    """
    needed = hugepages_needed(profile)
    if not profile.hugepages_1g:
        return 0, None
    if numa_node is None:
        raise _refuse(refusal, "hugepages_unknown",
                      "hugepages are required but the slot has no NUMA node to take them from", **base, needed=needed)
    path = f"{HUGEPAGES_1G_DIR.format(node=numa_node)}/free_hugepages"
    free = free_hugepages_1g(host, numa_node)
    if free is None:
        raise _refuse(refusal, "hugepages_unknown", f"NUMA node {numa_node} has no 1 GiB hugepage pool", **base,
                      numa_node=numa_node, path=path, needed=needed)
    if free < needed:
        raise _refuse(refusal, "hugepages_insufficient",
                      f"NUMA node {numa_node} has {free} free 1 GiB hugepages; profile {profile.name} needs {needed}",
                      **base, numa_node=numa_node, path=path, free=free, needed=needed)
    return needed, free


class QemuUser(WireModel):
    """Who QEMU runs as under libvirt, and where that was read."""

    name: str
    uid: int
    gid: int
    groups: list[int] = Field(description="primary and supplementary gids")
    source: str = Field(description="qemu.conf user= or the distribution default found in the passwd db")


def _passwd(host: HostRoot) -> dict[str, tuple[int, int]]:
    users: dict[str, tuple[int, int]] = {}
    try:
        text = host.read_text(PASSWD)
    except OSError:
        return users
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[2].isdigit() and parts[3].isdigit():
            users.setdefault(parts[0], (int(parts[2]), int(parts[3])))
    return users


def _groups_of(host: HostRoot, name: str) -> tuple[dict[str, int], list[int]]:
    by_name: dict[str, int] = {}
    member_of: list[int] = []
    try:
        text = host.read_text(GROUP)
    except OSError:
        return by_name, member_of
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[2].isdigit():
            by_name.setdefault(parts[0], int(parts[2]))
            if name in parts[3].split(","):
                member_of.append(int(parts[2]))
    return by_name, member_of


def _qemu_conf(host: HostRoot) -> dict[str, str]:
    """``user``/``group`` set (uncommented) in libvirt's qemu.conf; values unquoted."""
    out: dict[str, str] = {}
    try:
        text = host.read_text(QEMU_CONF)
    except OSError:
        return out
    for line in text.splitlines():
        key, sep, value = line.split("#", 1)[0].partition("=")
        if sep and key.strip() in ("user", "group", "dynamic_ownership"):
            out[key.strip()] = value.strip().strip('"').strip("'")
    return out


def qemu_user(system: HostRoot, refusal: type[GuardError] = PreconditionRefused) -> QemuUser:
    """QEMU's user: qemu.conf ``user =`` when set, else the first of ``libvirt-qemu``, ``qemu`` in the passwd db.

    ``+N`` in qemu.conf is a numeric uid (libvirt's syntax). Refused (``qemu_user_unknown``) when none is found.
    """
    conf = _qemu_conf(system)
    users = _passwd(system)
    wanted = conf.get("user")
    candidates = [wanted] if wanted else list(QEMU_USERS)
    for name in candidates:
        if name.startswith("+") and name[1:].isdigit():
            uid = int(name[1:])
            entry = next(((n, ids) for n, ids in users.items() if ids[0] == uid), (name, (uid, uid)))
            name, (uid, gid) = entry[0], entry[1]
        elif name in users:
            uid, gid = users[name]
        else:
            continue
        group_ids, member_of = _groups_of(system, name)
        group = conf.get("group")
        if group:
            gid = int(group[1:]) if group.startswith("+") and group[1:].isdigit() else group_ids.get(group, gid)
        source = f"{QEMU_CONF} user={wanted}" if wanted else f"default {name} in {PASSWD}"
        return QemuUser(name=name, uid=uid, gid=gid, groups=sorted({gid, *member_of}), source=source)
    raise _refuse(refusal, "qemu_user_unknown",
                  f"cannot tell which user QEMU runs as: {'qemu.conf user=' + wanted if wanted else 'none of ' + ', '.join(QEMU_USERS)}"
                  f" is in {PASSWD}", qemu_conf=conf, passwd=PASSWD, root=str(system.root))


def _may(st: os.stat_result, user: QemuUser, bits: int) -> bool:
    """Whether ``user`` has ``bits`` (4 r, 2 w, 1 x) on an entry, by its mode and owner (no ACLs)."""
    if st.st_uid == user.uid:
        return (st.st_mode >> 6) & bits == bits
    if st.st_gid in user.groups:
        return (st.st_mode >> 3) & bits == bits
    return st.st_mode & bits == bits


class PathAccess(WireModel):
    path: str
    mode: str
    uid: int
    gid: int
    ok: bool


class SeedDirEvidence(WireModel):
    """The seed dir exists, the agent can write it, and QEMU's user can reach and read it."""

    seed_dir: str
    qemu_user: QemuUser
    components: list[PathAccess] = Field(description="every directory from / to the seed dir, as QEMU's user meets it")
    agent_writable: bool


def check_seed_dir(system: HostRoot, seed_dir: str | Path, refusal: type[GuardError] = PreconditionRefused,
                   user: QemuUser | None = None) -> SeedDirEvidence:
    """Prove QEMU (libvirt's qemu user) can open a seed ISO in ``seed_dir`` and the agent can write one there.

    libvirt's ``dynamic_ownership`` chowns the ISO itself at start, never its parent directories:
    every component, the seed dir included, must let QEMU's uid traverse (seed 004: ``/var/lib/libvirt``
    0700 root:root kept libvirt-qemu out). QEMU opens the ISO by its path and never lists the
    directory, so the package's 0711 seed dir (``prepare-host``) is enough: search, not read.
    """
    seed_dir = posixpath.normpath("/" + str(seed_dir))
    user = user or qemu_user(system, refusal)
    try:
        resolved = system.resolve(seed_dir)
    except OSError as exc:
        raise _refuse(refusal, "seed_dir_missing", f"seed dir {seed_dir} cannot be resolved: {exc}", seed_dir=seed_dir) from exc
    if not system.is_dir(resolved):
        raise _refuse(refusal, "seed_dir_missing", f"seed dir {seed_dir} does not exist", seed_dir=seed_dir,
                      resolved=resolved, root=str(system.root))
    components: list[PathAccess] = []
    parts = [p for p in resolved.split("/") if p]
    for depth in range(len(parts) + 1):
        path = "/" + "/".join(parts[:depth])
        st = os.stat(system.real(path))
        components.append(PathAccess(path=path, mode=oct(stat.S_IMODE(st.st_mode)), uid=st.st_uid, gid=st.st_gid,
                                     ok=_may(st, user, 1)))
    real = str(system.real(resolved))
    writable = os.access(real, os.W_OK | os.X_OK)
    evidence = SeedDirEvidence(seed_dir=seed_dir, qemu_user=user, components=components, agent_writable=writable)
    if not writable:
        raise _refuse(refusal, "seed_dir_not_writable", f"seed dir {seed_dir} is not writable by uid {os.geteuid()}",
                      **evidence.model_dump(mode="json"))
    blocked = [c for c in components if not c.ok]
    if blocked:
        first = blocked[0]
        raise _refuse(refusal, "seed_dir_unreadable_by_qemu",
                      f"QEMU's user {user.name} (uid {user.uid}) cannot traverse {first.path} "
                      f"(mode {first.mode} owner {first.uid}:{first.gid})", **evidence.model_dump(mode="json"))
    return evidence


class RelayKeyEvidence(WireModel):
    public_key_file: str
    private_key_file: str
    key_type: str
    comment: str | None = None
    private_mode: str
    private_uid: int


def parse_ed25519(line: str) -> tuple[str, str | None] | None:
    """(key type, comment) of one ``ssh-ed25519 BASE64 [comment]`` line whose blob is a real ed25519 key."""
    words = line.split(None, 2)
    if len(words) < 2 or words[0] != ED25519:
        return None
    try:
        blob = base64.b64decode(words[1], validate=True)
        (n,) = struct.unpack(">I", blob[:4])
        kind = blob[4:4 + n]
        (m,) = struct.unpack(">I", blob[4 + n:8 + n])
        key = blob[8 + n:8 + n + m]
    except (binascii.Error, ValueError, struct.error):
        return None
    if kind != ED25519.encode() or m != 32 or len(key) != 32 or len(blob) != 8 + n + m:
        return None
    return words[0], words[2].strip() if len(words) > 2 else None


def check_relay_key(system: HostRoot, public_key_file: str | Path,
                    refusal: type[GuardError] = PreconditionRefused) -> RelayKeyEvidence:
    """The terminal relay's key pair (seed 004): the ``.pub`` parses as one ed25519 key; the private key is root's, 0600.

    The seed step writes the public key into the guest; the relay logs in with the private one, so a
    key the relay cannot use (or that others can read) makes an active slice no one can reach safely.
    """
    pub = posixpath.normpath("/" + str(public_key_file))
    if not pub.endswith(".pub"):
        raise _refuse(refusal, "relay_key_invalid", f"terminal relay key {pub} is not a .pub file", path=pub)
    private = pub[: -len(".pub")]
    try:
        text = system.read_text(pub)
    except OSError as exc:
        raise _refuse(refusal, "relay_key_missing", f"terminal relay key {pub} cannot be read: {exc.strerror or exc}",
                      path=pub) from exc
    lines = [line for line in text.splitlines() if line.strip()]
    parsed = parse_ed25519(lines[0].strip()) if len(lines) == 1 else None
    if parsed is None:
        raise _refuse(refusal, "relay_key_invalid", f"{pub} is not one {ED25519} public key line",
                      path=pub, lines=len(lines), first_word=(lines[0].split() or [""])[0][:32] if lines else None)
    try:
        st = os.stat(system.real(system.resolve(private)))
    except OSError as exc:
        raise _refuse(refusal, "relay_key_missing", f"terminal relay private key {private} is missing: {exc.strerror or exc}",
                      path=private, public_key_file=pub) from exc
    mode = stat.S_IMODE(st.st_mode)
    # 0600 (0400 also satisfies ssh): no bit for group or others, and root's.
    if not stat.S_ISREG(st.st_mode) or mode & 0o177 or st.st_uid != 0:
        raise _refuse(refusal, "relay_key_permissions",
                      f"terminal relay private key {private} is mode {oct(mode)} owner uid {st.st_uid}; want 0600 root",
                      path=private, mode=oct(mode), uid=st.st_uid, regular=stat.S_ISREG(st.st_mode))
    return RelayKeyEvidence(public_key_file=pub, private_key_file=private, key_type=parsed[0], comment=parsed[1],
                            private_mode=oct(mode), private_uid=st.st_uid)


class CacheSpaceEvidence(WireModel):
    cache_dir: str
    measured_at: str = Field(description="the cache dir, or its nearest existing parent when it is not created yet")
    free_bytes: int
    image_size_bytes: int | None = Field(description="None: size not known before download; not checked")


def check_cache_space(system: HostRoot, cache_dir: str | Path, image_size_bytes: int | None,
                      refusal: type[GuardError] = PreconditionRefused) -> CacheSpaceEvidence:
    """Free space where the image will be downloaded ≥ its size (when the size is known)."""
    cache_dir = posixpath.normpath("/" + str(cache_dir))
    probe = cache_dir
    while probe != "/" and not system.is_dir(probe):
        probe = posixpath.dirname(probe)
    free = shutil.disk_usage(system.real(system.resolve(probe))).free
    evidence = CacheSpaceEvidence(cache_dir=cache_dir, measured_at=probe, free_bytes=free,
                                  image_size_bytes=image_size_bytes)
    if image_size_bytes is not None and free < image_size_bytes:
        raise _refuse(refusal, "cache_space_insufficient",
                      f"image cache {cache_dir} has {free} bytes free; the image needs {image_size_bytes}",
                      **evidence.model_dump(mode="json"))
    return evidence


# -- the validate step's one call --------------------------------------------------------------------


class ProvisionPreconditions(WireModel):
    """What validate proved for the steps after it; journaled as the validate step's output."""

    profile: str
    domain_type: DomainType
    kvm: str = Field(description="usable | not_required")
    numa_node: int | None
    hugepages_1g_needed: int
    hugepages_1g_free: int | None
    vfio: list[VfioGuardEvidence]
    gpu_handover: GpuHandoverReadiness | None = None
    image_cache: CacheSpaceEvidence
    seed_dir: SeedDirEvidence
    relay_key: RelayKeyEvidence
    ovmf: OvmfFirmware
    ovs_bridge: str
    gateway: str = Field(description="the address the bridge owns, with prefix")
    dnsmasq: DnsmasqEvidence
    checks_passed: list[str]


def check_gpu_handover(host: HostRoot, slice_config: SliceConfig, profile: RuntimeProfile,
                       gpu_pci_address: str | None, fabric_vf_pci_address: str | None) -> GpuHandoverReadiness | None:
    """The release will hand the slot's GPU over (guards/gpureset.py): the tool is installed and the
    GPU and VF have a reset the agent may use. Refused here, before the lease, never after the tenant."""
    if gpu_pci_address is None:
        return None
    try:
        return check_gpu_handover_ready(host.fresh(), profile.gpu_handover, gpu_pci_address, fabric_vf_pci_address,
                                        slice_config.gpu_admin_tool)
    except GpuHandoverRefused as exc:
        raise PreconditionRefused(exc.message, code=exc.code, evidence={"profile": profile.name, **exc.evidence}) from None


def check_provision_preconditions(
    host: HostRoot,
    system: HostRoot,
    slice_config: SliceConfig,
    profile: RuntimeProfile,
    *,
    numa_node: int | None,
    gpu_pci_address: str | None,
    fabric_vf_pci_address: str | None,
    bridge_exists: BridgeCheck,
    image_cache_dir: str | Path,
    image_size_hint: int | None = None,
    proc: HostRoot | None = None,
    net: HostRoot | None = None,
    netns: str | None = None,
) -> ProvisionPreconditions:
    """Prove every later step of a provision can succeed, or raise :class:`PreconditionRefused`.

    ``host``: the root discovery reads (sysfs: KVM, hugepages, IOMMU groups) when the profile passes
    devices through; ``system``: the machine QEMU and the agent run on (OVMF, passwd, qemu.conf, seed
    dir, relay key, image cache). ``proc``: where the process table is read; ``net``: where links and
    addresses are read (both default ``system``; tests point them at the live machine while the files
    live in a temp root). ``netns``: read the bridge's addresses in this namespace (tests). Blocking.
    """
    base = {"profile": profile.name}
    passed: list[str] = []
    sysfs = host if profile.hostdevs else system  # the same rule as the start step

    kvm = "not_required"
    if profile.domain_type is DomainType.kvm:
        kvm = check_kvm(sysfs.fresh())
        passed.append("kvm_usable")

    needed, free = check_hugepages(sysfs.fresh(), profile, numa_node, PreconditionRefused, **base)
    if profile.hugepages_1g:
        passed.append("hugepages_free")

    vfio: list[VfioGuardEvidence] = []
    gpu_handover = None
    if profile.hostdevs:
        approved = [a for a in (gpu_pci_address, fabric_vf_pci_address) if a]
        for address in approved:  # the slot's GPU and, when it has one, its VF
            try:
                vfio.append(check_vfio_bindable(host.fresh(), address, approved))
            except VfioGuardError as exc:
                raise PreconditionRefused(exc.message, code=exc.code, evidence={**base, **exc.evidence}) from None
        passed.append("vfio_groups_viable")
        gpu_handover = check_gpu_handover(host, slice_config, profile, gpu_pci_address, fabric_vf_pci_address)
        passed.append("gpu_handover_ready")

    cache = check_cache_space(system, image_cache_dir, image_size_hint)
    passed.append("cache_space" if image_size_hint is not None else "cache_space_unknown_size")
    seed = check_seed_dir(system, slice_config.seed_dir)
    passed.append("seed_dir")
    relay = check_relay_key(system, slice_config.terminal_relay_key_file)
    passed.append("relay_key")
    try:
        firmware = find_ovmf(system)
    except OvmfNotFoundError as exc:
        raise PreconditionRefused(exc.message, code="ovmf_missing", evidence=exc.evidence) from None
    passed.append("ovmf")

    bridge = slice_config.ovs_bridge
    present = bridge_exists(bridge) if callable(bridge_exists) else bridge_exists
    if present is not True:
        raise PreconditionRefused(f"OVS bridge {bridge} does not exist", code="ovs_bridge_missing",
                                  evidence={**base, "ovs_bridge": bridge, "evidence_given": repr(present)})
    target = NetTarget(subnet=slice_config.subnet, ovs_bridge=bridge, netns=netns)
    gateway = f"{slice_config.gateway}/{slice_config.subnet.prefixlen}"
    links, addresses, unreadable = read_bridge_addresses(net or system, target)
    owned = sorted(a.cidr for a in addresses or [] if a.ifname == bridge and a.family == "inet")
    if gateway not in owned:
        raise PreconditionRefused(
            f"{bridge} does not own the gateway {gateway}: it has {', '.join(owned) or 'no IPv4 address'}"
            + ("" if links is None or bridge in links else f" (no link named {bridge})"),
            code="bridge_gateway_missing",
            evidence={**base, "ovs_bridge": bridge, "gateway": gateway, "addresses": owned, "link_present":
                      None if links is None else bridge in links, "netns": netns,
                      "unreadable": [u.model_dump() for u in unreadable]})
    passed.append("bridge_owns_gateway")

    dnsmasq = read_dnsmasq_evidence(proc or system, slice_config.dnsmasq_hosts_file, slice_config.dnsmasq_pid_file)
    problem = judge_dnsmasq(dnsmasq)
    if problem is not None:
        code = "dnsmasq_not_running" if problem.code == "dnsmasq_unproven" else problem.code
        raise PreconditionRefused(problem.detail, code=code, evidence={**base, **dnsmasq.model_dump(mode="json")})
    passed.append("dnsmasq_reads_hosts")

    return ProvisionPreconditions(
        profile=profile.name, domain_type=profile.domain_type, kvm=kvm, numa_node=numa_node,
        hugepages_1g_needed=needed, hugepages_1g_free=free, vfio=vfio, gpu_handover=gpu_handover,
        image_cache=cache, seed_dir=seed, relay_key=relay, ovmf=firmware, ovs_bridge=bridge, gateway=gateway,
        dnsmasq=dnsmasq, checks_passed=passed)


def check_fabric_manager(profile: RuntimeProfile, nvswitches: Sequence[str], fm_problem: str | None) -> None:
    """A ``fabric_partitions`` profile on an NVSwitch host needs Fabric Manager answering (before any lease).

    Without FM no partition can be activated and the guest's GPUs get no NVLink (CUDA error 802 in the
    guest): the task is refused with the slots untouched. ``fm_problem``: why FM did not answer, or None.
    A profile without ``fabric_partitions`` never asks for FM (the seed's guidance: no host FM unless the
    profile says it is safe), and a host without NVSwitches has no partitions to activate.
    """
    if not profile.fabric_partitions or not nvswitches or fm_problem is None:
        return
    raise PreconditionRefused(
        f"profile {profile.name} needs NVIDIA Fabric Manager on this NVSwitch host and it did not answer: "
        f"{fm_problem}; start nvidia-fabricmanager (Shared NVSwitch mode) and configure [slice.fabric_manager]",
        code="fabric_manager_missing",
        evidence={"profile": profile.name, "nvswitches": list(nvswitches), "fabric_manager": fm_problem})
