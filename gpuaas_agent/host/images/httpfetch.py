"""http(s) with httpx for what is not a download: range reads that prove a source, and the download rules' constants.

Downloads are read by a curl child (host/images/curlstream.py: TLS at OpenSSL speed outside the
interpreter); this module keeps the rules both follow and the small range reads
(:func:`read_ranges`) with which a cache hit under another URL is proven against its source.
What stays ours, because it is the safety of the cache (host/images/cache.py):

- redirects are followed one hop at a time, and ``check_hop`` (the allow-list of
  host/images/source.py) sees every hop before it is requested;
- the read timeout is the stall timeout (no byte for that long is ``fetch_stalled``);
- a connection that drops in the middle of a body is resumed from the byte where it
  stopped (``Range: bytes=N-``, with ``If-Range`` on the validator the first answer
  gave), after a backoff, at most ``retries`` times; the answer must be ``206`` whose
  ``Content-Range`` starts at exactly ``N`` and names the same total, or the download
  is ``truncated``. The bytes before ``N`` were hashed as they arrived and are never
  read again: the digest of the resumed download is computed over each byte once;
- a refused connection or a 502/503/504 before the body is retried with the same
  backoff; a TLS verification failure or any other status is not (it will not heal).

httpx reaches the image server the way every other tool on the host does (``https_proxy``,
``no_proxy`` in the service's environment, ``trust_env``).
"""

from __future__ import annotations

import re
import ssl
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urljoin

from gpuaas_agent.host.images.source import ImageCacheError

if TYPE_CHECKING:
    import httpx

USER_AGENT = "gpuaas-agent"
MAX_REDIRECTS = 5
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
CONNECT_TIMEOUT_S = 30.0
RETRY_STATUSES = (502, 503, 504)
CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
REDIRECT_STATUSES = (301, 302, 303, 307, 308)


# The download rules above, as the readers apply them (host/images/curlstream.py, and the httpx reader the
# benchmark keeps for comparison): one place, so a rule tightened here holds for every reader.

def declared_length(content_length: str | None) -> int | None:
    """The body's size from ``Content-Length``; ``None`` when absent or not plain ASCII decimal (no resume then).

    ``isdigit`` alone takes ``²`` (``int`` then raises) and other scripts' digits (``int`` reads them).
    """
    return int(content_length) if content_length and content_length.isascii() and content_length.isdigit() else None


def resume_validator(etag: str | None, last_modified: str | None) -> str | None:
    """What ``If-Range`` may name: a strong ETag, else ``Last-Modified`` (a weak ETag never matches)."""
    return etag if etag and not etag.startswith("W/") else last_modified


def resume_headers(received: int, validator: str | None) -> dict[str, str]:
    """The request that resumes a body after its first ``received`` bytes, pinned to ``validator`` when known."""
    headers = {"Range": f"bytes={received}-"}
    if validator:
        headers["If-Range"] = validator
    return headers


def resumes_at(status: int, content_range: str | None, received: int, length: int) -> bool:
    """Whether an answer to :func:`resume_headers` continues the same body at exactly byte ``received``.

    Only a ``206`` whose ``Content-Range`` starts at ``received`` and names the same total does: a 200 (the
    server ignored the range or the validator no longer matched) or a range elsewhere would splice other
    bytes after the ones already hashed.
    """
    match = CONTENT_RANGE_RE.match(content_range or "")
    return status == 206 and match is not None and int(match.group(1)) == received and int(match.group(3)) == length


def back_off(cancel: threading.Event, backoff_s: float, attempt: int, url: str) -> None:
    """Wait ``backoff_s * 2**attempt`` before the next try; ``download cancelled`` at once when ``cancel`` is set."""
    if cancel.wait(backoff_s * (2 ** attempt)):
        raise ImageCacheError("download cancelled", code="fetch_failed", evidence={"url": url})


def _causes(exc: BaseException) -> list[BaseException]:
    seen = [exc]
    while (cause := seen[-1].__cause__ or seen[-1].__context__) is not None and cause not in seen and len(seen) < 6:
        seen.append(cause)
    return seen


def _error_chain(exc: BaseException) -> str:
    """``repr`` of the error and of what caused it, down to the OS or TLS error (evidence, not prose)."""
    return " <- ".join(repr(e) for e in _causes(exc))


class RangesRefused(Exception):
    """The server answered a range request with the whole body (200): it does not serve ranges."""


def read_ranges(url: str, ranges: list[tuple[int, int]], total: int, *, check_hop: Callable[[str, str], None],
                verify: ssl.SSLContext, stall_timeout_s: float) -> list[bytes]:
    """The bytes of each ``(start, length)`` range of ``url``, whose whole size must be ``total``.

    Why: a cache hit under a URL other than the one the entry was fetched from is served only when
    that URL answers for the entry's bytes (host/images/cache.py). Each range is one GET with
    ``Range: bytes=a-b``, following redirects hop by hop through ``check_hop`` like a download. An
    answer must be ``206`` with ``Content-Range: bytes a-b/total``; any other status is
    ``fetch_failed`` (a 404 is what it is for a download too), a 206 naming another range or total
    is returned as empty bytes (the caller's mismatch). A plain ``200`` raises
    :class:`RangesRefused` before its body is read.
    """
    import httpx  # only a cache hit under another URL reads ranges (tests/test_import_graph.py)

    out = []
    with httpx.Client(verify=verify, trust_env=True, follow_redirects=False,
                      timeout=httpx.Timeout(stall_timeout_s, connect=min(CONNECT_TIMEOUT_S, stall_timeout_s)),
                      headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}) as client:
        for start, length in ranges:
            out.append(_read_range(client, url, start, length, total, check_hop, stall_timeout_s))
    return out


def _read_range(client: httpx.Client, first: str, start: int, length: int, total: int,
                check_hop: Callable[[str, str], None], stall_timeout_s: float) -> bytes:
    import httpx  # see read_ranges

    url = first
    headers = {"Range": f"bytes={start}-{start + length - 1}"}
    for _ in range(MAX_REDIRECTS + 1):
        check_hop(url, first)
        try:
            with client.stream("GET", url, headers=headers) as response:
                location = response.headers.get("location")
                if response.status_code in REDIRECT_STATUSES and location:
                    url = urljoin(url, location)
                    continue
                if response.status_code == 200:
                    raise RangesRefused()
                if response.status_code != 206:
                    raise ImageCacheError(
                        f"image server answered HTTP {response.status_code} {response.reason_phrase}",
                        code="fetch_failed", evidence={"url": url, "http_status": response.status_code})
                match = CONTENT_RANGE_RE.match(response.headers.get("content-range", ""))
                if not match or (int(match.group(1)), int(match.group(2)), int(match.group(3))) != (
                        start, start + length - 1, total):
                    return b""
                body = bytearray()
                for chunk in response.iter_raw():
                    body += chunk
                    if len(body) > length:
                        return b""
                return bytes(body)
        except httpx.TimeoutException as exc:
            raise ImageCacheError(f"no answer from the image server for {stall_timeout_s:g}s",
                                  code="fetch_stalled", evidence={"url": url, "stall_timeout_s": stall_timeout_s}) from exc
        except httpx.TransportError as exc:
            raise ImageCacheError(f"cannot reach the image server: {exc}", code="fetch_failed",
                                  evidence={"url": url, "error": _error_chain(exc)}) from exc
    raise ImageCacheError("too many redirects", code="fetch_failed", evidence={"url": first})
