"""Structured logs: native journald fields when journald is there, JSON lines on stderr otherwise.

Events are logged as a JSON object message (``{"event": "clone_progress",
"percent": 42}``). journald gets them as fields (``GPUAAS_EVENT``,
``GPUAAS_PERCENT``) so ``journalctl GPUAAS_EVENT=clone_progress`` works on 500
hosts. ``systemd.journal.send`` drops messages silently when journald is
absent (DESIGN.md §5), so the journal is used only after a connect to its
socket succeeds, and a send that fails is written to stderr instead of lost.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
import sys
from datetime import datetime, timezone
from typing import Any

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_IDENTIFIER = "gpuaas-agent"
_FIELD_BAD = re.compile(r"[^A-Z0-9_]")
# logging level -> syslog priority (journald's PRIORITY field)
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def log_event(
    logger: logging.Logger, event: str, level: int = logging.INFO, *, exc_info: bool = False, **fields: Any
) -> None:
    """One structured event: a JSON object message that the handlers turn into fields or a line."""
    logger.log(level, json.dumps({"event": event, **fields}, default=str, sort_keys=True), exc_info=exc_info)


def _fields_of(record: logging.LogRecord) -> tuple[dict[str, Any] | None, str]:
    """The event object of a record (or None) and its plain message."""
    message = record.getMessage()
    try:
        fields = json.loads(message)
    except ValueError:
        return None, message
    return (fields, message) if isinstance(fields, dict) else (None, message)


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per line; a message that is already a JSON object is merged, not quoted."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields, message = _fields_of(record)
        if fields is not None:
            line.update(fields)
        else:
            line["msg"] = message
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def journal_datagram(fields: dict[str, str]) -> bytes:
    """journald's native protocol: ``KEY=value`` lines; values with a newline use the length form."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalHandler(logging.Handler):
    """Sends each record to journald as native fields; falls back to a JSON line on stderr."""

    def __init__(self, sock: socket.socket, fallback: logging.Handler) -> None:
        super().__init__()
        self._sock = sock
        self._fallback = fallback

    @classmethod
    def connect(cls, path: str = JOURNAL_SOCKET) -> "JournalHandler | None":
        """A handler bound to journald, or None when nothing listens at ``path``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        return cls(sock, _stderr_handler())

    def emit(self, record: logging.LogRecord) -> None:
        fields, message = _fields_of(record)
        entry = {
            "MESSAGE": message,
            "PRIORITY": str(_PRIORITY.get(record.levelno, 6)),
            "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
            "GPUAAS_LOGGER": record.name,
        }
        for key, value in (fields or {}).items():
            name = "GPUAAS_" + _FIELD_BAD.sub("_", str(key).upper())
            entry[name] = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
        if record.exc_info:
            entry["GPUAAS_EXCEPTION"] = logging.Formatter().formatException(record.exc_info)
        try:
            self._sock.send(journal_datagram(entry))
        except OSError:
            self._fallback.emit(record)  # journald went away: never lose the line

    def close(self) -> None:
        self._sock.close()
        super().close()


def _stderr_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLinesFormatter())
    return handler


def configure_logging(level: int = logging.INFO, *, journal_socket: str = JOURNAL_SOCKET) -> logging.Handler:
    """Journald when it answers, JSON lines on stderr otherwise; returns the handler in use."""
    handler = JournalHandler.connect(journal_socket) or _stderr_handler()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("nats").setLevel(logging.WARNING)
    return handler
