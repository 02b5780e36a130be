"""An entrypoint job on a gang of two trainers (real processes, gloo on CPU): every rank's function
starts with torch.distributed initialized and its own shard; commands apply on every rank at the
same call (a `set` reaches rank 1's job.params); a stopped gang resumes to the weights of an
uninterrupted run."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from tests.support.jobs import EntryCluster, final_weights

GANG = {
    "dataset": "mnist",
    "entrypoint": "tests.support.entrypoints:ddp",
    "params": {"lr": 0.05, "epochs": 2},
    "batch_size": 16,
    "seed": 5,
    "world_size": 2,
    "evaluate": False,
    "checkpoint_every": 5,
}


#: Each test waits for whole jobs on a cluster of processes, with its own timeouts and the cluster's
#: logs when one runs out: pytest's own limit (120 s) must not cut that short.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = EntryCluster(tmp_path_factory.mktemp("entry-gang"))
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.start_trainer("g1")
        cluster.start_trainer("g2")
        yield cluster
    finally:
        cluster.close()


def rank1_weights(cluster: EntryCluster, job: str) -> dict[str, torch.Tensor]:
    path = cluster.state / "checkpoints" / job / "rank-1" / "model.safetensors"
    deadline = time.monotonic() + 60
    while not path.exists():  # rank 1 writes it while rank 0 pushes the result
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    return load_file(path)


def test_a_gang_runs_the_function_on_every_rank_and_resumes_a_stop_exactly(cluster):
    ref = cluster.wait_end(cluster.submit_spec(GANG), timeout=180)
    assert ref["state"] == "succeeded", ref["error"]
    assert ref["result"]["world_size"] == 2
    ours, other = final_weights(ref), rank1_weights(cluster, ref["id"])
    for name in ours:  # DDP kept the replicas identical
        assert torch.equal(ours[name], other[name]), name

    job = cluster.submit_spec({**GANG, "params": {**GANG["params"], "sleep": 0.05}})
    cluster.wait(job, lambda i: (i.get("progress") or {}).get("step", 0) >= 8, timeout=120)
    # paused first: the report seen lags the gang, which may be near its end by now; paused, it waits
    # for the set and the resume, and only the stop has to land while it trains
    assert cluster.control(job, "pause")["state"] == "paused"
    assert cluster.control(job, "set", tag=7)["spec"]["params"]["tag"] == 7
    cluster.control(job, "resume")
    cluster.control(job, "stop")
    stopped = cluster.wait_end(job, timeout=90)
    assert stopped["state"] == "stopped", stopped["error"]
    cluster.control(job, "resume")
    info = cluster.wait_end(job, timeout=180)
    assert info["state"] == "succeeded", info["error"]
    ours, theirs = final_weights(info), final_weights(ref)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # rank 1 took rank 0's params at the same call: its epoch line says the tag the set gave
    rank1 = (cluster.state / "g1.log").read_text() + (cluster.state / "g2.log").read_text()
    assert "rank 1 of 2: epoch 1 tag 7" in rank1, rank1[-3000:]
