"""Logs read like logs: one sentence per event, fields alongside; journald through libsystemd when it answers.

libsystemd always sends to ``/run/systemd/journal/socket``. The journald tests therefore
run a child in a private mount namespace (``unshare --mount``) with a tmpfs over
``/run`` and a real datagram socket bound at that path: the real ``systemd.journal.send``
talks to it, and no other process on the machine sees it.
"""

import json
import logging
import subprocess
import sys
import textwrap

from gpuaas_agent.logs import JsonLinesFormatter, SentenceFormatter, configure_logging, sentence
from tests.conftest import REPO

log = logging.getLogger("gpuaas_agent.test")

CHILD = textwrap.dedent('''
    import io, json, logging, os, pty, socket, struct, subprocess, sys
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run"], check=True)
    os.makedirs("/run/systemd/journal")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("/run/systemd/journal/socket")
    server.settimeout(5)

    def parse(datagram):
        fields, i = {}, 0
        while i < len(datagram):
            end = datagram.index(b"\\n", i)
            line = datagram[i:end]
            if b"=" in line:
                key, _, value = line.partition(b"=")
                fields[key.decode()] = value.decode()
                i = end + 1
            else:
                (size,) = struct.unpack("<Q", datagram[end + 1:end + 9])
                fields[line.decode()] = datagram[end + 9:end + 9 + size].decode()
                i = end + 9 + size + 1
        return fields

    from gpuaas_agent.logs import configure_logging, log_event
    log = logging.getLogger("gpuaas_agent.test")
    out = {}
    if sys.argv[1] == "pipe":
        handler = configure_logging()
        out["handler"] = type(handler).__name__
        log_event(log, "step_succeeded", task_id="t-1", type="slice.vm_provision", step="clone",
                  allocation_id="0b7c1a9e-0000-4000-8000-000000000001", duration_s=12.25, evidence={"samples": 18})
        out["fields"] = parse(server.recv(65536))
        server.close()  # journald goes away: the next line must reach stderr, not vanish
        log_event(log, "still_here", task_id="t-2")
    else:
        master, slave = pty.openpty()
        sys.stderr = io.TextIOWrapper(os.fdopen(slave, "wb", buffering=0), write_through=True)
        handler = configure_logging()
        out["handler"] = type(handler).__name__
        log_event(log, "task_started", task_id="t-3", type="slice.plan")
        out["tty"] = os.read(master, 4096).decode()
        server.setblocking(False)
        try:
            server.recv(65536)
            out["journal_got_it"] = True
        except BlockingIOError:
            out["journal_got_it"] = False
    print(json.dumps(out))
''')


def _child(mode: str) -> tuple[dict, str]:
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", CHILD, mode],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_sentence_names_event_task_allocation_step_and_duration():
    line = sentence({"event": "step_succeeded", "task_id": "t-1", "type": "slice.vm_provision", "step": "clone",
                     "allocation_id": "a-1", "duration_s": 12.25})
    assert line == "step succeeded: task t-1 (slice.vm_provision) allocation a-1 step clone in 12.2s"
    failed = sentence({"event": "task_failed", "task_id": "t-2", "code": "disk_mounted", "message": "nvme4n1p1 is mounted"})
    assert failed == "task failed: task t-2 code disk_mounted: nvme4n1p1 is mounted"


def test_journald_gets_the_sentence_as_message_and_fields_alongside():
    out, stderr = _child("pipe")
    assert out["handler"] == "JournalHandler"
    fields = out["fields"]
    assert fields["MESSAGE"] == ("step succeeded: task t-1 (slice.vm_provision) allocation "
                                 "0b7c1a9e-0000-4000-8000-000000000001 step clone in 12.2s")
    assert fields["PRIORITY"] == "6" and fields["SYSLOG_IDENTIFIER"] == "gpuaas-agent"
    assert fields["GPUAAS_EVENT"] == "step_succeeded" and fields["GPUAAS_STEP"] == "clone"
    assert fields["GPUAAS_TASK_ID"] == "t-1" and json.loads(fields["GPUAAS_EVIDENCE"]) == {"samples": 18}
    # journald went away: the line is on stderr (a pipe: JSON) instead of lost
    last = json.loads(stderr.strip().splitlines()[-1])
    assert last["event"] == "still_here" and last["msg"] == "still here: task t-2"


def test_terminal_gets_sentences_even_when_journald_is_present():
    out, _ = _child("tty")
    assert out["handler"] == "StreamHandler" and out["journal_got_it"] is False
    assert "task started: task t-3 (slice.plan)" in out["tty"] and "event=task_started" in out["tty"]
    assert not out["tty"].lstrip().startswith("{")


def test_without_journald_a_pipe_gets_json_lines_with_the_sentence(capfd):
    handler = configure_logging()  # no journald on this machine, stderr captured (not a TTY)
    try:
        assert isinstance(handler.formatter, JsonLinesFormatter)
        log.warning(json.dumps({"event": "lease_conflict", "slot_index": 3}))
        line = json.loads(capfd.readouterr().err.strip().splitlines()[-1])
        assert (line["event"], line["slot_index"], line["level"]) == ("lease_conflict", 3, "warning")
        assert line["msg"] == "lease conflict: slot 3"
    finally:
        logging.getLogger().handlers[:] = []


def test_event_with_exc_info_keeps_the_traceback(capfd):
    from gpuaas_agent.logs import log_event

    configure_logging()
    try:
        try:
            raise RuntimeError("store refused")
        except RuntimeError:
            log_event(log, "task_processing_error", logging.ERROR, exc_info=True, task_id="t-1")
        line = json.loads(capfd.readouterr().err.strip().splitlines()[-1])
        assert (line["event"], line["task_id"], line["level"]) == ("task_processing_error", "t-1", "error")
        assert "RuntimeError: store refused" in line["exception"] and "exc_info" not in line
    finally:
        logging.getLogger().handlers[:] = []


def test_sentence_formatter_is_one_line_with_fields():
    record = logging.LogRecord("gpuaas_agent.x", logging.INFO, __file__, 1,
                               json.dumps({"event": "image_cached", "sha256": "ab", "size_bytes": 5}), None, None)
    text = SentenceFormatter().format(record)
    assert "\n" not in text and "image cached" in text and "size_bytes=5" in text
