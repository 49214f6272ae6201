"""Parsers of /proc and udev text, against the formats the kernel and udev write."""

from gpuaas_agent.discovery.procfs import parse_mountinfo, parse_swaps, parse_udev_data

MOUNTINFO = (
    "22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/mapper/ubuntu--vg-ubuntu--lv rw\n"
    "95 22 259:7 / /share\\0402 rw,relatime shared:50 master:3 - ext4 /dev/nvme0n1p1 rw\n"
    "96 22 0:45 /@home /home rw - btrfs /dev/nvme1n1p2 rw,space_cache=v2\n"
    "garbage line\n"
    "\n"
)


def test_mountinfo_fields_optional_tags_and_escapes():
    entries, bad = parse_mountinfo(MOUNTINFO)
    assert [(e.dev, e.mountpoint, e.fstype, e.source) for e in entries] == [
        ("252:0", "/", "ext4", "/dev/mapper/ubuntu--vg-ubuntu--lv"),
        ("259:7", "/share 2", "ext4", "/dev/nvme0n1p1"),
        ("0:45", "/home", "btrfs", "/dev/nvme1n1p2"),
    ]
    assert entries[2].root == "/@home"
    assert bad == [4]


def test_swaps_skips_header():
    text = "Filename\tType\tSize\tUsed\tPriority\n/dev/nvme3n1p2 partition 8388604 0 -2\n/swap.img file 1 0 -3\n"
    assert parse_swaps(text) == ["/dev/nvme3n1p2", "/swap.img"]


def test_udev_record_properties_and_links():
    props, links = parse_udev_data("S:disk/by-id/nvme-eui.01\nE:ID_FS_TYPE=ext4\nE:ID_MODEL=A=B\nI:123\n")
    assert props == {"ID_FS_TYPE": "ext4", "ID_MODEL": "A=B"}
    assert links == ["disk/by-id/nvme-eui.01"]
