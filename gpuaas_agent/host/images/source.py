"""Where an image may come from: the config's allow-list, checked before anything is opened.

A task's ``image.url`` is written by whoever can publish a task. Without this check it could
name any file the agent can read: another slot's disk (``/dev/disk/by-id/...``), the
enrollment credentials in the state dir, an endless device (``/dev/zero``). So:

- ``https://`` only to a host (and port) the config lists, on every redirect too;
- ``file://`` only for a regular file that resolves, symlinks followed, under the configured
  image directory, and never under ``/dev``, ``/proc``, ``/sys``, the state dir or the image
  cache itself; the opened descriptor is checked again (``fstat`` + its ``/proc/self/fd`` path),
  so a file swapped between the check and the open is still refused;
- ``http://`` only when the lab allows it, and only to a loopback address.

A refusal is ``image_url_refused`` with the URL and the rule that refused it, never anything
read from the source. A path outside the image directory is refused on its spelling before
the file system is asked anything about it.
"""

from __future__ import annotations

import errno
import io
import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

from gpuaas_agent.errors import HostError

SCHEMES = ("https", "file", "http")
FORBIDDEN_ROOTS = ("/dev", "/proc", "/sys")
HTTPS_DEFAULT_PORT = 443

# The rules a refusal names (evidence["rule"]).
RULE_SCHEME = "scheme"
RULE_HOST = "host_not_allowed"
RULE_OUTSIDE = "outside_image_dir"
RULE_NOT_REGULAR = "not_regular_file"
RULE_FORBIDDEN = "forbidden_path"
RULE_MALFORMED = "malformed_url"
# A second name of a file elsewhere: a hard link in the image dir to another tenant's upload, the state dir
# or a key would pass every path rule (its path *is* in the dir). Images there are single-named files.
RULE_HARD_LINK = "hard_linked_file"


class ImageCacheError(HostError):
    """Fetching or verifying an image failed; no partial file is left in the cache.

    Codes: ``image_url_refused`` (the source is not allowed by the config; evidence ``url``
    and ``rule``), ``digest_mismatch``, ``truncated``, ``too_large``, ``fetch_stalled``,
    ``fetch_timeout``, ``cache_full``, ``cache_write_failed``, ``fetch_failed``,
    ``unknown_format``, ``backing_file_refused``.
    """

    default_code = "image_cache_error"


@dataclass(frozen=True)
class SourcePolicy:
    """The allow-list (``SliceConfig.image_*``) plus the directories that are never a source.

    ``https_hosts``: lower-case ``host`` or ``host:port``; a bare host means port 443.
    ``forbidden``: the state dir and the cache root (whatever ``file_dir`` says).
    """

    https_hosts: tuple[str, ...] = ()
    file_dir: Path | None = None
    allow_loopback_http: bool = False
    forbidden: tuple[Path, ...] = ()


def refused(url: str, rule: str, message: str) -> ImageCacheError:
    return ImageCacheError(message, code="image_url_refused", evidence={"url": url, "rule": rule})


def check_url(policy: SourcePolicy, url: str) -> str | None:
    """Raise ``image_url_refused`` unless ``url`` is allowed; for ``file://`` the resolved path to open."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise refused(url, RULE_SCHEME, "image URL scheme is not https:// or file:// (lower case)")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise refused(url, RULE_MALFORMED, "image URL contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise refused(url, RULE_MALFORMED, "image URL does not parse") from None
    if scheme == "file":
        return _check_file(policy, url, parts)
    if parts.username is not None or parts.password is not None or not parts.hostname:
        raise refused(url, RULE_HOST, "image URL carries credentials or no host")
    host = parts.hostname
    if scheme == "https":
        if not _https_host_allowed(policy.https_hosts, host, port):
            raise refused(url, RULE_HOST, f"https host {parts.netloc} is not in slice.image_https_hosts")
        return None
    if not policy.allow_loopback_http:
        raise refused(url, RULE_SCHEME, "plain http:// images are not allowed")
    if not _is_loopback(host):
        raise refused(url, RULE_HOST, "plain http:// is allowed only to a loopback address")
    return None


def _https_host_allowed(allowed: tuple[str, ...], host: str, port: int | None) -> bool:
    wanted = (host.lower(), port or HTTPS_DEFAULT_PORT)
    for entry in allowed:
        name, colon, entry_port = entry.lower().partition(":")
        if (name, int(entry_port) if colon else HTTPS_DEFAULT_PORT) == wanted:
            return True
    return False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _under(path: str, base: str) -> bool:
    """``path`` is ``base`` or below it (both absolute, normalised)."""
    return path == base or path.startswith(base.rstrip("/") + "/")


def _forbidden_roots(policy: SourcePolicy) -> list[str]:
    roots = list(FORBIDDEN_ROOTS)
    for path in policy.forbidden:
        roots += [os.path.normpath(os.path.abspath(path)), os.path.realpath(path)]
    return roots


def _placement_rule(policy: SourcePolicy, path: str, bases: list[str]) -> str | None:
    """The rule ``path`` breaks by where it lies (forbidden first), or ``None``."""
    if any(_under(path, root) for root in _forbidden_roots(policy)):
        return RULE_FORBIDDEN
    if not any(_under(path, base) and path != base for base in bases):
        return RULE_OUTSIDE
    return None


def _bases(policy: SourcePolicy) -> list[str]:
    assert policy.file_dir is not None
    return [os.path.normpath(os.path.abspath(policy.file_dir)), os.path.realpath(policy.file_dir)]


_MESSAGES = {
    RULE_FORBIDDEN: "image path lies under /dev, /proc, /sys, the state dir or the image cache",
    RULE_OUTSIDE: "image path is outside slice.image_file_dir",
    RULE_NOT_REGULAR: "image path is not a regular file (device, FIFO, socket or directory)",
    RULE_HARD_LINK: "image file has more than one hard link (st_nlink > 1): it may be another file's second name",
}


def _check_file(policy: SourcePolicy, url: str, parts: SplitResult) -> str:
    if parts.netloc:
        raise refused(url, RULE_HOST, "file:// image URLs name no host")
    if parts.query or parts.fragment:
        raise refused(url, RULE_MALFORMED, "file:// image URL has a query or fragment")
    if policy.file_dir is None:
        raise refused(url, RULE_SCHEME, "file:// images are not allowed (slice.image_file_dir is not set)")
    try:
        path = unquote(parts.path, errors="strict")
    except UnicodeDecodeError:
        path = ""
    if "\0" in path or not path.startswith("/"):
        raise refused(url, RULE_MALFORMED, "file:// image path is not an absolute path")
    bases = _bases(policy)
    # On its spelling first: a path outside the directory is refused without asking the file system.
    lexical = os.path.normpath(path)
    rule = _placement_rule(policy, lexical, bases)
    if rule is not None:
        raise refused(url, rule, _MESSAGES[rule])
    real = os.path.realpath(lexical)  # every symlink followed, a `..` after a symlink included
    rule = _placement_rule(policy, real, bases)
    if rule is not None:
        raise refused(url, rule, _MESSAGES[rule])
    try:
        st = os.stat(real)
    except OSError as exc:
        raise ImageCacheError(f"cannot open the image source: {exc.strerror}", code="fetch_failed",
                              evidence={"url": url, "errno": exc.errno}) from exc
    if not stat.S_ISREG(st.st_mode):
        raise refused(url, RULE_NOT_REGULAR, _MESSAGES[RULE_NOT_REGULAR])
    if st.st_nlink > 1:
        raise refused(url, RULE_HARD_LINK, _MESSAGES[RULE_HARD_LINK])
    return real


def open_file(policy: SourcePolicy, path: str, url: str) -> tuple[io.FileIO, int]:
    """Open the path ``check_url`` resolved; the descriptor itself must pass the same rules.

    ``O_NOFOLLOW``: the last component cannot have become a symlink; ``O_NONBLOCK``: a FIFO
    swapped in cannot hang the open; then ``fstat`` must say regular file and the path the
    kernel holds for the descriptor must still lie under the image dir. Returns the file and
    its size.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the checked path's last component became a symlink since the check
            raise refused(url, RULE_NOT_REGULAR, _MESSAGES[RULE_NOT_REGULAR]) from exc
        raise ImageCacheError(f"cannot open the image source: {exc.strerror}", code="fetch_failed",
                              evidence={"url": url, "errno": exc.errno}) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refused(url, RULE_NOT_REGULAR, _MESSAGES[RULE_NOT_REGULAR])
        if st.st_nlink > 1:  # linked since the check: the descriptor is what will be read
            raise refused(url, RULE_HARD_LINK, _MESSAGES[RULE_HARD_LINK])
        held = os.readlink(f"/proc/self/fd/{fd}")
        rule = _placement_rule(policy, held, _bases(policy))
        if rule is not None:
            raise refused(url, rule, _MESSAGES[rule])
        return os.fdopen(fd, "rb", buffering=0), st.st_size
    except BaseException:
        os.close(fd)
        raise
