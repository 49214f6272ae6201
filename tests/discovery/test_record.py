"""record_fixture over real directory trees: the recording is what discovery reads, and nothing else.

Every test builds real files, links and fifos under tmp_path (no mocks); the
live test records the machine running the tests.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from pathlib import Path

import pytest

from gpuaas_agent.contract.fixture import (
    FIXTURE_META_DIR,
    MANIFEST_NAME,
    FixtureManifest,
)
from gpuaas_agent.contract.types import PCI_ADDRESS_RE
from gpuaas_agent.discovery.fixture_archive import tree_digest, unpack_tree
from gpuaas_agent.discovery.record import (
    ATTR_CAP,
    BLOCK_ATTRS,
    COMMANDS,
    DMI_ATTRS,
    IB_PORT_ATTRS,
    NET_ATTRS,
    NVME_CTRL_ATTRS,
    NVME_SUBSYS_ATTRS,
    PCI_ATTRS,
    record_fixture,
    record_fixture_archive,
)
from gpuaas_agent.discovery.report import discover
from gpuaas_agent.errors import FixtureError
from gpuaas_agent.hostfs import HostRoot
from lab.fixture_hosts import fixture_host, host_names, recorded_names

REPO = Path(__file__).resolve().parents[1]
HOST_TOPS = {"sys", "dev", "proc", "run", "etc"}
BDF_RE = PCI_ADDRESS_RE


# -- building a small host tree ---------------------------------------------------


def put(root: Path, host_path: str, text: str = "") -> None:
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def link(root: Path, host_path: str, target: str) -> None:
    """A link with exactly ``target`` as written."""
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)


def rel_link(root: Path, host_path: str, target_host_path: str) -> None:
    """A relative link, the way the kernel writes sysfs links."""
    link(root, host_path, posixpath.relpath(target_host_path, posixpath.dirname(host_path)))


def mkdir(root: Path, host_path: str) -> None:
    (root / host_path.lstrip("/")).mkdir(parents=True, exist_ok=True)


PCI = "/sys/devices/pci0000:00"
GPU_PORT = f"{PCI}/0000:00:01.0"
GPU = f"{GPU_PORT}/0000:01:00.0"
NVME_PORT = f"{PCI}/0000:00:02.0"
NVME = f"{NVME_PORT}/0000:02:00.0"
CTRL = f"{NVME}/nvme/nvme0"
NS = f"{CTRL}/nvme0n1"
PART = f"{NS}/nvme0n1p1"
DM = "/sys/devices/virtual/block/dm-0"


def pci_function(root: Path, path: str, vendor: str, device: str, cls: str, driver: str | None, group: int | None) -> None:
    for name, value in (
        ("vendor", vendor), ("device", device), ("class", cls), ("subsystem_vendor", vendor),
        ("subsystem_device", "0x0000"), ("revision", "0xa1"), ("numa_node", "0"),
        ("local_cpulist", "0-23"), ("enable", "1"), ("driver_override", "(null)"),
    ):
        put(root, f"{path}/{name}", value + "\n")
    rel_link(root, f"{path}/subsystem", "/sys/bus/pci")
    if driver:
        rel_link(root, f"{path}/driver", f"/sys/bus/pci/drivers/{driver}")
    if group is not None:
        rel_link(root, f"{path}/iommu_group", f"/sys/kernel/iommu_groups/{group}")
        put(root, f"/sys/kernel/iommu_groups/{group}/type", "DMA\n")
        rel_link(root, f"/sys/kernel/iommu_groups/{group}/devices/{path.rsplit('/', 1)[1]}", path)


def block_node(root: Path, path: str, dev: str, size: str, partition: str | None = None) -> None:
    for name, value in (("dev", dev), ("size", size), ("ro", "0"), ("removable", "0"), ("hidden", "0")):
        put(root, f"{path}/{name}", value + "\n")
    put(root, f"{path}/queue/logical_block_size", "512\n")
    mkdir(root, f"{path}/holders")
    if partition is not None:
        put(root, f"{path}/partition", partition + "\n")
        put(root, f"{path}/start", "2048\n")
    name = path.rsplit("/", 1)[1]
    rel_link(root, f"/sys/class/block/{name}", path)
    rel_link(root, f"/sys/dev/block/{dev}", path)


def build_host(root: Path) -> Path:
    """One GPU behind a root port, one NVMe whose partition holds an LVM volume mounted at /share1."""
    pci_function(root, f"{GPU_PORT}", "0x8086", "0x347a", "0x060400", "pcieport", None)
    pci_function(root, GPU, "0x10de", "0x2335", "0x030200", "vfio-pci", 17)
    pci_function(root, NVME_PORT, "0x8086", "0x347b", "0x060400", "pcieport", None)
    pci_function(root, NVME, "0x144d", "0xa80a", "0x010802", "nvme", 18)
    rel_link(root, "/sys/bus/pci/devices/0000:00:01.0", GPU_PORT)  # relative, as the kernel writes
    link(root, "/sys/bus/pci/devices/0000:01:00.0", GPU)  # absolute: must resolve inside the root
    rel_link(root, "/sys/bus/pci/devices/0000:00:02.0", NVME_PORT)
    rel_link(root, "/sys/bus/pci/devices/0000:02:00.0", NVME)
    for driver, bound in (("vfio-pci", GPU), ("nvme", NVME), ("pcieport", GPU_PORT)):
        for name in ("bind", "unbind", "new_id", "remove_id"):
            put(root, f"/sys/bus/pci/drivers/{driver}/{name}")
        rel_link(root, f"/sys/bus/pci/drivers/{driver}/{bound.rsplit('/', 1)[1]}", bound)
    rel_link(root, "/sys/bus/pci/drivers/pcieport/0000:00:02.0", NVME_PORT)
    put(root, "/sys/bus/pci/drivers_probe")

    for name, value in (
        ("serial", "S64ANS0T100001"), ("model", "SAMSUNG MZQL21T9HCJR-00A07"), ("firmware_rev", "GDC5602Q"),
        ("address", "0000:02:00.0"), ("transport", "pcie"), ("cntlid", "6"), ("state", "live"),
        ("subsysnqn", "nqn.1994-11.com.samsung:nvme:PM9A3:2.5-inch:S64ANS0T100001"), ("numa_node", "0"),
    ):
        put(root, f"{CTRL}/{name}", value + "\n")
    rel_link(root, f"{CTRL}/device", NVME)
    rel_link(root, "/sys/class/nvme/nvme0", CTRL)
    block_node(root, NS, "259:0", "3750748848")
    put(root, f"{NS}/wwid", "eui.0025385b71b07e2f\n")
    put(root, f"{NS}/nsid", "1\n")
    rel_link(root, f"{NS}/device", CTRL)
    block_node(root, PART, "259:1", "3750746800", partition="1")
    rel_link(root, f"{PART}/holders/dm-0", DM)
    block_node(root, DM, "253:0", "3750740000")
    put(root, f"{DM}/dm/name", "vg-share1\n")
    put(root, f"{DM}/dm/uuid", "LVM-Xk2b\n")
    rel_link(root, f"{DM}/slaves/nvme0n1p1", PART)
    rel_link(root, "/sys/block/nvme0n1", NS)
    rel_link(root, "/sys/block/dm-0", DM)

    rel_link(root, "/sys/class/net/lo", "/sys/devices/virtual/net/lo")
    for name, value in (("address", "00:00:00:00:00:00"), ("operstate", "unknown"), ("type", "772"), ("mtu", "65536"), ("ifindex", "1")):
        put(root, f"/sys/devices/virtual/net/lo/{name}", value + "\n")
    put(root, "/sys/devices/system/node/online", "0\n")
    put(root, "/sys/devices/system/node/possible", "0\n")
    put(root, "/sys/devices/system/node/node0/cpulist", "0-23\n")
    put(root, "/sys/devices/system/node/node0/meminfo", "Node 0 MemTotal:       131072000 kB\n")
    put(root, "/sys/devices/system/node/node0/hugepages/hugepages-1048576kB/nr_hugepages", "0\n")
    put(root, "/sys/devices/system/node/node0/hugepages/hugepages-1048576kB/free_hugepages", "0\n")
    rel_link(root, "/sys/class/dmi/id", "/sys/devices/virtual/dmi/id")
    put(root, "/sys/devices/virtual/dmi/id/sys_vendor", "Dell Inc.\n")
    put(root, "/sys/devices/virtual/dmi/id/product_name", "PowerEdge XE9680\n")
    put(root, "/sys/devices/virtual/dmi/id/product_uuid", "4c4c4544-0047-3010-8052-b4c04f4e3533\n")
    mkdir(root, "/sys/module/vfio_pci")
    mkdir(root, "/sys/module/kvm")

    link(root, "/dev/disk/by-id/nvme-eui.0025385b71b07e2f", "../../nvme0n1")
    link(root, "/dev/disk/by-id/nvme-SAMSUNG_MZQL21T9HCJR-00A07_S64ANS0T100001", "../../nvme0n1")
    link(root, "/dev/disk/by-id/nvme-eui.0025385b71b07e2f-part1", "../../nvme0n1p1")
    link(root, "/dev/disk/by-id/dm-name-vg-share1", "../../dm-0")
    link(root, "/dev/disk/by-uuid/0b7d1c1e-5a1f-4d2a-9d3e-2a3b4c5d6e7f", "../../dm-0")
    link(root, "/dev/mapper/vg-share1", "../dm-0")
    put(root, "/dev/kvm")
    put(root, "/dev/vfio/vfio")
    put(root, "/dev/vfio/17")

    put(root, "/proc/self/mountinfo", (
        "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
        "40 27 253:0 / /share1 rw,relatime shared:50 - xfs /dev/mapper/vg-share1 rw\n"
    ))
    put(root, "/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
    put(root, "/proc/cmdline", "BOOT_IMAGE=/vmlinuz intel_iommu=on iommu=pt\n")
    put(root, "/proc/meminfo", "MemTotal:       263000000 kB\n")
    put(root, "/proc/sys/net/ipv4/ip_forward", "1\n")
    put(root, "/proc/sys/kernel/hostname", "xe9680-07\n")
    put(root, "/run/udev/data/b259:0", "E:ID_PART_TABLE_TYPE=gpt\n")
    put(root, "/run/udev/data/b259:1", "E:ID_FS_TYPE=LVM2_member\n")
    put(root, "/run/udev/data/b253:0", "E:ID_FS_TYPE=xfs\n")
    put(root, "/etc/machine-id", "0f3c2a9d5e6b4c1a8d7e6f5a4b3c2d1e\n")
    put(root, "/etc/hostname", "xe9680-07\n")
    put(root, "/etc/os-release", 'PRETTY_NAME="Ubuntu 22.04.4 LTS"\n')
    return root


# -- comparing trees ----------------------------------------------------------------


def snapshot(root: Path, *, host_only: bool = True) -> dict[str, tuple]:
    """Every entry under root, links not followed: ("dir",), ("link", target) or ("file", bytes)."""
    out: dict[str, tuple] = {}

    def walk(directory: Path, rel: str) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if not rel and host_only and entry.name not in HOST_TOPS:
                continue  # FIXTURE.md, .gpuaas-fixture/ and the like are not host paths
            name = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_symlink():
                out[name] = ("link", os.readlink(entry.path))
            elif entry.is_dir(follow_symlinks=False):
                out[name] = ("dir",)
                walk(Path(entry.path), name)
            else:
                out[name] = ("file", Path(entry.path).read_bytes())

    walk(root, "")
    return out


def assert_discovery_identical(src: Path, out: Path) -> None:
    assert discover(HostRoot.open(src)).model_dump_json() == discover(HostRoot.open(out)).model_dump_json()


def must_be_recorded(src: Path, source: dict[str, tuple]) -> set[str]:
    """Files of a source fixture that sit where the whitelist says the recorder must copy them.

    Fixtures written by hand may hold more than discovery reads (``uevent``,
    ``irq``...); those may be left out, these may not.
    """
    host = HostRoot.open(src)
    block_dirs = {host.resolve(f"/sys/class/block/{n}").lstrip("/") for n in _names(host, "/sys/class/block")}
    dmi_dir = host.resolve("/sys/class/dmi/id").lstrip("/")
    expected = set()
    for rel, entry in source.items():
        if entry[0] != "file" or not rel.startswith("sys/"):
            continue
        parts = rel.split("/")
        parent, name = "/".join(parts[:-1]), parts[-1]
        if (
            (name in PCI_ATTRS and BDF_RE.match(parts[-2]))
            or (name in NET_ATTRS and parts[-3] == "net")
            or (name in IB_PORT_ATTRS and parts[-3] == "ports")
            or (name in NVME_CTRL_ATTRS and re.fullmatch(r"nvme\d+", parts[-2]) and parts[-3] == "nvme")
            or (name in NVME_SUBSYS_ATTRS and parts[-2].startswith("nvme-subsys"))
            or (name in DMI_ATTRS and parent == dmi_dir)
            or (name in BLOCK_ATTRS and parent in block_dirs)
            or (f"{parts[-2]}/{name}" in BLOCK_ATTRS and "/".join(parts[:-2]) in block_dirs)
        ):
            expected.add(rel)
    return expected


def _names(host: HostRoot, path: str) -> list[str]:
    return host.listdir(path) if host.is_dir(path) else []




# -- tests ----------------------------------------------------------------------------


def test_recording_a_built_host_gives_the_same_tree(tmp_path):
    src = build_host(tmp_path / "src")
    out = tmp_path / "out"
    manifest = record_fixture(HostRoot.open(src), out)

    assert snapshot(out) == snapshot(src)
    assert manifest.live is False and manifest.commands == []
    assert manifest.hostname == "xe9680-07"
    assert manifest.source_root == str(src.resolve())
    links = sum(1 for v in snapshot(src).values() if v[0] == "link")
    files = sum(1 for v in snapshot(src).values() if v[0] == "file")
    assert (manifest.links, manifest.files) == (links, files)
    assert os.readlink(out / "sys/bus/pci/devices/0000:01:00.0") == GPU  # absolute kept absolute
    assert os.readlink(out / "sys/bus/pci/devices/0000:00:01.0") == "../../../devices/pci0000:00/0000:00:01.0"
    assert_discovery_identical(src, out)


def test_built_host_is_meaningful_to_discovery(tmp_path):
    """Guards the comparison above: the tree must exercise PCI, IOMMU, NVMe, partitions and holders."""
    out = tmp_path / "out"
    record_fixture(HostRoot.open(build_host(tmp_path / "src")), out)
    report = discover(HostRoot.open(out))
    assert [g.pci_address for g in report.gpus] == ["0000:01:00.0"]
    assert report.gpus[0].iommu_group == 17 and report.gpus[0].pci_path == ["0000:00:01.0"]
    [disk] = report.nvme_devices
    assert disk.by_id == "/dev/disk/by-id/nvme-eui.0025385b71b07e2f"
    assert [p.name for p in disk.partitions] == ["nvme0n1p1"]
    assert [(c.mountpoint, c.via_holder) for c in disk.mounted_children] == [("/share1", "dm-0")]


@pytest.mark.parametrize("name", host_names())
def test_recording_a_fixture_host_reads_the_same(tmp_path, name):
    """Every fixture host records back to itself: links verbatim, contents equal, discovery equal."""
    src = fixture_host(name)
    out = tmp_path / "out"
    record_fixture(HostRoot.open(src), out)
    source, recorded = snapshot(src), snapshot(out)
    source_host = HostRoot.open(src)
    for rel, entry in recorded.items():
        if entry[0] == "file" and rel in source and source[rel][0] == "link":
            # /proc/self and /etc/os-release are copied flat: compare what the link leads to.
            assert entry[1] == source_host.read_text("/" + rel).encode(), rel
        else:
            assert source.get(rel) == entry, rel
    assert sorted(must_be_recorded(src, source) - set(recorded)) == []
    assert_discovery_identical(src, out)


def test_recording_as_one_archive_unpacks_to_the_recorded_tree(tmp_path):
    """recording -> archive -> unpack changes nothing: same tree as a directory recording, same discovery."""
    src = build_host(tmp_path / "src")
    record_fixture(HostRoot.open(src), tmp_path / "as-dir")
    manifest = record_fixture_archive(HostRoot.open(src), tmp_path / "host.tar.xz")
    unpacked = unpack_tree(tmp_path / "host.tar.xz", tmp_path / "unpacked")
    assert tree_digest(unpacked) == tree_digest(tmp_path / "as-dir")
    assert snapshot(unpacked) == snapshot(src)
    assert (manifest.links, manifest.files) == (
        sum(1 for v in snapshot(src).values() if v[0] == "link"),
        sum(1 for v in snapshot(src).values() if v[0] == "file"),
    )
    assert_discovery_identical(src, unpacked)
    assert sorted(os.listdir(tmp_path)) == ["as-dir", "host.tar.xz", "src", "unpacked"]  # staging removed


def test_recording_the_same_tree_twice_gives_the_same_archive_bytes(tmp_path):
    src = build_host(tmp_path / "src")
    record_fixture_archive(HostRoot.open(src), tmp_path / "a.tar.xz")
    record_fixture_archive(HostRoot.open(src), tmp_path / "b.tar.xz")
    assert (tmp_path / "a.tar.xz").read_bytes() == (tmp_path / "b.tar.xz").read_bytes()


def test_archive_output_must_be_new_and_named_tar_xz(tmp_path):
    src = build_host(tmp_path / "src")
    (tmp_path / "taken.tar.xz").write_bytes(b"mine")
    with pytest.raises(FixtureError) as caught:
        record_fixture_archive(HostRoot.open(src), tmp_path / "taken.tar.xz")
    assert caught.value.code == "output_exists" and (tmp_path / "taken.tar.xz").read_bytes() == b"mine"
    with pytest.raises(FixtureError) as caught:
        record_fixture_archive(HostRoot.open(src), tmp_path / "host.tgz")
    assert caught.value.code == "archive_name"
    assert sorted(os.listdir(tmp_path)) == ["src", "taken.tar.xz"]


@pytest.mark.parametrize("name", recorded_names())
def test_committed_recordings_are_archives_that_rerecord_to_the_same_host(tmp_path, name):
    """A real recording kept as one archive, re-recorded through the archive path, reads identically."""
    src = fixture_host(name)
    record_fixture_archive(HostRoot.open(src), tmp_path / f"{name}.tar.xz")
    again = unpack_tree(tmp_path / f"{name}.tar.xz", tmp_path / name)
    assert snapshot(again) == snapshot(src)
    assert_discovery_identical(src, again)


def test_non_empty_output_is_refused_and_left_alone(tmp_path):
    src = build_host(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    with pytest.raises(FixtureError) as caught:
        record_fixture(HostRoot.open(src), out)
    assert caught.value.code == "output_exists"
    assert sorted(os.listdir(out)) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine\n"


def test_output_that_is_a_file_is_refused(tmp_path):
    src = build_host(tmp_path / "src")
    out = tmp_path / "out"
    out.write_text("x")
    with pytest.raises(FixtureError) as caught:
        record_fixture(HostRoot.open(src), out)
    assert caught.value.code == "output_exists"
    assert out.read_text() == "x"


def test_output_inside_the_recorded_tree_is_refused(tmp_path):
    src = build_host(tmp_path / "src")
    with pytest.raises(FixtureError) as caught:
        record_fixture(HostRoot.open(src), src / "sys" / "recording")
    assert caught.value.code == "output_inside_source"
    assert not (src / "sys" / "recording").exists()


def test_empty_existing_output_is_used(tmp_path):
    src = build_host(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    record_fixture(HostRoot.open(src), out)
    assert snapshot(out) == snapshot(src)


def test_links_pointing_outside_are_recorded_verbatim_and_never_followed_out(tmp_path):
    src = tmp_path / "src"
    link(src, "/sys/bus/pci/devices/x", "/etc")
    link(src, "/sys/bus/pci/devices/0000:00:1f.0", "/etc")  # a PCI-looking name: it is descended into
    link(src, "/sys/bus/pci/devices/0000:00:1f.1", "../../../../../../../../../../etc")
    link(src, "/sys/class/block/sda", "/etc")
    link(src, "/dev/disk/by-id/nvme-evil", "/etc/passwd")
    put(src, "/etc/hostname", "fixture-host\n")
    out = tmp_path / "out"

    manifest = record_fixture(HostRoot.open(src), out)

    assert os.readlink(out / "sys/bus/pci/devices/x") == "/etc"
    assert os.readlink(out / "sys/bus/pci/devices/0000:00:1f.0") == "/etc"
    assert os.readlink(out / "sys/bus/pci/devices/0000:00:1f.1") == "../../../../../../../../../../etc"
    assert os.readlink(out / "dev/disk/by-id/nvme-evil") == "/etc/passwd"
    # The only thing under etc/ is the fixture's own hostname: nothing of this machine's /etc.
    assert sorted(os.listdir(out / "etc")) == ["hostname"]
    assert (out / "etc/hostname").read_text() == "fixture-host\n"
    assert manifest.hostname == "fixture-host"
    files = [rel for rel, v in snapshot(out).items() if v[0] == "file"]
    assert files == ["etc/hostname"]


def test_recording_twice_is_byte_identical(tmp_path):
    src = build_host(tmp_path / "src")
    first, second = tmp_path / "one", tmp_path / "two"
    m1 = record_fixture(HostRoot.open(src), first)
    m2 = record_fixture(HostRoot.open(src), second)
    assert m1 == m2
    assert snapshot(first, host_only=False) == snapshot(second, host_only=False)
    manifest_text = (first / FIXTURE_META_DIR / MANIFEST_NAME).read_text()
    assert FixtureManifest.model_validate_json(manifest_text) == m1


def test_binary_oversized_and_special_attributes_are_skipped_with_a_reason(tmp_path):
    src = build_host(tmp_path / "src")
    (src / GPU.lstrip("/") / "revision").write_bytes(b"\x00\xff\x10")
    (src / GPU.lstrip("/") / "local_cpulist").write_text("0" * (ATTR_CAP + 1))
    (src / GPU.lstrip("/") / "numa_node").unlink()
    os.mkfifo(src / GPU.lstrip("/") / "numa_node")  # would block forever if opened
    out = tmp_path / "out"

    manifest = record_fixture(HostRoot.open(src), out)

    reasons = {s.path: s.reason for s in manifest.skipped}
    assert reasons[f"{GPU}/revision"] == "binary content"
    assert reasons[f"{GPU}/local_cpulist"] == "larger than 64 KiB"
    assert reasons[f"{GPU}/numa_node"] == "not a regular file"
    for name in ("revision", "local_cpulist", "numa_node"):
        assert not os.path.lexists(out / GPU.lstrip("/") / name)
    assert (out / GPU.lstrip("/") / "vendor").read_text() == "0x10de\n"


def test_driver_control_files_are_empty_markers(tmp_path):
    src = build_host(tmp_path / "src")
    (src / "sys/bus/pci/drivers/vfio-pci/new_id").write_text("must not be copied\n")
    out = tmp_path / "out"
    record_fixture(HostRoot.open(src), out)
    assert (out / "sys/bus/pci/drivers/vfio-pci/new_id").read_bytes() == b""
    assert (out / "sys/bus/pci/drivers_probe").read_bytes() == b""


def test_modules_are_recorded_as_directories_only(tmp_path):
    """Presence is what counts; ``initstate`` keeps a loadable module's directory alive in git."""
    src = build_host(tmp_path / "src")
    put(src, "/sys/module/vfio_pci/initstate", "live\n")
    put(src, "/sys/module/vfio_pci/parameters/ids", "10de:2335\n")
    put(src, "/sys/module/ext4/initstate", "live\n")  # not a module discovery asks about
    out = tmp_path / "out"
    record_fixture(HostRoot.open(src), out)
    assert sorted(os.listdir(out / "sys/module")) == ["kvm", "vfio_pci"]
    assert sorted(os.listdir(out / "sys/module/vfio_pci")) == ["initstate"]
    assert os.listdir(out / "sys/module/kvm") == []


def test_flat_files_are_recorded_as_regular_files(tmp_path):
    """/proc/self and /etc/os-release are links on a real host; the recording holds their text."""
    src = build_host(tmp_path / "src")
    (src / "etc/os-release").unlink()
    put(src, "/usr/lib/os-release", 'NAME="Debian GNU/Linux"\n')
    link(src, "/etc/os-release", "../usr/lib/os-release")
    out = tmp_path / "out"
    record_fixture(HostRoot.open(src), out)
    assert not (out / "etc/os-release").is_symlink()
    assert (out / "etc/os-release").read_text() == 'NAME="Debian GNU/Linux"\n'
    assert not (out / "usr").exists()


def test_recording_the_live_host(tmp_path):
    out = tmp_path / "live"
    manifest = record_fixture(HostRoot.open("/"), out)

    assert manifest.live is True and manifest.source_root == "/"
    assert [c.name for c in manifest.commands] == [name for name, _ in COMMANDS]
    for command in manifest.commands:
        assert (command.exit_code is None) == (command.output_file is None)
        assert command.exit_code is not None or command.error  # a missing tool says so
        if command.output_file:
            assert (out / FIXTURE_META_DIR / command.output_file).is_file()
    on_disk = json.loads((out / FIXTURE_META_DIR / MANIFEST_NAME).read_text())
    assert on_disk == json.loads(manifest.model_dump_json())
    assert (out / "proc/self/mountinfo").read_text().strip()
    assert not (out / "proc/self").is_symlink()
    if os.path.isdir("/sys/bus/pci/devices"):
        for name in os.listdir("/sys/bus/pci/devices"):
            assert (out / "sys/bus/pci/devices" / name).is_symlink() == os.path.islink(f"/sys/bus/pci/devices/{name}")
    for entry in snapshot(out).values():  # device nodes are markers, never copies
        assert entry[0] != "file" or len(entry[1]) <= 4 * 1024 * 1024
    if discover is not None:
        report = discover(HostRoot.open(out))
        assert report.summary.gpu_devices == len(report.gpus)
