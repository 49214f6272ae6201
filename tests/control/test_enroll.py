"""Enrollment against a real nats-server and the test control plane.

One server for the module, with two logins besides the anonymous one (which is the full-access
``plane`` user, so the control plane and most tests connect without credentials): ``bootstrap``,
holding exactly the bootstrap permissions (``ENROLL_PERMISSIONS``), and ``plane``. The reply's
secrets are sealed to the requester (``control/sealed.py``): an eavesdropper on the inbox,
with the bootstrap login or full access, sees the reply and no secret in it; a reply whose seal
does not open, or that carries credentials in clear, is refused and nothing is stored.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import stat

import nats
import pytest

from gpuaas_agent.contract.enrollment import EnrollReply, EnrollRequest, NatsCredentials
from gpuaas_agent.control.enroll import (
    ENROLL_SUBJECT,
    EnrollError,
    EnrollIdentity,
    creds_path,
    enroll,
    load_enrollment,
    record_path,
)
from gpuaas_agent.control.permissions import ENROLL_PERMISSIONS
from gpuaas_agent.control.sealed import b64url, b64url_decode, new_reply_key, public_key_text, seal_credentials
from gpuaas_agent.control.transport import TransportSecurity
from tests.controlplane import ControlPlane
from tests.support.nats_server import NatsServer

IDENTITY = EnrollIdentity(machine_id="0123456789abcdef0123456789abcdef", hostname="slice-host-01",
                          dmi_serial="SN123", agent_version="0.1.0")
INSECURE = TransportSecurity(insecure=True)
DEADLINE_S = 20.0


class EnrollServer(NatsServer):
    """The module's nats-server: anonymous connections are ``plane`` (full access); ``bootstrap`` may only enroll."""

    def __init__(self, root) -> None:
        self.passwords = {"plane": secrets.token_urlsafe(12), "bootstrap": secrets.token_urlsafe(12)}
        bootstrap = {"user": "bootstrap", "password": self.passwords["bootstrap"],
                     "permissions": {"publish": {"allow": ENROLL_PERMISSIONS["publish"]},
                                     "subscribe": {"allow": ENROLL_PERMISSIONS["subscribe"]}}}
        config = root / "nats.conf"
        config.write_text(json.dumps({"no_auth_user": "plane", "authorization": {"users": [
            {"user": "plane", "password": self.passwords["plane"]}, bootstrap]}}))
        store = root / "store"
        store.mkdir()
        binary = shutil.which("nats-server")
        if binary is None:
            pytest.fail("nats-server is not installed (apt-get install nats-server): the control tests need a real server")
        super().__init__(binary, store, root / "nats.log", extra_args=("-c", str(config)))

    def url_as(self, user: str) -> str:
        return f"nats://{user}:{self.passwords[user]}@127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory):
    """Shadows the per-test plugin fixture: every test here makes its own plane and tokens, so one server serves all."""
    server = EnrollServer(tmp_path_factory.mktemp("enroll-nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _with_plane(url, body):
    plane = await ControlPlane.connect(url)
    try:
        await plane.serve_enrollment()
        return await body(plane)
    finally:
        await plane.close()


def test_enroll_stores_credentials_0600_and_removes_token(nats_server, tmp_path):
    token_file, state = tmp_path / "token", tmp_path / "state"

    async def body(plane):
        token_file.write_text(plane.issue_token() + "\n")
        record = await enroll(nats_server.url_as("bootstrap"), token_file, state, IDENTITY, timeout=5,
                              security=INSECURE)
        return record, plane.issued_credentials, plane.enroll_requests

    record, issued, requests = _run(_with_plane(nats_server.url, body))
    path = record_path(state)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not token_file.exists()
    assert load_enrollment(state) == record
    # The sealed reply opened to exactly what the control plane issued, for the key this attempt sent.
    assert record.credentials == issued[record.node_id]
    [request] = requests
    assert len(b64url_decode(request.reply_public_key)) == 32
    assert record.node_id.startswith("node-") and record.credentials.servers == [nats_server.url]
    assert "password" not in repr(record)
    assert [p.name for p in state.iterdir()] == ["enrollment.json"]  # no temp file left behind


def test_wrong_token_is_refused_and_token_file_kept(nats_server, tmp_path):
    token_file, state = tmp_path / "token", tmp_path / "state"
    token_file.write_text("not-a-token-the-plane-issued-0000")

    async def body(plane):
        plane.issue_token()
        return await enroll(nats_server.url, token_file, state, IDENTITY, timeout=5, security=INSECURE)

    with pytest.raises(EnrollError) as err:
        _run(_with_plane(nats_server.url, body))
    assert err.value.code == "token_invalid"
    assert token_file.exists() and load_enrollment(state) is None


def test_reused_token_is_refused(nats_server, tmp_path):
    first_token, second_token = tmp_path / "token-a", tmp_path / "token-b"

    async def body(plane):
        token = plane.issue_token()
        first_token.write_text(token)
        second_token.write_text(token)
        await enroll(nats_server.url, first_token, tmp_path / "state-a", IDENTITY, timeout=5, security=INSECURE)
        other = IDENTITY.model_copy(update={"machine_id": "f" * 32, "hostname": "slice-host-02"})
        return await enroll(nats_server.url, second_token, tmp_path / "state-b", other, timeout=5, security=INSECURE)

    with pytest.raises(EnrollError) as err:
        _run(_with_plane(nats_server.url, body))
    assert err.value.code == "token_reused"
    assert second_token.exists() and load_enrollment(tmp_path / "state-b") is None


def test_expired_token_is_refused(nats_server, tmp_path):
    token_file = tmp_path / "token"

    async def body(plane):
        token_file.write_text(plane.issue_token(ttl_s=-1))
        return await enroll(nats_server.url, token_file, tmp_path / "state", IDENTITY, timeout=5, security=INSECURE)

    with pytest.raises(EnrollError) as err:
        _run(_with_plane(nats_server.url, body))
    assert err.value.code == "token_expired"


def test_already_enrolled_sends_no_request(nats_server, tmp_path):
    token_file, state = tmp_path / "token", tmp_path / "state"

    async def body(plane):
        token_file.write_text(plane.issue_token())
        first = await enroll(nats_server.url, token_file, state, IDENTITY, timeout=5, security=INSECURE)
        token_file.write_text(plane.issue_token())
        again = await enroll(nats_server.url, token_file, state, IDENTITY, timeout=5, security=INSECURE)
        return first, again, len(plane.enroll_requests)

    first, again, requests = _run(_with_plane(nats_server.url, body))
    assert again == first
    assert requests == 1
    assert token_file.exists()  # an unused token is not ours to delete


def test_missing_token_file_is_a_typed_error(tmp_path):
    with pytest.raises(EnrollError) as err:
        _run(enroll("nats://127.0.0.1:1", tmp_path / "absent", tmp_path / "state", IDENTITY, timeout=1))
    assert err.value.code == "token_missing"


@pytest.mark.parametrize("kind", ["directory", "binary"])
def test_unreadable_token_is_a_typed_error_not_a_traceback(tmp_path, kind):
    token = tmp_path / "token"
    if kind == "directory":
        token.mkdir()
    else:
        token.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(EnrollError) as err:
        _run(enroll("nats://127.0.0.1:1", token, tmp_path / "state", IDENTITY, timeout=1))
    assert err.value.code == "token_unreadable"
    assert err.value.evidence["token_file"] == str(token)
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


@pytest.mark.parametrize(("login", "wildcard"), [("bootstrap", "_INBOX.enroll.*.>"), ("plane", "_INBOX.>")])
def test_an_eavesdropper_on_the_inbox_receives_the_reply_and_finds_no_password_in_it(nats_server, tmp_path,
                                                                                        login, wildcard):
    """``bootstrap``: another host sharing the bootstrap login; ``plane``: the worst case, full access."""
    token_file, state = tmp_path / "token", tmp_path / "state"

    async def body(plane):
        spy = await nats.connect(nats_server.url_as(login), connect_timeout=5)
        seen: list = []
        reply_seen = asyncio.Event()

        async def listen(msg):
            seen.append((msg.subject, msg.data))
            if msg.subject.startswith("_INBOX.enroll."):
                reply_seen.set()
        try:
            await spy.subscribe(wildcard, cb=listen)
            await spy.flush(timeout=5)
            token_file.write_text(plane.issue_token())
            record = await enroll(nats_server.url_as("bootstrap"), token_file, state, IDENTITY, timeout=5,
                                  security=INSECURE)
            await asyncio.wait_for(reply_seen.wait(), DEADLINE_S)
        finally:
            await spy.close()
        return record, seen

    record, seen = _run(_with_plane(nats_server.url, body))
    replies = [data for subject, data in seen if subject.startswith("_INBOX.enroll.")]
    assert len(replies) == 1, "the eavesdropper must have received the enrollment reply itself"
    password = record.credentials.password.encode()
    assert all(password not in data for _, data in seen)
    heard = EnrollReply.model_validate_json(replies[0])
    assert heard.node_id == record.node_id and heard.sealed_credentials is not None


SECRET = "hostile-reply-password-must-not-be-stored"
HOSTILE_REPLIES = {
    # reply kind -> the code the agent refuses it with
    "sealed_to_another_key": "enroll_reply_tampered",
    "sealed_for_another_token": "enroll_reply_tampered",
    "node_id_swapped": "enroll_reply_tampered",
    "tampered_ciphertext": "enroll_reply_tampered",
    "credentials_in_clear": "enroll_reply_unsealed",
    "accepted_without_seal": "enroll_reply_unsealed",
}


def _hostile_reply(kind: str, request: EnrollRequest) -> bytes:
    node = "node-hostile01"
    credentials = NatsCredentials(user=node, password=SECRET, servers=["nats://127.0.0.1:4222"])
    if kind == "credentials_in_clear":  # what a control plane from before the seal answers
        return json.dumps({"schema_version": "gpuaas.agent/v1", "accepted": True, "node_id": node,
                           "credentials": credentials.model_dump()}).encode()
    if kind == "accepted_without_seal":
        return EnrollReply(accepted=True, node_id=node).model_dump_json().encode()
    sealed_for, reply_node = request, node
    if kind == "sealed_to_another_key":
        sealed_for = request.model_copy(update={"reply_public_key": public_key_text(new_reply_key())})
    elif kind == "sealed_for_another_token":  # a reply captured from another host's request
        sealed_for = request.model_copy(update={"bootstrap_token": "another-hosts-token-0123456789"})
    elif kind == "node_id_swapped":
        reply_node = "node-hostile02"
    sealed = seal_credentials(credentials, sealed_for, node)
    if kind == "tampered_ciphertext":
        raw = bytearray(b64url_decode(sealed.ciphertext))
        raw[-1] ^= 0x80
        sealed = sealed.model_copy(update={"ciphertext": b64url(bytes(raw))})
    return EnrollReply(accepted=True, node_id=reply_node, sealed_credentials=sealed).model_dump_json().encode()


@pytest.mark.parametrize("kind", list(HOSTILE_REPLIES))
def test_a_reply_that_does_not_open_or_carries_credentials_in_clear_is_refused_and_nothing_is_stored(
        nats_server, tmp_path, kind):
    token_file, state = tmp_path / "token", tmp_path / "state"
    token_file.write_text("bootstrap-token-0123456789\n")

    async def body():
        responder = await nats.connect(nats_server.url, connect_timeout=5)

        async def answer(msg):
            await msg.respond(_hostile_reply(kind, EnrollRequest.model_validate_json(msg.data)))
        try:
            await responder.subscribe(ENROLL_SUBJECT, cb=answer)
            await responder.flush(timeout=5)
            return await enroll(nats_server.url_as("bootstrap"), token_file, state, IDENTITY, timeout=5,
                                security=INSECURE)
        finally:
            await responder.close()

    with pytest.raises(EnrollError) as err:
        _run(body())
    assert err.value.code == HOSTILE_REPLIES[kind]
    assert SECRET not in str(err.value) and SECRET not in json.dumps(err.value.evidence)
    assert token_file.read_text() == "bootstrap-token-0123456789\n"
    assert not record_path(state).exists() and not creds_path(state).exists()
    assert not state.exists() or not any(state.iterdir())
