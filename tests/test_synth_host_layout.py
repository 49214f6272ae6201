"""The synthesised H200 host fixtures are internally consistent and reproducible.

``lab/synth_host.py`` writes the ``h200-slice-*`` trees from their descriptions
(``fixtures/hosts/<name>.synth.json``, each pinning its tree's digest). These
checks use plain ``os`` functions only (never the agent's own ``HostRoot``), so
a bug in the reader cannot hide a broken fixture and a broken fixture cannot
make a reader bug look like a pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuaas_agent.discovery.fixture_archive import tree_digest
from lab.fixture_hosts import built_in_this_process, description, synthetic_names
from tests.conftest import H200_FIXTURES, fixture_host, load_synth_host

AFTER = fixture_host("h200-slice-after-transition")
BEFORE = fixture_host("h200-slice-before-transition")
REBOOT = fixture_host("h200-slice-after-reboot")
NO_VFS = fixture_host("h200-slice-no-vfs")
# Names udev puts under /dev that point at device nodes a recording cannot copy.
DEV_NODE_LINK_DIRS = ("dev/disk/", "dev/mapper/", "dev/ubuntu-vg/")


def _links(root: Path) -> dict[str, str]:
    """Every symlink under ``root`` (not followed): relative path -> raw target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                out[os.path.relpath(path, root)] = os.readlink(path)
    return out


def _snapshot(root: Path) -> dict[str, tuple[str, object]]:
    """Files by content and links by target; what git would store of the tree."""
    out: dict[str, tuple[str, object]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    out[rel] = ("file", fh.read())
    return out


def _attr(path: Path) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def _pci_functions(root: Path) -> dict[str, Path]:
    devices = root / "sys/bus/pci/devices"
    return {name: devices / name for name in sorted(os.listdir(devices))}


def _by_id_targets(root: Path) -> dict[str, str]:
    by_id = root / "dev/disk/by-id"
    return {name: os.path.basename(os.readlink(by_id / name)) for name in os.listdir(by_id)}


@pytest.mark.parametrize("name", H200_FIXTURES)
def test_every_link_is_relative_and_lands_inside_the_fixture(name):
    root = fixture_host(name)
    real_root = os.path.realpath(root)
    class_block = set(os.listdir(root / "sys/class/block"))
    links = _links(root)
    assert len(links) > 500
    for rel, target in links.items():
        assert not target.startswith("/"), (rel, target)
        resolved = os.path.realpath(root / rel)
        assert resolved.startswith(real_root + os.sep), (rel, target)
        if os.path.exists(resolved):
            continue
        # /dev/disk/by-id/nvme-eui.X -> ../../nvme3n1: the node is not copied, the name must be a block device.
        assert rel.startswith(DEV_NODE_LINK_DIRS), (rel, target)
        assert os.path.basename(resolved) in class_block, (rel, target)


@pytest.mark.parametrize(
    ("name", "vfs", "gpu_driver"),
    [
        ("h200-slice-after-transition", 8, "nvidia"),
        ("h200-slice-before-transition", 8, "nvidia"),
        ("h200-slice-after-reboot", 8, "vfio-pci"),
        ("h200-slice-no-vfs", 0, "nvidia"),
    ],
)
def test_gpu_and_connectx7_counts(name, vfs, gpu_driver):
    functions = _pci_functions(fixture_host(name))
    gpus = [p for p in functions.values() if _attr(p / "vendor") == "0x10de" and _attr(p / "class").startswith("0x0302")]
    pfs = [p for p in functions.values() if _attr(p / "device") == "0x1021"]
    vf_dirs = [p for p in functions.values() if (p / "physfn").is_symlink()]
    assert len(gpus) == 8 and len(pfs) == 8 and len(vf_dirs) == vfs
    assert {os.path.basename(os.readlink(p / "driver")) for p in gpus} == {gpu_driver}
    assert {_attr(p / "sriov_numvfs") for p in pfs} == {"1" if vfs else "0"}
    for vf in vf_dirs:
        pf = vf / "physfn"
        assert os.path.realpath(pf / "virtfn0") == os.path.realpath(vf)
        assert not (vf / "sriov_numvfs").exists()


def test_every_pci_function_has_its_identity_files_and_its_own_iommu_group():
    groups = set()
    for address, path in _pci_functions(AFTER).items():
        for attr in ("vendor", "device", "class", "subsystem_vendor", "subsystem_device", "revision",
                     "numa_node", "local_cpulist", "enable", "driver_override"):
            with open(path / attr, encoding="utf-8") as fh:
                assert fh.read().endswith("\n"), (address, attr)
        group = os.path.basename(os.readlink(path / "iommu_group"))
        members = os.listdir(AFTER / "sys/kernel/iommu_groups" / group / "devices")
        assert members == [address]
        groups.add(group)
        assert os.path.realpath(path / "subsystem") == os.path.realpath(AFTER / "sys/bus/pci")
    assert len(groups) == len(_pci_functions(AFTER))


def test_sys_block_has_nine_nvme_heads_and_dm0_besides_hidden_path_disks():
    sys_block = AFTER / "sys/block"
    visible, hidden = set(), set()
    for name in os.listdir(sys_block):
        (hidden if _attr(sys_block / name / "hidden") == "1" else visible).add(name)
    assert visible == {f"nvme{n}n1" for n in range(9)} | {"dm-0"}
    # The kernel links multipath per-path disks into /sys/block too; they have no dev and no udev record.
    assert hidden == {f"nvme{n}c{n}n1" for n in range(9)}
    for name in hidden:
        assert not (sys_block / name / "dev").exists()
        assert (AFTER / "sys/class/block" / name).is_symlink()
    for name in visible:
        major_minor = _attr(sys_block / name / "dev")
        assert os.path.realpath(AFTER / "sys/dev/block" / major_minor) == os.path.realpath(sys_block / name)
        assert (AFTER / "run/udev/data" / f"b{major_minor}").is_file()


def test_only_the_os_disk_is_mounted_after_transition():
    mountinfo = (AFTER / "proc/self/mountinfo").read_text().splitlines()
    sources = {line.split(" - ")[1].split()[1] for line in mountinfo}
    assert {s for s in sources if s.startswith("/dev/nvme")} == {"/dev/nvme4n1p1", "/dev/nvme4n1p2"}
    assert "/dev/mapper/ubuntu--vg-ubuntu--lv" in sources
    dm_slaves = os.listdir(AFTER / "sys/block/dm-0/slaves")
    assert dm_slaves == ["nvme4n1p3"]
    assert os.listdir(AFTER / "sys/class/block/nvme4n1p3/holders") == ["dm-0"]


def test_before_transition_mounts_seven_slot_partitions_and_leaves_nvme1n1p1_alone():
    mounts = {}
    for line in (BEFORE / "proc/self/mountinfo").read_text().splitlines():
        fields, rest = line.split(" - ")
        mounts[fields.split()[4]] = (fields.split()[2], rest.split()[1])
    expected = {"/share2": "nvme0n1p1", "/share3": "nvme2n1p1", "/share4": "nvme3n1p1", "/share5": "nvme5n1p1",
                "/share6": "nvme6n1p1", "/share7": "nvme7n1p1", "/share8": "nvme8n1p1"}
    for mountpoint, part in expected.items():
        major_minor, source = mounts[mountpoint]
        assert source == f"/dev/{part}"
        assert _attr(BEFORE / "sys/class/block" / part / "dev") == major_minor
    assert (BEFORE / "sys/class/block/nvme1n1p1/partition").is_file()
    assert not any(source == "/dev/nvme1n1p1" for _, source in mounts.values())
    assert _attr(BEFORE / "sys/class/block/nvme4n1/hidden") == "0" and mounts["/boot"][1] == "/dev/nvme4n1p2"


def test_after_reboot_keeps_by_id_names_but_moves_kernel_names():
    before, after = _by_id_targets(AFTER), _by_id_targets(REBOOT)
    assert set(before) == set(after)
    boss = next(n for n in before if n.startswith("nvme-Dell_BOSS-N1_") and not n.endswith(("_1", "-part1", "-part2", "-part3")))
    assert before[boss] == "nvme4n1" and after[boss] == "nvme7n1"
    eui_names = [n for n in before if n.startswith("nvme-eui.") and "-part" not in n]
    assert len(eui_names) == 9
    assert all(before[n] != after[n] for n in eui_names)  # every disk was renamed
    majmin_before = {n: _attr(AFTER / "sys/class/block" / before[n] / "dev") for n in eui_names}
    majmin_after = {n: _attr(REBOOT / "sys/class/block" / after[n] / "dev") for n in eui_names}
    assert majmin_before != majmin_after
    for n in eui_names:  # the name still leads to the same drive
        wwid = "eui." + n.removeprefix("nvme-eui.")
        assert _attr(REBOOT / "sys/class/block" / after[n] / "wwid") == wwid


def test_kernel_names_do_not_follow_island_order():
    functions = _pci_functions(AFTER)
    micron = sorted((a for a, p in functions.items() if _attr(p / "device") == "0x51c3"))
    names = [os.listdir(functions[a] / "nvme")[0] for a in micron]
    assert len(names) == 8 and all(name != f"nvme{i}" for i, name in enumerate(names))


def test_every_synthetic_host_is_described():
    assert set(synthetic_names()) == {*H200_FIXTURES, "h200-slice-nat-missing"}
    for name in synthetic_names():
        assert name == "h200-slice-" + description(name).variant


@pytest.mark.parametrize("name", synthetic_names())
def test_materialised_tree_is_the_pinned_one(name):
    """The tree every test reads is exactly the one its description pins (content, links, names)."""
    assert tree_digest(fixture_host(name)) == description(name).tree_sha256, (
        f"{name}: the generator now writes another tree; if that is intended, re-pin with "
        "`python -m lab.fixture_hosts --pin` and say why in the commit; if not, something wrote into "
        f"the shared tree {fixture_host(name)} (remove .cache/fixture-hosts)"
    )


def test_a_tree_built_by_this_generator_now_has_the_pinned_digest(tmp_path):
    """Not a tree from an earlier session's cache: the generator is deterministic and the pin is not stale.

    (That the digest sees a changed byte or link target: tests/discovery/test_fixture_archive.py.)
    """
    name = "h200-slice-after-reboot"  # the variant that differs most from the others (boot "b")
    root = fixture_host(name)
    if not built_in_this_process(name):  # reused from the cache: build a fresh one to compare
        load_synth_host().build(tmp_path / name, description(name).variant)
        root = tmp_path / name
    assert tree_digest(root) == description(name).tree_sha256


def test_absolute_links_variant_has_the_same_links_made_absolute(tmp_path):
    synth = load_synth_host()
    synth.build(tmp_path / "abs", "after-reboot", absolute_links=True)
    absolute, relative = _links(tmp_path / "abs"), _links(REBOOT)
    assert set(absolute) == set(relative)
    for rel, target in relative.items():
        expected = os.path.normpath(os.path.join("/", os.path.dirname(rel), target))
        assert absolute[rel] == expected, rel


def test_classic_nvme_variant_has_no_heads_or_path_disks(tmp_path):
    synth = load_synth_host()
    synth.build(tmp_path / "classic", "before-transition", multipath=False)
    root = tmp_path / "classic"
    names = set(os.listdir(root / "sys/class/block"))
    assert not any("c" in n.removeprefix("nvme") for n in names if n.startswith("nvme"))
    subsys = root / "sys/devices/virtual/nvme-subsystem"
    assert not any(n.startswith("nvme") and "n1" in n for s in os.listdir(subsys) for n in os.listdir(subsys / s))
    head = os.path.realpath(root / "sys/block/nvme4n1")
    assert "/nvme/nvme4/nvme4n1" in head and os.readlink(root / "sys/block/nvme4n1/device") == "../../nvme4"
    assert os.listdir(root / "sys/block/nvme4n1/nvme4n1p3/holders") == ["dm-0"]
    assert _attr(root / "sys/module/nvme_core/parameters/multipath") == "N"


def test_build_refuses_to_replace_a_tree_it_did_not_write(tmp_path):
    synth = load_synth_host()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("not a fixture\n")
    with pytest.raises(FileExistsError):
        synth.build(tmp_path / "other", "no-vfs", overwrite=True)
    assert (tmp_path / "other" / "keep.txt").exists()
