"""Tokens, unit and on real sockets: no token, bad signature, expiry, wrong role each get their code."""

import time

import jwt
import pytest

from libbus.errors import AuthExpired, AuthInvalid, ConfigError, Forbidden
from libbus.security.auth import issue_token, verify_token
from libbus.wire.messages import BatchRequest, DatasetInfoRequest, ListJobs, SubmitJob, decode, encode

SECRET = b"k" * 40


def test_token_round_trip_carries_its_claims():
    token = issue_token(SECRET, sub="t1", role="trainer", audience="c", ttl_s=60, datasets=["mnist"])
    claims = verify_token(token, SECRET, audience="c")
    assert (claims.sub, claims.role, claims.aud) == ("t1", "trainer", "c")
    assert claims.scopes == {"datasets": ["mnist"]} and claims.jti and claims.exp > time.time()


@pytest.mark.parametrize(
    "token, error",
    [
        (lambda: issue_token(b"x" * 40, sub="t", role="trainer", audience="c"), AuthInvalid),  # other secret
        (lambda: issue_token(SECRET, sub="t", role="trainer", audience="other"), AuthInvalid),
        (
            lambda: jwt.encode(
                {"sub": "t", "role": "trainer", "aud": "c", "iss": "c", "iat": 0, "exp": 10, "jti": "j"},
                SECRET,
                algorithm="HS256",
            ),
            AuthExpired,
        ),
        (
            lambda: jwt.encode(
                {
                    "sub": "t",
                    "role": "trainer",
                    "aud": "c",
                    "iss": "c",
                    "iat": int(time.time()),
                    "exp": int(time.time()) + 60,
                    "jti": "j",
                },
                None,
                algorithm="none",
            ),
            AuthInvalid,
        ),
        (
            lambda: jwt.encode(
                {
                    "sub": "t",
                    "role": "root",
                    "aud": "c",
                    "iss": "c",
                    "iat": int(time.time()),
                    "exp": int(time.time()) + 60,
                    "jti": "j",
                },
                SECRET,
                algorithm="HS256",
            ),
            AuthInvalid,
        ),
        (lambda: "not.a.token", AuthInvalid),
    ],
)
def test_bad_tokens_are_refused_with_their_code(token, error):
    with pytest.raises(error):
        verify_token(token(), SECRET, audience="c")


def test_issuing_checks_role_and_ttl():
    with pytest.raises(ConfigError, match="unknown role"):
        issue_token(SECRET, sub="x", role="god", audience="c")
    with pytest.raises(ConfigError, match="positive"):
        issue_token(SECRET, sub="x", role="admin", audience="c", ttl_s=0)


# -- on real sockets ---------------------------------------------------------------------------


def test_request_without_hello_gets_auth_required(provider, raw_dealer):
    sock = raw_dealer(provider.endpoint)
    sock.send_multipart(encode(DatasetInfoRequest(id=5, dataset="mnist")))
    assert sock.poll(3000)
    reply = decode(sock.recv_multipart())
    assert (reply.type, reply.code, reply.id) == ("Error", "AUTH_REQUIRED", 5)


def test_bad_signature_gets_auth_invalid(provider, client_for, make_token):
    client = client_for(provider.endpoint, token=make_token(key=b"z" * 64))
    with pytest.raises(AuthInvalid):
        client.hello()


def test_expired_token_gets_auth_expired(provider, client_for, secret):
    expired = jwt.encode(
        {"sub": "t", "role": "trainer", "aud": "batchbus", "iss": "batchbus", "iat": 0, "exp": 100, "jti": "j"},
        secret,
        algorithm="HS256",
    )
    with pytest.raises(AuthExpired):
        client_for(provider.endpoint, token=expired).hello()


def test_token_expiring_during_a_session_is_refused(provider, client_for, make_token):
    client = client_for(provider.endpoint, token=make_token(ttl_s=1))
    client.request(DatasetInfoRequest(dataset="mnist"))
    minted = []
    renewing = client_for(provider.endpoint, token=lambda: minted.append(1) or make_token(ttl_s=1))
    renewing.request(DatasetInfoRequest(dataset="mnist"))
    time.sleep(7)  # ttl + the verifier's clock-skew leeway
    with pytest.raises(AuthExpired):
        client.request(DatasetInfoRequest(dataset="mnist"))
    with pytest.raises(AuthExpired):  # and again: until it says Hello with a fresh token
        client.request(DatasetInfoRequest(dataset="mnist"))
    # a client that mints its tokens (services, busctl) says Hello again with a fresh one
    assert renewing.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    assert len(minted) == 2


def test_wrong_role_is_forbidden(router, provider, client_for, make_token):
    trainer = client_for(router.endpoint, role="trainer")
    with pytest.raises(Forbidden, match="needs role admin"):
        trainer.request(SubmitJob(spec={"dataset": "mnist"}))
    # a provider token may not read batches from another provider
    other = client_for(provider.endpoint, role="provider")
    with pytest.raises(Forbidden):
        other.request(BatchRequest(dataset="mnist", split="train", range=[0, 2]))
    # claiming a role the token does not grant
    liar = client_for(router.endpoint, role="admin", token=make_token("trainer"))
    with pytest.raises(Forbidden, match="token grants"):
        liar.request(ListJobs())
    assert client_for(router.endpoint, role="admin").request(ListJobs()).jobs == []


def test_idle_session_is_renewed_transparently(provider, client_for):
    """A server that dropped an idle session answers AUTH_REQUIRED; the client says Hello again."""
    client = client_for(provider.endpoint)
    client.request(DatasetInfoRequest(dataset="mnist"))
    server = provider.service.server
    server.config.idle_session_s = 0.0
    deadline = time.monotonic() + 5
    while server.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.sessions
    server.config.idle_session_s = 300.0
    assert client.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    assert server.counters["error_AUTH_REQUIRED"] == 1
