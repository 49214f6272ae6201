"""The lab guest image builder (``lab/build_guest_image.py``): what it picks, what it writes, and its cache."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pytest

from tests.realvm import LAB_CACHE, load_builder

DEBIAN_SEARCH = """\
linux-image-6.1.0-28-amd64 - Linux 6.1 for 64-bit PCs (signed)
linux-image-6.1.0-28-cloud-amd64 - Linux 6.1 for x86-64 cloud (signed)
linux-image-6.12.9+bpo-amd64 - Linux 6.12 for 64-bit PCs (signed)
linux-image-6.12.117+deb12-amd64 - Linux 6.12 for 64-bit PCs (signed)
linux-image-6.12.117+deb12-cloud-amd64 - Linux 6.12 for x86-64 cloud (signed)
linux-image-6.12.117+deb12-rt-amd64 - Linux 6.12 for 64-bit PCs (signed), PREEMPT_RT
linux-image-6.12.117+deb12-amd64-unsigned - Linux 6.12 for 64-bit PCs
linux-image-amd64 - Linux for 64-bit PCs (meta-package)
"""
UBUNTU_SEARCH = """\
linux-image-6.8.0-31-generic - Signed kernel image generic
linux-image-6.8.0-100-generic - Signed kernel image generic
linux-image-6.8.0-49-generic - Signed kernel image generic
linux-image-generic - Generic Linux kernel image
"""


def _run(*argv: str, stdin: bytes | None = None) -> str:
    return subprocess.run(list(argv), input=stdin, capture_output=True, check=True, timeout=60).stdout.decode()


@pytest.mark.parametrize(
    ("search", "expected"),
    [(DEBIAN_SEARCH, "linux-image-6.12.117+deb12-amd64"), (UBUNTU_SEARCH, "linux-image-6.8.0-100-generic")],
)
def test_newest_generic_kernel_is_picked_by_version_not_by_text(search, expected):
    assert load_builder().newest_kernel_package(search) == expected


def test_no_kernel_package_known_to_apt_is_a_typed_error():
    builder = load_builder()
    with pytest.raises(builder.LabImageError, match="lab_image_failed"):
        builder.newest_kernel_package("linux-image-amd64 - meta\n")


def test_module_load_order_puts_dependencies_first_and_leaves_out_builtin_ones(tmp_path):
    (tmp_path / "modules.dep").write_text(
        "kernel/drivers/net/virtio_net.ko.xz: kernel/drivers/net/net_failover.ko.xz kernel/net/core/failover.ko.xz\n"
        "kernel/drivers/net/net_failover.ko.xz: kernel/net/core/failover.ko.xz\n"
        "kernel/net/core/failover.ko.xz:\n"
        "kernel/drivers/scsi/sr_mod.ko.xz: kernel/drivers/cdrom/cdrom.ko.xz\n"
        "kernel/drivers/cdrom/cdrom.ko.xz:\n"
    )
    order = load_builder().module_load_order(tmp_path, ["virtio_net", "sr_mod", "virtio_pci"])
    assert order == [
        "kernel/net/core/failover.ko.xz",
        "kernel/drivers/net/net_failover.ko.xz",
        "kernel/drivers/net/virtio_net.ko.xz",
        "kernel/drivers/cdrom/cdrom.ko.xz",
        "kernel/drivers/scsi/sr_mod.ko.xz",
    ]


def test_initramfs_archive_is_newc_that_cpio_reads_and_the_same_bytes_every_time():
    builder = load_builder()

    def archive() -> bytes:
        cpio = builder.Cpio()
        cpio.chardev("dev/console", 5, 1)
        cpio.file("bin/busybox", b"\x7fELF...", 0o755)
        cpio.symlink("bin/sh", "busybox")
        cpio.file("init", b"#!/bin/sh\n", 0o755)
        return cpio.render()

    data = archive()
    assert data == archive()
    listing = _run("cpio", "-itv", "--quiet", stdin=data)
    lines = {line.split()[-1] if "->" not in line else line.split()[-3]: line for line in listing.splitlines()}
    assert lines["dev/console"].startswith("crw-------") and "5,   1" in lines["dev/console"]
    assert lines["bin/sh"].startswith("lrwxrwxrwx") and lines["bin/sh"].endswith("-> busybox")
    assert lines["init"].startswith("-rwxr-xr-x")
    assert lines["bin"].startswith("drwxr-xr-x")


def test_image_is_gpt_with_one_esp_holding_a_uki_of_kernel_initramfs_and_serial_cmdline(lab_guest_image, tmp_path):
    builder = load_builder()
    image = lab_guest_image.path
    table = json.loads(_run("sfdisk", "--json", str(image)))["partitiontable"]
    assert table["label"] == "gpt"
    (esp,) = table["partitions"]
    assert esp["type"] == builder.ESP_TYPE and esp["start"] == 2048
    spec = f"{image}@@{esp['start'] * 512}"
    assert "BOOTX64  EFI" in _run("mdir", "-i", spec, "::/EFI/BOOT")
    uki = tmp_path / "BOOTX64.EFI"
    _run("mcopy", "-i", spec, "::/EFI/BOOT/BOOTX64.EFI", str(uki))
    sections = _run("objdump", "-h", str(uki))
    for name in (".osrel", ".cmdline", ".linux", ".initrd"):
        assert f" {name} " in sections, sections
    _run("objcopy", "-O", "binary", "--only-section=.cmdline", str(uki), str(tmp_path / "cmdline"))
    assert (tmp_path / "cmdline").read_bytes().rstrip(b"\0") == b"console=ttyS0"
    _run("objcopy", "-O", "binary", "--only-section=.initrd", str(uki), str(tmp_path / "initrd.gz"))
    names = _run("cpio", "-it", "--quiet", stdin=gzip.decompress((tmp_path / "initrd.gz").read_bytes())).split()
    for needed in ("init", "bin/busybox", "usr/sbin/dropbear", "etc/acpi/PWRF/00000080", "etc/modules.load"):
        assert needed in names
    assert any(n.endswith("/virtio_net.ko") for n in names) and any(n.endswith("/isofs.ko") for n in names)
    assert any(n.endswith("/button.ko") for n in names) and any(n.endswith("/evdev.ko") for n in names)


def test_rebuild_with_the_same_inputs_is_a_no_op_and_a_fresh_build_gives_the_same_bytes(lab_guest_image, tmp_path):
    builder = load_builder()
    again = builder.ensure_guest_image(LAB_CACHE)
    assert (again.built, again.path, again.sha256) == (False, lab_guest_image.path, lab_guest_image.sha256)
    # A second cache sharing only the downloaded/unpacked kernel builds the image from scratch.
    fresh_cache = tmp_path / "cache"
    fresh_cache.mkdir()
    for shared in ("debs", "kernels"):
        (fresh_cache / shared).symlink_to(LAB_CACHE / shared)
    fresh = builder.ensure_guest_image(fresh_cache)
    assert fresh.built and fresh.path.parent == fresh_cache / "images"
    assert (fresh.input_digest, fresh.sha256) == (lab_guest_image.input_digest, lab_guest_image.sha256)
    out = builder.build_guest_image(tmp_path / "copy.raw", fresh_cache)
    assert out == tmp_path / "copy.raw" and out.read_bytes() == fresh.path.read_bytes()
    assert builder._sha256_file(Path(out)) == lab_guest_image.sha256
