"""Enrollment against a real nats-server and the test control plane.

One server for the module, with two logins besides the anonymous one (which is the full-access
``plane`` user, so the control plane and most tests connect without credentials): ``bootstrap``,
holding exactly the bootstrap permissions (``ENROLL_PERMISSIONS``), and ``plane``. The node's key
is born on the node and the token is proven, not sent: an eavesdropper with the bootstrap login or
full access sees the requests and the reply and neither the seed nor the token; a replayed
request is refused; a reply whose seal does not open, that carries credentials in clear, a
password, or a JWT for another key is refused and nothing is stored.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import stat
from datetime import UTC, datetime

import nats
import pytest

from gpuaas_agent.config import parse_config
from gpuaas_agent.contract import subjects
from gpuaas_agent.contract.enrollment import (
    EnrollNonce,
    EnrollNonceRequest,
    EnrollReply,
    EnrollRequest,
    NatsCredentials,
    js_api_prefix_problem,
    reply_key_id,
)
from gpuaas_agent.control.enroll import (
    ENROLL_SUBJECT,
    NONCE_SUBJECT,
    EnrollError,
    EnrollmentRecord,
    creds_path,
    enroll,
    js_api_prefix_in_use,
    load_enrollment,
    record_path,
    remove_bootstrap_login,
)
from gpuaas_agent.control.nkeyseed import new_user_seed, public_key
from gpuaas_agent.control.permissions import ENROLL_PERMISSIONS
from gpuaas_agent.control.sealed import (
    SealError,
    b64url,
    b64url_decode,
    new_reply_key,
    open_credentials,
    public_key_text,
    seal_credentials,
)
from gpuaas_agent.control.tokenproof import token_id, token_proof
from gpuaas_agent.control.transport import CREDS_SEED_BEGIN, TransportSecurity, jwt_claims
from tests.support.controlplane import ControlPlane
from tests.support.enroll_identity import IDENTITY
from tests.support.nats_server import NatsServer, nats_server_binary

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
        super().__init__(nats_server_binary("the control tests need a real server"), store, root / "nats.log", extra_args=("-c", str(config)))

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
    assert stat.S_IMODE(creds_path(state).stat().st_mode) == 0o600
    assert not token_file.exists()
    assert load_enrollment(state) == record
    # The sealed reply opened to exactly what the control plane issued, for the key this attempt sent.
    assert record.credentials == issued[record.node_id]
    [request] = requests
    assert len(b64url_decode(request.reply_public_key)) == 32
    assert record.node_id.startswith("node-") and record.credentials.servers == [nats_server.url]
    # The key was born here: the JWT is for the public key of the seed in nats.creds, the record holds no seed.
    seed = _seed(state)
    assert jwt_claims(record.credentials.user_jwt)["sub"] == public_key(seed) == request.node_public_key
    assert seed.encode() not in path.read_bytes() and b"NKEY SEED" not in path.read_bytes()
    assert sorted(p.name for p in state.iterdir()) == ["enrollment.json", "nats.creds"]  # no temp file left behind


def _seed(state) -> str:
    lines = creds_path(state).read_text().splitlines()
    return lines[lines.index(CREDS_SEED_BEGIN) + 1]


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


def test_the_bootstrap_login_is_deleted_once_enrolled_but_never_the_nodes_own_creds(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    own = creds_path(state)
    own.write_text("the node's own login")
    remove_bootstrap_login(TransportSecurity(insecure=True, creds_file=own), state)  # a config naming the same file
    assert own.exists()
    boot = tmp_path / "bootstrap.creds"
    boot.write_text("shared enrollment login")
    remove_bootstrap_login(TransportSecurity(insecure=True, creds_file=boot), state)
    assert not boot.exists()
    remove_bootstrap_login(TransportSecurity(insecure=True, creds_file=boot), state)  # gone already: nothing to do
    remove_bootstrap_login(None, state)


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


@pytest.mark.parametrize(("login", "wildcard"), [("bootstrap", "_INBOX.enroll.*.>"), ("plane", ">")])
def test_an_eavesdropper_on_the_inbox_receives_the_reply_and_finds_no_password_in_it(nats_server, tmp_path,
                                                                                        login, wildcard):
    """``bootstrap``: another host sharing the bootstrap login; ``plane``: the worst case, full access."""
    token_file, state = tmp_path / "token", tmp_path / "state"
    token = ""

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
            nonlocal token
            token = plane.issue_token()
            token_file.write_text(token)
            record = await enroll(nats_server.url_as("bootstrap"), token_file, state, IDENTITY, timeout=5,
                                  security=INSECURE)
            await asyncio.wait_for(reply_seen.wait(), DEADLINE_S)
            await spy.flush(timeout=5)
        finally:
            await spy.close()
        return record, seen

    record, seen = _run(_with_plane(nats_server.url, body))
    replies = [data for subject, data in seen if subject.startswith("_INBOX.enroll.")]
    assert len(replies) == 2, "the eavesdropper must have received the nonce and the enrollment reply"
    assert any(subject == ENROLL_SUBJECT for subject, _ in seen) == (login == "plane")  # full access: the request too
    for secret in (_seed(state).encode(), token.encode()):  # neither the node's seed nor the token travelled
        assert all(secret not in data for _, data in seen)
    heard = EnrollReply.model_validate_json(replies[-1])
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
    "password_sealed": "enroll_reply_carries_secret",
    "jwt_for_another_key": "enroll_reply_wrong_key",
}


def _hostile_reply(kind: str, request: EnrollRequest) -> bytes:
    node = "node-hostile01"
    credentials = NatsCredentials(user=node, password=SECRET, servers=["nats://127.0.0.1:4222"])
    if kind == "jwt_for_another_key":  # what a control plane that made the key itself would send
        credentials = NatsCredentials(user_jwt=plane_jwt(public_key(new_user_seed())), servers=["nats://h:4222"])
    # A hostile plane answering this very request knows its reply key: it echoes the binding (the agent takes
    # no answer without it), so what is refused below is refused for its content.
    bound = reply_key_id(request.reply_public_key)
    if kind == "credentials_in_clear":  # what a control plane from before the seal answers
        return json.dumps({"schema_version": "gpuaas.agent/v1", "accepted": True, "node_id": node,
                           "credentials": credentials.model_dump(), "reply_key_id": bound}).encode()
    if kind == "accepted_without_seal":
        return EnrollReply(accepted=True, node_id=node, reply_key_id=bound).model_dump_json().encode()
    sealed_for, reply_node = request, node
    if kind == "sealed_to_another_key":
        sealed_for = request.model_copy(update={"reply_public_key": public_key_text(new_reply_key())})
    elif kind == "sealed_for_another_token":  # a reply captured from another host's request
        sealed_for = request.model_copy(update={"token_id": token_id("another-hosts-token-0123456789")})
    elif kind == "node_id_swapped":
        reply_node = "node-hostile02"
    sealed = seal_credentials(credentials, sealed_for, node)
    if kind == "tampered_ciphertext":
        raw = bytearray(b64url_decode(sealed.ciphertext))
        raw[-1] ^= 0x80
        sealed = sealed.model_copy(update={"ciphertext": b64url(bytes(raw))})
    return EnrollReply(accepted=True, node_id=reply_node, sealed_credentials=sealed,
                       reply_key_id=bound).model_dump_json().encode()


@pytest.mark.parametrize("kind", list(HOSTILE_REPLIES))
def test_a_reply_that_does_not_open_or_carries_credentials_in_clear_is_refused_and_nothing_is_stored(
        nats_server, tmp_path, kind):
    token_file, state = tmp_path / "token", tmp_path / "state"
    token_file.write_text("bootstrap-token-0123456789\n")

    async def body():
        responder = await nats.connect(nats_server.url, connect_timeout=5)

        async def answer(msg):
            await msg.respond(_hostile_reply(kind, EnrollRequest.model_validate_json(msg.data)))

        async def nonce(msg):
            asked = EnrollNonceRequest.model_validate_json(msg.data)
            await msg.respond(EnrollNonce(nonce=b64url(secrets.token_bytes(32)), expires_at=datetime(2099, 1, 1, tzinfo=UTC),
                                          reply_key_id=reply_key_id(asked.reply_public_key))
                              .model_dump_json().encode())
        try:
            await responder.subscribe(NONCE_SUBJECT, cb=nonce)
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


def plane_jwt(key: str) -> str:
    from tests.natsauth.natsjwt import Operator
    return Operator().user_jwt_for(key, "node-hostile01")


def test_a_second_bootstrap_holder_cannot_answer_into_another_hosts_inbox_nor_use_what_it_hears(nats_server,
                                                                                                  tmp_path):
    """Host A holds the shared bootstrap login too. It hears every enrollment inbox (``_INBOX.enroll.*.>``) and,
    at its strongest, knows the exact reply subject of host B's pending enrollment request (the plane is held
    until A has struck). A has the plane answer into B's inbox a nonce request of its own and an enrollment
    request spending B's heard nonce: B ignores both (bound to A's key, not B's), its nonce was not spent, and it
    enrolls. What A heard is useless: B's nonce is bound to B's key and spent, B's credentials are sealed to B."""
    token_file, state = tmp_path / "token", tmp_path / "state"

    async def body():
        plane = await ControlPlane.connect(nats_server.url)
        attacker = await nats.connect(nats_server.url_as("bootstrap"), connect_timeout=5)
        heard: list = []  # (subject, data) A received on the enrollment inboxes
        changed = asyncio.Condition()
        held: list = []  # B's enrollment request, held at the plane until A has struck

        async def hear(msg):
            async with changed:
                heard.append((msg.subject, msg.data))
                changed.notify_all()

        async def heard_on(subject, count):
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda: len([h for h in heard if h[0] == subject]) >= count),
                                       DEADLINE_S)

        attacker_key = new_reply_key()

        async def strike(b_reply):
            b_nonce = EnrollNonce.model_validate_json(next(d for subj, d in heard if subj != b_reply
                                                           and b"nonce" in d)).nonce
            own = public_key_text(attacker_key)
            await attacker.publish(NONCE_SUBJECT, EnrollNonceRequest(reply_public_key=own).model_dump_json().encode(),
                                   reply=b_reply)
            fields = {"server_nonce": b_nonce, "token_id": token_id("attacker-token-0123456789"),
                      "node_public_key": public_key(new_user_seed()), "machine_id": "a" * 32,
                      "reply_public_key": own}
            forged = EnrollRequest(token_proof=token_proof("attacker-token-0123456789", **fields), **fields,
                                   **IDENTITY.model_dump(exclude={"machine_id"}))
            await attacker.publish(ENROLL_SUBJECT, forged.model_dump_json().encode(), reply=b_reply)
            await attacker.flush(timeout=5)

        async def gate(msg):
            if not held:  # B's request: hold it, let A strike at its exact reply subject
                held.append(msg)
                asyncio.get_running_loop().create_task(strike(msg.reply))
                return
            await plane._on_enroll(msg)  # A's forged request, answered into B's inbox
            await heard_on(held[0].reply, 2)  # both forged answers reached B's inbox before the real one
            await plane._on_enroll(held[0])

        try:
            await attacker.subscribe(f"{subjects.ENROLL_INBOX_PREFIX}.*.>", cb=hear)
            await attacker.flush(timeout=5)
            await plane.nc.subscribe(NONCE_SUBJECT, cb=plane._on_nonce)
            await plane.nc.subscribe(ENROLL_SUBJECT, cb=gate)
            await plane.nc.flush(timeout=5)
            token_file.write_text(plane.issue_token())
            record = await enroll(nats_server.url_as("bootstrap"), token_file, state, IDENTITY, timeout=10,
                                  security=INSECURE)
            await heard_on(held[0].reply, 3)
        finally:
            await attacker.close()
            await plane.close()
        return record, heard, held[0].reply, plane, attacker_key

    record, heard, b_reply, plane, attacker_key = _run(body())
    assert load_enrollment(state) == record and len(plane.issued_credentials) == 1  # B enrolled, A earned nothing
    in_b = [EnrollReply.model_validate_json(d) if b"accepted" in d else EnrollNonce.model_validate_json(d)
            for subj, d in heard if subj == b_reply]
    b_request = plane.enroll_requests[-1]
    b_bound = reply_key_id(b_request.reply_public_key)
    # Two answers the plane was made to send into B's inbox, both bound to A's key (B ignored them), then B's own.
    assert [a.reply_key_id for a in in_b] == [reply_key_id(public_key_text(attacker_key))] * 2 + [b_bound]
    forged_refusal = next(a for a in in_b if isinstance(a, EnrollReply) and not a.accepted)
    assert forged_refusal.error == "nonce_invalid"  # B's nonce, bound to B's key: not A's to use, nor spent by it
    b_reply_heard = in_b[-1]
    assert isinstance(b_reply_heard, EnrollReply) and b_reply_heard.accepted
    with pytest.raises(SealError):  # what A heard of B's credentials does not open with A's key
        open_credentials(b_reply_heard.sealed_credentials, attacker_key,
                         b_request.model_copy(update={"reply_public_key": public_key_text(attacker_key)}),
                         b_reply_heard.node_id)
    assert plane.nonces == {} or all(bound != b_request.reply_public_key for _, bound in plane.nonces.values())


def test_a_recorded_request_replayed_is_refused_and_a_re_pointed_one_fails_its_proof(nats_server, tmp_path):
    """A full-access eavesdropper records the enrollment request and sends it again, as it is and re-pointed at
    its own key with a fresh nonce: the first finds its nonce spent, the second's proof does not hold."""
    token_file, state = tmp_path / "token", tmp_path / "state"

    async def body(plane):
        spy = await nats.connect(nats_server.url, connect_timeout=5)
        recorded: list[bytes] = []
        heard = asyncio.Event()

        async def record_request(msg):
            recorded.append(msg.data)
            heard.set()
        try:
            await spy.subscribe(ENROLL_SUBJECT, cb=record_request)
            await spy.flush(timeout=5)
            token_file.write_text(plane.issue_token())
            await enroll(nats_server.url_as("bootstrap"), token_file, state, IDENTITY, timeout=5, security=INSECURE)
            await asyncio.wait_for(heard.wait(), DEADLINE_S)
            replayed = EnrollReply.model_validate_json((await spy.request(ENROLL_SUBJECT, recorded[0], timeout=5)).data)
            fresh = EnrollNonce.model_validate_json((await spy.request(NONCE_SUBJECT, b"{}", timeout=5)).data).nonce
            original = EnrollRequest.model_validate_json(recorded[0])
            attacker_key = public_key(new_user_seed())
            repointed = original.model_copy(update={"server_nonce": fresh, "node_public_key": attacker_key})
            re_pointed = EnrollReply.model_validate_json(
                (await spy.request(ENROLL_SUBJECT, repointed.model_dump_json().encode(), timeout=5)).data)
            # The same, had the attacker guessed the token's proof bytes without the token: it cannot, shown by
            # the one field it would need to forge.
            assert repointed.token_proof == original.token_proof != token_proof(
                "not-the-token-0123456789", server_nonce=fresh, token_id=original.token_id,
                node_public_key=attacker_key, machine_id=original.machine_id,
                reply_public_key=original.reply_public_key)
        finally:
            await spy.close()
        return replayed, re_pointed, plane

    replayed, re_pointed, plane = _run(_with_plane(nats_server.url, body))
    assert (replayed.accepted, replayed.error) == (False, "nonce_invalid")
    assert (re_pointed.accepted, re_pointed.error) == (False, "token_invalid")
    assert len(plane.issued_credentials) == 1  # only the genuine enrollment earned a JWT


# -- the JetStream API prefix an enrollment reply may carry --------------------------------------------------


@pytest.mark.parametrize("prefix", ["$JS.API", "gpuaas.js.API", "js", "site-1.js_api.API"])
def test_a_plain_js_api_prefix_is_accepted(prefix):
    assert js_api_prefix_problem(prefix) is None


@pytest.mark.parametrize("prefix", ["", ".", "a..b", ".a", "a.", "$JS.API.>", "$JS.>", "*", ">", "a.*.b", "a b",
                                    "$SYS.REQ", "$JS.ACK", "$JS", "gpuaas.node", "gpuaas.node.node-x.task",
                                    "gpuaas.enroll", "gpuaas.enroll.nonce", "_INBOX", "_INBOX.node-x",
                                    "a.b.c.d.e.f.g.h.i", "x" * 65, "a\tb", "ä"])
def test_a_js_api_prefix_that_is_not_a_plain_prefix_or_names_node_subjects_is_refused(prefix):
    assert js_api_prefix_problem(prefix) is not None


def _record(prefix: str | None, tmp_path) -> EnrollmentRecord:
    creds = NatsCredentials(user="u", password="p", servers=["nats://127.0.0.1:4222"], js_api_prefix=prefix)
    return EnrollmentRecord.model_construct(node_id="node-abc", credentials=creds, enrolled_at=datetime.now(UTC))


def test_the_prefix_in_use_is_the_configs_then_enrollments_then_the_default(tmp_path):
    from_enrollment = _record("gpuaas.js.API", tmp_path)
    assert js_api_prefix_in_use(parse_config({}), None) == ("$JS.API", "default")
    assert js_api_prefix_in_use(parse_config({}), _record(None, tmp_path)) == ("$JS.API", "default")
    assert js_api_prefix_in_use(parse_config({}), from_enrollment) == ("gpuaas.js.API", "enrollment")
    # Set in the config, even to the default: the operator's word wins over the reply's.
    assert js_api_prefix_in_use(parse_config({"js_api_prefix": "$JS.API"}), from_enrollment) == ("$JS.API", "config")


def test_an_enrollment_record_with_a_hostile_prefix_is_refused_on_load(tmp_path):
    """enrollment.json is written by the agent from a checked reply; one edited to a wildcard is damaged."""
    record = _record("gpuaas.js.API", tmp_path)
    doc = json.loads(record.model_dump_json())
    (tmp_path / "enrollment.json").write_text(json.dumps(doc))
    assert load_enrollment(tmp_path).credentials.js_api_prefix == "gpuaas.js.API"
    for hostile in ("$JS.API.>", "", "gpuaas.node.node-other"):
        doc["credentials"]["js_api_prefix"] = hostile
        (tmp_path / "enrollment.json").write_text(json.dumps(doc))
        with pytest.raises(EnrollError) as err:
            load_enrollment(tmp_path)
        assert err.value.code == "enrollment_record_invalid"


def test_an_old_reply_without_a_prefix_is_still_accepted_and_names_none(nats_server, tmp_path):
    """A v2 control plane (one account) sends no js_api_prefix: enrolled as before, the config decides."""
    async def body():
        plane = await ControlPlane.connect(nats_server.url)
        await plane.serve_enrollment()
        try:
            token = tmp_path / "token"
            token.write_text(plane.issue_token())
            return await enroll(nats_server.url, token, tmp_path / "state", IDENTITY, timeout=5,
                                security=TransportSecurity(insecure=True))
        finally:
            await plane.close()
    record = _run(body())
    assert record.credentials.js_api_prefix is None
    raw = json.loads((tmp_path / "state" / "enrollment.json").read_text())
    assert raw["credentials"].get("js_api_prefix") is None
