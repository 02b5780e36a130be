"""Nobody acts in another's name: the router keys every trainer on its token's subject. Each test does what the attacker or the careless operator did, against a real
router on a real socket, and shows the refusal."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libbus.connect.client import Client, Identity
from libbus.errors import BadRequest, Forbidden, Unavailable
from libbus.wire.messages import (
    Checkpointed,
    CommandAck,
    ControlJob,
    GetJob,
    GetModel,
    GetTask,
    ListJobs,
    NoTask,
    Progress,
    PushResult,
    SubmitJob,
    Task,
)


def trainer(client_for, router, make_token, sub: str, name: str, **scopes) -> Client:
    c = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub=sub, **scopes))
    c.identity.name = name
    return c


def job_of(admin, job: str) -> dict:
    return admin.request(GetJob(job=job)).job


def test_a_name_is_not_an_identity_every_route_is_refused(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
    victim = trainer(client_for, router, make_token, "victim", "gpu0")
    assert victim.request(GetTask()).job == job
    # mallory: a trainer token for another dataset, saying Hello with the victim's name
    mallory = trainer(client_for, router, make_token, "mallory", "gpu0", datasets=["other"])
    mallory.hello()
    for forged in (
        PushResult(job=job, state="failed", error="mallory was here"),
        PushResult(
            job=job,
            state="succeeded",
            result={"model": {"sha256": hashlib.sha256(b"evil").hexdigest()}},
            frames=[b"evil"],
        ),
        Checkpointed(job=job, checkpoint={"step": 1, "epoch": 0, "path": "/tmp/evil"}),
        Progress(job=job, progress={"step": 99}),
    ):
        with pytest.raises(Forbidden, match="not running on 'mallory'|not running on mallory"):
            mallory.request(forged)
    info = job_of(admin, job)
    assert (info["state"], info["trainer"], info["attempts"]) == ("running", "victim", 1)
    # the victim's provider grant stays the victim's
    assert router.service.handler.entitlements().assigned == {"mnist": ["victim"]}
    # a command goes to the victim's session only, and only its acknowledgement settles it
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(admin.request, ControlJob(job=job, command="pause"))
        deadline = time.monotonic() + 5
        while not any(m.type == "Command" for m in victim.pushes):
            assert time.monotonic() < deadline, "pause never pushed to the victim"
            victim.recv(0.05)
        seq = next(m.seq for m in victim.pushes if m.type == "Command")
        mallory.recv(0.2)
        assert not [m for m in mallory.pushes if m.type == "Command"]
        with pytest.raises(Forbidden):
            mallory.request(CommandAck(job=job, command="pause", seq=seq, state="paused"))
        assert not asked.done()
        victim.request(CommandAck(job=job, command="pause", seq=seq, state="paused"))
        assert asked.result(5).detail["trainer"] == "victim"
    # mallory asking for work abandons nothing of the victim's and burns none of its attempts
    assert isinstance(mallory.request(GetTask()), NoTask)
    info = job_of(admin, job)
    assert (info["state"], info["trainer"], info["attempts"]) == ("paused", "victim", 1)
    # the victim goes away: mallory, connected under its name, does not keep its lease alive
    victim.close()
    deadline = time.monotonic() + 15
    while job_of(admin, job)["trainer"] is not None:
        assert time.monotonic() < deadline, "the lapsed lease was kept alive by a session with the victim's name"
        mallory.request(GetTask())
        time.sleep(0.2)


def test_two_trainers_with_one_name_own_their_own_jobs(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    first_job = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    second_job = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    a = trainer(client_for, router, make_token, "node-a", "trainer-gpu0")  # a copied config: same name
    b = trainer(client_for, router, make_token, "node-b", "trainer-gpu0")
    assert a.request(GetTask()).job == first_job
    assert b.request(GetTask()).job == second_job  # b asking for work abandons nothing of a's
    assert (job_of(admin, first_job)["trainer"], job_of(admin, second_job)["trainer"]) == ("node-a", "node-b")
    with pytest.raises(Forbidden):
        b.request(Progress(job=first_job, progress={"step": 1}))


DUPLICATE = """
import sys
from libbus.connect.client import Client, Identity
from libbus.errors import BusError
c = Client(sys.argv[1], Identity(role="trainer", name="trainer-gpu0", token=sys.argv[2], host_id="other-host"),
           timeout_s=5, retries=0)
try:
    c.hello()
    print("WELCOME")
except BusError as err:
    print(err.code, err)
"""


def test_a_second_process_with_the_same_identity_is_refused(router, client_for, make_token):
    token = make_token("trainer", sub="node-a")
    first = client_for(router.endpoint, role="trainer", token=token)
    first.identity.caps = {"heartbeat": False}
    assert isinstance(first.request(GetTask()), (Task, NoTask))
    out = subprocess.run(
        [sys.executable, "-c", DUPLICATE, router.endpoint, token], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.startswith("UNAVAILABLE") and "already connected" in out.stdout, out.stdout + out.stderr
    # the holder goes (Goodbye): the identity is free for the next process
    first.close()
    out = subprocess.run(
        [sys.executable, "-c", DUPLICATE, router.endpoint, token], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "WELCOME", out.stdout + out.stderr


def test_an_acknowledgement_settles_only_the_command_of_its_job(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    j1 = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    j2 = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    a = trainer(client_for, router, make_token, "node-a", "a")
    b = trainer(client_for, router, make_token, "node-b", "b")
    assert a.request(GetTask()).job == j1 and b.request(GetTask()).job == j2
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(admin.request, ControlJob(job=j1, command="checkpoint"))
        deadline = time.monotonic() + 5
        while not any(m.type == "Command" for m in a.pushes):
            assert time.monotonic() < deadline
            a.recv(0.05)
        seq = next(m.seq for m in a.pushes if m.type == "Command")
        # b acknowledges a's command under its own job: refused, and a's command is still waiting
        with pytest.raises(Forbidden, match=f"sent to job {j1}"):
            b.request(CommandAck(job=j2, command="checkpoint", seq=seq, state="running"))
        assert not asked.done()
        a.request(CommandAck(job=j1, command="checkpoint", seq=seq, state="running"))
        assert asked.result(5).detail["acked"] is True


def test_a_dataset_scoped_admin_touches_only_its_datasets_jobs(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    theirs = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    scoped = client_for(router.endpoint, role="admin", token=make_token("admin", sub="ops-cifar", datasets=["cifar10"]))
    mine = scoped.request(SubmitJob(spec={"dataset": "cifar10"})).job
    for msg in (ControlJob(job=theirs, command="stop"), GetModel(job=theirs), GetJob(job=theirs)):
        with pytest.raises(Forbidden, match="'mnist' is outside this token's datasets scope"):
            scoped.request(msg)
    assert [j["id"] for j in scoped.request(ListJobs()).jobs] == [mine]
    assert job_of(admin, theirs)["state"] == "queued"


def test_a_provider_registers_only_datasets_its_token_covers_and_replicas_are_checked_by_identity(
    router, provider, client_for, make_token
):
    live = router.service.handler.sessions_of("provider")[0]
    info = dict(live.hello.caps["datasets"]["mnist"])
    rogue = client_for(router.endpoint, role="provider", token=make_token("provider", sub="p2", datasets=["mnist"]))
    rogue.identity.caps = {"endpoint": "tcp://127.0.0.1:9", "datasets": {"mnist": info, "secrets": info}}
    with pytest.raises(Forbidden, match="'secrets' is outside this token's datasets scope"):
        rogue.hello()
    # another provider under the live one's *name*, serving different data under the same dataset name
    other = dict(info, splits={**info["splits"], "train": {**info["splits"]["train"], "num_samples": 7}})
    twin = client_for(router.endpoint, role="provider", token=make_token("provider", sub="p3"))
    twin.identity.name = live.name
    twin.identity.caps = {"endpoint": "tcp://127.0.0.1:9", "datasets": {"mnist": other}}
    with pytest.raises(BadRequest, match="differs from the replica"):
        twin.hello()


def test_the_same_subject_cannot_register_a_second_provider_process(router, provider, client_for, make_token):
    live = router.service.handler.sessions_of("provider")[0]
    twin = Client(
        router.endpoint,
        Identity(
            role="provider",
            name="copy",
            host_id="elsewhere",
            token=make_token("provider", sub=live.subject),
            caps={"endpoint": "tcp://127.0.0.1:9", "datasets": {}},
        ),
        timeout_s=3,
        retries=0,
    )
    # Identity.hello reports this process's pid; claim another host so it is "another process"
    live_process = live.process
    assert live_process != ("elsewhere", live.hello.pid)
    try:
        with pytest.raises(Unavailable, match="already connected"):
            twin.hello()
    finally:
        twin.close()
