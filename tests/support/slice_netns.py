"""A throwaway network namespace holding a healthy private-NAT slice network (ovsbr0, NAT rule, ip_forward).

Used by the network-evidence tests of discovery, the guards, preflight and the parity command;
the namespace, its rule and its sysctl are deleted with it, even when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid

MASQ = ["POSTROUTING", "-s", "10.100.0.0/24", "-j", "MASQUERADE"]


def run_argv(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One test-side command (text output, 20 s timeout); raises on a non-zero exit unless ``check=False``."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=check)


def ns_exec(name: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``argv`` inside network namespace ``name``."""
    return run_argv("ip", "netns", "exec", name, *argv, check=check)


@contextlib.contextmanager
def slice_namespace():
    """A namespace holding a healthy private-NAT slice network: ovsbr0 (a bridge link) owning
    10.100.0.1/24, ``POSTROUTING -s 10.100.0.0/24 -j MASQUERADE`` and ip_forward=1.

    The rule and the sysctl live and die with the namespace; it is deleted even when the test fails.
    """
    name = f"gpuaas-pe-{uuid.uuid4().hex[:8]}"
    run_argv("ip", "netns", "add", name)
    try:
        run_argv("ip", "-n", name, "link", "add", "ovsbr0", "type", "bridge")
        run_argv("ip", "-n", name, "addr", "add", "10.100.0.1/24", "dev", "ovsbr0")
        run_argv("ip", "-n", name, "link", "set", "ovsbr0", "up")
        ns_exec(name, "iptables", "-t", "nat", "-A", *MASQ)
        set_ip_forward(name, 1)  # per namespace: the machine's own value is untouched
        yield name
    finally:
        run_argv("ip", "netns", "del", name, check=False)
        assert not os.path.exists(f"/run/netns/{name}")


def set_ip_forward(name: str, value: int) -> None:
    """The namespace's own net.ipv4.ip_forward (the machine's stays as it is)."""
    ns_exec(name, "sh", "-c", f"echo {value} > /proc/sys/net/ipv4/ip_forward")
