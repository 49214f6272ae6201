"""The agent's configuration file (JSON or TOML), validated into :class:`AgentConfig`.

Unknown keys are refused, not ignored: a misspelt ``heartbeat_interval`` that
silently falls back to a default is a fleet-wide surprise. Errors name the key
and what was wrong with it.
"""

from __future__ import annotations

import json
import tomllib
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from gpuaas_agent.contract.tasks import TaskType
from gpuaas_agent.contract.types import BRIDGE_NAME_PATTERN
from gpuaas_agent.errors import AgentError

DEFAULT_STATE_DIR = Path("/var/lib/gpuaas-agent")


class ConfigError(AgentError):
    default_code = "config_invalid"


def _default_concurrency() -> dict[TaskType, int]:
    from gpuaas_agent.control.worker import DEFAULT_CONCURRENCY  # one source of the defaults

    return dict(DEFAULT_CONCURRENCY)


class SliceConfig(BaseModel):
    """Where this host's slice plumbing lives: the OVS bridge and ovsdb, dnsmasq's files, libvirt, caches.

    Defaults are the production layout of seed 002 Phase 6 (private NAT on ovsbr0,
    10.100.0.0/24, gateway .1); the lab-in-a-box points them at its private daemons.
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
    nameservers: tuple[IPv4Address, ...] = (IPv4Address("10.100.0.1"),)
    readiness_timeout_s: float = Field(default=900.0, gt=0)
    clone_timeout_s: float = Field(default=3600.0, gt=0)
    # Only the lab sets these: TCG domains (profile domain_type=qemu) and http images from 127.0.0.1.
    allow_emulated_domains: bool = False
    allow_loopback_http: bool = False

    @model_validator(mode="after")
    def _gateway_in_subnet(self) -> "SliceConfig":
        if self.gateway not in self.subnet or self.gateway in (self.subnet.network_address,
                                                                 self.subnet.broadcast_address):
            raise ValueError(f"gateway {self.gateway} is not a host address of {self.subnet}")
        return self


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    state_dir: Path = DEFAULT_STATE_DIR
    host_root: Path = Path("/")
    nats_url: str = Field(default="nats://127.0.0.1:4222", pattern=r"^(nats|tls)://")
    # In the state dir, not /etc: the unit's ProtectSystem=strict keeps /etc read-only, and the
    # agent must delete the token after enrolling. cloud-init writes it there, root 0600.
    token_file: Path = DEFAULT_STATE_DIR / "bootstrap-token"
    concurrency: dict[TaskType, PositiveInt] = Field(default_factory=_default_concurrency)
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
    slice: SliceConfig = Field(default_factory=SliceConfig)

    @model_validator(mode="after")
    def _keepalive_below_ack_wait(self) -> "AgentConfig":
        if self.keepalive_interval_s * 2 > self.ack_wait_s:
            raise ValueError("keepalive_interval_s must be at most half of ack_wait_s, or JetStream redelivers running tasks")
        return self

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


def parse_config(data: dict, *, source: str = "<config>") -> AgentConfig:
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
