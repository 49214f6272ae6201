"""Every fixture host by name: ``fixture_host(name) -> Path``, the one way to reach one.

Tests, the lab, the benchmarks and the deploy tests all call this; nothing
else reads ``fixtures/hosts/``. That directory holds one small file per host:

* ``<name>.tar.xz``: a real recording (``gpuaas-agent record-fixture --archive``),
  unpacked by :func:`gpuaas_agent.discovery.fixture_archive.unpack_tree`;
* ``<name>.synth.json``: the description of a synthetic host (generator
  variant and options, and the pinned digest of the tree it must give);
  ``lab/synth_host.py`` builds the tree in code, as NVIDIA go-nvlib's
  ``pkg/nvpci/mock.go`` builds its mock sysfs.

A host is materialised once into a cache directory keyed by the content hash
of what makes it (the archive's bytes; the description plus the generator's
source), so a test session pays for it at most once, a second session not at
all, and a changed generator can never serve a stale tree. A tree is built in
a temporary sibling and renamed into place, so a test session and the lab
materialising the same host at once both end up with one complete tree.

The returned tree is shared by everyone who asks: read it, never write into it
(tests that break a host copy it first, ``host_copy`` in ``tests/conftest.py``).

``python -m lab.fixture_hosts [NAME...] [--link] [--pin]`` prints the paths
(``make fixtures``); ``--link`` also points ``fixtures/hosts/<name>`` (ignored by
git) at each, the compatibility path for code that still spells
``REPO / "fixtures/hosts/<name>"``; ``--pin`` rewrites each description's
``tree_sha256`` after a deliberate generator change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, StrictBool

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpuaas_agent.contract.base import WireModel  # noqa: E402
from gpuaas_agent.contract.types import Sha256Hex  # noqa: E402
from gpuaas_agent.discovery.fixture_archive import ARCHIVE_SUFFIX, tree_digest, unpack_tree  # noqa: E402

FIXTURES_DIR = REPO / "fixtures" / "hosts"
GENERATOR = Path(__file__).resolve().with_name("synth_host.py")
SYNTH_SUFFIX = ".synth.json"
CACHE_ENV = "GPUAAS_FIXTURE_CACHE"
DEFAULT_CACHE = REPO / ".cache" / "fixture-hosts"
# Bumped when the way a tree is materialised changes, so old cache entries are never reused.
MATERIALISE_VERSION = "1"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9.-]{0,63}")

# The 8x H200 host the lab, the benchmarks and most tests use.
H200 = "h200-slice-after-transition"


class SynthDescription(WireModel):
    """``fixtures/hosts/<name>.synth.json``: which generated host this name is, and the tree it must be."""

    generator: Literal["lab/synth_host.py"]
    variant: str = Field(pattern=r"^[a-z-]+$")
    options: dict[str, StrictBool | int | str] = {}
    summary: str
    tree_sha256: Sha256Hex


_MATERIALISED: dict[str, Path] = {}  # name -> root, for this process
_BUILT_HERE: set[str] = set()  # names this process built (not found in the cache)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def recorded_names() -> tuple[str, ...]:
    """Hosts recorded on real machines (one archive each)."""
    return tuple(sorted(p.name[: -len(ARCHIVE_SUFFIX)] for p in FIXTURES_DIR.glob(f"*{ARCHIVE_SUFFIX}")))


def synthetic_names() -> tuple[str, ...]:
    """Hosts generated from a description."""
    return tuple(sorted(p.name[: -len(SYNTH_SUFFIX)] for p in FIXTURES_DIR.glob(f"*{SYNTH_SUFFIX}")))


def host_names() -> tuple[str, ...]:
    """Every fixture host, sorted."""
    return tuple(sorted(recorded_names() + synthetic_names()))


def description(name: str) -> SynthDescription:
    """The description of a synthetic host."""
    return SynthDescription.model_validate_json((FIXTURES_DIR / f"{name}{SYNTH_SUFFIX}").read_bytes())


def _source(name: str) -> tuple[str, Path]:
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"not a fixture host name: {name!r}")
    archive, synth = FIXTURES_DIR / f"{name}{ARCHIVE_SUFFIX}", FIXTURES_DIR / f"{name}{SYNTH_SUFFIX}"
    if archive.is_file() and synth.is_file():
        raise ValueError(f"fixture host {name!r} is both recorded and described: keep one of {archive.name}, {synth.name}")
    if archive.is_file():
        return "archive", archive
    if synth.is_file():
        return "synth", synth
    raise FileNotFoundError(f"no fixture host {name!r}: neither {archive} nor {synth} exists (hosts: {host_names()})")


def cache_key(name: str) -> str:
    """Content hash of everything that makes the tree of ``name``."""
    kind, source = _source(name)
    digest = hashlib.sha256(f"gpuaas-fixture-host\0{MATERIALISE_VERSION}\0{kind}\0{name}\0".encode())
    if kind == "archive":
        digest.update(source.read_bytes())
    else:
        desc = description(name)
        digest.update(json.dumps({"variant": desc.variant, "options": desc.options}, sort_keys=True).encode())
        digest.update(GENERATOR.read_bytes())
    return digest.hexdigest()[:24]


def _build(name: str, kind: str, source: Path, dest: Path) -> None:
    if kind == "archive":
        unpack_tree(source, dest)
        return
    from lab import synth_host

    desc = description(name)
    synth_host.build(dest, desc.variant, **desc.options)


def fixture_host(name: str) -> Path:
    """The root of fixture host ``name``, materialised at most once per process (and per cache key)."""
    if name in _MATERIALISED:
        return _MATERIALISED[name]
    kind, source = _source(name)
    final = cache_dir() / cache_key(name)
    root = final / name
    if not root.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
        staging.chmod(0o755)  # readable like any checkout, not mkdtemp's 0700
        try:
            _build(name, kind, source, staging / name)
            try:
                os.rename(staging, final)
                _BUILT_HERE.add(name)
            except OSError:
                if not root.is_dir():  # not someone else's complete tree: a real failure
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _MATERIALISED[name] = root
    return root


def built_in_this_process(name: str) -> bool:
    """Whether this process built ``name``'s tree (rather than finding it in the cache)."""
    return name in _BUILT_HERE


def link_hosts(names: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Point ``fixtures/hosts/<name>`` at each materialised host (compatibility path; ignored by git)."""
    out = {}
    for name in names or host_names():
        root = fixture_host(name)
        link = FIXTURES_DIR / name
        if link.is_symlink():
            if os.readlink(link) == str(root):
                out[name] = root
                continue
            link.unlink()
        elif link.exists():
            raise FileExistsError(
                f"{link} is a directory left from when fixtures were trees: remove it (hosts are materialised "
                f"under {cache_dir()}; a new recording goes in as {name}{ARCHIVE_SUFFIX}, see docs/testing.md)"
            )
        tmp = link.with_name(f".{name}.link-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(root)
        os.replace(tmp, link)
        out[name] = root
    return out


def pin(name: str) -> str:
    """Rewrite the ``tree_sha256`` of a synthetic host's description to the tree the generator gives now."""
    path = FIXTURES_DIR / f"{name}{SYNTH_SUFFIX}"
    desc = description(name)
    with tempfile.TemporaryDirectory() as tmp:
        _build(name, "synth", path, Path(tmp) / name)
        digest = tree_digest(Path(tmp) / name)
    updated = desc.model_copy(update={"tree_sha256": digest})
    path.write_text(json.dumps(updated.model_dump(), indent=2) + "\n")
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Materialise fixture hosts and print their roots.")
    parser.add_argument("names", nargs="*", help="hosts (default: every one)")
    parser.add_argument("--link", action="store_true", help="also point fixtures/hosts/<name> at each root")
    parser.add_argument("--pin", action="store_true", help="re-pin the tree_sha256 of synthetic hosts")
    args = parser.parse_args(argv)
    names = tuple(args.names) or host_names()
    if args.pin:
        for name in names:
            if name in synthetic_names():
                print(f"{name} tree_sha256={pin(name)}")
        return 0
    roots = link_hosts(names) if args.link else {name: fixture_host(name) for name in names}
    for name, root in roots.items():
        print(root if len(names) == 1 else f"{name} {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
