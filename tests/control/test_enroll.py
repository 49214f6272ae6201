"""Enrollment against a real nats-server and the test control plane."""

from __future__ import annotations

import asyncio
import stat

import pytest

from gpuaas_agent.control.enroll import EnrollError, EnrollIdentity, enroll, load_enrollment, record_path
from gpuaas_agent.control.transport import TransportSecurity
from tests.controlplane import ControlPlane

IDENTITY = EnrollIdentity(machine_id="0123456789abcdef0123456789abcdef", hostname="slice-host-01",
                          dmi_serial="SN123", agent_version="0.1.0")


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
        return await enroll(nats_server.url, token_file, state, IDENTITY, timeout=5, security=TransportSecurity(insecure=True))

    record = _run(_with_plane(nats_server.url, body))
    path = record_path(state)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not token_file.exists()
    assert load_enrollment(state) == record
    assert record.node_id.startswith("node-") and record.credentials.servers == [nats_server.url]
    assert "password" not in repr(record)
    assert [p.name for p in state.iterdir()] == ["enrollment.json"]  # no temp file left behind


def test_wrong_token_is_refused_and_token_file_kept(nats_server, tmp_path):
    token_file, state = tmp_path / "token", tmp_path / "state"
    token_file.write_text("not-a-token-the-plane-issued-0000")

    async def body(plane):
        plane.issue_token()
        return await enroll(nats_server.url, token_file, state, IDENTITY, timeout=5, security=TransportSecurity(insecure=True))

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
        await enroll(nats_server.url, first_token, tmp_path / "state-a", IDENTITY, timeout=5, security=TransportSecurity(insecure=True))
        other = IDENTITY.model_copy(update={"machine_id": "f" * 32, "hostname": "slice-host-02"})
        return await enroll(nats_server.url, second_token, tmp_path / "state-b", other, timeout=5, security=TransportSecurity(insecure=True))

    with pytest.raises(EnrollError) as err:
        _run(_with_plane(nats_server.url, body))
    assert err.value.code == "token_reused"
    assert second_token.exists() and load_enrollment(tmp_path / "state-b") is None


def test_expired_token_is_refused(nats_server, tmp_path):
    token_file = tmp_path / "token"

    async def body(plane):
        token_file.write_text(plane.issue_token(ttl_s=-1))
        return await enroll(nats_server.url, token_file, tmp_path / "state", IDENTITY, timeout=5, security=TransportSecurity(insecure=True))

    with pytest.raises(EnrollError) as err:
        _run(_with_plane(nats_server.url, body))
    assert err.value.code == "token_expired"


def test_already_enrolled_sends_no_request(nats_server, tmp_path):
    token_file, state = tmp_path / "token", tmp_path / "state"

    async def body(plane):
        token_file.write_text(plane.issue_token())
        first = await enroll(nats_server.url, token_file, state, IDENTITY, timeout=5, security=TransportSecurity(insecure=True))
        token_file.write_text(plane.issue_token())
        again = await enroll(nats_server.url, token_file, state, IDENTITY, timeout=5, security=TransportSecurity(insecure=True))
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
