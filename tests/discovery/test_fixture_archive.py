"""One host, one file: the archive is deterministic, round-trips a tree exactly, and refuses hostile entries.

Hostile archives are built with ``tarfile`` itself (real archives, no mocks);
every refusal is checked to have written nothing outside the destination.
"""

from __future__ import annotations

import io
import lzma
import os
import tarfile
from pathlib import Path

import pytest

from gpuaas_agent.discovery.fixture_archive import pack_tree, tree_digest, unpack_tree
from gpuaas_agent.errors import FixtureError


def _tree(root: Path) -> Path:
    """Files, an exec bit, an empty dir, relative and absolute links, a dangling link."""
    (root / "sys/devices/pci0000:00/0000:00:01.0").mkdir(parents=True)
    (root / "sys/devices/pci0000:00/0000:00:01.0/vendor").write_text("0x10de\n")
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    os.symlink("../../../devices/pci0000:00/0000:00:01.0", root / "sys/bus/pci/devices/0000:00:01.0")
    os.symlink("/sys/devices/pci0000:00", root / "sys/abs")
    (root / "dev/disk/by-id").mkdir(parents=True)
    os.symlink("../../nvme0n1", root / "dev/disk/by-id/nvme-eui.0025385b71b07e2f")  # node not recorded
    (root / "sys/block/nvme0n1/holders").mkdir(parents=True)  # empty: kept (git would drop it)
    (root / "bin").mkdir()
    (root / "bin/tool").write_text("#!/bin/sh\n")
    (root / "bin/tool").chmod(0o755)
    (root / "empty-file").write_bytes(b"")
    return root


def _xz(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ)


def _info(name: str, kind: bytes = tarfile.REGTYPE, *, linkname: str = "", size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size, info.mode = kind, linkname, size, 0o644
    return info


def test_round_trip_keeps_files_links_modes_and_empty_dirs(tmp_path):
    src = _tree(tmp_path / "src")
    pack_tree(src, tmp_path / "host.tar.xz")
    out = unpack_tree(tmp_path / "host.tar.xz", tmp_path / "out")
    assert tree_digest(out) == tree_digest(src)
    assert os.readlink(out / "sys/abs") == "/sys/devices/pci0000:00"  # absolute kept verbatim
    assert os.readlink(out / "dev/disk/by-id/nvme-eui.0025385b71b07e2f") == "../../nvme0n1"
    assert (out / "sys/block/nvme0n1/holders").is_dir() and not os.listdir(out / "sys/block/nvme0n1/holders")
    assert (out / "bin/tool").stat().st_mode & 0o777 == 0o755
    assert (out / "sys/bus/pci/devices/0000:00:01.0/vendor").read_text() == "0x10de\n"


def test_same_tree_packs_to_the_same_bytes_whatever_the_mtimes(tmp_path):
    src = _tree(tmp_path / "src")
    pack_tree(src, tmp_path / "a.tar.xz")
    os.utime(src / "empty-file", (1, 1))
    os.utime(src / "sys", (2, 2))
    pack_tree(src, tmp_path / "b.tar.xz")
    assert (tmp_path / "a.tar.xz").read_bytes() == (tmp_path / "b.tar.xz").read_bytes()
    with tarfile.open(tmp_path / "a.tar.xz") as tar:
        members = tar.getmembers()
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    names = [m.name for m in members]
    assert names == sorted(names, key=lambda n: n.split("/"))


def test_digest_changes_with_content_link_target_and_exec_bit(tmp_path):
    src = _tree(tmp_path / "src")
    before = tree_digest(src)
    (src / "bin/tool").chmod(0o644)
    no_exec = tree_digest(src)
    (src / "empty-file").write_bytes(b"\n")
    changed = tree_digest(src)
    assert len({before, no_exec, changed}) == 3


def test_packing_refuses_a_fifo_and_an_existing_output(tmp_path):
    src = _tree(tmp_path / "src")
    (tmp_path / "taken.tar.xz").write_bytes(b"mine")
    with pytest.raises(FixtureError) as caught:
        pack_tree(src, tmp_path / "taken.tar.xz")
    assert caught.value.code == "output_exists" and (tmp_path / "taken.tar.xz").read_bytes() == b"mine"
    os.mkfifo(src / "fifo")
    with pytest.raises(FixtureError) as caught:
        pack_tree(src, tmp_path / "new.tar.xz")
    assert caught.value.code == "unsupported_entry" and caught.value.evidence["path"] == "fifo"
    assert not (tmp_path / "new.tar.xz").exists()


@pytest.mark.parametrize(
    "entries",
    [
        [(_info("/etc/passwd", size=1), b"x")],
        [(_info("../escape", size=1), b"x")],
        [(_info("a/../../escape", size=1), b"x")],
        [(_info("./a", size=1), b"x")],
        [(_info("a//b", size=1), b"x")],
        [(_info("link", tarfile.SYMTYPE, linkname="/tmp"), None), (_info("link/planted", size=1), b"x")],
        [(_info("f", size=1), b"x"), (_info("f/under-a-file", size=1), b"x")],
        [(_info("f", size=1), b"x"), (_info("f", size=1), b"y")],
        [(_info("hard", tarfile.LNKTYPE, linkname="etc/passwd"), None)],
        [(_info("node", tarfile.CHRTYPE), None)],
        [(_info("pipe", tarfile.FIFOTYPE), None)],
    ],
    ids=["absolute", "dotdot", "inner-dotdot", "dot", "double-slash", "through-a-link", "under-a-file",
         "twice", "hardlink", "device", "fifo"],
)
def test_hostile_entries_are_refused_and_nothing_lands_outside(tmp_path, entries):
    (tmp_path / "host.tar.xz").write_bytes(_xz(entries))
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(FixtureError) as caught:
        unpack_tree(tmp_path / "host.tar.xz", tmp_path / "out")
    assert caught.value.code == "unsafe_archive_entry"
    assert os.listdir(outside) == []
    assert not Path("/tmp/planted").exists() and not (tmp_path / "escape").exists()


def test_unpack_into_a_non_empty_directory_is_refused(tmp_path):
    pack_tree(_tree(tmp_path / "src"), tmp_path / "host.tar.xz")
    (tmp_path / "out").mkdir()
    (tmp_path / "out/keep").write_text("mine\n")
    with pytest.raises(FixtureError) as caught:
        unpack_tree(tmp_path / "host.tar.xz", tmp_path / "out")
    assert caught.value.code == "output_exists" and os.listdir(tmp_path / "out") == ["keep"]


def test_a_file_that_is_not_an_archive_is_a_typed_error(tmp_path):
    (tmp_path / "junk.tar.xz").write_bytes(b"not xz at all")
    with pytest.raises(FixtureError) as caught:
        unpack_tree(tmp_path / "junk.tar.xz", tmp_path / "out")
    assert caught.value.code == "archive_unreadable"
