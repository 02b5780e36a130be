"""The router's job rules where a restart, a resend or a failure used to lose something: command
ids across router restarts, a stop pending when an attempt fails retryably, a resent GetTask.

Real SQLite files and, for GetTask, a real router on loopback TCP with a trainer session."""

from __future__ import annotations

from concurrent.futures import Future

from libbus.jobs.spec import JobSpec
from libbus.wire.messages import Command, GetJob, GetTask, PushResult, SubmitJob, Task
from services.router.jobs import JobControl
from services.router.store import JobStore


def _control(path: str, pushed: list) -> JobControl:
    return JobControl(JobStore(path), lambda trainer, msg: pushed.append(msg) or True, lambda: {"t1"}, lease_s=10)


def test_command_ids_never_repeat_across_router_restarts(tmp_path):
    """A trainer applies each command id once: a restarted router must not reuse the last one's."""
    path = str(tmp_path / "router.db")
    seen = set()
    for _ in range(3):  # three starts of the router on one database
        pushed: list[Command] = []
        jobs = _control(path, pushed)
        job = jobs.store.submit(JobSpec.from_dict({"dataset": "mnist", "epochs": 100}))
        jobs.store.claim("t1", 10, accept=lambda j, job=job: j["id"] == job)
        assert isinstance(jobs.control("admin", job, "pause", {}), Future)
        assert isinstance(jobs.control("admin", job, "checkpoint", {}), Future)
        seqs = {c.seq for c in pushed}
        assert len(seqs) == 2 and not seqs & seen, (seqs, seen)
        seen |= seqs
        jobs.store.close()


def test_a_pending_stop_survives_a_retryable_failure(tmp_path):
    pushed: list[Command] = []
    jobs = _control(str(tmp_path / "router.db"), pushed)
    job = jobs.store.submit(JobSpec.from_dict({"dataset": "mnist"}))
    jobs.store.claim("t1", 10)
    stop = jobs.control("admin", job, "stop", {})
    assert isinstance(stop, Future) and pushed[-1].command == "stop"
    # the provider went away before the trainer applied the stop: a retryable failure
    jobs.on_result(
        "t1",
        PushResult(job=job, state="failed", result={"retryable": True}, error="PeerTimeout: provider did not answer"),
    )
    info = jobs.store.get(job)
    assert info["state"] == "stopped", info["events"]
    assert "stop requested" in info["events"][-1]["reason"]


def test_a_resent_get_task_gets_the_same_job_and_costs_no_attempt(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "max_attempts": 2})).job
    other = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    trainer = client_for(router.endpoint, role="trainer")
    first = trainer.request(GetTask(key="ask-1"))
    assert isinstance(first, Task) and first.job == job
    for _ in range(3):  # the link resends the same ask after reconnecting
        again = trainer.request(GetTask(key="ask-1"))
        assert isinstance(again, Task) and again.job == job
    info = admin.request(GetJob(job=job)).job
    assert (info["state"], info["attempts"], info["failures"]) == ("running", 1, 0)
    assert not any("abandoned" in e["reason"] for e in info["events"])
    # a new ask means the trainer let the job go: that one is abandoned (and counted)
    nxt = trainer.request(GetTask(key="ask-2"))
    assert isinstance(nxt, Task) and nxt.job in (job, other)
    info = admin.request(GetJob(job=job)).job
    assert info["failures"] == 1 and any("abandoned" in e["reason"] for e in info["events"])
