"""One recorded host is one file: a deterministic ``.tar.xz`` of its recording tree.

A recording is thousands of small files and links (sysfs attributes, udev
records, ``/dev/disk/by-id`` names). Kept in git as a tree it is thousands of
tracked files that say nothing file by file; packed it is one file that
changes only when the host did. :func:`pack_tree` makes the archive
deterministic (entries sorted, every mtime 0, uid/gid 0, no owner names, only
the permission bits kept), so the same tree always packs to the same bytes.

:func:`unpack_tree` is the only way back, and it treats the archive as hostile:
only directories, regular files and symlinks; names are relative and already
normal (no ``..``, no ``.``, no doubled ``/``); and nothing is ever written
through a link, because every parent of every entry must be a directory this
unpack made itself. Link *targets* are kept verbatim, absolute ones included:
a recording is read through :class:`gpuaas_agent.hostfs.HostRoot`, which
resolves them inside the root.

:func:`tree_digest` names a tree by its content (paths, kinds, file bytes and
exec bits, link targets), so a test can pin a generated tree or prove that
recording -> archive -> unpack changed nothing.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

from gpuaas_agent.errors import FixtureError

ARCHIVE_SUFFIX = ".tar.xz"
XZ_PRESET = 6
# A recorded host is a few MiB; anything near this is not a recording.
MAX_UNPACKED_BYTES = 1024 * 1024 * 1024
MAX_ENTRIES = 1_000_000


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` (links not followed), as (relative posix path, lstat)."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for name in dirnames + filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            yield rel, os.lstat(root / rel)


def _entries(root: Path) -> list[tuple[str, os.stat_result]]:
    """All entries sorted by their path components (a directory before its contents)."""
    if not root.is_dir() or root.is_symlink():
        raise FixtureError(f"{str(root)!r} is not a directory", code="not_a_tree", evidence={"root": str(root)})
    out = list(_walk(root))
    out.sort(key=lambda item: item[0].split("/"))
    for rel, st in out:
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise FixtureError(
                f"{rel!r} is neither a file, a directory nor a link",
                code="unsupported_entry",
                evidence={"root": str(root), "path": rel, "mode": oct(st.st_mode)},
            )
    return out


def tree_digest(root: str | os.PathLike[str]) -> str:
    """sha256 over every entry of the tree: kind and path, then file bytes and exec bit, or link target.

    Permission bits other than "executable" are left out, as git leaves them
    out: they follow the umask of whoever wrote the tree, not its content.
    """
    root = Path(root)
    digest = hashlib.sha256()
    for rel, st in _entries(root):
        if stat.S_ISLNK(st.st_mode):
            digest.update(f"l {rel}\0{os.readlink(root / rel)}\0".encode())
        elif stat.S_ISDIR(st.st_mode):
            digest.update(f"d {rel}\0".encode())
        else:
            content = (root / rel).read_bytes()
            kind = "x" if st.st_mode & 0o111 else "f"
            digest.update(f"{kind} {rel}\0{hashlib.sha256(content).hexdigest()}\0".encode())
    return digest.hexdigest()


def pack_tree(root: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the tree under ``root`` as the deterministic archive ``out`` (which must not exist).

    Written to a sibling temporary file and renamed, so ``out`` is either
    absent or complete.
    """
    root, out = Path(root), Path(out)
    if out.exists() or out.is_symlink():
        raise FixtureError(f"output {str(out)!r} already exists", code="output_exists", evidence={"out": str(out)})
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, st in _entries(root):
            info = tarfile.TarInfo(rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(root / rel), 0o777
                tar.addfile(info)
            elif stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                content = (root / rel).read_bytes()
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    data = lzma.compress(buffer.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _refuse(archive: Path, name: str, why: str) -> FixtureError:
    return FixtureError(
        f"archive {archive.name!r}: entry {name!r} {why}",
        code="unsafe_archive_entry",
        evidence={"archive": str(archive), "entry": name, "why": why},
    )


def unpack_tree(archive: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Unpack ``archive`` into the new (absent or empty) directory ``dest``; returns ``dest``."""
    archive, dest = Path(archive), Path(dest)
    if dest.exists() or dest.is_symlink():
        if dest.is_symlink() or not dest.is_dir() or any(dest.iterdir()):
            raise FixtureError(
                f"output {str(dest)!r} exists and is not an empty directory",
                code="output_exists",
                evidence={"out": str(dest)},
            )
    else:
        dest.mkdir(parents=True)
    kinds: dict[str, str] = {"": "dir"}  # what this unpack made, by relative path
    dir_modes: list[tuple[Path, int]] = []
    try:
        with tarfile.open(archive, mode="r:xz") as tar:
            total = 0
            for count, member in enumerate(tar, start=1):
                if count > MAX_ENTRIES:
                    raise _refuse(archive, member.name, f"is past the limit of {MAX_ENTRIES} entries")
                total += member.size if member.isreg() else 0
                if total > MAX_UNPACKED_BYTES:
                    raise _refuse(archive, member.name, f"takes the archive past {MAX_UNPACKED_BYTES} bytes")
                _unpack_member(archive, dest, tar, member, kinds, dir_modes)
    except (OSError, EOFError, lzma.LZMAError, tarfile.TarError) as exc:
        raise FixtureError(
            f"cannot read archive {str(archive)!r}: {exc}",
            code="archive_unreadable",
            evidence={"archive": str(archive), "error": str(exc)},
        ) from exc
    for path, mode in reversed(dir_modes):  # deepest last-made first, so a read-only parent comes last
        os.chmod(path, mode)
    return dest


def _unpack_member(
    archive: Path, dest: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, kinds: dict[str, str],
    dir_modes: list[tuple[Path, int]],
) -> None:
    """One entry: checked name, parents this unpack made, never written through an existing path."""
    name = member.name
    if not name or "\0" in name or name.startswith("/") or name == "." or posixpath.normpath(name) != name:
        raise _refuse(archive, name, "is not a normal relative path")
    if ".." in name.split("/"):
        raise _refuse(archive, name, "climbs out with '..'")
    if name in kinds:
        raise _refuse(archive, name, "appears twice")
    if not (member.isdir() or member.issym() or member.isreg()):
        raise _refuse(archive, name, "is neither a file, a directory nor a link")
    _make_parents(archive, dest, posixpath.dirname(name), kinds)
    path = dest / name
    if member.isdir():
        path.mkdir()
        kinds[name] = "dir"
        dir_modes.append((path, member.mode & 0o777))
    elif member.issym():
        os.symlink(member.linkname, path)
        kinds[name] = "link"
    else:
        source = tar.extractfile(member)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            if source is not None:
                shutil.copyfileobj(source, fh)
        os.chmod(path, member.mode & 0o777)
        kinds[name] = "file"


def _make_parents(archive: Path, dest: Path, parent: str, kinds: dict[str, str]) -> None:
    """Every ancestor of an entry is a directory this unpack made (made now when the archive skipped it)."""
    if not parent:
        return
    parts = parent.split("/")
    for depth in range(1, len(parts) + 1):
        rel = "/".join(parts[:depth])
        kind = kinds.get(rel)
        if kind == "dir":
            continue
        if kind is not None:
            raise _refuse(archive, parent, f"lies under {rel!r}, which is a {kind}, not a directory")
        (dest / rel).mkdir()
        kinds[rel] = "dir"
