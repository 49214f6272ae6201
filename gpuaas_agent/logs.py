"""Logs that read like logs: one human sentence per event, with the event's fields kept alongside.

Events are logged as a JSON object message (``{"event": "clone_progress",
"percent": 42}``) by :func:`log_event`; the handler chosen at start turns each
into what its reader needs:

- **journald** (the daemon under systemd): ``MESSAGE`` is one sentence an operator
  reads in ``journalctl`` ("step succeeded: task t-1 (slice.vm_provision) step
  clone allocation 1b2c... in 12.3s"), the fields are journal fields
  (``GPUAAS_EVENT``, ``GPUAAS_TASK_ID``...) so ``journalctl GPUAAS_EVENT=clone_progress``
  works on 500 hosts. Sent through ``systemd.journal.send`` (libsystemd).
- **a terminal** (stderr is a TTY, journald present or not): the same sentence,
  then the fields as ``key=value``, one line per event.
- **neither** (stderr is a pipe or a file and no journald): one JSON object per
  line (what tests and log shippers parse), with the sentence as ``msg``.

``systemd.journal.send`` drops messages silently when journald is absent
(docs/testing.md): the journal is chosen only when its socket accepts a connect,
and a send that raises falls back to stderr instead of losing the line.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
from datetime import datetime
from typing import Any, TextIO

from gpuaas_agent.compat import UTC
from systemd import journal  # type: ignore[attr-defined]  # systemd-python ships no type information

JOURNAL_SOCKET = "/run/systemd/journal/socket"  # libsystemd's own, fixed path
SYSLOG_IDENTIFIER = "gpuaas-agent"
_FIELD_BAD = re.compile(r"[^A-Z0-9_]")
# logging level -> syslog priority (journald's PRIORITY field)
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}
# Fields that make up the sentence, in the order a person reads them.
_SUBJECT_FIELDS = (("task_id", "task"), ("allocation_id", "allocation"), ("slot_index", "slot"), ("step", "step"),
                   ("status", "status"), ("code", "code"))


def log_event(
    logger: logging.Logger, event: str, level: int = logging.INFO, *, exc_info: bool = False, **fields: Any
) -> None:
    """One structured event: a JSON object message that the handlers turn into a sentence and fields."""
    if not logger.isEnabledFor(level):
        return  # not encoded for nothing (bench_fleet: ~5% of a burst's event-loop CPU at level ERROR)
    logger.log(level, json.dumps({"event": event, **fields}, default=str, sort_keys=True), exc_info=exc_info)


def _fields_of(record: logging.LogRecord) -> tuple[dict[str, Any] | None, str]:
    """The event object of a record (or None) and its plain message."""
    message = record.getMessage()
    try:
        fields = json.loads(message)
    except ValueError:
        return None, message
    return (fields, message) if isinstance(fields, dict) else (None, message)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def sentence(fields: dict[str, Any]) -> str:
    """The one line a person reads: what happened, to which task/allocation/step, how it ended, how long.

    ``{"event": "step_succeeded", "task_id": "t-1", "type": "slice.vm_provision", "step": "clone",
    "duration_s": 12.3}`` -> ``step succeeded: task t-1 (slice.vm_provision) step clone in 12.3s``.
    A ``message`` field (an error's own sentence) ends it.
    """
    head = str(fields.get("event", "event")).replace("_", " ")
    parts = []
    for key, label in _SUBJECT_FIELDS:
        value = fields.get(key)
        if value is None or value == "":
            continue
        text = f"{label} {_short(value)}"
        if key == "task_id" and fields.get("type"):
            text += f" ({fields['type']})"
        parts.append(text)
    if "task_id" not in fields and fields.get("type"):
        parts.insert(0, str(fields["type"]))
    if isinstance(fields.get("duration_s"), (int, float)):
        parts.append(f"in {fields['duration_s']:.3g}s")
    line = head + (": " + " ".join(parts) if parts else "")
    message = fields.get("message")
    if message:
        line += f": {_short(message) if not isinstance(message, str) else message}"
    return line.replace("\n", " ")


def _record_sentence(record: logging.LogRecord) -> tuple[str, dict[str, Any] | None]:
    fields, message = _fields_of(record)
    return (sentence(fields) if fields is not None else message.replace("\n", " ")), fields


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per line; a message that is already a JSON object is merged, not quoted."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        text, fields = _record_sentence(record)
        if fields is not None:
            line["msg"] = text
            line.update(fields)
        else:
            line["msg"] = text
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class SentenceFormatter(logging.Formatter):
    """``HH:MM:SS.mmm LEVEL sentence  key=value ...`` for a person at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        text, fields = _record_sentence(record)
        stamp = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        tail = " ".join(f"{k}={_short(v)}" for k, v in (fields or {}).items() if k not in ("message",))
        line = f"{stamp} {record.levelname:<7} {text}" + (f"  [{tail}]" if tail else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def journal_fields(record: logging.LogRecord) -> tuple[str, dict[str, str]]:
    """(MESSAGE, other journal fields) of a record: the sentence, and every event field as ``GPUAAS_<KEY>``."""
    text, fields = _record_sentence(record)
    entry = {
        "PRIORITY": str(_PRIORITY.get(record.levelno, 6)),
        "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
        "GPUAAS_LOGGER": record.name,
    }
    for key, value in (fields or {}).items():
        name = "GPUAAS_" + _FIELD_BAD.sub("_", str(key).upper())
        entry[name] = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
    if record.exc_info:
        entry["GPUAAS_EXCEPTION"] = logging.Formatter().formatException(record.exc_info)
    return text, entry


class JournalHandler(logging.Handler):
    """Sends each record to journald through libsystemd (``systemd.journal.send``); stderr when that fails."""

    def __init__(self, fallback: logging.Handler) -> None:
        super().__init__()

        self._send = journal.send
        self._fallback = fallback

    def emit(self, record: logging.LogRecord) -> None:
        message, entry = journal_fields(record)
        try:
            self._send(message, **entry)
        except (OSError, ValueError):
            self._fallback.emit(record)  # journald went away: never lose the line


def journal_available(path: str = JOURNAL_SOCKET) -> bool:
    """True when journald's socket accepts a connect (libsystemd would drop messages silently otherwise)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
    except OSError:
        return False
    finally:
        sock.close()
    return True


def stderr_handler(stream: TextIO | None = None) -> logging.Handler:
    """Sentences for a terminal, JSON lines for a pipe or a file."""
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    handler.setFormatter(SentenceFormatter() if tty else JsonLinesFormatter())
    return handler


def configure_logging(level: int = logging.INFO) -> logging.Handler:
    """A terminal gets sentences; otherwise journald when it answers, JSON lines on stderr when not."""
    fallback = stderr_handler()
    tty = isinstance(fallback.formatter, SentenceFormatter)
    handler = JournalHandler(fallback) if not tty and journal_available() else fallback
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("nats").setLevel(logging.WARNING)
    return handler
