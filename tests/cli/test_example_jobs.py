"""examples/jobs/ as jobs (the job recipes): PyTorch's MNIST example, a custom-loss function and a
Lightning ``Trainer``, each written on the job API, submitted to a real cluster, its trainer killed
with SIGKILL right after the attempt's first checkpoint (mid-epoch; at the first epoch's end for Lightning), and
resumed to the end by the trainer restarted under its name, as systemd restarts it (the router gives the job back at
once, not after the 20 s lease; a lapsed lease and another trainer: tests/system/test_jobs_durable.py)."""

from __future__ import annotations

import signal

import pytest

from tests.support.jobs import EntryCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = EntryCluster(tmp_path_factory.mktemp("example-jobs"))
    cluster.env.update(BATCHBUS_JOB_MODULES="examples.jobs.", BATCHBUS_ATTEMPT_SILENCE_S="120")
    try:
        cluster.start_router()
        cluster.start_provider()
        yield cluster
    finally:
        cluster.close()


@pytest.mark.parametrize(
    ("entrypoint", "params", "batch", "every", "resumed"),
    [
        ("examples.jobs.mnist:train", {"epochs": 1, "lr": 1.0}, 32, 5, "Train Epoch: 0 [192/320]"),
        ("examples.jobs.custom_loss:train", {"epochs": 1}, 32, 5, "attempt 1 starts at epoch 0, sample 160"),
        ("examples.jobs.lightning:train", {"epochs": 2}, 64, 0, "attempt 1: Lightning fit from epoch 1"),
    ],
)
def test_a_recipe_job_killed_after_its_first_checkpoint_resumes_to_the_end(
    cluster, entrypoint, params, batch, every, resumed
):
    spec = {
        "dataset": "mnist",
        "entrypoint": entrypoint,
        "params": params,
        "batch_size": batch,
        "checkpoint_every": every,
        "train_range": [0, 320],  # 10 steps of 32 an epoch: the recipes as written, on less data
        "evaluate": False,
        "max_attempts": 3,
    }
    job = cluster.submit_spec(spec)
    name = entrypoint.split(".")[2].split(":")[0]
    proc = cluster.start_killed_at(name, "entry_checkpoint")
    assert proc.wait(240) == -signal.SIGKILL, cluster.logs()
    cluster.start_trainer(name)  # restarted under its name: the job is given back at once
    try:
        info = cluster.wait_end(job, timeout=240)
    finally:
        cluster.procs[name].send_signal(signal.SIGTERM)
        cluster.procs[name].wait(30)
    assert info["state"] == "succeeded", info["error"]
    assert [r["epoch"] for r in info["result"]["history"]] == list(range(1, params["epochs"] + 1))
    assert all(0 <= r["val_accuracy"] <= 1 for r in info["result"]["history"])
    logs = cluster.busctl("job", "logs", job).stdout
    assert resumed in logs, logs
    assert info["result"]["model"]["bytes"] > 0
