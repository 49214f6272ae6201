"""Slice network baseline: converge ovsbr0 + gateway, the dnsmasq subnet config, NAT, ip_forward, tmfifo_net0.

The code behind ``gpuaas-agent network-baseline`` and
``gpuaas-slice-network-baseline.service`` (seed 004: the manual repair script
turned into one idempotent converge). Each piece is checked first and changed
only when it is missing, so a second run reports every step ``unchanged``.
It never starts, restarts or enables dnsmasq: the unit restarts
``dnsmasq.service`` from ``ExecStartPost=`` (seed 004: the script that ran
``systemctl enable --now dnsmasq`` from inside the service looped).

Everything acts on the network namespace the process runs in (``ip netns exec
NS gpuaas-agent network-baseline ...`` targets another one; tests do that) and
on the paths in :class:`BaselineSpec` (the dnsmasq config file, the
``ip_forward`` file), so a test can aim it at a throw-away root.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from enum import Enum
from ipaddress import IPv4Interface
from pathlib import Path
from typing import Any, cast

from pydantic import Field, model_validator

from gpuaas_agent.atomicfile import write_atomic
from gpuaas_agent.contract.base import WireModel
from gpuaas_agent.contract.ovs import BridgeEvidence, IfName
from gpuaas_agent.contract.types import DATAPATH_TYPE_PATTERN
from gpuaas_agent.errors import HostError
from gpuaas_agent.host.network.ovs import OvsDriver
from gpuaas_agent.host.run import Completed, run

DNSMASQ_CONF = Path("/etc/dnsmasq.d/gpuaas-slice-network.conf")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
OVS_REMOTE = "unix:/var/run/openvswitch/db.sock"
REQUIRED_TOOLS = ("ip", "iptables", "dnsmasq")


class BaselineError(HostError):
    """The baseline could not be converged; ``code`` says which piece, ``evidence`` what was seen."""

    default_code = "network_baseline_failed"


class BaselineSpec(WireModel):
    """The slice host's private network, seed 004's values as defaults."""

    bridge: IfName = "ovsbr0"
    gateway: IPv4Interface = IPv4Interface("10.100.0.1/24")
    # First and last DHCP host offsets inside the subnet (seed: .10 - .250 leaves room for fixed hosts).
    dhcp_first_offset: int = Field(default=10, ge=2)
    dhcp_last_offset: int = Field(default=250, ge=2)
    dhcp_lease_time: str = Field(default="12h", pattern=r"^\d+[smhd]?$|^infinite$")
    dhcp_hostsfile: Path | None = None
    dnsmasq_conf: Path = DNSMASQ_CONF
    ip_forward_path: Path = IP_FORWARD
    ovs_remote: str = OVS_REMOTE
    # None keeps OVS's default (the kernel datapath); tests and hosts without the module use "netdev".
    datapath_type: str | None = Field(default=None, pattern=DATAPATH_TYPE_PATTERN)
    nat: bool = True
    tmfifo: bool = False
    tmfifo_interface: IfName = "tmfifo_net0"
    tmfifo_address: IPv4Interface = IPv4Interface("192.168.100.1/30")
    command_timeout_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _range_inside_subnet(self) -> BaselineSpec:
        net = self.gateway.network
        if not self.dhcp_first_offset <= self.dhcp_last_offset < net.num_addresses - 1:
            raise ValueError(f"DHCP offsets {self.dhcp_first_offset}-{self.dhcp_last_offset} do not fit {net}")
        gw_offset = int(self.gateway.ip) - int(net.network_address)
        if self.dhcp_first_offset <= gw_offset <= self.dhcp_last_offset:
            raise ValueError(f"gateway {self.gateway.ip} lies inside the DHCP range")
        return self


class StepOutcome(str, Enum):
    unchanged = "unchanged"
    changed = "changed"
    absent = "absent"  # an optional piece (tmfifo_net0) is not on this host: evidence, not failure


class BaselineStep(WireModel):
    name: str
    outcome: StepOutcome
    detail: str = ""


class BaselineReport(WireModel):
    steps: list[BaselineStep]

    @property
    def changed(self) -> list[str]:
        return [s.name for s in self.steps if s.outcome is StepOutcome.changed]

    def line(self) -> str:
        """The seed's one-line form: ``GPUAAS_SLICE_BASELINE bridge=unchanged nat=changed ...``."""
        return "GPUAAS_SLICE_BASELINE " + " ".join(f"{s.name}={s.outcome.value}" for s in self.steps)


def dnsmasq_config(spec: BaselineSpec) -> str:
    """The subnet config dnsmasq reads from /etc/dnsmasq.d (pure: the same spec gives the same bytes)."""
    net = spec.gateway.network
    first = net.network_address + spec.dhcp_first_offset
    last = net.network_address + spec.dhcp_last_offset
    lines = [
        "# Written by gpuaas-agent network-baseline (gpuaas-slice-network-baseline.service); rewritten on change.",
        f"interface={spec.bridge}",
        # bind-interfaces: coexist with libvirt's own dnsmasq on virbr0 and a resolver on lo.
        "bind-interfaces",
        "except-interface=lo",
        f"dhcp-range={first},{last},{net.netmask},{spec.dhcp_lease_time}",
        f"dhcp-option=option:router,{spec.gateway.ip}",
        f"dhcp-option=option:dns-server,{spec.gateway.ip}",
    ]
    if spec.dhcp_hostsfile is not None:
        lines.append(f"dhcp-hostsfile={spec.dhcp_hostsfile}")
    return "\n".join(lines) + "\n"


def nat_rule(spec: BaselineSpec) -> list[str]:
    """Seed 004's rule exactly: ``-A POSTROUTING -s 10.100.0.0/24 -j MASQUERADE`` (discovery looks for it)."""
    return ["POSTROUTING", "-s", str(spec.gateway.network), "-j", "MASQUERADE"]


def missing_tools() -> list[str]:
    return [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]


class NetworkBaseline:
    """One converge run over the host (or namespace) this process is in."""

    def __init__(self, spec: BaselineSpec) -> None:
        self.spec = spec
        self.steps: list[BaselineStep] = []

    async def converge(self) -> BaselineReport:
        missing = missing_tools()
        if missing:
            raise BaselineError(f"required host tools are not installed: {', '.join(missing)}",
                                code="baseline_tools_missing", evidence={"missing": missing})
        await self._bridge()
        await self._link_up(self.spec.bridge, "bridge_up")
        await self._address(self.spec.bridge, self.spec.gateway, "gateway_address")
        self._hostsfile()
        self._dnsmasq_conf()
        self._ip_forward()
        if self.spec.nat:
            await self._nat()
        if self.spec.tmfifo:
            await self._tmfifo()
        return BaselineReport(steps=self.steps)

    def _step(self, name: str, outcome: StepOutcome, detail: str = "") -> None:
        self.steps.append(BaselineStep(name=name, outcome=outcome, detail=detail))

    async def _ip(self, *args: str, check: bool = True) -> Completed:
        return await run(["ip", *args], timeout=self.spec.command_timeout_s, check=check)

    async def _bridge(self) -> None:
        def ensure() -> BridgeEvidence:
            driver = OvsDriver(self.spec.ovs_remote, timeout_s=self.spec.command_timeout_s)
            try:
                return driver.ensure_bridge(self.spec.bridge, create=True, datapath_type=self.spec.datapath_type)
            finally:
                driver.close()

        evidence = await asyncio.to_thread(ensure)
        self._step("bridge", StepOutcome.changed if evidence.created else StepOutcome.unchanged,
                   f"{self.spec.bridge} datapath={evidence.datapath_type or 'system'}")
        await self._wait_link(self.spec.bridge)

    async def _wait_link(self, name: str) -> None:
        """ovs-vswitchd makes the bridge's netdev after the commit: poll for it with a deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.command_timeout_s
        while True:
            done = await self._ip("-j", "link", "show", "dev", name, check=False)
            if done.returncode == 0:
                return
            if loop.time() > deadline:
                raise BaselineError(f"bridge {name} is in ovsdb but no such network interface appeared; is ovs-vswitchd running?",
                                    code="baseline_bridge_link_missing", evidence={"bridge": name})
            await asyncio.sleep(0.1)

    async def _link(self, name: str) -> dict[str, Any] | None:
        done = await self._ip("-j", "link", "show", "dev", name, check=False)
        if done.returncode != 0:
            return None
        links = json.loads(done.stdout or b"[]")
        return cast("dict[str, Any]", links[0]) if links else None

    async def _link_up(self, name: str, step: str) -> None:
        link = await self._link(name)
        if link is None:
            raise BaselineError(f"interface {name} does not exist", code="baseline_link_missing", evidence={"link": name})
        if "UP" in link.get("flags", []):
            self._step(step, StepOutcome.unchanged, name)
            return
        await self._ip("link", "set", "dev", name, "up")
        self._step(step, StepOutcome.changed, name)

    async def _address(self, name: str, address: IPv4Interface, step: str) -> None:
        done = await self._ip("-j", "-4", "addr", "show", "dev", name)
        have = {
            IPv4Interface(f"{a['local']}/{a['prefixlen']}")
            for entry in json.loads(done.stdout or b"[]")
            for a in entry.get("addr_info", [])
            if a.get("family") == "inet"
        }
        if address in have:
            self._step(step, StepOutcome.unchanged, f"{name} {address}")
            return
        await self._ip("addr", "add", str(address), "dev", name)
        self._step(step, StepOutcome.changed, f"{name} {address}")

    def _hostsfile(self) -> None:
        """The agent's reservations file must exist before dnsmasq is restarted with ``dhcp-hostsfile=`` on it."""
        path = self.spec.dhcp_hostsfile
        if path is None:
            return
        if path.exists():
            self._step("dhcp_hostsfile", StepOutcome.unchanged, str(path))
            return
        # 0755/0644: dnsmasq reads it after dropping to its own user (never inside the 0700 state dir).
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomic(path, b"", mode=0o644)
        self._step("dhcp_hostsfile", StepOutcome.changed, str(path))

    def _dnsmasq_conf(self) -> None:
        path, wanted = self.spec.dnsmasq_conf, dnsmasq_config(self.spec).encode()
        try:
            if path.read_bytes() == wanted:
                self._step("dnsmasq_config", StepOutcome.unchanged, str(path))
                return
        except FileNotFoundError:
            pass
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomic(path, wanted, mode=0o644)  # dnsmasq reads it after dropping to its own user
        self._step("dnsmasq_config", StepOutcome.changed, str(path))

    def _ip_forward(self) -> None:
        path = self.spec.ip_forward_path
        try:
            if path.read_text().strip() == "1":
                self._step("ip_forward", StepOutcome.unchanged, str(path))
                return
            path.write_text("1\n")
        except OSError as exc:
            raise BaselineError(f"cannot enable IPv4 forwarding through {path}: {exc.strerror}",
                                code="baseline_ip_forward_failed", evidence={"path": str(path)}) from None
        self._step("ip_forward", StepOutcome.changed, str(path))

    async def _nat(self) -> None:
        rule = nat_rule(self.spec)
        base = ["iptables", "-w", str(int(self.spec.command_timeout_s)), "-t", "nat"]
        check = await run([*base, "-C", *rule], timeout=self.spec.command_timeout_s, check=False)
        detail = " ".join(rule)
        if check.returncode == 0:
            self._step("nat", StepOutcome.unchanged, detail)
            return
        if check.returncode != 1:  # 1 is "no such rule"; anything else is iptables itself failing
            raise BaselineError(f"iptables -C failed: {check.stderr.decode(errors='replace').strip()}",
                                code="baseline_nat_check_failed",
                                evidence={"argv": [*base, "-C", *rule], "returncode": check.returncode})
        await run([*base, "-A", *rule], timeout=self.spec.command_timeout_s)
        self._step("nat", StepOutcome.changed, detail)

    async def _tmfifo(self) -> None:
        name = self.spec.tmfifo_interface
        if await self._link(name) is None:
            # Seed 004: tmfifo presence is validation evidence, never assumed from bootstrap.
            self._step("tmfifo", StepOutcome.absent, f"{name} not present (no BF3 RShim on this host)")
            return
        await self._link_up(name, "tmfifo_up")
        await self._address(name, self.spec.tmfifo_address, "tmfifo")


async def converge(spec: BaselineSpec) -> BaselineReport:
    """Converge the baseline once; :class:`BaselineError` (or the OVS driver's errors) when a piece cannot be."""
    return await NetworkBaseline(spec).converge()
