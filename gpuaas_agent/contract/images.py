"""Records of the image cache: what a fetched, verified image is, and the marker that proves it.

The marker is the reason a cache hit never re-hashes: an image is hashed once,
while its bytes arrive, and the marker written afterwards says so (docs/performance.md).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from gpuaas_agent.contract.base import SCHEMA_VERSION, WireEnum, WireModel
from gpuaas_agent.contract.types import Sha256Hex

# A SHA-256 digest as lower-case hex, the cache key and the control plane's image id.


class ImageFormat(WireEnum):
    """Formats `qemu-img convert` may read into a slot disk; anything else is refused."""

    raw = "raw"
    qcow2 = "qcow2"


class CachedImage(WireModel):
    """A verified image in the cache, ready to clone."""

    path: str
    sha256: Sha256Hex
    size_bytes: Annotated[int, Field(ge=0)]
    source_url: str
    format: ImageFormat
    # A hit: how the provision's own URL answered for these bytes (recorded_source, ranges, full_read);
    # None for an image this fetch downloaded. A digest alone never serves a hit (host/images/cache.py).
    source_proof: str | None = None


class CacheEntryMarker(WireModel):
    """``<root>/sha256/<hex>.verified.json``: written atomically after the digest matched."""

    schema_version: str = SCHEMA_VERSION
    sha256: Sha256Hex
    size_bytes: Annotated[int, Field(ge=0)]
    source_url: str
    format: ImageFormat
    verified_at: datetime
