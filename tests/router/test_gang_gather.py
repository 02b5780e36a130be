"""Gangs never block the cluster: a gathering that cannot complete releases its trainers (the job
waits its turn again, or fails by its policy) and a queued job of higher priority goes first.
A real router on loopback TCP with trainer sessions, and the rules on a real job database."""

from __future__ import annotations

import time

from libbus.jobs.spec import JobSpec
from libbus.wire.messages import GetJob, GetTask, NoTask, SubmitJob, Task
from services.router.gangs import Gangs
from services.router.store import JobStore


def _ask_until_task(trainer, timeout: float = 10.0) -> Task:
    deadline = time.monotonic() + timeout
    while True:
        reply = trainer.request(GetTask(key=f"k{time.monotonic()}"))
        if isinstance(reply, Task):
            return reply
        assert time.monotonic() < deadline, "the trainer never got work: the gang blocked it"
        time.sleep(0.1)


def test_a_gang_that_cannot_gather_releases_its_trainer_to_other_work(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    gang = admin.request(
        SubmitJob(spec={"dataset": "mnist", "world_size": 4, "gather_timeout_s": 0.5, "priority": 1})
    ).job
    single = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    trainer = client_for(router.endpoint, role="trainer")
    assert isinstance(trainer.request(GetTask(key="a")), NoTask)  # joined the gang of 4 (1/4)
    task = _ask_until_task(trainer)
    assert task.job == single
    info = admin.request(GetJob(job=gang)).job
    assert info["state"] == "queued"
    assert any("did not gather within 0.5 s" in e["reason"] for e in info["events"]), info["events"]


def test_gather_policy_fail_and_priorities_on_the_job_database(tmp_path):
    store = JobStore(str(tmp_path / "router.db"))
    gangs = Gangs(store, lease_s=10)
    failing = store.submit(
        JobSpec.from_dict({"dataset": "mnist", "world_size": 2, "gather_timeout_s": 5, "gather_policy": "fail"})
    )
    assert isinstance(gangs.join("t1", store.first_queued()), NoTask)
    now = time.monotonic()
    gangs.tick({"t1"}, now=now + 1)
    assert failing in gangs.gathering
    gangs.tick({"t1"}, now=now + 6)
    info = store.get(failing)
    assert info["state"] == "failed" and "did not gather within 5 s" in info["error"]
    assert gangs.task_for("t1") is None  # free for other work
    # a gathering behind a queued job of higher priority lets its members go at once
    low = store.submit(JobSpec.from_dict({"dataset": "mnist", "world_size": 2}))
    assert isinstance(gangs.join("t1", store.first_queued()), NoTask) and low in gangs.gathering
    high = store.submit(JobSpec.from_dict({"dataset": "mnist", "priority": 9}))
    gangs.tick({"t1"})
    assert low not in gangs.gathering and gangs.task_for("t1") is None
    assert store.first_queued()["id"] == high
    assert "higher priority" in store.get(low)["events"][-1]["reason"]
