"""Logs reach journald as native fields when it answers, and stderr as JSON lines when it does not."""

import json
import logging
import socket
import struct

import pytest

from gpuaas_agent.logs import JournalHandler, configure_logging, journal_datagram

log = logging.getLogger("gpuaas_agent.test")


def _parse(datagram: bytes) -> dict[str, str]:
    fields, i = {}, 0
    while i < len(datagram):
        end = datagram.index(b"\n", i)
        line = datagram[i:end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode()
            i = end + 1
        else:  # KEY\n<u64 length><data>\n
            (size,) = struct.unpack("<Q", datagram[end + 1:end + 9])
            fields[line.decode()] = datagram[end + 9:end + 9 + size].decode()
            i = end + 9 + size + 1
    return fields


@pytest.fixture
def journal(tmp_path):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "journal.socket")
    server.bind(path)
    server.settimeout(5)
    yield server, path
    server.close()
    logging.getLogger().handlers[:] = []


def test_event_becomes_native_journal_fields(journal):
    server, path = journal
    handler = configure_logging(journal_socket=path)
    assert isinstance(handler, JournalHandler)
    log.error(json.dumps({"event": "wipe_unverified", "code": "wipe_unverified", "evidence": {"samples": 18}}))
    fields = _parse(server.recv(65536))
    assert fields["PRIORITY"] == "3" and fields["SYSLOG_IDENTIFIER"] == "gpuaas-agent"
    assert fields["GPUAAS_EVENT"] == "wipe_unverified" and fields["GPUAAS_CODE"] == "wipe_unverified"
    assert json.loads(fields["GPUAAS_EVIDENCE"]) == {"samples": 18}


def test_multiline_values_use_the_length_form():
    datagram = journal_datagram({"MESSAGE": "one\ntwo", "PRIORITY": "6"})
    assert _parse(datagram) == {"MESSAGE": "one\ntwo", "PRIORITY": "6"}
    assert datagram.startswith(b"MESSAGE\n" + struct.pack("<Q", 7))


def test_without_journald_lines_go_to_stderr_as_json(tmp_path, capfd):
    handler = configure_logging(journal_socket=str(tmp_path / "absent.socket"))
    assert not isinstance(handler, JournalHandler)
    log.warning(json.dumps({"event": "lease_conflict", "slot": 3}))
    line = json.loads(capfd.readouterr().err.strip().splitlines()[-1])
    assert (line["event"], line["slot"], line["level"]) == ("lease_conflict", 3, "warning")
    logging.getLogger().handlers[:] = []


def test_journal_that_goes_away_loses_nothing(journal, capfd):
    server, path = journal
    configure_logging(journal_socket=path)
    server.close()  # journald restarted or died
    log.info(json.dumps({"event": "still_here"}))
    assert json.loads(capfd.readouterr().err.strip().splitlines()[-1])["event"] == "still_here"


def test_event_with_exc_info_keeps_the_traceback(tmp_path, capfd):
    from gpuaas_agent.logs import log_event

    configure_logging(journal_socket=str(tmp_path / "absent.socket"))
    try:
        raise RuntimeError("store refused")
    except RuntimeError:
        log_event(log, "task_processing_error", logging.ERROR, exc_info=True, task_id="t-1")
    line = json.loads(capfd.readouterr().err.strip().splitlines()[-1])
    assert (line["event"], line["task_id"], line["level"]) == ("task_processing_error", "t-1", "error")
    assert "RuntimeError: store refused" in line["exception"] and "exc_info" not in line
    logging.getLogger().handlers[:] = []
