"""No secret on the wire, against a real nats-server in operator mode (decentralized auth, as ``nsc`` sets up).

The server verifies every login against the operator's account: the control plane (full access),
the bootstrap user (``ENROLL_PERMISSIONS``), and each node with the user JWT the test control plane
minted for the key the node made itself. An eavesdropper with full access (a ``>`` subscription,
the worst case: a leaked plane login, a misconfigured export) records everything while a node
enrolls and rotates twice; none of the node's seeds, the token, a password or a private key is in
what it recorded. A rotation whose renewal reply is lost leaves the node logging in with its
previous credentials.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import nats
import pytest

from gpuaas_agent.config import parse_config
from gpuaas_agent.control.connection import Backoff, connect_nats
from gpuaas_agent.control.enroll import creds_path, enroll, login_options, record_path
from gpuaas_agent.control.permissions import ENROLL_PERMISSIONS, consumer_name
from gpuaas_agent.control.rotation import CredsRotator, previous_path
from gpuaas_agent.control.transport import CREDS_SEED_BEGIN, TransportSecurity, check_creds_file
from tests.natsauth.natsjwt import Operator
from tests.support.controlplane import TASK_STREAM, ControlPlane
from tests.support.deadline import run_bounded, wait_until
from tests.support.enroll_identity import IDENTITY
from tests.support.nats_server import configured_server, write_creds

DEADLINE_S = 20.0
INSECURE = TransportSecurity(insecure=True)


class OperatorServer:
    """One nats-server for the module whose only logins are the operator's users."""

    def __init__(self, root) -> None:
        self.root = root
        self.operator = Operator()
        self.plane_creds, _ = self.operator.user("control-plane")
        self.bootstrap_creds, _ = self.operator.user("bootstrap", pub=ENROLL_PERMISSIONS["publish"],
                                                     sub=ENROLL_PERMISSIONS["subscribe"])
        self.server = configured_server(root, self.operator.server_config())

    def creds_file(self, name: str, text: str):
        return write_creds(self.root, name, text)

    def connz(self) -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.server.http_port}/connz?auth=1", timeout=5) as resp:
            return json.load(resp).get("connections") or []

    async def plane(self) -> ControlPlane:
        plane = await ControlPlane.connect(self.server.url, operator=self.operator,
                                           user_credentials=str(self.creds_file("plane", self.plane_creds)))
        await plane.create_streams()
        await plane.serve_enrollment()
        await plane.serve_rotation()
        return plane


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = OperatorServer(tmp_path_factory.mktemp("operator"))
    lab.server.start()
    try:
        yield lab
    finally:
        lab.server.stop()


def _seed(state) -> str:
    lines = creds_path(state).read_text().splitlines()
    return lines[lines.index(CREDS_SEED_BEGIN) + 1]


async def _enrolled_node(lab: OperatorServer, plane: ControlPlane, tmp_path):
    """Enroll over the bootstrap login; then the daemon's own login (nats.creds) and its rotation listener."""
    state, token = tmp_path / "state", tmp_path / "token"
    token.write_text(plane.issue_token())
    record = await enroll(lab.server.url, token, state, IDENTITY, timeout=DEADLINE_S,
                          security=TransportSecurity(insecure=True, creds_file=lab.creds_file("boot", lab.bootstrap_creds)))
    config = parse_config({"state_dir": str(state), "insecure": True})
    nc = await connect_nats(record.credentials.servers, timeout_s=5.0, name="node", reconnect=Backoff(0.1, 0.5),
                            **login_options(config, record))  # as the daemon connects
    rotator = CredsRotator(nc, record.node_id, creds_path(state), timeout_s=2.0)
    await rotator.start()
    await nc.flush(timeout=5)  # the rotation subscription is on the server before the plane orders one
    return record, state, nc, rotator


async def _logged_in_as(lab: OperatorServer, key: str) -> None:
    await wait_until(lambda: any(c.get("authorized_user") == key for c in lab.connz()), DEADLINE_S,
                     f"a connection logged in as {key}")


def test_an_eavesdropper_with_full_access_sees_no_seed_token_or_password_through_enrollment_and_two_rotations(
        lab, tmp_path):
    async def body():
        plane = await lab.plane()
        spy = await nats.connect(lab.server.url, user_credentials=str(lab.creds_file("spy", lab.plane_creds)))
        recorded: list[tuple[str, bytes, bytes]] = []

        async def record(msg):
            recorded.append((msg.subject, msg.data, json.dumps(msg.headers or {}).encode()))
        await spy.subscribe(">", cb=record)
        await spy.flush(timeout=5)
        token = None
        try:
            # The token is what the plane issued; remember it to look for it on the wire.
            original_issue = plane.issue_token

            def issue(*a, **kw):
                nonlocal token
                token = original_issue(*a, **kw)
                return token
            plane.issue_token = issue
            record_, state, nc, rotator = await _enrolled_node(lab, plane, tmp_path)
            seeds = [_seed(state)]
            keys = [check_creds_file(creds_path(state)).user_key]
            await _logged_in_as(lab, keys[0])
            # The node's own JWT lets it look up the consumer the plane created at enrollment (and nothing else).
            info = await nc.jetstream(timeout=5).consumer_info(TASK_STREAM, consumer_name(record_.node_id))
            assert info.config.filter_subject == f"gpuaas.node.{record_.node_id}.task.>"
            assert info.config.deliver_subject is None
            for rotation in (1, 2):
                reply = await plane.rotate(record_.node_id)
                assert reply.accepted, reply
                await _logged_in_as(lab, reply.node_public_key)
                await wait_until(lambda n=rotation: rotator.confirmed == n, DEADLINE_S, "the new login confirmed")
                seeds.append(_seed(state))
                keys.append(reply.node_public_key)
            assert len(set(seeds)) == 3 and len(set(keys)) == 3 and keys == plane.node_keys[record_.node_id]
            assert not previous_path(creds_path(state)).exists()  # each old seed deleted once the new one worked
            await spy.flush(timeout=5)
            await rotator.stop()
            await nc.close()
        finally:
            await spy.close()
            await plane.close()
        return recorded, seeds, token, state

    recorded, seeds, token, state = run_bounded(body(), 90)
    subjects = {s for s, _, _ in recorded}
    # It did see the whole exchange...
    assert {"gpuaas.enroll.nonce", "gpuaas.enroll"} <= subjects
    assert sum(1 for s in subjects if s.endswith(".creds.renew")) == 1 and sum(
        1 for s, _, _ in recorded if s.endswith(".creds.renew")) == 2
    # ... and none of the secrets.
    wire = b"\n".join(data + headers for _, data, headers in recorded)
    for secret in (*seeds, token):
        assert secret.encode() not in wire
    for marker in (b"NKEY SEED", b'"password"', b"PRIVATE KEY", b'"seed"', b'"bootstrap_token"'):
        assert marker not in wire
    # On disk: the seed only in nats.creds (0600); enrollment.json holds none.
    assert seeds[-1].encode() not in record_path(state).read_bytes()
    assert [p.name for p in sorted(state.iterdir())] == ["enrollment.json", "nats.creds"]


def test_a_rotation_whose_reply_is_lost_leaves_the_node_on_its_previous_credentials(lab, tmp_path):
    async def body():
        plane = await lab.plane()
        record_, state, nc, rotator = await _enrolled_node(lab, plane, tmp_path)
        try:
            before = creds_path(state).read_bytes()
            key = check_creds_file(creds_path(state)).user_key
            plane.drop_renew_replies = 1  # the plane minted a JWT for the new key; its answer never arrives
            reply = await plane.rotate(record_.node_id)
            assert (reply.accepted, reply.error) == (False, "creds_renew_unanswered")
            assert len(plane.node_keys[record_.node_id]) == 2  # a JWT was minted for a key the node threw away
            assert creds_path(state).read_bytes() == before and not previous_path(creds_path(state)).exists()
            # A reconnect (a server restart, a network blip) logs in with the previous credentials.
            reconnects = nc.stats["reconnects"]
            await nc.force_reconnect()
            await wait_until(lambda: nc.is_connected and nc.stats["reconnects"] > reconnects, DEADLINE_S,
                             "the node reconnected")
            await _logged_in_as(lab, key)
            # The next rotation goes through.
            again = await plane.rotate(record_.node_id)
            assert again.accepted
            await _logged_in_as(lab, again.node_public_key)
        finally:
            await rotator.stop()
            await nc.close()
            await plane.close()
    run_bounded(body(), 90)


def test_new_credentials_the_server_refuses_are_reverted_and_the_node_logs_in_with_its_previous_ones(lab, tmp_path):
    """Until a reconnect with the new credentials comes up, the previous seed is kept (nats.creds.prev)."""
    async def body():
        plane = await lab.plane()
        record_, state, nc, rotator = await _enrolled_node(lab, plane, tmp_path)
        rotator.confirm_s = 3.0
        try:
            before = creds_path(state).read_bytes()
            key = check_creds_file(creds_path(state)).user_key
            trusted, plane.operator = plane.operator, Operator()  # a JWT the server does not trust
            reply = await plane.rotate(record_.node_id)
            plane.operator = trusted
            assert reply.accepted  # the agent cannot tell; the server will
            assert previous_path(creds_path(state)).read_bytes() == before  # kept until confirmed
            await wait_until(lambda: creds_path(state).read_bytes() == before, DEADLINE_S, "the previous creds back")
            assert not previous_path(creds_path(state)).exists() and rotator.confirmed == 0
            await wait_until(lambda: nc.is_connected, DEADLINE_S, "the node reconnected")
            await _logged_in_as(lab, key)
        finally:
            await rotator.stop()
            await nc.close()
            await plane.close()
    run_bounded(body(), 90)


def test_a_restart_between_install_and_confirmation_with_refused_creds_falls_back_to_the_previous_ones(lab, tmp_path):
    """The agent stopped after installing new credentials the server refuses: its connect puts the kept ones back."""
    from gpuaas_agent.daemon import connect

    async def body():
        plane = await lab.plane()
        record_, state, nc, rotator = await _enrolled_node(lab, plane, tmp_path)
        await rotator.stop()
        await nc.close()
        good = creds_path(state).read_bytes()
        key = check_creds_file(creds_path(state)).user_key
        previous_path(creds_path(state)).write_bytes(good)
        previous_path(creds_path(state)).chmod(0o600)
        untrusted, _ = Operator().user(record_.node_id)  # what an unconfirmed rotation could have left in place
        creds_path(state).write_text(untrusted)
        config = parse_config({"state_dir": str(state), "insecure": True, "reconnect_backoff_initial_s": 0.1,
                               "reconnect_backoff_max_s": 0.5})
        try:
            nc = await connect(config, record_, asyncio.Event())
            assert nc is not None and nc.is_connected
            await _logged_in_as(lab, key)
            assert creds_path(state).read_bytes() == good and not previous_path(creds_path(state)).exists()
            await nc.close()
        finally:
            await plane.close()
    run_bounded(body(), 90)
