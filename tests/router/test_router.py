"""The router: its SQLite job store, discovery, heartbeats, and jobs whose trainer vanishes."""

import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libbus.connect.client import Identity
from libbus.connect.link import Link
from libbus.errors import BadRequest, Forbidden, NotFound, Timeout
from libbus.jobs.spec import JobSpec
from libbus.wire.messages import (
    CommandAck,
    ControlJob,
    GetJob,
    GetTask,
    ListJobs,
    ListStudies,
    NoTask,
    Progress,
    PushResult,
    Resolve,
    Stats,
    SubmitJob,
    SubmitStudy,
    Task,
)
from services.router.store import JobStore


def test_store_survives_reopening_and_keeps_events(tmp_path):
    path = str(tmp_path / "jobs.db")
    store = JobStore(path)
    low = store.submit(JobSpec.from_dict({"dataset": "a"}))
    high = store.submit(JobSpec.from_dict({"dataset": "b", "priority": 5}))
    assert store.claim("t1", 10)["id"] == high  # priority first
    store.finish(high, "succeeded", "done", result={"test_accuracy": 0.97})
    store.close()
    store = JobStore(path)
    assert store.get(high)["result"] == {"test_accuracy": 0.97}
    assert [e["state"] for e in store.get(high)["events"]] == ["queued", "running", "succeeded"]
    assert store.claim("t2", 10)["id"] == low
    store.release(low, "trainer gone", lost=False)
    job = store.get(low)
    assert job["state"] == "queued" and job["trainer"] is None and job["attempts"] == 1
    assert store.claim("t3", 10)["id"] == low and store.claim("t3", 10) is None
    store.close()


@pytest.mark.parametrize(
    "spec, words",
    [
        ({}, "needs 'dataset'"),
        ({"dataset": "a", "epochs": 0}, "epochs"),
        ({"dataset": "a", "lr": "fast"}, "lr"),
        ({"dataset": "a", "optimizer": "lbfgs"}, "optimizer"),
        ({"dataset": "a", "colour": 1}, "unknown job field"),
        ({"dataset": "remote://"}, "names nothing"),
    ],
)
def test_bad_job_specs_are_refused_naming_the_field(spec, words):
    with pytest.raises(BadRequest, match=words):
        JobSpec.from_dict(spec)


@pytest.mark.parametrize(
    "wire, words",
    [
        ({"dataset": "mnist", "epochs": "many"}, "job field 'epochs' must be int, got 'many'"),
        ({"dataset": "mnist", "colour": 1}, "unknown job field(s) colour"),
        ({"model": "mlp"}, "job spec needs 'dataset'"),
        ({"base": {"dataset": "mnist", "lr": -1.0}, "space": {"seed": {"int": [0, 3]}}}, "[base]: lr must be positive"),
    ],
)
def test_a_malformed_spec_is_refused_where_it_enters_the_router(router, client_for, wire, words):
    """Sent past busctl's checks, a bad job or study spec gets one line naming the field; nothing is kept,
    and a trainer asking for work is given none."""
    admin = client_for(router.endpoint, role="admin")
    msg = SubmitStudy(spec=wire) if "base" in wire else SubmitJob(spec=wire)
    with pytest.raises(BadRequest) as refused:
        admin.request(msg)
    assert words in str(refused.value) and "\n" not in str(refused.value) and "Traceback" not in str(refused.value)
    assert admin.request(ListJobs()).jobs == [] and admin.request(ListStudies()).studies == []
    assert isinstance(client_for(router.endpoint).request(GetTask(key="k")), NoTask)


def test_a_spec_corrupted_in_the_store_fails_its_job_at_the_router_and_reaches_no_trainer(router, client_for):
    """A job's spec changed behind the router's back (its SQLite file edited by hand) is parsed as the
    router reads it to hand out: the job fails in one line, and the trainer that asked gets no task."""
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "model": "mlp"})).job
    with sqlite3.connect(router.settings.db, timeout=30) as db:
        db.execute("UPDATE jobs SET spec = json_set(spec, '$.batch_size', 'many') WHERE id = ?", (job,))
    db.close()
    assert isinstance(client_for(router.endpoint).request(GetTask(key="k")), NoTask)
    info = admin.request(GetJob(job=job)).job
    assert info["state"] == "failed" and info["attempts"] == 0, info
    assert info["error"] == "job field 'batch_size' must be int, got 'many'"
    assert (
        info["events"][-1]["reason"] == "its stored spec cannot be read: job field 'batch_size' must be int, got 'many'"
    )


def test_resolve_names_providers_and_what_is_online(router, provider, client_for):
    admin = client_for(router.endpoint, role="admin")
    resolved = admin.request(Resolve(dataset="remote://mnist"))
    assert resolved.providers[0]["endpoint"] == provider.endpoint
    assert resolved.info["splits"]["train"]["num_samples"] == 600
    with pytest.raises(NotFound, match=r"'cifar' is not served by any provider; online: mnist \(provider"):
        admin.request(Resolve(dataset="cifar"))


def test_silent_peer_is_dropped_and_its_stats_were_carried(router, make_token):
    link = Link(
        router.endpoint,
        Identity(role="trainer", name="beat", token=make_token()),
        heartbeat_ms=100,
        stats=lambda: {"queue": 3},
    ).start()
    assert link.wait_connected(5)
    time.sleep(0.3)
    admin_stats = router.service.handler.on_Stats(None, Stats()).services
    row = admin_stats["test"]  # keyed by the token's subject; Hello.name is a label in the row
    assert {k: row[k] for k in ("role", "queue", "name")} == {"role": "trainer", "queue": 3, "name": "beat"}
    link.close()
    deadline = time.monotonic() + 5
    while any(p.name == "beat" for p in router.service.handler.peers.values()):
        assert time.monotonic() < deadline, "silent trainer never dropped"
        time.sleep(0.05)
    # 5 intervals of 100 ms: dropped well within a few seconds of going silent


def test_job_of_a_vanished_trainer_is_requeued_and_stale_reports_refused(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
    first = client_for(router.endpoint, role="trainer")
    task = first.request(GetTask())
    assert isinstance(task, Task) and task.job == job
    first.close()  # the trainer's session goes silent, then its job's lease lapses
    router.service.server.config.idle_session_s = 0.2
    deadline = time.monotonic() + 10
    while admin.request(GetJob(job=job)).job["state"] != "queued":
        assert time.monotonic() < deadline, "job never requeued"
        time.sleep(0.1)
    # another trainer (identity = token subject, not Hello.name) takes it
    second = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub="trainer-2"))
    assert second.request(GetTask()).job == job
    events = [e["state"] for e in admin.request(GetJob(job=job)).job["events"]]
    assert events == ["queued", "running", "queued", "running"]
    with pytest.raises(Forbidden, match="not running on"):
        first.request(Progress(job=job, progress={}))


def test_stop_reaches_a_queued_job_and_a_running_trainer(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    queued = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    assert admin.request(ControlJob(job=queued, command="stop")).detail["state"] == "stopped"
    with pytest.raises(BadRequest, match="already ended"):
        admin.request(ControlJob(job=queued, command="stop"))
    with pytest.raises(BadRequest, match="unknown command"):
        admin.request(ControlJob(job=queued, command="explode"))
    running = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    trainer = client_for(router.endpoint, role="trainer")
    assert trainer.request(GetTask()).job == running
    with ThreadPoolExecutor(1) as pool:
        # the admin's stop is answered once the trainer acknowledges it
        asked = pool.submit(admin.request, ControlJob(job=running, command="stop"))
        deadline = time.monotonic() + 5
        while not any(m.type == "Command" for m in trainer.pushes):
            assert time.monotonic() < deadline, "stop never pushed to the trainer"
            trainer.recv(0.05)
        pushed = [m for m in trainer.pushes if m.type == "Command"]
        assert [(m.job, m.command) for m in pushed] == [(running, "stop")] and pushed[0].seq > 0
        reply = trainer.request(Progress(job=running, progress={"step": 1}))
        assert reply.detail["stop"] is True  # told on its next report, even if the push were lost
        assert not asked.done()
        trainer.request(CommandAck(job=running, command="stop", seq=pushed[0].seq, state="stopping"))
        detail = asked.result(5).detail
    assert (
        detail["acked"] is True and detail["state"] == "stopping" and detail["trainer"] == "test"
    )  # its token subject
    trainer.request(PushResult(job=running, state="stopped"))
    info = admin.request(GetJob(job=running)).job
    assert info["state"] == "stopped"
    assert [e["reason"].split(" by ")[0] for e in info["events"][2:4]] == ["stop requested", "stop acknowledged"]
    assert isinstance(trainer.request(GetTask()), NoTask)


def test_a_restarted_router_gets_its_providers_back(router, provider, client_for, make_settings):
    from services.router.app import RouterService
    from tests.support import run_service

    router.shutdown()  # the router dies; the provider keeps running
    settings = make_settings(bind=router.endpoint)
    again = run_service(RouterService(settings), settings)
    try:
        admin = client_for(router.endpoint, role="admin")
        deadline = time.monotonic() + 15
        while True:
            try:
                assert admin.request(Resolve(dataset="mnist")).providers[0]["endpoint"] == provider.endpoint
                break
            except NotFound:
                assert time.monotonic() < deadline, "provider never re-registered"
                time.sleep(0.2)
    finally:
        again.shutdown()


def test_commands_for_jobs_no_trainer_holds_are_applied_by_the_router(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "lr": 0.01})).job
    assert admin.request(ControlJob(job=job, command="pause")).detail["state"] == "paused"
    trainer = client_for(router.endpoint, role="trainer")
    assert isinstance(trainer.request(GetTask()), NoTask)  # a paused job is not handed out
    spec = admin.request(ControlJob(job=job, command="set", args={"lr": 0.5})).detail["spec"]
    assert spec["lr"] == 0.5 and admin.request(GetJob(job=job)).job["spec"]["lr"] == 0.5
    with pytest.raises(BadRequest, match="cannot set epochs"):
        admin.request(ControlJob(job=job, command="set", args={"epochs": 9}))
    with pytest.raises(BadRequest, match="only a job a trainer holds can checkpoint"):
        admin.request(ControlJob(job=job, command="checkpoint"))
    with pytest.raises(BadRequest, match="takes no arguments"):
        admin.request(ControlJob(job=job, command="pause", args={"now": 1}))
    assert admin.request(ControlJob(job=job, command="resume")).detail["state"] == "queued"
    task = trainer.request(GetTask())
    assert task.job == job and task.spec["lr"] == 0.5 and task.resume is None


def test_a_command_the_trainer_never_acknowledges_times_out_and_is_repeated(router, client_for):
    router.service.handler.jobs.ack_timeout_s = 0.5
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    trainer = client_for(router.endpoint, role="trainer")
    assert trainer.request(GetTask()).job == job
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(admin.request, ControlJob(job=job, command="checkpoint"))
        deadline = time.monotonic() + 5
        while not any(m.type == "Command" for m in trainer.pushes):  # pushed, and "lost" here
            assert time.monotonic() < deadline
            trainer.recv(0.05)
        # until acknowledged, the command rides on every progress reply
        repeated = trainer.request(Progress(job=job, progress={})).detail["commands"]
        assert [c["command"] for c in repeated] == ["checkpoint"]
        with pytest.raises(Timeout, match="has not acknowledged checkpoint"):
            asked.result(10)
    assert trainer.request(Progress(job=job, progress={})).detail["commands"] == []


def test_a_retryable_failure_requeues_until_max_attempts(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "max_attempts": 2})).job
    trainer = client_for(router.endpoint, role="trainer")
    for attempt, state in ((1, "queued"), (2, "failed")):
        assert trainer.request(GetTask()).job == job
        trainer.request(
            PushResult(job=job, state="failed", error="PeerTimeout: provider silent", result={"retryable": True})
        )
        info = admin.request(GetJob(job=job)).job
        assert (info["state"], info["failures"]) == (state, attempt)
    assert "gave up after 2 lost attempt(s)" in info["events"][-1]["reason"]
    assert "provider silent" in info["error"]
