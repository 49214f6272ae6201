"""One NATS connection under deadlines we own: a bounded first connect, jittered backoff after it.

Why not plain ``nats.connect``: nats.py retries inside ``connect()`` (its
``allow_reconnect=False`` does not stop the retries of its server selection, up to
``max_reconnect_attempts`` × ``reconnect_time_wait``), sleeps a fixed
``reconnect_time_wait`` between reconnects, and logs every async error with a
traceback through its default error callback. So here:

* a connect tries each server at most twice, back to back (``max_reconnect_attempts=1``,
  ``reconnect_time_wait=0``), under our own ``asyncio.wait_for`` deadline; on any failure,
  cancellation included, the client is closed and one typed :class:`NatsConnectError`
  comes back: ``nats_unreachable`` (refused, timed out, no NATS greeting) or
  ``nats_auth_refused`` (the server said "Authorization Violation");
* with ``reconnect=`` (the daemon), once connected nats.py reconnects forever — it
  restores subscriptions and the pull consumer's inbox — but the delay before each
  attempt is ours (``reconnect_to_server_handler``): exponential backoff with full
  jitter, one log line per attempt naming the last error;
* the error callback keeps errors raised while (re)connecting for that line (no
  traceback flood); any other async error is one WARNING line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats.errors
from nats.aio.client import Client, Server

from gpuaas_agent.control.transport import (
    TlsEnforcingClient,
    TransportError,
    TransportSecurity,
)
from gpuaas_agent.errors import AgentError
from gpuaas_agent.logs import log_event

log = logging.getLogger(__name__)
CLOSE_ON_CANCEL_S = 2.0


class NatsConnectError(AgentError):
    """NATS could not be reached or refused us; the message names the server and why."""

    default_code = "nats_unreachable"


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: attempt ``n`` waits ``uniform(0, min(max_s, initial_s * 2**n))``.

    Full jitter (rather than ±10 %) spreads a fleet that lost the same server at the
    same moment over the whole window, so 5,000 agents do not reconnect in lockstep.
    """

    initial_s: float = 0.5
    max_s: float = 30.0

    def ceiling(self, attempt: int) -> float:
        """The upper bound of attempt ``attempt`` (0-based)."""
        doubled: float = self.initial_s * 2 ** min(max(attempt, 0), 62)  # int ** int is Any to mypy
        return min(self.max_s, doubled)

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, self.ceiling(attempt))


def safe_url(url: str) -> str:
    """``url`` without user:password, for messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _is_auth_refusal(exc: BaseException | None) -> bool:
    text = str(exc).lower()
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text \
        or "authentication expired" in text or "authentication revoked" in text


def _is_tls_failure(exc: BaseException | None) -> bool:
    return isinstance(exc, ssl.SSLError) or "offered no tls" in str(exc).lower()


def _reason(exc: BaseException | None) -> str:
    """A short human reason: 'connection refused', 'Authorization Violation', 'no answer'."""
    if exc is None or isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "no answer"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower() if exc.errno != errno.ECONNREFUSED else "connection refused"
    text = str(exc).removeprefix("nats: ").strip("'\"") or type(exc).__name__
    return text


@dataclass
class _Callbacks:
    """nats.py's callbacks for one client: quiet while (re)connecting, one line otherwise."""

    label: str
    backoff: Backoff | None
    rng: random.Random
    last_error: BaseException | None = None
    client: Client | None = field(default=None, repr=False)
    connected: bool = False  # set once the first connect returned; until then errors are the attempt's

    async def error(self, exc: Exception) -> None:
        self.last_error = exc
        nc = self.client
        if not self.connected or nc is None or nc.is_connecting or nc.is_reconnecting or nc.is_closed:
            log.debug("nats error while connecting: %r", exc)  # the attempt line reports it
            return
        log_event(log, "nats_error", logging.WARNING, connection=self.label, error=_reason(exc),
                  message=f"NATS error on {self.label}: {_reason(exc)}")

    async def disconnected(self) -> None:
        if self.client is not None and self.client.is_closed:
            return
        log_event(log, "nats_disconnected", logging.WARNING, connection=self.label,
                  message=f"{self.label}: lost the NATS connection; reconnecting with backoff")

    async def reconnected(self) -> None:
        url = self.client.connected_url if self.client is not None else None
        log_event(log, "nats_reconnected", connection=self.label, server=safe_url(url.geturl()) if url else None,
                  message=f"{self.label}: NATS connection restored")
        for listener in list(getattr(self.client, "reconnect_listeners", ())):
            listener()

    def next_server(self, servers: list[Server], server_info: dict[str, Any]) -> tuple[None, float]:
        """``reconnect_to_server_handler``: nats.py's round robin picks the server, we pick the delay."""
        attempt = min((s.reconnects for s in servers), default=0)
        delay = self.backoff.delay(attempt, self.rng) if self.backoff is not None else 0.0
        log_event(log, "nats_reconnect_attempt", logging.WARNING, connection=self.label, attempt=attempt + 1,
                  retry_in_s=round(delay, 3), last_error=_reason(self.last_error),
                  message=f"{self.label}: reconnect attempt {attempt + 1} in {delay:.1f}s "
                          f"(last error: {_reason(self.last_error)})")
        return None, delay


async def connect_nats(
    servers: list[str],
    *,
    timeout_s: float,
    name: str,
    user: str | None = None,
    password: str | None = None,
    reconnect: Backoff | None = None,
    rng: random.Random | None = None,
    ping_interval_s: int = 10,
    security: TransportSecurity | None = None,
    inbox_prefix: str | None = None,
) -> Client:
    """Connect within ``timeout_s`` or raise :class:`NatsConnectError`; the client is closed on every failure.

    ``reconnect``: after this first connect, reconnect forever with that backoff (the
    daemon); None: a broken connection stays broken (enrollment's one request).
    ``security``: TLS and credentials (``control/transport.py``); the default refuses
    plaintext (``insecure=True`` allows it, with a WARNING). Its refusals (``plaintext_refused``, ``creds_insecure``,
    ``creds_expired``...) are raised as :class:`NatsConnectError` before anything is dialled.
    ``inbox_prefix``: replies come on ``<prefix>.>`` (a per-node prefix lets permissions
    keep every other node's replies away from this one).
    """
    shown = ", ".join(safe_url(s) for s in servers)
    security = security or TransportSecurity()
    try:
        servers = security.check_servers(servers)
        secure_options = security.connect_options(servers)
    except TransportError as exc:
        raise NatsConnectError(exc.message, code=exc.code, evidence=exc.evidence) from None
    callbacks = _Callbacks(label=name, backoff=reconnect, rng=rng or random.Random())
    nc = TlsEnforcingClient()
    nc.require_tls = "tls" in secure_options
    callbacks.client = nc
    options: dict[str, Any] = {
        "servers": servers, "name": name, "connect_timeout": timeout_s,
        "allow_reconnect": reconnect is not None, "max_reconnect_attempts": 1, "reconnect_time_wait": 0,
        "error_cb": callbacks.error, "disconnected_cb": callbacks.disconnected,
        "reconnected_cb": callbacks.reconnected, "ping_interval": ping_interval_s, "max_outstanding_pings": 3,
    }
    if reconnect is not None:
        options["reconnect_to_server_handler"] = callbacks.next_server
    if user is not None:
        options.update(user=user, password=password)
    options.update(secure_options)
    if inbox_prefix is not None:
        options["inbox_prefix"] = inbox_prefix
    try:
        await asyncio.wait_for(nc.connect(**options), timeout_s)
    except BaseException as exc:
        # Cancelled (SIGTERM while connecting): a half-open client has nothing worth waiting for, and a
        # close racing its own connect could hold the stop for the whole connect deadline.
        close_s = CLOSE_ON_CANCEL_S if isinstance(exc, asyncio.CancelledError) else timeout_s
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), close_s)
        if not isinstance(exc, (OSError, nats.errors.Error, TimeoutError, asyncio.TimeoutError)):
            raise  # cancelled (SIGTERM while connecting) or a bug: not ours to rename
        cause = exc if not isinstance(exc, nats.errors.NoServersError) else callbacks.last_error
        evidence = {"servers": [safe_url(s) for s in servers], "timeout_s": timeout_s,
                    "error": repr(cause) if cause is not None else repr(exc)}
        if _is_auth_refusal(cause):
            raise NatsConnectError(f"{shown} refused the credentials ({_reason(cause)})", code="nats_auth_refused",
                                   evidence=evidence) from None
        if _is_tls_failure(cause):
            raise NatsConnectError(f"TLS to {shown} failed: {_reason(cause)}; nothing was sent",
                                   code="nats_tls_failed", evidence=evidence) from None
        if isinstance(cause, (TimeoutError, asyncio.TimeoutError)) or cause is None:
            raise NatsConnectError(f"cannot reach {shown} within {timeout_s:g}s", evidence=evidence) from None
        raise NatsConnectError(f"cannot reach {shown}: {_reason(cause)}", evidence=evidence) from None
    callbacks.connected = True
    if not nc.require_tls:  # plaintext happens only with insecure = true (check_servers refused it otherwise)
        url = safe_url(nc.connected_url.geturl()) if nc.connected_url else shown
        log_event(log, "nats_plaintext", logging.WARNING, connection=name, server=url,
                  message=f"{name}: connected to {url} without TLS (insecure = true; labs only)")
    if reconnect is not None:
        # The first connect was bounded above; from now on a lost server is retried forever
        # (nats.py reads this option on every reconnect; connect() has no separate knob for it).
        nc.options["max_reconnect_attempts"] = -1
    return nc
