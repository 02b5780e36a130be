"""Elastic gangs (``elastic = true``, ``min_world_size``..``max_world_size``): the spec's bounds are
checked; the router starts a gang at once with the maximum, or with at least the minimum once the
gather timeout has passed; and, with real processes, a gang of 2 that loses a trainer to SIGKILL
resumes its checkpoint on the one trainer left, every sample of every epoch trained once."""

from __future__ import annotations

import json
import time

import pytest

from libbus.errors import BadRequest
from libbus.jobs.spec import MAX_WORLD_SIZE, JobSpec
from libbus.wire.messages import NoTask, Task
from services.router.gangs import Gangs
from services.router.store import JobStore
from services.trainer.attempt.audit import effective_epochs
from tests.support.jobs import SPEC, JobCluster, wait_trained

ELASTIC = {"dataset": "mnist", "elastic": True, "min_world_size": 1, "max_world_size": 2}


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"min_world_size": 0}, "1 <= min_world_size <= max_world_size"),
        ({"min_world_size": 3}, "got min_world_size=3 max_world_size=2"),
        ({"max_world_size": MAX_WORLD_SIZE + 1}, f"<= {MAX_WORLD_SIZE}"),
        ({"min_world_size": -1}, "1 <= min_world_size"),
        ({"world_size": 4}, "world_size is its max_world_size"),
        ({"elastic": False}, "need elastic = true"),
        ({"elastic": "yes"}, "'elastic' must be bool"),
        ({"max_world_size": 2.0}, "'max_world_size' must be int"),
    ],
)
def test_elastic_bounds_are_checked_and_refusals_name_them(changes, refusal):
    with pytest.raises(BadRequest, match=refusal):
        JobSpec.from_dict({**ELASTIC, **changes})


def test_an_elastic_job_gathers_up_to_its_maximum():
    spec = JobSpec.from_dict({**ELASTIC, "world_size": 2})
    assert spec.world_size == 2 and spec.to_dict()["world_size"] == 2
    assert JobSpec.from_dict(ELASTIC).world_size == 2
    assert JobSpec.from_dict(spec.to_dict()).with_hyper({"lr": 0.5}).max_world_size == 2  # stored, re-read


def _elastic(store: JobStore, low: int, high: int, timeout: float = 5) -> str:
    spec = {**ELASTIC, "min_world_size": low, "max_world_size": high, "gather_timeout_s": timeout}
    return store.submit(JobSpec.from_dict(spec))


def test_the_router_starts_an_elastic_gang_at_its_maximum_or_after_the_wait_with_its_minimum(tmp_path):
    store = JobStore(str(tmp_path / "router.db"))
    gangs = Gangs(store, lease_s=10)
    # at the maximum it starts at once, and every rank is told the world size chosen
    full = _elastic(store, 2, 3)
    for trainer in ("t1", "t2"):
        assert isinstance(gangs.join(trainer, store.first_queued()), NoTask)
    gangs.join("t3", store.first_queued())
    assert store.get(full)["state"] == "running" and store.get(full)["gang"]["members"] == ["t1", "t2", "t3"]
    task = gangs.task_for("t1")
    assert isinstance(task, Task) and (task.rank, task.world_size) == (0, 3)
    store.finish(full, "stopped", "done with it")

    # short of the maximum it waits out gather_timeout_s, then starts with the members it has
    some = _elastic(store, 1, 3)
    now = time.monotonic()
    gangs.join("t1", store.first_queued())
    gangs.join("t2", store.first_queued())
    assert gangs.tick({"t1", "t2"}, now=now + 1) is False and store.get(some)["state"] == "queued"
    # a member that disconnected is not started with
    assert gangs.tick({"t2"}, now=now + 6) is True
    info = store.get(some)
    assert info["state"] == "running" and info["gang"]["members"] == ["t2"]
    assert any("elastic gang starts with 1 of up to 3" in e["reason"] for e in info["events"])
    task = gangs.task_for("t2")
    assert isinstance(task, Task) and (task.rank, task.world_size) == (0, 1)
    assert gangs.task_for("t1") is None  # free for other work
    store.finish(some, "stopped", "done with it")

    # fewer than the minimum at the timeout: released, as a fixed gang is
    short = _elastic(store, 2, 3)
    now = time.monotonic()
    gangs.join("t1", store.first_queued())
    assert gangs.tick({"t1"}, now=now + 6) is False
    info = store.get(short)
    assert info["state"] == "queued" and gangs.waiting(short, now + 6)
    assert "its gang of 2 to 3 did not gather within 5 s" in info["events"][-1]["reason"]


def _submit_elastic(cluster: JobCluster, path) -> str:
    """:data:`SPEC` as a job file, made elastic (1 to 2) by ``busctl submit``'s flags; a careless
    range on the same command line is refused in one line."""
    fields = {**SPEC, "epochs": 2, "gather_timeout_s": 5.0}
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items() if not isinstance(v, dict)]
    lines += ["[model_kwargs]", *(f"{k} = {json.dumps(v)}" for k, v in SPEC["model_kwargs"].items())]
    path.write_text("\n".join(lines) + "\n")
    bad = cluster.busctl(
        "submit", str(path), "--elastic", "--min-world-size", "3", "--max-world-size", "2", check=False
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr + bad.stdout
    assert "min_world_size=3 max_world_size=2" in bad.stderr and bad.stderr.strip().count("\n") == 0, bad.stderr
    out = cluster.busctl("submit", str(path), "--elastic", "--min-world-size", "1", "--max-world-size", "2")
    return out.stdout.strip()


def test_an_elastic_gang_that_loses_a_trainer_resumes_on_the_one_left(tmp_path):
    cluster = JobCluster(tmp_path)
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.start_trainer("e1")
        cluster.start_trainer("e2")
        cluster.wait_connected(("e1", "e2"))
        digests = cluster.train_digests()
        job = _submit_elastic(cluster, tmp_path / "job.toml")
        info = cluster.wait(job, lambda i: i["state"] == "running", timeout=90)
        assert len(info["gang"]["members"]) == 2, info["events"]
        wait_trained(cluster, job, SPEC["checkpoint_every"] + 1, ranks=2)  # past the first checkpoint, each rank
        cluster.procs[info["gang"]["members"][1]].kill()  # SIGKILL: rank 0's next collective breaks
        info = cluster.wait_end(job, timeout=120)
        assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
        events = [e["reason"] for e in info["events"]]
        assert any("assigned to a gang of 2" in e for e in events), events
        assert any("elastic gang starts with 1 of up to 2" in e for e in events), events
        assert info["result"]["world_size"] == 1 and info["progress"]["resumed_from"]["step"] >= 1
        epochs = effective_epochs(cluster.audit, job)
        for epoch in range(2):
            assert epochs[epoch] == digests, f"epoch {epoch}: not every sample once"
    finally:
        cluster.close()


def _attempt(directory, name: str, rank: int, started: float, resumed: int, steps: range) -> None:
    lines = [{"job": "j", "trainer": name, "started": started, "resumed_from_step": resumed, "rank": rank}]
    lines += [{"epoch": 0, "step": s, "t": started + s / 100, "samples": [f"{name}{s}"]} for s in steps]
    (directory / f"j.{name}.1.{rank}.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_the_audit_replays_a_gang_resumed_at_another_world_size(tmp_path):
    _attempt(tmp_path, "a", 0, 10.0, 0, range(1, 5))  # a gang of 2 trained steps 1..4,
    _attempt(tmp_path, "b", 1, 10.001, 0, range(1, 5))  # its rank 1 alongside (never cut by rank 0)
    _attempt(tmp_path, "c", 0, 20.0, 2, range(3, 6))  # then one trainer resumed from step 2
    seen = effective_epochs(tmp_path, "j")[0]
    assert sorted(seen) == ["a1", "a2", "b1", "b2", "c3", "c4", "c5"]
