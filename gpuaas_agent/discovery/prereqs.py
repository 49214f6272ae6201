"""Slice-host prerequisites as parity checks (seed 002 Phase 5 "Prereq check", seed 004 parity target).

Each check proves behaviour where it can: IOMMU groups exist (not just a
cmdline flag), the libvirt and OVSDB sockets answer (not just a unit file),
the bridge owns the gateway address, the NAT rule is in force. On a recorded
fixture a socket cannot be asked, so those checks WARN: not proven is never
PASS (DESIGN.md §4.7). Only hard checks may FAIL.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from dataclasses import dataclass

from gpuaas_agent.contract.parity import ParityCheck, ParityStatus, SliceNetworkEvidence
from gpuaas_agent.discovery.netevidence import IPOIB_NETPLAN, TMFIFO
from gpuaas_agent.hostfs import HostRoot

PASS, WARN, FAIL = ParityStatus.PASS, ParityStatus.WARN, ParityStatus.FAIL
SOCKET_TIMEOUT_S = 3.0
VFIO_MODULES = ("vfio", "vfio_pci", "vfio_iommu_type1")
# The pair the runtime profile boots (seed 004: OVMF_CODE_4M.fd + OVMF_VARS_4M.fd with secure='no').
OVMF_FILES = ("/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd")
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


def _check(status: ParityStatus, name: str, detail: str, remediation: str | None = None, *, hard: bool = True) -> ParityCheck:
    if status is FAIL and not hard:
        status = WARN  # a soft check reports at most WARN
    return ParityCheck(status=status, check=name, detail=detail,
                       remediation=None if status is PASS else remediation, hard=hard)


def _unprovable(name: str, what: str, remediation: str, *, hard: bool = True) -> ParityCheck:
    return _check(WARN, name, f"not provable from a recording: {what}", remediation, hard=hard)


# -- agent, virtualisation, passthrough -------------------------------------------------------


def check_node_agent(host: HostRoot, *, answering_task: bool = False) -> ParityCheck:
    """The agent answering a task is itself the proof; from the CLI, a running ``gpuaas-agent run``."""
    remediation = "enroll and start gpuaas-agent (gpuaas-agent enroll; systemctl enable --now gpuaas-agent)"
    if answering_task:
        return _check(PASS, "node_agent", "active/running (answering slice.preflight)")
    if not host.is_live:
        return _unprovable("node_agent", "no process table", remediation)
    pids = _agent_pids()
    if pids:
        return _check(PASS, "node_agent", f"active/running pid={','.join(map(str, pids))}")
    return _check(FAIL, "node_agent", "no running gpuaas-agent run process", remediation)


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


def check_kvm(host: HostRoot) -> ParityCheck:
    if host.exists("/dev/kvm"):
        return _check(PASS, "kvm", "/dev/kvm present")
    return _check(FAIL, "kvm", "/dev/kvm missing", "enable VT-x/VMX (AMD-V) in firmware and load kvm_intel/kvm_amd")


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
    if groups > 0:
        return _check(PASS, "iommu", detail)
    return _check(FAIL, "iommu", detail, "enable VT-d/AMD-Vi in firmware and boot with intel_iommu=on iommu=pt")


def check_vfio(host: HostRoot) -> ParityCheck:
    loaded = [m for m in VFIO_MODULES if host.is_dir(f"/sys/module/{m}")]
    missing = [m for m in VFIO_MODULES if m not in loaded]
    container = host.exists("/dev/vfio/vfio")
    detail = f"modules={','.join(loaded) or 'none'} /dev/vfio/vfio={'present' if container else 'missing'}"
    if not missing and container:
        return _check(PASS, "vfio", detail)
    return _check(FAIL, "vfio", detail + (f" missing={','.join(missing)}" if missing else ""),
                  "load vfio vfio_iommu_type1 vfio_pci (/etc/modules-load.d/gpuaas-vfio.conf)")


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
    if with_vfs:
        return _check(PASS, "sriov_vfs", detail)
    return _check(FAIL, "sriov_vfs", detail, "create the per-slot fabric VFs (sriov_numvfs) from the BF3/CX7 profile")


def check_ovmf(host: HostRoot) -> ParityCheck:
    missing = [p for p in OVMF_FILES if not host.exists(p)]
    if not missing:
        return _check(PASS, "ovmf", "present: " + " ".join(OVMF_FILES))
    return _check(FAIL, "ovmf", "missing: " + " ".join(missing), "install ovmf")


def check_hugepages(host: HostRoot) -> ParityCheck:
    """1 GiB pages per NUMA node; soft: only profiles that ask for hugepages need them (provision checks again)."""
    parts = []
    free_total = 0
    try:
        nodes = [n for n in host.listdir(NODE_DIR) if re.fullmatch(r"node\d+", n)]
    except OSError:
        nodes = []
    for node in sorted(nodes, key=lambda n: int(n[4:])):
        base = f"{NODE_DIR}/{node}/hugepages/{HUGEPAGE_1G}"
        try:
            nr, free = int(host.read_attr(f"{base}/nr_hugepages")), int(host.read_attr(f"{base}/free_hugepages"))
        except (OSError, ValueError):
            parts.append(f"{node}=unknown")
            continue
        free_total += free
        parts.append(f"{node}={free}/{nr}")
    detail = f"1GiB free/total {' '.join(parts) or 'no NUMA nodes'}"
    if free_total > 0:
        return _check(PASS, "hugepages", detail, hard=False)
    return _check(WARN, "hugepages", detail, "stage 1 GiB hugepages (hugepages=512) for tuned profiles", hard=False)


def check_rdma(host: HostRoot) -> ParityCheck:
    try:
        devices = host.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if devices:
        return _check(PASS, "rdma_devices", f"infiniband devices={len(devices)}", hard=False)
    return _check(WARN, "rdma_devices", "no /sys/class/infiniband devices", "load mlx5_ib and install rdma-core", hard=False)


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
        return _unprovable("libvirt", "a socket cannot be asked", remediation)
    errors = []
    for path in sockets.libvirt:
        try:
            _connect(path).close()
            return _check(PASS, "libvirt", f"{path} accepts connections")
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
    return _check(FAIL, "libvirt", "; ".join(errors), remediation)


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
        return _unprovable("openvswitch", "a socket cannot be asked", remediation)
    try:
        dbs = ovsdb_databases(sockets.ovsdb)
    except (OSError, ValueError) as exc:
        return _check(FAIL, "openvswitch", f"{sockets.ovsdb}: {getattr(exc, 'strerror', None) or exc}", remediation)
    if "Open_vSwitch" in dbs:
        return _check(PASS, "openvswitch", f"{sockets.ovsdb} serves {','.join(dbs)}")
    return _check(FAIL, "openvswitch", f"{sockets.ovsdb} serves {','.join(dbs) or 'no database'}, not Open_vSwitch", remediation)


# -- slice network (from the evidence) ----------------------------------------------------------


def network_checks(ev: SliceNetworkEvidence) -> list[ParityCheck]:
    """ovsbr0 + gateway, dnsmasq, NAT, ip_forward, IPoIB netplan/address/route, tmfifo."""
    checks = []
    bridge, addrs = ev.ovs_bridge, ev.addresses_of(ev.ovs_bridge)
    fix_bridge = f"create {bridge} and assign {ev.gateway} (slice network baseline)"
    if not ev.links:
        checks.append(_check(WARN, "ovs_bridge", "links could not be read", fix_bridge))
    elif bridge not in ev.links:
        checks.append(_check(FAIL, "ovs_bridge", f"{bridge} missing", fix_bridge))
    elif ev.gateway in addrs:
        checks.append(_check(PASS, "ovs_bridge", f"{bridge} owns {ev.gateway}"))
    else:
        checks.append(_check(FAIL, "ovs_bridge", f"{bridge} does not own {ev.gateway}: has {','.join(addrs) or 'no IPv4'}", fix_bridge))

    if ev.dnsmasq_subnet_files:
        checks.append(_check(PASS, "dnsmasq", f"dhcp-range in {ev.subnet}: {','.join(ev.dnsmasq_subnet_files)}"))
    else:
        checks.append(_check(FAIL, "dnsmasq", f"no dhcp-range in {ev.subnet} ({','.join(ev.dnsmasq_files) or 'no dnsmasq config'})",
                             f"render the {ev.subnet} dnsmasq config for {bridge} and restart dnsmasq"))

    fix_nat = f"iptables -t nat -A POSTROUTING -s {ev.subnet} -j MASQUERADE (persist via the network baseline)"
    if ev.nat.present:
        checks.append(_check(PASS, "nat", f"{ev.nat.method}: {ev.nat.detail}"))
    elif ev.nat.present is False:
        checks.append(_check(FAIL, "nat", f"{ev.nat.method}: {ev.nat.detail}", fix_nat))
    else:
        checks.append(_check(WARN, "nat", f"not proven: {ev.nat.detail}", fix_nat))

    fix_fwd = "sysctl -w net.ipv4.ip_forward=1 and persist it in /etc/sysctl.d"
    if ev.ip_forward:
        checks.append(_check(PASS, "ip_forward", "net.ipv4.ip_forward=1"))
    elif ev.ip_forward is False:
        checks.append(_check(FAIL, "ip_forward", "net.ipv4.ip_forward=0", fix_fwd))
    else:
        checks.append(_check(WARN, "ip_forward", "net.ipv4.ip_forward could not be read", fix_fwd))

    checks.extend(_ipoib_checks(ev))
    checks.append(_tmfifo_check(ev))
    return checks


def _ipoib_checks(ev: SliceNetworkEvidence) -> list[ParityCheck]:
    fix = f"render {IPOIB_NETPLAN} from site/profile bootstrap and netplan apply"
    out = []
    if ev.ipoib_netplan:
        out.append(_check(PASS, "ipoib_netplan", f"{ev.ipoib_netplan} present"))
    else:
        out.append(_check(FAIL, "ipoib_netplan", f"{IPOIB_NETPLAN} missing", fix))
    ib_addrs = sorted(f"{a.ifname}={a.cidr}" for a in ev.addresses if a.family == "inet" and a.ifname.startswith("ibp"))
    if ib_addrs:
        out.append(_check(PASS, "ipoib_address", ",".join(ib_addrs)))
    elif not ev.links:
        out.append(_check(WARN, "ipoib_address", "addresses could not be read", fix))
    else:
        out.append(_check(FAIL, "ipoib_address", "no ibp* interface has an IPv4 address", fix))
    fabric = sorted(f"{r.dst}@{r.dev}" for r in ev.routes if r.dev and r.dev.startswith("ibp") and r.dst != "default")
    if fabric:
        out.append(_check(PASS, "fabric_route", ",".join(fabric)))
    elif not ev.links:
        out.append(_check(WARN, "fabric_route", "routes could not be read", fix))
    else:
        out.append(_check(FAIL, "fabric_route", "no route for the IPoIB subnet via an ibp* interface", fix))
    return out


def _tmfifo_check(ev: SliceNetworkEvidence) -> ParityCheck:
    """Optional BF3 RShim management link: evidence, never a blocker."""
    if TMFIFO not in ev.links:
        return _check(WARN, "tmfifo", f"{TMFIFO} absent (optional BF3 RShim management link)",
                      "install rshim and assign 192.168.100.1/30 if BF3 management is wanted", hard=False)
    v4 = ev.addresses_of(TMFIFO)
    slash30 = [c for c in v4 if ipaddress.IPv4Interface(c).network.prefixlen == 30]
    if slash30:
        return _check(PASS, "tmfifo", f"{TMFIFO} has {','.join(slash30)}", hard=False)
    return _check(WARN, "tmfifo", f"{TMFIFO} without a /30 IPv4 ({','.join(v4) or 'none'})",
                  f"assign 192.168.100.1/30 to {TMFIFO}", hard=False)


# -- service history and reboot state ------------------------------------------------------------


def check_historical_service(host: HostRoot) -> ParityCheck:
    """Either historical unit name is accepted as evidence with WARN; behaviour is judged by the other checks."""
    found = [f"{d}/{name}.service" for name in HISTORICAL_SERVICES for d in UNIT_DIRS if host.exists(f"{d}/{name}.service")]
    fix = "converge on one agent-verified network baseline; behaviour checks (ovs_bridge, nat, ip_forward) decide"
    if found:
        return _check(WARN, "historical_network_service", f"historical evidence only: {','.join(found)}", fix, hard=False)
    return _check(WARN, "historical_network_service",
                  f"neither {' nor '.join(HISTORICAL_SERVICES)} is installed: nothing proven to re-apply the network after reboot",
                  fix, hard=False)


def check_reboot_required(host: HostRoot) -> ParityCheck:
    if host.exists(REBOOT_REQUIRED):
        return _check(WARN, "reboot_required", f"{REBOOT_REQUIRED} present", "reboot the host to apply staged kernel/boot changes", hard=False)
    return _check(PASS, "reboot_required", f"{REBOOT_REQUIRED} absent", hard=False)
