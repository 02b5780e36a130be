"""An attempt holds only its job's grant.

The router mints, with each task, an ``attempt`` token scoped to that job and its dataset; the
attempt's process (a tenant's code) gets that and nothing that authenticates as its trainer. End to
end: a hostile entrypoint looks for its trainer's token in its settings and every environment it can
read, says Hello to the router as a trainer (its trainer's pid and host id) and asks for another
tenant's queued job, and reads that tenant's dataset: it gets nothing, while its own data reads.
Then, piece by piece, with real sockets: the router refuses an attempt's session, hands a grant with
each task and renews it only for the trainer holding the job; a provider serves a grant its job's
dataset and its job's evaluations, nothing else.
"""

from __future__ import annotations

import json
import time

import pytest

from libbus.connect.client import Client, Identity
from libbus.errors import ConfigError, Forbidden
from libbus.security.auth import issue_token, load_secret, verify_token
from libbus.wire.messages import DatasetInfoRequest, Evaluate, GetTask, Grant, RenewGrant, SubmitJob, Task
from services.trainer.grant import CREDENTIAL_VARIABLES, WITHHELD, GrantSource, withhold_environment
from services.trainer.service.attempt_settings import attempt_settings
from tests.support.jobs import EntryCluster

CLUSTER = "batchbus"


@pytest.mark.timeout(600)
def test_a_hostile_entrypoint_finds_no_trainer_credential_takes_no_job_and_reads_no_other_dataset(tmp_path):
    cluster = EntryCluster(tmp_path / "head")
    # the trainer's node: its own state folder, no secret; its token in a file of its own (one in the
    # state folder an attempt of the same uid could read: docs/security.md §4.1)
    node, creds = tmp_path / "gpu1", tmp_path / "creds"
    node.mkdir(mode=0o700)
    creds.mkdir(mode=0o700)
    try:
        cluster.start_router()
        secret = load_secret(cluster.state / "secret")
        token = issue_token(secret, sub="gpu1", role="trainer", audience=CLUSTER, ttl_s=3600)
        (creds / "token").write_text(token)
        (creds / "token").chmod(0o600)
        cluster.start(
            "provider",
            "provider",
            "--bind",
            "tcp://127.0.0.1:0",
            "--dataset",
            "mnist=mock://mnist?n=600",
            "--dataset",
            "private=mock://mnist?n=300",
            ready=True,
        )
        cluster.endpoint_of("provider")
        cluster.start(
            "gpu1",
            "trainer",
            env={
                "BATCHBUS_STATE_DIR": str(node),
                "BATCHBUS_TOKEN_FILE": str(creds / "token"),
                "BATCHBUS_TOKEN_ALG": "HS256",
            },
        )
        out, go = tmp_path / "hostile.json", tmp_path / "go"
        hostile = cluster.submit_spec(
            {
                "dataset": "mnist",
                "entrypoint": "tests.support.entrypoints:hostile",
                "params": {"out": str(out), "go": str(go), "victim": "private"},
                "max_attempts": 1,
                "evaluate": False,
            }
        )
        cluster.wait(hostile, lambda j: j["state"] == "running", timeout=120)
        # another tenant's job, queued while the hostile one runs on the only trainer
        victim = cluster.submit_spec(
            {
                "dataset": "private",
                "entrypoint": "tests.support.entrypoints:constant",
                "params": {"value": 1.0},
                "evaluate": False,
            }
        )
        go.write_text("")
        ended = cluster.wait_end(hostile, timeout=180)
        assert ended["state"] == "succeeded", f"{ended.get('error')}\n{cluster.logs()}"
        got = json.loads(out.read_text())
        assert got["credentials"] == [], got  # nothing in its settings or any environment it reads
        # its grant, as itself and as its trainer (with the trainer's pid and host id), refused at Hello
        asked = got["router"]
        assert len(asked) == 2 and all(line.split(": ")[1] == "refused Forbidden" for line in asked), asked
        assert "the router takes nothing from it" in asked[0] and "token grants 'attempt'" in asked[1], asked
        assert "Forbidden" in got["victim"], got["victim"]
        assert got["own_batches"] == 3  # its grant reads its own job's data
        # the victim's job was never taken by the hostile: the trainer runs it, once, after
        done = cluster.wait_end(victim, timeout=180)
        assert done["state"] == "succeeded", f"{done.get('error')}\n{cluster.logs()}"
        assert done.get("attempts") == 1, done
    finally:
        cluster.close()


def test_an_attempts_settings_and_environment_hold_no_credential():
    from libbus.config import Settings

    settings = Settings(state_dir="/srv/bb", token="eyJ.trainer.token", token_file="/srv/bb/token").resolved()
    given = attempt_settings(settings)
    assert given["token"] == given["token_file"] == ""
    assert given["secret_file"] == given["signing_key_file"] == WITHHELD
    again = Settings(**given)  # as the attempt builds them: the withheld paths stay withheld
    assert again.resolved().secret_file == WITHHELD and not again.resolved().token
    env = {"BATCHBUS_TOKEN": "t", "BATCHBUS_TOKEN_FILE": "/f", "CREDENTIALS_DIRECTORY": "/run/c", "PATH": "/bin"}
    assert sorted(withhold_environment(env)) == ["BATCHBUS_TOKEN", "BATCHBUS_TOKEN_FILE", "CREDENTIALS_DIRECTORY"]
    assert env == {"PATH": "/bin"}
    assert "BATCHBUS_SECRET_FILE" in CREDENTIAL_VARIABLES and "BATCHBUS_SIGNING_KEY_FILE" in CREDENTIAL_VARIABLES


def test_a_grant_is_renewed_through_the_trainer_and_only_an_attempts_token_for_its_job_is_taken():
    secret = b"s" * 32

    def grant(job: str = "j1", role: str = "attempt", ttl: float = 3600) -> str:
        return issue_token(secret, sub="gpu1", role=role, audience=CLUSTER, ttl_s=ttl, datasets=["mnist"], jobs=[job])

    with pytest.raises(ConfigError, match="no grant"):
        GrantSource("j1", "", lambda msg: Grant(token=""))
    with pytest.raises(ConfigError, match="not an attempt"):
        GrantSource("j1", grant(role="trainer"), lambda msg: Grant(token=""))
    with pytest.raises(ConfigError, match="not an attempt"):
        GrantSource("j1", grant(job="j2"), lambda msg: Grant(token=""))
    asked: list[RenewGrant] = []
    fresh = grant()
    source = GrantSource("j1", grant(ttl=1), lambda msg: asked.append(msg) or Grant(token=fresh))
    time.sleep(1.1)  # half of a one-second grant is spent
    assert source() == fresh and [m.job for m in asked] == ["j1"]
    assert source() == fresh and len(asked) == 1


def _client(router, token: str, role: str) -> Client:
    return Client(router.endpoint, Identity(role=role, name="gpu1", token=token), timeout_s=5, retries=0)


def test_the_router_opens_no_session_for_an_attempts_grant(router, make_token):
    grant = make_token(sub="gpu1", role="attempt", jobs=["j1"], datasets=["mnist"])
    # refused at Hello, not by GetTask's role (a session would count against its trainer's subject and
    # beat in its name): as itself, or claiming to be its trainer
    for role, why in (("attempt", "the router takes nothing from it"), ("trainer", "the token grants 'attempt'")):
        client = _client(router, grant, role)
        try:
            with pytest.raises(Forbidden, match=why):
                client.request(GetTask(key="k"))
        finally:
            client.close()


def test_a_task_carries_a_grant_for_its_job_renewed_only_for_the_trainer_holding_it(router, make_token, state_dir):
    admin = _client(router, make_token(sub="admin", role="admin"), "admin")
    trainer = _client(router, make_token(sub="gpu1"), "trainer")
    other = _client(router, make_token(sub="gpu2"), "trainer")
    try:
        job = admin.request(SubmitJob(spec={"dataset": "mnist", "model": "mlp"})).job
        task = trainer.request(GetTask(key="k1"))
        assert isinstance(task, Task) and task.job == job
        claims = verify_token(task.grant, load_secret(state_dir / "secret"), audience=CLUSTER)
        assert (claims.role, claims.sub) == ("attempt", "gpu1")
        assert claims.scopes == {"datasets": ["mnist"], "jobs": [job]}
        assert claims.exp - claims.iat <= 3600
        renewed = trainer.request(RenewGrant(job=job))
        assert verify_token(renewed.token, load_secret(state_dir / "secret"), audience=CLUSTER).scopes["jobs"] == [job]
        with pytest.raises(Forbidden, match="not running on gpu2"):
            other.request(RenewGrant(job=job))  # another trainer gets no grant for a job it does not hold
    finally:
        for client in (admin, trainer, other):
            client.close()


def test_a_provider_serves_a_grant_its_jobs_dataset_and_evaluations_only(start_provider, make_token):
    provider = start_provider("mnist=mock://mnist?n=200", "private=mock://mnist?n=200")
    grant = make_token(sub="gpu1", role="attempt", jobs=["j1"], datasets=["mnist"])
    client = Client(provider.endpoint, Identity(role="attempt", name="gpu1", token=grant), timeout_s=5, retries=0)
    try:
        assert client.request(DatasetInfoRequest(dataset="mnist")).dataset == "mnist"
        with pytest.raises(Forbidden, match="outside this token's datasets scope"):
            client.request(DatasetInfoRequest(dataset="private"))
        weights = Evaluate(dataset="mnist", model={"name": "mlp"}, job="")
        weights.frames = [b"\0" * 16]
        with pytest.raises(Forbidden, match="its own job only"):
            client.request(weights)
        weights.job = "j2"
        with pytest.raises(Forbidden, match="outside this token's jobs scope"):
            client.request(weights)
    finally:
        client.close()
