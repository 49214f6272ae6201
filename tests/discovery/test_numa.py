"""Per-node CPU lists and free 1 GiB hugepages, read from the recorded host and this machine."""

from __future__ import annotations

import pytest

from gpuaas_agent.contract.domain import cpulist_cpus
from gpuaas_agent.discovery.numa import NumaReadError, free_hugepages_1g, node_cpulist
from gpuaas_agent.hostfs import HostRoot
from tests.conftest import fixture_host

H200 = HostRoot.open(fixture_host("h200-slice-after-transition"))


def test_recorded_nodes_cpulists_and_hugepages():
    assert node_cpulist(H200, 0) == "0-55,112-167"
    assert node_cpulist(H200, 1) == "56-111,168-223"
    assert len(cpulist_cpus(node_cpulist(H200, 0))) == 112
    assert free_hugepages_1g(H200, 0) == 256 and free_hugepages_1g(H200, 1) == 256


def test_a_node_that_does_not_exist_is_an_error_or_no_pool():
    with pytest.raises(NumaReadError) as err:
        node_cpulist(H200, 7)
    assert err.value.evidence["path"] == "/sys/devices/system/node/node7/cpulist"
    assert free_hugepages_1g(H200, 7) is None


def test_this_machine_has_node0_with_its_cpus():
    cpus = cpulist_cpus(node_cpulist(HostRoot.open("/"), 0))
    assert cpus and cpus[0] == 0


def test_cpulist_parsing():
    assert cpulist_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ValueError):
        cpulist_cpus("5-2")
