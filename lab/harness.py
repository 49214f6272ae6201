"""The lab-in-a-box: every real component of a slice host on one machine, driven over the wire.

Started in order, stopped in reverse (by PID), whatever failed:

1. ``nats-server -js`` on 127.0.0.1 and the test control plane (``tests/support/controlplane.py``), in the supported
   layout: operator mode with a full resolver, an account per node and streams per node
   (``gpuaas_agent/control/accounts.py``, ``control/streams.py``; the node enrolls over the bootstrap
   account into an account of its own). The lanes that install the node as a package keep one shared
   account (:attr:`Lab.account_per_node`);
2. a real Open vSwitch (ovsdb-server + ovs-vswitchd, netdev datapath) in the root
   namespace, its bridge owning the lab gateway address;
3. dnsmasq serving only the agent's reservations on that bridge;
4. a libvirt daemon started by hand (``qemu:///system``), reaching the private ovsdb;
5. the recorded 8xH200 host with loop devices as slot disks (``lab/loophost.py``);
6. the lab guest image (``lab/build_guest_image.py``), offered to the agent as a
   ``file://`` URL with its sha256: the agent verifies and clones it itself;
7. the agent: ``gpuaas-agent enroll`` with a one-time token, then ``gpuaas-agent run``.

Used by ``lab/run_lab.py`` (the README's first command) and by the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpuaas_agent.contract.slots import ApprovedSlot, SlotStatus  # noqa: E402
from gpuaas_agent.contract.tasks import TaskResult  # noqa: E402
from lab.fixture_hosts import H200, fixture_host  # noqa: E402
from lab.loophost import LoopHost, materialize  # noqa: E402
from lab.subnet import subnet_routed_elsewhere  # noqa: E402
from tests.natsauth.fleet import FleetOperator  # noqa: E402
from tests.support.controlplane import ControlPlane  # noqa: E402
from tests.support.daemons import stop_pid  # noqa: E402

AGENT = REPO / ".venv/bin/gpuaas-agent"
DEFAULT_FIXTURE_NAME = H200  # the 8x H200 host, materialised by lab/fixture_hosts.py on first use
IMAGE_CACHE = Path(os.environ.get("GPUAAS_LAB_CACHE", "/var/cache/gpuaas-agent-lab"))
LAB_PROFILE = "lab_tcg_1c_512m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_creds(path: Path, text: str) -> Path:
    """A creds file the agent accepts (0600: it refuses creds others can read)."""
    path.write_text(text)
    path.chmod(0o600)
    return path


def _sh(*argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check)


def _wait(predicate, what: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what}: process exited {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)  # poll step of a deadline wait


@dataclass
class LabSettings:
    workdir: Path
    fixture: Path = field(default_factory=lambda: fixture_host(DEFAULT_FIXTURE_NAME))
    slots: int = 8
    disk_bytes: int = 256 << 20
    subnet: IPv4Network = IPv4Network("10.231.0.0/24")
    readiness_timeout_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    say: object = print  # progress lines for people; tests pass a quiet one
    # The fresh-host lane (tests/deploy/test_fresh_host.py): the agent the .deb installed, and the package's
    # default state dir, seed-ISO dir and terminal relay key (made by its prepare-host, not by the lab).
    agent_binary: Path = AGENT
    use_package_paths: bool = False
    # The config the user-data installed (/etc/gpuaas-agent/agent.toml): when set, the node runs with it as
    # written, [slice] and all; the lab adds only top-level keys of its recorded host (host_root, timers).
    installed_config: Path | None = None
    # The supported NATS layout: an account per node and streams per node (docs/security-auth.md). False: one shared
    # account and shared streams (the reply-subject and forged-ack holes stay open; a lane that needs it says why).
    account_per_node: bool = True


@dataclass
class Lab:
    settings: LabSettings
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    nats_url: str = ""
    cp: ControlPlane | None = None
    node_id: str = ""
    bridge: str = ""
    ovs_env: dict = field(default_factory=dict)
    ovs_remote: str = ""
    host: LoopHost | None = None
    image_path: Path | None = None
    image_sha256: str = ""
    tenant_key: str = ""
    tenant_key_file: Path | None = None
    config_path: Path | None = None
    approved: list[ApprovedSlot] = field(default_factory=list)
    switch: object = None  # tests/support/ovsdb_fixture.py's OvsSwitch
    libvirtd: object = None  # tests/support/libvirtd_fixture.py's LibvirtDaemon
    upstream: object = None  # lab/upstream.py: the NAT and the network beyond it (issue 16)
    operator: FleetOperator | None = None  # the account-per-node layout's operator (signs every account)
    bootstrap_creds: Path | None = None  # the shared enrollment login the node's config names

    @property
    def account_per_node(self) -> bool:
        """Whether this lab runs the supported layout. The lanes that install the node as a package
        (``use_package_paths``, ``installed_config``: tests/deploy) keep one shared account: neither cloud-init's
        user-data nor the package carries the bootstrap login (``nats_enroll_creds_file``) an operator-mode
        server asks the enrollment for."""
        return (self.settings.account_per_node and self.settings.installed_config is None
                and not self.settings.use_package_paths)

    @property
    def work(self) -> Path:
        return self.settings.workdir

    @property
    def state_dir(self) -> Path:
        if self.settings.use_package_paths:
            from gpuaas_agent.config import DEFAULT_STATE_DIR

            return DEFAULT_STATE_DIR
        return self.work / "state"

    @property
    def gateway(self) -> str:
        return str(self.settings.subnet.network_address + 1)

    def say(self, line: str) -> None:
        self.settings.say(line)

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> Lab:
        if os.geteuid() != 0:
            raise SystemExit("the lab needs root: loop devices, OVS, dnsmasq, libvirtd")
        try:
            await self.start_services()
            await self.start_node()
        except BaseException:
            await self.stop()
            raise
        return self

    async def start_services(self) -> None:
        """Everything around the node: NATS + control plane, OVS, dnsmasq, libvirtd, the host, the image."""
        self.work.mkdir(parents=True, exist_ok=True)
        self.work.chmod(0o755)  # QEMU (libvirt-qemu) opens the seed ISOs under it
        self._start_nats()
        await self._start_control_plane()
        self._start_ovs()
        self._start_dnsmasq()
        self._start_libvirtd()
        self._start_upstream()
        self._make_host()
        self._make_image()

    async def start_node(self) -> None:
        """The node, as its unit would start it: config, (prepare-host), enroll, run."""
        self._make_keys()
        self._write_config()
        if self.settings.use_package_paths:
            await self._prepare_host()
        await self._enroll()
        self.start_agent()

    def _start_nats(self, port: int | None = None) -> None:
        port = port or _free_port()
        store = self.work / "nats"
        store.mkdir(exist_ok=True)
        log = self.work / "nats.log"
        argv = ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
        if self.account_per_node:
            # Operator mode with a full resolver (its pushed accounts kept in nats-jwt/ across a restart).
            config = self.work / "nats.conf"
            if self.operator is None:
                self.operator = FleetOperator()
                (self.work / "nats-jwt").mkdir(exist_ok=True)
                config.write_text(self.operator.resolver_config(self.work / "nats-jwt"))
            argv += ["-c", str(config)]
        with open(log, "wb") as out:
            self.procs["nats"] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.nats_url = f"nats://127.0.0.1:{port}"

        def answers() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        _wait(answers, "nats-server", 20, self.procs["nats"], log)
        self.say(f"lab: nats-server -js on {self.nats_url} (pid {self.procs['nats'].pid})")

    async def _start_control_plane(self) -> None:
        if not self.account_per_node:
            self.cp = await ControlPlane.connect(self.nats_url)
            await self.cp.create_streams()
            await self.cp.serve_enrollment()
            self.say("lab: control plane: task/result streams, enrollment on gpuaas.enroll (one shared account)")
            return
        assert self.operator is not None  # made with the server's config
        creds = self.work / "creds"
        creds.mkdir(mode=0o700, exist_ok=True)
        plane_login, _ = self.operator.user("control-plane")
        self.cp = await ControlPlane.connect(self.nats_url, operator=self.operator, per_node_streams=True,
                                             user_credentials=str(_write_creds(creds / "plane.creds", plane_login)))
        await self.cp.connect_system(str(_write_creds(creds / "sys.creds", self.operator.system_user())))
        self.bootstrap_creds = _write_creds(creds / "bootstrap.creds", self.operator.bootstrap_user())
        await self.cp.create_streams()
        await self.cp.serve_enrollment()
        self.say("lab: control plane: an account and task/result streams per node, made at enrollment; "
                 "enrollment on gpuaas.enroll over the bootstrap account")

    def _start_ovs(self) -> None:
        from tests.support.ovsdb_fixture import running_ovs

        routes = json.loads(_sh("ip", "-j", "route", "show", "table", "main", timeout=10).stdout or "[]")
        held = subnet_routed_elsewhere(routes, self.settings.subnet)
        if held:
            raise RuntimeError(
                f"lab: {self.settings.subnet} is already routed on this machine ({'; '.join(held)}): the guests' "
                "replies would leave through that device, not the lab's bridge. A lab or test run killed before its "
                "teardown leaves its bridge holding the gateway; check it is no longer used, then "
                "`ip link del <device>`, or run the lab on another subnet.")

        sw = self.stack.enter_context(running_ovs(root_netns=True))
        self.switch = sw
        self.bridge, self.ovs_env, self.ovs_remote = sw.bridge, sw.env, sw.remote
        prefix = self.settings.subnet.prefixlen
        _sh("ip", "addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        self.say(f"lab: OVS bridge {self.bridge} (netdev datapath) owns {self.gateway}/{prefix}; ovsdb {sw.remote}")

    def dnsmasq_argv(self) -> list[str]:
        """The lab's dnsmasq: reservations only, on the bridge; files under <work>/dnsmasq (made here)."""
        d = self.work / "dnsmasq"
        d.mkdir(exist_ok=True)
        (d / "hosts").touch()
        net = self.settings.subnet
        log = self.work / "dnsmasq.log"
        return ["dnsmasq", "--keep-in-foreground", "--user=root", "--port=0", "--conf-file=/dev/null",
                f"--interface={self.bridge}", "--bind-interfaces", "--except-interface=lo",
                f"--dhcp-range={net.network_address},static,{net.netmask},12h",
                f"--dhcp-hostsfile={d / 'hosts'}", f"--dhcp-leasefile={d / 'leases'}",
                f"--pid-file={d / 'dnsmasq.pid'}", "--log-dhcp", f"--log-facility={log}"]

    def _start_dnsmasq(self) -> None:
        d, log = self.work / "dnsmasq", self.work / "dnsmasq.log"
        argv = self.dnsmasq_argv()
        self.procs["dnsmasq"] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.STDOUT)
        _wait(lambda: (d / "dnsmasq.pid").exists() and (d / "dnsmasq.pid").read_text().strip(),
              "dnsmasq pid file", 20, self.procs["dnsmasq"], log)
        self.say(f"lab: dnsmasq (pid {self.procs['dnsmasq'].pid}) serves reservations only, on {self.bridge}")

    def _start_libvirtd(self) -> None:
        from tests.support.libvirtd_fixture import running_libvirtd

        d = self.stack.enter_context(running_libvirtd(self.work / "libvirtd", extra_env=self.ovs_env))
        self.libvirtd = d
        self.say(f"lab: libvirtd (pid {d.pid}) on {d.uri}, OVS_RUNDIR -> the lab ovsdb")

    def _start_upstream(self) -> None:
        from lab.upstream import Upstream

        self.upstream = Upstream(self.settings.subnet, self.work).start()
        self.stack.callback(self.upstream.close)
        self.say(f"lab: NAT MASQUERADE for {self.settings.subnet}, ip_forward=1; upstream netns {self.upstream.netns} "
                 f"listens on {self.upstream.peer_ip}:{self.upstream.port} (host end {self.upstream.host_ip})")

    def _make_host(self) -> None:
        self.host = materialize(self.settings.fixture, self.work / "host", disk_bytes=self.settings.disk_bytes,
                                slots=self.settings.slots)
        self.stack.callback(self.host.close)
        loops = ", ".join(f"slot{d.slot_index}={d.loop}" for d in self.host.disks)
        self.say(f"lab: host root {self.host.root} ({self.settings.fixture.name}); slot disks: {loops}")

    def _make_image(self) -> None:
        from lab.build_guest_image import build_guest_image

        # A directory of its own: it is the agent's slice.image_file_dir, the only place file:// images may come from.
        source_dir = self.work / "image-source"
        source_dir.mkdir(exist_ok=True)
        path = Path(build_guest_image(source_dir, IMAGE_CACHE))
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        self.image_path, self.image_sha256 = path, h.hexdigest()
        self.say(f"lab: guest image {path} sha256={self.image_sha256[:16]}...")

    def _make_keys(self) -> None:
        keys = self.work / "keys"
        keys.mkdir(exist_ok=True)
        for name in ("tenant",) if self.settings.use_package_paths else ("relay", "tenant"):
            if not (keys / name).exists():
                _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpuaas-lab-{name}", "-f", str(keys / name))
        self.tenant_key = (keys / "tenant.pub").read_text().strip()
        self.tenant_key_file = keys / "tenant"

    def slice_settings(self) -> dict:
        """The lab's ``[slice]`` table: its bridge, ovsdb, dnsmasq files, libvirt, image dir, lab switches.

        In package mode the seed dir and relay key are left to the package's defaults (prepare-host made them).
        """
        d = self.work / "dnsmasq"
        table = {
            "subnet": str(self.settings.subnet),
            "gateway": self.gateway,
            "ovs_bridge": self.bridge,
            "ovsdb_remote": self.ovs_remote,
            "libvirt_uri": "qemu:///system",
            "dnsmasq_hosts_file": str(d / "hosts"),
            "dnsmasq_lease_file": str(d / "leases"),
            "dnsmasq_pid_file": str(d / "dnsmasq.pid"),
            "seed_dir": str(self.work / "seeds"),
            "console_log_dir": str(self.work / "console"),
            "image_cache_dir": str(self.work / "images"),
            "image_file_dir": str(self.image_path.parent),
            "terminal_relay_key_file": str(self.work / "keys/relay.pub"),
            "nameservers": [self.gateway],
            "readiness_timeout_s": self.settings.readiness_timeout_s,
            "allow_emulated_domains": True,
            "readiness_egress_target": {"ip": self.upstream.peer_ip, "port": self.upstream.port},
            "readiness_egress_timeout_s": 30,
            # A power operation may wait the payload's whole graceful timeout (up to the wire's 3600 s): the
            # hostile-load test's reboot of a guest that ignores ACPI must outlast its neighbour's work by far.
            "max_graceful_timeout_s": 3600,
            # TCG guests answer an SSH handshake far slower than KVM ones, and slower still while other lab
            # guests boot: the hostile-load test's nine sessions once timed out at the 15 s default (a 2-core
            # VM under load). The default stays what a real host gets.
            "terminal": {"connect_timeout_s": 60},
        }
        if self.settings.use_package_paths:
            for key in ("seed_dir", "terminal_relay_key_file"):
                del table[key]
        return table

    def _write_config(self) -> None:
        state = self.work / "state"
        seeds = self.work / "seeds"
        if not self.settings.use_package_paths:
            state.mkdir(mode=0o700, exist_ok=True)
            seeds.mkdir(exist_ok=True)
            seeds.chmod(0o755)
            (self.work / "console").mkdir(mode=0o700, exist_ok=True)  # prepare-host's job on a real host
        config = {
            "state_dir": str(state),
            "host_root": str(self.host.root),
            "nats_url": self.nats_url,
            "insecure": True,  # the lab's nats-server is plaintext on loopback
            "token_file": str(state / "bootstrap-token"),
            "heartbeat_interval_s": self.settings.heartbeat_interval_s,
            "reconcile_interval_s": 120.0,
            "health_network_live": True,  # recorded hardware, real slice network: the checks read it live
            "shutdown_grace_s": 30.0,
            "slice": self.slice_settings(),
        }
        if self.bootstrap_creds is not None:  # the account-per-node layout: enroll over the bootstrap account
            config["nats_enroll_creds_file"] = str(self.bootstrap_creds)
        if self.settings.use_package_paths:
            # Left to the agent's defaults, which are the package's: prepare-host made them.
            for key in ("state_dir", "token_file"):
                del config[key]
        if self.settings.installed_config is not None:
            from gpuaas_agent.compat import tomllib

            installed = tomllib.loads(self.settings.installed_config.read_text())
            lab_only = {k: config[k] for k in ("host_root", "heartbeat_interval_s", "reconcile_interval_s",
                                               "health_network_live", "shutdown_grace_s")}
            config = {**installed, **lab_only}  # [slice], nats_url, token_file: as cloud-init wrote them
        self.config_path = self.work / "agent.json"
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")

    async def _prepare_host(self) -> None:
        """The unit's first two ExecStartPre= lines: prepare-host, then its --check."""
        for extra in ((), ("--check",)):
            done = await asyncio.to_thread(_sh, str(self.settings.agent_binary), "prepare-host", *extra, "--config",
                                           str(self.config_path), timeout=60, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"gpuaas-agent prepare-host {' '.join(extra)} failed ({done.returncode}): "
                                   f"{done.stderr.strip()}")
            self.say(f"lab: prepare-host {' '.join(extra)}\n{done.stdout.rstrip()}")

    async def _enroll(self) -> None:
        record_file = self.state_dir / "enrollment.json"
        if not record_file.exists():  # else enrolled already (cloud-init): enroll is the unit's no-op ExecStartPre
            token_file = self.state_dir / "bootstrap-token"
            token_file.write_text(self.cp.issue_token() + "\n")
            token_file.chmod(0o600)
        done = await asyncio.to_thread(_sh, str(self.settings.agent_binary), "enroll", "--config", str(self.config_path),
                                       timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"gpuaas-agent enroll failed ({done.returncode}): {done.stderr.strip()}")
        record = json.loads(record_file.read_text())
        self.node_id = record["node_id"]
        self.say(f"lab: agent enrolled as node {self.node_id}")
        await self.sync_consumer()

    async def sync_consumer(self) -> None:
        """The control plane (re)creates the node's consumer as the agent's config expects it (ack_wait...):
        the node cannot create or change it. Call again after changing the config's ack_wait_s or concurrency."""
        from gpuaas_agent.config import load_config
        from gpuaas_agent.daemon import worker_settings

        await self.cp.create_node_consumer(self.node_id, worker_settings(load_config(self.config_path)))

    def start_agent(self, extra_env: dict[str, str] | None = None) -> None:
        log = self.work / "agent.log"
        out = open(log, "ab")
        env = {**os.environ, **self.ovs_env, **(extra_env or {})}
        self.procs["agent"] = subprocess.Popen([str(self.settings.agent_binary), "run", "--config", str(self.config_path)], env=env,
                                               stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()
        self.say(f"lab: gpuaas-agent run (pid {self.procs['agent'].pid}), log {log}")

    def stop_agent(self, timeout: float = 60) -> int | None:
        proc = self.procs.pop("agent", None)
        stop_pid(proc, timeout)
        return None if proc is None else proc.returncode

    # -- driving -----------------------------------------------------------------------------

    async def task(self, task_type: str, payload: dict, *, deadline_s: float = 900, timeout: float = 900,
                   task_id: str | None = None) -> TaskResult:
        envelope = self.cp.envelope(self.node_id, task_type, payload, deadline_s=deadline_s, task_id=task_id)
        await self.cp.enqueue(envelope)
        return await self.cp.wait_result(envelope.task_id, timeout=timeout)

    async def submit(self, task_type: str, payload: dict, *, deadline_s: float = 900) -> str:
        envelope = self.cp.envelope(self.node_id, task_type, payload, deadline_s=deadline_s)
        await self.cp.enqueue(envelope)
        return envelope.task_id

    async def approve_slots(self) -> list[ApprovedSlot]:
        """``slice.topology_discover``, then approve every complete candidate slot (the operator's step)."""
        result = await self.task("slice.topology_discover",
                                 {"subnet": str(self.settings.subnet), "ovs_bridge": self.bridge}, timeout=120)
        if result.status.value != "succeeded":
            raise RuntimeError(f"topology_discover failed: {result.error}")
        report = result.output.get("report", result.output)
        disks = {d.by_id for d in self.host.disks}
        self.approved = [
            ApprovedSlot(slot_id=f"lab-slot-{s['slot_index']}", slot_index=s["slot_index"],
                         gpu_pci_address=s["gpu_pci_address"], nvme_device=s["nvme_device"],
                         storage_identity_kind=s["storage_identity_kind"],
                         fabric_vf_pci_address=s["fabric_vf_pci_address"], fabric_claim_mode=s["fabric_claim_mode"],
                         mac=s["mac"], private_ip=s["private_ip"], ovs_bridge=self.bridge,
                         numa_node=s.get("numa_node"), status=SlotStatus.reserved)
            for s in report["candidate_slots"] if not s["blockers"] and s["nvme_device"] in disks
        ]
        return self.approved

    def provision_payload(self, slot: ApprovedSlot, *, allocation_id: str | None = None,
                          sha256: str | None = None) -> dict:
        return {
            "allocation_id": allocation_id or str(uuid.uuid4()),
            "slot": slot.model_dump(mode="json"),
            "image": {"url": f"file://{self.image_path}", "sha256": sha256 or self.image_sha256},
            "runtime_profile": LAB_PROFILE,
            "hostname": f"lab-slice-{slot.slot_index}",
            "user": "tenant",
            "ssh_authorized_keys": [self.tenant_key],
        }

    @staticmethod
    def release_payload(allocation_id: str, slot: ApprovedSlot, graceful_timeout_s: int = 60) -> dict:
        return {"allocation_id": allocation_id, "slot": slot.model_dump(mode="json"),
                "graceful_timeout_s": graceful_timeout_s}

    @staticmethod
    def domains() -> dict[str, str]:
        """Agent domains on this machine's libvirt and their state (the lab's own view, not the agent's)."""
        import libvirt

        from gpuaas_agent.contract.naming import DOMAIN_PREFIX

        names = {libvirt.VIR_DOMAIN_RUNNING: "running", libvirt.VIR_DOMAIN_SHUTOFF: "shut off"}
        conn = libvirt.open("qemu:///system")
        try:
            return {d.name(): names.get(d.state()[0], str(d.state()[0])) for d in conn.listAllDomains()
                    if d.name().startswith(DOMAIN_PREFIX)}
        finally:
            conn.close()

    # -- outages (the crash harness restarts each service under the node) --------------------

    def restart_nats(self) -> None:
        """Stop nats-server and start it again on the same port and JetStream store."""
        stop_pid(self.procs.pop("nats", None))
        self._start_nats(int(self.nats_url.rsplit(":", 1)[1]))

    def restart_dnsmasq(self) -> None:
        stop_pid(self.procs.pop("dnsmasq", None))
        (self.work / "dnsmasq" / "dnsmasq.pid").unlink(missing_ok=True)
        self._start_dnsmasq()

    def restart_vswitchd(self) -> None:
        """SIGKILL ovs-vswitchd and start it on the same db (its OpenFlow rules are gone, as after a crash)."""
        self.switch.restart_vswitchd()

    def restart_libvirtd(self) -> None:
        """Stop libvirtd (running domains keep running) and start it again; returns once it answers."""
        from tests.support.libvirtd_fixture import restart_libvirtd

        restart_libvirtd(self.libvirtd)

    # -- stop --------------------------------------------------------------------------------

    async def stop(self) -> list[str]:
        """Stop everything started, in reverse; returns what could not be undone (also printed)."""
        problems: list[str] = []
        self.stop_agent()
        with contextlib.suppress(Exception):
            await self._destroy_lab_domains()
        self._drop_guard_tables()
        if self.cp is not None:
            with contextlib.suppress(Exception):
                await self.cp.close()
            self.cp = None
        stop_pid(self.procs.pop("dnsmasq", None))
        try:
            self.stack.close()  # host loops, libvirtd, OVS (reverse order of entry)
        except Exception as exc:  # keep going: NATS still has to stop
            problems.append(f"teardown: {exc}")
        stop_pid(self.procs.pop("nats", None))
        for problem in problems:
            self.say(f"lab: cleanup problem: {problem}")
        return problems

    @staticmethod
    def _drop_guard_tables() -> None:
        """The agent's host-side guard tables live in this (root) namespace: the lab takes them with it."""
        from gpuaas_agent.contract.isolation import GUARD_TABLE

        for family in ("inet", "arp"):
            _sh("nft", "delete", "table", family, GUARD_TABLE, check=False)

    async def _destroy_lab_domains(self) -> None:
        """A lab that stops mid-provision leaves no domain behind (the agent would have)."""
        import libvirt

        from gpuaas_agent.contract.naming import DOMAIN_PREFIX

        conn = libvirt.open("qemu:///system")
        try:
            for dom in conn.listAllDomains():
                if not dom.name().startswith(DOMAIN_PREFIX):
                    continue
                if dom.isActive():
                    dom.destroy()
                try:
                    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
                except libvirt.libvirtError:
                    dom.undefine()
        finally:
            conn.close()
