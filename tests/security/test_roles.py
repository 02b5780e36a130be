"""Who may do what: a reader token reads its datasets and nothing else; on the default
set-up no trainer node holds anything that mints a token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import pytest
import torch
from cryptography.hazmat.primitives import serialization

from libbus.connect.client import Client, Identity
from libbus.errors import AuthInvalid, Forbidden
from libbus.loader.remote import RemoteLoader
from libbus.security.auth import issue_token, load_signing_key, load_token_public_key, verify_token
from libbus.wire.messages import Evaluate, GetJob, GetTask, ListJobs, Progress, PushResult, SubmitJob
from tests.support import CLUSTER, Cluster, busctl, wait_file


def _loader_client(endpoint: str, token: str, role: str = "reader", loader: bool = True) -> Client:
    caps = {"loader": True} if loader else {}
    return Client(endpoint, Identity(role=role, name="script", token=token, caps=caps), timeout_s=5.0, retries=0)


def test_a_reader_token_takes_no_job_and_pushes_nothing(router, start_provider, client_for, make_token):
    start_provider("mnist=mock://mnist?n=600", assigned_only=True)
    admin = client_for(router.endpoint, "admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
    reader = make_token("reader", sub="alice", datasets=["mnist"])

    script = _loader_client(router.endpoint, reader)
    try:
        for msg in (
            GetTask(),
            Progress(job=job, progress={"epoch": 1, "test_accuracy": 1.0}),
            PushResult(job=job, state="succeeded", result={"test_accuracy": 1.0}),
        ):
            with pytest.raises(Forbidden):
                script.request(msg)
    finally:
        script.close()
    # Without caps.loader it is not let in at all: a reader never acts as a trainer service.
    service = _loader_client(router.endpoint, reader, loader=False)
    try:
        with pytest.raises(Forbidden, match="loader sessions only"):
            service.request(GetTask())
    finally:
        service.close()
    assert admin.request(GetJob(job=job)).job["state"] == "queued"  # still there for a real trainer


def test_a_reader_token_trains_on_its_dataset_and_reads_no_other(router, start_provider, make_token):
    provider = start_provider(
        "mnist=mock://mnist?n=600", "zeros=dummy://?shape=2,3&n=100&classes=4", assigned_only=True
    )
    reader = make_token("reader", sub="alice", datasets=["mnist"])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with RemoteLoader("mnist", router=router.endpoint, token=reader, batch_size=60, seed=1) as loader:
        for _ in range(3):
            total = 0.0
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y.long())
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach())
            losses.append(total / len(loader))
    assert losses[-1] < 0.5 * losses[0], losses  # it learned from what the provider sent a reader

    with pytest.raises(Forbidden, match="scope"):
        with RemoteLoader("zeros", router=router.endpoint, token=reader, batch_size=10) as other:
            next(iter(other))
    # Evaluations are the trainer service's (the test split's scores): a reader is refused them.
    script = _loader_client(provider.endpoint, reader)
    try:
        with pytest.raises(Forbidden):
            script.request(Evaluate(dataset="mnist", model={"name": "mlp"}, frames=[b"\0" * 8]))
    finally:
        script.close()


def test_a_trainer_token_still_opens_loader_sessions(router, start_provider, make_token):
    start_provider("mnist=mock://mnist?n=600", assigned_only=False)
    with RemoteLoader("mnist", router=router.endpoint, token=make_token("trainer"), batch_size=100) as loader:
        assert sum(1 for _ in loader) == len(loader) > 0


def test_busctl_issues_reader_tokens(state_dir):
    from libbus.security.auth import load_secret

    out = busctl("token", "issue", "--role", "reader", "--dataset", "mnist", "--state-dir", str(state_dir), check=True)
    claims = verify_token(out.stdout.strip(), load_secret(state_dir / "secret"), audience=CLUSTER)
    assert claims.role == "reader" and claims.scopes["datasets"] == ["mnist"]


# -- on the default set-up no trainer holds what makes an admin ----------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _hs256(key: bytes, claims: dict) -> str:
    """An HS256 token keyed with ``key`` (any bytes: PyJWT refuses PEM keys as HMAC secrets, an attacker does not)."""
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + _b64(json.dumps(claims).encode())
    return head + "." + _b64(hmac.new(key, head.encode(), hashlib.sha256).digest())


def _admin_claims() -> dict:
    now = int(time.time())
    return {
        "sub": "mallory",
        "role": "admin",
        "aud": CLUSTER,
        "iss": CLUSTER,
        "iat": now,
        "nbf": now,
        "exp": now + 600,
        "jti": "forged",
    }


def test_on_the_default_set_up_a_trainer_node_holds_nothing_that_mints(tmp_path):
    head, gpu, data = tmp_path / "head", tmp_path / "gpu1", tmp_path / "data1"
    cluster = Cluster(head)  # busctl on the administrator's machine: BATCHBUS_STATE_DIR=head
    try:
        # The router's first start on a fresh machine makes the key pair: no secret anywhere.
        cluster.spawn("router", "start", "router", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(head / "r.ep"))
        endpoint = wait_file(head / "r.ep", [cluster.procs["router"]])
        assert (head / "token.key").stat().st_mode & 0o777 == 0o600 and (head / "token.pub").exists()
        assert not (head / "secret").exists()
        # Each node gets the public key and its own role's token; it starts from those files alone.
        cluster.busctl("token", "node", str(gpu), "--role", "trainer", "--name", "gpu1", check=True)
        cluster.busctl("token", "node", str(data), "--role", "provider", "--name", "data1", check=True)
        assert sorted(p.name for p in gpu.iterdir()) == ["token", "token.pub"]
        for name, node, args in (
            ("data1", data, ["provider", "--dataset", "mnist=mock://mnist?n=300", "--bind", "tcp://127.0.0.1:0"]),
            ("gpu1", gpu, ["trainer"]),
        ):
            node_env = {
                "BATCHBUS_STATE_DIR": str(node),
                "BATCHBUS_TOKEN_FILE": str(node / "token"),
                "BATCHBUS_ROUTER": endpoint,
            }
            cluster.spawn(name, "start", *args[:1], "--name", name, *args[1:], env=node_env)
        key = load_signing_key(head / "token.key")
        admin = Client(
            endpoint,
            Identity(
                role="admin",
                name="admin",
                token=issue_token(key, sub="admin", role="admin", audience=CLUSTER, algorithm="EdDSA"),
            ),
            timeout_s=10,
            retries=2,
        )
        cluster.admin = admin
        job = cluster.submit_spec({"dataset": "mnist", "epochs": 1, "batch_size": 50})
        assert cluster.wait_end(job, timeout=120)["state"] == "succeeded"  # the set-up trains

        # Nothing on the trainer node (after it ran) mints a token the router takes: no file is a
        # signing key, and an admin token keyed (HS256) with any file's bytes is refused.
        files = [p for p in gpu.rglob("*") if p.is_file()]
        assert files and not any(p.name == "secret" for p in files)
        for path in files:
            raw = path.read_bytes()
            with pytest.raises((ValueError, TypeError)):
                serialization.load_pem_private_key(raw, password=None)
            for secret in {raw, raw.strip()}:
                forged = Client(
                    endpoint,
                    Identity(role="admin", name="mallory", token=_hs256(secret, _admin_claims())),
                    timeout_s=5,
                    retries=0,
                )
                try:
                    with pytest.raises(AuthInvalid):
                        forged.request(ListJobs())
                finally:
                    forged.close()
        # Its own token is a trainer's: not an admin's, and its signature covers no other claims.
        token = (gpu / "token").read_text().strip()
        as_admin = Client(endpoint, Identity(role="admin", name="gpu1", token=token), timeout_s=5, retries=0)
        try:
            with pytest.raises(Forbidden):
                as_admin.request(ListJobs())
        finally:
            as_admin.close()
        head_b64, _, sig = token.split(".")
        tampered = head_b64 + "." + _b64(json.dumps({**_admin_claims(), "sub": "gpu1"}).encode()) + "." + sig
        with pytest.raises(AuthInvalid):
            verify_token(tampered, load_token_public_key(gpu / "token.pub"), audience=CLUSTER, algorithm="EdDSA")
        # Without its token the node has nothing to start with: it says so, and mints nothing.
        out = cluster.busctl(
            "start",
            "trainer",
            "--name",
            "gpu2",
            check=False,
            timeout=60,
            env={"BATCHBUS_STATE_DIR": str(gpu), "BATCHBUS_ROUTER": endpoint},
        )
        assert out.returncode == 2 and "no signing key" in out.stderr
    finally:
        if cluster.admin is not None:
            cluster.admin.close()
        cluster.close()


def test_hs256_stays_for_one_machine_when_chosen(tmp_path):
    """A node whose state holds the secret (busctl token secret) and no EdDSA key runs HS256; an explicit
    token_alg wins over what files are there."""
    from libbus.config import load_settings

    busctl("token", "secret", str(tmp_path / "secret"), check=True)
    settings, sources = load_settings(env={"BATCHBUS_STATE_DIR": str(tmp_path)})
    assert settings.token_alg == "HS256" and "secret file" in sources["token_alg"]
    settings, _ = load_settings(env={"BATCHBUS_STATE_DIR": str(tmp_path), "BATCHBUS_TOKEN_ALG": "EdDSA"})
    assert settings.token_alg == "EdDSA"
    fresh, sources = load_settings(env={"BATCHBUS_STATE_DIR": str(tmp_path / "fresh")})
    assert fresh.token_alg == "EdDSA" and sources["token_alg"] == "default (no secret file)"
