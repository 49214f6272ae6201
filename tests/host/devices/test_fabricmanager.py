"""The Fabric Manager client: fmpm's real argv and timeout, answered from recorded fmpm output (fixtures/)."""

from __future__ import annotations

import json

import pytest

from gpuaas_agent.config import ConfigError, parse_config
from gpuaas_agent.host.devices.fabricmanager import FabricManager, FabricManagerError, parse_partition_list, pci_address
from gpuaas_agent.tasks.drivers import fabric_manager
from tests.support.deadline import run_bounded
from tests.support.fabric_manager import GPUS, LIST, recorded_answer, recorded_fm


def test_the_recorded_list_parses_into_the_hgx_partitions():
    listed = parse_partition_list(LIST.read_text())
    assert listed.max_partitions == 64 and len(listed.partitions) == 15
    sizes = [len(p.gpus) for p in listed.partitions]
    assert sizes == [8, 4, 4, 2, 2, 2, 2] + [1] * 8
    assert listed.by_id(3).gpu_addresses == {GPUS[0], GPUS[1]}
    assert listed.by_id(0).gpus[1].pci_address == "0000:3a:00.0"  # from FM's "00000000:3A:00.0"
    assert not any(p.active for p in listed.partitions)


@pytest.mark.parametrize("text", ["", "Failed to get partition list. fmReturn: -2\n", '{"partitionInfo": [',
                                  '{"numPartitions": 2, "maxNumPartitions": 64, "partitionInfo": []}'])
def test_output_that_is_not_a_partition_list_is_refused(text):
    with pytest.raises(FabricManagerError) as err:
        parse_partition_list(text)
    assert err.value.code == "fm_output_invalid"


def test_pci_bus_ids_are_normalised():
    assert pci_address("00000000:9A:00.0") == "0000:9a:00.0"
    assert pci_address("0000:9a:00.0") == "0000:9a:00.0"
    with pytest.raises(ValueError):
        pci_address("GPU-1")


def test_activate_and_deactivate_are_read_back(tmp_path):
    fm, replay = recorded_fm(tmp_path)

    async def body():
        partition = await fm.activate(3)
        assert partition.active and replay.active == [3]
        assert (await fm.deactivate(3)).active is False
    run_bounded(body(), 60)
    assert [c[:2] for c in replay.calls] == [["-a", "3"], ["-l"], ["-d", "3"], ["-l"]]


def test_activation_refused_in_use_names_fm_return(tmp_path):
    fm, replay = recorded_fm(tmp_path, answers={"-a 1": recorded_answer("fmpm-a.in-use.out", 249)})
    with pytest.raises(FabricManagerError) as err:
        run_bounded(fm.activate(1), 60)
    assert err.value.code == "fm_refused"
    assert err.value.evidence["fm_return"] == "FM_ST_IN_USE" and err.value.evidence["returncode"] == 249
    assert replay.active == []


def test_activation_nvlink_error_is_a_refusal(tmp_path):
    fm, _ = recorded_fm(tmp_path, answers={"-a 0": recorded_answer("fmpm-a.nvlink-error.out", 246)})
    with pytest.raises(FabricManagerError) as err:
        run_bounded(fm.activate(0), 60)
    assert (err.value.code, err.value.evidence["fm_return"]) == ("fm_refused", "FM_ST_NVLINK_ERROR")


def test_fabric_manager_not_running_is_unavailable(tmp_path):
    fm, _ = recorded_fm(tmp_path, answers={"-l": recorded_answer("fmpm.connect-failed.out", 247)})
    with pytest.raises(FabricManagerError) as err:
        run_bounded(fm.partitions(), 60)
    assert err.value.code == "fm_unavailable"
    assert err.value.evidence["fm_return"] == "FM_ST_CONNECTION_NOT_VALID"


def test_fmpm_not_installed_is_unavailable(tmp_path):
    with pytest.raises(FabricManagerError) as err:
        run_bounded(FabricManager(fmpm=str(tmp_path / "no-fmpm")).partitions(), 60)
    assert err.value.code == "fm_unavailable" and err.value.evidence["cause"] == "command_not_found"


def test_a_hanging_fmpm_is_killed_at_its_timeout(tmp_path):
    fm, _ = recorded_fm(tmp_path, timeout_s=1.0, hang=["-a 4"])
    with pytest.raises(FabricManagerError) as err:
        run_bounded(fm.activate(4), 60)
    assert err.value.code == "fm_unavailable" and err.value.evidence["cause"] == "command_timeout"


def test_fm_restarting_right_after_activation_is_not_an_activation(tmp_path):
    fm, replay = recorded_fm(tmp_path, restart_after=["-a 3"])
    with pytest.raises(FabricManagerError) as err:
        run_bounded(fm.activate(3), 60)
    assert err.value.code == "fm_activation_unverified"
    assert err.value.evidence == {"partition_id": 3, "listed": "inactive"}


def test_restore_is_verified_and_catches_an_fmpm_that_sends_an_empty_list(tmp_path):
    fm, replay = recorded_fm(tmp_path)
    assert [p.partition_id for p in run_bounded(fm.set_activated([5, 3]), 60).partitions if p.active] == [3, 5]
    assert replay.calls[0][:2] == ["--set-activated-list", "3,5"]
    replay.update(active=[], ignore_set_activated=True)  # fmpm 1.0.1: *numPartitions++ sends no partition
    with pytest.raises(FabricManagerError) as err:
        run_bounded(fm.set_activated([3, 5]), 60)
    assert err.value.code == "fm_restore_unverified" and err.value.evidence["inactive"] == [3, 5]


def test_the_hostname_reaches_fmpm_and_no_socket_option_is_ever_sent(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[1])
    listed = run_bounded(FabricManager(fmpm=fm.fmpm, hostname="10.0.0.7").partitions(), 60)
    assert replay.calls[-1] == ["-l", "--hostname", "10.0.0.7"]
    assert [p.partition_id for p in listed.partitions if p.active] == [1]
    run_bounded(fm.partitions(), 60)
    assert replay.calls[-1] == ["-l"]  # unset: fmpm's own default, 127.0.0.1 over TCP


def test_a_unix_socket_setting_is_refused_with_what_fmpm_really_does():
    # fmpm.cpp overwrites the socket path with --hostname and sets addressIsUnixSocket = 0 before fmConnect:
    # a unix_socket key would look honoured and never be; the config says so instead.
    with pytest.raises(ConfigError) as err:
        parse_config({"slice": {"fabric_manager": {"unix_socket": "/run/nvidia-fabricmanager/fm.sock"}}})
    assert "fmpm ignores --unix-domain-socket" in err.value.message
    assert "slice.fabric_manager" in err.value.message and "hostname" in err.value.message


def test_replayed_list_is_fmpm_styled_json(tmp_path):
    fm, replay = recorded_fm(tmp_path, active=[1])
    listed = run_bounded(fm.partitions(), 60)
    assert [p.partition_id for p in listed.partitions if p.active] == [1]
    assert json.loads(LIST.read_text())["numPartitions"] == 15


def test_the_config_table_builds_the_client_and_its_absence_builds_none():
    config = parse_config({"slice": {"fabric_manager": {"hostname": "127.0.0.1", "timeout_s": 12}}})
    fm = fabric_manager(config.slice.fabric_manager)
    assert (fm.fmpm, fm.timeout_s, fm.hostname) == ("/usr/bin/fmpm", 12.0, "127.0.0.1")
    assert fabric_manager(parse_config({}).slice.fabric_manager) is None
