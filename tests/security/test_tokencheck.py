"""A token's signature is verified once, and every check that depends on time or revocation still
runs at every use (libbus/security/tokencheck.py): what a kept token must not let through."""

import time

import jwt
import pytest

from libbus.errors import AuthExpired, AuthInvalid
from libbus.security.auth import LEEWAY_S
from libbus.security.tokencheck import TokenCheck
from tests.support import CLUSTER


def _check(secret: bytes, keep: int = 64) -> TokenCheck:
    return TokenCheck(secret, audience=CLUSTER, issuer=None, algorithm="HS256", keep=keep)


def _raw(secret: bytes, **claims) -> str:
    now = int(time.time())
    body = {"sub": "t", "role": "trainer", "aud": CLUSTER, "iss": CLUSTER, "iat": now, "exp": now + 600, "jti": "j1"}
    return jwt.encode({**body, **claims}, secret, algorithm="HS256")


def test_a_connection_verifies_its_token_once(router, client_for, make_token):
    """The handshake verifies the token; Hello and a second connection with it find it kept."""
    tokens = router.service.server.tokens
    before = tokens.verifications
    token = make_token("trainer", sub="once")
    client_for(router.endpoint, token=token).hello()
    assert tokens.verifications == before + 1
    client_for(router.endpoint, token=token).hello()  # another connection, the same token
    assert tokens.verifications == before + 1
    client_for(router.endpoint, token=make_token("trainer", sub="other")).hello()
    assert tokens.verifications == before + 2


def test_a_kept_token_expires_on_time(secret):
    """Kept at the handshake, refused at Hello and at the handshake once past ``exp`` and the leeway."""
    check = _check(secret)
    token = _raw(secret, exp=int(time.time()) - LEEWAY_S + 1)
    assert check.hello(token).sub == "t"  # within the leeway: accepted, and kept
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            check.hello(token)
        except AuthExpired:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a kept token was still accepted after it expired")
    with pytest.raises(AuthExpired):  # and at the handshake: an expired token proves nothing
        check.handshake(token)
    assert check.verifications == 1


def test_a_token_not_yet_valid_is_kept_but_refused_at_hello(secret):
    check = _check(secret)
    early = _raw(secret, nbf=int(time.time()) + 3600)
    assert check.handshake(early) == "t"
    with pytest.raises(AuthInvalid, match="not valid yet"):
        check.hello(early)
    with pytest.raises(AuthInvalid, match="Not Before"):
        check.hello(_raw(secret, nbf="soon"))


def test_revocation_reaches_kept_tokens(secret):
    check = _check(secret)
    token = _raw(secret, jti="gone")
    check.hello(token)
    check.set_revoked(["gone"])
    for call in (check.hello, check.handshake):
        with pytest.raises(AuthInvalid, match="revoked"):
            call(token)


def test_an_altered_token_is_verified_and_refused_while_the_genuine_one_is_kept(secret):
    check = _check(secret)
    token = _raw(secret)
    check.hello(token)
    head, body, sig = token.split(".")
    forged_sig = f"{head}.{body}.{sig[:-2]}{'AA' if sig[-2:] != 'AA' else 'BB'}"
    other = _raw(secret, role="admin")
    forged_body = f"{head}.{other.split('.')[1]}.{sig}"  # an admin's claims under the trainer's signature
    for forged in (forged_sig, forged_body, token + " "):
        with pytest.raises(AuthInvalid):
            check.hello(forged)
    with pytest.raises(AuthInvalid):
        check.hello(_raw(b"not-this-cluster-secret-0123456789"))
    assert check.kept == 1  # nothing refused was kept: each refusal was a verification anew


def test_at_most_keep_tokens_are_kept(secret):
    check = _check(secret, keep=3)
    tokens = [_raw(secret, sub=f"t{i}", jti=f"j{i}") for i in range(5)]
    for token in tokens:
        check.hello(token)
    assert check.kept == 3
    assert [check.hello(t).sub for t in tokens] == [f"t{i}" for i in range(5)]  # forgotten ones verified again
