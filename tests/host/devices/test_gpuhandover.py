"""GPU handover between tenants: the reset chosen from sysfs, and each of the tool's answers a typed result.

The host is the synthetic 8xH200 host after a reboot (GPUs and VFs on vfio-pci) with the kernel's
``reset_method`` and the GPU's config space (tests/support/gpu_handover.py); the tool's answers are
replayed from fixtures/gpu-admin-tools by a runner that refuses any argv not recorded there.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gpuaas_agent.contract.gpuhandover import GpuHandoverResult, GpuResetMethod
from gpuaas_agent.contract.handover import CcMode, GpuHandoverPolicy
from gpuaas_agent.guards.gpureset import (
    GpuHandoverRefused,
    check_gpu_handover_ready,
    choose_gpu_reset,
    functions_below,
    resolve_gpu_tool,
)
from gpuaas_agent.host.devices.gpuadmin import memory_clear_register, parse_answer
from gpuaas_agent.host.devices.gpuhandover import GpuHandoverError, hand_over_gpu, read_config_space, reset_fabric_vf
from gpuaas_agent.hostfs import HostRoot
from tests.support.gpu_handover import BRIDGE, DEVICES, GPU, HOST, VF, ReplayTool, between_tenants, config_space

POLICY = GpuHandoverPolicy()


@pytest.fixture
def host(host_copy) -> Path:
    return between_tenants(host_copy(HOST))


def _hand_over(root: Path, case: str, policy: GpuHandoverPolicy = POLICY, held=()) -> tuple[ReplayTool, object]:
    replay = ReplayTool(case)

    async def go():
        return await hand_over_gpu(HostRoot.open(root), GPU, policy, held=held, tool=replay.tool())

    try:
        return replay, asyncio.run(go())
    except (GpuHandoverError, GpuHandoverRefused) as exc:
        return replay, exc


def _sibling(root: Path, address: str = "0000:18:00.1") -> None:
    """A second function below the GPU's switch port (e.g. an audio or NVSwitch function)."""
    gpu_dir = (root / DEVICES / GPU).resolve()
    (gpu_dir.parent / address).mkdir()
    (root / DEVICES / address).symlink_to(os.path.relpath(gpu_dir.parent / address, root / DEVICES))


# -- the reset chosen from sysfs ---------------------------------------------------------


def test_a_gpu_alone_below_its_switch_port_gets_a_secondary_bus_reset(host):
    choice = choose_gpu_reset(HostRoot.open(host), GPU)
    assert choice.method is GpuResetMethod.sbr and choice.bridge == BRIDGE and choice.bridge_functions == []
    assert choice.reset_methods == ["flr", "bus"] and "alone below bridge 0000:17:00.0" in choice.reason
    assert functions_below(HostRoot.open(host), BRIDGE) == [GPU]


def test_a_bridge_with_another_function_means_flr_and_a_memory_clear_that_cannot_be_proven(host):
    _sibling(host)
    root = HostRoot.open(host)
    choice = choose_gpu_reset(root, GPU, clear_memory=False)
    assert choice.method is GpuResetMethod.flr and choice.bridge_functions == ["0000:18:00.1"]
    with pytest.raises(GpuHandoverRefused) as refused:
        choose_gpu_reset(root, GPU, clear_memory=True)
    assert refused.value.code == "gpu_memory_clear_unprovable"
    assert refused.value.evidence["bridge_functions"] == ["0000:18:00.1"]


def test_no_bus_reset_offered_by_the_kernel_is_flr_and_no_reset_method_at_all_is_refused(host):
    (host / DEVICES / GPU / "reset_method").write_text("flr\n")  # e.g. quirk_nvidia_no_bus_reset
    assert choose_gpu_reset(HostRoot.open(host), GPU, clear_memory=False).method is GpuResetMethod.flr
    (host / DEVICES / GPU / "reset_method").unlink()
    with pytest.raises(GpuHandoverRefused) as refused:
        choose_gpu_reset(HostRoot.open(host), GPU, clear_memory=False)
    assert refused.value.code == "gpu_reset_path_missing" and refused.value.evidence["reset_methods"] == []


def test_a_device_a_defined_domain_holds_is_never_reset(host):
    replay, error = _hand_over(host, "success", held=[GPU, "0000:3a:00.0"])
    assert isinstance(error, GpuHandoverRefused) and error.code == "gpu_held_by_domain"
    assert error.evidence["held"] == [GPU] and replay.calls == []  # the tool never ran


def test_the_tool_missing_is_a_typed_refusal(tmp_path):
    with pytest.raises(GpuHandoverRefused) as refused:
        resolve_gpu_tool(tmp_path / "nvidia_gpu_tools.py")
    assert refused.value.code == "gpu_handover_tool_missing"
    # The package's own: installed with the agent (a runtime dependency), never imported, only run.
    assert resolve_gpu_tool(None).name == "nvidia_gpu_tools.py"


def test_readiness_names_the_tool_the_reset_and_the_vf_flr(host):
    ready = check_gpu_handover_ready(HostRoot.open(host), POLICY, GPU, VF, None)
    assert ready.gpu_reset.method is GpuResetMethod.sbr and ready.fabric_vf_reset_methods == ["flr"]
    (host / DEVICES / VF / "reset_method").unlink()
    with pytest.raises(GpuHandoverRefused) as refused:
        check_gpu_handover_ready(HostRoot.open(host), POLICY, GPU, VF, None)
    assert refused.value.code == "gpu_reset_path_missing" and refused.value.evidence["address"] == VF


# -- the tool's answers ------------------------------------------------------------------


def test_success_resets_clears_restores_and_proves_each_step(host):
    replay, result = _hand_over(host, "success")
    assert isinstance(result, GpuHandoverResult), result
    assert [r.purpose for r in result.tool_runs] == ["query_before", "stage_settings", "reset_and_clear", "query_after"]
    assert replay.options()[1] == ["--set-cc-mode", "off", "--force-ecc-on-after-reset", "--force-mig-off-after-reset",
                                   "--set-ppcie-mode", "off"]
    assert replay.options()[2] == ["--reset-with-sbr", "--clear-memory", "--read-bar0", "0x100b20"]
    # What the tenant left, and what the next one gets.
    assert result.before is not None and (result.before.ecc_enabled, result.before.mig_enabled) == (False, True)
    assert (result.after.ecc_enabled, result.after.mig_enabled, result.after.cc_mode, result.after.ppcie_mode) == (
        True, False, "off", "off")
    assert result.memory_cleared and result.memory_clear_flag == "0x1"
    assert result.config_space.restored and result.config_space.vendor_device == "10de:2335"
    assert result.config_space.bars == {"0": "0x9a000000", "1": "0x200000000000", "3": "0x204000000000"}
    assert result.driver == "vfio-pci" and not result.vfio_rebound and result.warnings == []
    # It is a wire model: the release's cleanup proof carries it.
    assert GpuHandoverResult.model_validate_json(result.model_dump_json()) == result


def test_a_refused_reset_that_exits_zero_is_a_failed_reset(host):
    replay, error = _hand_over(host, "reset_refused")
    assert isinstance(error, GpuHandoverError) and error.code == "gpu_reset_failed"
    assert "upstream bridge is not accessible" in error.message
    runs = error.evidence["tool_runs"]
    assert [r["purpose"] for r in runs] == ["query_before", "stage_settings", "reset_and_clear"]
    assert runs[-1]["returncode"] == 0  # the tool's exit status alone would have passed it
    assert error.evidence["reset"]["method"] == "sbr" and len(replay.calls) == 3


def test_a_memory_clear_flag_never_set_is_unverified(host):
    _, error = _hand_over(host, "memory_clear_flag_never_set")
    assert isinstance(error, GpuHandoverError) and error.code == "gpu_memory_clear_unverified"
    assert "memory_clear_finished (0x100b20), value 0x0" in error.message
    assert error.evidence["flag_register"] == "0x100b20" and error.evidence["flag"] is None
    assert [r["purpose"] for r in error.evidence["tool_runs"]][-1] == "reset_and_clear"


def test_mig_left_on_after_the_reset_is_settings_not_restored(host):
    _, error = _hand_over(host, "mig_left_on")
    assert isinstance(error, GpuHandoverError) and error.code == "gpu_settings_not_restored"
    assert error.evidence["mismatches"] == {"mig_enabled": {"expected": False, "found": True}}
    assert error.evidence["after"]["mig_enabled"] is True and len(error.evidence["tool_runs"]) == 4


def test_bars_not_restored_after_the_reset_fail_the_handover(host):
    (host / DEVICES / GPU / "config").write_bytes(config_space(host, GPU, bar_override={0: 0}))
    _, error = _hand_over(host, "success")
    assert isinstance(error, GpuHandoverError) and error.code == "gpu_config_space_not_restored"
    assert error.evidence["config_space"]["bars"]["0"] == "0x0"


def test_a_gpu_that_left_vfio_pci_is_bound_back(host):
    driver = host / DEVICES / GPU / "driver"
    driver.unlink()  # the reset left it without a driver

    def kernel(write):  # the fixture stands in for the kernel's probe
        if write.path == "/sys/bus/pci/drivers_probe":
            driver.symlink_to("../../../../../../bus/pci/drivers/vfio-pci")

    async def go():
        return await hand_over_gpu(HostRoot.open(host), GPU, POLICY, held=(), tool=ReplayTool("success").tool(),
                                   after_write=kernel)

    result = asyncio.run(go())
    assert result.driver == "vfio-pci" and result.vfio_rebound
    assert (host / DEVICES / GPU / "driver_override").read_text() == "vfio-pci"


def test_the_replay_refuses_an_argv_it_has_no_answer_for(host):
    with pytest.raises(AssertionError, match="no answer recorded"):
        _hand_over(host, "success", policy=GpuHandoverPolicy(cc_mode=CcMode.on))


def test_the_fabric_vf_gets_the_kernels_flr(host):
    result = asyncio.run(reset_fabric_vf(HostRoot.open(host), VF, held=()))
    assert (host / DEVICES / VF / "reset").read_text() == "1"
    assert result.method == "flr" and result.driver == "vfio-pci" and not result.vfio_rebound
    with pytest.raises(GpuHandoverRefused) as refused:
        asyncio.run(reset_fabric_vf(HostRoot.open(host), VF, held=[VF]))
    assert refused.value.code == "gpu_held_by_domain"


# -- pure parts ----------------------------------------------------------------------------


def test_answers_count_only_for_the_selected_gpu_and_ppcie_unsupported_is_not_an_error():
    stderr = "\n".join([
        "2026-11-27,10:00:00.001 INFO     GPU 0000:3a:00.0 H200 0x2335 BAR0 0x1 MIG mode is enabled",
        "2026-11-27,10:00:00.002 INFO     GPU 0000:18:00.0 H200 0x2335 BAR0 0x1 MIG mode is disabled",
        "2026-11-27,10:00:00.003 ERROR    Querying PPCIe mode is not supported on GPU 0000:18:00.0 H200 0x2335 BAR0 0x1",
        "2026-11-27,10:00:00.004 ERROR    Forcing ECC on after reset not supported on GPU 0000:18:00.0",
    ])
    answer = parse_answer(stderr, GPU)
    assert answer.mig_enabled is False and answer.ppcie_unsupported
    assert answer.errors == ("Forcing ECC on after reset not supported on GPU 0000:18:00.0",)
    assert answer.settings().ppcie_mode == "unsupported"


def test_the_memory_clear_flag_register_is_known_per_architecture():
    assert memory_clear_register(0x2335) == 0x100B20 and memory_clear_register(0x2901) == 0x8A004C
    assert memory_clear_register(0x20B0) is None  # A100: not a slice GPU, no flag we would trust


def test_config_space_is_read_from_the_live_file(host):
    check = read_config_space(HostRoot.open(host), GPU)
    assert check.restored and check.bars["0"] == "0x9a000000"
    (host / DEVICES / GPU / "config").unlink()
    with pytest.raises(GpuHandoverError) as err:
        read_config_space(HostRoot.open(host), GPU)
    assert err.value.code == "gpu_config_space_not_restored"


def test_no_agent_module_imports_the_tools_top_level_modules():
    """The tool installs generic top-level names (cli, gpu, pci, utils): it is run, never imported."""
    import ast

    package = Path(__file__).resolve().parents[3] / "gpuaas_agent"
    tool_names = {"cli", "gpu", "pci", "utils", "nvidia_gpu_tools"}
    found = []
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{source.name}: {n}" for n in names if n.split(".")[0] in tool_names]
    assert found == []
