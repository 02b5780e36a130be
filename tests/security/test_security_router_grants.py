"""Nobody reaches past their grant on the router: what each audit
probe did, done again on a real router, provider and trainers over loopback, with scoped tokens
("admin[mnist]": an admin token limited to dataset mnist), showing the refusal or the bound."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from libbus.connect.client import Identity
from libbus.connect.link import Link
from libbus.errors import AuthInvalid, BadRequest, Forbidden, RateLimited
from libbus.security.auth import inspect_token
from libbus.wire.messages import (
    BatchRequest,
    CommandAck,
    ControlJob,
    DatasetInfoRequest,
    GetJob,
    GetModel,
    GetStudy,
    GetTask,
    ListJobs,
    ListRevoked,
    ListStudies,
    NoTask,
    Ok,
    Progress,
    PushResult,
    RevokeToken,
    Stats,
    StopStudy,
    SubmitJob,
    SubmitStudy,
)
from services.router.store import PROGRESS_BYTES_KEPT, REASON_CHARS
from services.router.studies import START_PER_STEP
from services.router.study_spec import MAX_CONCURRENT, MAX_TRIALS
from tests.support.busctl import busctl

MNIST = "mock://mnist?n=600"


def admin_of(client_for, router, make_token, sub: str, name: str = "", **scopes):
    """An admin client whose token has subject ``sub`` and ``scopes``; ``name`` is its Hello.name."""
    c = client_for(router.endpoint, role="admin", token=make_token("admin", sub=sub, **scopes))
    c.identity.name = name or sub
    return c


def trainer_of(client_for, router, make_token, sub: str, **scopes):
    c = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub=sub, **scopes))
    c.identity.name = sub
    return c


def succeeded_with_model(admin, trainer, dataset: str, weights: bytes) -> str:
    """A job on ``dataset`` that ``trainer`` took and ended with ``weights`` kept by the router."""
    job = admin.request(SubmitJob(spec={"dataset": dataset, "epochs": 1})).job
    assert trainer.request(GetTask()).job == job
    digest = hashlib.sha256(weights).hexdigest()
    trainer.request(PushResult(job=job, state="succeeded", result={"model": {"sha256": digest}}, frames=[weights]))
    return job


def jti_of(token: str) -> str:
    return inspect_token(token)[1]["jti"]


# -- an evaluate task's model_from ------------------------------------------------------


def test_an_evaluate_task_may_name_only_a_model_its_submitter_may_read(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    weights = b"the other team's weights"
    other_job = succeeded_with_model(admin, trainer_of(client_for, router, make_token, "t-other"), "other", weights)
    scoped = admin_of(client_for, router, make_token, "a-mnist", datasets=["mnist"])
    with pytest.raises(Forbidden, match="'other' is outside this token's datasets scope"):
        scoped.request(GetModel(job=other_job))
    evaluate = {"task": "evaluate", "dataset": "mnist", "model_from": other_job, "split": "val"}
    with pytest.raises(Forbidden, match="'other' is outside this token's datasets scope"):
        scoped.request(SubmitJob(spec=evaluate))  # what the probe did: the task would carry the weights
    jobs_scoped = admin_of(client_for, router, make_token, "a-jobs", jobs=["jnothing"])
    with pytest.raises(Forbidden, match=f"job '{other_job}' is outside this token's jobs scope"):
        jobs_scoped.request(SubmitJob(spec=evaluate))
    # nothing was queued: a trainer[mnist] is handed no task carrying those bytes
    reader = trainer_of(client_for, router, make_token, "t-mnist", datasets=["mnist"])
    assert isinstance(reader.request(GetTask()), NoTask)
    assert [j["id"] for j in scoped.request(ListJobs()).jobs] == []
    # an admin whose scope covers the model may still score it (the check refuses only reach)
    job = admin.request(SubmitJob(spec=evaluate)).job
    task = reader.request(GetTask())
    assert task.job == job and bytes(task.frames[0].buffer) == weights


# -- revocations ------------------------------------------------------------------------


def test_thousands_of_revocations_by_a_scoped_admin_leave_assignments_working(
    router, start_provider, client_for, make_token
):
    provider = start_provider("mnist=" + MNIST, "other=" + MNIST, assigned_only=True)
    admin = client_for(router.endpoint, role="admin")
    admin_a = admin_of(client_for, router, make_token, "admin-a", datasets=["mnist"])
    refused = 0
    for i in range(3000):  # the probe's flood: ids the router has never seen, expiry 1e12
        try:
            admin_a.request(RevokeToken(jti=f"junk-{i:05d}", exp=1e12))
        except Forbidden as err:
            assert "not in use here" in str(err)
            refused += 1
    assert refused == 3000 and admin.request(ListRevoked()).revoked == []

    # a scoped admin revokes a live token inside its scope, until that token's own expiry
    inside = make_token("trainer", sub="t-inside", datasets=["mnist"])
    trainer_of(client_for, router, make_token, "t-inside").close()
    live = client_for(router.endpoint, token=inside)
    live.hello()
    done = admin_a.request(RevokeToken(jti=jti_of(inside), exp=1e12, reason="left the team"))
    assert done.detail["until"] == inspect_token(inside)[1]["exp"]
    for sub, scopes, why in (("t-other", {"datasets": ["other"]}, "other"), ("t-all", {}, "every datasets")):
        token = make_token("trainer", sub=sub, **scopes)
        client_for(router.endpoint, token=token).hello()
        with pytest.raises(Forbidden, match=f"reaches {why} beyond this administrator's datasets scope"):
            admin_a.request(RevokeToken(jti=jti_of(token), exp=1e12))
    router.service.handler.revocations.scoped_limit = 1  # its one revocation is its share now
    second = make_token("trainer", sub="t-inside-2", datasets=["mnist"])
    client_for(router.endpoint, token=second).hello()
    with pytest.raises(RateLimited, match="the most a dataset- or job-limited administrator may have"):
        admin_a.request(RevokeToken(jti=jti_of(second), exp=1e12))

    # an unrestricted admin: any id, but no expiry past the longest token lifetime, and a cap in all
    with pytest.raises(BadRequest, match="at most 366 days from now"):
        admin.request(RevokeToken(jti="far", exp=1e12))
    router.service.handler.revocations.limit = 40
    for i in range(39):
        admin.request(RevokeToken(jti="x" * 100 + f"{i:03d}", exp=time.time() + 3600, reason="r" * 1000))
    with pytest.raises(RateLimited, match="at most 40 unexpired revocations"):
        admin.request(RevokeToken(jti="one-too-many", exp=time.time() + 3600))
    listed = admin.request(ListRevoked()).revoked
    assert len(listed) == 40 and all(len(r["reason"]) <= 200 for r in listed)
    assert [r["jti"] for r in admin_a.request(ListRevoked()).revoked] == [jti_of(inside)]  # its own only

    # what the flood broke: an assigned trainer still reads its job's dataset; the push that tells the
    # provider of it carries what changed (the assignment), not the unchanged revocation list again
    pushes: list = []
    handler = router.service.handler
    original_push = handler.push

    def recording(sid, msg):
        if type(msg).__name__ == "Entitlements":
            pushes.append(msg)
        return original_push(sid, msg)

    handler.push = recording
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
    t1 = make_token("trainer", sub="t1")
    assert trainer_of(client_for, router, make_token, "t1").request(GetTask()).job == job
    reader = client_for(provider.endpoint, token=t1, timeout_s=8.0)
    assert reader.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    assert reader.request(BatchRequest(dataset="mnist", split="train", range=[0, 2])).shapes
    with pytest.raises(AuthInvalid, match="refused this connection at the handshake"):  # the provider heard
        client_for(provider.endpoint, token=inside, timeout_s=8.0).request(DatasetInfoRequest(dataset="mnist"))
    granted = [p for p in pushes if "t1" in p.assigned.get("mnist", [])]
    assert granted and all(p.revoked is None for p in granted), pushes


# -- studies and the dataset scope ------------------------------------------------------


def study(dataset: str, **settings) -> dict:
    return {
        "base": {"dataset": dataset, "epochs": 1},
        "space": {"lr": {"log_uniform": [1e-3, 1e-1]}},
        "study": {"trials": 2, "concurrent": 1, "sampler": "random", **settings},
    }


def test_studies_keep_to_the_dataset_scope_and_audits_name_the_subject(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    other = admin.request(SubmitStudy(spec=study("other"))).study["id"]
    scoped = admin_of(client_for, router, make_token, "a-mnist", name="root", datasets=["mnist"])
    mine = scoped.request(SubmitStudy(spec=study("mnist"))).study["id"]
    assert [s["id"] for s in scoped.request(ListStudies()).studies] == [mine]
    assert {s["id"] for s in admin.request(ListStudies()).studies} == {mine, other}
    with pytest.raises(Forbidden, match="'other' is outside"):
        scoped.request(GetStudy(study=other))
    with pytest.raises(Forbidden, match="'other' is outside"):
        scoped.request(StopStudy(study=other))
    with pytest.raises(Forbidden, match="'other' is outside"):
        scoped.request(SubmitStudy(spec=study("other")))
    jobs_scoped = admin_of(client_for, router, make_token, "a-jobs", jobs=["jx"])
    assert jobs_scoped.request(ListStudies()).studies == []
    with pytest.raises(Forbidden, match="limited to jobs cannot submit or see studies"):
        jobs_scoped.request(GetStudy(study=mine))
    assert admin.request(GetStudy(study=other)).study["state"] == "running"  # untouched
    scoped.request(StopStudy(study=mine))
    info = admin.request(GetStudy(study=mine)).study
    assert info["reason"] == "stopped by a-mnist"  # the token's subject, not Hello.name "root"
    trial_job = info["trials"][0]["job"]
    reasons = [e["reason"] for e in admin.request(GetJob(job=trial_job)).job["events"]]
    assert any("stopped by a-mnist" in r for r in reasons) and not any("root" in r for r in reasons), reasons


# -- a study's size and the loop ----------------------------------------------------------


def test_a_huge_study_is_refused_or_queued_in_slices_while_a_busy_trainer_keeps_its_lease(
    router, client_for, make_token
):
    admin = client_for(router.endpoint, role="admin")
    with pytest.raises(BadRequest, match=f"trials must be 1 to {MAX_TRIALS}, got 10000"):
        admin.request(SubmitStudy(spec=study("mnist", trials=10000, concurrent=2)))
    with pytest.raises(BadRequest, match=f"concurrent must be 1 to {MAX_CONCURRENT}, got 1500"):
        admin.request(SubmitStudy(spec=study("mnist", trials=1000, concurrent=1500)))
    # a trainer with a job, heard from by heartbeats only (its lease lives while its session does)
    job = admin.request(SubmitJob(spec={"dataset": "other", "epochs": 1, "priority": 5})).job
    busy = Link(
        router.endpoint,
        Identity(role="trainer", name="busy", token=make_token("trainer", sub="busy")),
        heartbeat_ms=100,
    ).start()
    try:
        assert busy.wait_connected(5)
        session = busy.client.session
        assert busy.request(GetTask(), timeout_s=5).job == job
        big = admin.request(SubmitStudy(spec=study("mnist", trials=MAX_TRIALS, concurrent=MAX_CONCURRENT)))
        started = [t for t in big.study["trials"] if t["job"]]
        assert 0 < len(started) <= START_PER_STEP  # the first slice; the rest follow at the ticks
        deadline = time.monotonic() + 60
        while len(admin.request(ListJobs(state="queued", limit=1000)).jobs) < MAX_CONCURRENT:
            assert time.monotonic() < deadline, "the study's slices never filled its concurrency"
            time.sleep(0.2)
        assert len(admin.request(GetStudy(study=big.study["id"])).study["trials"]) == MAX_CONCURRENT
        held = admin.request(GetJob(job=job)).job
        assert held["state"] == "running" and held["trainer"] == "busy"
        assert not any("lapsed" in e["reason"] for e in held["events"]), held["events"]
        assert busy.client.session == session  # never reconnected meanwhile
        admin.request(StopStudy(study=big.study["id"]))
    finally:
        busy.close()


# -- what a trainer can make the router store -----------------------------------------


def db_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).parent.glob(Path(path).name + "*"))


def test_a_trainer_cannot_grow_the_database_or_evict_its_jobs_events(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
    t = trainer_of(client_for, router, make_token, "t-noisy")
    assert t.request(GetTask()).job == job
    # one real command, acknowledged through the progress reply that repeats it
    answered: list = []
    asking = threading.Thread(target=lambda: answered.append(admin.request(ControlJob(job=job, command="checkpoint"))))
    asking.start()
    deadline = time.monotonic() + 5
    while not (commands := t.request(Progress(job=job, progress={"step": 1})).detail["commands"]):
        assert time.monotonic() < deadline, "the command never reached the trainer"
        time.sleep(0.05)
    seq = commands[0]["seq"]
    t.request(CommandAck(job=job, command="checkpoint", seq=seq, state="running", detail={"path": "/c"}))
    asking.join(10)
    assert isinstance(answered[0], Ok) and answered[0].detail["acked"]
    events_before = admin.request(GetJob(job=job)).job["events"]

    with pytest.raises(BadRequest, match="is not a job command"):
        t.request(CommandAck(job=job, command="x" * 500_000, seq=seq, state="running"))
    for i in range(50):  # acknowledgements of commands never sent: refused, nothing stored
        with pytest.raises(BadRequest, match="was not sent to job"):
            t.request(CommandAck(job=job, command="eval", seq=10_000 + i, state="running", detail={"e": "y" * 1000}))
    assert t.request(CommandAck(job=job, command="checkpoint", seq=seq, state="running")).detail["duplicate"]
    assert admin.request(GetJob(job=job)).job["events"] == events_before

    blob = "z" * 240_000  # each within the 256 KiB a report may be
    db = router.service.settings.db
    for step in range(120):
        t.request(Progress(job=job, progress={"step": step, "blob": blob}))
    kept = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        stored = kept.execute("SELECT SUM(LENGTH(progress)) FROM progress WHERE job = ?", (job,)).fetchone()[0]
    finally:
        kept.close()
    assert stored <= PROGRESS_BYTES_KEPT  # 28 MiB sent
    assert db_bytes(db) < 4 * PROGRESS_BYTES_KEPT, db_bytes(db)
    assert len(admin.request(GetJob(job=job, progress=1000)).job["progress_history"]) < 120

    t.request(PushResult(job=job, state="failed", error="e" * 200_000))
    info = admin.request(GetJob(job=job)).job
    assert len(info["events"][-1]["reason"]) < REASON_CHARS + 100
    reasons = [e["reason"] for e in info["events"]]
    assert reasons[0] == "submitted" and any("checkpoint acknowledged by t-noisy" in r for r in reasons)


# -- Stats ------------------------------------------------------------------------------


def beating(router, make_token, sub: str, name: str, stats: dict) -> Link:
    link = Link(
        router.endpoint,
        Identity(role="trainer", name=name, token=make_token("trainer", sub=sub)),
        heartbeat_ms=100,
        stats=lambda: stats,
    ).start()
    assert link.wait_connected(5)
    return link


def test_stats_are_keyed_by_subject_scoped_and_fit_one_reply(router, client_for, make_token, state_dir):
    admin = client_for(router.endpoint, role="admin")
    links = [
        beating(router, make_token, "alice", "router", {"job": "j-alice", "role": "router"}),  # poses as it
        beating(router, make_token, "bob", "bob", {"job": "j-bob"}),
    ]
    try:
        deadline = time.monotonic() + 5
        while not {"alice", "bob"} <= set(services := admin.request(Stats()).services):
            assert time.monotonic() < deadline, f"heartbeats never arrived: {sorted(services)}"
            time.sleep(0.05)
        assert services["router"]["role"] == "router"  # the router's own row, not alice's
        assert services["alice"]["name"] == "router" and services["alice"]["job"] == "j-alice"
        assert services["alice"]["role"] == "trainer"  # the router says who is what, not the peer's stats
        seen_by_bob = links[1].request(Stats(), timeout_s=5).services
        assert set(seen_by_bob) == {"router", "bob"}  # not alice's row, nor her job
        scoped = admin_of(client_for, router, make_token, "a-mnist", datasets=["mnist"])
        assert set(scoped.request(Stats()).services) == {"router"}  # no trainer holds a job of mnist
        # rows each within the stored bound, together past one reply: cut, and busctl queues works
        for i in range(6):
            links.append(beating(router, make_token, f"big{i}", f"big{i}", {"blob": "b" * 200_000}))
        deadline = time.monotonic() + 5
        while not all(f"big{i}" in (services := admin.request(Stats()).services) for i in range(6)):
            assert time.monotonic() < deadline, "heartbeats never arrived"
            time.sleep(0.05)
        assert any("cut" in row for row in services.values())
        out = busctl("queues", "--json", env={"BATCHBUS_STATE_DIR": str(state_dir), "BATCHBUS_ROUTER": router.endpoint})
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert {"router", "alice", "bob"} <= set(json.loads(out.stdout))
    finally:
        for link in links:
            link.close()


def test_a_full_revocation_list_fits_one_push_and_no_token_outlives_it(state_dir):
    from libbus.constants import MAX_HEADER_BYTES
    from libbus.wire.frames import encode
    from libbus.wire.messages import Entitlements
    from services.router.grants import MAX_JTI_LEN, MAX_REVOKED

    push = Entitlements(revoked=["x" * MAX_JTI_LEN] * MAX_REVOKED, assigned={"mnist": [f"t{i}" for i in range(1000)]})
    assert len(encode(push)[1]) < MAX_HEADER_BYTES  # what broke past 9,000 revocations
    env = {"BATCHBUS_STATE_DIR": str(state_dir)}
    out = busctl("token", "issue", "--role", "trainer", "--ttl", str(400 * 86400), env=env)
    assert out.returncode == 2 and "--ttl is at most 31622400 s (366 days)" in out.stderr, out.stderr
    assert busctl("token", "issue", "--role", "trainer", "--ttl", str(366 * 86400), env=env).returncode == 0
