"""NUMA node facts a slot's domain is placed with: the node's CPUs and its free 1 GiB hugepages.

Pure reads over a :class:`HostRoot` (a live host or a recorded fixture). The
domain is pinned to the GPU's node (``numatune`` strict), so these are read per
node, never summed over the host: 512 free pages on node 1 do not back a VM
pinned to node 0.
"""

from __future__ import annotations

from gpuaas_agent.contract.domain import cpulist_cpus
from gpuaas_agent.errors import HostError
from gpuaas_agent.hostfs import HostRoot

NODE_DIR = "/sys/devices/system/node/node{node}"
HUGEPAGES_1G_DIR = NODE_DIR + "/hugepages/hugepages-1048576kB"


class NumaReadError(HostError):
    """A NUMA fact the agent needs could not be read; evidence names the path."""

    default_code = "numa_unreadable"


def node_cpulist(host: HostRoot, node: int) -> str:
    """``/sys/devices/system/node/nodeN/cpulist`` as the kernel prints it (``0-55,112-167``)."""
    path = f"{NODE_DIR.format(node=node)}/cpulist"
    try:
        text = host.read_attr(path)
        cpulist_cpus(text)  # refuse junk here, not in the XML
    except (OSError, ValueError) as exc:
        raise NumaReadError(
            f"cannot read the cpulist of NUMA node {node}", evidence={"path": path, "error": str(exc)}
        ) from None
    if not text:
        raise NumaReadError(f"NUMA node {node} has no CPUs", evidence={"path": path, "cpulist": text})
    return text


def free_hugepages_1g(host: HostRoot, node: int) -> int | None:
    """Free 1 GiB pages on ``node``; None when the kernel has no 1 GiB pool there (not configured or no node)."""
    path = f"{HUGEPAGES_1G_DIR.format(node=node)}/free_hugepages"
    try:
        return int(host.read_attr(path))
    except (OSError, ValueError):
        return None
