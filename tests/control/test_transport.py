"""The control channel's transport and identity against a real nats-server: TLS, mutual TLS, `.creds`, rotation.

One server for the module: TLS with a throwaway CA (server cert for 127.0.0.1 and
``nats.test``), client certificates required (``verify: true``), and decentralized auth
(operator → account → users, memory resolver; one user revoked). Each refusal must be a
clear, typed error, raised before anything is executed (for local refusals: before
anything is dialled).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import shutil
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from gpuaas_agent.compat import UTC
from gpuaas_agent.config import parse_config
from gpuaas_agent.contract.enrollment import NatsCredentials
from gpuaas_agent.control.connection import NatsConnectError, connect_nats
from gpuaas_agent.control.enroll import (
    EnrollError,
    EnrollmentRecord,
    creds_path,
    enroll,
    load_enrollment,
    login_options,
    record_path,
    store_creds,
)
from gpuaas_agent.control.permissions import ENROLL_PERMISSIONS
from gpuaas_agent.control.rotation import CredsRotator, previous_path
from gpuaas_agent.control.transport import TransportSecurity, check_creds_file
from tests.control.conftest import NatsServer
from tests.control.test_enroll import IDENTITY
from tests.natsauth.natsjwt import Operator
from tests.natsauth.pki import CA
from tests.support.controlplane import ControlPlane
from tests.support.deadline import wait_until

NODE = "node-tls01"
DEADLINE_S = 20.0
TEST_DEADLINE_S = 60.0


def sync(test):
    """Run an async test body under asyncio.run with a deadline (the suite has no asyncio plugin)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(test(*args, **kwargs), TEST_DEADLINE_S))
    return wrapper


class TlsLab:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = CA(root / "pki")
        self.other_ca = CA(root / "pki-other", name="other-ca")
        self.server_cert = self.ca.issue("nats-server", dns=("nats.test",), ips=("127.0.0.1",))
        self.client = self.ca.issue("node-client", client=True)
        self.operator = Operator()
        self.creds, self.user = self.operator.user(NODE)
        revoked_at = time.time()
        self.revoked_creds, revoked = self.operator.user("revoked", issued_at=revoked_at - 60)
        self.operator.revoke(revoked, at=revoked_at)
        self.plane_creds, _ = self.operator.user("control-plane")
        self.bootstrap_creds, _ = self.operator.user("bootstrap", pub=ENROLL_PERMISSIONS["publish"],
                                                     sub=ENROLL_PERMISSIONS["subscribe"])
        config = root / "nats.conf"
        config.write_text(
            self.operator.server_config()
            + f'tls {{\n  cert_file: "{self.server_cert.cert}"\n  key_file: "{self.server_cert.key}"\n'
              f'  ca_file: "{self.ca.path}"\n  verify: true\n  timeout: 5\n}}\n')
        store = root / "store"
        store.mkdir()
        self.server = NatsServer(shutil.which("nats-server") or "nats-server", store, root / "nats.log",
                                 extra_args=("-c", str(config)))

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.server.port}"

    def creds_file(self, name: str, text: str, mode: int = 0o600) -> Path:
        path = self.root / f"{name}.creds"
        path.write_text(text)
        path.chmod(mode)
        return path

    def security(self, **overrides) -> TransportSecurity:
        values = {"ca_file": self.ca.path, "cert_file": self.client.cert, "key_file": self.client.key,
                  "creds_file": self.creds_file("node", self.creds)}
        values.update(overrides)
        return TransportSecurity(**values)

    def connz(self) -> list[dict]:
        url = f"http://127.0.0.1:{self.server.http_port}/connz?auth=1"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp).get("connections") or []


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = TlsLab(tmp_path_factory.mktemp("tls"))
    lab.server.start()
    try:
        yield lab
    finally:
        lab.server.stop()


async def _connect(lab: TlsLab, security: TransportSecurity, **kw):
    return await connect_nats([lab.url], timeout_s=5.0, name="test-node", security=security, **kw)


async def _refused(lab: TlsLab, security: TransportSecurity, url: str | None = None) -> NatsConnectError:
    with pytest.raises(NatsConnectError) as caught:
        await connect_nats([url or lab.url], timeout_s=5.0, name="test-node", security=security)
    assert lab.connz() == [], "a refused connection must not stay connected"
    return caught.value


@sync
async def test_tls_with_client_certificate_and_creds_connects_and_round_trips(lab):
    nc = await _connect(lab, lab.security())
    try:
        assert nc.connected_url.scheme == "tls"
        sub = await nc.subscribe("gpuaas.node.tls01.echo")
        await nc.publish("gpuaas.node.tls01.echo", b"hello")
        msg = await sub.next_msg(timeout=DEADLINE_S)
        assert msg.data == b"hello"
        [conn] = lab.connz()
        assert conn["tls_version"].startswith("1.")
        assert conn["authorized_user"] == lab.user.public
    finally:
        await nc.close()


@sync
async def test_a_server_certificate_from_another_ca_is_refused_before_connect(lab):
    err = await _refused(lab, lab.security(ca_file=lab.other_ca.path))
    assert err.code == "nats_tls_failed"
    assert "certificate verify failed" in err.message and "nothing was sent" in err.message


@sync
async def test_a_server_name_the_certificate_does_not_hold_is_refused(lab):
    err = await _refused(lab, lab.security(server_name="not-the-server.test"))
    assert err.code == "nats_tls_failed"
    assert "mismatch" in err.message  # "Hostname mismatch, certificate is not valid for 'not-the-server.test'"


@sync
async def test_the_server_name_can_differ_from_the_dialled_address(lab):
    nc = await _connect(lab, lab.security(server_name="nats.test"))
    await nc.close()


@sync
async def test_without_a_client_certificate_the_server_refuses_the_handshake(lab):
    with pytest.raises(NatsConnectError) as caught:
        await _connect(lab, lab.security(cert_file=None, key_file=None))
    assert caught.value.code in ("nats_tls_failed", "nats_unreachable")
    assert lab.connz() == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
@sync
async def test_a_creds_file_readable_by_others_is_refused_before_dialling(lab, mode):
    path = lab.creds_file(f"loose-{mode:o}", lab.creds, mode=mode)
    err = await _refused(lab, lab.security(creds_file=path), url="tls://192.0.2.1:4222")  # never dialled
    assert err.code == "creds_insecure"
    assert f"{mode:04o}" in err.message and "0600" in err.message


@sync
async def test_expired_creds_are_refused_with_their_expiry(lab):
    creds, _ = lab.operator.user("expired", issued_at=time.time() - 7200, expires_at=time.time() - 60)
    err = await _refused(lab, lab.security(creds_file=lab.creds_file("expired", creds)), url="tls://192.0.2.1:4222")
    assert err.code == "creds_expired"
    assert "expired at" in err.message


@sync
async def test_revoked_creds_are_refused_by_the_server(lab):
    err = await _refused(lab, lab.security(creds_file=lab.creds_file("revoked", lab.revoked_creds)))
    assert err.code == "nats_auth_refused"
    assert "Authorization Violation" in err.message


@sync
async def test_a_file_that_is_not_creds_is_refused(lab):
    err = await _refused(lab, lab.security(creds_file=lab.creds_file("junk", "user=root\npassword=x\n")),
                         url="tls://192.0.2.1:4222")
    assert err.code == "creds_invalid"


def _connz(server: NatsServer) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/connz", timeout=5) as resp:
        return json.load(resp).get("connections") or []


@pytest.mark.parametrize("url", ["nats://192.0.2.1:4222", "loopback"])
@sync
async def test_plaintext_is_refused_without_insecure_loopback_included_and_names_url_and_setting(nats_server, url):
    url = nats_server.url if url == "loopback" else url
    with pytest.raises(NatsConnectError) as caught:
        await connect_nats([url], timeout_s=5.0, name="t", security=TransportSecurity())
    err = caught.value
    assert err.code == "plaintext_refused"
    assert url in err.message and "insecure = true" in err.message
    assert err.evidence["server"] == url and err.evidence["setting"] == "insecure"
    assert _connz(nats_server) == []  # refused before dialling: the server never saw us


@sync
async def test_plaintext_with_insecure_connects_and_warns(nats_server, caplog):
    caplog.set_level(logging.WARNING, logger="gpuaas_agent.control.connection")
    nc = await connect_nats([nats_server.url], timeout_s=5.0, name="lab-node", security=TransportSecurity(insecure=True))
    try:
        assert nc.is_connected and nc.connected_url.scheme == "nats"
        assert len(_connz(nats_server)) == 1
    finally:
        await nc.close()
    [warning] = [json.loads(r.getMessage()) for r in caplog.records if "nats_plaintext" in r.getMessage()]
    assert warning["server"] == nats_server.url and "insecure = true" in warning["message"]


@sync
async def test_plaintext_to_a_remote_server_with_insecure_is_dialled():
    with pytest.raises(NatsConnectError) as caught:  # allowed, so it is dialled (and nobody answers)
        await connect_nats(["nats://192.0.2.1:4222"], timeout_s=1.0, name="t", security=TransportSecurity(insecure=True))
    assert caught.value.code == "nats_unreachable"


@sync
async def test_a_plaintext_server_behind_a_tls_url_gets_no_connect(nats_server):
    url = nats_server.url.replace("nats://", "tls://")
    with pytest.raises(NatsConnectError) as caught:
        await connect_nats([url], timeout_s=5.0, name="t", security=TransportSecurity())
    assert caught.value.code == "nats_tls_failed"
    assert "offered no TLS" in caught.value.message


def test_config_refuses_half_a_client_certificate(tmp_path):
    with pytest.raises(Exception) as caught:
        parse_config({"nats_tls_cert_file": str(tmp_path / "c.pem")})
    assert "nats_tls_cert_file and nats_tls_key_file go together" in str(caught.value)


def _jwt(creds: str) -> str:
    return next(line for line in creds.splitlines() if line.startswith("eyJ"))


def test_the_login_uses_nats_creds_and_a_missing_one_is_never_restored_from_the_record(lab, tmp_path):
    state = tmp_path / "state"
    record = EnrollmentRecord(node_id=NODE, enrolled_at=datetime.now(UTC),
                              credentials=NatsCredentials(user_jwt=_jwt(lab.creds), servers=[lab.url]))
    config = parse_config({"state_dir": str(state), "nats_tls_ca_file": str(lab.ca.path),
                           "nats_tls_cert_file": str(lab.client.cert), "nats_tls_key_file": str(lab.client.key)})
    with pytest.raises(EnrollError) as err:  # the seed exists nowhere else: say so, write nothing
        login_options(config, record)
    assert err.value.code == "creds_missing" and not creds_path(state).exists()
    path = store_creds(state, lab.creds)
    options = login_options(config, record)
    assert options["security"].creds_file == path
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert check_creds_file(path).user_key == lab.user.public
    assert options["inbox_prefix"] == f"_INBOX.{NODE}"
    assert "password" not in options


@pytest.mark.parametrize("creds_file_there", [True, False])
def test_a_v1_record_that_kept_the_seed_is_scrubbed_on_load(lab, tmp_path, creds_file_there):
    state = tmp_path / "state"
    state.mkdir()
    v1 = {"record_version": "gpuaas.agent.enrollment/v1", "node_id": NODE, "enrolled_at": "2026-01-01T00:00:00Z",
          "credentials": {"user": None, "password": None, "creds": lab.creds, "servers": [lab.url]}}
    record_path(state).write_text(json.dumps(v1))
    if creds_file_there:
        store_creds(state, lab.creds)
    record = load_enrollment(state)
    assert record is not None and record.credentials.user_jwt == _jwt(lab.creds)
    assert b"NKEY SEED" not in record_path(state).read_bytes()
    assert oct(record_path(state).stat().st_mode & 0o777) == oct(0o600)
    assert check_creds_file(creds_path(state)).user_key == lab.user.public  # the seed's one home
    assert load_enrollment(state) == record


async def _plane(lab: TlsLab, name: str) -> ControlPlane:
    return await ControlPlane.connect(lab.url, operator=lab.operator, tls=lab.security().ssl_context(),
                                      user_credentials=str(lab.creds_file(name, lab.plane_creds)))


def _logged_in_as(lab: TlsLab, key: str):
    async def wait():
        while not any(c.get("authorized_user") == key for c in lab.connz()):
            await asyncio.sleep(0.05)  # poll interval of a condition with a deadline
    return asyncio.wait_for(wait(), DEADLINE_S)


@sync
async def test_rotation_makes_a_new_key_here_asks_for_its_jwt_and_reconnects_without_touching_subscriptions(
        lab, tmp_path):
    state = tmp_path / "state"
    path = store_creds(state, lab.creds)
    nc = await _connect(lab, lab.security(creds_file=path), reconnect=None, inbox_prefix=f"_INBOX.{NODE}")
    nc.options["allow_reconnect"] = True  # force_reconnect needs it (the daemon connects with reconnect=Backoff)
    plane = await _plane(lab, "plane")
    await plane.serve_rotation()
    rotator = CredsRotator(nc, NODE, path)
    try:
        await rotator.start()
        # Stands in for the running task consumer; a subject the node's new JWT allows it (its terminal input).
        work_subject = f"gpuaas.node.{NODE}.terminal.0f8fad5b-d9cb-469f-a165-70867728950e.in"
        work = await nc.subscribe(work_subject)
        await nc.flush()

        refused = await plane.rotate(NODE, order_for="node-other", timeout=DEADLINE_S)
        assert refused.error == "wrong_node" and not refused.accepted
        assert check_creds_file(path).user_key == lab.user.public  # the old file stays

        reply = await plane.rotate(NODE)
        assert reply.accepted and reply.node_public_key == plane.node_keys[NODE][-1]
        assert check_creds_file(path).user_key == reply.node_public_key != lab.user.public
        assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        await _logged_in_as(lab, reply.node_public_key)
        assert nc.stats["reconnects"] >= 1
        await wait_until(lambda: rotator.confirmed == 1, DEADLINE_S, "the new login confirmed")
        assert not previous_path(path).exists()  # the old seed is gone once the new login worked
        await plane.nc.publish(work_subject, b"still-here")
        assert (await work.next_msg(timeout=DEADLINE_S)).data == b"still-here"
    finally:
        await rotator.stop()
        await nc.close()
        await plane.close()


@sync
async def test_enrollment_over_tls_stores_a_key_born_here_0600_and_hears_on_an_unguessable_inbox(lab, tmp_path):
    plane = await _plane(lab, "plane-enroll")
    await plane.serve_enrollment()
    on_inbox: list[tuple[str, bytes]] = []  # what a full-access user subscribed to _INBOX.> reads
    heard = asyncio.Event()

    async def eavesdrop(msg):
        if msg.subject.startswith("_INBOX.enroll."):  # not the plane's own JetStream replies
            on_inbox.append((msg.subject, msg.data))
        if len(on_inbox) >= 2:
            heard.set()
    spy = await plane.nc.subscribe("_INBOX.>", cb=eavesdrop)
    await plane.nc.flush()
    token = tmp_path / "token"
    token.write_text(plane.issue_token() + "\n")
    state = tmp_path / "state"
    try:
        # The bootstrap login: TLS + client certificate + a bootstrap user allowed only to enroll.
        record = await enroll(lab.url, token, state, IDENTITY, timeout=DEADLINE_S, connect_timeout=5.0,
                              security=lab.security(creds_file=lab.creds_file("bootstrap", lab.bootstrap_creds)))
        await asyncio.wait_for(heard.wait(), DEADLINE_S)
    finally:
        await spy.unsubscribe()
        await plane.close()
    path = creds_path(state)
    seed = next(line for line in path.read_text().splitlines() if line.startswith("SU")).encode()
    # The eavesdropper heard the nonce and the reply, on one unguessable inbox, and no seed in either.
    assert len(on_inbox) == 2 and all(seed not in data for _, data in on_inbox)
    assert all(s.startswith("_INBOX.enroll.") and len(s.split(".")[2]) == 32 for s, _ in on_inbox)
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    node_key = check_creds_file(path).user_key
    assert node_key == plane.node_keys[record.node_id][0]  # the JWT is for the key born here
    assert oct(record_path(state).stat().st_mode & 0o777) == oct(0o600)
    assert not token.exists()
    # ... and the daemon's login now uses that file over TLS, verified by the server against the operator.
    config = parse_config({"state_dir": str(state), "nats_tls_ca_file": str(lab.ca.path),
                           "nats_tls_cert_file": str(lab.client.cert), "nats_tls_key_file": str(lab.client.key)})
    login = login_options(config, record)
    nc = await connect_nats([lab.url], timeout_s=5.0, name="enrolled", **login)
    try:
        assert any(c.get("authorized_user") == node_key for c in lab.connz())
    finally:
        await nc.close()
