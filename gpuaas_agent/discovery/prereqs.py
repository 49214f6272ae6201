"""Slice-host prerequisites as parity checks (seed 002 Phase 5 "Prereq check", seed 004 parity target).

Each check proves behaviour where it can: IOMMU groups exist (not just a
cmdline flag), the libvirt and OVSDB sockets answer (not just a unit file),
the bridge owns the gateway address, the NAT rule is in force. On a recorded
fixture a socket cannot be asked, so those checks WARN: not proven is never
PASS (docs/safety.md §7). Only hard checks may FAIL.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from dataclasses import dataclass

from gpuaas_agent.contract.parity import DnsmasqEvidence, ParityCheck, ParityStatus, SliceNetworkEvidence
from gpuaas_agent.contract.runtime import RuntimeProfile
from gpuaas_agent.contract.topology import TopologyReport
from gpuaas_agent.discovery.netevidence import (
    IPOIB_NETPLAN,
    TMFIFO,
    judge_dnsmasq,
    judge_recorded_dnsmasq,
    running_processes,
)
from gpuaas_agent.discovery.ovmf import OvmfNotFoundError, find_ovmf
from gpuaas_agent.hostfs import HostRoot

PASS, WARN, FAIL = ParityStatus.PASS, ParityStatus.WARN, ParityStatus.FAIL
SOCKET_TIMEOUT_S = 3.0
VFIO_MODULES = ("vfio", "vfio_pci", "vfio_iommu_type1")
LIBVIRT_SOCKETS = ("/run/libvirt/libvirt-sock", "/run/libvirt/virtqemud-sock")
OVSDB_SOCKET = "/run/openvswitch/db.sock"
# Seed 004: early hosts used the first name, site bootstrap the second; either is historical evidence only.
HISTORICAL_SERVICES = ("gpuaas-slice-host-net-baseline", "gpuaas-slice-network-baseline")
UNIT_DIRS = ("/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
REBOOT_REQUIRED = "/run/reboot-required"
HUGEPAGE_1G = "hugepages-1048576kB"
NODE_DIR = "/sys/devices/system/node"


@dataclass(frozen=True)
class SocketPaths:
    """Where the daemons listen; tests point these at the servers they start."""

    libvirt: tuple[str, ...] = LIBVIRT_SOCKETS
    ovsdb: str = OVSDB_SOCKET

    @classmethod
    def from_env(cls) -> SocketPaths:
        """``OVS_RUNDIR`` moves the OVSDB socket, as it does for ovs-vsctl."""
        rundir = os.environ.get("OVS_RUNDIR")
        return cls(ovsdb=os.path.join(rundir, "db.sock") if rundir else OVSDB_SOCKET)


def _check(status: ParityStatus, name: str, detail: str, remediation: str | None = None, *, hard: bool = True,
           evidence: str | None = None) -> ParityCheck:
    if status is FAIL and not hard:
        status = WARN  # a soft check reports at most WARN
    return ParityCheck(status=status, check=name, detail=detail,
                       remediation=None if status is PASS else remediation, hard=hard, evidence=evidence)


def _unprovable(name: str, what: str, remediation: str, *, hard: bool = True, evidence: str | None = None) -> ParityCheck:
    return _check(WARN, name, f"not provable from a recording: {what}", remediation, hard=hard, evidence=evidence)


# -- agent, virtualisation, passthrough -------------------------------------------------------


def check_node_agent(host: HostRoot, *, answering_task: bool = False) -> ParityCheck:
    """The agent answering a task is itself the proof; from the CLI, a running ``gpuaas-agent run``."""
    remediation = "enroll and start gpuaas-agent (gpuaas-agent enroll; systemctl enable --now gpuaas-agent)"
    if answering_task:
        return _check(PASS, "node_agent", "active/running (answering slice.preflight)", evidence="this process answered the task")
    if not host.is_live:
        return _unprovable("node_agent", "no process table", remediation, evidence="recording: /proc has no pids")
    pids = _agent_pids()
    if pids:
        return _check(PASS, "node_agent", f"active/running pid={','.join(map(str, pids))}", evidence="/proc/*/cmdline")
    return _check(FAIL, "node_agent", "no running gpuaas-agent run process", remediation, evidence="/proc/*/cmdline")


def _agent_pids() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        words = [os.path.basename(a.decode(errors="replace")) for a in argv if a]
        if any(w in ("gpuaas-agent", "gpuaas_agent", "gpuaas_agent.daemon") for w in words) and "run" in words:
            found.append(int(name))
    return sorted(found)


def check_iommu(host: HostRoot) -> ParityCheck:
    """IOMMU is on when the kernel made groups; the cmdline alone proves nothing (seed 004, j22u05 VMX story)."""
    try:
        cmdline = host.read_text("/proc/cmdline").split()
    except OSError:
        cmdline = []
    flags = [w for w in cmdline if re.match(r"^(intel_iommu|amd_iommu|iommu)=", w)]
    try:
        groups = len(host.listdir("/sys/kernel/iommu_groups"))
    except OSError:
        groups = 0
    try:
        units = len(host.listdir("/sys/class/iommu"))
    except OSError:
        units = None
    detail = f"iommu_groups={groups} cmdline={','.join(flags) or 'none'}" + (f" iommu_units={units}" if units is not None else "")
    ev = "read /sys/kernel/iommu_groups /sys/class/iommu /proc/cmdline"
    if groups > 0:
        return _check(PASS, "iommu", detail, evidence=ev)
    return _check(FAIL, "iommu", detail, "enable VT-d/AMD-Vi in firmware and boot with intel_iommu=on iommu=pt", evidence=ev)


def check_vfio(host: HostRoot) -> ParityCheck:
    loaded = [m for m in VFIO_MODULES if host.is_dir(f"/sys/module/{m}")]
    missing = [m for m in VFIO_MODULES if m not in loaded]
    container = host.exists("/dev/vfio/vfio")
    detail = f"modules={','.join(loaded) or 'none'} /dev/vfio/vfio={'present' if container else 'missing'}"
    ev = "read " + " ".join(f"/sys/module/{m}" for m in VFIO_MODULES) + " /dev/vfio/vfio"
    if not missing and container:
        return _check(PASS, "vfio", detail, evidence=ev)
    return _check(FAIL, "vfio", detail + (f" missing={','.join(missing)}" if missing else ""),
                  "load vfio vfio_iommu_type1 vfio_pci (/etc/modules-load.d/gpuaas-vfio.conf)", evidence=ev)


def check_sriov(host: HostRoot) -> ParityCheck:
    """Per-slot fabric needs VFs: at least one Mellanox PF with ``sriov_numvfs`` > 0."""
    pfs = []
    try:
        names = host.listdir("/sys/bus/pci/devices")
    except OSError:
        names = []
    for name in names:
        base = f"/sys/bus/pci/devices/{name}"
        try:
            if host.read_attr(f"{base}/vendor") != "0x15b3" or not host.exists(f"{base}/sriov_totalvfs"):
                continue
            pfs.append((name, int(host.read_attr(f"{base}/sriov_numvfs") or 0), int(host.read_attr(f"{base}/sriov_totalvfs") or 0)))
        except (OSError, ValueError):
            continue
    with_vfs = [p for p in pfs if p[1] > 0]
    detail = f"fabric_pfs={len(pfs)} pfs_with_vfs={len(with_vfs)} vfs={sum(p[1] for p in pfs)}"
    ev = "sriov_numvfs/sriov_totalvfs " + (",".join(f"{a}={n}/{t}" for a, n, t in pfs) or "no 0x15b3 PF with sriov_totalvfs")
    if with_vfs:
        return _check(PASS, "sriov_vfs", detail, evidence=ev)
    return _check(FAIL, "sriov_vfs", detail, "create the per-slot fabric VFs (sriov_numvfs) from the BF3/CX7 profile",
                  evidence=ev)


def check_ovmf(host: HostRoot) -> ParityCheck:
    """The pair the define step will use (``find_ovmf``: firmware descriptors, then well-known files)."""
    try:
        fw = find_ovmf(host)
    except OvmfNotFoundError as exc:
        passed_over = "; ".join(f"{p['candidate']}: {p['reason']}" for p in exc.evidence.get("passed_over", []))
        return _check(FAIL, "ovmf", "no UEFI pair without Secure Boot", "install ovmf", evidence=passed_over)
    return _check(PASS, "ovmf", f"present: {fw.code_path} {fw.vars_template_path}",
                  evidence=f"descriptor {fw.descriptor}" if fw.descriptor else "well-known pair, no firmware descriptor")


def check_hugepages(host: HostRoot, profiles: list[RuntimeProfile], slot_nodes: list[int | None]) -> ParityCheck:
    """1 GiB pages on each slot's NUMA node for the host's runtime profiles (hard: QEMU aborts without them).

    FAIL when a profile that asks for hugepages cannot start even one domain on a slot's node (or the
    node has no 1 GiB pool); WARN when a node cannot back all of its slots at once; PASS otherwise.
    """
    parts = []
    pools: dict[int, int | None] = {}
    try:
        nodes = [n for n in host.listdir(NODE_DIR) if re.fullmatch(r"node\d+", n)]
    except OSError:
        nodes = []
    free: int | None  # a node's free 1 GiB pages; None where its pool is unknown
    for node_dir in sorted(nodes, key=lambda n: int(n[4:])):
        base = f"{NODE_DIR}/{node_dir}/hugepages/{HUGEPAGE_1G}"
        try:
            nr, free = int(host.read_attr(f"{base}/nr_hugepages")), int(host.read_attr(f"{base}/free_hugepages"))
        except (OSError, ValueError):
            parts.append(f"{node_dir}=unknown")
            pools[int(node_dir[4:])] = None
            continue
        pools[int(node_dir[4:])] = free
        parts.append(f"{node_dir}={free}/{nr}")
    ev = f"{NODE_DIR}/node*/hugepages/{HUGEPAGE_1G}/free_hugepages/nr_hugepages: {' '.join(parts) or 'no NUMA nodes'}"
    wanting = [p for p in profiles if p.hugepages_1g]
    names = ",".join(p.name for p in profiles) or "none"
    if not wanting:
        return _check(PASS, "hugepages", f"no runtime profile asks for 1 GiB hugepages (profiles {names})", evidence=ev)
    fix = "stage 1 GiB hugepages per NUMA node (kernel cmdline hugepagesz=1G hugepages=N) for the runtime profile"
    per_node: dict[int | None, int] = {}
    for node in slot_nodes:
        per_node[node] = per_node.get(node, 0) + 1
    short, partial = [], []
    for profile in wanting:
        needed = -(-profile.memory_mib // 1024)
        for node, slots in sorted(per_node.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            free = pools.get(node) if node is not None else None
            if free is None or free < needed:
                short.append(f"{profile.name} needs {needed} on node{node if node is not None else '?'}, "
                             f"free={'none' if free is None else free}")
            elif free < needed * slots:
                partial.append(f"node{node} backs {free // needed} of its {slots} slots ({profile.name} needs {needed} each)")
    if not slot_nodes:
        return _check(WARN, "hugepages", f"profiles {names} need 1 GiB pages; no candidate slot to place them for",
                      fix, evidence=ev)
    if short:
        return _check(FAIL, "hugepages", "; ".join(short), fix, evidence=ev)
    if partial:
        return _check(WARN, "hugepages", "; ".join(partial), fix, evidence=ev)
    return _check(PASS, "hugepages", f"every slot's node backs all its slots for {names}", evidence=ev)


def check_rdma(host: HostRoot) -> ParityCheck:
    try:
        devices = host.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    ev = f"/sys/class/infiniband: {','.join(devices) or 'empty or absent'}"
    if devices:
        return _check(PASS, "rdma_devices", f"infiniband devices={len(devices)}", hard=False, evidence=ev)
    return _check(WARN, "rdma_devices", "no /sys/class/infiniband devices", "load mlx5_ib and install rdma-core",
                  hard=False, evidence=ev)


# -- daemons that must answer -------------------------------------------------------------------


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(SOCKET_TIMEOUT_S)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def check_libvirt(host: HostRoot, sockets: SocketPaths) -> ParityCheck:
    remediation = "start libvirtd (systemctl enable --now libvirtd) before launching slice VMs"
    if not host.is_live:
        return _unprovable("libvirt", "a socket cannot be asked", remediation, evidence="recording")
    errors = []
    for path in sockets.libvirt:
        try:
            _connect(path).close()
            return _check(PASS, "libvirt", f"{path} accepts connections", evidence=f"connect({path})")
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
    return _check(FAIL, "libvirt", "; ".join(errors), remediation, evidence="connect(" + ",".join(sockets.libvirt) + ")")


def ovsdb_databases(path: str) -> list[str]:
    """``list_dbs`` over the OVSDB JSON-RPC socket: the answer proves ovsdb-server is serving."""
    with _connect(path) as sock:
        sock.sendall(json.dumps({"method": "list_dbs", "params": [], "id": 0}).encode())
        buf = b""
        decoder = json.JSONDecoder()
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError(0, "connection closed before a reply")
            buf += chunk
            try:
                reply, _ = decoder.raw_decode(buf.decode())
            except ValueError:
                continue
            if reply.get("error"):
                raise OSError(0, f"list_dbs error: {reply['error']}")
            return list(reply.get("result") or [])


def check_openvswitch(host: HostRoot, sockets: SocketPaths) -> ParityCheck:
    remediation = "start openvswitch-switch (ovsdb-server and ovs-vswitchd)"
    if not host.is_live:
        return _unprovable("openvswitch", "a socket cannot be asked", remediation, evidence="recording")
    try:
        dbs = ovsdb_databases(sockets.ovsdb)
    except (OSError, ValueError) as exc:
        return _check(FAIL, "openvswitch", f"{sockets.ovsdb}: {getattr(exc, 'strerror', None) or exc}", remediation,
                      evidence=f"list_dbs on {sockets.ovsdb}")
    ev = f"list_dbs on {sockets.ovsdb}"
    if "Open_vSwitch" in dbs:
        return _check(PASS, "openvswitch", f"{sockets.ovsdb} serves {','.join(dbs)}", evidence=ev)
    return _check(FAIL, "openvswitch", f"{sockets.ovsdb} serves {','.join(dbs) or 'no database'}, not Open_vSwitch", remediation,
                  evidence=ev)


# -- slice network (from the evidence) ----------------------------------------------------------


def _net_source(ev: SliceNetworkEvidence, what: str) -> str:
    if ev.source == "fixture":
        return f"recorded {what}"
    return f"netlink{' in netns ' + ev.netns if ev.netns else ''}"


def network_checks(ev: SliceNetworkEvidence, dnsmasq: DnsmasqEvidence) -> list[ParityCheck]:
    """ovsbr0 + gateway, dnsmasq, NAT, ip_forward, IPoIB netplan/address/route, tmfifo."""
    checks = []
    bridge, addrs = ev.ovs_bridge, ev.addresses_of(ev.ovs_bridge)
    fix_bridge = f"create {bridge} and assign {ev.gateway} (slice network baseline)"
    ev_bridge = f"{_net_source(ev, 'ip -j addr')}: {bridge} {'present' if bridge in ev.links else 'absent'} " \
                f"inet={','.join(addrs) or 'none'}"
    if not ev.links:
        checks.append(_check(WARN, "ovs_bridge", "links could not be read", fix_bridge, evidence=ev_bridge))
    elif bridge not in ev.links:
        checks.append(_check(FAIL, "ovs_bridge", f"{bridge} missing", fix_bridge, evidence=ev_bridge))
    elif ev.gateway in addrs:
        checks.append(_check(PASS, "ovs_bridge", f"{bridge} owns {ev.gateway}", evidence=ev_bridge))
    else:
        checks.append(_check(FAIL, "ovs_bridge", f"{bridge} does not own {ev.gateway}: has {','.join(addrs) or 'no IPv4'}",
                             fix_bridge, evidence=ev_bridge))

    checks.append(check_dnsmasq(ev, dnsmasq))

    fix_nat = f"iptables -t nat -A POSTROUTING -s {ev.subnet} -j MASQUERADE (persist via the network baseline)"
    ev_nat = f"method={ev.nat.method} rule={ev.nat.rule!r}"
    if ev.nat.present:
        checks.append(_check(PASS, "nat", f"{ev.nat.method}: {ev.nat.detail}", evidence=ev_nat))
    elif ev.nat.present is False:
        checks.append(_check(FAIL, "nat", f"{ev.nat.method}: {ev.nat.detail}", fix_nat, evidence=ev_nat))
    else:
        checks.append(_check(WARN, "nat", f"not proven: {ev.nat.detail}", fix_nat, evidence=ev_nat))

    fix_fwd = "sysctl -w net.ipv4.ip_forward=1 and persist it in /etc/sysctl.d"
    ev_fwd = f"/proc/sys/net/ipv4/ip_forward{' in netns ' + ev.netns if ev.netns else ''}"
    if ev.ip_forward:
        checks.append(_check(PASS, "ip_forward", "net.ipv4.ip_forward=1", evidence=ev_fwd))
    elif ev.ip_forward is False:
        checks.append(_check(FAIL, "ip_forward", "net.ipv4.ip_forward=0", fix_fwd, evidence=ev_fwd))
    else:
        checks.append(_check(WARN, "ip_forward", "net.ipv4.ip_forward could not be read", fix_fwd, evidence=ev_fwd))

    checks.extend(_ipoib_checks(ev))
    checks.append(_tmfifo_check(ev))
    return checks


def _ipoib_checks(ev: SliceNetworkEvidence) -> list[ParityCheck]:
    fix = f"render {IPOIB_NETPLAN} from site/profile bootstrap and netplan apply"
    out = []
    if ev.ipoib_netplan:
        out.append(_check(PASS, "ipoib_netplan", f"{ev.ipoib_netplan} present", evidence=f"exists({IPOIB_NETPLAN})"))
    else:
        out.append(_check(FAIL, "ipoib_netplan", f"{IPOIB_NETPLAN} missing", fix, evidence=f"exists({IPOIB_NETPLAN})"))
    ev_addr = _net_source(ev, "ip -j addr") + " ibp*"
    ev_route = _net_source(ev, "ip -j route") + " main table via ibp*"
    ib_addrs = sorted(f"{a.ifname}={a.cidr}" for a in ev.addresses if a.family == "inet" and a.ifname.startswith("ibp"))
    out.append(_ipoib_found(ev, "ipoib_address", ib_addrs, unreadable="addresses could not be read",
                            missing="no ibp* interface has an IPv4 address", fix=fix, evidence=ev_addr))
    fabric = sorted(f"{r.dst}@{r.dev}" for r in ev.routes if r.dev and r.dev.startswith("ibp") and r.dst != "default")
    out.append(_ipoib_found(ev, "fabric_route", fabric, unreadable="routes could not be read",
                            missing="no route for the IPoIB subnet via an ibp* interface", fix=fix, evidence=ev_route))
    return out


def _ipoib_found(ev: SliceNetworkEvidence, name: str, found: list[str], *, unreadable: str, missing: str, fix: str,
                 evidence: str) -> ParityCheck:
    """PASS naming what was ``found``; else WARN when the links could not be read at all, FAIL when they were."""
    if found:
        return _check(PASS, name, ",".join(found), evidence=evidence)
    if not ev.links:
        return _check(WARN, name, unreadable, fix, evidence=evidence)
    return _check(FAIL, name, missing, fix, evidence=evidence)


def _tmfifo_check(ev: SliceNetworkEvidence) -> ParityCheck:
    """Optional BF3 RShim management link: evidence, never a blocker."""
    evidence = _net_source(ev, "ip -j addr") + f" {TMFIFO}"
    if TMFIFO not in ev.links:
        return _check(WARN, "tmfifo", f"{TMFIFO} absent (optional BF3 RShim management link)",
                      "install rshim and assign 192.168.100.1/30 if BF3 management is wanted", hard=False, evidence=evidence)
    v4 = ev.addresses_of(TMFIFO)
    slash30 = [c for c in v4 if ipaddress.IPv4Interface(c).network.prefixlen == 30]
    if slash30:
        return _check(PASS, "tmfifo", f"{TMFIFO} has {','.join(slash30)}", hard=False, evidence=evidence)
    return _check(WARN, "tmfifo", f"{TMFIFO} without a /30 IPv4 ({','.join(v4) or 'none'})",
                  f"assign 192.168.100.1/30 to {TMFIFO}", hard=False, evidence=evidence)


# -- service history and reboot state ------------------------------------------------------------


def check_historical_service(host: HostRoot) -> ParityCheck:
    """Either historical unit name is accepted as evidence with WARN; behaviour is judged by the other checks."""
    found = [f"{d}/{name}.service" for name in HISTORICAL_SERVICES for d in UNIT_DIRS if host.exists(f"{d}/{name}.service")]
    fix = "converge on one agent-verified network baseline; behaviour checks (ovs_bridge, nat, ip_forward) decide"
    evidence = "looked in " + ",".join(UNIT_DIRS)
    if found:
        return _check(WARN, "historical_network_service", f"historical evidence only: {','.join(found)}", fix, hard=False,
                      evidence=evidence)
    return _check(WARN, "historical_network_service",
                  f"neither {' nor '.join(HISTORICAL_SERVICES)} is installed: nothing proven to re-apply the network after reboot",
                  fix, hard=False, evidence=evidence)


def check_reboot_required(host: HostRoot) -> ParityCheck:
    evidence = f"exists({REBOOT_REQUIRED})"
    if host.exists(REBOOT_REQUIRED):
        return _check(WARN, "reboot_required", f"{REBOOT_REQUIRED} present", "reboot the host to apply staged kernel/boot changes",
                      hard=False, evidence=evidence)
    return _check(PASS, "reboot_required", f"{REBOOT_REQUIRED} absent", hard=False, evidence=evidence)


# -- dnsmasq: the subnet config and the running process that reads the agent's reservations ------


def _recorded_reads(dnsmasq: DnsmasqEvidence) -> str:
    cfg = dnsmasq.recorded_config
    if cfg is None:
        return "-"
    return ",".join(cfg.hosts_files + cfg.hosts_dirs) or "none"


def check_dnsmasq(ev: SliceNetworkEvidence, dnsmasq: DnsmasqEvidence) -> ParityCheck:
    """A dhcp-range in the subnet *and* a running dnsmasq reading the agent's hosts file (the one a reload reaches).

    The config alone proves neither that dnsmasq runs nor that it reads the reservations: on a
    recording (no process table) the best is WARN.
    """
    fix_range = f"render the {ev.subnet} dnsmasq config for {ev.ovs_bridge} and restart dnsmasq"
    fix_hosts = (f"point the running dnsmasq at the agent's reservations (dhcp-hostsfile={dnsmasq.hosts_file}; "
                 "gpuaas-agent network-baseline writes it) and restart dnsmasq")
    procs = "; ".join(f"pid {p.pid} argv={' '.join(p.argv)[:200]} conf={','.join(p.conf_files) or 'none'} "
                      f"hosts={','.join(p.hosts_files + p.hosts_dirs) or 'none'}" for p in dnsmasq.processes)
    evidence = (f"config files {','.join(ev.dnsmasq_files) or 'none'}; dhcp-range files "
                f"{','.join(ev.dnsmasq_subnet_files) or 'none'}; "
                f"processes: {procs or ('none' if dnsmasq.process_table else 'no process table')}; "
                f"pid_file {dnsmasq.pid_file or '-'}={dnsmasq.pid_file_pid or '-'}")
    if not ev.dnsmasq_subnet_files:
        return _check(FAIL, "dnsmasq", f"no dhcp-range in {ev.subnet} ({','.join(ev.dnsmasq_files) or 'no dnsmasq config'})",
                      fix_range, evidence=evidence)
    problem = judge_dnsmasq(dnsmasq)
    if problem is None:
        return _check(PASS, "dnsmasq", f"dhcp-range in {ev.subnet}; {dnsmasq.via}", evidence=evidence)
    if problem.code == "dnsmasq_unproven":
        recorded = judge_recorded_dnsmasq(dnsmasq)
        if recorded is None:
            return _unprovable("dnsmasq", f"dhcp-range in {ev.subnet} is configured, but whether a running dnsmasq "
                               f"reads {dnsmasq.hosts_file} is not", fix_hosts, evidence=evidence)
        evidence += f"; recorded config reads {_recorded_reads(dnsmasq)}"
        if recorded.code == "dnsmasq_unproven":
            return _unprovable("dnsmasq", f"dhcp-range in {ev.subnet}; {recorded.detail}", fix_hosts, evidence=evidence)
        if recorded.code == "dnsmasq_config_reads_other_hosts":
            # WARN, naming the file: the service's command line (not recorded) could still add the agent's file.
            return _check(WARN, "dnsmasq", f"{recorded.code}: {recorded.detail}", fix_hosts, evidence=evidence)
        return _check(FAIL, "dnsmasq", f"{recorded.code}: {recorded.detail}", fix_hosts, evidence=evidence)
    fix = "start dnsmasq (systemctl enable --now dnsmasq)" if problem.code == "dnsmasq_not_running" else fix_hosts
    return _check(FAIL, "dnsmasq", f"{problem.code}: {problem.detail}", fix, evidence=evidence)


# -- slots, GPUs and the host services that hold them ------------------------------------------------

# What each slot blocker asks the operator to do (docs/architecture.md, seed 004 storage transition).
STORAGE_TRANSITION = ("run the slice-mode storage transition on the slot disks: unmount /share*, disable their fstab "
                      "entries, wipefs and blkdiscard the approved raw slot devices (seed 004)")
SLOT_REMEDIATIONS = {
    "nvme_mounted_child": STORAGE_TRANSITION,
    "nvme_mounted": STORAGE_TRANSITION,
    "nvme_not_raw": STORAGE_TRANSITION,
    "nvme_holders": STORAGE_TRANSITION,
    "nvme_swap": STORAGE_TRANSITION,
    "no_nvme_device": "install or expose a raw NVMe slot disk per GPU (check /dev/disk/by-id and the NVMe controllers)",
    "no_free_fabric_vf": "create the per-slot fabric VFs (sriov_numvfs) from the BF3/CX7 profile",
    "fabric_vf_no_iommu_group": "enable VT-d/AMD-Vi and boot with intel_iommu=on iommu=pt",
    "gpu_no_iommu_group": "enable VT-d/AMD-Vi and boot with intel_iommu=on iommu=pt",
    "gpu_iommu_group_shared": "move the GPU to its own IOMMU group (ACS / slot placement) before slicing",
    "no_private_ip": "widen the slice subnet or release stale reservations",
    "no_gpus": "this host has no NVIDIA GPU to slice: check the GPUs are present and seen on the PCI bus",
}


def check_slot_candidates(report: TopologyReport) -> ParityCheck:
    """A slice host is usable only with at least one ready candidate slot (all its devices present and clean)."""
    counts: dict[str, int] = {}
    for slot in report.candidate_slots:
        for blocker in slot.blockers:
            counts[blocker.code] = counts.get(blocker.code, 0) + 1
    for finding in report.blockers:
        counts[finding.code] = counts.get(finding.code, 0) + 1
    summary = report.summary
    detail = f"candidate_slots={summary.candidate_slots} ready_candidate_slots={summary.ready_candidate_slots}"
    evidence = (f"{summary.as_line()}; blockers "
                + (",".join(f"{code}x{n}" for code, n in sorted(counts.items())) or "none"))
    if summary.ready_candidate_slots > 0:
        return _check(PASS, "slot_candidates", detail, evidence=evidence)
    fixes = []
    for code in sorted(counts, key=lambda c: -counts[c]):
        fix = SLOT_REMEDIATIONS.get(code)
        if fix and fix not in fixes:
            fixes.append(fix)
    if summary.candidate_slots == 0 and not fixes:
        fixes.append(SLOT_REMEDIATIONS["no_gpus"])
    return _check(FAIL, "slot_candidates", detail + " (no slot can be provisioned)",
                  "; ".join(fixes) or "resolve the slot blockers reported by gpuaas-agent discover", evidence=evidence)


VFIO_DRIVER = "vfio-pci"
# /proc/<pid>/comm is cut at 15 characters: nvidia-persistenced, nv-fabricmanager, nv-hostengine (DCGM).
GPU_HOST_SERVICES = {"nvidia-persiste": "nvidia-persistenced", "nv-fabricmanage": "nvidia-fabricmanager",
                     "nv-hostengine": "nvidia-dcgm"}
GPU_SERVICE_UNITS = ("nvidia-persistenced.service", "nvidia-fabricmanager.service", "nvidia-dcgm.service")
WANTS_DIRS = ("/etc/systemd/system/multi-user.target.wants", "/etc/systemd/system/graphical.target.wants")


def _slot_gpu_drivers(report: TopologyReport) -> dict[str, str | None]:
    slot_gpus = {s.gpu_pci_address for s in report.candidate_slots}
    return {g.pci_address: g.driver for g in report.gpus if g.pci_address in slot_gpus}


def check_gpu_driver(report: TopologyReport) -> ParityCheck:
    """Slot GPUs on ``vfio-pci`` is slice mode; on ``nvidia`` they are the host's until bind_vfio moves them (WARN).

    Not a FAIL by itself: provision's bind step unbinds a GPU nothing holds. What makes that unbind
    hang is a host service holding the GPU, which ``gpu_host_services`` reports as a FAIL.
    """
    drivers = _slot_gpu_drivers(report)
    evidence = "/sys/bus/pci/devices/*/driver: " + (",".join(f"{a}={d or 'none'}" for a, d in sorted(drivers.items())) or "no slot GPUs")
    off = {a: d for a, d in drivers.items() if d != VFIO_DRIVER}
    if not drivers:
        return _check(WARN, "gpu_driver", "no slot GPU to check", "see slot_candidates", evidence=evidence)
    if not off:
        return _check(PASS, "gpu_driver", f"all {len(drivers)} slot GPUs on {VFIO_DRIVER}", evidence=evidence)
    by_driver: dict[str, int] = {}
    for d in off.values():
        by_driver[d or "none"] = by_driver.get(d or "none", 0) + 1
    return _check(WARN, "gpu_driver",
                  f"{len(off)} of {len(drivers)} slot GPUs not on {VFIO_DRIVER} ("
                  + ",".join(f"{d}={n}" for d, n in sorted(by_driver.items())) + "); provision will rebind them",
                  "persist vfio-pci for the approved slot GPUs (driverctl set-override) once the host is in slice mode",
                  evidence=evidence)


def check_gpu_host_services(host: HostRoot, report: TopologyReport) -> ParityCheck:
    """nvidia-persistenced / nvidia-fabricmanager / DCGM on a slice host (seed 004, j22u05).

    They hold ``/dev/nvidia*`` and NVSwitch devices: while any slot GPU is still on ``nvidia`` they
    keep libvirt/bind_vfio from detaching it (seed 004: 0000:1b:00.0) -> FAIL. With every slot GPU
    already on vfio-pci they hold nothing a slice needs, but re-grab GPUs after a driver change or
    reboot -> WARN. A recording has no process table: enabled units are the evidence there (WARN).
    """
    drivers = _slot_gpu_drivers(report)
    on_nvidia = sorted(a for a, d in drivers.items() if d == "nvidia")
    fix = ("stop and disable nvidia-persistenced, nvidia-fabricmanager and nvidia-dcgm on slice-mode hosts "
           "(systemctl disable --now ...)")
    # A wants/ entry is a link to the unit file; a recording keeps the link, not always its target.
    enabled = [f"{d}/{u}" for d in WANTS_DIRS for u in GPU_SERVICE_UNITS if host.is_link(f"{d}/{u}") or host.exists(f"{d}/{u}")]
    table = running_processes(host, tuple(GPU_HOST_SERVICES))
    if table is None:
        evidence = f"no process table; enabled units: {','.join(enabled) or 'none'}"
        what = f"enabled at boot: {','.join(enabled)}" if enabled else "whether GPU host services run"
        return _unprovable("gpu_host_services", what, fix, evidence=evidence)
    running = sorted({GPU_HOST_SERVICES[comm] + f"(pid {pid})" for pid, (comm, _) in table.items()})
    evidence = (f"/proc/*/comm: {','.join(running) or 'none running'}; enabled units: {','.join(enabled) or 'none'}; "
                f"slot GPUs on nvidia: {','.join(on_nvidia) or 'none'}")
    if running and on_nvidia:
        return _check(FAIL, "gpu_host_services",
                      f"{','.join(running)} running while {len(on_nvidia)} slot GPUs are on nvidia: "
                      "they hold the GPUs and block the vfio-pci detach", fix, evidence=evidence)
    if running or enabled:
        return _check(WARN, "gpu_host_services",
                      f"GPU host services {'running' if running else 'enabled'} on a slice host: "
                      f"{','.join(running or enabled)}", fix, evidence=evidence)
    return _check(PASS, "gpu_host_services", "no nvidia-persistenced/fabricmanager/dcgm running or enabled",
                  evidence=evidence)
