"""EdDSA tokens, pinned algorithms, issuer/nbf/exp checks and dataset/job scopes, on real sockets.

The cluster here runs with ``token_alg = "EdDSA"``: router and provider hold only the public key
(their ``signing_key_file`` does not exist); tokens are minted with the administrator's key.
"""

import base64
import hashlib
import hmac
import json
import os
import time

import jwt
import pytest

from libbus.errors import AuthExpired, AuthInvalid, ConfigError, Forbidden
from libbus.security.auth import Claims, generate_signing_key, issue_token, load_signing_key, verify_token
from libbus.wire.messages import (
    AttachRing,
    BatchRequest,
    ControlJob,
    DatasetInfoRequest,
    Evaluate,
    GetJob,
    ListJobs,
    Progress,
    PushResult,
    Resolve,
    SubmitJob,
)
from services import credentials
from tests.support import CLUSTER, busctl


@pytest.fixture
def admin_keys(tmp_path):
    """The administrator's key pair, outside the nodes' state directory."""
    return generate_signing_key(tmp_path / "admin" / "token.key")


@pytest.fixture
def sign(admin_keys):
    private = load_signing_key(admin_keys[0])

    def make(role="trainer", sub="test", **kw):
        return issue_token(private, sub=sub, role=role, audience=CLUSTER, algorithm="EdDSA", **kw)

    return make


@pytest.fixture
def make_settings(make_settings, admin_keys, sign, tmp_path):
    """Every service of these tests runs an EdDSA cluster and holds only the public key."""

    def make(**flags):
        flags.setdefault("token_alg", "EdDSA")
        flags.setdefault("public_key_file", str(admin_keys[1]))
        flags.setdefault("signing_key_file", str(tmp_path / "not-on-this-node.key"))
        if "datasets" in flags:  # a provider: it registers with a token the administrator issued
            flags.setdefault("token", sign("provider", sub="provider-test"))
        return make_settings(**flags)

    return make


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _forge(header: dict, claims: dict, sign_with=None) -> str:
    """A token built by hand, as an attacker would: HS256 over ``sign_with``, or no signature."""
    head = _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(claims).encode())
    sig = b"" if sign_with is None else hmac.new(sign_with, head.encode(), hashlib.sha256).digest()
    return head + "." + _b64(sig)


def _claims(**over):
    now = int(time.time())
    return {
        "sub": "mallory",
        "role": "admin",
        "aud": CLUSTER,
        "iss": CLUSTER,
        "iat": now,
        "nbf": now,
        "exp": now + 600,
        "jti": "j1",
        **over,
    }


# -- the cluster works with only the public key -----------------------------------------------


def test_eddsa_cluster_end_to_end(router, start_provider, client_for, sign):
    provider = start_provider("mnist=mock://mnist?n=600")
    trainer = client_for(router.endpoint, token=sign("trainer"))
    resolved = trainer.request(Resolve(dataset="mnist"))
    assert resolved.providers[0]["endpoint"] == provider.endpoint
    data = client_for(provider.endpoint, token=sign("trainer"))
    assert data.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    assert data.request(BatchRequest(dataset="mnist", split="train", range=[0, 4])).shapes[0][0] == 4
    admin = client_for(router.endpoint, role="admin", token=sign("admin"))
    assert admin.request(ListJobs()).jobs == []
    claims = provider.service.server.sessions[next(iter(provider.service.server.sessions))].claims
    assert (claims.iss, claims.role) == (CLUSTER, "trainer")


# -- refusals -----------------------------------------------------------------------------------


def test_hs256_token_is_refused_by_an_eddsa_cluster(router, client_for, make_token):
    # make_token signs with the (still present) HS256 cluster secret: a valid token of the wrong kind,
    # refused at the connection handshake (the router logs why: "accepts only EdDSA")
    with pytest.raises(AuthInvalid, match="refused this connection at the handshake"):
        client_for(router.endpoint, token=make_token("trainer")).hello()


def test_algorithm_confusion_token_is_refused(router, client_for, admin_keys):
    """HS256 'signed' with the public key as the HMAC secret: a verifier that let the token pick
    its algorithm would check it with the public key bytes, which everyone has."""
    public_pem = admin_keys[1].read_bytes()
    forged = _forge({"alg": "HS256", "typ": "JWT"}, _claims(), sign_with=public_pem)
    with pytest.raises(AuthInvalid, match="refused this connection at the handshake"):
        client_for(router.endpoint, role="admin", token=forged).hello()
    # and the library's own check, even without the header pre-check, pins EdDSA
    with pytest.raises(AuthInvalid):
        verify_token(forged, load_signing_key(admin_keys[0]).public_key(), audience=CLUSTER, algorithm="EdDSA")


@pytest.mark.parametrize("header", [{"alg": "none", "typ": "JWT"}, {"alg": "None"}, {"typ": "JWT"}])
def test_unsigned_token_is_refused(router, client_for, header):
    with pytest.raises(AuthInvalid):
        client_for(router.endpoint, role="admin", token=_forge(header, _claims())).hello()


def test_token_not_yet_valid_is_refused(router, client_for, admin_keys):
    now = int(time.time())
    early = jwt.encode(_claims(role="trainer", nbf=now + 3600), load_signing_key(admin_keys[0]), algorithm="EdDSA")
    with pytest.raises(AuthInvalid, match="not valid yet"):
        client_for(router.endpoint, token=early).hello()


def test_expired_token_is_refused(router, client_for, admin_keys):
    now = int(time.time())
    old = jwt.encode(
        _claims(role="trainer", iat=now - 7200, nbf=now - 7200, exp=now - 3600),
        load_signing_key(admin_keys[0]),
        algorithm="EdDSA",
    )
    with pytest.raises(AuthExpired):
        client_for(router.endpoint, token=old).hello()


def test_skew_within_the_leeway_is_accepted(router, client_for, admin_keys):
    now = int(time.time())
    token = jwt.encode(_claims(role="trainer", nbf=now + 2), load_signing_key(admin_keys[0]), algorithm="EdDSA")
    client_for(router.endpoint, token=token).hello()


def test_other_issuer_and_bad_scope_claims_are_refused(admin_keys):
    key = load_signing_key(admin_keys[0])
    public = key.public_key()
    other = issue_token(key, sub="t", role="trainer", audience=CLUSTER, issuer="someone-else", algorithm="EdDSA")
    with pytest.raises(AuthInvalid, match="issuer"):
        verify_token(other, public, audience=CLUSTER, algorithm="EdDSA")
    loose = jwt.encode(_claims(datasets="mnist"), key, algorithm="EdDSA")  # a string, not a list
    with pytest.raises(AuthInvalid, match="list of strings"):
        verify_token(loose, public, audience=CLUSTER, algorithm="EdDSA")
    # an EdDSA token to an HS256 verifier is refused as well
    with pytest.raises(AuthInvalid, match="accepts only HS256"):
        verify_token(
            issue_token(key, sub="t", role="trainer", audience=CLUSTER, algorithm="EdDSA"), b"s" * 40, audience=CLUSTER
        )


def test_node_without_token_or_signing_key_says_what_to_do(make_settings):
    settings = make_settings(token="")
    with pytest.raises(ConfigError, match="no signing key.*--token"):
        credentials.token_source(settings, "provider", "p1")


# -- scopes -------------------------------------------------------------------------------------


def test_claims_scope_checks():
    free = Claims(sub="a", role="trainer", aud="c", exp=0, iat=0, jti="j")
    scoped = Claims(sub="a", role="trainer", aud="c", exp=0, iat=0, jti="j", scopes={"datasets": ["mnist"], "jobs": []})
    assert free.allows_dataset("x") and free.allows_job("j1")
    assert scoped.allows_dataset("mnist") and not scoped.allows_dataset("zeros")
    assert not scoped.allows_job("j1")  # an empty scope allows nothing


def test_dataset_scope_on_the_provider(start_provider, client_for, sign):
    provider = start_provider("mnist=mock://mnist?n=600", "zeros=dummy://?shape=2,3&n=100&classes=4")
    client = client_for(provider.endpoint, token=sign("trainer", datasets=["mnist"]))
    assert client.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    assert client.request(BatchRequest(dataset="mnist", split="train", range=[0, 2])).shapes[0][0] == 2
    for msg in (
        DatasetInfoRequest(dataset="zeros"),
        BatchRequest(dataset="zeros", split="train", range=[0, 2]),
        Evaluate(dataset="zeros", model={"name": "mlp"}, frames=[b"x"]),
    ):
        with pytest.raises(Forbidden, match=r"dataset 'zeros' is outside this token's datasets scope \[mnist\]"):
            client.request(msg)
    nothing_here = client_for(provider.endpoint, token=sign("trainer", datasets=["cifar10"]))
    with pytest.raises(Forbidden, match="covers none of the datasets served here"):
        nothing_here.request(AttachRing(name="bb-x", slots=2, slot_bytes=64, label_offset=32))
    assert provider.service.handler.refused["scope"] == 4


def test_dataset_and_job_scopes_on_the_router(router, start_provider, client_for, sign):
    start_provider("mnist=mock://mnist?n=600", "zeros=dummy://?shape=2,3&n=100&classes=4")
    trainer = client_for(router.endpoint, token=sign("trainer", datasets=["mnist"]))
    assert trainer.request(Resolve(dataset="remote://mnist")).dataset == "mnist"
    with pytest.raises(Forbidden, match="'zeros' is outside"):
        trainer.request(Resolve(dataset="zeros"))

    admin = client_for(router.endpoint, role="admin", token=sign("admin"))
    j1 = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    j2 = admin.request(SubmitJob(spec={"dataset": "zeros"})).job
    mnist_admin = client_for(router.endpoint, role="admin", token=sign("admin", datasets=["mnist"]))
    assert mnist_admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    with pytest.raises(Forbidden, match="'zeros' is outside"):
        mnist_admin.request(SubmitJob(spec={"dataset": "zeros"}))

    one_job = client_for(router.endpoint, role="admin", token=sign("admin", jobs=[j1]))
    assert one_job.request(GetJob(job=j1)).job["id"] == j1
    assert [j["id"] for j in one_job.request(ListJobs()).jobs] == [j1]
    with pytest.raises(Forbidden, match=f"job '{j2}' is outside this token's jobs scope \\[{j1}\\]"):
        one_job.request(GetJob(job=j2))
    with pytest.raises(Forbidden, match="jobs scope"):
        one_job.request(ControlJob(job=j2, command="stop"))

    scoped_trainer = client_for(router.endpoint, token=sign("trainer", jobs=[j1]))
    for msg in (Progress(job=j2, progress={}), PushResult(job=j2, state="failed", error="x")):
        with pytest.raises(Forbidden, match="jobs scope"):
            scoped_trainer.request(msg)


# -- keys and the command line -----------------------------------------------------------------


def test_signing_key_is_0600_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        key, pub = generate_signing_key(tmp_path / "k" / "token.key")
        out = busctl("token", "keygen", str(tmp_path / "cli.key"))
    finally:
        os.umask(old)
    assert key.stat().st_mode & 0o777 == 0o600 and pub.exists()
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cli.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "cli.key.pub").exists()
    with pytest.raises(ConfigError, match="already exists"):
        generate_signing_key(key)


def test_busctl_issues_scoped_eddsa_tokens_and_inspects_them(tmp_path, admin_keys):
    env = {
        "BATCHBUS_STATE_DIR": str(tmp_path / "node"),
        "BATCHBUS_TOKEN_ALG": "EdDSA",
        "BATCHBUS_SIGNING_KEY_FILE": str(admin_keys[0]),
    }
    out = busctl(
        "token",
        "issue",
        "--role",
        "trainer",
        "--name",
        "t1",
        "--dataset",
        "mnist",
        "--dataset",
        "cifar10",
        "--job",
        "j1",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    claims = verify_token(token, load_signing_key(admin_keys[0]).public_key(), audience=CLUSTER, algorithm="EdDSA")
    assert claims.scopes == {"datasets": ["mnist", "cifar10"], "jobs": ["j1"]} and claims.iss == CLUSTER

    shown = busctl(
        "token",
        "inspect",
        token,
        "--public-key-file",
        str(admin_keys[1]),
        env={**env, "BATCHBUS_SIGNING_KEY_FILE": str(tmp_path / "absent")},
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("VERIFIED") and "datasets: ['mnist', 'cifar10']" in shown.stdout
    unverified = busctl("token", "inspect", token, env={**env, "BATCHBUS_SIGNING_KEY_FILE": str(tmp_path / "absent")})
    assert unverified.returncode == 0 and unverified.stdout.startswith("UNVERIFIED")
    garbage = busctl("token", "inspect", "not-a-token", env=env)
    assert garbage.returncode != 0 and "Traceback" not in garbage.stderr and "not a token" in garbage.stderr
    no_key = busctl(
        "token", "issue", "--role", "admin", env={**env, "BATCHBUS_SIGNING_KEY_FILE": str(tmp_path / "absent")}
    )
    assert no_key.returncode != 0 and "Traceback" not in no_key.stderr and "signing key" in no_key.stderr
