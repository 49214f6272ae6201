"""A host prepared the way the package and the network baseline leave it, for pipeline tests that pass validate.

Validate proves every precondition of the later steps (docs/safety.md §8) against the
real host: so a test that drives a provision past validate needs those to be true,
with real components, not a switch that turns the checks off:

* an OVS bridge (real ovsdb-server + vswitchd, root namespace) owning the gateway;
* a dnsmasq that reads the agent's hosts file and writes the configured pid file;
* a seed dir QEMU's user can traverse, and an ed25519 relay key pair (0600).
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import IPv4Interface
from pathlib import Path

import pytest

from gpuaas_agent.contract.isolation import GUARD_TABLE
from gpuaas_agent.tasks.pipeline import PipelineFailed
from gpuaas_agent.tasks.provision import provision
from lab.fixture_hosts import fixture_host
from lab.loophost import LoopHost, materialize
from tests.support.daemons import stop_pid
from tests.support.ovsdb_fixture import OvsSwitch, running_ovs
from tests.support.realdev import require_root
from tests.support.tiers import starts

GATEWAY = IPv4Interface("10.100.0.1/24")  # SliceConfig's default subnet and gateway


@dataclass
class PreparedHost:
    ovs: OvsSwitch
    work: Path
    relay_key: Path  # the .pub the config names
    dnsmasq: subprocess.Popen

    def stop_dnsmasq(self) -> None:
        """Stop (and reap) the host's dnsmasq, as a crash or a hand-stop would leave it."""
        stop_pid(self.dnsmasq)

    @property
    def bridge(self) -> str:
        return self.ovs.bridge

    def slice_config(self, **over) -> dict:
        """``SliceConfig`` keyword arguments naming this host's plumbing."""
        d = self.work / "dnsmasq"
        return {"ovs_bridge": self.bridge, "ovsdb_remote": self.ovs.remote, "dnsmasq_hosts_file": d / "hosts",
                "dnsmasq_lease_file": d / "leases", "dnsmasq_pid_file": d / "dnsmasq.pid",
                "seed_dir": self.work / "seeds", "terminal_relay_key_file": self.relay_key,
                "allow_emulated_domains": True, **over}


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=60)


@pytest.fixture
@starts("ovs", "netns")
def prepared_host() -> Iterator[PreparedHost]:
    # /var/tmp, 0755: QEMU's user (libvirt-qemu) must traverse to the seed dir; pytest's tmp is 0700.
    work = Path(tempfile.mkdtemp(prefix="gpuaas-prepared-", dir="/var/tmp"))
    work.chmod(0o755)
    (work / "seeds").mkdir(mode=0o755)
    keys = work / "keys"
    keys.mkdir(mode=0o700)
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuaas-relay", "-f", str(keys / "relay"))
    d = work / "dnsmasq"
    d.mkdir()
    (d / "hosts").touch()
    dnsmasq = None
    with running_ovs(root_netns=True) as sw:
        try:
            _run("ip", "addr", "add", str(GATEWAY), "dev", sw.bridge)
            _run("ip", "link", "set", sw.bridge, "up")
            dnsmasq = subprocess.Popen(
                ["dnsmasq", "--keep-in-foreground", "--user=root", "--port=0", "--conf-file=/dev/null",
                 f"--interface={sw.bridge}", "--bind-interfaces", "--except-interface=lo",
                 f"--dhcp-range={GATEWAY.network.network_address},static,{GATEWAY.netmask},12h",
                 f"--dhcp-hostsfile={d / 'hosts'}", f"--dhcp-leasefile={d / 'leases'}",
                 f"--pid-file={d / 'dnsmasq.pid'}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 20
            pid_file = d / "dnsmasq.pid"
            while not (pid_file.exists() and pid_file.read_text().strip() == str(dnsmasq.pid)):
                if dnsmasq.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"dnsmasq did not start (exit {dnsmasq.poll()})", pytrace=False)
                time.sleep(0.05)  # poll step of the deadline wait above
            yield PreparedHost(ovs=sw, work=work, relay_key=keys / "relay.pub", dnsmasq=dnsmasq)
        finally:
            stop_pid(dnsmasq)
            for family in ("inet", "arp"):  # the port isolation's host-side guard, made in the root namespace
                subprocess.run(["nft", "delete", "table", family, GUARD_TABLE], capture_output=True, timeout=30)
            subprocess.run(["rm", "-rf", "--one-file-system", str(work)], timeout=60)


@contextmanager
def slice_loop_host(workdir: Path, *, disk_bytes: int, slots: int = 1) -> Iterator[LoopHost]:
    """The H200 slice host (``h200-slice-after-transition``) with ``slots`` candidate slots on real loop disks of
    ``disk_bytes`` each, under ``workdir`` (root; no by-id link on the real host); closed, leaving nothing, after.

    A module's ``loop_host`` fixture is this with its own sizes (its scope is the module's choice)."""
    require_root()
    host = materialize(fixture_host("h200-slice-after-transition"), workdir, disk_bytes=disk_bytes, slots=slots,
                       real_links=False)
    yield host
    assert host.close() == []


def provision_failure(sh, payload, ctx) -> PipelineFailed:
    """Run the real provision pipeline to its failure (closing the drivers after) and return that failure."""

    async def scenario():
        try:
            await provision(sh, payload, ctx)
        finally:
            await sh.close()

    with pytest.raises(PipelineFailed) as info:
        asyncio.run(scenario())
    return info.value
