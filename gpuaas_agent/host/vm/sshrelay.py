"""An SSH PTY into a slice guest (seed 004's terminal relay), through asyncssh: never a shelled ``ssh``.

The driver does one thing: connect to ``host:port`` as ``user`` with the node's relay key,
check the guest's host key against the pin it is given, open a PTY running the user's login
shell, and hand out its bytes. Policy (which host, which user, whether to pin) is the
caller's (``tasks/terminal.py``).

Nothing of the agent's environment leaks in: no ``~/.ssh/config``, no ``known_hosts``, no
agent socket, no password or keyboard-interactive fallback; the only credential offered is
the relay key. The host key is checked by :class:`_PinningClient`: with no pin any key is
taken (and reported, for the caller to pin); with a pin only that key, anything else fails
the handshake with :class:`HostKeyChanged` naming both fingerprints.

Memory: asyncssh stops reading the channel once ``window_bytes`` of output wait unread
(its stream limit is the receive window), so a guest that prints faster than the caller
reads blocks in its own ``write``; nothing accumulates here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from gpuaas_agent.errors import AgentError, HostError

log = logging.getLogger(__name__)

# asyncssh logs every connection at INFO with peer addresses; the relay logs its own events.
logging.getLogger("asyncssh").setLevel(logging.WARNING)


class HostKeyChanged(AgentError):
    """The guest presented a host key other than the one pinned for its allocation: refused, nothing sent."""

    default_code = "host_key_changed"


class SshRelayError(HostError):
    """The SSH connection or its PTY could not be made (``terminal_connect_failed``, ``terminal_auth_refused``,
    ``terminal_pty_refused``)."""

    default_code = "terminal_connect_failed"


def fingerprint(key: asyncssh.SSHKey) -> str:
    """``SHA256:...`` as ``ssh-keygen -l`` prints it."""
    return key.get_fingerprint("sha256")


def public_line(key: asyncssh.SSHKey) -> str:
    """The key in OpenSSH one-line form, without comment (what the store pins)."""
    return key.export_public_key("openssh").decode().split("\n")[0].strip()


def import_public(line: str) -> asyncssh.SSHKey:
    return asyncssh.import_public_key(line)


def load_client_key(private: Path) -> asyncssh.SSHKey:
    try:
        return asyncssh.read_private_key(str(private))
    except (OSError, asyncssh.KeyImportError, ValueError) as exc:
        raise SshRelayError(f"terminal relay key {private} cannot be loaded: {exc}", code="relay_key_invalid",
                            evidence={"path": str(private)}) from None


class _PinningClient(asyncssh.SSHClient):
    def __init__(self, pinned: asyncssh.SSHKey | None) -> None:
        self.pinned = pinned
        self.offered: asyncssh.SSHKey | None = None

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self.offered = key
        return self.pinned is None or key.public_data == self.pinned.public_data


@dataclass
class SshPty:
    """A running PTY session: :meth:`read` the guest's output, :meth:`write` + :meth:`drain` its input."""

    conn: asyncssh.SSHClientConnection
    process: asyncssh.SSHClientProcess[bytes]
    host_key: asyncssh.SSHKey

    @property
    def host_key_fingerprint(self) -> str:
        return fingerprint(self.host_key)

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes as soon as some are there; ``b""`` once the guest closed its side."""
        return await self.process.stdout.read(n)

    def write(self, data: bytes) -> None:
        self.process.stdin.write(data)

    async def drain(self) -> None:
        await self.process.stdin.drain()

    def resize(self, cols: int, rows: int) -> None:
        self.process.change_terminal_size(cols, rows)

    @property
    def exit_status(self) -> int | None:
        return self.process.exit_status

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close the channel and the connection; bounded, never raises."""
        with contextlib.suppress(Exception):
            self.process.close()
        self.conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.wait_closed(), timeout_s)


async def open_pty(host: str, port: int, user: str, client_key: asyncssh.SSHKey, *, pinned: str | None,
                   term: str, cols: int, rows: int, connect_timeout_s: float, keepalive_interval_s: float,
                   window_bytes: int, max_packet_bytes: int = 32768) -> SshPty:
    """Connect, check the host key against ``pinned`` (OpenSSH line, or None: first use), open a PTY shell."""
    pinned_key = import_public(pinned) if pinned else None
    client = _PinningClient(pinned_key)
    evidence = {"host": host, "port": port, "user": user}
    try:
        conn, _ = await asyncio.wait_for(asyncssh.create_connection(
            lambda: client, host, port, username=user, client_keys=[client_key],
            known_hosts=([], [], []),  # every key goes through validate_host_public_key
            server_host_key_algs="default", config=None, agent_path=None, agent_forwarding=False,
            preferred_auth="publickey", password=None, kbdint_auth=False, gss_host=None,
            x509_trusted_certs=None, ignore_encrypted=True, connect_timeout=connect_timeout_s,
            login_timeout=connect_timeout_s, keepalive_interval=keepalive_interval_s, keepalive_count_max=3,
            window=window_bytes, max_pktsize=min(max_packet_bytes, window_bytes)), connect_timeout_s * 2)
    except asyncssh.HostKeyNotVerifiable:
        offered = client.offered
        raise HostKeyChanged(
            f"guest {host}:{port} presented host key {fingerprint(offered) if offered else 'none'}, "
            f"not the pinned {fingerprint(pinned_key) if pinned_key else 'none'}: refused",
            evidence={**evidence, "pinned_fingerprint": fingerprint(pinned_key) if pinned_key else None,
                      "offered_fingerprint": fingerprint(offered) if offered else None}) from None
    except asyncssh.PermissionDenied as exc:
        raise SshRelayError(f"guest {host}:{port} refused the relay key for user {user}: {exc.reason}",
                            code="terminal_auth_refused", evidence=evidence) from None
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__
        raise SshRelayError(f"cannot reach the guest's SSH server at {host}:{port}: {reason}",
                            evidence={**evidence, "error": repr(exc)[:300]}) from None
    key = client.offered
    try:
        if key is None:  # asyncssh always asks for a plain host key here; no key means no check ran
            raise SshRelayError(f"guest {host}:{port} presented no host key the relay could check",
                                evidence=evidence)
        try:
            process = await asyncio.wait_for(conn.create_process(
                term_type=term, term_size=(cols, rows), request_pty="force", encoding=None,
                stderr=asyncssh.STDOUT, window=window_bytes, max_pktsize=min(max_packet_bytes, window_bytes)),
                connect_timeout_s)
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            raise SshRelayError(f"guest {host}:{port} refused a PTY session for {user}: {reason}",
                                code="terminal_pty_refused", evidence={**evidence, "error": repr(exc)[:300]}) from None
    except BaseException:
        conn.close()
        raise
    return SshPty(conn=conn, process=process, host_key=key)
