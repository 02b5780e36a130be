"""Several trainers on one job (``world_size: 2``), with real processes: a router, a provider that
serves trainers only the datasets of their jobs, and two `busctl start trainer` subprocesses that
train together through torch.distributed (gloo, CPU).

The trainers audit every batch they train on (services/trainer/attempt/audit.py): per epoch, rank 0 and
rank 1 must have read disjoint shards whose union is the train split. Rank 1 keeps its final
weights in its own checkpoint directory; they must equal rank 0's, which the job's result names.
Then a gang is paused, checkpointed, stopped and resumed (its final weights equal an uninterrupted
run's); a rank is killed with SIGKILL, and another sent SIGTERM, mid-job (a new gang resumes from
the checkpoint; every sample once per epoch). The router's gathering rules run on a real job
database without processes.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from services.trainer.attempt.audit import effective_epochs
from tests.support.jobs import SPEC, JobCluster, final_weights, rank_batches, wait_trained

GANG = {**SPEC, "epochs": 2, "world_size": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = JobCluster(tmp_path_factory.mktemp("gang"))
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.start_trainer("g1")
        cluster.start_trainer("g2")
        cluster.provider_endpoint = cluster.endpoint_of("provider")
        yield cluster
    finally:
        cluster.close()


def rank_epochs(cluster: JobCluster, job: str) -> dict[int, dict[int, Counter]]:
    """Per rank, per epoch, the digests that rank trained on (one attempt each)."""
    out: dict[int, dict[int, Counter]] = {}
    for path in cluster.audit.glob(f"{job}.*.jsonl"):
        head, *batches = [json.loads(line) for line in path.read_bytes().splitlines()]
        epochs = out.setdefault(head["rank"], {})
        for b in batches:
            epochs.setdefault(b["epoch"], Counter()).update(b["samples"])
    return out


def rank1_weights(cluster: JobCluster, job: str, timeout_s: float = 60.0) -> dict[str, torch.Tensor]:
    """Rank 1's final weights. Rank 1 writes them (atomically) after the last step while rank 0 pushes
    the job's result: the job's end does not wait for them, so they are awaited here (bounded)."""
    path = cluster.state / "checkpoints" / job / "rank-1" / "model.safetensors"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, (
            f"rank 1 wrote no final weights in {timeout_s:.0f} s; logs in {cluster.state}"
        )
        time.sleep(0.1)
    return load_file(path)


def submit(cluster: JobCluster, **changes) -> str:
    return cluster.submit(**{**GANG, **changes})


@pytest.fixture(scope="module")
def uninterrupted(cluster) -> dict:
    """:data:`GANG` trained to its end by the module's two trainers, untouched: the job the first test
    checks, and the run a paused, stopped and resumed gang must end equal to (one gang's run, not two)."""
    return cluster.wait_end(submit(cluster), timeout=120)


def test_two_trainers_train_one_job_on_disjoint_shards_and_report_once(cluster, uninterrupted, train_digests):
    info = uninterrupted
    job = info["id"]
    assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
    events = [e["reason"] for e in cluster.job(job)["events"]]
    assert any("assigned to a gang of 2" in e for e in events), events
    assert sum(e.startswith("finished on") for e in events) == 1, events  # one PushResult
    assert info["result"]["world_size"] == 2 and info["gang"]["rendezvous"].startswith("tcp://127.0.0.1:")
    rank0 = info["trainer"]
    assert info["gang"]["members"][0] == rank0 and sorted(info["gang"]["members"]) == ["g1", "g2"]

    ranks = rank_epochs(cluster, job)
    assert sorted(ranks) == [0, 1]
    for epoch in range(GANG["epochs"]):
        mine, theirs = ranks[0][epoch], ranks[1][epoch]
        assert not set(mine) & set(theirs), f"epoch {epoch}: ranks shared samples"
        assert sum(mine.values()) == sum(theirs.values()), "drop_uneven: both ranks train as many samples"
        assert mine + theirs == train_digests, f"epoch {epoch}: the shards do not cover the split"
    # DDP kept the replicas identical: rank 1's final weights are rank 0's
    ours, other = final_weights(info), rank1_weights(cluster, job)
    assert ours.keys() == other.keys()
    for name in ours:
        assert torch.equal(ours[name], other[name]), name
    # progress came from rank 0 and counts the gang's samples
    assert info["progress"]["samples"] == 2 * sum(ranks[0][e].total() for e in ranks[0])
    listed = cluster.busctl("jobs", env={"COLUMNS": "200"}).stdout
    assert f"{rank0} +1" in listed, listed


def test_gang_pauses_together_stops_and_resumes_exactly_from_its_checkpoint(cluster, uninterrupted, train_digests):
    ref = uninterrupted
    assert ref["state"] == "succeeded"

    job = submit(cluster)
    wait_trained(cluster, job, 3, GANG["world_size"])
    detail = cluster.control(job, "pause")
    assert detail["state"] == "paused"
    time.sleep(0.5)  # the other rank stops at the same step
    both = rank_batches(cluster, job)
    time.sleep(0.5)
    assert rank_batches(cluster, job) == both, "a rank kept training while the gang was paused"
    assert both[0] == both[1], "the ranks paused at different steps"
    ckpt = cluster.control(job, "checkpoint")["checkpoint"]
    assert ckpt["step"] == both[0]
    assert cluster.control(job, "stop")["state"] == "stopping"
    stopped = cluster.wait_end(job, timeout=60)
    assert stopped["state"] == "stopped"

    cluster.control(job, "resume")  # requeued; a new gang gathers and resumes from the checkpoint
    info = cluster.wait_end(job, timeout=120)
    assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
    assert info["progress"]["resumed_from"]["step"] == ckpt["step"]
    epochs = effective_epochs(cluster.audit, job)
    for epoch in range(GANG["epochs"]):
        assert epochs[epoch] == train_digests, f"epoch {epoch}: not every sample once"
    # the resumed gang ends where the uninterrupted one did
    ours, uninterrupted = final_weights(info), final_weights(ref)
    for name in ours:
        torch.testing.assert_close(ours[name], uninterrupted[name], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(ours[k], v) for k, v in rank1_weights(cluster, job).items())


def test_a_set_on_a_gang_reaches_every_rank_at_the_same_step(cluster):
    """``busctl job set lr=...`` is applied by rank 0 and sent to the other ranks at the same step:
    the ranks' weights stay identical (DDP averages the gradients; a rank still on the old lr would
    step differently), and the final model is not the one the old lr trains."""
    job = submit(cluster, epochs=3)  # first: it holds both trainers while the reference waits
    reference = submit(cluster, epochs=3)
    wait_trained(cluster, job, 2, GANG["world_size"])
    assert cluster.control(job, "pause")["state"] == "paused"
    assert cluster.control(job, "set", lr=GANG["lr"] * 10)["spec"]["lr"] == GANG["lr"] * 10
    assert cluster.control(job, "resume")["state"] == "running"
    info = cluster.wait_end(job, timeout=120)
    assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
    ours = final_weights(info)
    assert all(torch.equal(ours[k], v) for k, v in rank1_weights(cluster, job).items()), "the ranks diverged"
    ref = cluster.wait_end(reference, timeout=120)
    assert any(not torch.equal(ours[k], v) for k, v in final_weights(ref).items()), "the new lr changed nothing"


def test_a_rank_killed_mid_job_requeues_the_gang_which_resumes_from_its_checkpoint(cluster, train_digests):
    job = submit(cluster)
    # a batch past the first checkpoint on each rank, from the audit files: a report saying so may come
    # late enough that the gang has ended by the time the kill lands
    info = wait_trained(cluster, job, SPEC["checkpoint_every"] + 1, GANG["world_size"])
    rank1 = info["gang"]["members"][1]
    cluster.procs[rank1].kill()  # SIGKILL: rank 0's next collective breaks
    cluster.start_trainer("g3")  # a new member for the next gang
    info = cluster.wait_end(job, timeout=120)
    assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
    events = [e["reason"] for e in info["events"]]
    assert any("attempt failed" in e and "gang" in e for e in events), events
    assert sum("assigned to a gang of 2" in e for e in events) == 2, events
    assert info["progress"]["resumed_from"]["step"] >= 1
    epochs = effective_epochs(cluster.audit, job)
    for epoch in range(GANG["epochs"]):
        assert epochs[epoch] == train_digests, f"epoch {epoch}: not every sample once"


def test_sigterm_to_a_rank_hands_the_gang_back_without_losing_an_attempt(cluster, train_digests):
    job = submit(cluster)
    info = wait_trained(cluster, job, 3, GANG["world_size"])
    rank0, rank1 = info["gang"]["members"]
    cluster.procs[rank1].terminate()  # its trainer is stopping: the whole gang hands the job back
    assert cluster.procs[rank1].wait(30) == 0
    back = cluster.wait(job, lambda i: i["state"] == "queued", timeout=30)
    assert back["failures"] == 0 and back["checkpoint"]["step"] >= 3
    assert any(e["reason"].startswith(f"handed back by {rank0}") for e in back["events"]), back["events"]
    cluster.start_trainer("g4")
    info = cluster.wait_end(job, timeout=120)
    assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
    assert info["progress"]["resumed_from"]["step"] == back["checkpoint"]["step"]
    epochs = effective_epochs(cluster.audit, job)
    for epoch in range(GANG["epochs"]):
        assert epochs[epoch] == train_digests, f"epoch {epoch}: not every sample once"


def test_gathering_and_assignment_rules(tmp_path):
    """The router's side without processes: a real job database, the gang rules of services/router/gangs.py."""
    from libbus.errors import BadRequest
    from libbus.jobs.spec import JobSpec
    from libbus.wire.messages import NoTask, Task
    from services.router.gangs import Gangs
    from services.router.grants import assignments
    from services.router.store import JobStore

    for bad in (0, 257, "2", True):
        with pytest.raises(BadRequest, match="world_size"):
            JobSpec.from_dict({"dataset": "mnist", "world_size": bad})
    store = JobStore(str(tmp_path / "router.db"))
    gangs = Gangs(store, lease_s=10)
    job_id = store.submit(JobSpec.from_dict({"dataset": "mnist", "world_size": 2}))
    job = store.first_queued()
    assert isinstance(gangs.join("t1", job), NoTask) and store.get(job_id)["state"] == "queued"
    assert isinstance(gangs.task_for("t1"), NoTask)  # waits on its gang, takes nothing else
    gangs.tick(connected=set())  # t1 disconnected: it leaves the gathering
    assert gangs.task_for("t1") is None and not gangs.gathering
    assert isinstance(gangs.join("t2", job), NoTask)
    assert isinstance(gangs.join("t1", job), NoTask)  # completes the gang; rank 0 (t2) goes first
    row = store.get(job_id)
    assert (row["state"], row["trainer"], row["gang"]["members"]) == ("running", "t2", ["t2", "t1"])
    assert assignments(store.held(), {"t1": "sub-1", "t2": "sub-2"}) == {"mnist": ["sub-1", "sub-2"]}
    assert isinstance(gangs.task_for("t1"), NoTask)  # rank 1 waits for rank 0's rendezvous
    task = gangs.task_for("t2")
    assert isinstance(task, Task) and (task.rank, task.world_size, task.rendezvous) == (0, 2, "")
    with pytest.raises(BadRequest, match="tcp://HOST:PORT"):
        gangs.rendezvous(job_id, "ipc:///tmp/x")
    gangs.rendezvous(job_id, "tcp://10.0.0.5:29500")
    task = gangs.task_for("t1")
    assert isinstance(task, Task) and (task.rank, task.rendezvous) == (1, "tcp://10.0.0.5:29500")
    assert gangs.task_for("t1") is None  # delivered: asking again is asking for new work
    assert store.release(job_id, "lease lapsed", lost=True) == "queued"
    assert store.get(job_id)["gang"] is None and store.held() == []
    store.close()
